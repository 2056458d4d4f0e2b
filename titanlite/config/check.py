"""Validate a command line without importing torch: `python -m titanlite.config.check --world-size N ARGS`.

run_train.sh calls this before torchrun so a typo costs a second, not a cluster start-up,
and every error is one line with exit code 2.
"""

import sys

from titanlite.config.manager import ConfigError, load_config, resolve_batch, run_cli


def main(argv: list[str]) -> None:
    world = 1
    if argv[:1] == ["--world-size"]:
        if len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
            raise ConfigError("--world-size expects a positive integer")
        world, argv = int(argv[1]), argv[2:]
    cfg = load_config(argv, world)
    resolve_batch(cfg, world)


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
