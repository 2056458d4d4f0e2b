"""One rank of an N-GPU training run, on fake tensors: build, parallelize, step, measure.

What runs is the trainer's own code: the model from titanlite.models on meta, `parallelize` (the
techniques in the order its docstring writes), `build_optimizer`, and `titanlite.step.TrainStep` for
the step itself (micro-batches, gradient sync on the last, clip, update), watched through
`MemoryHooks`. It all runs under FakeTensorMode with a fake process group of the target world size,
so every collective, shard and buffer has the shape it has on the GPUs while no memory is touched.

It reaches titanlite through seams only: the settings it builds from the config (the GPU's choices
made explicit: bf16 autocast or FSDP bf16 parameters, fused AdamW), the dims laid out by the
trainer's own `parallel_dims` over the fake process group it starts, from the launcher's record of a
job on nodes of estimate.gpus_per_node (rank 0, the target GPU's memory, float8 matmuls), parallelize's `wrap=` for DDP (fake tensors need its own comm hook), and
build_optimizer's `update=` (the fused update's bytes, counted as one kernel). Where torch itself
behaves otherwise on fake CPU tensors than on the GPU (CUDA's fused RMSNorm, DDP's checks that read
data, ...), estimation.standins holds the stand-in. With compile.enable, torch.compile runs its real
pipeline up to code generation (estimation.compiled), so compiled blocks keep what Inductor keeps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from titanlite.config import parallel_settings
from titanlite.models import build_model, get_model_args
from titanlite.ops.attention import BACKENDS, SDPA, Manual
from titanlite.optim import build_optimizer, eager_master_adamw_update
from titanlite.parallel.apply import parallelize
from titanlite.parallel.ddp import ddp_wrapper
from titanlite.parallel.dims import parallel_dims
from titanlite.parallel.modes import MODES
from titanlite.parallel.policy import computes_bf16, data_parallel_mode
from titanlite.step import StepHooks, build_train_step

from estimation.hardware import launch_on_nodes
from estimation.standins import (cuda_like_kernels, ddp_on_fake_tensors, fsdp_chunks_on_demand, init_without_values,
                                 keep_rebuilt_buckets)
from estimation.tracker import StepTracker, view_bytes

WARMUP_SEQ = 16  # the warm-up step only has to create optimizer state and DDP buckets


def _allreduce_hook(state, bucket):
    """DDP's built-in hook waits on a future the fake process group leaves empty; this one does the
    same bucket all-reduce in the configured dtype (so it is seen and timed, at its real size) over DDP's
    process group and hands the bucket back. state = (reduce dtype, tracker, that group): a bf16 reduce
    sends a copy, so the bucket itself is labelled a communication buffer here.

    With the default float32 reduce dtype the real run's hook (titanlite's mean_allreduce_hook) averages
    the bucket in place inside the collective, in the bucket's own dtype (fp32, or bf16 for float8's bf16
    gradients), so nothing more runs here. With bfloat16 it runs what titanlite's bf16 hook runs: a bf16
    copy (none where the bucket is bf16 already), the divide, and the copy back."""
    dtype, tracker, group = state
    buf = bucket.buffer()
    tracker.label([buf], "comm_buffers")
    if dtype != torch.bfloat16:
        dist.all_reduce(buf, group=group)
    else:
        reduced = buf.to(dtype)  # (the real bf16 hook divides before the sum; for fake tensors the order is moot)
        dist.all_reduce(reduced, group=group)
        reduced.div_(dist.get_world_size(group))
        if reduced is not buf:
            buf.copy_(reduced)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _one_pass_update(tracker, p, g, lo, m, v, *args) -> None:
    """MasterAdamW's update as the GPU runs it (build_optimizer's `update=`): one kernel reading g, p, lo,
    m, v and writing p, lo, m, v and the bf16 copy (lo None: p is its own master; the copy, the last
    argument, may be None), with nothing allocated. Its eager reference, run here for the values, would
    be counted op by op: about 4x the bytes, and its fp32 intermediates, several times the parameter at
    once (for a large embedding or output head, GiB that could set the step's peak)."""
    counting = tracker.count_work
    with tracker.stand_in_kernel():
        eager_master_adamw_update(p, g, lo, m, v, *args)
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
        GPU's bytes, where a choice depends on them (fsdp_reshard_after_forward=auto). A run of several
        ranks starts a fake process group of its own, so it refuses to start beside a live one (this
        process's own job, which it must not replace)."""
        self.device_memory = device_memory
        self.cfg = run_cfg = copy.deepcopy(cfg)
        run_cfg.optimizer.fused = "true" if cfg.optimizer.fused == "auto" else cfg.optimizer.fused  # CUDA default
        run_cfg.training.cuda_graphs = False      # capture changes no tensor; it needs a CUDA device
        if computes_bf16(parallel_settings(cfg).precision, "cuda"):  # as on CUDA (the fake tensors are CPU
            run_cfg.training.mixed_precision_param = "bfloat16"     # tensors): bf16 copies, autocast
        settings = parallel_settings(run_cfg)
        # The fake process group has no communicators to build: FSDP's gathers stay the job's (where they
        # run changes no tensor and no byte moved)
        settings = dataclasses.replace(settings, data_parallel=dataclasses.replace(
            settings.data_parallel, fsdp_copy_engine_all_gather="off"))
        self.world = world
        self.mode = data_parallel_mode(settings.data_parallel, world)
        self.args = get_model_args(cfg.model.name, cfg.model.flavor, cfg.model.vocab_size)
        self.seq_len = cfg.training.seq_len
        self.compiled = cfg.compile.enable
        self._own_pg = False
        if world > 1:
            if dist.is_initialized():
                raise RuntimeError(f"estimation's fake run of {world} ranks starts a fake process group of its own, "
                                   f"and this process already has a live one (torch.distributed is initialized); "
                                   f"run the estimate in a process without one")
            # here, not at the top: torch's testing package, which only a run of several ranks needs
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            self._own_pg = True
        self._stack = contextlib.ExitStack()  # the compile capture, which close() ends
        try:
            self._build(run_cfg, settings, attention_backend, device_memory)
        except BaseException:
            self.close()  # a run that failed to build leaves no fake group behind it
            raise

    def _build(self, run_cfg, settings, attention_backend: str, device_memory: int | None) -> None:
        # The trainer's layout over the fake group, from the launcher's record of a job on nodes of
        # estimate.gpus_per_node: rank 0, on the CPU that holds fake tensors, with the target GPU's memory
        # and its float8 matmuls (fake kernels give torch._scaled_mm's shapes on any device, so torchao's
        # real, non-emulated path runs and its GEMMs are counted as float8)
        launch = launch_on_nodes(run_cfg.estimate, self.world)
        self.dims = parallel_dims(settings.data_parallel, launch, torch.device("cpu"), device_memory, float8=True)

        with torch.device("meta"):
            runnable = attention_backend if issubclass(BACKENDS[attention_backend], (SDPA, Manual)) else "sdpa"
            model = build_model(self.args, runnable, self.seq_len, run_cfg.training.loss_chunk_tokens)
            for m in model.modules():
                if isinstance(getattr(m, "attn", None), SDPA):
                    m.attn.unpin()
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.tracker = StepTracker()
        self.hooks = MemoryHooks(self.tracker)
        if self.compiled:
            from estimation.compiled import capture_compile  # here, not at the top: it imports Dynamo

            self._stack.enter_context(capture_compile())
        with self._active(), init_without_values(), fsdp_chunks_on_demand():
            self.tracker.count_work = False
            wrap = None if MODES[self.mode].shards_params else self._wrap_ddp  # fsdp, hsdp: the trainer's own
            self.model, self.masters = parallelize(model, settings, self.dims, wrap=wrap)
            model = self.model
            # optimizer.fused=false runs torch's fused kernel on the GPU (standins.cuda_like_kernels runs it
            # here too), with fp32 temporaries for the state that is not fp32: it runs as it is
            fused = run_cfg.optimizer.fused == "true"
            self.optimizer = build_optimizer(model, run_cfg, torch.device("cpu"), self.mode, self.masters,
                                             update=functools.partial(_one_pass_update, self.tracker) if fused else None,
                                             group=self.dims.group("dp_replicate"))
            # MasterAdamW (bf16_params) creates its state (masters' low bits, moments) up front, not in a step
            self.tracker.label([t for st in self.optimizer.state.values() for t in st.values()], "optimizer")
            self.tracker.label(list(model.parameters()) + list(model.buffers()), "params")
            # as the Trainer: bf16 autocast where CUDA would run it (the fake tensors are on the CPU;
            # mixed_precision_param was made explicit above)
            self.train_step = build_train_step(model, self.optimizer, run_cfg, 1, self.dims, self.masters)
            # optimizer state and DDP buckets exist from here on (compiled code runs as eager: no compile
            # for a shape that is never measured)
            with torch.compiler.set_stance("force_eager"):
                self._step(1, WARMUP_SEQ, micro_steps=1)

    def _wrap_ddp(self, model, settings, dims, masters):
        """ddp and zero1's wrapper, as parallelize would apply it, fitted to fake tensors: built with the
        stand-ins for what reads tensor data, and with a comm hook whose future completes."""
        reduce_dtype = getattr(torch, settings.data_parallel.ddp_reduce_dtype)
        with ddp_on_fake_tensors():
            model = ddp_wrapper(model, settings, dims, masters)  # DDP takes one hook: ours, below
        model.register_comm_hook((reduce_dtype, self.tracker, model.process_group), _allreduce_hook)
        keep_rebuilt_buckets(model)
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
            res = StepResult(t.peak, t.breakdown("peak"), self.hooks.model_state, dict(t.work), dict(t.phase_peak))
        return self._with_bucket_rebuild(res) if micro_steps > 1 else res

    def _with_bucket_rebuild(self, res: "StepResult") -> "StepResult":
        """A measured step is a steady one. The real run's second step also rebuilds DDP's buckets at its
        first forward, and under accumulation the masters' gradients still view the old ones then
        (titanlite.parallel.grads.release_grads says why): every old bucket beside the new, the model
        state and the gradients once more, before any activation. Its peak where that is the larger."""
        keeps_views = (isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
                       and self.model.gradient_as_bucket_view and bool(self.masters.copies))
        # the buckets hold every gradient in its parameter's dtype (the tracker files them as comm buffers)
        grads = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        rebuild = sum(res.model_state.values()) + grads
        if not keeps_views or rebuild <= res.peak_bytes:
            return res
        at_rebuild = {**dict.fromkeys(res.breakdown, 0), **res.model_state}
        at_rebuild["comm_buffers"] = at_rebuild.get("comm_buffers", 0) + grads  # the new buckets
        return dataclasses.replace(res, peak_bytes=rebuild, breakdown=at_rebuild)

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
