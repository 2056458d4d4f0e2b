"""Compare runs in the seed guides' table: python -m titanlite.tools.compare RUN_OR_DIR... [--warmup N] [--csv FILE]

Columns: Config (what the run ran, from its resolved configuration: model, dataset and path,
data-parallel mode, world size, compile / CUDA graphs; titanlite.metrics.run_log.ran), GPUs, BS
(local batch), GA (accumulation), MFU (%) and Tokens/s (all GPUs) by the run log's throughput rule
(the steady entries' mean, as the Trainer's summary and diagnose report them:
titanlite.metrics.run_log.THROUGHPUT_RULE), Peak GB (max over the run), Loss (last), Run (file
name). --warmup N counts steps up to N as warm-up instead of the steady-state rule's cutoff.
"""

from __future__ import annotations

import argparse
import csv
import sys

from titanlite.errors import to_pipe
from titanlite.metrics.run_log import LoggedRun, RunLogError, load_all, throughput

COLUMNS = ("Config", "GPUs", "BS", "GA", "MFU", "Tokens/s", "Peak GB", "Loss", "Run")


def row(run: LoggedRun, warmup: int | None) -> dict:
    cfg, rates = run.config, throughput(run.steady(warmup).entries)
    return {"Config": run.label, "GPUs": cfg.get("world_size"), "BS": cfg.get("batch_size"),
            "GA": cfg.get("gradient_accumulation_steps"), "MFU": rates["mfu_pct"], "Tokens/s": rates["tokens_per_sec"],
            "Peak GB": max((e.get("memory_peak_gb") or 0.0) for e in run.iterations),
            "Loss": run.iterations[-1].get("loss"), "Run": run.path.name}


def format_table(rows: list[dict]) -> str:
    def cell(col, v):
        if v is None:
            return "-"
        spec = {"MFU": "{:.2f}%", "Tokens/s": "{:,.0f}", "Peak GB": "{:.2f}", "Loss": "{:.4f}"}.get(col, "{}")
        return spec.format(v)

    cells = [[cell(c, r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(COLUMNS)]
    fmt = lambda vals: "  ".join(v.ljust(w) if i in (0, len(COLUMNS) - 1) else v.rjust(w)
                                 for i, (v, w) in enumerate(zip(vals, widths)))
    lines = [fmt(COLUMNS), "-" * (sum(widths) + 2 * (len(COLUMNS) - 1))]
    return "\n".join(lines + [fmt(line) for line in cells])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titanlite.tools.compare", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run_*.json files or folders holding them")
    ap.add_argument("--warmup", type=int, default=None,
                    help="steps up to this one are warm-up (default: the run log's steady-state rule; "
                         "the seed guides' snippets skip a fixed count)")
    ap.add_argument("--csv", help="also write the table as CSV to this file")
    args = ap.parse_args(argv)
    try:
        rows = [row(r, args.warmup) for r in load_all(args.runs)]
    except RunLogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(rows))
    if args.csv:
        try:
            with open(args.csv, "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=COLUMNS)
                w.writeheader()
                w.writerows(rows)
        except OSError as e:
            print(f"error: --csv {args.csv}: {e.strerror}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(to_pipe(main))
