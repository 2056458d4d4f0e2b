"""Checkpoint cost and resume check on GPUs, LLaMA 1.36B (about 5 minutes on one H100/H200).

    python benchmarks/checkpoint_gpu.py [--ngpu N] [--folder /tmp/titanlite_ckbench] [--local-batch 4]

1. How long training is blocked by one save in each checkpoint.async_mode (disabled / async /
   async_with_pinned_mem), and the step time while an async write runs in the background.
2. Resume: a run saving at step 5 is resumed from it; the first 5 steps after the resume must give
   the uninterrupted run's losses. A second uninterrupted run shows how far two identical GPU runs
   drift apart by themselves (nondeterministic kernels), the yardstick for "equal" here.
Each run is the real `python -m titanlite.train` (torchrun over several GPUs) through
benchmarks/launch.py, on synthetic data (no tokenizer, no torchdata needed). A checkpoint of 1.36B with AdamW state is about 15.5 GB; keep_latest_k bounds the
disk use to two of them. Prints a table; exit code 1 if the resume check fails.
"""

from __future__ import annotations

import re
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402  (benchmarks/launch.py: the one launcher)


def train(root: Path, name: str, ngpu: int, local_batch: int, steps: int, *extra: str,
          must: bool = True) -> tuple[str, list[dict] | None]:
    """One training run in ROOT/NAME (checkpoints there too); a failure stops the benchmark if `must`,
    else returns (output, None)."""
    base = [*launch.PEER_SHAPES, "--training.local_batch_size", str(local_batch), "--lr_scheduler.warmup_steps", "2",
            "--parallelism.data_parallel", "fsdp", "--checkpoint.enable"]
    r = launch.titanlite(name, list(extra), ngpu, steps, 1, 900, work=root, base=base)
    if r.error:
        msg = f"run failed ({' '.join(extra)}): {r.error}\n" + "\n".join(r.output.splitlines()[-40:])
        if must:
            sys.exit(msg)
        print(msg, flush=True)
        return r.output, None
    return r.output, r.entries


def blocked(out: str) -> dict[int, float]:
    """step -> seconds training waited for that save (sync: the whole save; async: staging)."""
    found = {}
    for m in re.finditer(r"checkpoint step-(\d+) saved in ([\d.]+) s", out):
        found[int(m.group(1))] = float(m.group(2))
    for m in re.finditer(r"checkpoint step-(\d+): training blocked ([\d.]+) s", out):
        found[int(m.group(1))] = float(m.group(2))
    return found


def main() -> None:
    p = launch.Parser(__doc__)
    p.add_argument("--ngpu", type=int, default=0, help="GPUs (default: all visible)")
    p.add_argument("--folder", default="/tmp/titanlite_ckbench")
    p.add_argument("--local-batch", type=int, default=4)
    p.add_argument("--skip-modes", default="", help="comma-separated async modes not to time")
    a = p.parse_args()
    import torch

    ngpu = a.ngpu or torch.cuda.device_count()
    if ngpu < 1:
        sys.exit("no GPU visible")
    root = Path(a.folder)
    shutil.rmtree(root, ignore_errors=True)
    print(f"LLaMA 1.36B, {ngpu} x {torch.cuda.get_device_name(0)}, local batch {a.local_batch} x seq 2048, "
          f"torch {torch.__version__}", flush=True)

    # Resume check, and the blocking time of a synchronous save (step 5).
    ref_out, ref = train(root, "resume", ngpu, a.local_batch, 10, "--checkpoint.interval", "5",
                         "--checkpoint.keep_latest_k", "2")
    _, resumed = train(root, "resume", ngpu, a.local_batch, 10, "--checkpoint.interval", "5",
                       "--checkpoint.keep_latest_k", "2", "--checkpoint.load_step", "5")
    # The same 10 steps once more, uninterrupted and without checkpoints: how far two identical GPU
    # runs drift apart by themselves (nondeterministic kernels), the yardstick for the resume.
    _, again = train(root, "again", ngpu, a.local_batch, 10, "--checkpoint.enable=false")
    expected, got, rerun = (launch.step_losses(x) for x in (ref, resumed, again))
    steps = list(range(6, 11))
    diffs = [abs(got[s] - expected[s]) for s in steps]
    noise = [abs(rerun[s] - expected[s]) for s in steps]
    exact = all(got[s] == expected[s] for s in steps)
    rows = [("disabled", [blocked(ref_out)[5]], statistics.median(e["time_ms"] for e in ref[1:]), ref[5]["time_ms"])]
    shutil.rmtree(root / "resume", ignore_errors=True)
    shutil.rmtree(root / "again", ignore_errors=True)

    for mode in [m for m in ("async", "async_with_pinned_mem") if m not in a.skip_modes.split(",")]:
        out, it = train(root, mode, ngpu, a.local_batch, 7, "--checkpoint.interval", "3",
                        "--checkpoint.keep_latest_k", "1", "--checkpoint.async_mode", mode, must=False)
        if it is None:
            errors = [ln.strip() for ln in out.splitlines() if "Error" in ln]
            rows.append((mode, [], None, errors[-1][:120] if errors else "failed"))
            shutil.rmtree(root / mode, ignore_errors=True)
            continue
        b = blocked(out)
        # time_ms excludes the blocked time; the step after a save runs beside the background write
        rows.append((mode, [b[3], b[6]], statistics.median(e["time_ms"] for e in it[1:]),
                     statistics.mean(it[s]["time_ms"] for s in (3, 6))))
        shutil.rmtree(root / mode, ignore_errors=True)

    print("\n| async_mode | training blocked per save (s) | median step (ms) | step beside the write (ms) |")
    print("|---|---|---|---|")
    for mode, saves, median, beside in rows:
        if median is None:  # a failed mode: `beside` holds the error
            print(f"| {mode} | failed: {beside} | - | - |")
            continue
        print(f"| {mode} | {', '.join(f'{s:.2f}' for s in saves)} | {median:.0f} | {beside:.0f} |")
    print(f"\nresume from step 5: steps 6-10 {'bit-exact' if exact else 'differ'}; max |loss diff| {max(diffs):.3g}; "
          f"a second uninterrupted run differs from the first by up to {max(noise):.3g}")
    print("  step  uninterrupted       resumed  second uninterrupted")
    for s in steps:
        print(f"  {s:>4} {expected[s]:>14.6f} {got[s]:>13.6f} {rerun[s]:>21.6f}")
    sys.exit(0 if max(diffs) <= 1e-3 * abs(expected[6]) else 1)


if __name__ == "__main__":
    main()
