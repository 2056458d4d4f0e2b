"""What a step's collectives cost: the one communication model that estimation and diagnose share.

Bytes: a ring collective over n ranks moves RING_FACTOR x (n - 1) / n of its buffer through each rank's
link (an all-reduce is a reduce-scatter and an all-gather: twice); a broadcast moves its buffer once.
Time: the bytes moved over the link they cross, at its bandwidth x the calibrated link efficiency
(`seconds`). Inside one node that is the GPU's link (titanlite.hardware); a group spanning nodes is
bounded by the slower of that link and the network its ranks on one node share, and pays a latency
per step of its ring, or tree for an all-reduce.
Overlap (`overlap`): collectives issued during forward and backward hide behind that compute, except
those at its edges (the first all-gather, the last gradient reduction), which have nothing to hide
behind. A hidden collective is not free: its kernels take SMs and memory bandwidth from the compute
beside it, which runs longer by the hidden time x a measured rate per kind of collective (BESIDE_KIND).
Per data-parallel mode (`data_parallel_step`): what one optimizer step of each mode reduces and
gathers, from the parameter count and the dtypes the gradients and gathered parameters cross in.

estimation prices the collectives its fake step records; diagnose prices the ones a mode's step
issues for the model a log names. Both use the rates of estimation/calibration.json (link efficiency,
beside rates; `python -m estimation.calibrate` writes it): one measurement, read by both.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass

from titanlite.hardware import GPUS_PER_NODE
from titanlite.parallel.modes import MODES

CALIBRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "estimation", "calibration.json")
# The GPU whose fits are each calibration entry's own value, which every other GPU without a fit takes.
REFERENCE_GPU = "h100"

# ring traffic through each rank's link, per byte of the buffer, before the (n - 1) / n
RING_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}
# c10d's collective ops (as a dispatch mode sees them) -> their kind
OP_KIND = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "broadcast_": "broadcast",
           "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
           "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
           "alltoall_base_": "all_to_all"}
# kind of collective -> its kind in calibration.json's beside_collectives (how it slows the compute beside it)
BESIDE_KIND = {"all_reduce": "all_reduce", "broadcast": "all_reduce", "all_gather": "sharded",
               "reduce_scatter": "sharded", "all_to_all": "sharded"}
# Latency of a collective across nodes, in microseconds: per call, and per step of its ring or tree over
# NVLink and over the network. Assumed, of the order NCCL's own tuning model takes for large messages;
# not measured here.
LATENCY_US = {"call": 8.0, "nvlink": 3.0, "network": 10.0}


def load_calibration(path: str = CALIBRATION) -> dict:
    with open(path) as fh:
        return json.load(fh)


def gpu_rate(entry: dict, gpu: str) -> tuple[float, str]:
    """A rate on `gpu` and its source: the GPU's own fit where the entry holds one under its key
    (`python -m estimation.calibrate --write` stores them), else the entry's value (REFERENCE_GPU's),
    which every GPU without its own fit takes as the same fraction of its peak."""
    own = entry.get(gpu)
    return (own["value"], source(own)) if isinstance(own, dict) else (entry["value"], source(entry))


def beside_rate(entry: dict, gpu: str) -> tuple[float, str]:
    """One kind of collective's beside rate on `gpu`, and its source: the GPU's own fit, else the mean of
    the GPUs fitted (how much a collective slows the compute beside it differed several-fold between
    the 2 x H100 and the 2 x H200 measured)."""
    fits = {k: e for k, e in entry.items() if isinstance(e, dict)}
    if gpu in fits:
        return fits[gpu]["value"], source(fits[gpu])
    return sum(e["value"] for e in fits.values()) / len(fits), f"mean of the fits on {', '.join(sorted(fits))}"


def source(entry: dict) -> str:
    return f"{entry['source']} ({entry['date']})" if entry.get("date") else entry["source"]


@dataclass(frozen=True)
class Link:
    """The links a collective crosses and how well they are used."""
    gbps: float                          # per-GPU, one-direction bandwidth inside a node (GB/s)
    efficiency: float                    # achieved fraction of it (calibration.json's link_efficiency)
    gpus_per_node: int = GPUS_PER_NODE
    network_gbps: float = 50.0           # per GPU between nodes (GB/s each way)


def calibrated_link(gbps: float, gpu: str, calibration: dict | None = None, **nodes) -> Link:
    """A link of `gbps` with the link efficiency calibrated for `gpu` (a titanlite.hardware key)."""
    cal = calibration or load_calibration()
    return Link(gbps, gpu_rate(cal["rates"]["link_efficiency"], gpu)[0], **nodes)


def calibrated_beside(gpu: str, calibration: dict | None = None) -> dict[str, float]:
    """calibration.json's beside rate of each kind of collective on `gpu`."""
    cal = calibration or load_calibration()
    return {kind: beside_rate(entry, gpu)[0] for kind, entry in cal.get("beside_collectives", {}).items()}


def moved_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank's link carries for a collective of `kind` over `n` ranks on a buffer of `nbytes`."""
    return nbytes if kind == "broadcast" else RING_FACTOR[kind] * (n - 1) / n * nbytes


def span(ranks, per_node: int) -> tuple[int, int]:
    """(nodes a group's ranks are on, the most of them on one node); torchrun numbers ranks node by node."""
    counts = Counter(r // per_node for r in ranks)
    return len(counts), max(counts.values())


def seconds(kind: str, moved: float, ranks, link: Link) -> float:
    """One collective's time: its ring traffic over the links it crosses, plus latency across nodes.

    Inside one node: the GPU's link. Across nodes NCCL runs several rings (or trees) at once, each leaving
    the node through another NIC, so a node's ranks in the group share their NICs' bandwidth: the group
    is bounded by min(link, ranks per node x network per GPU), e.g. fsdp over 2 x 8 GPUs by 8 NICs, hsdp's
    replicate all-reduce (one rank per node) by one. Latency: a ring's steps (n - 1, twice for an
    all-reduce), of which one per node boundary crosses the network; an all-reduce takes the lesser of
    that and a tree's (up and down: the ranks of a node in a chain, the nodes in a binary tree)."""
    nodes, local = span(ranks, link.gpus_per_node)
    if nodes == 1:
        return moved / (link.gbps * 1e9 * link.efficiency)
    bandwidth = min(link.gbps, local * link.network_gbps) * 1e9 * link.efficiency
    lat, n = LATENCY_US, len(ranks)

    def steps(nvlink, network):
        return nvlink * lat["nvlink"] + network * lat["network"]

    ring = steps(n - nodes, nodes - 1)
    if kind == "all_reduce":
        ring = min(2 * ring, 2 * steps(local - 1, math.ceil(math.log2(nodes))))
    return moved / bandwidth + (lat["call"] + ring) * 1e-6


@dataclass(frozen=True)
class Overlapped:
    """Forward and backward with their collectives beside them (seconds or ms, as given)."""
    step: float     # compute + beside + what of the collectives shows
    beside: float   # what the hidden collectives add to the compute beside them
    exposed: float  # the collectives' time the compute does not cover


def overlap(compute: float, comm: float, edges: float, beside_all: float) -> Overlapped:
    """`comm` of collectives issued beside `compute`, of which `edges` have nothing to hide behind;
    `beside_all`: what the compute would grow by were every collective hidden (each one's time x its
    beside rate). Only the hidden share slows the compute, and of that no more than the compute's own
    length (a collective longer than the compute, on a slow network, spends the rest beside nothing)."""
    hidden = max(0.0, comm - edges)
    beside = beside_all * min(hidden, compute) / comm if comm else 0.0
    step = max(compute + beside, hidden) + min(edges, comm)
    return Overlapped(step, beside, step - compute - beside)


@dataclass(frozen=True)
class StepCollective:
    kind: str       # a RING_FACTOR key, or "broadcast"
    nbytes: float   # the buffer (all of it: a gather's output, a reduction's input)
    edge: bool      # issued where no compute is left to hide it
    optimizer: bool = False  # issued in the optimizer phase, after backward


def data_parallel_step(mode: str, params: int, grad_bytes: int, gather_bytes: int, edge_params: int,
                       regathered: int | None = None, micro_steps: int = 1, reduces: int = 1) -> list[StepCollective]:
    """The collectives one optimizer step of `mode` issues, for `params` parameters whose gradients cross
    in `grad_bytes` per element and whose gathered copies in `gather_bytes`. `edge_params`: the
    parameters of the collective at each edge (ddp: the bucket reduced last, which holds the input
    embedding, ready last; fsdp: the root's, gathered first and reduced last). `regathered`: the
    parameters fsdp gathers again for backward, those of the groups resharded after forward (default:
    all but the root's). A step of `micro_steps` gathers for each of them and reduces `reduces` times
    (fsdp: once, or once a micro-step where they accumulate into the shards; ddp reduces once, in the
    last), each collective priced as one of their summed bytes. hsdp is priced as fsdp over all its
    ranks: the split into shard groups and their replicas' all-reduce, which estimation's fake run
    records, is not modelled here."""
    traits = MODES[mode]
    if traits.comm == "none":
        return []
    if traits.comm == "all_reduce":
        out = [StepCollective("all_reduce", (params - edge_params) * grad_bytes, False),
               StepCollective("all_reduce", edge_params * grad_bytes, True)]
        if traits.optimizer == "zero":  # each rank's updated partition, broadcast to the others
            out.append(StepCollective("broadcast", params * 4, True, optimizer=True))
        return out
    again = params - edge_params if regathered is None else regathered
    return [StepCollective("all_gather", micro_steps * edge_params * gather_bytes, True),
            StepCollective("all_gather", micro_steps * (params - edge_params + again) * gather_bytes, False),
            StepCollective("reduce_scatter", reduces * (params - edge_params) * grad_bytes, False),
            StepCollective("reduce_scatter", reduces * edge_params * grad_bytes, True)]


@dataclass(frozen=True)
class CommCost:
    """A step's collectives at a link, ms: all of them back to back, and with overlap."""
    total_ms: float    # none of their time hidden: the most they can take from a step
    exposed_ms: float  # what shows beside the compute (edges, optimizer-phase collectives)
    beside_ms: float   # what the hidden ones add to the compute beside them
    edges_ms: float

    @property
    def overlapped_ms(self) -> float:
        """What the collectives add to a step with overlap."""
        return self.exposed_ms + self.beside_ms


def step_cost(collectives: list[StepCollective], world: int, link: Link, beside: dict[str, float],
              compute_ms: float) -> CommCost:
    """The collectives of one step over ranks 0..world-1, beside `compute_ms` of forward and backward."""
    ranks = tuple(range(world))
    ms = [(c, 1000 * seconds(c.kind, moved_bytes(c.kind, c.nbytes, world), ranks, link)) for c in collectives]
    fb = [(c, t) for c, t in ms if not c.optimizer]
    comm = sum(t for _, t in fb)
    edges = sum(t for c, t in fb if c.edge)
    beside_all = sum(beside.get(BESIDE_KIND[c.kind], 0.0) * t for c, t in fb)
    o = overlap(compute_ms, comm, edges, beside_all)
    optimizer = sum(t for c, t in ms if c.optimizer)
    return CommCost(comm + optimizer, o.exposed + optimizer, o.beside, edges)
