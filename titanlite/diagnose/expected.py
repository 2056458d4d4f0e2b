"""What a larger run should take, given the baseline, and what each run achieved: the cost model of a
scaling diagnosis.

The smallest run is the baseline; for each larger run every phase is predicted from the baseline for
the larger run's per-GPU work:
  data, compute, idle  scale with per-GPU tokens per step (micro-batches x local batch x seq_len);
  optimizer            stays the same (a lower bound for sharded optimizers, which do less);
  comm                 baseline + what the larger world's collectives add with none of their time hidden.
The step is predicted as the baseline's per-GPU work plus what the collectives add with overlap.
Collectives are priced by titanlite.parallel.comm_model, the model estimation uses: the bytes each
data-parallel mode moves for the model the log names, at the link's bandwidth (titanlite.hardware's
for the GPU named, or --link-gbps) and calibrated efficiency, hidden behind backward but for the
edges, each hidden one slowing the compute beside it by its measured rate.
"""

from __future__ import annotations

from dataclasses import fields, replace

from titanlite.diagnose.figures import iqr
from titanlite.diagnose.readers import registry_args
from titanlite.diagnose.runs import PHASES, Run
from titanlite.hardware import lookup
from titanlite.models.args import ModelArgs
from titanlite.parallel.comm_model import (REFERENCE_GPU, CommCost, Link, calibrated_beside, calibrated_link,
                                          data_parallel_step, step_cost)
from titanlite.parallel.fsdp import accumulates_sharded, accumulation_sums_bytes, blocks_reshard
from titanlite.parallel.modes import MODES
from titanlite.parallel.policy import bf16_gradients_refusal
from titanlite.parallel.settings import DataParallelSettings, PrecisionSettings

CPU_GBPS = 1.0  # gloo over loopback / shared memory, roughly


def link_gbps(run: Run, override: float | None) -> float:
    if override:
        return override
    if run.device != "cuda":
        return CPU_GBPS
    hw = lookup(str(run.hardware.get("name") or ""))
    return hw.link_gbps if hw else 450.0  # an unknown GPU: an NVLink-class node


def model_params(run: Run) -> int | None:
    """The run's parameter count: what its log prints (or --model gave), else the registered model it
    names; None when neither is known."""
    params = run.model.get("params")
    if not (isinstance(params, (int, float)) and params > 0):
        args = registry_args(run.model, run.config)
        params = args.num_params() if args is not None else None
    return None if params is None else int(params)


def gradient_bytes(run: Run) -> float | None:
    """Bytes of gradients one reduce carries (None: the model's size is not known)."""
    params = model_params(run)
    if not params:
        return None
    bf16 = "bfloat16" in (run.config.get("parallelism.fsdp_reduce_dtype"), run.config.get("parallelism.ddp_reduce_dtype"))
    return params * (2 if bf16 or gradients_cross_bf16(run) else 4)


def accumulates_into_shards(run: Run) -> bool:
    """Did the fsdp/hsdp run reduce every micro-step of its steps? titanlite's by parallelism.fsdp_accumulate
    (its rule for the GPU the log names); another trainer's, as FSDP does unless told otherwise. False for
    one micro-step a step."""
    c = run.config
    if run.accum == 1 or c.get("data_parallel") not in ("fsdp", "hsdp"):
        return False
    if run.source != "titanlite":
        return True
    sums = accumulation_sums_bytes(model_params(run) or 0, c.get("parallelism.fsdp_reduce_dtype") or "float32")
    return accumulates_sharded(c.get("parallelism.fsdp_accumulate") or "unsharded", sums, gpu_memory(run))


def gpu_memory(run: Run) -> int | None:
    """The bytes of the GPU the log names (None: a CPU run, or a GPU titanlite/hardware.py does not list), for
    titanlite's rules that weigh memory."""
    hw = lookup(str(run.hardware.get("name") or "")) if run.device == "cuda" else None
    return int(hw.memory_gib * 2**30) if hw else None


def gradients_cross_bf16(run: Run) -> bool:
    """Did fsdp's bf16 gradients cross the link as they are (parallelism.fsdp_gradient_transport: titanlite's
    fsdp and hsdp with bf16 compute, a float32 reduction and one micro-step a step, or several that each
    reduce into the shard)? False where the log does not say."""
    c = run.config
    if c.get("parallelism.fsdp_gradient_transport") not in ("auto", "bfloat16") or c.get("data_parallel") not in MODES:
        return False
    dp = DataParallelSettings(**{f.name: c.get(f"parallelism.{f.name}") for f in fields(DataParallelSettings)})
    dp = replace(dp, data_parallel=c["data_parallel"])
    precision = PrecisionSettings(c.get("training.mixed_precision_param"), c.get("training.bf16_params"))
    return (bf16_gradients_refusal(dp, precision, run.hardware.get("device", "cpu")) is None
            and (run.accum == 1 or accumulates_into_shards(run)))


def collectives(run: Run, gbps: float, compute_ms: float | None = None) -> CommCost | None:
    """What `run`'s collectives cost a step by the communication model estimation uses
    (titanlite.parallel.comm_model), beside `compute_ms` of forward and backward (default: its step);
    None where the model's size is not known. A log that names no data-parallel mode is taken to
    all-reduce its gradients (ddp), as every trainer whose logs omit it does."""
    params = model_params(run)
    if params is None:
        return None
    if run.world == 1:
        return CommCost(0.0, 0.0, 0.0, 0.0)
    mode = run.config.get("data_parallel")
    mode = mode if mode in MODES and MODES[mode].comm != "none" else "ddp"
    precision = run.config.get("training.mixed_precision_param")
    # the gathered copies' dtype: bf16 compute on a GPU unless the log says float32 (GPU trainers default to it)
    bf16 = precision == "bfloat16" or (precision in (None, "auto") and run.device == "cuda")
    args = registry_args(run.model, run.config)
    # the input embedding's gradients are ready last (ddp's last bucket, fsdp's root): nothing hides them
    edge = args.vocab_size * args.dim if args is not None else 0
    steps = data_parallel_step(mode, params, int(gradient_bytes(run) // params), 2 if bf16 else 4, edge,
                               regathered(run, params, args, 2 if bf16 else 4), micro_steps=run.accum,
                               reduces=run.accum if accumulates_into_shards(run) else 1)
    if run.device == "cuda":
        gpu = hw.key if (hw := lookup(str(run.hardware.get("name") or ""))) else REFERENCE_GPU
        link, beside = calibrated_link(gbps, gpu), calibrated_beside(gpu)
    else:  # gloo's figure (CPU_GBPS) is what a step sees already; no SMs for a collective to take
        link, beside = Link(gbps, 1.0), {}
    return step_cost(steps, run.world, link, beside, run.step_ms if compute_ms is None else compute_ms)


def regathered(run: Run, params: int, args: ModelArgs | None, gather_bytes: int) -> int | None:
    """The parameters fsdp gathers a second time for backward, by titanlite's rule for the setting the log
    names (titanlite.parallel.fsdp.blocks_reshard: the blocks, unless they are kept; the root's only under
    `always`); a log that names none (another trainer's) reshards the blocks, FSDP's default. None where
    the model is not known: all but the root's."""
    if args is None:
        return None
    blocks = params - args.vocab_size * args.dim * (1 if args.tie_embeddings else 2) - args.dim  # less the final norm
    setting = run.config.get("parallelism.fsdp_reshard_after_forward") or "default"
    again = blocks if blocks_reshard(setting, blocks * gather_bytes, gpu_memory(run)) else 0
    return again + (params - blocks if setting == "always" else 0)


def comm_ms(run: Run, gbps: float) -> float | None:
    """The most `run`'s collectives can take from a step: all of them, none hidden."""
    cost = collectives(run, gbps)
    return None if cost is None else cost.total_ms


def comm_extra_ms(base: Run, run: Run, gbps: float) -> float | None:
    """What the larger world's collectives add over the baseline's with none of either hidden (None:
    the model's size is not known)."""
    a, b = comm_ms(run, gbps), comm_ms(base, gbps)
    return None if a is None or b is None else max(a - b, 0.0)


def overlapped_extra_ms(base: Run, run: Run, gbps: float) -> float | None:
    """What the larger world's collectives add over the baseline's with overlap: what shows beside the
    compute and what the hidden ones take from it (None: the model's size is not known)."""
    compute = base.step_ms * work_ratio(base, run)
    a, b = collectives(run, gbps, compute), collectives(base, gbps, base.step_ms)
    return None if a is None or b is None else max(a.overlapped_ms - b.overlapped_ms, 0.0)


def work_ratio(base: Run, run: Run) -> float:
    """Per-GPU tokens per step of `run` over the baseline's."""
    return run.tokens_per_gpu_step / base.tokens_per_gpu_step


def predicted_step_ms(base: Run, run: Run, gbps: float) -> float:
    """The step `run` should take from the baseline's: its per-GPU work at the baseline's speed plus
    what its collectives add with overlap (none counted where the model's size is unknown)."""
    return base.step_ms * work_ratio(base, run) + (overlapped_extra_ms(base, run, gbps) or 0.0)


def efficiency(runs: list[Run], mode: str) -> dict:
    base = runs[0]
    rows = []
    for r in runs:
        row = {"run": r.label, "world_size": r.world, "tokens_per_step": r.tokens_per_step,
               "step_ms": round(r.step_ms, 3), "tokens_per_sec": round(r.tokens_per_sec, 1),
               "tokens_per_sec_per_gpu": round(r.per_gpu, 1),
               "efficiency": round(r.per_gpu / base.per_gpu, 4) if mode not in ("not_comparable", "single_run")
               else None}
        logged = r.tokens_per_sec_logged
        if logged is not None and base.tokens_per_sec_logged:
            row["efficiency_from_logged_tokens_per_sec"] = round((logged / r.world) / (base.tokens_per_sec_logged / base.world), 4)
        rows.append(row)
    weak = ("same per-GPU work" if all(r.tokens_per_gpu_step == base.tokens_per_gpu_step for r in runs)
            else "same micro-batch per GPU, different accumulation")
    definition = {
        "weak": f"{weak}: efficiency = per-GPU tokens/s / baseline per-GPU tokens/s (1.0 = perfect)",
        "strong": "same global batch: efficiency = (baseline step time x baseline GPUs) / (step time x GPUs) "
                  "= per-GPU tokens/s / baseline per-GPU tokens/s",
        "same_world_size": "same world size: efficiency = tokens/s / baseline tokens/s",
        "not_comparable": "neither per-GPU work nor global batch is the same: no efficiency",
        "single_run": "one run: no scaling claim",
    }[mode]
    basis = "tokens per step from the batch settings over the median step time (not the logged rate)"
    if any(r.accum != r.accum_printed for r in runs):
        basis = basis.replace("the batch settings", "the batch settings as reconstructed")
    if any(not r.has_step_time for r in runs):
        basis += "; a log without a time per iteration: its logged rate, as reconstructed"
    return {"mode": mode, "baseline": base.label, "definition": definition, "basis": basis, "runs": rows}


def predicted(base: Run, run: Run, gbps: float) -> dict[str, float | None]:
    """What each phase of `run` should cost (ms per step, fastest rank) given the baseline."""
    work = work_ratio(base, run)
    out = {}
    for p in PHASES:
        b = base.phase_over_ranks(p)
        if p == "comm":
            out[p] = (b or 0.0) + (comm_extra_ms(base, run, gbps) or 0.0)
        elif p == "optimizer":
            out[p] = b
        else:
            out[p] = None if b is None else b * work
    return out


def phase_excess(base: Run, run: Run, gbps: float) -> tuple[list[tuple[str, float, float, float]], dict[str, float]]:
    """(phase, measured, predicted, excess) in ms per step for each phase both logs have, and each
    phase's step-to-step jitter (interquartile ranges of the two runs added)."""
    pred = predicted(base, run, gbps)
    rows, noise = [], {}
    for p in PHASES:
        got, want = run.phase_over_ranks(p), pred[p]
        if got is None or want is None:
            continue
        rows.append((p, got, want, got - want))
        noise[p] = iqr(run.phase_series(p)) + iqr(base.phase_series(p))
    return rows, noise
