"""Print the per-rank timing breakdown of run logs as a table: python -m titanlite.tools.breakdown RUN_OR_DIR... [--warmup N]

For each steady log entry and rank: step, data, compute, comm, optimizer, idle (ms per optimizer
step) and `covered` = (data + compute + comm + optimizer) / step, the share of the step that the
measured phases explain (idle is the remainder, so the parts add up to the step exactly; the last
line reports the largest deviation of that sum, a check of the logger).
"""

from __future__ import annotations

import argparse
import sys

from titanlite.metrics.run_log import LoggedRun, RunLogError, load_all

FIELDS = ("step_ms", "data_ms", "compute_ms", "comm_ms", "optimizer_ms", "idle_ms")


def table(run: LoggedRun, warmup: int | None = None) -> list[str]:
    """The lines printed for one run."""
    lines = [f"== {run.path} ({run.label})",
             f"{'iter':>6} {'rank':>4} " + " ".join(f"{f[:-3]:>10}" for f in FIELDS)
             + f" {'sum/step':>9} {'covered':>8} slowest"]
    worst, method = 0.0, None
    for e in run.steady(warmup).entries:
        b = e.get("breakdown")
        if not isinstance(b, dict) or not isinstance(b.get("ranks"), list):
            continue
        method = b.get("method", method)
        for r in b["ranks"]:
            parts = sum((r.get(f) or 0.0) for f in FIELDS[1:])
            step = r.get("step_ms") or float("nan")
            covered = (parts - (r.get("idle_ms") or 0.0)) / step
            worst = max(worst, abs(parts / step - 1))
            cells = " ".join(f"{r[f]:>10.2f}" if r.get(f) is not None else f"{'null':>10}" for f in FIELDS)
            lines.append(f"{e['iter']:>6} {r['rank']:>4} {cells} {parts / step:>9.4f} {covered:>8.1%} "
                         f"{b.get('slowest_rank', '') if r['rank'] == 0 else ''}")
    if method is None:
        lines.append("no per-rank breakdown in this log")
    else:
        lines.append(f"largest |sum/step - 1| = {worst:.2e}   method = {method}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titanlite.tools.breakdown", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run_*.json files or folders holding them")
    ap.add_argument("--warmup", type=int, default=None,
                    help="steps up to this one are left out (default: the run log's steady-state rule)")
    args = ap.parse_args(argv)
    try:
        runs = load_all(args.runs)
    except RunLogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for run in runs:
        print("\n".join(table(run, args.warmup)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
