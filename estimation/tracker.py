"""Watch every op of a fake training step: live memory by category, and the work each op does.

`StepTracker` is a TorchDispatchMode entered inside FakeTensorMode. It sees each op's output storages
(fake: no bytes exist) and keeps, per storage, its size rounded like the CUDA caching allocator and a
category. A new storage takes the category of the phase it is born in (activations in forward,
temporaries in backward and in the optimizer step); collectives re-label their buffers as
communication buffers; the driver re-labels survivors at phase ends (a backward's survivors are
gradients, an optimizer step's are optimizer state). The peak remembers which storages were live, so
its breakdown uses their final labels. The same pass records FLOPs, bytes and collectives per phase
for the throughput model.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import (TorchDispatchMode, is_traceable_wrapper_subclass,
                                          is_traceable_wrapper_subclass_type)
from torch.utils._pytree import tree_flatten

from titanlite.ops.master_linear import accumulate_weight_grad
from titanlite.parallel.comm_model import OP_KIND, moved_bytes

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries", "comm_buffers")
ALIGN = 512  # the CUDA caching allocator hands out multiples of 512 bytes; max_memory_allocated counts them

aten, c10d = torch.ops.aten, torch.ops.c10d
MATMULS = {aten.mm.default: "mm", aten.addmm.default: "addmm", aten.bmm.default: "bmm"}
# mm(a, b, out_dtype=) and addmm(acc, a, b, out_dtype=, out=acc): GEMMs with an fp32 output
for _op, _kind in (("mm", "dtype"), ("addmm", "dtype"), ("addmm", "dtype_out")):
    if _kind in getattr(aten, _op).overloads():
        MATMULS[getattr(getattr(aten, _op), _kind)] = _op
# c10d op -> index of the buffer arg whose bytes count (its kind and ring traffic: titanlite.parallel.comm_model)
COLLECTIVES = {
    "_allgather_base_": 0, "_reduce_scatter_base_": 1, "allreduce_": 0, "broadcast_": 0,
    "allgather_into_tensor_coalesced_": 0, "reduce_scatter_tensor_coalesced_": 1, "allreduce_coalesced_": 0,
    "alltoall_base_": 1,  # fsdp_gradient_transport=bfloat16: the input's pieces for the other ranks
}
# Ops that move no bytes: allocation without a write, and metadata-only views.
FREE_OPS = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
            "lift_fresh", "_local_scalar_dense", "set_", "resize_")


def storages(t) -> list:
    """Untyped storages behind a tensor, looking through wrapper subclasses (DTensor, float8)."""
    if not isinstance(t, torch.Tensor):
        return []
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return [s for a in attrs for s in storages(getattr(t, a))]
    return [t.untyped_storage()]


def nbytes(t) -> int:
    """Bytes of memory a tensor holds: its whole storages (a view of a bucket holds the bucket)."""
    return sum(s.nbytes() for s in storages(t))


def view_bytes(t) -> int:
    """Bytes a kernel reads or writes of a tensor: its own elements (a view of a bucket: the view's),
    through wrapper subclasses to their local data."""
    if not isinstance(t, torch.Tensor):
        return 0
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return sum(view_bytes(getattr(t, a)) for a in attrs)
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Block:
    __slots__ = ("nbytes", "category", "phase")

    def __init__(self, nbytes: int, category: str, phase: str):
        self.nbytes, self.category, self.phase = nbytes, category, phase


@dataclass
class PhaseWork:
    """What one phase (fwd0, bwd0, ..., opt) asks of the GPU."""
    matmul_flops: float = 0.0
    float8_flops: float = 0.0
    attention_flops: float = 0.0    # causal FLOPs, forward 2*B*H*S^2*D, backward 2.5x that
    memory_bytes: float = 0.0       # bytes read + written by every other eager op
    fused_bytes: float = 0.0        # compiled graphs' generated kernels' traffic (estimation.compiled._traffic)
    ops: int = 0                    # kernels launched
    collectives: list = field(default_factory=list)  # Collective records, in the order they ran


class Collective(NamedTuple):
    """One collective a phase ran: the c10d op, the bytes a ring moves per rank, and the global ranks of
    its process group (which nodes it spans decides the links it crosses: estimation.throughput)."""
    op: str
    moved: float
    ranks: tuple


def _sharding_propagator():
    """DTensor's ShardingPropagator class, or None where torch has no distributed tensors."""
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:
        return None
    return ShardingPropagator


class StepTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.blocks: dict[int, _Block] = {}
        self.live = 0
        self.peak = 0
        self.peak_blocks: list[tuple[_Block, int]] = []  # (block, its size then)
        self.phase_peak: dict[str, int] = {}  # phase -> the most live bytes seen in it
        self.category = "params"        # label for storages born now
        self.phase = "setup"
        self.work: dict[str, PhaseWork] = defaultdict(PhaseWork)
        self.count_work = True
        self._in_kernel = False  # inside stand_in_kernel: new storages are a kernel's registers, not memory
        self._orig_resize = None
        self._orig_meta_prop = None
        self._meta_prop_depth = 0  # > 0: inside DTensor's sharding propagation, not part of the step
        self._node: tuple[bool, bool] | None = None  # inside a compiled graph: (materialised, library call)
        self._handed: list[tuple[int, _Block]] = []  # buffers the next compiled kernel's output reuses

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile traces with this mode switched off and runs its compiled graphs under it (see
        estimation.compiled): the tracker sees what a compiled step runs, not how it was compiled."""
        return True

    # ------------------------------------------------------------------------------ memory
    def _add(self, st, category: str) -> _Block:
        key = id(st)
        block = self.blocks.get(key)
        if block is None and self._handed:
            block = self._take_handed(st, category)
        if block is None:
            block = _Block(_aligned(st.nbytes()), category, self.phase)
            self.blocks[key] = block
            self.live += block.nbytes
            weakref.finalize(st, self._free, key, block)
            self._update_peak()
        return block

    def _take_handed(self, st, category: str) -> _Block | None:
        """A new storage of a handed-over buffer's size takes that buffer's block: no new memory."""
        size = _aligned(st.nbytes())
        for i, (old, block) in enumerate(self._handed):
            if block.nbytes == size and self.blocks.get(old) is block:
                del self._handed[i], self.blocks[old]
                block.category, block.phase = category, self.phase
                self.blocks[id(st)] = block
                weakref.finalize(st, self._free, id(st), block)
                return block
        return None

    def _free(self, key: int, block: _Block) -> None:
        if self.blocks.get(key) is block:
            del self.blocks[key]
            self.live -= block.nbytes

    def _update_peak(self) -> None:
        if self.live > self.phase_peak.get(self.phase, 0):
            self.phase_peak[self.phase] = self.live
        if self.live > self.peak:
            self.peak = self.live
            self.peak_blocks = [(b, b.nbytes) for b in self.blocks.values()]  # sizes change (FSDP resizes)

    def label(self, tensors, category: str) -> None:
        """Give these tensors' storages a category (registering them if they are new)."""
        for t in tensors:
            for st in storages(t):
                self._add(st, category).category = category

    def relabel_survivors(self, born_in: tuple[str, ...], old: str, new: str) -> None:
        """Storages of category `old` born in phases `born_in` and still alive become `new`."""
        for b in self.blocks.values():
            if b.category == old and b.phase in born_in:
                b.category = new

    def reset_peak(self) -> None:
        self.peak, self.peak_blocks = self.live, [(b, b.nbytes) for b in self.blocks.values()]
        self.phase_peak = {}

    def breakdown(self, which: str = "peak") -> dict[str, int]:
        blocks = self.peak_blocks if which == "peak" else [(b, b.nbytes) for b in self.blocks.values()]
        out = dict.fromkeys(CATEGORIES, 0)
        for b, n in blocks:
            out[b.category] += n
        return out

    def _resize(self, st, size):
        """FSDP gathers parameters into storages it grows from 0 and frees by shrinking to 0."""
        self._orig_resize(st, size)
        block = self.blocks.get(id(st))
        if block is None:
            block = self._add(st, "comm_buffers")
        new = _aligned(st.nbytes())
        if block.nbytes == 0 and new > 0:
            block.category = "comm_buffers"
        self.live += new - block.nbytes
        block.nbytes = new
        self._update_peak()

    def __enter__(self):
        self._orig_resize = torch.UntypedStorage.resize_
        torch.UntypedStorage.resize_ = lambda st, size: self._resize(st, size)
        # DTensor works out an op's output shape by running it on global-shape empty_strided stand-ins
        # in the fake mode (uncached whenever a fake mode is on, which torch 2.11 then does on every
        # call, e.g. _fused_adamw_ on all parameters, grads and moments: 4x the full fp32 model).
        # Those tensors never exist on the GPU: neither their memory nor their work counts. (A private
        # torch API: where it is absent, nothing is patched.)
        prop = _sharding_propagator()
        self._orig_meta_prop = orig = getattr(prop, "_propagate_tensor_meta_non_cached", None)
        if orig is not None:
            tracker = self

            def meta_prop(propagator, op_schema):
                tracker._meta_prop_depth += 1
                try:
                    return orig(propagator, op_schema)
                finally:
                    tracker._meta_prop_depth -= 1

            prop._propagate_tensor_meta_non_cached = meta_prop
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        if self._orig_meta_prop is not None:
            _sharding_propagator()._propagate_tensor_meta_non_cached = self._orig_meta_prop
        return super().__exit__(*exc)

    # ------------------------------------------------------------------------------ compiled graphs
    @contextlib.contextmanager
    def compiled_node(self, counted: bool, extern: bool):
        """Around one node of a compiled graph (estimation.compiled): its outputs take memory only when
        Inductor materialises them, and only a library call counts as work of its own (the fused
        kernels' traffic comes from add_kernels)."""
        self._node = (counted, extern)
        try:
            yield
        finally:
            self._node = None
            self._handed.clear()

    def hand_over(self, t) -> None:
        """The next compiled node's output reuses this tensor's buffer (Inductor writes a kernel's
        output into a dead buffer of the same size): it takes the memory without adding to it."""
        for st in storages(t):
            block = self.blocks.get(id(st))
            if block is not None:
                self._handed.append((id(st), block))

    def add_kernels(self, cost) -> None:
        """A compiled graph's generated kernels: their traffic and launches, once per run of the graph."""
        if self.count_work:
            w = self.work[self.phase]
            w.fused_bytes += cost.kernel_bytes
            w.ops += cost.kernels

    @contextlib.contextmanager
    def stand_in_kernel(self):
        """The ops run inside stand for one GPU kernel that only writes into tensors that already exist
        (MasterAdamW's fused update, run here as its eager reference): the reference's intermediates
        (fp32 copies of the gradient, the new moments, the new weight: several times the parameter)
        are never allocated on the GPU, so they take no memory, and their work is the caller's to
        count as the kernel's."""
        saved = self.count_work, self._in_kernel
        self.count_work, self._in_kernel = False, True
        try:
            yield
        finally:
            self.count_work, self._in_kernel = saved

    # ------------------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._meta_prop_depth:
            return func(*args, **kwargs)
        # Let tensor subclasses (DTensor, float8) desugar first: their local ops come back here.
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        name = func.__name__.split(".")[0]
        if func.namespace == "titanlite" and name == "weight_grad":
            # the op's own eager body, as the GPU runs it: where the weight holds a gradient its GEMM
            # writes into it (the fake kernel would hand autograd a new tensor to add, a pass the GPU
            # never makes); its widened CPU operands are not counted, being inside this dispatch
            out = accumulate_weight_grad(*args)
        else:
            out = func(*args, **kwargs)
        if func.namespace == "c10d" and name in COLLECTIVES:
            self._collective(name, args)
        else:
            counted, extern = self._node or (True, True)
            flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if counted and not self._in_kernel:
                for t in flat_out:
                    for st in storages(t):
                        self._add(st, self.category)
            if self.count_work and extern:
                self._work(func, name, args, kwargs, flat_out)
        return out

    def _collective(self, name: str, args) -> None:
        buf = args[COLLECTIVES[name]]
        tensors = buf if isinstance(buf, (list, tuple)) else [buf]
        tensors = [x for t in tensors for x in (t if isinstance(t, (list, tuple)) else [t])]
        self.label(tensors, "comm_buffers")
        ranks = _group_ranks(args)
        n = len(ranks)
        moved = moved_bytes(OP_KIND[name], sum(nbytes(t) for t in tensors), n)
        self.work[self.phase].collectives.append(Collective(name, moved, ranks))

    def _work(self, func, name: str, args, kwargs, outs) -> None:
        w = self.work[self.phase]
        if func in MATMULS:
            a, b = (args[1], args[2]) if MATMULS[func] == "addmm" else (args[0], args[1])
            w.matmul_flops += 2 * a.numel() * b.shape[-1]
        elif func.namespace == "titanlite" and name == "weight_grad":  # ops.master_linear: grad_out^T x, one GEMM
            grad_out, x = args[0], args[1]
            w.matmul_flops += 2 * grad_out.numel() * x.shape[-1]
        elif func.namespace == "titanlite" and name in ("fp32_mm", "fp32_addmm_"):  # ops.loss: a @ b, one GEMM
            a, b = args[-2], args[-1]
            w.matmul_flops += 2 * a.numel() * b.shape[-1]
        elif name == "_scaled_mm":
            w.float8_flops += 2 * args[0].numel() * args[1].shape[-1]
        elif "scaled_dot_product" in name and "attention" in name:
            q = args[1] if "backward" in name else args[0]  # backward ops take grad_out first
            b, h, s, d = q.shape
            causal_fwd = 2 * b * h * s * s * d  # 4*B*H*S^2*D halved by the causal mask
            w.attention_flops += causal_fwd * (2.5 if "backward" in name else 1.0)
        elif name in FREE_OPS or func.is_view or func.namespace == "prim":
            return
        else:
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            writes = outs or _mutated(func, args, kwargs)  # in-place foreach / fused ops return nothing
            if not writes:
                return
            w.memory_bytes += sum(t.numel() * t.element_size() for t in ins + writes)
        w.ops += 1


def _group_ranks(args) -> tuple:
    """The global ranks of the collective's process group (passed boxed as a ScriptObject)."""
    import torch.distributed as dist

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                group = dist.ProcessGroup.unbox(a)
            except RuntimeError:  # another boxed argument (a ReduceOp)
                continue
            return tuple(dist.get_process_group_ranks(group))
    return tuple(range(dist.get_world_size() if dist.is_initialized() else 1))


def _mutated(func, args, kwargs) -> list:
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            out += [t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)]
    return out

