from titanlite.config.job_config import JobConfig
from titanlite.config.manager import ConfigError, load_config, resolve_batch, run_cli, to_dict, to_toml
from titanlite.config.settings import data_parallel_mode, parallel_settings, run_mode

__all__ = ["JobConfig", "ConfigError", "data_parallel_mode", "load_config", "parallel_settings", "resolve_batch",
           "run_cli", "run_mode", "to_dict", "to_toml"]
