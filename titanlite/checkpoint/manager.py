"""Distributed checkpoints with torch.distributed.checkpoint (DCP).

Layout: `<job.dump_folder>/<checkpoint.folder>/step-N/` holds DCP's files and, written last by
rank 0 once every rank's data is on disk, `complete.json` (step, world size, file sizes, model
spec). Only folders with that marker count; start-up takes the newest one whose files still match
the recorded sizes and that DCP can read, falling back to older ones with a warning.

What goes in:
- model and optimizer, keyed by parameter name (get_state_dict with a flattened optimizer state),
  so DCP reshards across parallelism changes (fsdp on 2 ranks -> ddp on 1, ...);
- `stateful` objects that are identical on every rank (lr scheduler, train state);
- `per_rank` objects that differ per rank (the data loader), stored as `<name>.rank_<r>`, plus
  each rank's RNG states.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from titanlite.config import ConfigError

logger = logging.getLogger("titanlite")
# A single process passes no_dist=True on purpose; DCP still warns about it on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

MARKER = "complete.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
# Optimizer state keyed "state.<param>.<key>" / "param_groups.<param>.<key>": one entry per
# parameter, independent of how the optimizer groups or partitions them (zero1 included).
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def checkpoint_root(cfg) -> Path:
    return Path(cfg.job.dump_folder) / cfg.checkpoint.folder


def step_dirs(root: Path) -> dict[int, Path]:
    """step -> folder for every step-N folder under root (complete or not)."""
    if not root.is_dir():
        return {}
    return {int(m.group(1)): p for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()}


def read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def complete_steps(root: Path) -> list[int]:
    """Steps with a completion marker, newest first."""
    return sorted((s for s, p in step_dirs(root).items() if read_marker(p) is not None), reverse=True)


def verify_files(folder: Path, marker: dict) -> str | None:
    """A reason the folder differs from what was written (missing or truncated file), or None."""
    for name, size in marker.get("files", {}).items():
        path = folder / name
        if not path.exists():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size} bytes, {size} were written"
    return None


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _optimizers(optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state maps to parameters: ZeroRedundancyOptimizer's local one for zero1
    (this rank's partition; the per-parameter keys make the partitions disjoint in the checkpoint)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


class Checkpointer:
    def __init__(self, cfg, dims, model, optimizer, stateful: dict, per_rank: dict, info: dict | None = None):
        self.cfg, self.ck, self.dims = cfg, cfg.checkpoint, dims
        self.model, self.optimizer = model, optimizer
        self.stateful, self.per_rank, self.info = stateful, per_rank, info or {}
        self.root = checkpoint_root(cfg)
        distributed = dims.world_size > 1 and dist.is_initialized()
        # DCP's planning collectives run on their own gloo groups: host-side, never a GPU sync, and
        # a background async save never shares a group with the training thread.
        self.group = dist.new_group(backend="gloo") if distributed else None
        self.async_mode = self.ck.async_mode if self.ck.enable else "disabled"
        self.async_group = (dist.new_group(backend="gloo")
                            if distributed and self.async_mode != "disabled" else None)
        self.stager = self._build_stager()
        self.pending = None  # (step, future) of the async save in flight
        self.last_saved = -1

    # ------------------------------------------------------------------------------------- state
    def _state(self) -> dict:
        """The full state of this rank; tensors are the live ones (DCP loads into them in place)."""
        model_sd, optim_sd = get_state_dict(self.model, _optimizers(self.optimizer), options=OPTIONS)
        state = {"model": model_sd, "optimizer": optim_sd}
        state.update({name: obj.state_dict() for name, obj in self.stateful.items()})
        rank = f"rank_{self.dims.rank}"
        # Per-rank objects are pickled into one opaque value each: their structure may vary (a
        # loader's worker states) and DCP must not merge them across ranks.
        for name, obj in self.per_rank.items():
            state[name] = {rank: pickle.dumps(obj.state_dict())}
        state["rng"] = {rank: pickle.dumps(rng_state())}
        return state

    # -------------------------------------------------------------------------------------- save
    def _build_stager(self):
        """The stager of async_with_pinned_mem: host buffers reused from save to save (pinned on CUDA,
        plain host memory elsewhere), so each save's device-to-host copy allocates nothing."""
        if self.async_mode != "async_with_pinned_mem":
            return None
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:  # older torch
            logger.info("checkpoint.async_mode=async_with_pinned_mem needs torch's DefaultStager: plain async")
            return None

        class KeptStager(DefaultStager):
            """Kept open from save to save; only the Checkpointer closes it, at the end of training.

            torch closes the inner StateDictStager after every stage (2.11: at the end of
            `DefaultStager._stage`), and some versions close the stager given to async_save once the
            write is done. Either empties its deep-copy table, so the next save of a state holding a
            class object fails with `KeyError: <class 'type'>`, and drops the cached host buffers this
            mode exists to reuse. Both closes are no-ops here until `release()`."""

            def __init__(self, options):
                super().__init__(options)
                inner = getattr(self, "_state_dict_stager", None)
                self._inner_close = getattr(inner, "close", None)
                if self._inner_close is not None:
                    inner.close = lambda: None  # shadows the method on this instance only

            def close(self) -> None:
                pass

            def release(self) -> None:
                if self._inner_close is not None:
                    self._state_dict_stager.close = self._inner_close
                super().close()

        cuda = torch.cuda.is_available()
        return KeptStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                         use_async_staging=False, use_non_blocking_copy=cuda))

    def should_save(self, step: int, last: bool) -> bool:
        return self.ck.enable and step != self.last_saved and (last or step % self.ck.interval == 0)

    def save(self, step: int, last: bool = False) -> None:
        """Call after every step: saves at checkpoint.interval steps and when `last` (end of training,
        preemption; synchronous), and completes a finished async save (marker, retention)."""
        if self.pending is not None and self.pending[1].done():
            self.wait()
        if not self.should_save(step, last):
            return
        start = time.perf_counter()  # everything from here on blocks training
        self.wait()  # one save in flight at a time
        folder = self.root / f"step-{step}"
        if self.dims.is_main and folder.exists():
            shutil.rmtree(folder)  # a stale folder of the same step from an earlier, interrupted run
        self._barrier()
        state = self._state()
        if self.async_mode == "disabled" or last:
            dcp.save(state, checkpoint_id=str(folder), process_group=self.group, no_dist=self.group is None)
            self._complete(step, folder)
            if self.dims.is_main:
                logger.info(f"checkpoint step-{step} saved in {time.perf_counter() - start:.2f} s")
        else:
            kw = {"async_stager": self.stager} if self.stager is not None else {}
            fut = dcp.async_save(state, checkpoint_id=str(folder), process_group=self.async_group, **kw)
            fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse on newer torch with async staging
            self.pending = (step, fut)
            if self.dims.is_main:
                logger.info(f"checkpoint step-{step}: training blocked {time.perf_counter() - start:.2f} s, "
                            f"writing in the background")
        self.last_saved = step

    def wait(self) -> None:
        """Block until the async save in flight (if any) is on disk, then complete it; re-raise its failure.

        The marker is written here, on the training thread (rank 0), at the first step after the
        background write has finished: a run killed before that simply lacks this checkpoint.
        """
        if self.pending is None:
            return
        step, fut = self.pending
        self.pending = None
        try:
            fut.result()
        except Exception as e:
            raise RuntimeError(f"async checkpoint step-{step} failed: {e}") from e
        self._complete(step, self.root / f"step-{step}")

    def _complete(self, step: int, folder: Path) -> None:
        """Rank 0, once every rank's files are written: the marker (atomically), then retention."""
        if not self.dims.is_main:
            return
        files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
        marker = {"step": step, "world_size": self.dims.world_size, "data_parallel": self.dims.mode,
                  "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"), "files": files, **self.info}
        tmp = folder / (MARKER + ".tmp")
        tmp.write_text(json.dumps(marker, indent=1))
        os.replace(tmp, folder / MARKER)
        self._retain(step)

    def _retain(self, newest: int) -> None:
        """Keep the newest checkpoint.keep_latest_k complete checkpoints; drop leftovers older than `newest`."""
        k = self.ck.keep_latest_k
        keep = set(complete_steps(self.root)[:k]) if k > 0 else set(step_dirs(self.root))
        for step, folder in step_dirs(self.root).items():
            if step < newest and step not in keep:
                shutil.rmtree(folder, ignore_errors=True)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    # -------------------------------------------------------------------------------------- load
    def load(self) -> int | None:
        """Resume from the newest loadable complete checkpoint (or checkpoint.load_step); else, with
        checkpoint.initial_load_path, start from Hugging Face safetensors. Returns the resumed step."""
        explicit = self.ck.load_step >= 0
        if self.ck.enable or explicit:
            steps = complete_steps(self.root)
            self._report_incomplete(steps[0] if steps else -1)
            if explicit:
                if self.ck.load_step not in steps:
                    raise ConfigError(f"checkpoint.load_step={self.ck.load_step}: no complete checkpoint "
                                      f"step-{self.ck.load_step} under {self.root} (complete: {sorted(steps) or 'none'})")
                steps = [self.ck.load_step]
            failures = []
            for step in steps:
                folder = self.root / f"step-{step}"
                problem = verify_files(folder, read_marker(folder) or {}) or self._try_load(folder)
                if problem is None:
                    if self.dims.is_main:
                        logger.info(f"resumed from checkpoint {folder} (step {step})")
                    return step
                failures.append(f"step-{step}: {problem}")
                if self.dims.is_main:
                    logger.warning(f"warning: checkpoint {folder} is unusable ({problem})"
                                   + ("; trying the previous one" if step != steps[-1] else ""))
            if failures:
                raise ConfigError(f"no checkpoint under {self.root} could be loaded ({'; '.join(failures)}); "
                                  f"move them away to start afresh")
        if self.ck.initial_load_path:
            from titanlite.checkpoint.hf import load_hf_into

            load_hf_into(self.model, self.ck.initial_load_path, self.info.get("model", {}))
            if hasattr(self.optimizer, "sync_masters"):  # training.bf16_params: fp32 masters follow the weights
                self.optimizer.sync_masters()
            if self.dims.is_main:
                logger.info(f"initial weights loaded from {self.ck.initial_load_path}")
        return None

    def _report_incomplete(self, newest_complete: int) -> None:
        if not self.dims.is_main:
            return
        for step, folder in sorted(step_dirs(self.root).items()):
            if step > newest_complete and read_marker(folder) is None:
                logger.warning(f"warning: checkpoint {folder} is incomplete (no {MARKER}: the run stopped while "
                               f"saving); skipped")

    def _try_load(self, folder: Path) -> str | None:
        """Load `folder` into the live objects; the reason on failure (DCP raises on every rank alike)."""
        try:
            self._load(folder)
        except ConfigError:
            raise  # the checkpoint is fine but does not fit this run's configuration (data, model)
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException; any unreadable checkpoint falls back
            return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:500]
        return None

    def _load(self, folder: Path) -> None:
        state = self._state()
        marker = read_marker(folder) or {}
        same_world = marker.get("world_size") == self.dims.world_size
        # Per-rank entries: each rank its own; with another rank count every rank gets rank 0's
        # (titanlite's loader state is a global stream position, so it re-shards from any rank's).
        source = f"rank_{self.dims.rank}" if same_world else "rank_0"
        for name in self.per_rank:
            state[name] = {source: b""}
        if not same_world:
            state.pop("rng")  # RNG streams belong to ranks; a new layout starts them from the seed
        dcp.load(state, checkpoint_id=str(folder), process_group=self.group, no_dist=self.group is None)
        set_state_dict(self.model, _optimizers(self.optimizer), model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=OPTIONS)
        for name, obj in self.stateful.items():
            obj.load_state_dict(state[name])
        for name, obj in self.per_rank.items():
            obj.load_state_dict(pickle.loads(state[name][source]))
        if same_world:
            set_rng_state(pickle.loads(state["rng"][source]))
        elif self.dims.is_main:
            logger.warning(f"warning: checkpoint saved by {marker.get('world_size')} ranks, this run has "
                           f"{self.dims.world_size}: model and optimizer are resharded by DCP")
        self._sync_lr()

    def _sync_lr(self) -> None:
        """Put the scheduler's current lr into every param group: ZeroRedundancyOptimizer copies its
        own (outer) groups' lr into the local optimizer at each step, so a loaded inner lr is not enough."""
        sched = self.stateful.get("lr_scheduler")
        if sched is None:
            return
        for group, lr in zip(self.optimizer.param_groups, sched.get_last_lr()):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr

    def close(self) -> None:
        try:
            self.wait()
        finally:  # a failed async save still releases the staging buffers
            if self.stager is not None:
                self.stager.release()
                self.stager = None
