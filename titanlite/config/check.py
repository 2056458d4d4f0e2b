"""Validate a command line before any rank starts: `python -m titanlite.config.check --world-size N ARGS`.

titanlite.launch (what run_train.sh runs) calls `check` before torchrun so a typo costs a second, not
a cluster start-up, and every error is one line with exit code 2. Besides what `load_config` checks, it asks this
node's GPUs (through nvidia-smi, not torch) about what needs a GPU, so a combination that cannot run
here is refused before torchrun starts its ranks.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

from titanlite.config.manager import ConfigError, check_bf16_transport, load_config, resolve_batch, run_cli
from titanlite.errors import missing_package
from titanlite.hardware import FLOAT8_CAPABILITY, float8_refusal
from titanlite.parallel.launcher_env import Launch


def gpus() -> list[tuple[str, tuple[int, int]]] | None:
    """This node's NVIDIA GPUs as nvidia-smi names them, with their compute capabilities: [] on a
    machine without nvidia-smi or without GPUs, None when nvidia-smi cannot tell (an older driver)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        r = subprocess.run([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if "No devices were found" in r.stdout + r.stderr:
        return []
    found = []
    try:
        for line in filter(str.strip, r.stdout.splitlines()):
            name, _, capability = line.rpartition(",")
            found.append((name.strip(), tuple(int(x) for x in capability.strip().split("."))))
    except ValueError:
        return None
    return found


def check_launch(cfg, capabilities: list[tuple[int, int]] | None) -> None:
    """Refuse what would otherwise fail only inside the ranks: settings that GPUs of these compute
    capabilities ([]: none; None: unknown) cannot run, an activation-checkpoint option that is no
    option, a logger whose package is not installed."""
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and not (ac.selective_option == "op" or (ac.selective_option.isdigit()
                                                                       and int(ac.selective_option) >= 1)):
        raise ConfigError(f"activation_checkpoint.selective_option must be 'op' or a positive integer N; "
                          f"got '{ac.selective_option}'")
    for enabled, package in ((cfg.metrics.enable_tensorboard, "tensorboard"), (cfg.metrics.enable_wandb, "wandb")):
        if enabled and importlib.util.find_spec(package) is None:
            raise ConfigError(missing_package(package, f"metrics.enable_{package}"))
    if capabilities is None:
        return
    if cfg.float8.enable and not cfg.float8.emulate:
        lacking = [c for c in capabilities if c < FLOAT8_CAPABILITY]
        if not capabilities or lacking:
            raise ConfigError(float8_refusal("CPU" if not capabilities else
                                             f"compute capability {lacking[0][0]}.{lacking[0][1]}"))
    if cfg.parallelism.fsdp_copy_engine_all_gather == "on" and not capabilities:
        raise ConfigError("parallelism.fsdp_copy_engine_all_gather=on needs CUDA GPUs and NCCL; this machine has no GPU")
    if not capabilities:
        check_bf16_transport(cfg, "cpu")


def check(argv: list[str], world: int) -> tuple:
    """The configuration of `argv` for `world` ranks, checked against this node's GPUs; returns it
    with the GPUs (`gpus()`)."""
    cfg = load_config(argv, Launch(world_size=world))  # before torchrun: no launcher has said more yet
    resolve_batch(cfg, world)
    found = gpus()
    check_launch(cfg, None if found is None else [capability for _, capability in found])
    return cfg, found


def world_size(argv: list[str]) -> tuple[int, list[str]]:
    """A leading `--world-size N` (default 1) and the arguments after it."""
    if argv[:1] != ["--world-size"]:
        return 1, argv
    if len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
        raise ConfigError("--world-size expects a positive integer")
    return int(argv[1]), argv[2:]


def main(argv: list[str]) -> None:
    world, argv = world_size(argv)
    check(argv, world)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
