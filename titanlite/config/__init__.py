from titanlite.config.job_config import JobConfig
from titanlite.config.manager import ConfigError, load_config, resolve_batch, run_cli, to_dict, to_toml

__all__ = ["JobConfig", "ConfigError", "load_config", "resolve_batch", "run_cli", "to_dict", "to_toml"]
