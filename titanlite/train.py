"""The Trainer: config -> build on meta -> parallelize -> materialise -> train loop.

Read it top to bottom: `Trainer.__init__` builds everything, `train_step` is one optimizer step
(with gradient accumulation), `train` is the loop with logging, validation and checkpoints.
Host syncs (`.item()`, printing) happen only for log steps, and a log step's figures are read once
the next step is queued behind it (`LogPoint`), so the GPU does not wait while the host logs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import platform
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from titanlite.checkpoint import Checkpointer, CheckpointSaveError, Preemption, checkpoint_root
from titanlite.config import ConfigError, JobConfig, load_config, resolve_batch, run_cli
from titanlite.parallel.policy import autocasts
from titanlite.data import build_data
from titanlite.debug import FaultInjector
from titanlite.hardware import peak_tflops
from titanlite.metrics.profiler import StepProfiler
from titanlite.metrics.reporter import Reporter, RunFacts
from titanlite.metrics.timing import StepTimer
from titanlite.models import build_model, get_model_args
from titanlite.ops.attention import resolve_backend
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallel.apply import parallelize
from titanlite.parallel.dims import init_distributed
from titanlite.parallel.cuda_graphs import CudaGraphStep
from titanlite.parallel.launcher_watch import watch_launcher
from titanlite.step import (NonFiniteLossError, StepHooks, build_train_step, check_finite, global_step_losses,
                            validation_loss)

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
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.dims = init_distributed(cfg)
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
        self.attention_backend = resolve_backend(cfg.model.attention_backend, self.device)

        # Build on meta (no memory); parallelize applies float8 -> AC -> compile, materialises and
        # initialises the full weights identically on every rank, then wraps for data parallelism.
        with torch.device("meta"):
            model = build_model(self.model_args, self.attention_backend, cfg.training.seq_len,
                                cfg.training.loss_chunk_tokens, cfg.model.init)
        self.model = model = parallelize(model, cfg, self.dims)
        self.optimizer = build_optimizer(model, cfg, self.device, self.dims.mode)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
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
        self.preemption = Preemption(self.checkpointer.group)  # SIGTERM/SIGINT: finish the step, save, exit

        # The step: forward/backward over the micro-batches, clip, update (titanlite.step)
        autocast = self.device.type if autocasts(cfg, self.dims.world_size, self.device.type) else None
        self.step = build_train_step(model, self.optimizer, cfg, self.grad_accum, autocast)
        self.timer = StepTimer(self.device, model)  # phases + gradient-ready hooks for exposed comm
        self.faults = FaultInjector(cfg.debug, self.dims.rank)
        self.hooks = TimedHooks(self.timer, self.faults)
        self.cuda_graph = CudaGraphStep.build(cfg.training.cuda_graphs, self.step, self.device,
                                              cfg.training.cuda_graphs_warmup, self.dims.mode, self.dims.is_main)

        self.n_params = self.model_args.num_params()
        self.flops_per_token = self.model_args.flops_per_token(cfg.training.seq_len)
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else platform.processor() or "cpu"
        # CPU: only an explicit --metrics.peak_tflops gives MFU (the table holds GPUs)
        self.peak = peak_tflops(self.device_name if self.device.type == "cuda" else "", cfg.metrics.peak_tflops)
        if self.device.type == "cuda" and self.peak is None:
            logger.warning(f"no bf16 peak known for '{self.device_name}': set --metrics.peak_tflops to see MFU")
        facts = RunFacts(self.dims.world_size, self.dims.mode, self.grad_accum, self.global_batch, self.tokens_per_step,
                         self.attention_backend, self.device, self.device_name, self.peak, self.n_params,
                         self.model_args.num_params(exclude_embedding=True), self.flops_per_token,
                         self.data.description)
        self.report = Reporter(cfg, facts, self.dims.is_main, self.dims.rank, self.state.step, self.checkpointer.group)
        self.run_log = self.report.run_log
        self.profiler = StepProfiler(cfg.profiling, cfg.job.dump_folder, self.dims.rank, self.device)

    # ----------------------------------------------------------------------------------------- step
    def next_batch(self, _micro: int = 0):
        inputs, labels = next(self.train_iter)
        nb = self.device.type == "cuda"
        return inputs.to(self.device, non_blocking=nb), labels.to(self.device, non_blocking=nb)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (mean loss, grad norm) on device.

        With training.cuda_graphs (after warm-up) the step is one graph replay; if capture fails the
        micro-batches it fetched run eagerly (`batches`), so no data is skipped.
        """
        graph, batches = self.cuda_graph, None
        if graph is not None and graph.ready(self.state.step - self.start_step):  # warm-up restarts on resume
            with self.timer.phase("data"):
                batches = [self.next_batch() for _ in range(self.grad_accum)]
                self.faults.data()
            with self.timer.phase("comm"):
                self.faults.comm()
            with self.timer.phase("compute"):  # forward, backward and optimizer step in one replay
                self.faults.compute()
                out = graph.step(batches)
            if out is not None:
                self.step_lr = self.lr_scheduler.get_last_lr()[0]  # the lr this step used (read on log steps)
                self.lr_scheduler.step()
                return out
        with graph.warmup_context() if graph is not None else contextlib.nullcontext():
            out = self.step(batches.__getitem__ if batches else self.next_batch, self.hooks)
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
                               self.device, self.dims.world_size)

    # ----------------------------------------------------------------------------------------- loop
    def train(self) -> dict:
        cfg, st = self.cfg, self.state
        self.report.info(f"model {cfg.model.name}/{cfg.model.flavor}: {self.n_params:,} params, "
                         f"{self.flops_per_token / 1e9:.2f} GFLOP/token | attention {self.attention_backend} | "
                         f"{self.dims.world_size} x {self.device_name} ({self.dims.mode}) | global batch "
                         f"{self.global_batch} = {cfg.training.local_batch_size} x {self.dims.dp_size} x "
                         f"{self.grad_accum} accum | data: {self.data.description}")
        self.report.info(f"run log: {self.run_log.path}" if self.run_log else "")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        interval_steps, val_loss = 0, None
        self.interval_start, self.excluded_s = self.timer.mark(), 0.0  # the log interval under way
        pending: LogPoint | None = None  # a log step whose figures are read once the next step is queued
        self.preemption.install()
        while st.step < cfg.training.steps:
            self.excluded_s += self.profiler.step(st.step + 1)  # writing a trace is not training time
            try:
                loss, grad_norm = self.train_step()
            except BaseException:
                if pending is not None:  # the log step before a failing step keeps its entry
                    with contextlib.suppress(Exception):
                        self.finish_log(pending)
                raise
            if pending is not None:
                self.finish_log(pending)
                pending = None
            st.step += 1
            st.tokens_seen += self.tokens_per_step
            st.losses.append(loss)
            interval_steps += 1
            stop = self.preemption.requested()  # agreed by every rank, so all stop after this step
            last = st.step == cfg.training.steps or stop
            validating = cfg.validation.enable and (st.step % cfg.validation.freq == 0 or last) and not stop
            if st.step % cfg.metrics.log_freq == 0 or last or st.step == 1:
                pending, interval_steps = self.log_point(grad_norm, interval_steps), 0
                if last or validating or self.checkpointer.should_save(st.step, last):
                    self.finish_log(pending)  # needed now
                    pending = None
            if validating:
                started = time.perf_counter()
                val_loss = self.validate()
                self.report.log_validation(st.step, val_loss)
                self.excluded_s += time.perf_counter() - started  # validation time is not training time
            self.report.advance(st.step)
            saving = time.perf_counter()
            if st.losses and cfg.training.on_nan == "stop" and self.checkpointer.should_save(st.step, last):
                self.check_finite_losses()  # never write a checkpoint of NaN weights
            self.checkpointer.save(st.step, last=last)  # every checkpoint.interval steps, and the last
            self.excluded_s += time.perf_counter() - saving  # time blocked by a save is logged by it, not here
            if stop:
                self.report.info(f"{self.preemption.received}: stopped after step {st.step}; " + (
                    f"checkpoint saved under {self.checkpointer.root}, run the same command to resume"
                    if cfg.checkpoint.enable else "nothing saved (checkpoint.enable=false)"))
                break
        self.checkpointer.wait()  # under the handler: a signal now is noted and cannot cut the save short
        self.preemption.restore()
        self.profiler.close()
        return self.report.finish(st.step, val_loss)

    def log_point(self, grad_norm: torch.Tensor, steps: int) -> LogPoint:
        """Queue the figures of the log step just taken (the last `steps` steps) for the host; the
        next log interval starts where this one ends."""
        st = self.state
        values = torch.cat([global_step_losses(st.losses, self.dims.world_size), grad_norm.float().reshape(1)])
        st.losses.clear()
        if values.is_cuda:
            values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True).copy_(values, non_blocking=True)
        point = LogPoint(st.step, self.step_lr, st.tokens_seen, steps, values, self.timer.take(), self.interval_start,
                         self.excluded_s, self.timer.mark())
        self.interval_start, self.excluded_s = point.done, 0.0
        return point

    def finish_log(self, point: LogPoint) -> None:
        """Log `point` once its step has finished (with on_nan=stop, raise naming a non-finite step)."""
        self.timer.wait(point.done)
        *step_losses, grad_norm = point.values.tolist()
        check_finite(step_losses, point.step, self.cfg.training.on_nan)
        elapsed_s = self.timer.elapsed_ms(point.since, point.done) / 1000 - point.excluded_s
        self.report.log_step(point.step, step_losses, point.lr, grad_norm, elapsed_s, point.steps,
                             point.tokens_seen, self.timer.collect(point.marks), self.timer.method)

    def check_finite_losses(self) -> None:
        """With on_nan=stop, raise naming the first non-finite step since the last log step (the steps'
        global mean losses, one host sync)."""
        step_losses = global_step_losses(self.state.losses, self.dims.world_size).tolist()
        check_finite(step_losses, self.state.step, self.cfg.training.on_nan)

    def close(self):
        """Release what the run holds. The process group is left to the caller (`main`), which
        destroys it only once the Trainer and its DDP wrapper are gone."""
        try:
            if self.cuda_graph is not None:
                self.cuda_graph.release()  # before the process group goes (a captured collective hangs its teardown)
            self.checkpointer.close()  # waits for an async save in flight, still under the signal handler
        finally:
            self.preemption.restore()
        self.report.close()


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    watch_launcher()  # under torchrun: stop when the launcher dies
    cfg = load_config(argv)
    trainer = Trainer(cfg)
    failure = None  # raised once the Trainer is gone
    try:
        trainer.train()
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        failure = SystemExit(3)
    except CheckpointSaveError as e:  # one line, from rank 0 (every rank sees the same failure)
        if trainer.dims.is_main:
            print(f"error: {e}", file=sys.stderr)
        failure = SystemExit(1)
    except BaseException as e:
        failure = e
        if not isinstance(e, (ConfigError, SystemExit)):
            traceback.print_exc()  # shown now: its frames hold the Trainer, so it is dropped below
            failure = SystemExit(130 if isinstance(e, KeyboardInterrupt) else 1)
        e.with_traceback(None)  # in place: whoever else holds the exception must not keep the frames
    try:
        trainer.close()
    finally:
        # The DDP wrapper goes before its process group: one that outlives it can hang its rank
        # while the process exits (seen on gloo with 2 and 4 ranks).
        del trainer
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    if failure is not None:
        raise failure


if __name__ == "__main__":
    run_cli(main)
