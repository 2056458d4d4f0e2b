"""The error every layer raises for bad user input (a setting, a path, a combination), the line for an
optional package a command needs and this interpreter lacks, and how a known failure is said: in one
line for the job.

It sits below every package so that parallel/, data/ and checkpoint/ can name a bad setting without
importing the config parser; `titanlite.config.run_cli` turns it into one line and exit code 2.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

# The optional packages, by module: (pip package, the extra of pyproject.toml's
# [project.optional-dependencies] that installs it). A test holds this table to pyproject.toml.
OPTIONAL = {"matplotlib": ("matplotlib", "plot"), "pyarrow": ("pyarrow", "parquet"), "wandb": ("wandb", "wandb"),
            "datasets": ("datasets", "hf")}

# A run's exit codes besides 0 (the README's table; 130 + Ctrl-C and 128 + N for a signal are the shell's)
FAILURE_EXIT = 1        # a failure shown with its traceback, a checkpoint that could not be saved, stdout's reader gone
BAD_INPUT_EXIT = 2      # bad input, or a run the memory check predicts cannot fit
NON_FINITE_EXIT = 3     # a non-finite loss with training.on_nan=stop
OUT_OF_MEMORY_EXIT = 4  # out of memory


class ConfigError(ValueError):
    """Bad configuration input. The message is one line and names the key or file."""


def to_pipe(main, *args):
    """`main(*args)`'s exit code, its output flushed; where stdout's reader has gone (`| head`), the
    command ends quietly as a shell tool does, exit 1, instead of a BrokenPipeError traceback."""
    try:
        code = main(*args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # the interpreter flushes stdout again at exit: point it at nothing so that flush cannot fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return FAILURE_EXIT


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


def say_failure(line: str, exit_code: int, launch=None, same_on_every_rank: bool = False) -> None:
    """Say why this process stops, in one line (`line` starts with "error: "), before it exits with
    `exit_code`.

    Under torchrun the line goes into this rank's error file (TORCHELASTIC_ERROR_FILE, torchrun's own
    channel for a worker's failure): `titanlite.launch` prints the first failing rank's line once for
    the job and exits with its code, where torchrun would print one report per job (exit code 1) and
    every rank its own line; a torchrun started by hand shows the line in its report. A process on
    its own prints it, every rank of a process group started another way its own, or only rank 0 when
    `same_on_every_rank`. `launch`: the process's titanlite.parallel.launcher_env.Launch (its rank and torchrun's
    error file, read where the process started); None: a process on its own."""
    error_file = launch.error_file if launch is not None else None
    if error_file:
        # torchrun's format (a message, when it happened: the first failure is the job's cause), and the
        # exit code, which torchrun sees as a signal's where it stops this rank before it exits itself
        with open(error_file, "w") as fh:
            json.dump({"message": line, "timestamp": time.time(), "exit_code": exit_code}, fh)
    elif not same_on_every_rank or launch is None or launch.rank == 0:
        print(line, file=sys.stderr, flush=True)
