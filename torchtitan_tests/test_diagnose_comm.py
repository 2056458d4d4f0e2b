"""diagnose and estimation price a run's collectives with one communication model
(titanlite.parallel.comm_model): for the same model, mode, world size and GPU, the collectives diagnose
expects from a run's log take the time estimation's dry run gives them."""

import pytest

from titanlite.config import load_config
from titanlite.diagnose.expected import collectives, link_gbps
from titanlite.diagnose.runs import Run
from titanlite.hardware import by_key
from titanlite.models import get_model_args
from titanlite.parallel.comm_model import (Link, StepCollective, data_parallel_step, moved_bytes, overlap, seconds,
                                           step_cost)

# the debug model with a large vocabulary (estimation's test shapes): the embedding's gradients are one
# bucket of their own, as in the large models diagnose reads
SHAPE = ["--model.flavor", "debug", "--model.vocab_size", "32768", "--training.seq_len", "32",
         "--training.local_batch_size", "2", "--estimate.search=false", "--compile.enable=false"]


def estimated(mode: str, world: int, gpu: str, *extra) -> dict:
    from estimation.estimate import estimate

    cfg = load_config([*SHAPE, "--estimate.ngpu", str(world), "--parallelism.data_parallel", mode,
                       "--estimate.hardware", gpu, *extra])
    return estimate(cfg, progress=lambda m: None)


def log_of(report: dict) -> Run:
    """diagnose's view of a run of what `report` estimated, as its log would say it."""
    c = report["config"]
    config = {"data_parallel": c["data_parallel"], "model.name": "llama", "model.flavor": "debug",
              "model.vocab_size": 32768, "training.mixed_precision_param": c["mixed_precision_param"],
              "gradient_accumulation_steps": c["gradient_accumulation_steps"],
              **{f"parallelism.{k}": v for k, v in report["resolved_config"]["parallelism"].items()}}
    name, flavor = c["model"].split("/")
    return Run(path="", label=f"{c['ngpu']} GPUs", config=config,
               hardware={"name": c["device_name"], "device": "cuda"},
               model={"name": name, "flavor": flavor, "params": c["params"]}, world=c["ngpu"],
               local_batch=c["local_batch_size"], accum=c["gradient_accumulation_steps"],
               global_batch=c["global_batch_size"], seq_len=c["seq_len"],
               entries=[{"iter": 10, "time_ms": 100.0}], excluded=0)


@pytest.mark.parametrize("mode,world,gpu,extra", [
    ("ddp", 2, "h100", ()), ("ddp", 4, "h200", ()), ("ddp", 8, "b200", ()), ("zero1", 4, "h100", ()),
    ("fsdp", 2, "h100", ()), ("fsdp", 4, "h200", ()),
    ("fsdp", 4, "h100", ("--parallelism.fsdp_reshard_after_forward", "always")),
    ("fsdp", 8, "a100", ("--parallelism.fsdp_gradient_transport", "reduce_dtype")),
    # two micro-steps a step: the gathers twice, the reduce once, or twice where it accumulates into the shards
    ("fsdp", 4, "h200", ("--training.global_batch_size", "16", "--parallelism.fsdp_accumulate", "unsharded")),
    ("fsdp", 4, "h200", ("--training.global_batch_size", "16", "--parallelism.fsdp_accumulate", "sharded")),
    ("ddp", 2, "h100", ("--training.global_batch_size", "8",))])
def test_diagnose_expects_the_collective_time_estimation_gives(mode, world, gpu, extra):
    """All the collectives of a step, none hidden: the same ms from a log's settings as from the dry run's
    recorded collectives, within what fsdp's shard padding and the gradient norm's scalar add (0.5%); with
    accumulation too (the fake run records each micro-step's)."""
    report = estimated(mode, world, gpu, *extra)
    run = log_of(report)
    assert link_gbps(run, None) == by_key(gpu).link_gbps
    want = report["throughput"]["terms_ms"]["comm_total"]
    got = collectives(run, link_gbps(run, None)).total_ms
    assert want > 0 and got == pytest.approx(want, rel=0.005)


def test_ddp_exposes_the_embedding_bucket_and_hides_the_rest_as_estimation_does():
    """ddp's all-reduce of the embedding's gradients (ready last) is what shows beside the backward in both;
    the rest hides, slowing the compute beside it by the same calibrated rate."""
    report = estimated("ddp", 4, "h100", "--parallelism.ddp_bucket_cap_mb", "1")
    terms = report["throughput"]["terms_ms"]
    compute = sum(terms[k] for k in ("gemm", "attention", "elementwise", "gaps", "launch"))
    got = collectives(log_of(report), 450.0, compute)
    assert got.exposed_ms == pytest.approx(terms["comm_exposed"], rel=0.02)
    assert got.beside_ms == pytest.approx(terms["comm_beside"], rel=0.02)


def test_each_modes_step_moves_its_bytes():
    """ddp all-reduces every gradient; zero1 also broadcasts the updated parameters after backward; fsdp
    gathers the parameters for forward and again for backward (once where it does not reshard) and
    reduce-scatters the gradients; the edge collectives are the embedding's."""
    n, edge = 1000, 100
    ddp = data_parallel_step("ddp", n, 4, 2, edge)
    assert sum(c.nbytes for c in ddp if c.kind == "all_reduce") == 4 * n and [c.nbytes for c in ddp if c.edge] == [400]
    zero1 = data_parallel_step("zero1", n, 4, 2, edge)
    assert [(c.kind, c.nbytes) for c in zero1 if c.optimizer] == [("broadcast", 4 * n)]
    for again in (None, 0, n):  # the blocks again (the default), nothing again, everything again
        fsdp = data_parallel_step("fsdp", n, 4, 2, edge, regathered=again)
        assert sum(c.nbytes for c in fsdp if c.kind == "all_gather") == 2 * (n + (n - edge if again is None else again))
        assert sum(c.nbytes for c in fsdp if c.kind == "reduce_scatter") == 4 * n
    assert data_parallel_step("none", n, 4, 2, edge) == []
    # three micro-steps: fsdp gathers for each; it reduces once, or for each where it accumulates into the shards
    fsdp3 = data_parallel_step("fsdp", n, 4, 2, edge, micro_steps=3, reduces=3)
    assert sum(c.nbytes for c in fsdp3 if c.kind == "all_gather") == 3 * 2 * (2 * n - edge)
    assert sum(c.nbytes for c in fsdp3 if c.kind == "reduce_scatter") == 3 * 4 * n
    assert data_parallel_step("ddp", n, 4, 2, edge, micro_steps=3) == ddp  # ddp reduces once, in the last


def test_link_time_and_overlap():
    """A ring all-reduce moves 2 (n-1)/n of its buffer; across nodes it pays the network and a latency;
    overlap hides all but the edges, and the hidden time slows the compute beside it by its rate."""
    assert moved_bytes("all_reduce", 8e9, 4) == pytest.approx(12e9)
    assert moved_bytes("all_gather", 8e9, 4) == pytest.approx(6e9)
    link = Link(450.0, 0.8)
    assert seconds("all_reduce", 12e9, range(4), link) == pytest.approx(12e9 / 360e9)
    assert seconds("all_reduce", 12e9, range(16), link) > 12e9 / (8 * 50e9 * 0.8)  # the network, and latency
    o = overlap(compute=100.0, comm=30.0, edges=5.0, beside_all=15.0)  # beside rate 0.5
    assert (o.beside, o.exposed, o.step) == pytest.approx((12.5, 5.0, 117.5))
    cost = step_cost([StepCollective("all_reduce", 1e9, False)], 2, Link(100.0, 1.0), {"all_reduce": 0.5}, 1000.0)
    assert cost.total_ms == pytest.approx(10.0) and cost.beside_ms == pytest.approx(5.0) and cost.exposed_ms == 0
