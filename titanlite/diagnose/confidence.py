"""How far a verdict can be trusted, why not further, and which runs' figures a finding may rest on."""

from __future__ import annotations

from titanlite.diagnose.expected import gradient_bytes
from titanlite.diagnose.like_for_like import cfg_value
from titanlite.diagnose.reconstruct import HARDWARE_FLAG, MODEL_FLAG, Reconstruction
from titanlite.diagnose.records import CONFIDENCE, Finding, Reason, Thresholds
from titanlite.diagnose.runs import Run


def confidence(runs: list[Run], rec: Reconstruction | None, th: Thresholds,
               findings: list[Finding] = ()) -> tuple[str, list[Reason]]:
    """How far the verdict can be trusted, and why not further: a check that could not run (an unknown
    GPU or model, a host the log does not describe) keeps it below high, and names the flag that
    would let it run."""
    why: list[Reason] = []
    for r in runs:
        n = len(r.entries)
        if r.only_warmup:
            why.append(Reason(r.label, "warmup_only", 2, f"{r.label}: every logged entry is warm-up, so its step "
                                                         "time holds start-up and compilation"))
        elif n < th.min_steady:
            why.append(Reason(r.label, "few_entries", 2 if n == 1 else 1,
                              f"{r.label}: {n} steady log entr{'y' if n == 1 else 'ies'} (fewer than {th.min_steady}): "
                              "too few to weigh a difference against step-to-step jitter"))
        if not r.has_step_time:
            why.append(Reason(r.label, "no_step_time", 1, f"{r.label}: no time per iteration in the log, so its step "
                                                          "time is derived from its logged tokens/s, which no clock can check"))
    on_gpu = {r.label for r in runs if r.device == "cuda"}
    for rr in rec.runs if rec else []:
        if rr.plausibility == "impossible":
            why.append(Reason(rr.label, "impossible", 2, f"{rr.label}: no reading of its log is physically possible "
                                                         f"({rr.why})"))
        elif rr.plausibility == "suspect":
            why.append(Reason(rr.label, "suspect", 1,
                              f"{rr.label}: its figures imply only {100 * rr.dense_peak_share:.1f}% of the dense bf16 "
                              "peak, too little for a GPU that is not starved: a figure may be wrong in a way no "
                              "reading covers"))
        unchecked = rr.plausibility == "unchecked" and rr.gpu != "cpu" and rr.label in on_gpu
        missing = [what for what, known in (("the GPU", rr.peak_tflops_dense), ("the model", rr.flops_per_token))
                   if not known] if unchecked else []
        flags = tuple(f for f, known in ((HARDWARE_FLAG, rr.peak_tflops_dense), (MODEL_FLAG, rr.flops_per_token))
                      if not known) if unchecked else ()
        if unchecked:
            why.append(Reason(rr.label, "gpu_unknown" if not rr.peak_tflops_dense else "model_unknown", 1,
                              f"{rr.label}: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not known "
                              f"({rr.gpu or 'not in the log'}), so no reading could be checked against the dense "
                              f"peak (pass {' and '.join(f.split()[0] for f in flags)})", flags))
        if rr.ambiguous_with:
            why.append(Reason(rr.label, "ambiguous", 1, f"{rr.label}: another reading fits its log as well "
                                                        f"({'; '.join(rr.ambiguous_with)})",
                              tuple(rec.settle_flags), tuple(rec.settle_logs)))
    top = findings[0].kind if findings else ""
    if top in ("compute_stall", "communication") and len(runs) > 1:
        for r in runs:
            if gradient_bytes(r) is None:
                why.append(Reason(r.label, "allreduce_unknown", 1, f"{r.label}: the model's size is not known, so the "
                                  "all-reduce's cost could not be told apart from compute (pass --model)", (MODEL_FLAG,)))
    if top == "compute_stall" and len(runs) > 1 and all(r.device == "cpu" for r in runs):
        for r in runs:
            if cfg_value(r, "threads_per_process") is None:
                why.append(Reason(r.label, "host_unknown", 1, f"{r.label}: its threads per process are not in the log "
                                  "(torchrun gives each of several processes one), so slower compute per process "
                                  "may be fewer threads, not a stall"))
    level = max((w.level for w in why), default=0)
    return CONFIDENCE[level], why




def trusted(r: Run, rec: Reconstruction | None) -> bool:
    """Figures a stall, communication or straggler finding may rest on."""
    if r.only_warmup:
        return False
    rr = next((x for x in rec.runs if x.label == r.label), None) if rec else None
    return rr is None or rr.plausibility != "impossible"
