"""python -m estimation --job.config_file X.toml --estimate.ngpu 8 --estimate.hardware b200 [--section.key v ...]

Prints the memory / batch / throughput table and writes the JSON report (estimate.output, default
<job.dump_folder>/estimate.json). Exit codes: 0 the configured run fits; 1 it does not fit (the
report says so first and holds no throughput); 2 bad input, or a combination the trainer refuses at
estimate.ngpu ranks (one line on stderr, the trainer's).
With --estimate.recommend: the best configurations for the target global batch (estimation.recommend).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from estimation import EstimateWarning
from titanlite.config import load_config, run_cli


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warnings.filterwarnings("ignore")  # fake-tensor and FSDP notices say nothing about the estimate
    warnings.filterwarnings("default", category=EstimateWarning)  # the estimate's own fallbacks do
    cfg = load_config(argv)
    from estimation.estimate import estimate, format_report, write_report

    if cfg.estimate.recommend:  # checks each candidate it weighs the same way
        from estimation.recommend import main as recommend

        recommend(cfg)
        return
    report = estimate(cfg)
    print(format_report(report))
    path = write_report(report, cfg.estimate.output or os.path.join(cfg.job.dump_folder, "estimate.json"))
    print(f"report: {path} ({report['elapsed_s']} s)")
    if not report["memory"]["fits"]:
        sys.exit(1)  # the configured run cannot start: a result, not a usage error (exit 2)


if __name__ == "__main__":
    run_cli(main)
