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
materialised tensor they read, once per pass over it (`_fused_kernels`).
"""

from __future__ import annotations

import contextlib
import functools
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

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
    kernel_bytes: float = 0.0  # bytes read + written by the generated (fused) kernels
    kernels: int = 0           # generated kernels launched


def _hint(n) -> int:
    """A size as a number (a symbolic one, e.g. of the random-state token, by its example value)."""
    return n if isinstance(n, int) else int(n.node.hint) if hasattr(n, "node") else int(n)


GLOBAL_REDUCTION = 1024  # a reduction to at most this many values (a float8 scale's amax) ends a pass


def _fused_kernels(graph: fx.Graph, mat: set[fx.Node]) -> GraphCost:
    """The generated kernels of one graph: each materialised element-wise or reduction node is one
    kernel that writes its output and reads the materialised tensors its inlined cone reaches.

    Kernels that read the same tensor fuse into one pass over it (Inductor fuses consumers that share
    a loop: a saved activation read by several backward expressions, a row-wise norm and its
    epilogue), unless one has to wait for a library call or a tensor-wide reduction that depends on
    the other (a float8 cast after its amax): each such wait starts a new pass, which reads again.
    """
    cost = GraphCost()
    level: dict[fx.Node, int] = {}  # passes that must finish before this node's value exists
    reads: set[tuple[fx.Node, int]] = set()

    def leaves(node, seen):
        for a in node.all_input_nodes:
            if a in seen:
                continue
            seen.add(a)
            if a in mat:
                yield a
            else:
                yield from leaves(a, seen)

    def nbytes(node):
        v = node.meta.get("val")
        vals = v if isinstance(v, (list, tuple)) else [v]
        return sum(_hint(t.numel()) * t.element_size() for t in vals if isinstance(t, torch.Tensor))

    def ends_pass(node):
        return kind(node) == "extern" or (kind(node) == "reduction" and nbytes(node) <= 4 * GLOBAL_REDUCTION)

    for node in graph.nodes:
        if node.op != "call_function" or node not in mat:
            continue
        ins = list(leaves(node, set()))
        level[node] = max((level.get(a, 0) + (1 if a.op == "call_function" and ends_pass(a) else 0) for a in ins),
                          default=0)
        if kind(node) == "extern" or getattr(node.target, "is_view", False):
            continue
        cost.kernels += 1
        cost.kernel_bytes += nbytes(node)
        reads.update((a, level[node]) for a in ins)
    cost.kernel_bytes += sum(nbytes(a) for a, _ in reads)
    return cost


class _Runner(fx.Interpreter):
    """Runs a partitioned graph on fake tensors, letting the tracker count only materialised outputs."""

    def __init__(self, gm: fx.GraphModule, mat: set[fx.Node], cost: GraphCost):
        super().__init__(gm)
        self.mat, self.cost = mat, cost

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
        if tracker is None or n.op != "call_function":
            return super().run_node(n)
        with tracker.compiled_node(counted=n in self.mat, extern=kind(n) == "extern"):
            return super().run_node(n)


def _active_tracker():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from estimation.tracker import StepTracker

    return next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, StepTracker)), None)


def _eager_inner(gm: fx.GraphModule, example_inputs, **kwargs):
    """Inductor's inner compile, minus code generation: the graph itself, run node by node."""
    mat = materialized(gm.graph)
    cost = _fused_kernels(gm.graph, mat)

    def run(args):
        tracker = _active_tracker()
        if tracker is not None:
            tracker.add_kernels(cost)
        return _Runner(gm, mat, cost).boxed_run(args)

    run._boxed_call = True
    return run


@contextlib.contextmanager
def capture_compile():
    """Every torch.compile with the Inductor backend, while this is active, runs Inductor's pipeline
    up to code generation and then the partitioned graphs on fake tensors (see module docstring).

    Inside DDP's forward, Dynamo's DDP optimizer splits each compiled graph at the gradient-bucket
    boundaries before Inductor sees it (the partitioner then works per piece); that happens here too,
    in the backend, because Dynamo's own route to it would trace with the fake mode still active.
    Shapes stay static as in training (no automatic dynamic shapes after a batch change), each probed
    batch keeps its compiled entry, and nothing is read from or written to the compile caches (an
    entry there holds generated code, not these graphs). Dynamo's caches are reset on exit, so a
    later real torch.compile in the same process compiles afresh.
    """
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.compile_fx as cfx
    from torch._dynamo.utils import get_optimize_ddp_mode
    from torch.nn.parallel import DistributedDataParallel

    from torch.utils._python_dispatch import TorchDispatchMode

    from titanlite.config import ConfigError

    if not hasattr(TorchDispatchMode, "ignore_compile_internals"):  # torch.compile would skip every frame
        raise ConfigError(f"estimating compile.enable needs a torch whose dispatch modes can sit out compilation "
                          f"(TorchDispatchMode.ignore_compile_internals), not {torch.__version__}; use "
                          f"--compile.enable=false for the eager estimate")
    orig = cfx.compile_fx
    split_for_ddp = get_optimize_ddp_mode() == "ddp_optimizer"

    @functools.wraps(orig)
    def compile_fx(model_, example_inputs_, inner_compile=None, **kw):
        inductor = functools.partial(orig, inner_compile=_eager_inner, **kw)
        ddp = DistributedDataParallel._get_active_ddp_module() if split_for_ddp else None
        if ddp is None:
            return inductor(model_, example_inputs_)
        from torch._dynamo.backends.distributed import DDPOptimizer

        return DDPOptimizer(bucket_bytes_cap=ddp.bucket_bytes_cap, backend_compile_fn=inductor).compile_fn(
            model_, example_inputs_)

    cfx.compile_fx = compile_fx
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=1024,
                                        accumulated_recompile_limit=1 << 16, optimize_ddp=False), \
                functorch_config.patch(enable_autograd_cache=False):
            yield
    finally:
        cfx.compile_fx = orig
        torch._dynamo.reset()
