"""Distributed checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is `<job.dump_folder>/<checkpoint.folder>/step-N/` (titanlite.checkpoint.layout):
- DCP's files: model and optimizer, keyed by parameter name (get_state_dict with a flattened
  optimizer state), so DCP reshards across parallelism changes (fsdp on 2 ranks -> ddp on 1, ...);
- per rank, titanlite's own state as JSON + safetensors, never pickle (titanlite.checkpoint.state_file):
  the `stateful` objects that are identical on every rank (lr scheduler, train state), the
  `per_rank` ones (the data loader) and the RNG streams;
- `complete.json`, written last by rank 0 once every rank's files are on disk: step, world size,
  layout format, size and CRC-32 of every file (titanlite.checkpoint.integrity), model spec, lr schedule.

Start-up takes the newest complete checkpoint (or checkpoint.load_step). Its format and model spec
are compared first: a mismatch is one error, not a reason to try older ones. Then sizes and
checksums (the ranks share the reading), then DCP loads it; a damaged or unreadable checkpoint is
reported and the previous one is tried. The step resumed from becomes the head of the line: later
checkpoints are moved aside (titanlite.checkpoint.lineage). A failed save stops the run with one
line naming the cause; the partial folder is removed and the earlier checkpoints stay.
"""

from __future__ import annotations

import json
import logging
import os
import random
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

from titanlite.checkpoint.integrity import ALGORITHM, checksum_problem, file_checksum, size_problem
from titanlite.checkpoint.layout import (FORMAT, MARKER, checkpoint_root, complete_steps, read_marker,
                                         step_dirs)
from titanlite.checkpoint.lineage import abandon_after, abandoned_steps, finish_interrupted
from titanlite.checkpoint.restricted import (RestrictedPlanner, RestrictedReader, UnsafeCheckpointError,
                                             read_metadata, unsafe_cause)
from titanlite.checkpoint.state_file import EncodedState, json_name, read_state
from titanlite.checkpoint.writer import StateWriter
from titanlite.config import ConfigError

logger = logging.getLogger("titanlite")

# Optimizer state keyed "state.<param>.<key>" / "param_groups.<param>.<key>": one entry per
# parameter, independent of how the optimizer groups or partitions them (zero1 included).
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

__all__ = ["Checkpointer", "CheckpointSaveError", "finished_line", "checkpoint_root", "complete_steps", "read_marker", "step_dirs",
           "MARKER"]


class CheckpointSaveError(RuntimeError):
    """A save failed; the message is the one line for the user (cause, what is kept)."""


def lr_schedule(cfg, global_batch: int | None) -> dict:
    """What the learning rate of a step depends on besides the step, and the global batch that turns
    steps into tokens: recorded in the marker, compared on resume."""
    s = cfg.lr_scheduler
    out = {"global_batch": global_batch, "training.steps": cfg.training.steps,
           "lr_scheduler.warmup_steps": s.warmup_steps, "lr_scheduler.decay_type": s.decay_type,
           "lr_scheduler.min_lr_factor": s.min_lr_factor}
    if s.decay_type == "wsd":
        out["lr_scheduler.decay_ratio"] = s.decay_ratio
    return out


def finished_line(step: int, total: int, root: Path) -> str:
    """What a job run again after it finished says (running the same command resumes, so a finished
    job's command resumes its last step): nothing left to train, and how to train on."""
    return (f"finished: checkpoint step-{step} under {root} has reached training.steps ({total}); nothing to train, "
            f"no run log written (raise training.steps to train on from step {step})")


def failure_cause(error: BaseException, folder: Path) -> str:
    """Why a save failed, in a few words: an OSError's reason and file where one is behind it (DCP
    wraps each rank's error in a CheckpointException, a BaseException), else the error's last line."""
    if isinstance(error, CheckpointException):
        errors = [f[0] if isinstance(f, tuple) else f for f in error.failures.values()] or [error]
    else:
        errors = [error]
    for e in errors:
        seen = set()
        while e is not None and id(e) not in seen:
            seen.add(id(e))
            if isinstance(e, OSError) and e.strerror:
                return f"{e.strerror}: {e.filename or folder}"
            e = e.__cause__ or e.__context__
    first = errors[0]
    lines = str(first).strip().splitlines()
    return f"{type(first).__name__}: {lines[-1] if lines else ''} ({folder})"[:400]


def _describe(model: dict, keys: list[str]) -> str:
    args = model.get("args", {})
    detail = ", ".join(f"{k}={args.get(k)}" for k in keys)
    return f"{model.get('name')}/{model.get('flavor')}" + (f" ({detail})" if detail else "")


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


# A single process calls DCP without a process group on purpose (no_dist=True); DCP still warns about it
# on every call.
DCP_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def quiet_single_process_dcp() -> None:
    """Silence DCP_SINGLE_PROCESS_WARNING, where a single-process Checkpointer starts (never at import).
    A process-wide filter: async saves call DCP from a background thread, which a filter scoped to a
    call (warnings.catch_warnings) would not reach."""
    warnings.filterwarnings("ignore", message=DCP_SINGLE_PROCESS_WARNING)


class Checkpointer:
    def __init__(self, cfg, dims, model, optimizer, stateful: dict, per_rank: dict, info: dict | None = None,
                 global_batch: int | None = None):
        self.cfg, self.ck, self.dims = cfg, cfg.checkpoint, dims
        self.model, self.optimizer = model, optimizer
        self.stateful, self.per_rank = stateful, per_rank
        self.info = {**(info or {}), "schedule": lr_schedule(cfg, global_batch)}
        self.root = checkpoint_root(cfg)
        distributed = dims.world_size > 1 and dist.is_initialized()
        # DCP's planning collectives run on their own gloo groups over the job's ranks (the mesh's, every
        # rank holding a share of the state): host-side, never a GPU sync, and a background async save
        # never shares a group with the training thread.
        self.group = dist.new_group(ranks=dims.ranks, backend="gloo") if distributed else None
        if self.group is None:
            quiet_single_process_dcp()
        self.async_mode = self.ck.async_mode if self.ck.enable else "disabled"
        self.async_group = (dist.new_group(ranks=dims.ranks, backend="gloo")
                            if distributed and self.async_mode != "disabled" else None)
        self.stager = self._build_stager()
        self.pending = None  # (step, future) of the async save in flight
        self.last_saved = -1

    # ------------------------------------------------------------------------------------- state
    def _state(self) -> dict:
        """Model and optimizer of this rank, for DCP; the tensors are the live ones (DCP loads into
        them in place)."""
        model_sd, optim_sd = get_state_dict(self.model, _optimizers(self.optimizer), options=OPTIONS)
        return {"model": model_sd, "optimizer": optim_sd}

    def _own_state(self) -> dict:
        """titanlite's state of this rank, stored as JSON + tensors by the rank itself: `per_rank`
        objects and RNG streams are this rank's, `stateful` ones the same on every rank."""
        return {"stateful": {name: obj.state_dict() for name, obj in self.stateful.items()},
                "per_rank": {name: obj.state_dict() for name, obj in self.per_rank.items()},
                "rng": rng_state()}

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
        preemption; synchronous), and completes a finished async save (marker, retention). A failed
        save raises CheckpointSaveError."""
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
        writer = StateWriter(folder, EncodedState(self.dims.rank, self._own_state()))
        state = self._state()
        if self.async_mode == "disabled" or last:
            try:
                dcp.save(state, storage_writer=writer, process_group=self.group, no_dist=self.group is None)
                self._complete(step, folder)
            except (Exception, CheckpointException) as e:  # DCP's is a BaseException
                self._failed(step, folder, e)
            if self.dims.is_main:
                logger.info(f"checkpoint step-{step} saved in {time.perf_counter() - start:.2f} s")
        else:
            kw = {"async_stager": self.stager} if self.stager is not None else {}
            fut = dcp.async_save(state, storage_writer=writer, process_group=self.async_group, **kw)
            fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse on newer torch with async staging
            self.pending = (step, fut)
            if self.dims.is_main:
                logger.info(f"checkpoint step-{step}: training blocked {time.perf_counter() - start:.2f} s, "
                            f"writing in the background")
        self.last_saved = step

    def wait(self) -> None:
        """Block until the async save in flight (if any) is on disk, then complete it; a failure
        raises CheckpointSaveError.

        The marker is written here, on the training thread (rank 0), at the first step after the
        background write has finished: a run killed before that simply lacks this checkpoint.
        """
        if self.pending is None:
            return
        step, fut = self.pending
        self.pending = None
        folder = self.root / f"step-{step}"
        try:
            fut.result()
            self._complete(step, folder)
        except (Exception, CheckpointException) as e:
            self._failed(step, folder, e)

    def _failed(self, step: int, folder: Path, error: BaseException) -> None:
        """Remove what the failed save left (rank 0; it has no marker, so it was never a checkpoint,
        and on a full disk it holds the space), keep every earlier checkpoint, and stop."""
        if self.dims.is_main:
            shutil.rmtree(folder, ignore_errors=True)
        kept = complete_steps(self.root)
        raise CheckpointSaveError(
            f"checkpoint step-{step} could not be saved: {failure_cause(error, folder)}; training stopped, "
            f"earlier checkpoints are kept (newest: {f'step-{kept[0]}' if kept else 'none'})") from error

    def _complete(self, step: int, folder: Path) -> None:
        """Rank 0, once every rank's files are written: the marker (atomically), then retention.
        Each rank recorded the checksums of its own files in its JSON; rank 0 adds those of the
        small files it has no checksum for (DCP's .metadata, the ranks' JSON)."""
        if not self.dims.is_main:
            return
        names = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith(MARKER))
        written = {}
        for rank in range(self.dims.world_size):
            written.update(json.loads((folder / json_name(rank)).read_text())["files"])
        marker = {"format": FORMAT, "step": step, "world_size": self.dims.world_size,
                  "data_parallel": self.dims.mode, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "files": {name: (folder / name).stat().st_size for name in names},
                  ALGORITHM: {name: written.get(name) or file_checksum(folder / name) for name in names},
                  **self.info}
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

    def _agree(self, problem: str | None) -> str | None:
        """The first rank's problem, on every rank (None if no rank has one)."""
        if self.group is None:
            return problem
        found = [None] * self.dims.world_size
        dist.all_gather_object(found, problem, group=self.group)
        return next((p for p in found if p), None)

    def _on_main(self, fn, *args) -> None:
        """Rank 0 changes the checkpoint folder (logging what it did) while the others wait."""
        if self.dims.is_main:
            try:
                line = fn(*args)
            except OSError as e:
                raise ConfigError(f"cannot move checkpoints aside under {self.root}: {e.strerror}: {e.filename}") from None
            if line:
                logger.info(line)
        self._barrier()

    # -------------------------------------------------------------------------------------- load
    def load(self) -> int | None:
        """Resume from the newest loadable complete checkpoint (or checkpoint.load_step); else, with
        checkpoint.initial_load_path, start from Hugging Face safetensors. Returns the resumed step."""
        explicit = self.ck.load_step >= 0
        if self.ck.enable or explicit:
            self._on_main(finish_interrupted, self.root)  # a move aside that a killed run left half done
            steps = complete_steps(self.root)
            self._report_incomplete(steps[0] if steps else -1)
            if explicit:
                if self.ck.load_step not in steps:
                    raise ConfigError(self._missing_step(steps))
                steps = [self.ck.load_step]
            failures = []
            for step in steps:
                folder = self.root / f"step-{step}"
                marker = read_marker(folder) or {}
                self._check_fits(folder, marker)
                problem = self._verify(folder, marker)
                if problem is None:
                    self._on_main(abandon_after, self.root, step)  # before loading: a kill now resumes `step`
                    problem = self._try_load(folder, marker)
                if problem is None:
                    if self.dims.is_main:
                        logger.info(f"resumed from checkpoint {folder} (step {step})")
                        self._warn_schedule(step, marker)
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

    def _missing_step(self, steps: list[int]) -> str:
        n = self.ck.load_step
        msg = (f"checkpoint.load_step={n}: no complete checkpoint step-{n} under {self.root} "
               f"(complete: {sorted(steps) or 'none'})")
        aside = abandoned_steps(self.root).get(n)
        return msg + (f"; {aside} was set aside by an earlier resume from an earlier step: move it back "
                      f"to {self.root} to resume it" if aside else "")

    def _check_fits(self, folder: Path, marker: dict) -> None:
        """Layout format and model spec, before anything is read: a checkpoint of another model (or
        layout) is one error naming both, not damage to fall back from."""
        if marker.get("format", 1) != FORMAT:
            raise ConfigError(f"checkpoint {folder} has layout format {marker.get('format', 1)}, this titanlite "
                              f"reads format {FORMAT} (earlier formats pickle the per-rank state, which is never "
                              f"loaded): move it away to start afresh; python -m titanlite.checkpoint.export still "
                              f"converts its model")
        saved, now = marker.get("model"), self.info.get("model")
        if not saved or not now:
            return
        names = [(m.get("name"), m.get("flavor")) for m in (saved, now)]
        args = [m.get("args", {}) for m in (saved, now)]
        # Another model or flavor is named by that alone; the same one with other arguments (a
        # vocab_size override, say) by the first few that differ.
        keys = [] if names[0] != names[1] else sorted(k for k in {**args[0], **args[1]} if args[0].get(k) != args[1].get(k))
        if names[0] != names[1] or keys:
            raise ConfigError(f"checkpoint {folder} holds model {_describe(saved, keys[:4])}, this run builds "
                              f"{_describe(now, keys[:4])}: run the checkpoint's model, or use another "
                              f"checkpoint.folder or job.dump_folder")

    def _verify(self, folder: Path, marker: dict) -> str | None:
        """Sizes, then the checksum of every file, each rank reading its share of the files."""
        mine = size_problem(folder, marker) or checksum_problem(folder, marker, self.dims.rank,
                                                                self.dims.world_size if self.group else 1)
        return self._agree(mine)

    def _warn_schedule(self, step: int, marker: dict) -> None:
        saved, now = marker.get("schedule"), self.info["schedule"]
        changed = [f"{k} {saved[k]} -> {v}" for k, v in now.items() if saved and k in saved and saved[k] != v]
        if changed:
            logger.warning(f"warning: resuming step-{step} with another schedule ({', '.join(changed)}): the lr "
                           f"curve from here on differs from the one the checkpoint was trained on")

    def _report_incomplete(self, newest_complete: int) -> None:
        if not self.dims.is_main:
            return
        for step, folder in sorted(step_dirs(self.root).items()):
            if step > newest_complete and read_marker(folder) is None:
                logger.warning(f"warning: checkpoint {folder} is incomplete (no {MARKER}: the run stopped while "
                               f"saving); skipped")

    def _try_load(self, folder: Path, marker: dict) -> str | None:
        """Load `folder` into the live objects; the reason on failure (the same on every rank)."""
        try:
            self._load(folder, marker)
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            if unsafe := unsafe_cause(e):  # a pickle that would run code is refused, never fallen back from
                raise UnsafeCheckpointError(f"{unsafe}; move {folder} away to resume the checkpoint before it") from None
            if isinstance(e, ConfigError):
                raise  # the checkpoint is fine but does not fit this run's configuration (data, model)
            # any unreadable checkpoint falls back
            return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:500]
        return None

    def _load(self, folder: Path, marker: dict) -> None:
        same_world = marker.get("world_size") == self.dims.world_size
        # titanlite's state: each rank its own; with another rank count every rank reads rank 0's
        # (the loader state is a global stream position, so it re-shards from any rank's). Read
        # before DCP touches a live tensor, and agreed, so no rank enters DCP's collectives alone.
        # DCP's metadata too, through the restricted unpickler: a pickle that would run code stops
        # the load on every rank (they read the same file) before DCP is entered.
        try:
            metadata = read_metadata(folder / ".metadata")
            own, problem = read_state(folder, self.dims.rank if same_world else 0), None
        except UnsafeCheckpointError:
            raise
        except (ValueError, OSError) as e:
            own, problem = None, str(e)
        if problem := self._agree(problem):
            raise ValueError(problem)
        state = self._state()
        dcp.load(state, storage_reader=RestrictedReader(folder, metadata), planner=RestrictedPlanner(folder),
                 process_group=self.group, no_dist=self.group is None)
        set_state_dict(self.model, _optimizers(self.optimizer), model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=OPTIONS)
        for name, obj in self.stateful.items():
            obj.load_state_dict(own["stateful"][name])
        for name, obj in self.per_rank.items():
            obj.load_state_dict(own["per_rank"][name])
        if same_world:
            set_rng_state(own["rng"])  # RNG streams belong to ranks; a new layout starts them from the seed
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
