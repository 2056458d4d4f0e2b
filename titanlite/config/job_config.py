"""Typed configuration sections.

Every field carries its own documentation in `metadata["help"]`; `python -m titanlite.train --help`
prints them all. Ranges live in `metadata["min"]` / `metadata["max"]`; closed sets of choices are
`Literal[...]` types, and choices that a registry of the library owns name it in `metadata["registry"]`
("module:attribute"), so a new entry there is a new valid value here. Validation against these happens in `titanlite.config.manager`, so a field
added here is parsed, checked and documented with no further code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


def doc(default, help: str, **bounds):
    """A dataclass field with its help text and optional numeric bounds (min/max, inclusive, and why=
    the reason a refusal gives) or the registry its value must be a key of (registry="module:attribute")."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **bounds})
    return field(default=default, metadata={"help": help, **bounds})


@dataclass
class Job:
    config_file: str = doc("", "TOML file to read; CLI overrides win over it, it wins over defaults")
    dump_folder: str = doc("./outputs", "folder for run logs, the resolved config, checkpoints, traces")
    description: str = doc("", "free text recorded in the run log")


@dataclass
class Model:
    name: str = doc("llama", "model family from the registry (llama, qwen3)")
    flavor: str = doc("debug", "size preset of the family (see titanlite.models)")
    attention_backend: str = doc("auto", "attention kernel; auto picks the fastest available and logs which",
                                 registry="titanlite.ops.attention:CHOICES")
    init: str = doc("scaled", "weight initialisation scheme: scaled (embeddings std 0.02, the blocks' output "
                              "projections scaled by the model's depth) or per_layer (the Llama reference scheme "
                              "torchtitan uses: unit embeddings, output projections scaled by each block's depth); "
                              "in both the output layer starts the loss near ln(vocab) (logits of std 0.5; tied "
                              "embeddings std 1/dim)",
                    registry="titanlite.models.transformer:INITS")
    vocab_size: int = doc(0, "override the flavor's vocabulary size (0 = flavor's, or the tokenizer's for text data)", min=0)


@dataclass
class Optimizer:
    name: Literal["AdamW"] = doc("AdamW", "optimizer")
    lr: float = doc(3e-4, "peak learning rate", min=0.0)
    beta1: float = doc(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = doc(0.95, "AdamW beta2", min=0.0, max=1.0)
    eps: float = doc(1e-8, "AdamW epsilon", min=0.0)
    weight_decay: float = doc(0.1, "decoupled weight decay (not applied to norms and biases)", min=0.0)
    fused: Literal["auto", "true", "false"] = doc(
        "auto", "titanlite's one-pass AdamW kernel (Triton); false: torch's fused AdamW kernel on CUDA instead "
                "(fp32 temporaries around it for bf16 parameters and moments), foreach ops on the CPU; auto = on for CUDA")
    fuse_clip: bool = doc(True, "with the fused kernel, apply the grad-norm clip inside it (saves a pass over the grads)")
    moments_dtype: Literal["float32", "bfloat16"] = doc(
        "float32", "dtype of AdamW's two moments; bfloat16 halves their memory and the update's traffic (the "
                   "arithmetic stays fp32, stores round to nearest), with titanlite's MasterAdamW: 1 device, ddp or "
                   "zero1, beta2 <= 0.99. Convergence: docs/performance.md")


@dataclass
class LRScheduler:
    warmup_steps: int = doc(200, "linear warm-up steps from 0 to the peak lr", min=0)
    decay_type: Literal["cosine", "linear", "wsd"] = doc(
        "cosine", "decay after warm-up; wsd holds the peak, then decays linearly over decay_ratio of the run")
    decay_ratio: float = doc(0.2, "wsd only: fraction of training steps spent decaying", min=0.0, max=1.0)
    min_lr_factor: float = doc(0.1, "final lr as a fraction of the peak", min=0.0, max=1.0)


@dataclass
class Training:
    dataset: str = doc("python_stdlib", "dataset from the registry: synthetic, python_stdlib, or prepared "
                                        "(shards from python -m titanlite.data.prepare; see docs/data.md)")
    dataset_path: str = doc("", "dataset=prepared: the folder written by python -m titanlite.data.prepare")
    local_batch_size: int = doc(8, "sequences per GPU per micro-step", min=1)
    global_batch_size: int = doc(-1, "sequences per optimizer step over all ranks; -1 = local x data-parallel ranks "
                                     "(gradient accumulation = global / (local x dp ranks))", min=-1)
    seq_len: int = doc(2048, "tokens per sequence", min=2)
    steps: int = doc(1000, "optimizer steps to train", min=1)
    max_norm: float = doc(1.0, "gradient-norm clip (0 disables clipping)", min=0.0)
    mixed_precision_param: Literal["auto", "bfloat16", "float32"] = doc(
        "auto", "compute dtype: auto = bf16 on CUDA, fp32 elsewhere; bfloat16 = bf16 on any device (CPU too: "
                "slow, for tests); float32. bf16 comes from training.bf16_params or autocast (1 device, ddp, "
                "zero1), or from FSDP's parameter dtype (fsdp, hsdp)")
    bf16_params: bool = doc(
        True, "where the run computes in bf16 on 1 device, ddp or zero1: the transformer blocks' matrices stay fp32 "
              "master parameters and multiply bf16 copies of themselves, which the optimizer rewrites as it updates "
              "the masters (one fused kernel), so autocast's per-step weight casts go; each weight gradient comes "
              "out of its GEMM in fp32 and later micro-steps add into it there, so accumulation and the ddp "
              "all-reduce are fp32; embeddings, norms, head and residual stream stay fp32 under autocast. float8's "
              "matrices keep bf16 weights and gradients instead (fp32 under zero1). fsdp/hsdp: FSDP's "
              "mixed-precision policy does the equivalent. false: plain autocast (casts each weight every "
              "forward). See docs/performance.md")
    seed: int = doc(42, "seed for weights, data order and dropout-free RNG")
    deterministic: bool = doc(False, "use deterministic algorithms (slower)")
    on_nan: Literal["stop", "skip"] = doc("stop", "non-finite loss: stop naming the step, or skip the update")
    loss: Literal["chunked", "cross_entropy"] = doc(
        "chunked", "chunked: linear + cross-entropy in token chunks, never materialising fp32 logits "
                   "(less memory and traffic); cross_entropy: logits, then torch's fp32 cross-entropy")
    loss_chunk_tokens: int = doc(2048, "loss=chunked: tokens per logits chunk; the chunk's logits and their gradient "
                                       "are the peak's temporaries (2048 x vocab 32000: 0.12 GiB per bf16 buffer)", min=1)
    memory_fit: Literal["check", "adjust", "off"] = doc(
        "check", "run_train.sh on a GPU titanlite/hardware.py lists: predict the peak memory per GPU (estimation) "
                 "while the ranks start; where the local batch cannot fit, check = stop in one line (exit 2) naming "
                 "the predicted peak, the GPU's memory and the command that fits; adjust = start again at the "
                 "largest local batch that fits clear of the allocator's headroom and divides the global batch, "
                 "accumulation raised to keep it (where no batch fits, with activation checkpointing raised: "
                 "selective, then full; also where a stronger level's larger micro-batch is predicted faster; a "
                 "tight batch, one inside the headroom, starts again clear of it where that batch, at the "
                 "configured level or a stronger one, is at least half the configured one), said at start-up, one "
                 "node; off = no prediction. See docs/estimation.md")
    gc_interval: int = doc(
        50, "steps between Python garbage collections (young objects only), made at the same step on every rank; "
            "Python's own collector is off while training. 0 = leave Python's collector on: its pauses land "
            "at any point of a step on any rank, and under data parallelism every rank waits for them", min=0)
    cuda_graphs: bool = doc(False, "capture the whole training step as a CUDA graph after warm-up (seed: use_cuda_graphs)")
    cuda_graphs_warmup: int = doc(10, "eager steps before capture", min=1)


@dataclass
class Data:
    num_workers: int = doc(2, "DataLoader worker processes (0 = load in the training process)", min=0)
    prefetch_factor: int = doc(2, "batches each worker prepares ahead", min=1)
    pin_memory: bool = doc(True, "pin host batches for async H2D copies (CUDA only)")
    persistent_workers: bool = doc(True, "keep workers alive between epochs")
    shuffle: bool = doc(True, "shuffle the window order of every epoch (seeded by training.seed); text datasets only")


@dataclass
class Parallelism:
    data_parallel: str = doc("fsdp", "data-parallel mode (traits in titanlite/parallel/modes.py); with one rank "
                                     "every mode runs the single-device path", registry="titanlite.parallel.modes:MODES")
    replicate_degree: int = doc(-1, "hsdp: replicas, the outer mesh dim (-1 = world / shard_degree; both -1 = "
                                    "one replica per node, sharded over its GPUs)", min=-1)
    shard_degree: int = doc(-1, "hsdp: shards per replica, the inner mesh dim (-1 = world / replicate_degree)", min=-1)
    ddp_bucket_cap_mb: int = doc(100, "ddp/zero1: gradient bucket size in MB", min=1)
    ddp_bucket_view: bool = doc(True, "ddp/zero1: gradients become views into DDP's reduce buckets, so the reduced "
                                      "bucket is the gradient (no copy back out after each all-reduce)")
    ddp_reduce_dtype: Literal["float32", "bfloat16"] = doc(
        "float32", "ddp/zero1: gradient all-reduce dtype; bfloat16 halves the bytes (a comm hook: cast to bf16, "
                   "divide by the ranks, all-reduce, copy back into the fp32 bucket)")
    fsdp_reshard_after_forward: Literal["auto", "default", "always", "never"] = doc(
        "auto", "fsdp/hsdp: free gathered params after forward (default = all but the root; auto = as default, "
                "except that the blocks keep theirs when all their gathered params take at most 1/16 of the "
                "GPU's memory, which saves backward's second gather)")
    fsdp_reduce_dtype: Literal["float32", "bfloat16"] = doc("float32", "fsdp/hsdp: gradient reduce-scatter dtype")
    fsdp_gradient_transport: Literal["auto", "bfloat16", "reduce_dtype"] = doc(
        "auto", "fsdp/hsdp with bf16 compute and a float32 fsdp_reduce_dtype: bfloat16 = the bf16 gradients cross "
                "the link as computed, in one all-to-all, and each rank sums the pieces of its own shard in float32 "
                "(a float32 reduction, as NCCL's, at half the bytes; a step of several micro-steps that accumulates "
                "unsharded reduces its float32 sums as reduce_dtype does); reduce_dtype = NCCL's reduce-scatter of float32 copies; auto = bfloat16 "
                "where it applies, and says which")
    fsdp_accumulate: Literal["auto", "unsharded", "sharded"] = doc(
        "auto", "fsdp/hsdp with gradient accumulation: unsharded = the micro-steps before the last keep the whole "
                "model's gradient sums (4 bytes a parameter in float32) and the last reduce-scatters them, one reduce a "
                "step; sharded = every micro-step reduce-scatters into the shard, one reduce a micro-step (behind its "
                "backward; hsdp's all-reduce across replicas still once a step); auto = sharded where the whole sums "
                "would take more than 1/8 of the GPU's memory (8B models), else unsharded, and says which")
    fsdp_blocks_per_group: int = doc(
        0, "fsdp/hsdp: consecutive transformer blocks sharded as one FSDP group (one gather, one reduce-scatter and "
           "one set of hooks for them all), so the host spends less time launching a step and a busy host does "
           "not leave the GPUs waiting; the first block stays a group of its own (nothing hides its gather and "
           "reduce-scatter). 0 = auto: enough blocks for 150M parameters a group, leaving at least 4 groups "
           "(LLaMA 1.36B and Qwen3 1.8B: 3, 8B models: 1)", min=0)
    fsdp_copy_engine_all_gather: Literal["auto", "on", "off"] = doc(
        "auto", "fsdp/hsdp on CUDA: gather parameters into NCCL symmetric memory over a communicator of their own "
                "under NCCL's zero-CTA policy, so the GPU's copy engines move them over NVLink and the SMs stay "
                "with the GEMMs (the reduce-scatters keep SM kernels; needs NCCL >= 2.28). auto = on where every "
                "gather group is inside one NVSwitch host (H100 SXM, H200, B200, GB200), float8's gathers as "
                "bf16's, and says which; on = refuse to start where it cannot; off = NCCL's SM kernels")


@dataclass
class Checkpoint:
    enable: bool = doc(False, "save distributed checkpoints (DCP) and resume from the newest complete one")
    folder: str = doc("checkpoint", "subfolder of dump_folder (an absolute path is used as is)")
    interval: int = doc(500, "steps between saves (a final save always happens)", min=1)
    keep_latest_k: int = doc(3, "complete checkpoints kept (0 = keep all)", min=0)
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = doc(
        "disabled", "disabled: training waits for the write; async: copy to host memory, write in the background; "
                    "async_with_pinned_mem: the same through reused pinned buffers (CUDA)")
    load_step: int = doc(-1, "resume from this step (-1 = newest complete checkpoint)", min=-1)
    initial_load_path: str = doc("", "Hugging Face folder (safetensors + config.json) to start from when there is "
                                     "no checkpoint to resume (model weights only)")


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = doc("none", "recompute activations in backward to save memory")
    selective_option: str = doc("op", "selective: 'op' (save matmul outputs, recompute the rest) or N (every N-th block)")


@dataclass
class Compile:
    enable: bool = doc(False, "torch.compile each TransformerBlock (fullgraph) and the loss")
    mode: str = doc("default", "torch.compile mode (default, reduce-overhead, max-autotune, ...)")
    coordinate_descent_tuning: bool = doc(
        False, "Inductor tunes each generated Triton kernel's block sizes and warps by benchmarking them "
               "(float8's cast kernels gain most; a longer first compile, cached after)")


@dataclass
class Float8:
    enable: bool = doc(False, "float8 training via torchao on H100-class GPUs")
    recipe: Literal["tensorwise", "rowwise"] = doc("tensorwise", "torchao float8 scaling recipe: one scale per tensor, "
                                                   "or per row (its casts cost more: 0.79-0.84x tensorwise's speed on "
                                                   "H200, docs/performance.md)")
    emulate: bool = doc(False, "emulate float8 (for tests on CPU / older GPUs; slow)")
    backward_fast_accum: bool = doc(False, "the backward's float8 GEMMs (input and weight gradients) "
                                    "accumulate in the GPU's fast, less precise mode, as the forward's "
                                    "always do (faster; torchao keeps them precise by default)")


@dataclass
class Metrics:
    log_freq: int = doc(10, "steps between log lines (host syncs happen only here)", min=1)
    peak_tflops: float = doc(0.0, "dense bf16 peak per GPU for MFU (0 = from the built-in table)", min=0.0)
    enable_tensorboard: bool = doc(False, "write TensorBoard scalars under the run folder")
    enable_wandb: bool = doc(False, "log the same scalars to Weights & Biases from rank 0 (WANDB_MODE=offline: "
                                    "kept under the run folder, no network)")
    wandb_project: str = doc("", "W&B project ('' = WANDB_PROJECT, else 'titanlite')")
    wandb_run_name: str = doc("", "W&B run name ('' = WANDB_NAME, else the run log's name)")
    wandb_entity: str = doc("", "W&B entity, a user or team ('' = WANDB_ENTITY, else your default)")
    progress_bar: bool = doc(True, "show a progress bar on rank 0")


@dataclass
class Profiling:
    enable: bool = doc(False, "torch.profiler traces for a window of steps, one file per rank")
    start_step: int = doc(10, "first profiled step", min=1)
    num_steps: int = doc(3, "profiled steps", min=1)
    memory_snapshot: bool = doc(False, "also dump a CUDA memory snapshot (CUDA only)")


@dataclass
class Validation:
    enable: bool = doc(True, "compute validation loss")
    freq: int = doc(100, "steps between validations (and one at the end)", min=1)
    steps: int = doc(10, "batches per validation", min=1)


@dataclass
class Debug:
    inject_data_delay_ms: float = doc(0.0, "sleep this long in the data path of inject_rank (test hook)", min=0.0)
    inject_rank: int = doc(-1, "rank that receives injected faults (-1 = all ranks)", min=-1)
    inject_compute_matmuls: int = doc(0, "extra square matmuls per micro-step on inject_rank, inside the compute "
                                         "phase: a compute stall (one rank: a straggler)", min=0)
    inject_matmul_size: int = doc(512, "side of the square matrices those extra matmuls multiply", min=1)
    inject_comm_mb: float = doc(0.0, "all-reduce a dummy buffer of this many MB before each gradient sync: slow "
                                     "communication (every rank takes part, since a collective needs them all)", min=0.0)
    inject_oom_step: int = doc(0, "raise a CUDA out-of-memory error (torch.OutOfMemoryError) in this step, before its last "
                                  "micro-step's forward, on inject_rank, on any device (0 = never): tests the failure's one line",
                               min=0)
    inject_shared_device: bool = doc(False, "put every rank on one device: GPU 0 (process group over gloo, as NCCL "
                                            "refuses shared GPUs) or one CPU core")


@dataclass
class Estimate:
    """Dry runs (python -m estimation): read by estimation/ only; training ignores this section."""
    ngpu: int = doc(1, "GPUs the dry run models (world size of its fake process group)", min=1, max=16384,
                    why="the largest count the dry run models within about a minute: zero1's partition of the "
                        "parameters and hsdp's device mesh are built for every rank")
    hardware: str = doc("h100", "GPU by its key in titanlite/hardware.py (h100, h200, b200, a100, ...)")
    output: str = doc("", "JSON report path ('' = <job.dump_folder>/estimate.json)")
    search: bool = doc(True, "search the largest local batch that fits (one fake step per probe)")
    max_local_batch: int = doc(512, "upper bound of that search (also capped where even the blocks' inputs "
                                    "alone would not fit)", min=1)
    reserved_gib: float = doc(-1.0, "memory outside tensors (CUDA context, library and NCCL buffers), GiB: a batch "
                                    "fits when peak + this <= the GPU's memory; -1 = 0.6 on one GPU, 1.1 with NCCL",
                              min=-1.0)
    fragmentation: float = doc(-1.0, "allocator headroom over the peak: a batch above peak x (1 + this) + reserved "
                                      "still runs but the allocator releases its cache during the step, and "
                                      "--estimate.recommend keeps clear of it; -1 = the data-parallel mode's, measured "
                                      "with expandable_segments (titanlite/parallel/modes.py)", min=-1.0)
    gemm_efficiency: float = doc(0.0, "achieved fraction of the bf16 peak in matmuls (0 = estimation/calibration.json)",
                                 min=0.0, max=1.0)
    float8_efficiency: float = doc(0.0, "achieved fraction of twice the bf16 peak in float8 matmuls (0 = calibrated)",
                                   min=0.0, max=1.0)
    elementwise_efficiency: float = doc(0.0, "achieved fraction of HBM bandwidth in eager element-wise ops "
                                             "(0 = calibrated)", min=0.0, max=1.0)
    fused_efficiency: float = doc(0.0, "achieved fraction of HBM bandwidth in torch.compile's generated kernels "
                                       "(0 = calibrated)", min=0.0, max=1.0)
    optimizer_efficiency: float = doc(0.0, "achieved fraction of HBM bandwidth in the clip and AdamW update "
                                           "(0 = calibrated)", min=0.0, max=1.0)
    link_efficiency: float = doc(0.0, "achieved fraction of link bandwidth in collectives (0 = calibrated)",
                                 min=0.0, max=1.0)
    gap_us: float = doc(0.0, "GPU idle time between kernels, per kernel, in microseconds (0 = calibrated)", min=0.0)
    gpus_per_node: int = doc(0, "GPUs per node (those NVLink joins): a collective whose ranks are on one node runs on "
                                "the GPU's link (titanlite/hardware.py), one whose ranks span nodes also crosses the "
                                "network; hsdp shards inside a node; 0 = 8 (an HGX/DGX board). Where estimate.ngpu is larger it must be a "
                                "multiple of this (every node of a job runs the same number of ranks)", min=0)
    inter_node_gbps: float = doc(400.0, "network bandwidth between nodes per GPU, Gb/s each way (400: one NDR "
                                        "InfiniBand NIC per GPU); a measured bus bandwidth can be given with "
                                        "link_efficiency=1", min=0.001)
    launch_us: float = doc(0.0, "host time per kernel launch in microseconds (0 = calibrated)", min=0.0)
    recommend: bool = doc(False, "search local batch x accumulation, activation checkpointing, data-parallel mode, "
                                 "float8, bf16 parameters / moments and CUDA graphs for the target global batch; "
                                 "print the best predicted configurations and write the best as a TOML")
    target_tokens: int = doc(0, "recommend: tokens per optimizer step (0 = training.global_batch_size x seq_len)",
                             min=0)
    recommend_opt_in: bool = doc(True, "recommend: also search the settings that change numerics (float8, bf16 "
                                       "moments); false keeps the default's numerics")
    recommend_top: int = doc(5, "recommend: configurations printed", min=1)
    recommend_output: str = doc("", "recommend: TOML path ('' = <job.dump_folder>/recommended.toml)")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    data: Data = field(default_factory=Data)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    debug: Debug = field(default_factory=Debug)
    estimate: Estimate = field(default_factory=Estimate)
