"""Per-step losses with CUDA graphs against the same run never captured: 1 GPU, and ddp on 2 GPUs.

  python benchmarks/cuda_graphs_losses.py [--ngpus 1|2] [--noise] [--flavor debug]

Both runs use the capturable AdamW (the lr and step counters on the device): the graph run captures
the step after 5 eager steps (11 under ddp), the reference sets the capture past the last step, so
any difference from the capture on is the replay's. The reference is not plain eager because the
capturable AdamW rounds differently from the fused default from step 2 on, which would hide what
replay changes. --noise repeats the reference: how far two identical runs drift apart by
themselves, the yardstick for the graph's difference. LLaMA 1.36B at torchtitan's shapes, 20 steps.
Writes cuda_graphs_losses.md and .json to --out.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402  (benchmarks/launch.py: the one launcher)

STEPS = 20
GRAPHS = ["--training.cuda_graphs", "--training.cuda_graphs_warmup", "5"]
NEVER_CAPTURED = ["--training.cuda_graphs", "--training.cuda_graphs_warmup", "1000"]
SETUPS = {1: [], 2: ["--parallelism.data_parallel", "ddp"]}  # world size -> its data-parallel options


def compare(reference: launch.Result, other: launch.Result) -> list[str]:
    """Markdown lines: per-step losses of both and their relative difference, then the largest."""
    a, b = launch.step_losses(reference.entries), launch.step_losses(other.entries)
    lines = [f"### {other.name} against {reference.name} ({other.ngpus} GPU)", ""]
    if reference.error or other.error or not a or sorted(a) != sorted(b):
        return lines + [f"not comparable: {reference.name} {reference.error or f'{len(a)} steps'}, "
                        f"{other.name} {other.error or f'{len(b)} steps'}", ""]
    lines += ["| step | reference | other | relative difference |", "|---|---|---|---|"]
    lines += [f"| {s} | {a[s]:.6f} | {b[s]:.6f} | {abs(a[s] - b[s]) / abs(a[s]):.2e} |" for s in sorted(a)]
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
    captured = any("captured the training step" in ln for ln in other.output.splitlines())
    return lines + ["", f"largest relative difference {worst:.2e}" + (f"; graph captured: {captured}"
                                                                       if "graphs" in other.name else ""), ""]


def main(argv: list[str] | None = None) -> None:
    ap = launch.Parser(__doc__)
    ap.add_argument("--ngpus", type=int, choices=sorted(SETUPS), default=0, help="only this comparison (default: both)")
    ap.add_argument("--noise", action="store_true", help="also repeat the reference run")
    ap.add_argument("--flavor", default="1.36B", help="LLaMA flavor (debug: a quick functional check)")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/cuda_graphs_losses"))
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    base = [*launch.PEER_SHAPES, "--model.flavor", a.flavor]
    sections, results = [], []
    for n, setup in SETUPS.items():
        if a.ngpus and n != a.ngpus:
            continue
        tag = "" if n == 1 else "ddp_"
        run = lambda name, opts: launch.titanlite(f"{tag}{name}", setup + opts, n, STEPS, 1, a.timeout, base=base)
        ref, graph = run("never_captured", NEVER_CAPTURED), run("cuda_graphs", GRAPHS)
        results += [ref, graph]
        sections += compare(ref, graph)
        if a.noise:
            again = run("never_captured_again", NEVER_CAPTURED)
            results.append(again)
            sections += compare(ref, again)
    text = f"LLaMA {a.flavor}, local batch 4 x seq 2048, synthetic tokens, {STEPS} steps\n\n" + "\n".join(sections)
    print("\n" + text)
    launch.save(Path(a.out), "cuda_graphs_losses", text, results)


if __name__ == "__main__":
    main()
