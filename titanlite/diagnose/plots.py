"""The report's figures (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from titanlite.diagnose.runs import PHASES, Run, median

COLORS = {"data": "#e69f00", "compute": "#0072b2", "comm": "#cc79a7", "optimizer": "#009e73", "idle": "#999999"}
LABELS = {"data": "data wait", "compute": "compute", "comm": "exposed comm", "optimizer": "optimizer",
          "idle": "idle / host"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _stack(ax, x, values: dict[str, float | None], width=0.6):
    bottom = 0.0
    for p in PHASES:
        v = values.get(p)
        if v:
            ax.bar(x, v, width, bottom=bottom, color=COLORS[p])
            bottom += v
    return bottom


def _legend(fig, runs: list[Run]):
    from matplotlib.patches import Patch

    handles = [Patch(color=COLORS[p], label=LABELS[p]) for p in PHASES]
    if not all(r.has_breakdown for r in runs):
        handles.append(Patch(color="#dddddd", hatch="//", label="step (no breakdown)"))
    fig.legend(handles=handles, loc="lower center", ncol=3, frameon=False, fontsize=9)


def phases_png(runs: list[Run], effs: dict[str, float | None], path: Path) -> None:
    """Stacked ms per optimizer step for each run (median over ranks), step time and efficiency on top."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(runs) + 2), 5.2))
    top = 0.0
    for i, r in enumerate(runs):
        if r.has_breakdown:
            height = _stack(ax, i, {p: r.phase_over_ranks(p, how=median) for p in PHASES})
        else:
            height = ax.bar(i, r.step_ms, 0.6, color="#dddddd", hatch="//")[0].get_height()
        eff = effs.get(r.label)
        note = f"step {_ms(r.step_ms)}" + (f"\nefficiency {eff:.0%}" if eff is not None else "")
        ax.text(i, max(height, r.step_ms) * 1.02, note, ha="center", va="bottom", fontsize=9)
        top = max(top, height, r.step_ms)
    ax.set_xticks(range(len(runs)), [f"{r.label}\n{r.accum} micro-step{'s' if r.accum > 1 else ''}"
                                     + (f" (printed {r.accum_printed})" if r.accum != r.accum_printed else "")
                                     for r in runs])
    ax.set_ylim(0, top * 1.25)
    ax.set_ylabel("ms per optimizer step (median rank)")
    ax.set_title("Where each step's time goes, per world size")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    _legend(fig, runs)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ranks_png(runs: list[Run], path: Path) -> None:
    """One panel per run: each rank's phases, so one slow rank (and the others' waits) stand out."""
    plt = _plt()
    n = len(runs)
    fig, axes = plt.subplots(1, n, figsize=(max(6.5, 3.2 * n), 5.0), squeeze=False)
    for ax, r in zip(axes[0], runs):
        ranks = sorted(r.rank_phases)
        if not ranks:
            ax.bar(0, r.step_ms, 0.6, color="#dddddd", hatch="//")
            ax.set_xticks([0], ["all ranks"])
            ax.text(0, r.step_ms, "no per-rank\nbreakdown", ha="center", va="bottom", fontsize=9)
        else:
            for k in ranks:
                _stack(ax, k, {p: r.phase(p, k) for p in PHASES}, width=0.7)
            ax.set_xticks(ranks, [str(k) for k in ranks])
            ax.set_xlabel("rank")
        ax.set_ylim(0, max([r.step_ms] + [sum(r.phase(p, k) or 0 for p in PHASES) for k in ranks]) * 1.2)
        ax.set_title(f"{r.label} (step {_ms(r.step_ms)})", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0][0].set_ylabel("ms per optimizer step")
    fig.suptitle("Per-rank spread", fontsize=11)
    _legend(fig, runs)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ms(v: float) -> str:
    return f"{v:,.0f} ms" if v >= 100 else f"{v:.1f} ms"
