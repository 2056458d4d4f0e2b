"""What to check next for each finding, as data: ADVICE keyed by (finding kind, cause), REMEDIES keyed
by name. A detector names its finding's kind, its cause and the remedies that apply (Finding.kind,
.cause, .remedies); `advise` writes the report's "Next check" from them, and nothing else in the
package writes advice. What each remedy measured lives in docs/diagnosis.md ("Measured remedies").

Causes: for the kinds whose checks depend on what computes, "gpu" or "cpu" (a CPU run's compute is
its host: torchrun gives each of several processes one intra-op thread where a plain one-process
launch uses every core); "misreport" (the reconstruction found what the logger got wrong) or
"figures_disagree" (a logged figure disagrees with its own inputs) for measurement_inconsistency;
"gpu_waiting" (the GPUs' utilisation or power fell: they waited) or "gpu_throttled" (as busy, lower clocks) for a
compute_stall whose logs carry the GPUs' own readings;
"overlap_contention" (compute grew beside overlapped collectives) or "slow_link" (communication several
times its prediction, however little of the step it costs) for a healthy run's largest loss and a
scaling loss's; "split" (a scaling loss the phases spread) or "step_only" (logs that time only the
step) for a scaling loss; "host_starved" (host time grew with fewer CPUs per rank) for host overhead;
"" for a kind's one piece of advice. Texts name their placeholders in braces: {rank} (straggler),
{fixes} (misreport), {remedies} (the finding's remedies, in the order they measured best).
"""

from __future__ import annotations

from dataclasses import dataclass

GPU, CPU = "gpu", "cpu"

# a healthy run's largest loss and a scaling loss share their causes, and what to check for each
SLOW_LINK = (
    "Run the largest job again with NCCL_DEBUG=INFO and read the transport its rings use (P2P over NVLink inside "
    "a host; SHM or NET where peer-to-peer is off or unavailable), and measure the link at the gradient size "
    "(nccl-tests all_reduce_perf) against the figure used here (--link-gbps).")
OVERLAP_CONTENTION = (
    "Run benchmarks/stream_profile.py under torchrun with the same options: it shows how much longer the "
    "GEMMs take beside the NCCL kernels than on one GPU, and how much communication is exposed. To shrink "
    "the overlap's cost: {remedies} (what each measured: docs/diagnosis.md, 'Measured remedies').")

ADVICE: dict[tuple[str, str], str] = {
    ("compute_stall", GPU): (
        "Per-GPU work is equal, so each GPU should compute as fast at every world size. Check that every rank has "
        "its own GPU (nvidia-smi shows one training process per GPU; each rank uses cuda:LOCAL_RANK), watch "
        "`nvidia-smi --query-gpu=index,clocks.sm,clocks_throttle_reasons.active,temperature.gpu,power.draw "
        "--format=csv -l 1` for throttling, and check CPU oversubscription (ranks x OMP_NUM_THREADS x data workers "
        "<= cores). Then rerun the larger config on 1 GPU with the same local batch: its compute per micro-step "
        "should match the baseline."),
    ("compute_stall", "gpu_waiting"): (
        "The GPUs spent part of each step waiting (no kernel running, or kernels that wait), so look at what for. "
        "A slower rank first: the per-rank breakdown and `nvidia-smi` for one GPU shared or throttled. The host: other "
        "load on the machine (top; ranks x OMP_NUM_THREADS x (1 + data workers) <= cores), each rank's CPU and "
        "NUMA binding, and the gaps between kernels in a profile of a few steps (--profiling.enable); a step "
        "whose host time is close to its GPU time shows every host hiccup (fewer launches: --compile.enable, a "
        "larger local batch; under fsdp, fewer and larger FSDP groups: --parallelism.fsdp_blocks_per_group, which "
        "auto sets for models of small blocks; benchmarks/step_host_time.py measures the host's time a step). "
        "Then the link: collectives on the copy engines (fsdp's parameter gathers with "
        "parallelism.fsdp_copy_engine_all_gather) leave the GPU idle while a slow or shared link holds them: "
        "rerun with it off, and measure the link (nccl-tests) while the job runs."),
    ("compute_stall", "gpu_throttled"): (
        "The GPUs were busy but clocked lower than in the baseline: read the throttle reasons while the job runs "
        "(`nvidia-smi --query-gpu=index,clocks.sm,clocks_throttle_reasons.active,temperature.gpu,power.draw,"
        "power.limit --format=csv -l 1`): a power cap, heat, or a clock limit set on some GPUs (nvidia-smi -q -d "
        "CLOCK). Then rerun the larger config on 1 GPU with the same local batch: its compute per micro-step "
        "should match the baseline."),
    ("compute_stall", CPU): (
        "Per-process work is equal, so each process should compute as fast at every world size. Compare threads "
        "per process (OMP_NUM_THREADS; torchrun sets 1 when launching several) and check processes x threads x "
        "(1 + data workers) <= CPUs (nproc), and other load on the machine (top). Then rerun the larger config as "
        "one process with the same threads per process: its compute per micro-step should match the baseline."),
    ("data_stall", ""): (
        "Rerun with --training.dataset synthetic: if the data wait disappears, the input pipeline is the cause. "
        "Then raise --data.num_workers / --data.prefetch_factor, keep --data.pin_memory on, and check the "
        "storage and page cache the shards are read from."),
    ("communication", ""): (
        "Measure the link: nccl-tests all_reduce_perf at the gradient size on these GPUs, and compare its bus "
        "bandwidth with the figure used here (--link-gbps). Run with NCCL_DEBUG=INFO to see the transport "
        "(NVLink vs PCIe/SHM); check overlap (--parallelism.ddp_bucket_cap_mb; what bucket sizes measured: "
        "docs/diagnosis.md, 'Measured remedies') and the reduce dtype."),
    ("straggler", GPU): (
        "Look at that rank's device alone: `nvidia-smi -i {rank} -q -d PERFORMANCE,CLOCK,TEMPERATURE` (throttle "
        "reasons), other processes on it, its CPU/NUMA affinity and its data shard; rerun with LOG_RANK={rank} to "
        "read its own console."),
    ("straggler", CPU): (
        "Look at rank {rank}'s process: its CPU affinity (taskset -p PID), other load on its cores (top), its data "
        "shard; rerun with LOG_RANK={rank} to read its own console."),
    ("host_overhead", GPU): (
        "Profile a few steps (--profiling.enable) and look for gaps between kernels; reduce launches with "
        "--compile.enable or --training.cuda_graphs, or give each kernel more work with a larger local batch."),
    ("host_overhead", "host_starved"): (
        "Give each rank the CPUs the baseline's had: the job's CPU affinity (taskset, the scheduler's binding: "
        "--cpus-per-task) and its container's quota (cpu.max) against ranks x (threads + data workers); rerun the "
        "smaller job with as few CPUs per rank as the larger had: if its host time grows the same, the CPUs are the "
        "cause."),
    ("host_overhead", CPU): (
        "Profile a few steps (--profiling.enable) and look for time outside the ops; fewer, larger ops "
        "(--compile.enable, a larger local batch) and threads per process x processes <= CPUs."),
    ("config_mismatch", GPU): (
        "Rerun so that only the world size differs (same model, seq_len, precision, compile, parallel mode, "
        "threads per process, and either the same per-GPU batch and accumulation, or the same global batch)."),
    ("config_mismatch", CPU): (
        "Rerun so that only the world size differs: the same threads per process in every run (OMP_NUM_THREADS=N "
        "for the one-process run too, with processes x threads <= CPUs), and the same model, seq_len, precision "
        "and batch settings."),
    ("measurement_inconsistency", "figures_disagree"): (
        "Check how the logger computes the figure: tokens per step must be local batch x accumulation x ranks x "
        "seq_len, over the same wall-clock interval as time_ms (per optimizer step, not per micro-step); MFU must "
        "divide by GPUs x dense peak. Until fixed, trust step time and the batch settings, not the logged rate."),
    ("measurement_inconsistency", "misreport"): (
        "Fix the logger: {fixes}. Until then, read throughput from the step time and the micro-steps each GPU "
        "runs (the reconstruction table), not from the logged rate or MFU."),
    ("insufficient_data", ""): (
        "Log several steps past the warm-up (the first 10% of the run): more steps (--training.steps) or a "
        "smaller --metrics.log_freq, then diagnose again."),
    ("scaling_loss", "step_only"): (
        "Run the job at both sizes with titanlite (its run log times each rank's data, compute, comm and idle) or with "
        "a profile of a few steps at the larger size (--profiling.enable): exposed NCCL kernels are communication, "
        "longer GEMMs beside them are the overlap's contention, gaps between kernels are the host, and one rank "
        "slower than the others is a straggler."),
    ("scaling_loss", "split"): (
        "Look at the phase that grew most: comm (measure the link at the gradient size with nccl-tests), compute "
        "beside overlapped collectives (benchmarks/stream_profile.py shows how much longer the GEMMs take beside "
        "the NCCL kernels), idle (the host: a profile of a few steps, --profiling.enable) or data."),
    ("scaling_loss", "slow_link"): SLOW_LINK,
    ("scaling_loss", "overlap_contention"): OVERLAP_CONTENTION,
    ("healthy", ""): (
        "Nothing to fix at these sizes. To go further, profile the largest run (--profiling.enable) and compare "
        "its MFU with the single-GPU baseline."),
    ("healthy", "slow_link"): SLOW_LINK,
    ("healthy", "overlap_contention"): OVERLAP_CONTENTION,
}


@dataclass(frozen=True)
class Remedy:
    text: str
    note: bool = False  # says what the run already does, rather than what to change


REMEDIES: dict[str, Remedy] = {
    "ddp_reduce_bf16": Remedy("--parallelism.ddp_reduce_dtype bfloat16 halves the all-reduced bytes (the gradients "
                              "are summed over the ranks in bf16)"),
    "fsdp_copy_engine_gathers": Remedy("--parallelism.fsdp_copy_engine_all_gather auto moves the parameter "
                                       "all-gathers onto the copy engines"),
    "fsdp_reduce_bf16": Remedy("--parallelism.fsdp_reduce_dtype bfloat16 halves the gradient bytes"),
    "fsdp_grads_crossed_bf16": Remedy("the bf16 gradients already crossed the link as they are, summed in float32 "
                                      "(parallelism.fsdp_gradient_transport): a bf16 reduction would save no bytes",
                                      note=True),
    "fsdp_instead": Remedy("fsdp, whose parameter all-gathers take the copy engines on one NVSwitch host "
                           "(parallelism.fsdp_copy_engine_all_gather=auto), keeps most of its collectives off the SMs"),
    "fsdp_gathers_ran_on_copy_engines": Remedy("the parameter all-gathers already ran on the copy engines", note=True),
    "fsdp_gathers_auto": Remedy("parallelism.fsdp_copy_engine_all_gather=auto puts the parameter all-gathers on "
                                "the copy engines on one NVSwitch host; the run's start-up log says whether it "
                                "did, and why not", note=True),
}


def device_cause(device: str) -> str:
    """The cause of a kind whose advice depends on what computes: the host for a CPU run."""
    return CPU if device == "cpu" else GPU


def advise(kind: str, cause: str = "", remedies: list[str] | tuple[str, ...] = (), **fields) -> str:
    """The next check for a finding: ADVICE[(kind, cause)] with its placeholders filled, {remedies}
    from REMEDIES in the order given (what the run already does in parentheses after them)."""
    do = [REMEDIES[r].text for r in remedies if not REMEDIES[r].note]
    notes = [REMEDIES[r].text for r in remedies if REMEDIES[r].note]
    listed = "; then ".join(do) + (f" ({'; '.join(notes)})" if notes else "")
    return ADVICE[kind, cause].format(remedies=listed, **fields)
