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
and never less than the host's launch time (kernels x launch_us). Collectives cost ring traffic /
(bandwidth x link_efficiency), over the links they cross: a group whose ranks are on one node runs on
the GPU's link (titanlite.hardware); a group spanning nodes is bounded by the slower of that link and
the network its ranks on one node share (NCCL's rings spread over the node's NICs: ranks x
estimate.inter_node_gbps), and pays a latency per step of its ring, or tree for an all-reduce (not
charged inside one node, where whole-step fits cover it). Without overlap a step is compute +
communication; with overlap the collectives hide behind forward/backward compute except the first
all-gather and the last gradient reduction, which have nothing to hide behind, and the optimizer
phase's collectives. A
hidden collective is not free: its kernels take SMs and memory bandwidth from the compute beside
it, which runs longer by the collective's hidden time x a measured rate per kind of collective
(`beside_collectives` in calibration.json: all-reduce for ddp and zero1, gather and reduce-scatter
for fsdp and hsdp).

The rates come from estimation/calibration.json (`python -m estimation.calibrate` writes it from GPU
measurements): a GPU's own fit where it has one, else the entry's value (fitted on an H100) as the same
fraction of that GPU's peak; any `estimate.*_efficiency` / `estimate.launch_us` set above 0 overrides it.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import asdict, dataclass, field

from titanlite.models.args import mfu_pct

from estimation.hardware import GPUS_PER_NODE, Hardware, gpus_per_node

CALIBRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")
RATES = ("gemm_efficiency", "float8_efficiency", "elementwise_efficiency", "fused_efficiency",
         "optimizer_efficiency", "link_efficiency", "gap_us", "launch_us")
TERMS = ("gemm", "attention", "elementwise", "optimizer", "gaps", "launch")
# collective op (estimation.tracker.COLLECTIVES) -> its kind in calibration.json's beside_collectives
COLLECTIVE_KIND = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "broadcast_": "all_reduce",
                   "_allgather_base_": "sharded", "allgather_into_tensor_coalesced_": "sharded",
                   "_reduce_scatter_base_": "sharded", "reduce_scatter_tensor_coalesced_": "sharded",
                   "alltoall_base_": "sharded"}


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


def load_calibration(path: str = CALIBRATION) -> dict:
    with open(path) as fh:
        return json.load(fh)


def assumptions(est, hw: Hardware, world: int, attention_backend: str, calibration: dict | None = None) -> Assumptions:
    cal = calibration or load_calibration()
    rates, sources = {}, {}
    for name in RATES:
        override = getattr(est, name, 0.0)
        value, source = gpu_rate(cal["rates"][name], hw.key)
        rates[name] = override if override > 0 else value
        sources[name] = "estimate." + name if override > 0 else source
    attention, sources["attention_efficiency"] = gpu_rate(
        cal["attention"].get(attention_backend, cal["attention"]["sdpa"]), hw.key)
    beside = {}
    for kind, entry in cal.get("beside_collectives", {}).items():
        beside[kind], sources[f"beside_{kind}"] = _beside_rate(entry, hw.key)
    return Assumptions(peak_tflops=hw.peak_tflops, hbm_tbps=hw.hbm_tbps, link_gbps=hw.link_gbps,
                       attention_backend=attention_backend, attention_efficiency=attention, sources=sources,
                       gpus_per_node=gpus_per_node(est), network_gbps=est.inter_node_gbps / 8,
                       beside_collectives=beside, **rates)


# The GPU whose fits are each entry's own value, which every other GPU without a fit takes.
REFERENCE_GPU = "h100"


def gpu_rate(entry: dict, gpu: str) -> tuple[float, str]:
    """A rate on `gpu` and its source: the GPU's own fit where the entry holds one under its key
    (`python -m estimation.calibrate --write` stores them), else the entry's value (REFERENCE_GPU's),
    which every GPU without its own fit takes as the same fraction of its peak."""
    own = entry.get(gpu)
    return (own["value"], _source(own)) if isinstance(own, dict) else (entry["value"], _source(entry))


def _beside_rate(entry: dict, gpu: str) -> tuple[float, str]:
    """One kind of collective's beside rate on `gpu`, and its source: the GPU's own fit, else the mean of
    the GPUs fitted (how much a collective slows the compute beside it differed several-fold between
    the 2 x H100 and the 2 x H200 measured)."""
    fits = {k: e for k, e in entry.items() if isinstance(e, dict)}
    if gpu in fits:
        return fits[gpu]["value"], _source(fits[gpu])
    return sum(e["value"] for e in fits.values()) / len(fits), f"mean of the fits on {', '.join(sorted(fits))}"


def _source(entry: dict) -> str:
    return f"{entry['source']} ({entry['date']})" if entry.get("date") else entry["source"]


# Latency of a collective across nodes, in microseconds: per call, and per step of its ring or tree over
# NVLink and over the network. Assumed, of the order NCCL's own tuning model takes for large messages;
# not measured here.
LATENCY_US = {"call": 8.0, "nvlink": 3.0, "network": 10.0}


def span(ranks, per_node: int) -> tuple[int, int]:
    """(nodes a group's ranks are on, the most of them on one node); torchrun numbers ranks node by node."""
    counts = Counter(r // per_node for r in ranks)
    return len(counts), max(counts.values())


def collective_seconds(c, a: Assumptions) -> float:
    """One collective's time: its ring traffic over the links it crosses, plus latency across nodes.

    Inside one node: the GPU's link. Across nodes NCCL runs several rings (or trees) at once, each leaving
    the node through another NIC, so a node's ranks in the group share their NICs' bandwidth: the group
    is bounded by min(link, ranks per node x network per GPU), e.g. fsdp over 2 x 8 GPUs by 8 NICs, hsdp's
    replicate all-reduce (one rank per node) by one. Latency: a ring's steps (n - 1, twice for an
    all-reduce), of which one per node boundary crosses the network; an all-reduce takes the lesser of
    that and a tree's (up and down: the ranks of a node in a chain, the nodes in a binary tree)."""
    nodes, local = span(c.ranks, a.gpus_per_node)
    if nodes == 1:
        return c.moved / (a.link_gbps * 1e9 * a.link_efficiency)
    bandwidth = min(a.link_gbps, local * a.network_gbps) * 1e9 * a.link_efficiency
    lat, n = LATENCY_US, len(c.ranks)

    def steps(nvlink, network):
        return nvlink * lat["nvlink"] + network * lat["network"]

    ring = steps(n - nodes, nodes - 1)
    if c.op in ("allreduce_", "allreduce_coalesced_"):
        ring = min(2 * ring, 2 * steps(local - 1, math.ceil(math.log2(nodes))))
    return c.moved / bandwidth + (lat["call"] + ring) * 1e-6


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
    t["comm_beside"] = sum(a.beside_collectives.get(COLLECTIVE_KIND.get(name, ""), 0.0) * c for name, c in comms)
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
    hidden_comm = max(0.0, comm_fb - edges)
    # only the share of the collectives that runs beside compute slows it: the hidden share, and of that no
    # more than the compute's own length (a collective longer than the compute, on a slow network, spends
    # the rest beside nothing)
    beside = beside_all * min(hidden_comm, compute_fb) / comm_fb if comm_fb else 0.0
    overlap = max(compute_fb + beside, hidden_comm) + min(edges, comm_fb) + compute_opt + comm_opt
    terms["comm_exposed"] = max(0.0, overlap - compute_fb - beside - compute_opt)
    terms["comm_beside"] = beside
    terms["comm_total"] = comm_fb + comm_opt

    def rate(step_s):
        tps = tokens_per_step / step_s
        return {"step_ms": 1000 * step_s, "tokens_per_sec": tps, "tokens_per_sec_per_gpu": tps / world,
                "mfu_pct": mfu_pct(tps, flops_per_token, world, a.peak_tflops)}

    dominant = max((*TERMS, "comm_exposed", "comm_beside"), key=lambda k: terms[k])
    return {"overlap": rate(overlap), "no_overlap": rate(no_overlap),
            "terms_ms": {k: 1000 * v for k, v in terms.items()}, "dominant": dominant,
            "work": work_totals(work, accum), "assumptions": asdict(a)}
