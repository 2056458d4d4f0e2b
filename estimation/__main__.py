"""python -m estimation --job.config_file X.toml --estimate.ngpu 8 --estimate.hardware b200 [--section.key v ...]

Prints the memory / batch / throughput table and writes the JSON report (estimate.output, default
<job.dump_folder>/estimate.json). Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import logging
import os
import warnings

from titanlite.config import load_config, run_cli


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warnings.filterwarnings("ignore")  # fake-tensor and FSDP notices say nothing about the estimate
    cfg = load_config(argv)
    from estimation.estimate import estimate, format_report, write_report

    report = estimate(cfg)
    print(format_report(report))
    path = write_report(report, cfg.estimate.output or os.path.join(cfg.job.dump_folder, "estimate.json"))
    print(f"report: {path} ({report['elapsed_s']} s)")


if __name__ == "__main__":
    run_cli(main)
