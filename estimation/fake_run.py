"""One rank of an N-GPU training run, on fake tensors: build, parallelize, step, measure.

What runs is the trainer's own code: the model from titanlite.models on meta, `parallelize` (the
techniques in the order its docstring writes), `build_optimizer`, and `titanlite.step.TrainStep` for the step itself (micro-batches, gradient sync
on the last, clip, update), watched through `MemoryHooks`. It all runs under FakeTensorMode with a
fake process group of the target world size, so every collective, shard and buffer has the shape it
has on the GPUs while no memory is touched.

Fake tensors live on "cpu" (torch's fake CUDA kernels need a GPU build), so the GPU's choices are
made explicitly: bf16 autocast or FSDP bf16 parameters as on CUDA, fused AdamW as on CUDA, and a
stand-in for CUDA's fused RMSNorm outside compiled code (CPU decomposes it and would save two extra
fp32 copies of the input per norm). With compile.enable, torch.compile runs its real pipeline up to
code generation (estimation.compiled), so compiled blocks keep what Inductor keeps.
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
from titanlite.ops.attention import BACKENDS, SDPA, Manual
from titanlite.optim import build_optimizer
from titanlite.parallel.apply import parallelize
from titanlite.parallel.data_parallel import _fsdp, ddp_wrapper
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.modes import MODES
from titanlite.parallel.policy import computes_bf16, data_parallel_mode, hsdp_shape
from titanlite.step import StepHooks, build_train_step

from estimation.tracker import StepTracker, view_bytes

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


@functools.cache
def _fake_addmm_takes_out_dtype() -> bool:
    """Whether fake tensors run addmm's fp32-output overload (torch 2.11 decomposes it as plain addmm,
    taking the dtype for beta, and raises a TypeError; 2.13 has its own decomposition)."""
    import logging

    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)  # the failing probe is expected on such a torch: no logged traceback
    try:
        with FakeTensorMode():
            a = torch.empty(2, 2, dtype=torch.bfloat16)
            torch.addmm(torch.empty(2, 2), a, a, out_dtype=torch.float32)
        return True
    except TypeError:
        return False
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def cuda_like_kernels():
    """Swap in the stand-ins for CUDA kernels whose CPU versions keep different tensors or do different
    work: the fused RMSNorm (code that torch.compile traces keeps the real op: Inductor decides what
    it saves), and the chunked loss's fp32-output GEMM into the weight-gradient accumulator (on the
    CPU a product, then an add)."""
    orig = F.rms_norm

    def rms_norm(x, normalized_shape, weight=None, eps=None):
        if torch.compiler.is_compiling():
            return orig(x, normalized_shape, weight, eps)
        if weight is None:
            weight = torch.ones(normalized_shape, device=x.device)
        return _FusedRMSNorm.apply(x, weight, eps if eps is not None else torch.finfo(x.dtype).eps)

    import titanlite.ops.loss as loss

    def fp32_mm(a, b, acc=None):  # CUDA's path (titanlite.ops.master_linear.fp32_mm): one fp32-output GEMM
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        if _fake_addmm_takes_out_dtype():
            return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
        return acc.add_(torch.mm(a, b, out_dtype=torch.float32))

    F.rms_norm, orig_mm, loss.fp32_mm = rms_norm, loss.fp32_mm, fp32_mm
    try:
        yield
    finally:
        F.rms_norm, loss.fp32_mm = orig, orig_mm


@contextlib.contextmanager
def _float8_as_on_the_gpu():
    """The target GPU runs float8 matmuls (torch._scaled_mm); on fake tensors its fake kernel gives
    their shapes on any device, so the fake run keeps torchao's real (non-emulated) path: the float8
    GEMMs are counted as such, and torchao saves what it saves on the GPU."""
    import titanlite.parallel.apply as apply

    orig = apply.float8_supported
    apply.float8_supported = lambda device: True
    try:
        yield
    finally:
        apply.float8_supported = orig


@contextlib.contextmanager
def _init_without_values():
    """Weight initialisation has nothing to draw on fake tensors, and torch's truncated normal
    redraws out-of-range values in a loop that reads them."""
    import torch.nn.init as init

    orig = init.trunc_normal_
    init.trunc_normal_ = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        init.trunc_normal_ = orig


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
    is labelled a communication buffer here.

    With the default float32 reduce dtype the real run's hook (titanlite's mean_allreduce_hook) averages
    the bucket in place inside the collective, in the bucket's own dtype (fp32, or bf16 for float8's bf16
    gradients), so nothing more runs here. With bfloat16 it runs what titanlite's bf16 hook runs: a bf16
    copy (none where the bucket is bf16 already), the divide, and the copy back."""
    dtype, tracker = state
    buf = bucket.buffer()
    tracker.label([buf], "comm_buffers")
    if dtype != torch.bfloat16:
        dist.all_reduce(buf)
    else:
        reduced = buf.to(dtype)  # (the real bf16 hook divides before the sum; for fake tensors the order is moot)
        dist.all_reduce(reduced)
        reduced.div_(dist.get_world_size())
        if reduced is not buf:
            buf.copy_(reduced)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


# dist.Reducer's arguments after (params, bucket_indices, per_bucket_size_limits), as DDP passes them
_REDUCER_ARGS = ("process_group", "expect_sparse_gradients", "bucket_bytes_cap", "find_unused_parameters",
                 "gradient_as_bucket_view", "param_to_name_mapping", "first_bucket_bytes_cap")


@contextlib.contextmanager
def _buckets_as_rebuilt():
    """DDP builds its reducer with every gradient in one bucket (before a backward it does not know the
    order gradients become ready in) and rebuilds the buckets after the first backward: up to
    first_bucket_bytes_cap, then bucket_bytes_cap each, over the parameters in the order their gradients
    became ready, so from the second step on each bucket is all-reduced as soon as its gradients exist,
    beside the rest of the backward. That rebuild agrees on the order across ranks by reading a
    tensor's data, which fake tensors do not have (see _NoBucketRebuild), so the fake reducer is built
    with the rebuilt layout from the start, taking the ready order as the reverse of the parameters'
    order (DDP's own assumption for its first layout: the output head's gradient first, the input
    embedding's last)."""
    orig = dist.Reducer

    def reducer(params, bucket_indices, per_bucket_size_limits, *rest, **kwargs):
        named = {**dict(zip(_REDUCER_ARGS, rest)), **kwargs}
        sparse = list(named.get("expect_sparse_gradients") or [False] * len(params))
        cap = named.get("bucket_bytes_cap", 25 * 2**20)
        first = named.get("first_bucket_bytes_cap", dist._DEFAULT_FIRST_BUCKET_BYTES)
        ready = list(range(len(params)))[::-1]
        bucket_indices, per_bucket_size_limits = dist._compute_bucket_assignment_by_size(
            [params[i] for i in ready], [first, cap], [sparse[i] for i in ready], ready)
        return orig(params, bucket_indices, per_bucket_size_limits, *rest, **kwargs)

    dist.Reducer = reducer
    try:
        yield
    finally:
        dist.Reducer = orig


class _NoBucketRebuild:
    """DDP rebuilds its buckets once, agreeing on the order by reading a tensor's data (fake tensors
    have none). The fake reducer was built with the rebuilt layout (_buckets_as_rebuilt): keep it."""

    def __init__(self, reducer):
        self._reducer = reducer

    def _rebuild_buckets(self):
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)


def _one_pass_update(tracker, p, g, lo, m, v, *args) -> None:
    """MasterAdamW's update as the GPU runs it: one kernel reading g, p, lo, m, v and writing p, lo, m, v
    and the bf16 copy (lo None: p is its own master; the copy, the last argument, may be None), with
    nothing allocated. Its eager reference, run here for the values, would be counted op by op: about
    4x the bytes, and its fp32 intermediates, several times the parameter at once (for a large
    embedding or output head, GiB that could set the step's peak)."""
    from titanlite.optim import _master_adamw_update

    counting = tracker.count_work
    with tracker.stand_in_kernel():
        _master_adamw_update(p, g, lo, m, v, *args)
    if counting:
        work = tracker.work[tracker.phase]
        copy = args[-1]
        # the elements each tensor has, not its storage: under ddp a gradient is a view of its bucket
        work.memory_bytes += (view_bytes(g) + 2 * (view_bytes(p) + view_bytes(m) + view_bytes(v))
                              + (0 if lo is None else 2 * view_bytes(lo)) + (0 if copy is None else view_bytes(copy)))
        work.ops += 1


class MemoryHooks(StepHooks):
    """TrainStep's phases as the tracker's: what a forward allocates is activations, what a backward or
    the optimizer allocates is temporaries; a backward's survivors are gradients (plain or, without
    sync, accumulated unsharded), the optimizer's survivors its state. Also counts the micro-steps and
    optimizer phases it saw (tests check the step ran through TrainStep)."""

    def __init__(self, tracker: StepTracker):
        self.t = tracker
        self.model_state: dict[str, int] = {}
        self.micro_steps = 0
        self.updates = 0

    def _phase(self, phase: str, category: str) -> None:
        self.t.phase, self.t.category = phase, category

    @staticmethod
    def _tag(last: bool) -> str:
        return "last" if last else "accum"

    @contextlib.contextmanager
    def micro_step(self, micro: int, last: bool):
        self._phase(f"fwd_{self._tag(last)}", "activations")
        yield
        self.t.relabel_survivors((f"bwd_{self._tag(last)}",), "temporaries", "grads")
        self.micro_steps += 1

    @contextlib.contextmanager
    def data(self, micro: int):
        self._phase("data", "activations")  # the token ids: inputs of the forward
        yield

    @contextlib.contextmanager
    def backward(self, micro: int, last: bool):
        self._phase(f"bwd_{self._tag(last)}", "temporaries")
        yield

    @contextlib.contextmanager
    def optimizer(self):
        self.model_state = self.t.breakdown("current")  # params, grads, optimizer state, persistent buffers
        self._phase("opt", "temporaries")
        yield
        self.t.relabel_survivors(("opt",), "temporaries", "optimizer")
        self._phase("idle", "temporaries")
        self.updates += 1


class FakeRun:
    """Rank 0 of `world` ranks; `step(local_batch)` measures one optimizer step at that batch."""

    def __init__(self, cfg, world: int, attention_backend: str = "sdpa", device_memory: int | None = None):
        """`attention_backend`: the one the GPU runs (a concrete name). Its tensors are what count: a
        pinned SDPA kernel, which exists only on a GPU, runs unpinned here with its K/V expansion for
        GQA; the flash-attn packages take GQA natively, as SDPA's enable_gqa does. `device_memory`: the
        GPU's bytes, where a choice depends on them (fsdp_reshard_after_forward=auto)."""
        self.device_memory = device_memory
        self.cfg = run_cfg = copy.deepcopy(cfg)
        run_cfg.optimizer.fused = "true" if cfg.optimizer.fused == "auto" else cfg.optimizer.fused  # CUDA default
        run_cfg.training.cuda_graphs = False      # capture changes no tensor; it needs a CUDA device
        if computes_bf16(cfg, "cuda"):  # as on CUDA (the fake tensors are CPU tensors): bf16 copies, autocast
            run_cfg.training.mixed_precision_param = "bfloat16"
        self.world = world
        self.mode = data_parallel_mode(cfg, world)
        self.args = get_model_args(cfg.model.name, cfg.model.flavor, cfg.model.vocab_size)
        self.seq_len = cfg.training.seq_len
        self.compiled = cfg.compile.enable
        self.dims = ParallelDims(world, 0, 0, torch.device("cpu"), self.mode)
        self._own_pg = False
        if world > 1:
            if dist.is_initialized():
                dist.destroy_process_group()
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            self._own_pg = True
        self._mesh = None
        if self.mode == "fsdp":
            self._mesh = _mesh_outside_fake((world,), ("dp_shard",))
        elif self.mode == "hsdp":
            self._mesh = _mesh_outside_fake(hsdp_shape(run_cfg, world), ("dp_replicate", "dp_shard"))

        with torch.device("meta"):
            runnable = attention_backend if issubclass(BACKENDS[attention_backend], (SDPA, Manual)) else "sdpa"
            model = build_model(self.args, runnable, self.seq_len, run_cfg.training.loss_chunk_tokens)
            for m in model.modules():
                if isinstance(getattr(m, "attn", None), SDPA):
                    m.attn.unpin()
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.tracker = StepTracker()
        self.hooks = MemoryHooks(self.tracker)
        self._stack = contextlib.ExitStack()
        if self.compiled:
            from estimation.compiled import capture_compile

            self._stack.enter_context(capture_compile())
        with self._active(), _init_without_values(), _float8_as_on_the_gpu():
            self.tracker.count_work = False
            self.model = model = parallelize(model, run_cfg, self.dims, wrap=self._wrap)
            self.optimizer = build_optimizer(model, run_cfg, torch.device("cpu"), self.mode)
            # MasterAdamW (bf16_params) creates its state (masters' low bits, moments) up front, not in a step
            self.tracker.label([t for st in self.optimizer.state.values() for t in st.values()], "optimizer")
            local = getattr(self.optimizer, "optim", self.optimizer)  # zero1: the rank's own MasterAdamW
            if hasattr(local, "update_fn"):
                local.update_fn = functools.partial(_one_pass_update, self.tracker)
            self.tracker.label(list(model.parameters()) + list(model.buffers()), "params")
            # as the Trainer: bf16 autocast where CUDA would run it (the fake tensors are on the CPU;
            # mixed_precision_param was made explicit above)
            self.train_step = build_train_step(model, self.optimizer, run_cfg, 1, self.dims, compile_loss=self.compiled)
            # optimizer state and DDP buckets exist from here on (compiled code runs as eager: no compile
            # for a shape that is never measured)
            with torch.compiler.set_stance("force_eager"):
                self._step(1, WARMUP_SEQ, micro_steps=1)

    def _wrap(self, model, cfg, dims):
        """The mode's wrapper, as parallelize would apply it, fitted to fake tensors."""
        if MODES[self.mode].shards_params:
            # shown a CUDA device: FSDP's bf16 parameter policy is a GPU choice
            return _fsdp(model, cfg, dataclasses.replace(dims, device=torch.device("cuda", 0)), self._mesh,
                         self.device_memory)
        reduce_dtype = getattr(torch, cfg.parallelism.ddp_reduce_dtype)
        with _ddp_without_shape_check(), _buckets_as_rebuilt():
            model = ddp_wrapper(model, cfg, dims)  # DDP takes one hook: ours, below
        model.register_comm_hook((reduce_dtype, self.tracker), _allreduce_hook)
        model.reducer = _NoBucketRebuild(model.reducer)
        return model

    @contextlib.contextmanager
    def _active(self):
        with self.fake_mode, self.tracker, cuda_like_kernels():
            yield

    def _step(self, local_batch: int, seq_len: int, micro_steps: int) -> None:
        self.train_step.grad_accum = micro_steps
        vocab = self.args.vocab_size

        def batch(_micro):
            tokens = torch.randint(0, vocab, (local_batch, seq_len))
            return tokens, tokens

        self.train_step(batch, self.hooks)

    def step(self, local_batch: int, micro_steps: int = 1) -> "StepResult":
        """Peak memory and work of one optimizer step (micro_steps > 1: accumulation, the last syncs)."""
        t = self.tracker
        with self._active():
            t.work.clear()
            t.count_work = True
            t.reset_peak()
            self._step(local_batch, self.seq_len, micro_steps)
            return StepResult(t.peak, t.breakdown("peak"), self.hooks.model_state, dict(t.work), dict(t.phase_peak))

    def close(self) -> None:
        self._stack.close()
        if self._own_pg and dist.is_initialized():
            dist.destroy_process_group()


@dataclasses.dataclass
class StepResult:
    peak_bytes: int
    breakdown: dict       # category -> bytes at the peak
    model_state: dict     # category -> bytes live after the last backward (before the optimizer step)
    work: dict            # phase -> tracker.PhaseWork
    phase_peak: dict = dataclasses.field(default_factory=dict)  # phase -> most live bytes in it

    def peak_without_accumulation(self) -> int:
        """The peak of a step with one micro-batch, from a step of two: the first micro-step runs as the
        only one would (no gradients held yet), and the optimizer phase is the same."""
        return max(v for k, v in self.phase_peak.items() if k in ("fwd_accum", "bwd_accum", "opt"))
