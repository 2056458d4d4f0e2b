"""The memory check of a training job (training.memory_fit), run by titanlite.launch beside the ranks'
start-up: `python -m estimation.preflight --world-size W --nodes N --hardware KEY --command C -- ARGS`.

It predicts the job's peak memory per GPU on that GPU with `estimation.estimate` (the configured local
batch, and where that does not fit, the batch search up to it, its answer measured at the accumulation
it runs with; where no batch keeping the global batch fits, the same with stronger activation
checkpointing, selective then full; where the batch found is smaller than the configured one, the
next level's too, taken where its larger micro-batch is predicted faster by more than
recommend.AC_WORTH), on N nodes of W / N GPUs as the ranks are laid out (hsdp's default mesh shards
inside a node), and prints one JSON line, what the launcher does: {"action": "none" | "warn" |
"stop" | "restart", "line": the line to print, "args": the options to restart with}. `stop` names
the predicted peak, the GPU's memory and the command (C followed by ARGS, the batch options, and the
checkpointing where it was raised, replaced) that fits; `restart` (training.memory_fit=adjust, one
node) the local batch (and checkpointing) it starts again at, also for a tight batch (one that fits
only inside the allocator's headroom) where the largest clear one keeping the global batch, at the
configured checkpointing or the next level's, is at least half of it; `warn` a tight batch left as
it is. The global batch is kept: the configured one, or local x ranks where it is -1, with the
accumulation raised. Only the estimate's answer that nothing fits (estimation.DoesNotFit) stops the job; a
prediction that fails (any other error, a ConfigError included) says so in its line and stops nothing.
"""

from __future__ import annotations

import copy
import json
import logging
import shlex
import sys
import time
import warnings

from titanlite.config import data_parallel_mode, load_config

from titanlite.parallel.launcher_env import Launch

from estimation import DoesNotFit
from estimation.estimate import estimate
from estimation.hardware import get_hardware
from estimation.recommend import AC_CHOICES, AC_WORTH

BATCH_KEYS = ("training.local_batch_size", "training.global_batch_size", "training.memory_fit")


def preflight(cfg, world: int, nodes: int, hardware: str, command: str, argv: list[str]) -> dict:
    """What the launcher does about `cfg` on `world` GPUs of kind `hardware` (a titanlite.hardware key), on
    `nodes` nodes of world / nodes each. Raises where the prediction fails (main says so; the job goes on)."""
    t0 = time.perf_counter()
    hw = get_hardware(hardware)
    t = cfg.training
    local = t.local_batch_size
    global_batch = t.global_batch_size if t.global_batch_size != -1 else local * world
    cfg.training.global_batch_size = global_batch  # kept: the search's answer divides it
    # the job's nodes, as the launcher's record gives them to the ranks: hsdp shards inside one
    cfg.estimate.hardware, cfg.estimate.ngpu, cfg.estimate.gpus_per_node = hardware, world, world // nodes
    cfg.estimate.search, cfg.estimate.max_local_batch = True, local  # the largest that fits, up to the configured
    mode = data_parallel_mode(cfg, world)
    where = f"{world} x {hw.device_name}" + (f", {mode}" if world > 1 else "")
    configured_ac = cfg.activation_checkpoint.mode
    restarts = cfg.training.memory_fit == "adjust" and nodes == 1

    def with_level(ac: str | None, after: str = " ") -> str:
        """The checkpointing level `ac` as a line names it before a batch (`after` follows it); nothing for None."""
        return f"with activation_checkpoint.mode={ac}{after}" if ac else ""

    def batch(search: dict) -> tuple[str, list[str]]:
        """The batch a search found that keeps the global batch: as the lines say it, and as options."""
        fit = search["local_batch_for_global"]
        return (f"local batch {fit} x accumulation {search['gradient_accumulation_steps']}",
                ["--training.local_batch_size", str(fit), "--training.global_batch_size", str(global_batch)])

    def searched(ac: str) -> tuple[dict, DoesNotFit | None]:
        """The batch search with activation checkpointing `ac`; empty, with the estimate's answer, where not
        even local batch 1 fits."""
        c = copy.deepcopy(cfg)
        c.activation_checkpoint.mode = ac
        try:
            return estimate(c, progress=lambda _line: None)["batch_search"], None
        except DoesNotFit as e:
            return {}, e

    def faster_with_more_checkpointing(search: dict, ac: str | None = None,
                                       least: int = 1) -> tuple[dict, str | None, str]:
        """A micro-batch smaller than the configured one repeats each micro-step's gathers and per-step
        kernels (LLaMA-3.1-8B under fsdp on 2 x H200 ran 1.06x faster at local 2 with selective checkpointing
        than at local 1 without): `search` (made with checkpointing `ac`, None: the configured), or the next
        level's larger batch keeping the global batch (at least `least`), level by level while that is
        predicted faster by more than recommend.AC_WORTH. Returns the search chosen, its level (None: the
        configured) and its comparison with `search` as the line says it."""
        first, said = (search, ac or configured_ac), ""
        for stronger in AC_CHOICES[AC_CHOICES.index(ac or configured_ac) + 1:]:
            if (search.get("local_batch_for_global") or 0) == local:
                break  # the configured micro-batch: more checkpointing only adds work
            try:
                up = searched(stronger)[0]
            except Exception:  # noqa: BLE001 -- a failed extra search keeps the answer already found
                break
            ours, theirs = up.get("tokens_per_sec_per_gpu_for_global"), search.get("tokens_per_sec_per_gpu_for_global")
            if not ours or up["local_batch_for_global"] < least or (theirs and (
                    up["local_batch_for_global"] <= search["local_batch_for_global"]
                    or ours <= (1 + AC_WORTH) * theirs)):
                break
            search, ac = up, stronger
        base, level = first
        if ac and ac != level and base.get("tokens_per_sec_per_gpu_for_global"):
            less = "without checkpointing" if level == "none" else with_level(level, "")
            said = (f"predicted faster than {batch(base)[0]} {less}: {search['tokens_per_sec_per_gpu_for_global']:,} "
                    f"against {base['tokens_per_sec_per_gpu_for_global']:,} tokens/s per GPU")
        return search, ac, said

    try:
        report = estimate(cfg, progress=lambda _line: None)
    except DoesNotFit as e:  # not even local batch 1 fits: the estimate says why and what could. Any other
        report, nothing = None, e  # error is a failed prediction, which stops nothing (main)
    if report is not None and report["memory"]["fits"]:
        m = report["memory"]
        head = (f"memory check: {cfg.model.name}/{cfg.model.flavor} at local batch {local} on {where}: predicted "
                f"peak {m['peak_gib']:.2f} GiB per GPU of {hw.memory_gib:.1f} GiB")
        if not m["tight"]:
            return {"action": "none", "line": f"{head} ({time.perf_counter() - t0:.0f} s)"}
        inside = f"inside the allocator's {m['allocator_headroom']:.0%} headroom"
        if restarts:
            # adjust: clear of it, at no less than half the micro-batch (a tight batch may run; many more, smaller
            # micro-steps surely cost: at LLaMA 1.36B local 43 would start again at 1 x accumulation 43)
            search, half = report["batch_search"], -(-local // 2)
            if not half <= (search.get("local_batch_for_global") or 0) < local:
                search = {}
            search, ac, said = faster_with_more_checkpointing(search, least=half)
            if search.get("local_batch_for_global"):
                said = f"; {said}" if said else ""
                return {"action": "restart", "args": (["--activation_checkpoint.mode", ac] if ac else [])
                        + batch(search)[1],
                        "line": f"{head}, {inside}; starting again {with_level(ac)}at {batch(search)[0]}, the "
                                f"largest clear of it that keeps the global batch {global_batch} "
                                f"({search['peak_gib_for_global']:.2f} GiB{said}; training.memory_fit=adjust, "
                                f"{time.perf_counter() - t0:.0f} s)"}
        return {"action": "warn", "line": f"warning: {head} ({time.perf_counter() - t0:.0f} s), {inside}: the steps "
                                          f"may slow while it releases its cache, or run out of memory"}

    if report is not None:
        m = report["memory"]
        need = (f"{m['peak_gib']:.2f} GiB" if m["peak_gib"] is not None else f"at least {m['floor_gib']:.1f} GiB")
        why = (f"{cfg.model.name}/{cfg.model.flavor} at local batch {local} needs a predicted {need} per GPU "
               f"({where}), more than the {m['usable_gib']:.2f} GiB usable of the GPU's {hw.memory_gib:.1f} GiB")
    else:
        why = nothing.why
    # A batch that keeps the global batch at the configured checkpointing, or with more where that is predicted
    # faster; where none does, the first stronger checkpointing with one (recomputing more, the same model
    # trained: to rounding)
    search, ac, said = report["batch_search"] if report is not None else {}, None, ""
    if search.get("local_batch_for_global"):
        search, ac, said = faster_with_more_checkpointing(search)
    else:
        for stronger in AC_CHOICES[AC_CHOICES.index(configured_ac) + 1:]:
            # not even local batch 1 fits: said with the strongest tried (its advice no longer names
            # checkpointing); a batch fits, if only inside the headroom: not a DoesNotFit's refusal
            search, nothing = searched(stronger)
            if search.get("local_batch_for_global"):
                search, ac, said = faster_with_more_checkpointing(search, stronger)
                break
    fit = search.get("local_batch_for_global")
    if not fit:
        if report is None and nothing is not None:  # not even local batch 1 fits with the strongest tried
            return {"action": "stop", "line": f"error: {nothing}"}
        return {"action": "stop", "line": f"error: {why}; no local batch is clear of the allocator's headroom with "
                                          f"the accumulation that keeps the global batch {global_batch}, with any "
                                          f"activation checkpointing: try more GPUs with --parallelism.data_parallel "
                                          f"fsdp or a shorter --training.seq_len"}
    said_batch, args = batch(search)
    args = (["--activation_checkpoint.mode", ac] if ac else []) + args
    fits = (f"fits ({search['peak_gib_for_global']:.2f} GiB) and keeps the global batch {global_batch}"
            + (f", {said}" if said else ""))
    took = f"{time.perf_counter() - t0:.0f} s"
    if restarts:
        return {"action": "restart", "args": args,
                "line": f"memory check: {why}; starting again {with_level(ac)}at {said_batch}, the largest that {fits} "
                        f"(training.memory_fit=adjust, {took})"}
    keys = BATCH_KEYS + (("activation_checkpoint.mode",) if ac else ())
    return {"action": "stop", "line": f"error: {why}; {with_level(ac, ', ')}{said_batch} {fits}: {command} "
                                      f"{shlex.join([*without(argv, keys), *args])}"}


def without(argv: list[str], keys: tuple[str, ...]) -> list[str]:
    """`argv` less the options `keys` (as `--key value` or `--key=value`)."""
    out, i = [], 0
    while i < len(argv):
        key = argv[i][2:].split("=", 1)[0] if argv[i].startswith("--") else None
        if key in keys:
            i += 1 if "=" in argv[i] else 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: list[str]) -> None:
    """Prints the verdict's JSON line; never fails the job: an error becomes a line saying so."""
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")  # fake-tensor and FSDP notices say nothing about the memory
    opts = {}
    while argv and argv[0] != "--":
        opts[argv[0].lstrip("-")], argv = argv[1], argv[2:]
    argv = argv[1:]
    try:
        world, nodes = int(opts["world-size"]), int(opts.get("nodes", 1))
        launch = Launch(world_size=world, ranks_per_host=world // nodes)  # the job's layout, before it starts
        verdict = preflight(load_config(argv, launch), world, nodes, opts["hardware"],
                            opts.get("command", "./run_train.sh"), argv)
    except Exception as e:  # noqa: BLE001 -- the training runs whatever went wrong here
        verdict = {"action": "none",
                   "line": f"memory check: no prediction ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"}
    print(json.dumps(verdict), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
