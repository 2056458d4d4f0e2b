"""Plot runs: python -m titanlite.tools.plot RUN_OR_DIR... --out DIR

Writes, with all runs overlaid (legend = config label and file name):
  loss.png, tokens_per_sec.png, mfu.png (runs with a known peak only), memory.png (peak GiB),
  overview.png (the four as one 2x2 figure), and per run with a timing breakdown
  breakdown_<run>.png: per-rank stacked bars of data / compute / comm / optimizer / idle (ms per
  step, mean over the steady log entries: titanlite.metrics.run_log.steady) against the measured step time.
"""

from __future__ import annotations

import argparse
import os
import sys

from titanlite.errors import ConfigError, require, to_pipe
from titanlite.metrics.run_log import LoggedRun, RunLogError, load_all, mean

# (file stem, run-log key, y label)
SERIES = [("loss", "loss", "training loss"), ("tokens_per_sec", "tokens_per_sec", "tokens / s (all GPUs)"),
          ("mfu", "mfu", "MFU (%)"), ("memory", "memory_peak_gb", "peak memory (GiB)")]
PHASES = ("data", "compute", "comm", "optimizer", "idle")


def _series(run: LoggedRun, key: str):
    pts = [(e["iter"], e[key]) for e in run.iterations if e.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _draw(ax, runs: list[LoggedRun], key: str, ylabel: str) -> bool:
    drawn = False
    for run in runs:
        x, y = _series(run, key)
        if x:
            ax.plot(x, y, marker="." if len(x) < 50 else None, label=f"{run.label} ({run.path.stem})")
            drawn = True
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)
    return drawn


def plot_breakdown(run: LoggedRun, warmup: int | None, path: str, plt) -> bool:
    steady = [e for e in run.steady(warmup).entries if e.get("breakdown")]
    if not steady:
        return False
    ranks = sorted({r["rank"] for e in steady for r in e["breakdown"]["ranks"]})
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(ranks) + 2), 4))
    bottom = [0.0] * len(ranks)
    for phase in PHASES:
        vals = [mean(r.get(f"{phase}_ms") for e in steady for r in e["breakdown"]["ranks"] if r["rank"] == k) or 0.0
                for k in ranks]
        ax.bar([str(k) for k in ranks], vals, bottom=bottom, label=f"{phase}_ms")
        bottom = [b + v for b, v in zip(bottom, vals)]
    steps = [mean(r["step_ms"] for e in steady for r in e["breakdown"]["ranks"] if r["rank"] == k) for k in ranks]
    ax.scatter([str(k) for k in ranks], steps, color="black", marker="_", s=400, zorder=3, label="step_ms")
    ax.set_xlabel("rank")
    ax.set_ylabel("ms per optimizer step")
    ax.set_title(f"{run.label}: {steady[0]['breakdown']['method']}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_plots(runs: list[LoggedRun], out: str, warmup: int | None = None) -> list[str]:
    matplotlib = require("matplotlib", "python -m titanlite.tools.plot")
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    written = []
    for stem, key, ylabel in SERIES:
        fig, ax = plt.subplots(figsize=(7, 4))
        if _draw(ax, runs, key, ylabel):
            fig.tight_layout()
            fig.savefig(os.path.join(out, f"{stem}.png"), dpi=120)
            written.append(os.path.join(out, f"{stem}.png"))
        plt.close(fig)
    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    for ax, (_, key, ylabel) in zip(axes.flat, SERIES):
        _draw(ax, runs, key, ylabel)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "overview.png"), dpi=120)
    plt.close(fig)
    written.append(os.path.join(out, "overview.png"))
    for run in runs:
        path = os.path.join(out, f"breakdown_{run.path.stem}.png")
        if plot_breakdown(run, warmup, path, plt):
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titanlite.tools.plot", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run_*.json files or folders holding them")
    ap.add_argument("--out", required=True, help="folder for the PNG files (created)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="steps up to this one are left out of the breakdown means (default: the run log's "
                         "steady-state rule)")
    args = ap.parse_args(argv)
    try:
        require("matplotlib", "python -m titanlite.tools.plot")  # before any run log is read
        runs = load_all(args.runs)
        written = write_plots(runs, args.out, args.warmup)
    except (ConfigError, RunLogError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: --out {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(to_pipe(main))
