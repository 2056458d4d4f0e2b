"""Host time against GPU time of a training step, by phase, on one GPU or on every rank under torchrun.

    [torchrun --standalone --nproc-per-node N] benchmarks/step_host_time.py \\
        --job.config_file train_configs/llama_1.36b_h100.toml --training.local_batch_size 4 \\
        --training.dataset synthetic --data.num_workers 0 [--parallelism.data_parallel fsdp] \\
        [--launch group|parameter] [--trace DIR]

Any training option is accepted. After 10 warm-up steps it times 20 free-running steps (the rate a
run sees), then 10 steps each started on an idle GPU. Of those it reports the host's time to launch
the whole step (`host step`) and its parts: forward, backward (the autograd engine's, on its own
thread for CUDA, while the caller waits) and the optimizer (clip, update, gradient release), and
`opt GPU span`, the GPU time between the optimizer step's first and last kernel. A host step near
the free-running step means the host, not the GPU, sets the pace; the gap between them is the
slack a busier host eats before its GPUs wait.
`--launch parameter` (bf16_params / bf16 moments only) makes MasterAdamW launch its kernel once per
parameter, as it does under CUDA graph capture, instead of once per group and dtype.
`--busy N`: N processes spinning on the host's CPUs while the steps are timed (started after the
warm-up by each host's first rank), a stand-in for a host with other work: how much of its rate a
mode keeps when its launches slow down.
`--trace DIR`: afterwards rank 0 records one more idle-start step with torch's profiler, Python calls
included, to DIR/host_trace.json.gz (benchmarks/host_trace.py sums its host time by code).
"""

import contextlib
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from titanlite.config import load_config
from titanlite.step import StepHooks
from titanlite.train import Trainer


class HostClock(StepHooks):
    """The trainer's own hooks, with the host clock read at each phase's ends."""

    def __init__(self, inner: StepHooks):
        self.inner = inner
        self.ms = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}

    def data(self, micro):
        return self.inner.data(micro)

    @contextlib.contextmanager
    def micro_step(self, micro, last):
        t = time.perf_counter()
        with self.inner.micro_step(micro, last):
            yield
        self.ms["forward"] += (time.perf_counter() - t) * 1e3  # less backward's, taken out below

    @contextlib.contextmanager
    def backward(self, micro, last):
        t = time.perf_counter()
        with self.inner.backward(micro, last):
            yield
        took = (time.perf_counter() - t) * 1e3
        self.ms["backward"] += took
        self.ms["forward"] -= took

    @contextlib.contextmanager
    def optimizer(self):
        t = time.perf_counter()
        with self.inner.optimizer():
            yield
        self.ms["optimizer"] += (time.perf_counter() - t) * 1e3


def take_option(args: list[str], name: str, choices=None) -> str | None:
    """Remove `name VALUE` from `args` and return VALUE (None when absent); exit 2 on a bad one."""
    if name not in args:
        return None
    i = args.index(name)
    value = args[i + 1] if i + 1 < len(args) else None
    if value is None or (choices and value not in choices):
        print(f"step_host_time: {name} takes {' or '.join(choices) if choices else 'a value'}", file=sys.stderr)
        sys.exit(2)
    del args[i:i + 2]
    return value


def main() -> None:
    args = sys.argv[1:]
    if take_option(args, "--launch", ("group", "parameter")) == "parameter":
        import titanlite.ops.master_adamw as kernels

        kernels.master_adamw_update_many = lambda *a, **k: False  # declines: the per-parameter path runs
    trace_dir = take_option(args, "--trace")
    busy = take_option(args, "--busy")
    if busy is not None and not busy.isdigit():
        print("step_host_time: --busy takes a number of processes", file=sys.stderr)
        sys.exit(2)
    trainer = Trainer(load_config(args))
    rank = dist.get_rank() if dist.is_initialized() else 0
    clock = HostClock(trainer.hooks)
    trainer.hooks = clock
    cuda = trainer.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    spans, starts = [], []

    def opt_start(*_):
        if cuda:
            starts.append(torch.cuda.Event(enable_timing=True))
            starts[-1].record()

    def opt_end(*_):
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            spans.append((starts.pop(), end))

    trainer.optimizer.register_step_pre_hook(opt_start)
    trainer.optimizer.register_step_post_hook(opt_end)

    def run(steps: int, start_idle: bool) -> dict:
        sync()
        spans.clear()
        clock.ms = dict.fromkeys(clock.ms, 0.0)
        step_host, t0 = [], time.perf_counter()
        for _ in range(steps):
            if start_idle:
                sync()
            t = time.perf_counter()
            trainer.train_step()
            step_host.append((time.perf_counter() - t) * 1e3)
        sync()
        out = {k: v / steps for k, v in clock.ms.items()}
        out.update(wall=(time.perf_counter() - t0) / steps * 1e3, host=sorted(step_host)[steps // 2],
                   span=sum(a.elapsed_time(b) for a, b in spans) / steps)
        return out

    for _ in range(10):
        trainer.train_step()
    spinners = []
    if busy and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(int(busy))]
    try:
        if dist.is_initialized():
            dist.barrier()
        free, idle = run(20, False), run(10, True)
    finally:
        for p in spinners:
            p.kill()
    line = (f"rank {rank}{f' (host busy with {busy} spinning processes)' if busy else ''}: free-running {free['wall']:.1f} ms/step "
            f"({trainer.tokens_per_step / free['wall'] * 1e3:,.0f} tok/s in all); idle start: host step "
            f"{idle['host']:.1f} ms (median) = forward {idle['forward']:.1f} + backward {idle['backward']:.1f} + "
            f"optimizer {idle['optimizer']:.1f} (+ data, lr); opt GPU span {idle['span']:.1f} ms")
    lines = [None] * dist.get_world_size() if dist.is_initialized() else [line]
    if dist.is_initialized():
        dist.all_gather_object(lines, line)
    if rank == 0:
        print("\n".join(lines), flush=True)
    if trace_dir:
        from torch.profiler import ProfilerActivity, profile

        sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities, with_stack=True) if rank == 0 \
                else contextlib.nullcontext() as prof:
            trainer.train_step()
            sync()
        if rank == 0:
            os.makedirs(trace_dir, exist_ok=True)
            path = os.path.join(trace_dir, "host_trace.json.gz")
            prof.export_chrome_trace(path)
            print(f"trace of one idle-start step: {path}", flush=True)
    trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
