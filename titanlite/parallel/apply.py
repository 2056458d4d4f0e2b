"""parallelize(model, settings, dims): apply the configured techniques in the order its docstring writes.

The techniques before materialisation rewrite modules and run on the meta-device model. Weights are then materialised
and initialised in full, identically on every rank (same seed, same device type, same op order as a
single process), and only then sharded or replicated. Initialising sharded DTensors directly would
draw different random numbers per layout (DTensor's RNG offsets and CPU/GPU differences), so the
modes would not start from the same weights; the price is one full fp32 copy of the model per
device at start-up (5 GB for 1.36B, 32 GB for 8B), freed as FSDP shards it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.errors import ConfigError
from titanlite.hardware import float8_refusal
import titanlite.ops.attention  # noqa: F401  (registers titanlite::flash_attn_4_forward, which selective AC saves)
from titanlite.ops.master_linear import MasterWeights
from titanlite.parallel.ddp import apply_ddp
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.fsdp import apply_fsdp
from titanlite.parallel.grads import is_fsdp, local_tensor
from titanlite.parallel.modes import MODES
from titanlite.parallel.policy import bf16_copies
from titanlite.parallel.settings import (ActivationCheckpointSettings, CompileSettings, Float8Settings,
                                         ParallelSettings)

logger = logging.getLogger("titanlite")

# The data-parallel wrapper of each mode (its traits: titanlite.parallel.modes); zero1 is DDP for
# gradients, its optimizer-state sharding lives in titanlite.optim. fsdp and hsdp differ by their mesh.
Wrapper = Callable[[nn.Module, ParallelSettings, ParallelDims, MasterWeights], nn.Module]
DATA_PARALLEL: dict[str, Wrapper] = {"ddp": apply_ddp, "zero1": apply_ddp, "fsdp": apply_fsdp, "hsdp": apply_fsdp}


# ------------------------------------------------------------------------------------------ float8
def float8_eligible(module: nn.Module, fqn: str) -> bool:
    # The output projection stays in high precision (logit quality); float8 matmul kernels need
    # both dims to be multiples of 16.
    if fqn.split(".")[-1] == "output" or not isinstance(module, nn.Linear):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module, f8: Float8Settings, sharded: bool = False) -> None:
    """Swap eligible nn.Linear for torchao Float8Linear (dynamic scaling, tensorwise or rowwise), as
    the float8 section `f8` says; `sharded`: the parameters will be FSDP shards. (parallelize checks
    first that the device can run float8 matmuls, or that f8.emulate asks for torchao's emulation.)"""
    # here, not at the top: torchao is a large import that only float8 runs need
    from torchao.float8 import Float8GemmConfig, Float8LinearConfig, convert_to_float8_training

    if f8.recipe == "tensorwise":
        # Under FSDP the weights are all-gathered already cast to float8: half the bytes of bf16.
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=sharded, emulate=f8.emulate)
    else:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(f8.recipe), emulate=f8.emulate)
    if f8.backward_fast_accum:
        fast = Float8GemmConfig(use_fast_accum=True)
        config = dataclasses.replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    convert_to_float8_training(model, config=config, module_filter_fn=float8_eligible)


def float8_scale_hook(model: nn.Module, f8: Float8Settings):
    """Under FSDP with float8 all-gather (`f8`: the float8 section), an optimizer post-step
    hook that computes every weight's scale in one fused all-reduce, instead of one small reduction
    per weight inside the next forward; None where there is nothing to do."""
    if not (f8.enable and f8.recipe == "tensorwise" and is_fsdp(model)):
        return None
    from torchao.float8.float8_linear import Float8Linear  # torchao: float8 runs only (above)
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    weights = [m.weight for m in model.modules() if isinstance(m, Float8Linear)
               and isinstance(local := getattr(m.weight, "_local_tensor", None), WeightWithDynamicFloat8CastTensor)
               and hasattr(local, "_precomputed_scale")]
    if not weights:
        return None
    target = {m.config.cast_config_weight.target_dtype for m in model.modules() if isinstance(m, Float8Linear)}
    (dtype,) = target
    mesh = weights[0].device_mesh  # fsdp: Shard(0); hsdp: Replicate, Shard(0): the maximum is over the shards
    groups = [mesh.get_group(dim) for dim, placement in enumerate(weights[0].placements) if placement.is_shard()]
    return lambda optimizer, args, kwargs: precompute_float8_scales(weights, dtype, groups)


@torch.no_grad()
def precompute_float8_scales(weights: list, dtype: torch.dtype, groups: list) -> None:
    """Set each FSDP float8 weight's tensorwise scale (finfo(dtype).max over the weight's absolute
    maximum; `weights`: FSDP's DTensor parameters, sharded over the process groups `groups`) for its next
    all-gather, which then casts the shard with it instead of reducing its own maximum. torchao's float8
    weight wrapper reads it from `_precomputed_scale`, the attribute torchao's own
    precompute_float8_dynamic_scale_for_fsdp writes; this computes the same numbers (bf16 maxima, one
    all-reduce over the shard dimension of the mesh, the division in float64) on the plain local shards,
    where torchao's goes through DTensor dispatch op by op, host time at every step."""
    from torchao.float8.float8_utils import EPS

    shards = [local_tensor(w) for w in weights]
    present = [t for t in shards if t.numel()]  # an uneven split can leave a rank an empty shard
    maxima = iter(torch._foreach_norm(present, ord=math.inf) if present else ())
    amax = torch.stack([next(maxima) if t.numel() else t.new_zeros(()) for t in shards])
    for group in groups:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scales = (torch.finfo(dtype).max / amax.clamp(EPS).double()).float()
    for w, scale in zip(weights, scales.unbind()):
        w._local_tensor._precomputed_scale = scale


# ------------------------------------------------------------------------- activation checkpointing
def save_matmuls_policy():
    """Op-level policy: keep matmul and attention outputs (expensive), recompute the rest (cheap
    element-wise ops and norms)."""
    aten = torch.ops.aten
    save = {aten.mm.default, aten.bmm.default, aten.addmm.default}
    # float8 matmuls (torchao's _scaled_mm) and the SDPA kernels. flash-attn >= 2.6 registers its
    # forward as the torch custom op flash_attn::_flash_attn_forward, and flash-attn 3's
    # flash_attn_interface as flash_attn_3::_flash_attn_forward, which makes them visible here too.
    # The policy is built after the attention backend is chosen, i.e. after the package is imported.
    # flash-attn 4 runs through titanlite's own op (titanlite.ops.attention), registered on import.
    for ns, name in (("aten", "_scaled_mm"), ("aten", "_scaled_dot_product_flash_attention"),
                     ("aten", "_scaled_dot_product_efficient_attention"),
                     ("aten", "_scaled_dot_product_cudnn_attention"),
                     ("aten", "_scaled_dot_product_flash_attention_for_cpu"), ("flash_attn", "_flash_attn_forward"),
                     ("flash_attn_3", "_flash_attn_forward"), ("titanlite", "flash_attn_4_forward")):
        try:
            save.add(getattr(getattr(torch.ops, ns), name).default)
        except (AttributeError, RuntimeError):  # not in this torch build, or the package is not installed
            pass

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _recompute_all_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, ac: ActivationCheckpointSettings) -> None:
    """Wrap blocks for recomputation in backward (`ac`: the activation_checkpoint section): full (every
    block), selective 'op' (every block, save matmul outputs only) or selective N (every N-th block,
    fully recomputed).

    Full recomputation is an op-level policy too (recompute every op), not checkpoint's plain form:
    under torch.compile, torch 2.11 tags only the ops Dynamo sees at the top of a checkpointed region,
    so the ops inside a custom autograd.Function (MasterLinear's matmul) lose their recompute tag and
    the partitioner keeps their inputs, about as much as selective 'op' keeps. A policy is applied
    per aten op as the graph is traced, inside such functions too (torch 2.13 turns the plain form
    into this same policy itself)."""
    every, policy = 1, _recompute_all_policy
    if ac.mode == "selective":
        if ac.selective_option == "op":
            policy = save_matmuls_policy()
        elif ac.selective_option.isdigit() and int(ac.selective_option) >= 1:
            every = int(ac.selective_option)
        else:
            raise ConfigError(f"activation_checkpoint.selective_option must be 'op' or a positive integer N; "
                              f"got '{ac.selective_option}'")
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    for name, block in list(model.layers.named_children()):
        if int(name) % every == 0:
            # preserve_rng_state=False: the blocks have no dropout, and saving RNG state costs a sync.
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context_fn)
            model.layers.register_module(name, wrapped)


# ------------------------------------------------------------------------------------------ compile
def apply_compile(model: nn.Module, c: CompileSettings) -> None:
    """torch.compile each TransformerBlock with fullgraph=True (`c`: the compile section): small graphs,
    compiled once and reused by every block of the same shape; FSDP/DDP hooks stay outside the
    compiled regions. (The loss is compiled where it runs, told so by titanlite.step.make_forward_loss.)"""
    if c.coordinate_descent_tuning:
        import torch._inductor.config as inductor_config  # here, not at the top: it imports all of Inductor

        # Inductor's config is process-wide: the loss kernel compiled later is tuned too.
        inductor_config.coordinate_descent_tuning = True
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, fullgraph=True, mode=c.mode))


# ------------------------------------------------------------------------------------- bf16 params
def apply_bf16_params(model: nn.Module, dp_mode: str, head: bool = False) -> MasterWeights:
    """training.bf16_params: the transformer blocks' matrices (and with `head` the output layer's)
    multiply in bf16 without autocast's per-step casts; everything else stays with autocast
    (embeddings, norms, hence the residual stream and its gradient stay fp32).

    `head` is for training.loss=cross_entropy, whose logits come from the output layer's own call:
    its weight gradient then also comes out of its GEMM in fp32. The chunked loss multiplies the
    output weight itself and adds its gradient up in fp32 chunk by chunk.

    - nn.Linear: stays an fp32 master Parameter and multiplies a bf16 copy of itself, with fp32
      weight gradients (titanlite.ops.master_linear); MasterAdamW rewrites the copy as it updates.
    - float8's Float8Linear: its weight is stored in bf16, which torchao casts to float8, and its
      gradient, which torchao's float8 GEMM gives in bf16, stays bf16; the fp32 master lives in
      MasterAdamW as 16 low bits (titanlite.optim.master_low_bits), started from the fp32
      initialisation the returned MasterWeights holds. A master on the bf16 grid instead would ignore
      updates smaller than half a bf16 step, and trained worse. Under zero1 float8's weights stay
      fp32 (ZeroRedundancyOptimizer takes parameters of one dtype) and torchao casts them from fp32,
      as with autocast.

    Returns the masters and their copies, for the optimizer and the gradients' release.
    """
    masters = MasterWeights()
    bf16_float8 = MODES[dp_mode].optimizer != "zero"
    for block in model.layers.values():
        for module in block.modules():
            if type(module) is nn.Linear:
                masters.add_copy(module)
            elif isinstance(module, nn.Linear) and bf16_float8:  # float8's Float8Linear, the only subclass here
                masters.round_to_bf16(module.weight)
    if head:
        masters.add_copy(model.output)
    return masters


# ------------------------------------------------------------------------------------ materialise
def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate the full weights on `device` and initialise them from `seed`."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_weights(buffer_device=device)


class Parallelized(NamedTuple):
    model: nn.Module        # materialised, initialised, wrapped
    masters: MasterWeights  # the bf16 copies' fp32 masters (empty without training.bf16_params' copies)


def parallelize(model: nn.Module, settings: ParallelSettings, dims: ParallelDims,
                wrap: Wrapper | None = None) -> Parallelized:
    """Take the meta-device model spec; return the materialised, initialised, wrapped model (and its
    MasterWeights), with the techniques `settings` turns on applied in this order (the one place it is
    written):

        float8 -> activation checkpointing -> compile per TransformerBlock -> materialise + init
        -> bf16 copies of the blocks' matrices -> data-parallel wrapping (ddp | zero1 | fsdp | hsdp)

    Each constraint on the order is stated at its call. What is built on the model this returns
    follows it: the optimizer (titanlite.optim.build_optimizer: zero1's sharded AdamW state, a
    capturable AdamW for CUDA graphs, the masters' copies), then the step (titanlite.step.build_train_step:
    bf16 autocast, the fused clip, float8's post-step hook; CudaGraphStep captures it). A new technique
    is one `apply_*` function and one call here. The combination of settings was checked when the
    config was loaded (titanlite.config.manager.check_combination).

    `wrap(model, settings, dims, masters)` replaces the mode's data-parallel wrapper (DATA_PARALLEL): estimation's
    fake run wraps DDP around fake tensors on its fake process group, with its own comm hook."""
    mode = MODES[dims.mode]
    def applied(technique: str) -> None:  # each technique logged as it is applied, on the main rank
        if dims.rank == 0:
            logger.info(f"parallelize: {technique}")

    f8 = settings.float8
    if f8.enable:
        if not f8.emulate and not dims.float8:
            where = "CPU" if dims.device.type != "cuda" else torch.cuda.get_device_name(dims.device)
            raise ConfigError(float8_refusal(where))
        # First: it swaps nn.Linear for Float8Linear, and what comes after must wrap the swapped modules.
        apply_float8(model, f8, sharded=mode.shards_params)
        applied(f"float8 ({f8.recipe})")
    if settings.activation_checkpoint.mode != "none":
        # Before compile: compile then traces the checkpointed blocks, with their recompute policy.
        apply_ac(model, settings.activation_checkpoint)
        applied(f"activation checkpointing ({settings.activation_checkpoint.mode})")
    if settings.compile.enable:
        # After the module rewrites above (they are what gets traced), before the data-parallel
        # wrappers, whose hooks stay outside the compiled regions.
        apply_compile(model, settings.compile)
        applied("compile per TransformerBlock")
    # Still on meta up to here. The full weights, identically on every rank, before any sharding
    # (the module's docstring says why).
    materialize(model, dims.device, settings.seed)
    masters = MasterWeights()
    if bf16_copies(settings.precision, mode, dims.device.type):
        # After materialise (copies of the initialised weights), before ddp, whose buckets take the
        # gradients' dtype.
        masters = apply_bf16_params(model, dims.mode, head=settings.loss == "cross_entropy")
        applied("bf16 copies of the blocks' matrices")
    if dims.world_size > 1 and dims.mode != "none":
        # Last: a wrapper takes the finished modules (FSDP shards what the steps above made). For CUDA
        # graphs on CUDA it is built on a side stream: a captured backward needs DDP made there
        # (torch's CUDA-graph notes).
        graphs = settings.cuda_graphs and dims.device.type == "cuda"
        with torch.cuda.stream(torch.cuda.Stream(dims.device)) if graphs else contextlib.nullcontext():
            model = (wrap or DATA_PARALLEL[dims.mode])(model, settings, dims, masters)
        applied(f"{dims.mode} over {dims.world_size} ranks")
    return Parallelized(model, masters)
