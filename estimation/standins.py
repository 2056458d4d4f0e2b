"""Where the dry run stands in for torch itself: every function it replaces, why, and the context that
puts the replacement in place and restores the original on exit.

The fake run (estimation.fake_run) reaches titanlite only through its seams: the settings it builds,
the dims it lays out through `parallel_dims` over a fake process group it starts (with the target
GPU's memory and float8 matmuls), parallelize's `wrap=` for DDP, build_optimizer's `update=`. What is
left is torch behaving differently on fake CPU tensors than on the GPU being modelled, or reading
values fake tensors do not have; each such stand-in lives here:

| stand-in | for | why |
|---|---|---|
| `cuda_like_kernels` | F.rms_norm | the CPU decomposes it and keeps other tensors than CUDA's kernel |
| `cuda_like_kernels` | titanlite.optim.CPU_UPDATE_CHUNK, TORCH_KERNEL_DEVICES | without titanlite's kernel MasterAdamW runs the reference on the CPU, in smaller chunks, where a GPU runs torch's fused kernel with other temporaries |
| `init_without_values` | torch.nn.init.trunc_normal_ | it redraws out-of-range values in a loop that reads them |
| `ddp_on_fake_tensors` | DDP's parameter shape check; dist.Reducer's first bucket layout | both read tensor data |
| `keep_rebuilt_buckets` | the DDP reducer's bucket rebuild | it agrees on an order by reading tensor data |
| `fsdp_chunks_on_demand` | FSDP's `_chunk_with_empty` | it makes one fake tensor per rank for every parameter: minutes at thousands of ranks |
| `inductor_without_codegen` | torch._inductor.compile_fx.compile_fx | code generation needs a GPU; the graphs run instead |

(The memory tracker, estimation.tracker, also wraps two torch hooks while it is active, to observe
storage resizes and DTensor's shape propagation; it replaces no behaviour.)
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.nn.init as init
import torch.nn.parallel.distributed as ddp

from titanlite import optim


# --------------------------------------------------------------------------- kernels: CUDA's, not the CPU's
class _FusedRMSNorm(torch.autograd.Function):
    """What CUDA's fused rms_norm keeps for backward: the input and one fp32 rstd per row."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return (x.float() * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        xhat = x.float() * rstd
        gw = grad.float() * weight.float()
        gx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), (grad.float() * xhat).flatten(0, -2).sum(0).to(weight.dtype), None


@contextlib.contextmanager
def cuda_like_kernels():
    """CUDA's kernels where their CPU versions keep different tensors: the fused RMSNorm (the CPU
    decomposes it and would save two extra fp32 copies of the input per norm; code that torch.compile
    traces keeps the real op: Inductor decides what it saves), and MasterAdamW's update without
    titanlite's kernel (optimizer.fused=false): torch's fused kernel as on CUDA, not the CPU's reference,
    over a GPU's chunks of parameters (its fp32 temporaries, for state that is not fp32, span one chunk).
    (The chunked loss's fp32-output GEMMs need no stand-in: they are titanlite ops whose fake kernels
    give CUDA's tensors, titanlite.ops.loss.)"""
    orig, orig_chunk, orig_devices = F.rms_norm, optim.CPU_UPDATE_CHUNK, optim.TORCH_KERNEL_DEVICES

    def rms_norm(x, normalized_shape, weight=None, eps=None):
        if torch.compiler.is_compiling():
            return orig(x, normalized_shape, weight, eps)
        if weight is None:
            weight = torch.ones(normalized_shape, device=x.device)
        return _FusedRMSNorm.apply(x, weight, eps if eps is not None else torch.finfo(x.dtype).eps)

    F.rms_norm, optim.CPU_UPDATE_CHUNK = rms_norm, optim.UPDATE_CHUNK
    optim.TORCH_KERNEL_DEVICES = orig_devices | {"cpu"}
    try:
        yield
    finally:
        F.rms_norm, optim.CPU_UPDATE_CHUNK, optim.TORCH_KERNEL_DEVICES = orig, orig_chunk, orig_devices


# ---------------------------------------------------------------------------------- values fake tensors lack
@contextlib.contextmanager
def init_without_values():
    """Weight initialisation has nothing to draw on fake tensors, and torch's truncated normal redraws
    out-of-range values in a loop that reads them: it leaves the tensor as it is. (The rest of
    init_weights runs: it re-ties a tied output layer and builds the RoPE buffers.)"""
    orig = init.trunc_normal_
    init.trunc_normal_ = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        init.trunc_normal_ = orig


# ---------------------------------------------------------------------------- FSDP's sharding, at any rank count
# FSDP shards a parameter by chunking it into one piece per rank of its shard group (torch.chunk, padded
# with empty tensors to the group's size: `_chunk_with_empty`), then keeps chunk 0's size (the padded
# shard) and its own rank's chunk. On fake tensors every piece is a fake tensor made by a dispatched op,
# so a fake run of N ranks made N of them per parameter (16384 ranks took minutes for the debug model).
# Here the pieces are made when read, the two FSDP reads: the same tensors, shapes and views, whatever
# the rank count.
class LazyChunks:
    """The list `_chunk_with_empty(tensor, num_chunks, dim)` returns, each entry built when indexed."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int):
        self.tensor, self.n, self.dim = tensor, num_chunks, dim
        self.size = -(-tensor.size(dim) // num_chunks)  # torch.chunk's chunk length: ceil(length / n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        start, length = i * self.size, self.tensor.size(self.dim)
        if start >= length:  # past the last piece torch.chunk makes: one of the padding empties
            return self.tensor.new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.size, length - start))


@contextlib.contextmanager
def fsdp_chunks_on_demand():
    """While active, FSDP (fully_shard and its lazy init) chunks parameters with LazyChunks. A torch
    whose FSDP has no `_chunk_with_empty` is left as it is."""
    # torch's private FSDP module, imported when a fake run is set up (its layout differs across releases)
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param

    orig = getattr(fsdp_param, "_chunk_with_empty", None)
    if orig is None:
        yield
        return

    def chunks(tensor, num_chunks, dim):  # an empty dimension: torch.chunk's own answer, n empty pieces
        return LazyChunks(tensor, num_chunks, dim) if tensor.size(dim) else orig(tensor, num_chunks, dim)

    fsdp_param._chunk_with_empty = chunks
    try:
        yield
    finally:
        fsdp_param._chunk_with_empty = orig


# dist.Reducer's arguments after (params, bucket_indices, per_bucket_size_limits), as DDP passes them
_REDUCER_ARGS = ("process_group", "expect_sparse_gradients", "bucket_bytes_cap", "find_unused_parameters",
                 "gradient_as_bucket_view", "param_to_name_mapping", "first_bucket_bytes_cap")


@contextlib.contextmanager
def ddp_on_fake_tensors():
    """While DDP is built around fake tensors:

    - its start-up shape check across ranks reads tensor data in C++, which fake tensors do not have;
      every fake rank holds the same shapes by construction, so it is skipped;
    - its reducer is built with the buckets it would rebuild to. DDP first puts every gradient in one
      bucket (before a backward it does not know the order gradients become ready in) and rebuilds the
      buckets after the first backward: up to first_bucket_bytes_cap, then bucket_bytes_cap each, over
      the parameters in the order their gradients became ready, so from the second step on each bucket
      is all-reduced as soon as its gradients exist, beside the rest of the backward. That rebuild
      agrees on the order across ranks by reading a tensor's data (see keep_rebuilt_buckets), so the
      fake reducer gets the rebuilt layout from the start, taking the ready order as the reverse of the
      parameters' order (DDP's own assumption for its first layout: the output head's gradient first,
      the input embedding's last)."""
    orig_check, orig_reducer = ddp._verify_param_shape_across_processes, dist.Reducer

    def reducer(params, bucket_indices, per_bucket_size_limits, *rest, **kwargs):
        named = {**dict(zip(_REDUCER_ARGS, rest)), **kwargs}
        sparse = list(named.get("expect_sparse_gradients") or [False] * len(params))
        cap = named.get("bucket_bytes_cap", 25 * 2**20)
        first = named.get("first_bucket_bytes_cap", dist._DEFAULT_FIRST_BUCKET_BYTES)
        ready = list(range(len(params)))[::-1]
        bucket_indices, per_bucket_size_limits = dist._compute_bucket_assignment_by_size(
            [params[i] for i in ready], [first, cap], [sparse[i] for i in ready], ready)
        return orig_reducer(params, bucket_indices, per_bucket_size_limits, *rest, **kwargs)

    ddp._verify_param_shape_across_processes = lambda *a, **k: None
    dist.Reducer = reducer
    try:
        yield
    finally:
        ddp._verify_param_shape_across_processes, dist.Reducer = orig_check, orig_reducer


class _NoBucketRebuild:
    """DDP rebuilds its buckets once, agreeing on the order by reading a tensor's data (fake tensors
    have none). The fake reducer was built with the rebuilt layout (ddp_on_fake_tensors): keep it."""

    def __init__(self, reducer):
        self._reducer = reducer

    def _rebuild_buckets(self):
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)


def keep_rebuilt_buckets(model) -> None:
    """The fake DDP `model` keeps the bucket layout it was built with (for as long as it lives), and
    counts as rebuilt: the measured step is a steady one, after the real run's rebuild."""
    model.reducer = _NoBucketRebuild(model.reducer)
    model._has_rebuilt_buckets = True


# ------------------------------------------------------------------------------- Inductor without code
@contextlib.contextmanager
def inductor_without_codegen(compile_fx):
    """torch.compile's Inductor backend goes through `compile_fx` (same arguments as torch's own, which it
    may call with its own `inner_compile`) instead: generating code needs the GPU being modelled, while
    everything before it (Dynamo, AOTAutograd, Inductor's partitioner) runs on fake tensors as it is.
    `compile_fx(orig, model, example_inputs, **kw)` gets torch's function as `orig`."""
    import torch._inductor.compile_fx as cfx  # here, not at the top: it imports all of Inductor

    orig = cfx.compile_fx

    @functools.wraps(orig)
    def replacement(model_, example_inputs_, inner_compile=None, **kw):
        return compile_fx(orig, model_, example_inputs_, **kw)

    cfx.compile_fx = replacement
    try:
        yield
    finally:
        cfx.compile_fx = orig
