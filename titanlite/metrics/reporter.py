"""What a run reports: the startup record, one entry per log step (run log, TensorBoard, console,
per-rank breakdown, GPU counters), validation results and the closing summary.

The Trainer hands it the measured figures; everything derived from them (rates, MFU, memory) is
computed here, once, on log steps only (they are the only host syncs of the loop).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform

import torch

from titanlite.config import to_dict, to_toml
from titanlite.metrics.breakdown import gather_breakdown, rank_breakdown
from titanlite.metrics.console import Console
from titanlite.metrics.nvml import GpuMonitor
from titanlite.metrics.run_log import RunLog, host_facts, summarize
from titanlite.metrics.tensorboard import TensorBoard
from titanlite.metrics.weights_biases import WandB
from titanlite.models.args import FLOPS_CONVENTION, mfu_pct

logger = logging.getLogger("titanlite")


@dataclasses.dataclass
class RunFacts:
    """What the startup record and the rates need to know about the run."""
    world_size: int
    mode: str
    grad_accum: int
    global_batch: int
    tokens_per_step: int
    attention_backend: str
    device: torch.device
    device_name: str
    peak_tflops: float | None
    n_params: int
    n_params_without_input_embedding: int
    flops_per_token: int
    data_description: str


def startup_info(cfg, f: RunFacts) -> dict:
    resolved = to_dict(cfg)
    flat = {f"{s}.{k}": v for s, table in resolved.items() for k, v in table.items()}
    config = {
        **flat,
        # keys the users' earlier trainer's analysis snippets read (docs/observability.md)
        "world_size": f.world_size,
        "batch_size": cfg.training.local_batch_size,
        "gradient_accumulation_steps": f.grad_accum,
        "global_batch_size": f.global_batch,
        "seq_len": cfg.training.seq_len,
        "compile": cfg.compile.enable,
        "use_cuda_graphs": cfg.training.cuda_graphs,
        "use_dataloader": cfg.training.dataset != "synthetic",
        "attention_backend": f.attention_backend,
        "data_parallel": f.mode,
    }
    hardware = {"device": f.device.type, "name": f.device_name, "count": f.world_size,
                "peak_tflops_per_gpu": f.peak_tflops, "host": host_facts(torch.get_num_threads(), cfg.data.num_workers)}
    if f.device.type == "cuda":
        hardware["memory_gb"] = round(torch.cuda.get_device_properties(f.device).total_memory / 2**30, 1)
    return {
        "config": config,
        "resolved_config": resolved,
        "hardware": hardware,
        "software": {"python": platform.python_version(), "torch": torch.__version__,
                     "cuda": torch.version.cuda, "titanlite": _version()},
        "model": {"name": cfg.model.name, "flavor": cfg.model.flavor, "params": f.n_params,
                  "params_without_input_embedding": f.n_params_without_input_embedding,
                  "flops_per_token": f.flops_per_token, "flops_convention": FLOPS_CONVENTION},
        "data": f.data_description,
    }


class Reporter:
    def __init__(self, cfg, facts: RunFacts, is_main: bool, rank: int, start_step: int, host_group=None,
                 write_log: bool = True):
        # host_group: a gloo group for the breakdown's gather, so a log step finished while the next
        # step runs does not queue a collective behind that step on the GPU and wait for it
        self.facts, self.rank, self.host_group = facts, rank, host_group
        self.console = Console(is_main, cfg.training.steps, cfg.metrics.progress_bar, start_step=start_step)
        self.run_log = RunLog(cfg.job.dump_folder, startup_info(cfg, facts)) if is_main and write_log else None
        if self.run_log:
            with open(os.path.join(cfg.job.dump_folder, f"run_{self.run_log.stamp}_config.toml"), "w") as fh:
                fh.write(to_toml(cfg))
        self.tensorboard = (TensorBoard(cfg.job.dump_folder, self.run_log.stamp)
                            if self.run_log and cfg.metrics.enable_tensorboard else None)
        self.wandb = (WandB(cfg, self.run_log.data["startup_info"]["config"], f"run_{self.run_log.stamp}")
                      if self.run_log and cfg.metrics.enable_wandb else None)
        self.loggers = [x for x in (self.tensorboard, self.wandb) if x is not None]  # scalars, rank 0
        self.gpu_monitor = GpuMonitor(facts.device)
        self._retries_seen: int | None = None  # alloc_retries at the previous log step
        self._warned_retries = False

    def info(self, line: str) -> None:
        self.console.info(line)

    def log_step(self, step: int, step_losses: list[float], lr: float, grad_norm: float, elapsed_s: float,
                 steps: int, tokens_seen: int, phases: dict[str, float | None], timing_method: str,
                 warmup: bool = False) -> None:
        """One log entry over the `steps` optimizer steps since the last one (all ranks call it);
        `phases` is StepTimer.collect's figures over those steps; `warmup` marks an interval the
        steady state leaves out whatever its step (one holding a CUDA-graph capture)."""
        f = self.facts
        time_ms = elapsed_s / steps * 1000
        tps = f.tokens_per_step / (time_ms / 1000)
        entry = {
            "iter": step,
            "loss": step_losses[-1],
            "step_losses": step_losses,
            "lr": float(lr),
            "grad_norm": float(grad_norm),
            "time_ms": time_ms,
            "tokens_per_sec": tps,
            "tokens_per_sec_per_gpu": tps / f.world_size,
            "tflops": tps * f.flops_per_token / 1e12,
            "mfu": mfu_pct(tps, f.flops_per_token, f.world_size, f.peak_tflops),
            "tokens_seen": tokens_seen,
            **({"warmup": True} if warmup else {}),
        }
        entry.update(memory_stats(f.device))
        self._warn_on_cache_releases(entry.get("alloc_retries"))
        gpu = self.gpu_monitor.sample()  # NVML utilisation / power / SM clock, where present
        entry.update(gpu)
        local = rank_breakdown(self.rank, time_ms, phases, steps)
        local.update(gpu, memory_peak_gb=entry["memory_peak_gb"])
        entry["breakdown"] = gather_breakdown(local, timing_method, self.host_group)  # None off rank 0
        if self.run_log:
            self.run_log.append(entry)
        for scalars in self.loggers:
            scalars.log_step(entry)
        self.console.log_step(entry)

    def _warn_on_cache_releases(self, retries: int | None) -> None:
        """Once per run: the allocator began releasing its cache to make room (each release waits for
        the GPU). The first log step's retries are compilation's and warm-up's, so they only set the
        baseline."""
        if retries is None or self._warned_retries:
            return
        if self._retries_seen is not None and retries > self._retries_seen:
            logger.warning(f"memory is tight on rank {self.rank}: the CUDA caching allocator released its cache "
                           f"{retries - self._retries_seen} time(s) since the last log step to make room, and each "
                           f"release waits for the GPU; a smaller local batch (with more accumulation) or activation "
                           f"checkpointing leaves room (alloc_retries in the run log)")
            self._warned_retries = True
        self._retries_seen = retries

    def log_validation(self, step: int, val_loss: float) -> None:
        self.console.info(f"step {step}: validation loss {val_loss:.4f}")
        if self.run_log:
            self.run_log.add_validation({"iter": step, "val_loss": val_loss})
        for scalars in self.loggers:
            scalars.log_validation(step, val_loss)

    def advance(self, step: int) -> None:
        self.console.advance(step)

    def finish(self, steps: int, val_loss: float | None) -> dict:
        """The run's summary: printed as one line, stored in the run log, returned."""
        for scalars in self.loggers:
            scalars.close()
        self.loggers = []
        summary = self.summary(steps, val_loss)
        self.console.close()
        self.console.info(" | ".join(f"{k} {v}" for k, v in summary.items()))
        if self.run_log:
            self.run_log.set_summary(summary)
        return summary

    def summary(self, steps: int, val_loss: float | None) -> dict:
        log = self.run_log.data if self.run_log else {"training_iterations": [], "startup_info": {"config": {}}}
        out = {"steps": steps, **summarize(log["training_iterations"], log["startup_info"]["config"])}
        return out | ({"val_loss": round(val_loss, 4)} if val_loss is not None else {})

    def close(self) -> None:
        for scalars in self.loggers:  # a run that stopped early: its W&B run is finished, its files closed
            scalars.close()
        self.loggers = []
        self.console.close()


def memory_stats(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"memory_gb": round(torch.cuda.memory_allocated(device) / 2**30, 3),
                "memory_peak_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
                "memory_reserved_gb": round(torch.cuda.memory_reserved(device) / 2**30, 3),
                # what torchtitan's log line calls "memory" (max reserved by the caching allocator)
                "memory_reserved_peak_gb": round(torch.cuda.max_memory_reserved(device) / 2**30, 3),
                # times an allocation found no room, released the allocator's cache and retried (cumulative)
                "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0)}
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return {"memory_gb": round(rss, 3), "memory_peak_gb": round(rss, 3), "memory_reserved_gb": round(rss, 3)}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("titanlite")
    except Exception:
        return "unknown"
