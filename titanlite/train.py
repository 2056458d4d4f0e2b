"""The Trainer: config -> build on meta -> parallelize -> materialise -> train loop.

Read it top to bottom: `Trainer.__init__` builds everything, `train_step` is one optimizer step
(with gradient accumulation), `train` is the loop with logging, validation and checkpoints.
Host syncs (`.item()`, printing) happen only on log steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import os
import platform
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from titanlite.checkpoint import Checkpointer, Preemption, checkpoint_root
from titanlite.config import ConfigError, JobConfig, load_config, resolve_batch, run_cli, to_dict, to_toml
from titanlite.config.manager import autocasts
from titanlite.data import build_data
from titanlite.debug import FaultInjector
from titanlite.metrics.breakdown import gather_breakdown, rank_breakdown
from titanlite.metrics.console import Console
from titanlite.metrics.nvml import GpuMonitor
from titanlite.metrics.peaks import peak_tflops
from titanlite.metrics.profiler import StepProfiler
from titanlite.metrics.run_log import RunLog
from titanlite.metrics.tensorboard import TensorBoard
from titanlite.metrics.timing import StepTimer
from titanlite.models import build_model, get_model_args
from titanlite.ops.attention import resolve_backend
from titanlite.ops.loss import cross_entropy
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallel import clip_grad_norm, float8_post_step, grad_sync, init_distributed, parallelize
from titanlite.parallel.data_parallel import fused_clip_supported
from titanlite.parallel.launcher_watch import watch_launcher
from titanlite.parallel.cuda_graphs import CudaGraphStep

logger = logging.getLogger("titanlite")


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    losses: list = field(default_factory=list)  # per-step loss tensors since the last log step (on device)

    def state_dict(self):
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, sd):
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])


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
                              f"vocabulary ({self.data.vocab_size})")
        self.attention_backend = resolve_backend(cfg.model.attention_backend, self.device)

        # Build on meta (no memory); parallelize applies float8 -> AC -> compile, materialises and
        # initialises the full weights identically on every rank, then wraps for data parallelism.
        with torch.device("meta"):
            model = build_model(self.model_args, self.attention_backend, cfg.training.seq_len,
                                cfg.training.loss_chunk_tokens)
        model = parallelize(model, cfg, self.dims)
        self.model = model
        self.optimizer = build_optimizer(model, cfg, self.device, self.dims.mode)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg)
        fuse = cfg.optimizer.fuse_clip and fused_clip_supported(self.optimizer)
        self.fused_clip_optimizer = self.optimizer if fuse else None  # clip scale goes into the AdamW kernel
        self.optimizer_skips_nonfinite = fuse and cfg.training.on_nan == "skip"
        self.state = TrainState()
        # Checkpoints: resume (or initial safetensors load) now, before anything reads the state.
        self.checkpointer = Checkpointer(
            cfg, self.dims, self.model, self.optimizer,
            stateful={"lr_scheduler": self.lr_scheduler, "train_state": self.state},
            per_rank={"dataloader": self.train_iter},
            info={"model": {"name": cfg.model.name, "flavor": cfg.model.flavor, "max_seq_len": cfg.training.seq_len,
                            "args": dataclasses.asdict(self.model_args)},
                  "tokenizer": str(getattr(self.data, "tokenizer_path", "") or "")})
        self.checkpointer.load()
        self.start_step = self.state.step  # where this process began (0, or the resumed step)
        self.preemption = Preemption(self.checkpointer.group)  # SIGTERM/SIGINT: finish the step, save, exit
        self.timer = StepTimer(self.device, model)  # phases + gradient-ready hooks for exposed comm
        self.faults = FaultInjector(cfg.debug, self.dims.rank)
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16)
                         if autocasts(cfg, self.dims.world_size, self.device.type) else None)
        # training.loss=cross_entropy takes logits; compiled with the blocks (chunked compiles itself)
        self.loss_fn = (torch.compile(cross_entropy) if cfg.compile.enable and cfg.training.loss == "cross_entropy"
                        else cross_entropy)
        self.cuda_graph = CudaGraphStep.build(self)  # None unless training.cuda_graphs can run here

        self.n_params = self.model_args.num_params()
        self.flops_per_token = self.model_args.flops_per_token(cfg.training.seq_len)
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else platform.processor() or "cpu"
        # CPU: only an explicit --metrics.peak_tflops gives MFU (the table holds GPUs)
        self.peak = peak_tflops(self.device_name if self.device.type == "cuda" else "", cfg.metrics.peak_tflops)
        if self.device.type == "cuda" and self.peak is None:
            logger.warning(f"no bf16 peak known for '{self.device_name}': set --metrics.peak_tflops to see MFU")
        self.console = Console(self.dims.is_main, cfg.training.steps, cfg.metrics.progress_bar,
                               start_step=self.state.step)
        self.run_log = RunLog(cfg.job.dump_folder, self.startup_info()) if self.dims.is_main else None
        if self.dims.is_main:
            with open(os.path.join(cfg.job.dump_folder, f"run_{self.run_log.stamp}_config.toml"), "w") as fh:
                fh.write(to_toml(cfg))
        self.tensorboard = (TensorBoard(cfg.job.dump_folder, self.run_log.stamp)
                            if self.run_log and cfg.metrics.enable_tensorboard else None)
        self.profiler = StepProfiler(cfg.profiling, cfg.job.dump_folder, self.dims.rank, self.device)
        self.gpu_monitor = GpuMonitor(self.device)

    # ----------------------------------------------------------------------------------------- info
    def startup_info(self) -> dict:
        cfg = self.cfg
        resolved = to_dict(cfg)
        flat = {f"{s}.{k}": v for s, table in resolved.items() for k, v in table.items()}
        config = {
            **flat,
            # keys the seed guides' analysis snippets read
            "world_size": self.dims.world_size,
            "batch_size": cfg.training.local_batch_size,
            "gradient_accumulation_steps": self.grad_accum,
            "global_batch_size": self.global_batch,
            "seq_len": cfg.training.seq_len,
            "compile": cfg.compile.enable,
            "use_cuda_graphs": cfg.training.cuda_graphs,
            "use_dataloader": cfg.training.dataset != "synthetic",
            "attention_backend": self.attention_backend,
            "data_parallel": self.dims.mode,
        }
        hardware = {"device": self.device.type, "name": self.device_name, "count": self.dims.world_size,
                    "peak_tflops_per_gpu": self.peak}
        if self.device.type == "cuda":
            hardware["memory_gb"] = round(torch.cuda.get_device_properties(self.device).total_memory / 2**30, 1)
        return {
            "config": config,
            "resolved_config": resolved,
            "hardware": hardware,
            "software": {"python": platform.python_version(), "torch": torch.__version__,
                         "cuda": torch.version.cuda, "titanlite": _version()},
            "model": {"name": cfg.model.name, "flavor": cfg.model.flavor, "params": self.n_params,
                      "params_without_input_embedding": self.model_args.num_params(exclude_embedding=True),
                      "flops_per_token": self.flops_per_token,
                      "flops_convention": "6*(N - input embedding) + 12*L*H*Q*T"},
            "data": self.data.description,
        }

    # ----------------------------------------------------------------------------------------- step
    def next_batch(self):
        inputs, labels = next(self.train_iter)
        nb = self.device.type == "cuda"
        return inputs.to(self.device, non_blocking=nb), labels.to(self.device, non_blocking=nb)

    def forward_loss(self, inputs, labels) -> torch.Tensor:
        """Mean token loss, under bf16 autocast where the run uses it (config.manager.autocasts)."""
        with self.autocast if self.autocast is not None else contextlib.nullcontext():
            if self.cfg.training.loss == "chunked":
                return self.model(inputs, labels)  # linear + loss in chunks inside the model's forward
            logits = self.model(inputs)
        return self.loss_fn(logits, labels)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over grad_accum micro-batches; returns (mean loss, grad norm) on device.

        With training.cuda_graphs (after warm-up) the step is one graph replay; if capture fails the
        micro-batches it fetched run eagerly below (`batches`), so no data is skipped.
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
            total = torch.zeros((), device=self.device)
            for micro in range(self.grad_accum):
                with self.timer.phase("data"):
                    inputs, labels = batches[micro] if batches else self.next_batch()
                    self.faults.data()
                last = micro == self.grad_accum - 1
                if last:
                    with self.timer.phase("comm"):
                        self.faults.comm()
                with self.timer.phase("compute"), grad_sync(self.model, last):
                    self.faults.compute()
                    loss = self.forward_loss(inputs, labels) / self.grad_accum
                    loss.backward()
                total += loss.detach()
            skipped = False
            with self.timer.phase("optimizer"):
                grad_norm = clip_grad_norm(self.model, self.cfg.training.max_norm, self.fused_clip_optimizer,
                                           skip_nonfinite=self.cfg.training.on_nan == "skip")
                if self.optimizer_skips_nonfinite:
                    self.optimizer.step()  # the fused kernel skips a non-finite step on device, no sync
                    float8_post_step(self.model, self.cfg)
                elif self.cfg.training.on_nan == "skip" and not torch.isfinite(grad_norm):  # one sync per step
                    # the norm is global after the gradient sync, so every rank skips together, and an
                    # overflow in backward with a finite loss is caught too
                    logger.warning(f"step {self.state.step + 1}: non-finite gradients, update skipped")
                    skipped = True
                else:
                    self.optimizer.step()
                    float8_post_step(self.model, self.cfg)
                self.optimizer.zero_grad(set_to_none=True)
                self.step_lr = self.lr_scheduler.get_last_lr()[0]  # the lr this step used (read on log steps)
                # A skipped step still uses up its lr. When it is the process's first step, torch would
                # warn of a misordered call; the filter is scoped to that case (entering catch_warnings
                # resets which warnings were already shown, so it is not entered on every step).
                with warnings.catch_warnings() if skipped else contextlib.nullcontext():
                    if skipped:
                        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
                    self.lr_scheduler.step()
        return total, grad_norm

    @torch.no_grad()
    def validate(self) -> float:
        self.model.eval()
        it, total, n = self.data.make_val(), torch.zeros((), device=self.device), 0
        for _ in range(self.cfg.validation.steps):
            try:
                inputs, labels = next(it)
            except StopIteration:
                break
            total += self.forward_loss(inputs.to(self.device), labels.to(self.device))
            n += 1
        self.model.train()
        stats = torch.stack([total, torch.tensor(float(n), device=self.device)])
        if self.dims.world_size > 1:
            dist.all_reduce(stats)
        return (stats[0] / stats[1].clamp(min=1)).item()

    # ----------------------------------------------------------------------------------------- loop
    def train(self) -> dict:
        cfg, st = self.cfg, self.state
        self.console.info(f"model {cfg.model.name}/{cfg.model.flavor}: {self.n_params:,} params, "
                          f"{self.flops_per_token / 1e9:.2f} GFLOP/token | attention {self.attention_backend} | "
                          f"{self.dims.world_size} x {self.device_name} ({self.dims.mode}) | global batch "
                          f"{self.global_batch} = {cfg.training.local_batch_size} x {self.dims.dp_size} x "
                          f"{self.grad_accum} accum | data: {self.data.description}")
        self.console.info(f"run log: {self.run_log.path}" if self.run_log else "")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        interval_start, interval_steps, val_loss = time.perf_counter(), 0, None
        grad_norm = torch.zeros(())
        self.preemption.install()
        while st.step < cfg.training.steps:
            interval_start += self.profiler.step(st.step + 1)  # writing a trace is not training time
            loss, grad_norm = self.train_step()
            st.step += 1
            st.tokens_seen += self.tokens_per_step
            st.losses.append(loss)
            interval_steps += 1
            stop = self.preemption.requested()  # agreed by every rank, so all stop after this step
            last = st.step == cfg.training.steps or stop
            if st.step % cfg.metrics.log_freq == 0 or last or st.step == 1:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = time.perf_counter() - interval_start
                self.log_step(elapsed, interval_steps, grad_norm)
                interval_start, interval_steps = time.perf_counter(), 0
            if cfg.validation.enable and (st.step % cfg.validation.freq == 0 or last) and not stop:
                validating = time.perf_counter()
                val_loss = self.validate()
                self.console.info(f"step {st.step}: validation loss {val_loss:.4f}")
                if self.run_log:
                    self.run_log.add_validation({"iter": st.step, "val_loss": val_loss})
                if self.tensorboard:
                    self.tensorboard.log_validation(st.step, val_loss)
                interval_start += time.perf_counter() - validating  # validation time is not training time
            self.console.advance(st.step)
            saving = time.perf_counter()
            if st.losses and cfg.training.on_nan == "stop" and self.checkpointer.should_save(st.step, last):
                self.check_finite_losses(len(st.losses))  # never write a checkpoint of NaN weights
            self.checkpointer.save(st.step, last=last)  # every checkpoint.interval steps, and the last
            interval_start += time.perf_counter() - saving  # time blocked by a save is logged by it, not here
            if stop:
                self.console.info(f"{self.preemption.received}: stopped after step {st.step}; " + (
                    f"checkpoint saved under {self.checkpointer.root}, run the same command to resume"
                    if cfg.checkpoint.enable else "nothing saved (checkpoint.enable=false)"))
                break
        self.preemption.restore()
        self.checkpointer.wait()
        self.profiler.close()
        if self.tensorboard:
            self.tensorboard.close()
        summary = self.summary(val_loss)
        self.console.close()
        self.console.info(" | ".join(f"{k} {v}" for k, v in summary.items()))
        if self.run_log:
            self.run_log.set_summary(summary)
        return summary

    def check_finite_losses(self, steps: int) -> list[float]:
        """Global mean loss of each step since the last log step (one host sync); with on_nan=stop,
        raise naming the first non-finite step."""
        st = self.state
        losses = torch.stack(st.losses).float()
        if self.dims.world_size > 1:  # each rank saw its own micro-batches: report the global mean
            dist.all_reduce(losses, op=dist.ReduceOp.AVG)
        step_losses = losses.tolist()
        bad = [st.step - steps + 1 + i for i, v in enumerate(step_losses) if not math.isfinite(v)]
        if bad and self.cfg.training.on_nan == "stop":
            raise NonFiniteLossError(f"loss became non-finite at step {bad[0]} (training.on_nan=stop); "
                                     f"lower optimizer.lr or set training.on_nan=skip")
        return step_losses

    def log_step(self, elapsed: float, steps: int, grad_norm: torch.Tensor) -> None:
        st = self.state
        step_losses = self.check_finite_losses(steps)
        st.losses.clear()
        time_ms = elapsed / steps * 1000
        tps = self.tokens_per_step / (time_ms / 1000)
        tflops = tps * self.flops_per_token / 1e12
        entry = {
            "iter": st.step,
            "loss": step_losses[-1],
            "step_losses": step_losses,
            "lr": float(self.step_lr),
            "grad_norm": float(grad_norm),
            "time_ms": time_ms,
            "tokens_per_sec": tps,
            "tokens_per_sec_per_gpu": tps / self.dims.world_size,
            "tflops": tflops,
            "mfu": 100 * tflops / (self.dims.world_size * self.peak) if self.peak else None,
            "tokens_seen": st.tokens_seen,
        }
        entry.update(memory_stats(self.device))
        gpu = self.gpu_monitor.sample()  # NVML utilisation / power / SM clock, where present
        entry.update(gpu)
        local = rank_breakdown(self.dims.rank, time_ms, self.timer.collect(), steps)
        local.update(gpu, memory_peak_gb=entry["memory_peak_gb"])
        entry["breakdown"] = gather_breakdown(local, self.timer.method)  # one all_gather_object; None off rank 0
        if self.run_log:
            self.run_log.append(entry)
        if self.tensorboard:
            self.tensorboard.log_step(entry)
        self.console.log_step(entry)

    def summary(self, val_loss) -> dict:
        it = self.run_log.data["training_iterations"] if self.run_log else []
        steady = it[1:] or it  # the first entry holds start-up and compilation
        out = {"steps": self.state.step}  # only figures the run produced: no "val_loss None" without validation
        if it:
            out["final_loss"] = round(it[-1]["loss"], 4)
        if val_loss is not None:
            out["val_loss"] = round(val_loss, 4)
        if steady:
            out["tokens_per_sec"] = round(sum(e["tokens_per_sec"] for e in steady) / len(steady))
            if steady[-1]["mfu"] is not None:
                out["mfu_pct"] = round(sum(e["mfu"] for e in steady) / len(steady), 2)
            out["peak_memory_gb"] = max(e["memory_peak_gb"] for e in it)
        return out

    def close(self):
        """Release what the run holds. The process group is left to the caller (`main`), which
        destroys it only once the Trainer and its DDP wrapper are gone."""
        self.preemption.restore()
        if self.cuda_graph is not None:
            self.cuda_graph.release()  # before the process group goes (a captured collective hangs its teardown)
        self.checkpointer.close()  # waits for an async save in flight


def memory_stats(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"memory_gb": round(torch.cuda.memory_allocated(device) / 2**30, 3),
                "memory_peak_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
                "memory_reserved_gb": round(torch.cuda.memory_reserved(device) / 2**30, 3),
                # what torchtitan's log line calls "memory" (max reserved by the caching allocator)
                "memory_reserved_peak_gb": round(torch.cuda.max_memory_reserved(device) / 2**30, 3)}
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return {"memory_gb": round(rss, 3), "memory_peak_gb": round(rss, 3), "memory_reserved_gb": round(rss, 3)}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("titanlite")
    except Exception:
        return "unknown"


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
