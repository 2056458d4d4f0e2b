"""Print the per-rank timing breakdown of a run log as a table: python benchmarks/breakdown_table.py RUN_OR_DIR [--warmup N]

For each steady log entry and rank: step, data, compute, comm, optimizer, idle (ms per optimizer
step) and `covered` = (data + compute + comm + optimizer) / step, the share of the step that the
measured phases explain (idle is the remainder, so the parts always add up to the step exactly).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from titanlite.tools.runs import RunLogError, load_all

FIELDS = ("step_ms", "data_ms", "compute_ms", "comm_ms", "optimizer_ms", "idle_ms")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    try:
        runs = load_all(args.runs)
    except RunLogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for run in runs:
        print(f"== {run.path} ({run.label}, {run.config.get('world_size')} ranks)")
        print(f"{'iter':>6} {'rank':>4} " + " ".join(f"{f[:-3]:>10}" for f in FIELDS) + f" {'sum/step':>9} {'covered':>8} slowest")
        worst = 0.0
        for e in run.steady(args.warmup):
            b = e.get("breakdown")
            if not b:
                continue
            for r in b["ranks"]:
                parts = sum((r[f] or 0.0) for f in FIELDS[1:])
                covered = (parts - r["idle_ms"]) / r["step_ms"]
                worst = max(worst, abs(parts / r["step_ms"] - 1))
                cells = " ".join(f"{r[f]:>10.2f}" if r[f] is not None else f"{'null':>10}" for f in FIELDS)
                print(f"{e['iter']:>6} {r['rank']:>4} {cells} {parts / r['step_ms']:>9.4f} {covered:>8.1%} "
                      f"{b['slowest_rank'] if r['rank'] == 0 else ''}")
        print(f"largest |sum/step - 1| = {worst:.2e}   method = {b['method'] if b else '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
