"""The Trainer: config -> build on meta -> parallelize -> materialise -> train loop.

Read it top to bottom: `Trainer.__init__` builds everything, `train_step` is one optimizer step
(with gradient accumulation, eager or a CUDA-graph replay), `train` is the loop with logging,
validation and checkpoints, one phase after another. Host syncs (`.item()`, printing) happen only for
log steps, and a log step's figures are read once the next step is queued behind it (`LogPoint`), so
the GPU does not wait while the host logs. `main` runs a Trainer and tears the process down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import platform
import re
import socket
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from titanlite.checkpoint import Checkpointer, CheckpointSaveError, Preemption, checkpoint_root, finished_line
from titanlite.config import ConfigError, JobConfig, load_config, parallel_settings, resolve_batch, run_cli
from titanlite.config.agree import disagreement, job_settings
from titanlite.data import build_data
from titanlite.debug import FaultInjector
from titanlite.errors import BAD_INPUT_EXIT, FAILURE_EXIT, NON_FINITE_EXIT, OUT_OF_MEMORY_EXIT, say_failure
from titanlite.hardware import peak_tflops
from titanlite.metrics.profiler import StepProfiler
from titanlite.metrics.reporter import Reporter, RunFacts
from titanlite.metrics.timing import StepTimer
from titanlite.models import build_model, get_model_args
from titanlite.ops.attention import resolve_backend
from titanlite.optim import build_lr_scheduler, build_optimizer, schedule_warning
from titanlite.parallel.apply import parallelize
from titanlite.parallel.dims import ParallelDims, init_distributed
from titanlite.parallel.launcher_env import Launch
from titanlite.parallel.launcher_watch import watch_launcher
from titanlite.step import (CudaGraphStep, NonFiniteLossError, StepHooks, build_train_step, check_finite,
                            global_step_losses, validation_loss)

logger = logging.getLogger("titanlite")


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    losses: list = field(default_factory=list)  # per-step loss tensors since the last log step (on device)

    def state_dict(self):
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, sd):
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])


@dataclass
class LogPoint:
    """A log step's figures, queued on the GPU behind its step. Reading them at once would leave the
    GPU idle while the host waits, logs and launches the next step; read after the next step is
    queued, the host's logging overlaps that step.

    Its interval is timed between two marks of the step timer (CUDA events on the GPU's stream, or
    the host clock), from the end of the previous log step to the end of this one: the host, which
    runs ahead of the GPU, cannot tell when a step ended by when it looked."""
    step: int
    lr: float
    tokens_seen: int
    steps: int                 # optimizer steps since the previous log step
    values: torch.Tensor       # those steps' losses (mean over ranks), then the grad norm; host memory
    marks: list                # the step timer's phase marks of those steps
    since: Any                 # the mark the interval starts at
    excluded_s: float          # time inside the interval that is not training (validation, saves, traces)
    done: Any                  # the mark after this step and the copy to `values`
    warmup: bool = False       # the interval holds a CUDA-graph capture: its times are not the run's


class GarbageCollector:
    """Python's cyclic garbage collector at steps every rank agrees on. Left to itself it pauses
    whenever allocations cross its thresholds: on one rank, in the middle of a step, and under data
    parallelism every other rank waits for that one at the next collective. `interval`: steps between
    collections of the young generations (0: Python's collector stays on). The first collection comes
    after the first step this process runs: what start-up and compilation left in the young generations
    makes it the one long collection (fsdp on 2 CPU ranks, 134M eager: 6-12 ms against 0.04-0.07 ms
    for each later one), and there it falls in the warm-up instead of in the middle of a measured run."""

    def __init__(self, interval: int):
        self.interval = interval
        self.first = True

    def __enter__(self) -> "GarbageCollector":
        self.interval = self.interval if gc.isenabled() else 0  # someone else's choice stays theirs
        self.first = True
        if self.interval:
            gc.disable()  # no full collection first: in a large process it takes up to half a second
        return self

    def step(self, step: int) -> None:
        if self.interval and (self.first or step % self.interval == 0):
            self.first = False
            gc.collect(1)

    def __exit__(self, *exc) -> None:
        if self.interval:
            gc.enable()


def agree_on_config(cfg: JobConfig, dims: ParallelDims) -> None:
    """Every rank's resolved settings gathered and compared (titanlite.config.agree): a job whose nodes
    were started with different options stops here, before step 1, in one line naming the keys, their
    values and the ranks and hosts holding each. Host-side, over the job's ranks (the mesh's) on a gloo
    group of its own, as the checkpoint's agreements: pickled settings need no GPU."""
    if dims.world_size == 1:
        return
    group = dist.new_group(ranks=dims.ranks, backend="gloo")
    try:
        every: list = [None] * dims.world_size
        dist.all_gather_object(every, (socket.gethostname(), job_settings(cfg)), group=group)
    finally:
        dist.destroy_process_group(group)
    if line := disagreement(every):
        raise ConfigError(line)


def check_writable(folder: str, key: str = "job.dump_folder") -> None:
    """Fail at start-up, not hours in, when outputs cannot be written."""
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write_probe_{os.getpid()}")
        with open(probe, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{key} '{folder}' is not writable: {e.strerror}") from None


class TimedHooks(StepHooks):
    """The eager loop's view of a step: phase timers (metrics.timing) and injected faults (debug)."""

    def __init__(self, timer: StepTimer, faults: FaultInjector):
        self.timer, self.faults = timer, faults

    @contextlib.contextmanager
    def data(self, micro):
        with self.timer.phase("data"):
            yield
            self.faults.data()

    @contextlib.contextmanager
    def micro_step(self, micro, last):
        if last:  # the gradient sync happens in this micro-step's backward
            with self.timer.phase("comm"):
                self.faults.comm()
        with self.timer.phase("compute"):
            self.faults.compute()
            yield

    def optimizer(self):
        return self.timer.phase("optimizer")


class Trainer:
    def __init__(self, cfg: JobConfig, launch: Launch | None = None):
        """`launch`: what the launcher said about this process (default: read from the environment now)."""
        self.cfg = cfg
        settings = parallel_settings(cfg)  # what titanlite.parallel is told
        self.dims = init_distributed(settings, launch or Launch.from_environ())
        agree_on_config(cfg, self.dims)  # before anything reads a setting another rank may not share
        self.device = self.dims.device
        self.grad_accum = resolve_batch(cfg, self.dims.dp_size)
        self.global_batch = cfg.training.local_batch_size * self.dims.dp_size * self.grad_accum
        self.tokens_per_step = self.global_batch * cfg.training.seq_len
        if self.dims.is_main:
            check_writable(cfg.job.dump_folder)
            if cfg.checkpoint.enable:
                check_writable(str(checkpoint_root(cfg)), "checkpoint.folder")
        torch.manual_seed(cfg.training.seed)
        if cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

        # Data first: text datasets decide the vocabulary the model must cover.
        self.data = build_data(cfg, self.dims.dp_rank, self.dims.dp_size)
        self.train_iter = self.data.train
        self.model_args = get_model_args(cfg.model.name, cfg.model.flavor, cfg.model.vocab_size)
        if self.model_args.vocab_size < self.data.vocab_size:
            raise ConfigError(f"model.vocab_size ({self.model_args.vocab_size}) is smaller than the dataset's "
                              f"vocabulary ({self.data.vocab_size}); set model.vocab_size to {self.data.vocab_size} "
                              f"or more")
        self.attention_backend = resolve_backend(cfg.model.attention_backend, self.device, cfg.training.seq_len)

        # Build on meta (no memory), then parallelize: the techniques in their one order
        # (titanlite.parallel.apply.parallelize), the weights materialised and initialised on the way.
        with torch.device("meta"):
            model = build_model(self.model_args, self.attention_backend, cfg.training.seq_len,
                                cfg.training.loss_chunk_tokens, cfg.model.init)
        self.model, self.masters = parallelize(model, settings, self.dims)
        model = self.model
        self.optimizer = build_optimizer(model, cfg, self.device, self.dims.mode, self.masters,
                                         group=self.dims.group("dp_replicate"))
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        if self.dims.is_main and (line := schedule_warning(cfg.lr_scheduler, cfg.training.steps, cfg.optimizer.lr)):
            logger.warning(line)
        self.state = TrainState()
        # Checkpoints: resume (or initial safetensors load) now, before anything reads the state.
        self.checkpointer = Checkpointer(
            cfg, self.dims, self.model, self.optimizer,
            stateful={"lr_scheduler": self.lr_scheduler, "train_state": self.state},
            per_rank={"dataloader": self.train_iter},
            info={"model": {"name": cfg.model.name, "flavor": cfg.model.flavor, "max_seq_len": cfg.training.seq_len,
                            "args": dataclasses.asdict(self.model_args)},
                  "tokenizer": str(getattr(self.data, "tokenizer_path", "") or "")},
            global_batch=self.global_batch)
        self.checkpointer.load()
        self.start_step = self.state.step  # where this process began (0, or the resumed step)
        self.finished = self.state.step >= cfg.training.steps
        self.preemption = Preemption(self.checkpointer.group)  # SIGTERM/SIGINT: finish the step, save, exit

        # The step (titanlite.step): forward/backward over the micro-batches, clip, update; with
        # training.cuda_graphs the same step captured once and replayed (None when off or unavailable)
        self.step = build_train_step(model, self.optimizer, cfg, self.grad_accum, self.dims, self.masters)
        self.cuda_graph = CudaGraphStep.build(cfg.training.cuda_graphs, self.step, self.device,
                                              cfg.training.cuda_graphs_warmup, self.dims.mode, self.dims.is_main)
        self.captures_logged = 0  # capture attempts up to the last log step (the next one spanning one is warm-up)
        self.timer = StepTimer(self.device, model)  # phases + gradient-ready hooks for exposed comm
        self.faults = FaultInjector(cfg.debug, self.dims.rank)
        self.hooks = TimedHooks(self.timer, self.faults)

        self.report = Reporter(cfg, self.run_facts(), self.dims.is_main, self.dims.rank, self.state.step,
                               self.checkpointer.group, write_log=not self.finished)  # a finished job run again logs nothing
        self.run_log = self.report.run_log
        self.profiler = StepProfiler(cfg.profiling, cfg.job.dump_folder, self.dims.rank, self.device)
        self.pending: LogPoint | None = None  # a log step whose figures are read once the next step is queued
        self.excluded_s = 0.0  # time in the log interval under way that is not training (`untimed`)

    def run_facts(self) -> RunFacts:
        """What the reporter's startup record and rates need: sizes, device and its bf16 peak."""
        self.n_params = self.model_args.num_params()
        self.flops_per_token = self.model_args.flops_per_token(self.cfg.training.seq_len)
        cuda = self.device.type == "cuda"
        self.device_name = torch.cuda.get_device_name(self.device) if cuda else platform.processor() or "cpu"
        # CPU: only an explicit --metrics.peak_tflops gives MFU (the table holds GPUs)
        self.peak = peak_tflops(self.device_name if cuda else "", self.cfg.metrics.peak_tflops)
        if cuda and self.peak is None:
            logger.warning(f"no bf16 peak known for '{self.device_name}': set --metrics.peak_tflops to see MFU")
        return RunFacts(world_size=self.dims.world_size, mode=self.dims.mode, grad_accum=self.grad_accum,
                        global_batch=self.global_batch, tokens_per_step=self.tokens_per_step,
                        attention_backend=self.attention_backend, device=self.device, device_name=self.device_name,
                        peak_tflops=self.peak, n_params=self.n_params,
                        n_params_without_input_embedding=self.model_args.num_params(exclude_embedding=True),
                        flops_per_token=self.flops_per_token, data_description=self.data.description)

    # ----------------------------------------------------------------------------------------- step
    def next_batch(self, _micro: int = 0):
        inputs, labels = next(self.train_iter)
        nb = self.device.type == "cuda"
        return inputs.to(self.device, non_blocking=nb), labels.to(self.device, non_blocking=nb)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step, then the lr schedule's; returns (mean loss, grad norm) on device."""
        out = (self.cuda_graph or self.step)(self.next_batch, self.hooks)
        if out.skipped:
            logger.warning(f"step {self.state.step + 1}: non-finite gradients, update skipped")
        self.step_lr = self.lr_scheduler.get_last_lr()[0]  # the lr this step used (read on log steps)
        # A skipped step still uses up its lr. When it is the process's first step, torch would
        # warn of a misordered call; the filter is scoped to that case (entering catch_warnings
        # resets which warnings were already shown, so it is not entered on every step).
        with warnings.catch_warnings() if out.skipped else contextlib.nullcontext():
            if out.skipped:
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            self.lr_scheduler.step()
        return out.loss, out.grad_norm

    def validate(self) -> float:
        return validation_loss(self.model, self.data.make_val(), self.cfg.validation.steps, self.step.forward_loss,
                               self.device, self.dims.dp_group)

    # ----------------------------------------------------------------------------------------- loop
    def train(self) -> dict:
        cfg, st = self.cfg, self.state
        if self.finished:
            self.report.info(finished_line(st.step, cfg.training.steps, self.checkpointer.root))
            return {"steps": st.step}
        self.report.info(self.describe())
        self.report.info(f"run log: {self.run_log.path}" if self.run_log else "")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        val_loss = None
        # Python's collector off for the steps, back on however they end
        with GarbageCollector(cfg.training.gc_interval) as collector:
            self.interval_start, self.excluded_s = self.timer.mark(), 0.0  # the log interval under way
            self.preemption.install()
            while st.step < cfg.training.steps:
                with self.untimed():  # starting or writing a profiler trace
                    self.profiler.step(st.step + 1)
                # lr, forward/backward over the micro-batches, clip, update (titanlite.step); the log
                # step before it is read once this step is queued behind it
                with self.logging_behind():
                    loss, grad_norm = self.train_step()
                st.step += 1
                st.tokens_seen += self.tokens_per_step
                collector.step(st.step)
                st.losses.append(loss)
                stop = self.preemption.requested()  # agreed by every rank, so all stop after this step
                last = st.step == cfg.training.steps or stop
                validating = cfg.validation.enable and (st.step % cfg.validation.freq == 0 or last) and not stop
                saving = self.checkpointer.should_save(st.step, last)
                # log: queue this step's figures, read at once when validation or a save follows
                if st.step % cfg.metrics.log_freq == 0 or last or st.step == 1:
                    self.queue_log(grad_norm, now=last or validating or saving)
                # validate and save: time taken out of the step figures (a save logs its own)
                with self.untimed():
                    if validating:
                        val_loss = self.validate()
                        self.report.log_validation(st.step, val_loss)
                    self.report.advance(st.step)
                    if st.losses and cfg.training.on_nan == "stop" and saving:
                        self.check_finite_losses()  # never write a checkpoint of NaN weights
                    self.checkpointer.save(st.step, last=last)  # every checkpoint.interval steps, and the last
                # stop: a signal asked for it (the checkpoint is written)
                if stop:
                    self.report.info(f"{self.preemption.received}: stopped after step {st.step}; " + (
                        f"checkpoint saved under {self.checkpointer.root}, run the same command to resume"
                        if cfg.checkpoint.enable else "nothing saved (checkpoint.enable=false)"))
                    break
        self.checkpointer.wait()  # under the handler: a signal now is noted and cannot cut the save short
        self.preemption.restore()
        self.profiler.close()
        return self.report.finish(st.step, val_loss)

    def describe(self) -> str:
        cfg = self.cfg
        return (f"model {cfg.model.name}/{cfg.model.flavor}: {self.n_params:,} params, "
                f"{self.flops_per_token / 1e9:.2f} GFLOP/token | attention {self.attention_backend} | "
                f"{self.dims.world_size} x {self.device_name} ({self.dims.mode}) | global batch "
                f"{self.global_batch} = {cfg.training.local_batch_size} x {self.dims.dp_size} x "
                f"{self.grad_accum} accum | data: {self.data.description}")

    @contextlib.contextmanager
    def untimed(self):
        """Time spent inside is not training (validation, saves, traces): the log interval under way
        leaves it out of its step figures."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.excluded_s += time.perf_counter() - started

    @contextlib.contextmanager
    def logging_behind(self):
        """Around a step: the log step queued before it is logged once this step is queued (its
        figures cost the GPU no wait); a failing step still leaves that log step its entry."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self.flush_log()
            raise
        self.flush_log()

    def queue_log(self, grad_norm: torch.Tensor, now: bool) -> None:
        """Queue the figures of the log step just taken; with `now`, log them at once."""
        self.pending = self.log_point(grad_norm)
        if now:
            self.flush_log()

    def flush_log(self) -> None:
        if self.pending is not None:
            point, self.pending = self.pending, None
            self.finish_log(point)

    def log_point(self, grad_norm: torch.Tensor) -> LogPoint:
        """The figures of the log step just taken (the steps since the previous one), queued for the
        host; the next log interval starts where this one ends."""
        st = self.state
        values = torch.cat([global_step_losses(st.losses, self.dims.dp_group), grad_norm.float().reshape(1)])
        steps = len(st.losses)
        st.losses.clear()
        if values.is_cuda:
            values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True).copy_(values, non_blocking=True)
        captures = self.cuda_graph.captures if self.cuda_graph is not None else 0
        point = LogPoint(st.step, self.step_lr, st.tokens_seen, steps, values, self.timer.take(), self.interval_start,
                         self.excluded_s, self.timer.mark(), warmup=captures != self.captures_logged)
        self.interval_start, self.excluded_s, self.captures_logged = point.done, 0.0, captures
        return point

    def finish_log(self, point: LogPoint) -> None:
        """Log `point` once its step has finished (with on_nan=stop, raise naming a non-finite step)."""
        self.timer.wait(point.done)
        *step_losses, grad_norm = point.values.tolist()
        check_finite(step_losses, point.step, self.cfg.training.on_nan)
        elapsed_s = self.timer.elapsed_ms(point.since, point.done) / 1000 - point.excluded_s
        self.report.log_step(point.step, step_losses, point.lr, grad_norm, elapsed_s, point.steps,
                             point.tokens_seen, self.timer.collect(point.marks), self.timer.method, point.warmup)

    def check_finite_losses(self) -> None:
        """With on_nan=stop, raise naming the first non-finite step since the last log step (the steps'
        global mean losses, one host sync)."""
        step_losses = global_step_losses(self.state.losses, self.dims.dp_group).tolist()
        check_finite(step_losses, self.state.step, self.cfg.training.on_nan)

    def close(self):
        """Release what the run holds. The process group is left to `main`, which destroys it only
        once the Trainer and its DDP wrapper are gone."""
        try:
            if self.cuda_graph is not None:
                self.cuda_graph.release()  # before the process group goes (a captured collective hangs its teardown)
            self.checkpointer.close()  # waits for an async save in flight, still under the signal handler
        finally:
            self.preemption.restore()
        self.report.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run(cfg: JobConfig, launch: Launch | None = None) -> BaseException | None:
    """Train a run of `cfg`, the Trainer closed however it ends; returns the exit for `main` to raise
    (None on success). The failure's frames hold the Trainer, so they are dropped here: once this
    returns, the Trainer is gone."""
    launch = launch or Launch.from_environ()
    trainer = None
    try:
        with Trainer(cfg, launch) as trainer:
            trainer.train()
    except BaseException as e:
        failure = exit_for(e, launch, cfg, trainer)
        e.with_traceback(None)  # in place: whoever else holds the exception must not keep the frames
        return failure
    return None


def exit_for(e: BaseException, launch: Launch, cfg: JobConfig | None = None,
             trainer: Trainer | None = None) -> BaseException:
    """What a failed run exits with: one line for a known failure (titanlite.errors.say_failure: once
    for the job), else the traceback printed once."""
    if isinstance(e, NonFiniteLossError):
        say_failure(f"error: {e}", NON_FINITE_EXIT, launch)
        return SystemExit(NON_FINITE_EXIT)
    if isinstance(e, CheckpointSaveError):  # every rank sees the same failure
        say_failure(f"error: {e}", FAILURE_EXIT, launch, same_on_every_rank=True)
        return SystemExit(FAILURE_EXIT)
    if isinstance(e, ConfigError):
        say_failure(f"error: {e}", BAD_INPUT_EXIT, launch, same_on_every_rank=True)
        return SystemExit(BAD_INPUT_EXIT)
    if isinstance(e, SystemExit):
        return e
    if cfg is not None and out_of_memory(e) is not None:
        say_failure(out_of_memory_line(e, cfg, launch, trainer), OUT_OF_MEMORY_EXIT, launch)
        return SystemExit(OUT_OF_MEMORY_EXIT)
    traceback.print_exc()
    return SystemExit(130 if isinstance(e, KeyboardInterrupt) else FAILURE_EXIT)


# Same-seed CPU runs are bit-identical whatever their thread count (torchrun gives each rank one
# thread, a plain run one per core) and from one process to the next: MKL splits a GEMM that reduces
# over many rows (the weight gradients sum over every token) between its threads, so by default its
# rounding follows the thread count; its strict reproducibility mode sums in one fixed order. The
# AVX2 code path, not AUTO's pick: on AVX-512 CPUs AUTO's path still rounded differently in some
# processes (where the buffers landed), the AVX2 one in none. MKL reads this at its first call, so a
# training process sets it before any torch work (start_process); a value of your own wins.
REPRODUCIBLE_CPU_MATH = {"MKL_CBWR": "AVX2,STRICT"}


def start_process() -> Launch:
    """What a training process does first: MKL's reproducible mode (REPRODUCIBLE_CPU_MATH, where unset),
    then the launcher's environment, read once (titanlite.parallel.launcher_env.Launch) to be handed down."""
    for name, value in REPRODUCIBLE_CPU_MATH.items():
        os.environ.setdefault(name, value)
    return Launch.from_environ()


def graph_collectives(cfg: JobConfig, launch: Launch) -> None:
    """torch's CUDA-graph notes: collectives captured in a graph need NCCL's asynchronous error handling
    off. torchrun always sets it (to 1 unless told otherwise), so a run of several GPUs with
    training.cuda_graphs sets it to 0 here, before the process group starts and reads it. The cost: a
    hung collective then hangs instead of aborting after the timeout."""
    if not (cfg.training.cuda_graphs and launch.world_size > 1 and torch.cuda.is_available()
            and not cfg.debug.inject_shared_device) or os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "0":
        return
    if launch.is_main:
        logger.info("training.cuda_graphs: TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (torch's CUDA-graph requirement; "
                    "a hung collective will hang rather than abort)")
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"


def out_of_memory(e: BaseException | None) -> torch.OutOfMemoryError | None:
    """The out-of-memory error `e` is or was raised from (torch.compile's autotuning, for one, raises
    its own error from the allocator's), else None."""
    for _ in range(8):
        if e is None or isinstance(e, torch.OutOfMemoryError):
            return e
        e = e.__cause__ or e.__context__
    return None


def out_of_memory_line(e: BaseException, cfg: JobConfig, launch: Launch, trainer: Trainer | None) -> str:
    """The out-of-memory failure in one line: where, the peak and the device's capacity, what to lower,
    and the file holding the full traceback (with the CUDA allocator's summary), written here."""
    rank = launch.rank
    dp = trainer.dims.dp_size if trainer else launch.world_size
    when = f"in step {trainer.state.step + 1}" if trainer else "at start-up"
    device = trainer.device if trainer else (torch.device("cuda", torch.cuda.current_device())
                                             if torch.cuda.is_available() else torch.device("cpu"))
    gib = 2**30
    if device.type == "cuda":
        peak, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        capacity = torch.cuda.get_device_properties(device).total_memory
        held = (f"peak {peak / gib:.1f} GiB allocated ({reserved / gib:.1f} reserved) of the GPU's "
                f"{capacity / gib:.1f} GiB ({torch.cuda.get_device_name(device)})")
    else:  # the process's high-water mark in the host's memory
        import resource  # Unix only, and only this path reads it

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        held = f"peak {peak / gib:.1f} GiB of the host's {capacity / gib:.1f} GiB"
    asked = re.search(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)", str(out_of_memory(e)))
    path = os.path.join(cfg.job.dump_folder, f"oom_rank{rank}.txt")
    try:
        with open(path, "w") as fh:
            fh.write("".join(traceback.format_exception(e)))
            if device.type == "cuda":
                fh.write("\n" + torch.cuda.memory_summary(device))
        kept = f"traceback: {path}"
    except OSError as err:
        kept = f"traceback not kept ({path}: {err.strerror})"
    return (f"error: out of memory {when} on rank {rank}: {held}" + (f", asking {asked.group(1)} more" if asked else "")
            + f"; {what_to_lower(cfg, dp)}; {kept}")


def what_to_lower(cfg: JobConfig, dp: int) -> str:
    """The settings that lower a step's peak, the first one ready to paste: half the local batch (its
    largest divisor below it) with the accumulation that keeps the global batch."""
    t, ac = cfg.training, cfg.activation_checkpoint.mode
    out = []
    if t.local_batch_size > 1:
        local = next(d for d in range(t.local_batch_size // 2, 0, -1) if t.local_batch_size % d == 0)
        global_batch = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dp
        out.append(f"--training.local_batch_size {local} --training.global_batch_size {global_batch} (the same global "
                   f"batch, accumulation {global_batch // (local * dp)})")
    if ac != "full":
        out.append(f"--activation_checkpoint.mode {'selective' if ac == 'none' else 'full'}")
    out.append("a shorter training.seq_len")
    return "lower it with " + ", or ".join(out)


def main(argv: list[str]) -> None:
    launch = start_process()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    watch_launcher(launch)  # under torchrun: stop when the launcher dies
    try:
        cfg = load_config(argv, launch)
    except ConfigError as e:  # said as any failure of a rank is (once for the job under torchrun)
        raise exit_for(e, launch) from None
    graph_collectives(cfg, launch)
    failure = run(cfg, launch)
    # The DDP wrapper went before its process group: one that outlives it can hang its rank while
    # the process exits (seen on gloo with 2 and 4 ranks).
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    if failure is not None:
        raise failure


if __name__ == "__main__":
    run_cli(main)
