"""The error every layer raises for bad user input (a setting, a path, a combination), and for an
optional package a command needs and this interpreter lacks.

It sits below every package so that parallel/, data/ and checkpoint/ can name a bad setting without
importing the config parser; `titanlite.config.run_cli` turns it into one line and exit code 2.
"""

from __future__ import annotations

import importlib

# The optional packages, by module: (pip package, the extra of pyproject.toml's
# [project.optional-dependencies] that installs it). A test holds this table to pyproject.toml.
OPTIONAL = {"matplotlib": ("matplotlib", "plot"), "pyarrow": ("pyarrow", "parquet"), "wandb": ("wandb", "wandb")}


class ConfigError(ValueError):
    """Bad configuration input. The message is one line and names the key or file."""


def missing_package(module: str, needed_by: str) -> str:
    """The line saying that `needed_by` needs `module`'s package, which is not installed, and how to get it."""
    package, extra = OPTIONAL.get(module.split(".")[0], (module.split(".")[0], ""))
    how = f"pip install -e '.[{extra}]' in the titanlite checkout, or pip install {package}" if extra else \
        f"pip install {package}"
    return f"{needed_by} needs {package}, which is not installed ({how})"


def require(module: str, needed_by: str):
    """Import `module` (e.g. "matplotlib.pyplot"), or raise ConfigError: `needed_by` needs its package."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != module.split(".")[0]:
            raise  # the package is there, and broken: its own error says more
        raise ConfigError(missing_package(module, needed_by)) from None
