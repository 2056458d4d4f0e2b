"""One rank of an N-GPU training run, on fake tensors: build, parallelize, step, measure.

The model is built the way the trainer builds it (titanlite.models on meta, then titanlite.parallel's
float8 -> activation checkpointing -> materialise -> data-parallel wrapping) under FakeTensorMode
with a fake process group of the target world size, so every collective, shard and buffer has the
shape it has on the GPUs while no memory is touched. Fake tensors live on "cpu" (torch cannot run
CUDA kernels' fake versions without a GPU), so the GPU's choices are made explicitly here:
bf16 autocast or FSDP bf16 parameters as on CUDA, fused AdamW as on CUDA, and a stand-in for CUDA's
fused RMSNorm (CPU decomposes it and would save two extra fp32 copies of the input per norm).
torch.compile is not run: the memory is that of eager mode (see docs/estimation.md).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from titanlite.models import build_model, get_model_args
from titanlite.parallel import ParallelDims, clip_grad_norm, float8_post_step, grad_sync
from titanlite.config.manager import autocasts, data_parallel_mode, hsdp_shape
from titanlite.parallel.data_parallel import apply_ddp
from titanlite.parallel.apply import apply_ac, apply_bf16_params, apply_float8

from estimation.tracker import StepTracker, nbytes

WARMUP_SEQ = 16  # the warm-up step only has to create optimizer state and DDP buckets


class _FusedRMSNorm(torch.autograd.Function):
    """What CUDA's fused rms_norm keeps for backward: the input and one fp32 rstd per row."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return (x.float() * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        xhat = x.float() * rstd
        gw = grad.float() * weight.float()
        gx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), (grad.float() * xhat).flatten(0, -2).sum(0).to(weight.dtype), None


def _rms_norm(x, normalized_shape, weight=None, eps=None):
    if weight is None:
        weight = torch.ones(normalized_shape, device=x.device)
    return _FusedRMSNorm.apply(x, weight, eps if eps is not None else torch.finfo(x.dtype).eps)


@contextlib.contextmanager
def cuda_like_kernels():
    """Swap in the stand-ins for CUDA kernels whose CPU versions keep different tensors."""
    orig = F.rms_norm
    F.rms_norm = _rms_norm
    try:
        yield
    finally:
        F.rms_norm = orig


def _mesh_outside_fake(shape, names):
    """A DeviceMesh has to be built with real tensors (it reads its rank layout back)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh

    with unset_fake_temporarily():
        return init_device_mesh("cpu", shape, mesh_dim_names=names)


@contextlib.contextmanager
def _ddp_without_shape_check():
    """DDP's start-up shape check reads tensor data in C++, which fake tensors do not have; every
    fake rank holds the same shapes by construction, so skip it."""
    import torch.nn.parallel.distributed as ddp

    orig = ddp._verify_param_shape_across_processes
    ddp._verify_param_shape_across_processes = lambda *a, **k: None
    try:
        yield
    finally:
        ddp._verify_param_shape_across_processes = orig


def _allreduce_hook(state, bucket):
    """DDP's built-in hook waits on a future the fake process group leaves empty; this one does the
    same bucket all-reduce in the configured dtype (so it is seen and timed, at its real size) and hands
    the bucket back. state = (reduce dtype, tracker): a bf16 reduce sends a copy, so the bucket itself
    is labelled a communication buffer here."""
    dtype, tracker = state
    buf = bucket.buffer()
    tracker.label([buf], "comm_buffers")
    reduced = buf.to(dtype)  # (the real bf16 hook divides before the sum; for fake tensors the order is moot)
    dist.all_reduce(reduced)
    reduced.div_(dist.get_world_size())
    if reduced is not buf:
        buf.copy_(reduced)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


class _NoBucketRebuild:
    """DDP re-orders its buckets once, agreeing on the order by reading a tensor's data (fake tensors
    have none). The bucket bytes are the same in either order, so keep the first layout."""

    def __init__(self, reducer):
        self._reducer = reducer

    def _rebuild_buckets(self):
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)


def _one_pass_update(tracker, p, g, lo, m, v, *args) -> None:
    """MasterAdamW's update as the GPU runs it: one kernel reading g, p, lo, m, v and writing p, lo, m, v
    (lo None: p is its own master) (its eager reference, run here for the values, would be counted op
    by op: about 4x the bytes)."""
    from titanlite.optim import _master_adamw_update

    counting, tracker.count_work = tracker.count_work, False
    try:
        _master_adamw_update(p, g, lo, m, v, *args)
    finally:
        tracker.count_work = counting
    if counting:
        work = tracker.work[tracker.phase]
        work.memory_bytes += nbytes(g) + 2 * (nbytes(p) + nbytes(m) + nbytes(v)) + (0 if lo is None else 2 * nbytes(lo))
        work.ops += 1


class FakeRun:
    """Rank 0 of `world` ranks; `step(local_batch)` measures one optimizer step at that batch."""

    def __init__(self, cfg, world: int, attention_backend: str = "sdpa"):
        self.cfg = run_cfg = copy.deepcopy(cfg)
        run_cfg.compile.enable = False            # eager: see the module docstring
        run_cfg.float8.emulate = True             # float8 matmuls have CPU (fake) kernels only emulated
        run_cfg.optimizer.fused = "true" if cfg.optimizer.fused == "auto" else cfg.optimizer.fused  # CUDA default
        self.world = world
        self.mode = data_parallel_mode(cfg, world)
        self.args = get_model_args(cfg.model.name, cfg.model.flavor, cfg.model.vocab_size)
        self.seq_len = cfg.training.seq_len
        self.dims = ParallelDims(world, 0, 0, torch.device("cpu"), self.mode)
        # The data-parallel code reads dims.device for GPU-only choices (bf16 FSDP params): show it CUDA.
        self.gpu_dims = dataclasses.replace(self.dims, device=torch.device("cuda", 0))
        self._own_pg = False
        if world > 1:
            if dist.is_initialized():
                dist.destroy_process_group()
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            self._own_pg = True
        mesh = None
        if self.mode == "fsdp":
            mesh = _mesh_outside_fake((world,), ("dp_shard",))
        elif self.mode == "hsdp":
            mesh = _mesh_outside_fake(hsdp_shape(run_cfg, world), ("dp_replicate", "dp_shard"))

        with torch.device("meta"):
            model = build_model(self.args, attention_backend, self.seq_len, run_cfg.training.loss_chunk_tokens)
        if run_cfg.float8.enable:
            apply_float8(model, run_cfg, self.gpu_dims)
        if run_cfg.activation_checkpoint.mode != "none":
            apply_ac(model, run_cfg)

        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.tracker = StepTracker()
        with self._active():
            self.tracker.count_work = False
            model.to_empty(device="cpu")
            if self.args.tie_embeddings:  # values do not matter on fake tensors, the sharing does
                model.output.weight = model.tok_embeddings.weight
            if run_cfg.training.bf16_params:  # as parallelize: bf16 weights before any wrapping
                apply_bf16_params(model)
            if self.mode in ("fsdp", "hsdp"):
                from titanlite.parallel.data_parallel import _fsdp

                model = _fsdp(model, run_cfg, self.gpu_dims, mesh)
            elif self.mode in ("ddp", "zero1"):
                reduce_dtype = getattr(torch, run_cfg.parallelism.ddp_reduce_dtype)
                wrap_cfg = copy.deepcopy(run_cfg)
                wrap_cfg.parallelism.ddp_reduce_dtype = "float32"  # DDP takes one hook: ours, in that dtype
                with _ddp_without_shape_check():
                    model = apply_ddp(model, wrap_cfg, self.dims)
                model.register_comm_hook((reduce_dtype, self.tracker), _allreduce_hook)
                model.reducer = _NoBucketRebuild(model.reducer)
            from titanlite.optim import build_optimizer

            self.optimizer = build_optimizer(model, run_cfg, torch.device("cpu"), self.mode)
            # MasterAdamW (bf16_params) creates its state (masters' low bits, moments) up front, not in a step
            self.tracker.label([t for st in self.optimizer.state.values() for t in st.values()], "optimizer")
            if hasattr(self.optimizer, "update_fn"):
                self.optimizer.update_fn = functools.partial(_one_pass_update, self.tracker)
            self.model = model
            self.tracker.label(list(model.parameters()) + list(model.buffers()), "params")
            self._step(1, WARMUP_SEQ, micro_steps=1)  # optimizer state and DDP buckets exist from here on

    @contextlib.contextmanager
    def _active(self):
        with self.fake_mode, self.tracker, cuda_like_kernels():
            yield

    def _phase(self, phase: str, category: str) -> None:
        self.tracker.phase, self.tracker.category = phase, category

    def _forward_loss(self, tokens):
        from titanlite.ops.loss import cross_entropy

        autocast = autocasts(self.cfg, self.world)  # as the trainer on CUDA; the fake tensors run on CPU
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            if self.cfg.training.loss == "chunked":  # as Trainer.forward_loss
                return self.model(tokens, tokens)
            logits = self.model(tokens)
        return cross_entropy(logits, tokens)

    def _step(self, local_batch: int, seq_len: int, micro_steps: int) -> None:
        t = self.tracker
        for micro in range(micro_steps):
            last = micro == micro_steps - 1
            tag = "last" if last else "accum"
            with grad_sync(self.model, last):
                self._phase(f"fwd_{tag}", "activations")
                tokens = torch.randint(0, self.args.vocab_size, (local_batch, seq_len))
                loss = self._forward_loss(tokens) / micro_steps
                self._phase(f"bwd_{tag}", "temporaries")
                loss.backward()
                del loss, tokens
            # What a backward leaves behind is gradient (plain or, without sync, accumulated unsharded).
            t.relabel_survivors((f"bwd_{tag}",), "temporaries", "grads")
        self.model_state = t.breakdown("current")  # params, grads, optimizer state, persistent buffers
        self._phase("opt", "temporaries")
        clip_grad_norm(self.model, self.cfg.training.max_norm)
        self.optimizer.step()
        float8_post_step(self.model, self.cfg)
        self.optimizer.zero_grad(set_to_none=True)
        t.relabel_survivors(("opt",), "temporaries", "optimizer")
        self._phase("idle", "temporaries")

    def step(self, local_batch: int, micro_steps: int = 1) -> "StepResult":
        """Peak memory and work of one optimizer step (micro_steps > 1: accumulation, the last syncs)."""
        t = self.tracker
        with self._active():
            t.work.clear()
            t.count_work = True
            t.reset_peak()
            self._step(local_batch, self.seq_len, micro_steps)
            return StepResult(t.peak, t.breakdown("peak"), self.model_state, dict(t.work))

    def close(self) -> None:
        if self._own_pg and dist.is_initialized():
            dist.destroy_process_group()


@dataclasses.dataclass
class StepResult:
    peak_bytes: int
    breakdown: dict       # category -> bytes at the peak
    model_state: dict     # category -> bytes live after the last backward (before the optimizer step)
    work: dict            # phase -> tracker.PhaseWork
