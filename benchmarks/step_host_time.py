"""Host time against GPU time of a training step and of its optimizer step (one GPU).

    python benchmarks/step_host_time.py --job.config_file train_configs/llama_1.36b_h100.toml \\
        --training.local_batch_size 4 --training.dataset synthetic --data.num_workers 0 [--training.bf16_params]
        [--launch group|parameter]

Any training option is accepted. After 10 warm-up steps it times 20 free-running steps (the rate a
run sees), then 10 steps each started on an idle GPU, where `host opt.step` is the host time spent
launching the optimizer step and `opt GPU span` the GPU time between its first and last kernel.
A host time above the GPU span means the launches, not the kernels, set the pace of that phase.
`--launch parameter` (bf16_params / bf16 moments only) makes MasterAdamW launch its kernel once per
parameter, as it does under CUDA graph capture, instead of once per group and dtype.
"""

import sys
import time

import torch

from titanlite.config import load_config
from titanlite.train import Trainer


def main() -> None:
    args = sys.argv[1:]
    if "--launch" in args:
        i = args.index("--launch")
        if args[i + 1:i + 2] not in (["group"], ["parameter"]):
            print("step_host_time: --launch takes group or parameter", file=sys.stderr)
            sys.exit(2)
        if args[i + 1] == "parameter":
            import titanlite.ops.master_adamw as kernels

            kernels.master_adamw_update_many = lambda *a, **k: False  # declines: the per-parameter path runs
        del args[i:i + 2]
    trainer = Trainer(load_config(args))
    opt, inner = trainer.optimizer, trainer.optimizer.step
    host, spans = [], []

    def timed_step(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        host.append(time.perf_counter() - t0)
        end.record()
        spans.append((start, end))
        return out

    opt.step = timed_step

    def run(steps: int, start_idle: bool) -> tuple[float, float, float, float]:
        torch.cuda.synchronize()
        host.clear()
        spans.clear()
        step_host, t0 = [], time.perf_counter()
        for _ in range(steps):
            if start_idle:
                torch.cuda.synchronize()
            t = time.perf_counter()
            trainer.train_step()
            step_host.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e3
        span = sum(a.elapsed_time(b) for a, b in spans) / steps
        return wall, sum(step_host) / steps * 1e3, sum(host) / steps * 1e3, span

    for _ in range(10):
        trainer.train_step()
    free, idle = run(20, False), run(10, True)
    tokens = trainer.tokens_per_step
    print(f"free-running: {free[0]:.1f} ms/step ({tokens / free[0] * 1e3:,.0f} tok/s), opt GPU span {free[3]:.1f} ms")
    print(f"idle start:   {idle[0]:.1f} ms/step, host train_step {idle[1]:.1f} ms, host opt.step {idle[2]:.1f} ms, "
          f"opt GPU span {idle[3]:.1f} ms")
    trainer.close()


if __name__ == "__main__":
    main()
