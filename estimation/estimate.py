"""The dry run: memory at the configured batch, the largest batch that fits, and the throughput model."""

from __future__ import annotations

import json
import os
import sys
import time

from titanlite.config import ConfigError, resolve_batch, to_dict
from titanlite.config.manager import data_parallel_mode
from titanlite.models import get_model_args
from titanlite.parallel.modes import MODES
from titanlite.models.args import FLOPS_CONVENTION

from estimation.fake_run import FakeRun, StepResult
from estimation.hardware import auto_attention, get_hardware
from estimation.throughput import assumptions, predict

GIB = 2**30


def _progress(msg: str) -> None:
    print(f"[estimate] {msg}", file=sys.stderr, flush=True)


def largest_batch(peak_of, fits, start: int, limit: int) -> int:
    """Largest local batch in [1, limit] whose fake step fits (0 if none), probing as few as possible.

    Peak memory grows almost linearly with the batch, so each probe aims where the line through the
    two nearest probes crosses the limit; the answer is always bracketed by a probe that fits and
    one that does not (or the limit), and a probe aimed at a bracket end falls back to bisection.
    """
    probes: dict[int, int] = {}

    def probe(b):
        if b not in probes:
            probes[b] = peak_of(b)
        return probes[b]

    lo, hi = 0, limit + 1  # lo fits (0: nothing yet), hi does not (limit + 1: not probed)
    b = start
    while True:
        if fits(probe(b)):
            lo = b
        else:
            hi = b
        if hi - lo <= 1:
            return lo
        b = min(max(_aim(probes, lo, fits.budget), lo + 1), hi - 1)
        if b in probes:
            b = (lo + hi) // 2


def _aim(probes: dict[int, int], lo: int, budget: float) -> int:
    """Batch where the line through the two probes nearest the fitting end reaches the budget."""
    if len(probes) < 2:
        return 2 * lo if lo else 1
    (b0, p0), (b1, p1) = sorted(probes.items(), key=lambda bp: abs(bp[0] - lo))[:2]
    slope = (p1 - p0) / (b1 - b0)
    return b0 + int((budget - p0) // slope) if slope > 0 else 2 * max(lo, 1)


def headroom(configured: float, mode: str) -> float:
    """estimate.fragmentation, or (-1) the measured headroom of this data-parallel mode."""
    return MODES[mode].headroom if configured < 0 else configured


class _Fits:
    def __init__(self, usable_bytes: float, fragmentation: float):
        self.fragmentation = fragmentation
        self.budget = usable_bytes / (1 + fragmentation)  # largest peak that fits

    def __call__(self, peak: int) -> bool:
        return peak <= self.budget


def estimate(cfg, progress=_progress) -> dict:
    t0 = time.perf_counter()
    est = cfg.estimate
    hw = get_hardware(est.hardware)
    world = est.ngpu
    accum = resolve_batch(cfg, world)
    local = cfg.training.local_batch_size
    args = get_model_args(cfg.model.name, cfg.model.flavor, cfg.model.vocab_size)
    seq = cfg.training.seq_len
    attention = auto_attention(hw) if cfg.model.attention_backend == "auto" else cfg.model.attention_backend
    micro_steps = 2 if accum > 1 else 1  # two micro-steps show both the accumulating and the syncing one
    usable = hw.memory_gib * GIB - est.reserved_gib * GIB
    mode = data_parallel_mode(cfg, world)
    fits = _Fits(usable, headroom(est.fragmentation, mode))

    progress(f"building {cfg.model.name}/{cfg.model.flavor} on {world} fake rank(s), {mode}")
    run = FakeRun(cfg, world)
    try:
        results: dict[int, StepResult] = {}

        def peak_of(b: int) -> int:
            results[b] = r = run.step(b, micro_steps)
            verdict = "fits" if fits(r.peak_bytes) else "does not fit"
            progress(f"local batch {b}: peak {r.peak_bytes / GIB:.2f} GiB ({verdict}) "
                     f"[{time.perf_counter() - t0:.0f}s]")
            return r.peak_bytes

        limit = max(est.max_local_batch, local)
        largest = largest_batch(peak_of, fits, local, limit) if est.search else peak_of(local)
    finally:
        run.close()
    if largest == 0:
        r1 = results[1]
        raise ConfigError(
            f"{cfg.model.name}/{cfg.model.flavor} ({mode}, {world} x {est.hardware}) does not fit even at local batch "
            f"1: peak {r1.peak_bytes / GIB:.1f} GiB x {1 + fits.fragmentation:.2f} + {est.reserved_gib} GiB reserved > "
            f"{hw.memory_gib} GiB; try fsdp, activation_checkpoint.mode=full, a shorter seq_len or more GPUs")

    res = results[local]
    tokens_per_step = local * world * accum * seq
    flops_per_token = args.flops_per_token(seq)
    a = assumptions(est, hw, world, attention, cfg.compile.enable)
    report = {
        "config": {
            "model": f"{cfg.model.name}/{cfg.model.flavor}", "params": args.num_params(), "ngpu": world,
            "hardware": est.hardware, "device_name": hw.device_name, "data_parallel": mode,
            "local_batch_size": local, "seq_len": seq, "gradient_accumulation_steps": accum,
            "global_batch_size": local * world * accum, "activation_checkpoint": cfg.activation_checkpoint.mode,
            "float8": cfg.float8.enable, "compile": cfg.compile.enable, "attention_backend": attention,
            "mixed_precision_param": cfg.training.mixed_precision_param,
        },
        "memory": _memory(res, hw, usable, fits),
        "batch_search": _search(results, largest, cfg, world, fits) if est.search else None,
        "throughput": {"flops_per_token": flops_per_token,
                       **predict(res.work, a, accum, tokens_per_step, flops_per_token, world)},
        "notes": [
            "memory is per rank (rank 0) for eager mode; torch.compile keeps fewer activations",
            "fake tensors run on CPU with CUDA's choices made explicit: bf16 autocast / FSDP bf16 params, "
            "fused AdamW, fused RMSNorm saved tensors, flash-style attention (output + logsumexp saved)",
        ],
        "resolved_config": to_dict(cfg),
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    return report


def _gib(d: dict) -> dict:
    return {k: round(v / GIB, 3) for k, v in d.items()}


def _memory(res: StepResult, hw, usable: float, fits) -> dict:
    return {
        "peak_gib": round(res.peak_bytes / GIB, 3),
        "gpu_memory_gib": hw.memory_gib,
        "share_of_gpu_pct": round(100 * res.peak_bytes / (hw.memory_gib * GIB), 1),
        "usable_gib": round(usable / GIB, 2),
        "allocator_headroom": fits.fragmentation,
        "fits": fits(res.peak_bytes),
        "at_peak_gib": _gib(res.breakdown),
        "model_state_gib": _gib(res.model_state),
    }


def _search(results: dict, largest: int, cfg, world: int, fits) -> dict:
    gb = cfg.training.global_batch_size
    out = {"largest_local_batch": largest, "peak_gib_at_largest": round(results[largest].peak_bytes / GIB, 3),
           "probes": [{"local_batch": b, "peak_gib": round(r.peak_bytes / GIB, 3), "fits": fits(r.peak_bytes)}
                      for b, r in sorted(results.items())]}
    if gb == -1:
        out["global_batch_size"] = "local x ranks (no accumulation)"
        out["gradient_accumulation_steps"] = 1
    else:
        # The largest local batch that divides the configured global batch over the ranks.
        b = next((b for b in range(min(largest, gb), 0, -1) if gb % (b * world) == 0), None)
        out["global_batch_size"] = gb
        out["local_batch_for_global"] = b
        out["gradient_accumulation_steps"] = gb // (b * world) if b else None
    return out


def format_report(r: dict) -> str:
    c, m, t = r["config"], r["memory"], r["throughput"]
    lines = [
        f"{c['model']} ({c['params']:,} params) | {c['ngpu']} x {c['hardware']} ({c['device_name']}) | "
        f"{c['data_parallel']} | local batch {c['local_batch_size']} x seq {c['seq_len']} x accum "
        f"{c['gradient_accumulation_steps']} | AC {c['activation_checkpoint']} | float8 {c['float8']} | "
        f"compile {c['compile']}",
        "",
        "memory per rank (GiB)      at peak   after backward",
    ]
    for k in m["at_peak_gib"]:
        lines.append(f"  {k:<24} {m['at_peak_gib'][k]:>8.2f}   {m['model_state_gib'][k]:>8.2f}")
    lines.append(f"  {'peak':<24} {m['peak_gib']:>8.2f}   = {m['share_of_gpu_pct']}% of {m['gpu_memory_gib']} GiB "
                 f"({'fits' if m['fits'] else 'DOES NOT FIT'} in {m['usable_gib']} GiB usable, "
                 f"{m['allocator_headroom']:.0%} allocator headroom)")
    s = r.get("batch_search")
    if s:
        lines.append(f"largest local batch that fits: {s['largest_local_batch']} "
                     f"(peak {s['peak_gib_at_largest']:.2f} GiB; probes: "
                     + ", ".join(f"{p['local_batch']}{'' if p['fits'] else '!'}" for p in s["probes"]) + ")")
        if s.get("local_batch_for_global"):
            lines.append(f"global batch {s['global_batch_size']}: local batch {s['local_batch_for_global']} x "
                         f"{c['ngpu']} ranks x {s['gradient_accumulation_steps']} accumulation steps")
        elif s["global_batch_size"] != "local x ranks (no accumulation)":
            lines.append(f"global batch {s['global_batch_size']}: no local batch <= {s['largest_local_batch']} "
                         f"divides it over {c['ngpu']} ranks")
    a = t["assumptions"]
    lines += [
        "",
        f"throughput: {t['flops_per_token'] / 1e9:.2f} GFLOP/token ({FLOPS_CONVENTION})",
        f"  {'':<12} {'step ms':>9} {'tokens/s':>11} {'tok/s/GPU':>10} {'MFU %':>6}",
    ]
    for k in ("overlap", "no_overlap"):
        v = t[k]
        lines.append(f"  {k:<12} {v['step_ms']:>9.1f} {v['tokens_per_sec']:>11,.0f} "
                     f"{v['tokens_per_sec_per_gpu']:>10,.0f} {v['mfu_pct']:>6.1f}")
    lines.append("  terms (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in t["terms_ms"].items())
                 + f" -> dominant: {t['dominant']}")
    lines.append(f"  assumptions: bf16 peak {a['peak_tflops']} TFLOP/s x GEMM efficiency {a['gemm_efficiency']}; "
                 f"attention {a['attention_backend']} at {a['attention_efficiency']:.3f} of peak (causal FLOPs); "
                 f"memory-bound ops at {a['hbm_tbps']} TB/s x {a['memory_efficiency']}"
                 + (f" x traffic factor {a['compile_traffic_factor']} (compile)" if a["compile"] else " (eager)")
                 + f"; collectives at {a['link_gbps']} GB/s x {a['link_efficiency']} (ring); "
                 f"launch {a['launch_us']} us/kernel")
    return "\n".join(lines)


def write_report(report: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(report, fh, indent=2)
    os.replace(tmp, path)
    return path
