"""Do the runs differ in nothing but the world size? One row per setting, and the scaling mode
(weak: the same work per GPU; strong: the same global batch) their batches allow."""

from __future__ import annotations

from titanlite.diagnose.advice import advise, device_cause
from titanlite.diagnose.records import Finding, Setting
from titanlite.diagnose.runs import Run


# ------------------------------------------------------------------------------ like for like
def cfg_value(run: Run, key: str):
    c = run.config
    if key == "model":
        name, flavor = c.get("model.name", run.model.get("name")), c.get("model.flavor", run.model.get("flavor"))
        return f"{name}/{flavor}" if name else None
    if key == "hardware":
        return run.hardware.get("name")
    if key == "data_parallel":  # one rank runs the single-device path whatever the mode is
        return None if run.world == 1 else c.get("data_parallel")
    if key == "cpus_job":
        return cpus_job(run)
    if key == "cpus_per_rank":
        return cpus_per_rank(run)
    if key in dict(HOST_KEYS):
        return (run.hardware.get("host") or {}).get(key)
    return None if c.get(key) == "" else c.get(key)  # an empty string is a setting left unset


MUST_MATCH = [("model", "model"), ("seq_len", "seq_len"), ("training.mixed_precision_param", "precision"),
              ("compile", "compile"), ("use_cuda_graphs", "CUDA graphs"), ("attention_backend", "attention"),
              ("float8.enable", "float8"), ("activation_checkpoint.mode", "activation checkpointing"),
              ("data_parallel", "parallel mode"), ("training.dataset", "dataset"), ("training.dataset_path", "dataset path"),
              ("hardware", "hardware")]
BATCH_KEYS = [("batch_size", "local batch"), ("gradient_accumulation_steps", "accumulation steps"),
              ("global_batch_size", "global batch")]
# the host side (run log startup_info.hardware.host). On CPU the threads are the compute, so they must
# match; on GPU they only feed the kernels. The CPUs the job may use are compared, not required to match:
# a run with fewer of them per rank is the finding (named host-starved where its host time grows, a
# compute stall on CPU). The host's CPUs must match anywhere: another machine.
HOST_KEYS = [("threads_per_process", "threads per process"), ("cpus", "CPUs of the host"),
             ("cpus_job", "CPUs the job may use"), ("cpus_per_rank", "CPUs per rank"),
             ("data_workers", "data workers per process")]
HOST_MUST_MATCH = {"cpu": {"threads_per_process", "cpus"}, "cuda": {"cpus"}}


def cpus_job(run: Run) -> float | None:
    """The CPUs the job's processes may run on: their affinity, under the cgroup's quota where one is set
    (None where the log does not record them)."""
    host = run.hardware.get("host") or {}
    affinity, quota = host.get("cpus_affinity"), host.get("cpu_quota")
    if not isinstance(affinity, (int, float)):
        return None
    return min(affinity, quota) if isinstance(quota, (int, float)) and quota > 0 else affinity


def cpus_per_rank(run: Run) -> float | None:
    """The CPUs each rank on a host has: the job's CPUs shared by the ranks started there."""
    cpus, ranks = cpus_job(run), (run.hardware.get("host") or {}).get("ranks_per_host")
    return None if cpus is None or not isinstance(ranks, int) or ranks < 1 else round(cpus / ranks, 3)


def scaling_mode(runs: list[Run]) -> str:
    """weak: the same work per GPU (per step, or per micro-step when only the accumulation differs,
    whose per-GPU rate is still comparable); strong: the same global batch."""
    base = runs[0]
    if len(runs) == 1:
        return "single_run"
    if all(r.world == base.world for r in runs):
        return "same_world_size"
    if all(r.tokens_per_gpu_step == base.tokens_per_gpu_step for r in runs):
        return "weak"
    if all(r.tokens_per_step == base.tokens_per_step for r in runs):
        return "strong"
    if all(r.micro_batch_tokens == base.micro_batch_tokens for r in runs):
        return "weak"
    return "not_comparable"


def like_for_like(runs: list[Run]) -> tuple[list[Setting], list[Finding]]:
    rows, findings = [], []
    mode = scaling_mode(runs)
    if mode == "single_run":
        return rows, findings
    must = HOST_MUST_MATCH.get(runs[0].device, set())
    for key, name in MUST_MATCH + BATCH_KEYS + HOST_KEYS:
        values = [cfg_value(r, key) for r in runs]
        known = {repr(v) for v in values if v is not None}
        if key in dict(BATCH_KEYS):
            ok = mode != "not_comparable"
        elif key in dict(HOST_KEYS):
            ok = len(known) <= 1 or key not in must
        else:
            ok = len(known) <= 1
        rows.append(Setting(name, key, values, len(known) <= 1, ok))
    bad = [r for r in rows if not r.ok]
    if bad:
        what = "; ".join(f"{r.setting}: " + " vs ".join(str(v) for v in r.values) for r in bad)
        findings.append(Finding(
            "config_mismatch", "high",
            f"The runs differ in more than the world size ({what}): their throughput cannot be compared as scaling.",
            {r.key: r.values for r in bad}, advise("config_mismatch", cause := device_cause(runs[0].device)),
            score=1.0, cause=cause))
    return rows, findings
