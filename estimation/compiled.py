"""torch.compile in a dry run: Inductor's own graphs, run on fake tensors, counted as Inductor runs them.

With `compile.enable` the fake run compiles exactly what training compiles (each TransformerBlock,
the chunked loss's per-chunk kernel) through torch.compile's real pipeline: Dynamo captures the
graph, AOTAutograd builds the joint forward + backward with Inductor's decompositions, and Inductor's
partition function (its joint-graph passes, then the min-cut rematerialisation partitioner with
Inductor's settings) decides which tensors the forward saves for backward. Only the last stage,
Inductor's code generation, is replaced (`capture_compile`): each partitioned graph runs op by op on
the fake tensors, so the memory tracker sees exactly the saved tensors torch.compile keeps.

Inside a graph the tracker counts what Inductor materialises, not every eager intermediate
(`materialized`): element-wise ops and views fuse into the kernel of their consumer, so only the
outputs of kernels that cannot fuse (matmuls, attention, other library calls), the inputs those
read, reduction results and the graph's outputs (saved tensors included) take memory. The same
grouping gives the throughput model the generated kernels' traffic: what they write, and each
materialised tensor they read, once per pass over it (`_fused_kernels`), each element at no more than
bf16's two bytes (`KERNEL_ELEMENT_BYTES`).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from titanlite.errors import ConfigError

from estimation import EstimateWarning
from estimation.standins import inductor_without_codegen
from estimation.tracker import StepTracker

# Ops Inductor lowers to a library call (cuBLAS, cuDNN / flash attention, ...) that reads its inputs
# from memory and writes its output: they never fuse with their neighbours.
_EXTERN_NAMES = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "_scaled_dot_product",
                 "_flash_attention", "_efficient_attention", "_cudnn_attention", "scatter", "index_put",
                 "embedding", "sort", "topk", "cumsum")
# Structural ops Inductor fuses like element-wise ones (they move or build values, no reduction).
_FUSIBLE_NAMES = ("view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "squeeze",
                  "unsqueeze", "slice", "select", "split", "split_with_sizes", "unbind", "alias", "cat",
                  "clone", "_to_copy", "convert_element_type", "full", "scalar_tensor", "full_like", "zeros",
                  "ones", "zeros_like", "ones_like", "empty", "iota", "arange", "where", "gather", "index",
                  "repeat", "constant_pad_nd", "copy", "lift_fresh_copy", "detach", "as_strided",
                  "split_with_sizes_copy", "view_copy", "squeeze_copy", "unsqueeze_copy", "permute_copy")
_REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "logsumexp", "argmax",
               "argmin", "any", "all", "norm", "linalg_vector_norm")


def _name(node: fx.Node) -> str:
    t = node.target
    return getattr(t, "__name__", str(t)).split(".")[0]


def kind(node: fx.Node) -> str:
    """"fused" (element-wise or structural: inlined into its consumer's kernel), "reduction" or
    "extern" (a kernel of its own that reads its inputs from memory)."""
    if node.op != "call_function":
        return "fused"  # getitem of a multi-output op: the op's outputs are what counts
    if node.target is operator.getitem:
        return "fused"
    name = _name(node)
    tags = getattr(node.target, "tags", ())
    if any(name.startswith(e) for e in _EXTERN_NAMES):
        return "extern"
    if name in _REDUCTIONS:
        return "reduction"
    if torch.Tag.pointwise in tags or name in _FUSIBLE_NAMES or getattr(node.target, "is_view", False):
        return "fused"
    return "extern"


def _base(node: fx.Node) -> fx.Node:
    """Walk back through views and getitems to the node whose buffer a tensor lives in."""
    while node.op == "call_function" and (getattr(node.target, "is_view", False) or
                                         node.target is operator.getitem) and node.args and \
            isinstance(node.args[0], fx.Node) and kind(node.args[0]) == "fused":
        node = node.args[0]
    return node


def materialized(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose outputs Inductor writes to memory: kernel outputs that are not inlined."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            out.add(node)
        elif node.op == "output":
            for arg in node.all_input_nodes:
                out.add(_base(arg))
        elif node.op == "call_function":
            k = kind(node)
            if k != "fused":
                out.add(node)
            if k == "extern":  # a library kernel reads its operands from memory
                out.update(_base(a) for a in node.all_input_nodes)
    # a getitem of a materialised multi-output op, and views of a materialised buffer, share its memory
    return out


@dataclass
class GraphCost:
    """What a compiled graph's fused kernels move, beside the library calls the tracker counts."""
    kernel_bytes: float = 0.0  # traffic of the generated (fused) kernels: elements read + written, in _traffic's bytes
    kernels: int = 0           # generated kernels launched


def _hint(n) -> int:
    """A size as a number (a symbolic one, e.g. of the random-state token, by its example value)."""
    return n if isinstance(n, int) else int(n.node.hint) if hasattr(n, "node") else int(n)


GLOBAL_REDUCTION = 1024  # a reduction to at most this many values (a float8 scale's amax) ends a pass


def _nbytes(node: fx.Node, max_element_bytes: int | None = None) -> int:
    """Bytes of `node`'s tensor(s), each element counted at no more than `max_element_bytes` if given."""
    v = node.meta.get("val")
    vals = v if isinstance(v, (list, tuple)) else [v]
    return sum(_hint(t.numel()) * min(t.element_size(), max_element_bytes or t.element_size())
               for t in vals if isinstance(t, torch.Tensor))


def _reads(node: fx.Node, mat: set[fx.Node]) -> list[fx.Node]:
    """The materialised tensors a kernel reads: its inputs, looking through the inlined (fused) nodes
    it recomputes to the materialised tensors they come from."""
    out, seen, stack = [], set(), list(node.all_input_nodes)
    while stack:
        a = stack.pop()
        if a in seen:
            continue
        seen.add(a)
        if a in mat:
            out.append(a)
        else:
            stack.extend(a.all_input_nodes)
    return out


# Generated kernels compute in fp32 whatever they load, and their time follows the elements they move
# more than the bytes: on 2 x H100, one GPU's, ddp's and zero1's kernels (an fp32 residual stream) and
# fsdp's (a bf16 one, from FSDP's bf16 parameters) ran at 2.40-2.64 TB/s counted this way, against
# 2.41-3.29 TB/s counting bytes (benchmarks/results/2026-11-26_2xh100_estimation-kernels.md). So an
# element wider than bf16 counts as two bytes; narrower ones (float8) at their width.
KERNEL_ELEMENT_BYTES = 2


def _traffic(node: fx.Node) -> int:
    """What a generated kernel's read or write of `node` costs, in bytes (KERNEL_ELEMENT_BYTES at most an element)."""
    return _nbytes(node, KERNEL_ELEMENT_BYTES)


def _ends_pass(node: fx.Node) -> bool:
    return kind(node) == "extern" or (kind(node) == "reduction" and _nbytes(node) <= 4 * GLOBAL_REDUCTION)


def _levels(graph: fx.Graph, mat: set[fx.Node]) -> tuple[dict[fx.Node, int], dict[fx.Node, list[fx.Node]]]:
    """For each materialised node: the passes that must finish before its value exists (a library
    call or a tensor-wide reduction it depends on ends one), and the materialised tensors it reads."""
    level: dict[fx.Node, int] = {}
    reads: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node not in mat:
            continue
        reads[node] = ins = _reads(node, mat)
        level[node] = max((level.get(a, 0) + (1 if a.op == "call_function" and _ends_pass(a) else 0) for a in ins),
                          default=0)
    return level, reads


def _is_kernel(node: fx.Node) -> bool:
    """A generated kernel's output (not a library call's, a view's or a part of a multi-output op)."""
    return kind(node) != "extern" and not getattr(node.target, "is_view", False) and node.target is not operator.getitem


def _fused_kernels(graph: fx.Graph, mat: set[fx.Node]) -> GraphCost:
    """The generated kernels of one graph: each materialised element-wise or reduction node is one
    kernel that writes its output and reads the materialised tensors its inlined cone reaches.

    Kernels that read the same tensor fuse into one pass over it (Inductor fuses consumers that share
    a loop: a saved activation read by several backward expressions, a row-wise norm and its
    epilogue), unless one has to wait for a library call or a tensor-wide reduction that depends on
    the other (a float8 cast after its amax): each such wait starts a new pass, which reads again.
    """
    cost = GraphCost()
    level, reads = _levels(graph, mat)
    passes: set[tuple[fx.Node, int]] = set()
    for node, ins in reads.items():
        if kind(node) == "extern" or getattr(node.target, "is_view", False):
            continue
        cost.kernels += 1
        cost.kernel_bytes += _traffic(node)
        passes.update((a, level[node]) for a in ins)
    cost.kernel_bytes += sum(_traffic(a) for a, _ in passes)
    return cost


# ------------------------------------------------------------------------------- memory plan
# Inductor's scheduler refuses a horizontal fusion when the buffers it would stop from being reused
# outweigh this many times the bytes the two kernels share (Scheduler.can_fusion_increase_peak_memory),
# and fuses only kernels at most this many kernels apart (Scheduler.are_long_distant_nodes).
FUSION_MEMORY_FACTOR, FUSION_DISTANCE = 32, 64
# Library calls Inductor runs with an output buffer it allocates itself (extern_kernels.mm(..., out=)):
# like a generated kernel's, that buffer can be a reused one.
_OUT_EXTERNS = ("mm", "addmm", "bmm", "baddbmm")
# Ops that read an element at another index than the one written (a kernel through them cannot
# write its output over that input in place).
_MOVES = ("cat", "split", "split_with_sizes", "slice", "select", "permute", "transpose", "t", "expand",
          "gather", "index", "repeat", "constant_pad_nd", "as_strided", "unbind")


def _same_index(kernel: fx.Node, buffer: fx.Node, mat: set[fx.Node]) -> bool:
    """Does `kernel` read `buffer` only at the index it writes (so it may write over it in place)? Not
    where a path from the buffer to the kernel's output passes an op that moves elements (_MOVES)."""
    stack, seen = [(kernel, False)], set()
    while stack:
        n, moved = stack.pop()
        moved = moved or (n is not kernel and _name(n) in _MOVES)
        for a in n.all_input_nodes:
            if a is buffer:
                if moved:
                    return False
            elif a not in mat and (a, moved) not in seen:
                seen.add((a, moved))
                stack.append((a, moved))
    return True


@dataclass
class MemoryPlan:
    """How Inductor's generated wrapper holds a graph's buffers, as a schedule for the fake run:

    - the graph is reordered so that kernels Inductor fuses horizontally (several outputs of one
      loop, e.g. SwiGLU's recomputed product and its two gradients) run together, so their outputs
      exist at once;
    - a buffer lives until the last kernel that reads it, also where that kernel recomputes an inlined
      expression from it (`release_after`), not only until its last direct user;
    - a kernel's output takes over a dead buffer of the same dtype and size (`takes_over`): one that
      dies at that kernel (in place) or one freed earlier and kept for reuse, which Inductor then
      holds from its last use until the reuse (`codegen.wrapper`'s reuse pool).
    """
    roots: set[fx.Node]                            # nodes whose value is a buffer of its own
    release_after: dict[fx.Node, list[fx.Node]]    # node -> buffers whose last reader it ends
    takes_over: dict[fx.Node, fx.Node]             # allocating node -> the dead buffer it reuses


def _root(node: fx.Node, mat: set[fx.Node]) -> fx.Node:
    """The materialised node whose buffer a materialised view shares."""
    while node.op == "call_function" and getattr(node.target, "is_view", False) and node.args and \
            isinstance(node.args[0], fx.Node) and node.args[0] in mat:
        node = node.args[0]
    return node


def _reuse_key(node: fx.Node):
    """Buffers Inductor may reuse for one another: same dtype, same size."""
    v = node.meta.get("val")
    return (v.dtype, _nbytes(node)) if isinstance(v, torch.Tensor) else None


def _fusion_groups(kernels: list[fx.Node], level, roots, readers) -> list[list[fx.Node]]:
    """Kernels Inductor fuses into one: same pass, within FUSION_DISTANCE, and sharing a tensor they
    read (or one reads the other) without the fusion costing more reusable memory than it saves.
    `roots`: node -> the buffers it reads; `readers`: buffer -> how many nodes read it."""
    parent = {k: k for k in kernels}

    def find(k):
        while parent[k] is not k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    # inputs only this kernel reads: buffers it could hand over to a later output if not fused
    single = {k: {_reuse_key(r) for r in roots[k] if readers[r] == 1 and r.op == "call_function"} for k in kernels}
    for i, a in enumerate(kernels):
        for b in kernels[i + 1:i + 1 + FUSION_DISTANCE]:
            if level[a] != level[b] or find(a) is find(b):
                continue
            shared = sum(_nbytes(r) for r in roots[a] & roots[b]) + (_nbytes(a) if a in roots[b] else 0)
            if not shared:
                continue
            overhead = sum(k[1] for k in single[a] & single[b] if k)
            if overhead > FUSION_MEMORY_FACTOR * shared and a not in roots[b]:
                continue
            parent[find(b)] = find(a)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for k in kernels:
        groups.setdefault(find(k), []).append(k)
    return list(groups.values())


class MemoryPlanFallback(EstimateWarning):
    """memory_plan kept Inductor's graph order instead of its reordered one (see memory_plan)."""


def memory_plan(graph: fx.Graph, mat: set[fx.Node]) -> MemoryPlan:
    """Reorder `graph` so that fused kernels run together, and return how its buffers live (MemoryPlan).
    Should the reordered graph not hold together, Inductor's order is kept, with a MemoryPlanFallback
    warning (an error under the tests)."""
    level, read, readers = _buffer_reads(graph, mat)
    kernels = [n for n in read if _is_kernel(n)]
    groups = [g for g in _fusion_groups(kernels, level, read, readers) if len(g) > 1]
    original = list(graph.nodes)
    group_end = _run_groups_together(graph, groups, mat)
    try:
        graph.lint()
    except RuntimeError as e:  # a move got wrong: the plan of the graph as Inductor ordered it instead
        _restore_order(graph, original)
        group_end = {}
        warnings.warn(MemoryPlanFallback(f"estimation.compiled.memory_plan kept a graph's own order: running its "
                                         f"fused kernels together broke it ({str(e).splitlines()[0]}); its "
                                         f"buffers are held as unfused kernels would hold them"))
    order = list(graph.nodes)
    roots = _buffers(order, mat)
    dying = _dying(order, mat, read, roots, group_end)
    takes_over, release_after = _reuse(order, mat, read, readers, roots, dying, group_end)
    return MemoryPlan(roots, release_after, takes_over)


def _buffer_reads(graph: fx.Graph, mat: set[fx.Node]):
    """Each kernel's pass (_levels), the buffers each node reads (through views to their roots), and how
    many nodes read each buffer."""
    level, reads = _levels(graph, mat)
    read = {k: {_root(a, mat) for a in ins} for k, ins in reads.items()}  # node -> the buffers it reads
    readers: dict[fx.Node, int] = {}
    for bufs in read.values():
        for r in bufs:
            readers[r] = readers.get(r, 0) + 1
    return level, read, readers


def _run_groups_together(graph: fx.Graph, groups: list[list[fx.Node]], mat: set[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Move each fusion group's members right after its first one, with the inlined nodes they recompute
    (a member that waits for another kernel stays where it is: Inductor could not fuse it there either).
    Returns each placed member -> the group's last placed member, where the fused kernel ends."""
    group_end: dict[fx.Node, fx.Node] = {}
    for first, *rest in groups:
        cursor, placed = first, [first]
        for m in rest:
            pos = {n: i for i, n in enumerate(graph.nodes)}  # as moved so far
            anc, stack = set(), [m]
            while stack:
                x = stack.pop()
                if x in anc or pos[x] <= pos[cursor]:
                    continue
                anc.add(x)
                stack.extend(x.all_input_nodes)
            if any(x in mat and x is not m for x in anc):
                continue  # it waits for another kernel: Inductor could not fuse it here either
            for x in sorted(anc, key=pos.__getitem__):
                cursor.append(x)
                cursor = x
            placed.append(m)
        for m in placed:
            group_end[m] = placed[-1]
    return group_end


def _restore_order(graph: fx.Graph, order: list[fx.Node]) -> None:
    """Put `graph`'s nodes back in `order`."""
    prev = order[0]
    for n in order[1:]:
        prev.append(n)
        prev = n


def _buffers(order: list[fx.Node], mat: set[fx.Node]) -> set[fx.Node]:
    """The nodes whose value is a buffer of its own: materialised tensors that are no view of another."""
    return {n for n in order if (n.op == "placeholder" or n.op == "call_function") and n in mat
            and _root(n, mat) is n and isinstance(n.meta.get("val"), torch.Tensor)}


def _dying(order, mat, read, roots, group_end) -> dict[fx.Node, list[fx.Node]]:
    """Where each buffer dies: after the last kernel that reads it (the end of that kernel's fusion
    group), unless the graph returns it. node -> the buffers dying there."""
    at = {n: i for i, n in enumerate(order)}
    out_node = next(n for n in order if n.op == "output")
    outputs = {_root(a, mat) for a in out_node.all_input_nodes}
    last: dict[fx.Node, fx.Node] = {}
    for k, bufs in read.items():
        end = group_end.get(k, k)
        for r in bufs:
            if r in roots and (r not in last or at[end] > at[last[r]]):
                last[r] = end
    dying: dict[fx.Node, list[fx.Node]] = {}
    for r, end in last.items():
        if r not in outputs:
            dying.setdefault(end, []).append(r)
    return dying


def _reuse(order, mat, read, readers, roots, dying, group_end):
    """Inductor's wrapper's buffer reuse, walked in `order`: a kernel's output takes over a buffer dying
    at it (in place) or one freed earlier and pooled, of the same dtype and size; a dead buffer nobody
    takes is freed where it died. Returns (takes_over, release_after) of MemoryPlan."""

    def allocates(n):
        return n in roots and (_is_kernel(n) or _name(n) in _OUT_EXTERNS)

    pool: dict[tuple, list[fx.Node]] = {}
    takes_over: dict[fx.Node, fx.Node] = {}
    release_after: dict[fx.Node, list[fx.Node]] = {}
    taken: set[fx.Node] = set()
    pooled: dict[fx.Node, fx.Node] = {}  # buffer -> where it died (freed there unless reused later)
    for n in order:
        end = group_end.get(n, n)
        if allocates(n):
            # in place: an input only this kernel reads, at the index it writes (Inductor's
            # SchedulerNode.decide_inplace_update), dying here
            here = [r for r in dying.get(end, ()) if r.op == "call_function" and r not in taken and readers[r] == 1
                    and _reuse_key(r) == _reuse_key(n) and r in read[n] and _same_index(n, r, mat)]
            if here:
                takes_over[n] = here[0]
                taken.add(here[0])
            elif pool.get(_reuse_key(n)):
                r = pool[_reuse_key(n)].pop()
                takes_over[n] = r
                taken.add(r)
                del pooled[r]
        if end is n:  # the group (or the node) is done: what dies here is freed or kept for reuse
            for r in dying.get(n, ()):
                if r in taken:
                    continue
                if r.op == "call_function":
                    pool.setdefault(_reuse_key(r), []).append(r)
                    pooled[r] = n
                else:
                    release_after.setdefault(n, []).append(r)
    for r, died in pooled.items():  # never reused: freed where it died
        release_after.setdefault(died, []).append(r)
    return takes_over, release_after


class _Runner(fx.Interpreter):
    """Runs a partitioned graph on fake tensors, letting the tracker count only materialised outputs,
    and holding each buffer as Inductor's wrapper would (MemoryPlan)."""

    def __init__(self, gm: fx.GraphModule, mat: set[fx.Node], plan: MemoryPlan):
        super().__init__(gm)
        self.mat, self.plan = mat, plan
        self.held: dict[fx.Node, object] = {}

    def call_function(self, target, args, kwargs):
        # Recomputation under activation checkpointing replays random ops with the state saved in
        # forward; the state is a token here, the op runs as itself.
        hop = torch.ops.higher_order
        if target is getattr(hop, "run_and_save_rng_state", None):
            return torch.empty(0, dtype=torch.uint8), args[0](*args[1:], **kwargs)
        if target is getattr(hop, "run_with_rng_state", None):
            return args[1](*args[2:], **kwargs)
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node):
        tracker = _active_tracker()
        old = self.plan.takes_over.get(n)
        if old is not None and old in self.held:
            value = self.held.pop(old)
            if tracker is not None:
                tracker.hand_over(value)
        if tracker is None or n.op != "call_function":
            out = super().run_node(n)
        else:
            with tracker.compiled_node(counted=n in self.mat, extern=kind(n) == "extern"):
                out = super().run_node(n)
        if n in self.plan.roots:
            self.held[n] = out
        for r in self.plan.release_after.get(n, ()):
            self.held.pop(r, None)
        return out


def _active_tracker():
    return next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, StepTracker)), None)


def _eager_inner(gm: fx.GraphModule, example_inputs, **kwargs):
    """Inductor's inner compile, minus code generation: the graph itself, run node by node."""
    mat = materialized(gm.graph)
    cost = _fused_kernels(gm.graph, mat)
    plan = memory_plan(gm.graph, mat)
    gm.recompile()

    def run(args):
        tracker = _active_tracker()
        if tracker is not None:
            tracker.add_kernels(cost)
        runner = _Runner(gm, mat, plan)
        try:
            return runner.boxed_run(args)
        finally:
            runner.held.clear()

    run._boxed_call = True
    return run


@contextlib.contextmanager
def capture_compile():
    """Every torch.compile with the Inductor backend, while this is active, runs Inductor's pipeline
    up to code generation and then the partitioned graphs on fake tensors (see module docstring; the
    stand-in for code generation is estimation.standins.inductor_without_codegen).

    Inside DDP's forward, Dynamo's DDP optimizer splits each compiled graph at the gradient-bucket
    boundaries before Inductor sees it (the partitioner then works per piece); that happens here too,
    in the backend, because Dynamo's own route to it would trace with the fake mode still active.
    Shapes stay static as in training (no automatic dynamic shapes after a batch change), each probed
    batch keeps its compiled entry, and nothing is read from or written to the compile caches (an
    entry there holds generated code, not these graphs). Dynamo's caches are reset on exit, so a
    later real torch.compile in the same process compiles afresh.
    """
    # here, not at the top: Dynamo and Inductor are large imports that only compiled estimates need
    import torch._dynamo
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.distributed import DDPOptimizer
    from torch._dynamo.utils import get_optimize_ddp_mode

    if not hasattr(TorchDispatchMode, "ignore_compile_internals"):  # torch.compile would skip every frame
        raise ConfigError(f"estimating compile.enable needs a torch whose dispatch modes can sit out compilation "
                          f"(TorchDispatchMode.ignore_compile_internals), not {torch.__version__}; use "
                          f"--compile.enable=false for the eager estimate")
    split_for_ddp = get_optimize_ddp_mode() == "ddp_optimizer"

    def compile_fx(orig, model_, example_inputs_, **kw):
        inductor = functools.partial(orig, inner_compile=_eager_inner, **kw)
        ddp = DistributedDataParallel._get_active_ddp_module() if split_for_ddp else None
        if ddp is None:
            return inductor(model_, example_inputs_)
        return DDPOptimizer(bucket_bytes_cap=ddp.bucket_bytes_cap, backend_compile_fn=inductor).compile_fn(
            model_, example_inputs_)

    torch._dynamo.reset()
    try:
        with inductor_without_codegen(compile_fx), \
                torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=1024,
                                           accumulated_recompile_limit=1 << 16, optimize_ddp=False), \
                functorch_config.patch(enable_autograd_cache=False):
            yield
    finally:
        torch._dynamo.reset()
