"""Step time, tokens/s and MFU from the work a fake step recorded, at calibrated rates.

Each phase (forward, backward, per micro-step; optimizer) costs the sum of its terms on one stream:
  gemm         matmul FLOPs / (bf16 peak x gemm_efficiency); float8 matmuls at twice the peak
               x float8_efficiency
  attention    causal FLOPs / (bf16 peak x the attention kernel's rate)
  elementwise  eager ops' bytes read + written / (HBM x elementwise_efficiency), plus compiled
               graphs' generated kernels' traffic (each element at no more than two bytes:
               estimation.compiled.KERNEL_ELEMENT_BYTES) / (HBM x fused_efficiency)
  optimizer    the optimizer phase's bytes (clip and update) / (HBM x optimizer_efficiency)
  gaps         kernels x gap_us, the GPU's idle time between dependent kernels
and never less than the host's launch time (kernels x launch_us; none for a step replayed as a CUDA
graph). Collectives, their overlap with forward/backward and what they take from the compute beside
them are priced by titanlite.parallel.comm_model, the communication model diagnose shares: ring
traffic / (bandwidth x link_efficiency) over the links they cross (estimate.inter_node_gbps between
nodes), hidden behind the compute except the first all-gather, the last gradient reduction and the
optimizer phase's collectives, each hidden one slowing the compute beside it by a measured rate
(`beside_collectives`).

The rates come from estimation/calibration.json (`python -m estimation.calibrate` writes it from GPU
measurements): a GPU's own fit where it has one, else the entry's value (fitted on an H100) as the same
fraction of that GPU's peak; any `estimate.*_efficiency` / `estimate.launch_us` set above 0 overrides it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from titanlite.models.args import mfu_pct

from titanlite.parallel.comm_model import (BESIDE_KIND, CALIBRATION, LATENCY_US, OP_KIND, REFERENCE_GPU,  # noqa: F401
                                           Link, beside_rate, gpu_rate, load_calibration, overlap, seconds, source)

from estimation.hardware import GPUS_PER_NODE, Hardware, attention_kernel, gpus_per_node

RATES = ("gemm_efficiency", "float8_efficiency", "elementwise_efficiency", "fused_efficiency",
         "optimizer_efficiency", "link_efficiency", "gap_us", "launch_us")
TERMS = ("gemm", "attention", "elementwise", "optimizer", "gaps", "launch")
@dataclass
class Assumptions:
    peak_tflops: float
    hbm_tbps: float
    link_gbps: float
    attention_backend: str
    attention_efficiency: float
    gemm_efficiency: float
    float8_efficiency: float
    elementwise_efficiency: float
    fused_efficiency: float
    optimizer_efficiency: float
    link_efficiency: float
    launch_us: float
    gap_us: float = 0.0
    # nodes: GPUs per node, and the network between them per GPU (GB/s each way)
    gpus_per_node: int = GPUS_PER_NODE
    network_gbps: float = 50.0
    # kind of collective -> ms of extra compute per ms of that collective hidden behind compute
    beside_collectives: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)  # rate -> where its value comes from (and when)

    def replayed(self, cuda_graphs: bool = True) -> "Assumptions":
        """The rates of a step replayed as a CUDA graph (training.cuda_graphs): the host launches none of
        its kernels, so the launch term goes; the GPU's gaps between dependent kernels stay."""
        return replace(self, launch_us=0.0) if cuda_graphs else self


def assumptions(est, hw: Hardware, world: int, attention_backend: str, calibration: dict | None = None,
                seq_len: int = 0) -> Assumptions:
    """The rates of a run of `world` GPUs `hw` with `attention_backend` (`seq_len`: its sequence, for the
    attention kernel's rate; 0: the rate's own length)."""
    cal = calibration or load_calibration()
    rates, sources = {}, {}
    for name in RATES:
        override = getattr(est, name, 0.0)
        value, source = gpu_rate(cal["rates"][name], hw.key)
        rates[name] = override if override > 0 else value
        sources[name] = "estimate." + name if override > 0 else source
    attention, sources["attention_efficiency"] = attention_rate(cal["attention"], attention_kernel(attention_backend, hw),
                                                                hw.key, seq_len)
    beside = {}
    for kind, entry in cal.get("beside_collectives", {}).items():
        beside[kind], sources[f"beside_{kind}"] = beside_rate(entry, hw.key)
    return Assumptions(peak_tflops=hw.peak_tflops, hbm_tbps=hw.hbm_tbps, link_gbps=hw.link_gbps,
                       attention_backend=attention_backend, attention_efficiency=attention, sources=sources,
                       gpus_per_node=gpus_per_node(est), network_gbps=est.inter_node_gbps / 8,
                       beside_collectives=beside, **rates)


def attention_rate(table: dict, kernel: str, gpu: str, seq_len: int) -> tuple[float, str]:
    """The attention kernel's rate at `seq_len` and its source. An entry holds its rate at `at_seq_len`
    and may hold rates measured at other lengths (`by_seq_len`): a longer sequence amortises each tile's
    fixed work over more of the S x S square, so the rate is interpolated in log2(seq_len) between them,
    flat beyond the ends. An entry without them, or seq_len 0, gives its one rate."""
    entry = table.get(kernel, table["sdpa"])
    value, src = gpu_rate(entry, gpu)
    points = {int(s): e for s, e in entry.get("by_seq_len", {}).items()}
    if not (seq_len and points and entry.get("at_seq_len")):
        return value, src
    points[entry["at_seq_len"]] = {"value": value, "source": src}
    known = sorted(points)
    if seq_len <= known[0] or seq_len >= known[-1]:
        end = points[known[0] if seq_len <= known[0] else known[-1]]
        return end["value"], source(end)
    hi = next(s for s in known if s >= seq_len)
    lo = known[known.index(hi) - 1]
    f = (math.log2(seq_len) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return (points[lo]["value"] + f * (points[hi]["value"] - points[lo]["value"]),
            f"interpolated at seq {seq_len} between {lo} ({source(points[lo])}) and {hi} ({source(points[hi])})")


def collective_seconds(c, a: Assumptions) -> float:
    """One recorded collective's time at the assumed links (titanlite.parallel.comm_model.seconds)."""
    link = Link(a.link_gbps, a.link_efficiency, a.gpus_per_node, a.network_gbps)
    return seconds(OP_KIND[c.op], c.moved, c.ranks, link)


def _phase_times(w, a: Assumptions, optimizer: bool) -> dict[str, float]:
    """Seconds per term for one phase's work."""
    peak, hbm = a.peak_tflops * 1e12, a.hbm_tbps * 1e12
    memory = w.memory_bytes / (hbm * (a.optimizer_efficiency if optimizer else a.elementwise_efficiency))
    t = {
        "gemm": w.matmul_flops / (peak * a.gemm_efficiency) + w.float8_flops / (2 * peak * a.float8_efficiency),
        "attention": w.attention_flops / (peak * a.attention_efficiency),
        "elementwise": (0.0 if optimizer else memory) + w.fused_bytes / (hbm * a.fused_efficiency),
        "optimizer": memory if optimizer else 0.0,
    }
    t["gaps"] = w.ops * a.gap_us * 1e-6  # the GPU idles between dependent kernels
    t["launch"] = max(0.0, w.ops * a.launch_us * 1e-6 - sum(t.values()))  # only what the GPU cannot hide
    comms = [(c.op, collective_seconds(c, a)) for c in w.collectives if len(c.ranks) > 1]
    t["comm"] = sum(c for _, c in comms)
    t["comm_edges"] = (comms[0][1] if comms else 0.0, comms[-1][1] if comms else 0.0)
    # what hiding all of this phase's collectives would add to the compute beside them
    t["comm_beside"] = sum(a.beside_collectives.get(BESIDE_KIND[OP_KIND[name]], 0.0) * c for name, c in comms)
    return t


def work_totals(work: dict, accum: int) -> dict:
    """The step's work per term (what each rate divides): FLOPs, bytes, kernels, bytes on the link."""
    out = dict.fromkeys(("gemm_flops", "float8_flops", "attention_flops", "elementwise_bytes", "fused_bytes",
                         "optimizer_bytes", "kernels", "comm_bytes"), 0.0)
    for phase, w in work.items():
        n = _weights(accum).get(phase, 0)
        out["gemm_flops"] += n * w.matmul_flops
        out["float8_flops"] += n * w.float8_flops
        out["attention_flops"] += n * w.attention_flops
        out["optimizer_bytes" if phase == "opt" else "elementwise_bytes"] += n * w.memory_bytes
        out["fused_bytes"] += n * w.fused_bytes
        out["kernels"] += n * w.ops
        out["comm_bytes"] += n * sum(c.moved for c in w.collectives if len(c.ranks) > 1)
    return out


def _weights(accum: int) -> dict[str, int]:
    """How often each measured phase runs in a step of `accum` micro-batches."""
    return {"fwd_accum": accum - 1, "bwd_accum": accum - 1, "fwd_last": 1, "bwd_last": 1, "opt": 1}


def predict(work: dict, a: Assumptions, accum: int, tokens_per_step: int, flops_per_token: float, world: int) -> dict:
    """Predicted step time (with and without overlap), tokens/s, MFU and the dominant term."""
    terms = dict.fromkeys(TERMS, 0.0)
    comm_fb = comm_opt = compute_fb = compute_opt = 0.0
    edges = beside_all = 0.0  # beside_all: the compute added were every collective hidden
    for phase, w in work.items():
        n = _weights(accum).get(phase, 0)
        if not n:
            continue
        t = _phase_times(w, a, optimizer=phase == "opt")
        compute = sum(t[k] for k in terms)
        for k in terms:
            terms[k] += n * t[k]
        if phase == "opt":
            compute_opt += compute
            comm_opt += t["comm"]
        else:
            compute_fb += n * compute
            comm_fb += n * t["comm"]
            beside_all += n * t["comm_beside"]
            first, last = t["comm_edges"]
            edges += first if phase.startswith("fwd") else 0.0
            edges += last if phase == "bwd_last" else 0.0
    no_overlap = compute_fb + comm_fb + compute_opt + comm_opt
    fb = overlap(compute_fb, comm_fb, edges, beside_all)
    step = fb.step + compute_opt + comm_opt
    terms["comm_exposed"] = fb.exposed + comm_opt
    terms["comm_beside"] = fb.beside
    terms["comm_total"] = comm_fb + comm_opt

    def rate(step_s):
        tps = tokens_per_step / step_s
        return {"step_ms": 1000 * step_s, "tokens_per_sec": tps, "tokens_per_sec_per_gpu": tps / world,
                "mfu_pct": mfu_pct(tps, flops_per_token, world, a.peak_tflops)}

    dominant = max((*TERMS, "comm_exposed", "comm_beside"), key=lambda k: terms[k])
    return {"overlap": rate(step), "no_overlap": rate(no_overlap),
            "terms_ms": {k: 1000 * v for k, v in terms.items()}, "dominant": dominant,
            "work": work_totals(work, accum), "assumptions": asdict(a)}
