"""Step time, tokens/s and MFU from the work a fake step recorded, under a stated model.

Each phase (forward, backward, per micro-step; optimizer) costs the sum of its kernels on one stream:
  matmuls      FLOPs / (bf16 peak x gemm_efficiency)      (float8 matmuls at twice the bf16 peak)
  attention    causal FLOPs / (bf16 peak x the attention kernel's efficiency)
  memory-bound bytes read + written / (HBM bandwidth x memory_efficiency), times
               compile_traffic_factor when torch.compile fuses the element-wise chains
and never less than the host's launch time (ops x launch_us). Collectives cost ring traffic /
(link bandwidth x link_efficiency). Without overlap a step is compute + communication; with overlap
the collectives hide behind forward/backward compute except the first all-gather and the last
gradient reduction, which have nothing to hide behind, and the optimizer phase's collectives.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from titanlite.models.args import mfu_pct

from estimation.hardware import ATTENTION_EFFICIENCY, GPUS_PER_NODE, INTER_NODE_GBPS, Hardware


@dataclass
class Assumptions:
    peak_tflops: float
    gemm_efficiency: float
    attention_backend: str
    attention_efficiency: float
    hbm_tbps: float
    memory_efficiency: float
    link_gbps: float
    link_efficiency: float
    compile: bool
    compile_traffic_factor: float
    launch_us: float


def assumptions(est, hw: Hardware, world: int, attention_backend: str, compile: bool) -> Assumptions:
    link = hw.link_gbps if world <= GPUS_PER_NODE else min(hw.link_gbps, INTER_NODE_GBPS)
    return Assumptions(
        peak_tflops=hw.peak_tflops, gemm_efficiency=est.gemm_efficiency, attention_backend=attention_backend,
        attention_efficiency=ATTENTION_EFFICIENCY.get(attention_backend, ATTENTION_EFFICIENCY["sdpa"]),
        hbm_tbps=hw.hbm_tbps, memory_efficiency=est.memory_efficiency, link_gbps=link,
        link_efficiency=est.link_efficiency, compile=compile, compile_traffic_factor=est.compile_traffic_factor,
        launch_us=est.launch_us)


def _phase_times(w, a: Assumptions) -> dict[str, float]:
    """Seconds per term for one phase's work."""
    peak = a.peak_tflops * 1e12
    fused = a.compile_traffic_factor if a.compile else 1.0
    t = {
        "matmul": w.matmul_flops / (peak * a.gemm_efficiency) + w.float8_flops / (2 * peak * a.gemm_efficiency),
        "attention": w.attention_flops / (peak * a.attention_efficiency),
        "memory_bound": w.memory_bytes * fused / (a.hbm_tbps * 1e12 * a.memory_efficiency),
    }
    host = w.ops * fused * a.launch_us * 1e-6
    t["launch"] = max(0.0, host - sum(t.values()))  # only the part the GPU cannot hide
    comms = [moved / (a.link_gbps * 1e9 * a.link_efficiency) for _, moved, n in w.collectives if n > 1]
    t["comm"] = sum(comms)
    t["comm_edges"] = (comms[0] if comms else 0.0, comms[-1] if comms else 0.0)
    return t


def predict(work: dict, a: Assumptions, accum: int, tokens_per_step: int, flops_per_token: float, world: int) -> dict:
    """Predicted step time (with and without overlap), tokens/s, MFU and the dominant term."""
    weights = {"fwd_accum": accum - 1, "bwd_accum": accum - 1, "fwd_last": 1, "bwd_last": 1, "opt": 1}
    terms = dict.fromkeys(("matmul", "attention", "memory_bound", "launch"), 0.0)
    comm_fb = comm_opt = compute_fb = compute_opt = 0.0
    edges = 0.0
    for phase, w in work.items():
        n = weights.get(phase, 0)
        if not n:
            continue
        t = _phase_times(w, a)
        compute = sum(t[k] for k in terms)
        for k in terms:
            terms[k] += n * t[k]
        if phase == "opt":
            compute_opt += compute
            comm_opt += t["comm"]
        else:
            compute_fb += n * compute
            comm_fb += n * t["comm"]
            first, last = t["comm_edges"]
            edges += first if phase.startswith("fwd") else 0.0
            edges += last if phase == "bwd_last" else 0.0
    no_overlap = compute_fb + comm_fb + compute_opt + comm_opt
    hidden_comm = max(0.0, comm_fb - edges)
    overlap = max(compute_fb, hidden_comm) + min(edges, comm_fb) + compute_opt + comm_opt
    terms["comm_exposed"] = overlap - compute_fb - compute_opt
    terms["comm_total"] = comm_fb + comm_opt

    def rate(step_s):
        tps = tokens_per_step / step_s
        return {"step_ms": 1000 * step_s, "tokens_per_sec": tps, "tokens_per_sec_per_gpu": tps / world,
                "mfu_pct": mfu_pct(tps, flops_per_token, world, a.peak_tflops)}

    dominant = max(("matmul", "attention", "memory_bound", "launch", "comm_exposed"), key=lambda k: terms[k])
    return {"overlap": rate(overlap), "no_overlap": rate(no_overlap),
            "terms_ms": {k: 1000 * v for k, v in terms.items()}, "dominant": dominant,
            "assumptions": asdict(a)}
