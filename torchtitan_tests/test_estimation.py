"""estimation/: fake-tensor dry runs (memory by category, batch search, throughput model, CLI)."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

from titanlite.config import ConfigError, load_config
from titanlite.config.job_config import Estimate
from titanlite.models import get_model_args
from titanlite.parallel.modes import MODES

# debug shapes with a large vocabulary, so per-tensor 512-byte rounding stays far below 1%
BASE = ["--model.flavor", "debug", "--model.vocab_size", "32768", "--training.seq_len", "32",
        "--training.local_batch_size", "2"]


def _cfg(*extra):
    return load_config(BASE + list(extra))


MAX_RANKS = next(f for f in dataclasses.fields(Estimate) if f.name == "ngpu").metadata["max"]


@pytest.mark.parametrize("mode,world", [("none", 1), ("ddp", 2), ("ddp", 8), ("ddp_copy", 2), ("fsdp", 2),
                                        ("fsdp", 8)])
def test_model_state_matches_analytic(mode, world):
    """Parameters, gradients and AdamW state (fp32: 4, 4 and 8 bytes per parameter) within 1%."""
    from estimation.fake_run import FakeRun

    extra = ["--training.bf16_params=false"] + (["--parallelism.ddp_bucket_view=false"] if mode == "ddp_copy" else [])
    cfg = _cfg("--parallelism.data_parallel", {"none": "fsdp", "ddp_copy": "ddp"}.get(mode, mode), *extra)
    run = FakeRun(cfg, world)
    try:
        state = run.step(2).model_state
    finally:
        run.close()
    n = run.args.num_params()
    shards = world if mode == "fsdp" else 1
    rope = 2 * 32 * run.args.hdim * 4  # the rope cos/sin buffer, replicated
    expected = {"params": 4 * n / shards + rope, "grads": 4 * n / shards, "optimizer": 8 * n / shards}
    if mode == "ddp":  # gradients are views into DDP's reduce buckets: one copy, counted as the buckets
        expected["comm_buffers"] = expected.pop("grads")
        assert state["grads"] < 0.01 * 4 * n
    if mode == "ddp_copy":  # ddp_bucket_view=false: the buckets hold a second copy of the gradients
        expected["comm_buffers"] = 4 * n
    for k, v in expected.items():
        assert abs(state[k] - v) / v < 0.01, (k, state[k], v)


@pytest.mark.parametrize("mode,world,moments", [("none", 1, 4), ("ddp", 2, 4), ("none", 1, 2)])
def test_bf16_params_model_state(mode, world, moments):
    """training.bf16_params: the blocks' matrices are fp32 masters with a bf16 copy (4 + 2 bytes of
    parameters, counted as parameters although the copy is a buffer) and fp32 gradients (4), the rest
    fp32 (4 + 4); moments 2 x 4 bytes everywhere, 2 x 2 with bf16 moments. MasterAdamW's state counts
    as optimizer state although it is created up front."""
    from estimation.fake_run import FakeRun

    dtype = {4: "float32", 2: "bfloat16"}[moments]
    run = FakeRun(_cfg("--parallelism.data_parallel", "ddp", "--training.bf16_params",
                       "--optimizer.moments_dtype", dtype), world)
    try:
        state = run.step(2).model_state
    finally:
        run.close()
    a = run.args
    n, q, kv = a.num_params(), a.n_heads * a.hdim, a.kv_heads * a.hdim
    low = a.n_layers * (2 * a.dim * q + 2 * a.dim * kv + 3 * a.dim * a.ffn_dim)  # wq wo, wk wv, w1 w2 w3
    high = n - low  # embeddings, norms, output head
    rope = 2 * 32 * a.hdim * 4
    grads = "comm_buffers" if mode == "ddp" else "grads"  # ddp: views into its buckets
    for k, v in {"params": 6 * low + 4 * high + rope, grads: 4 * n, "optimizer": 2 * moments * n}.items():
        assert abs(state[k] - v) / v < 0.01, (k, state[k], v)


@pytest.mark.parametrize("extra", [[], ["--float8.enable"]], ids=["fp32_masters", "bf16_params_low_bits"])
def test_master_adamw_step_allocates_nothing(extra):
    """MasterAdamW's update is one fused kernel per launch on the GPU, writing into the parameters,
    moments, low bits and bf16 copies that exist: the optimizer phase holds the model state and a few
    scalars, as torch's fused AdamW does, never the fp32 intermediates of the eager reference the fake
    run executes for its values (about 7 copies of the largest parameter at once: with Qwen3's
    151,936-token embedding, 8 GiB that moved the whole step's peak into the optimizer)."""
    from estimation.fake_run import FakeRun

    excess = {}
    for name, flags in (("master", extra), ("torch_fused", ["--training.bf16_params=false"])):
        run = FakeRun(_cfg(*flags), 1)
        try:
            r = run.step(2)
        finally:
            run.close()
        if name == "master":
            assert type(run.optimizer).__name__ == "MasterAdamW"
            largest = max(p.numel() * p.element_size() for p in run.model.parameters())
        excess[name] = r.phase_peak["opt"] - sum(r.model_state.values())
    assert 0 <= excess["master"] <= excess["torch_fused"] + 0.01 * largest, (excess, largest)


@pytest.mark.parametrize("extra", [[], ["--float8.enable"], ["--optimizer.moments_dtype", "bfloat16"]],
                         ids=["fp32_masters", "bf16_params_low_bits", "bf16_moments"])
def test_unfused_master_adamw_step_holds_what_torchs_kernel_needs(extra):
    """optimizer.fused=false runs torch's fused AdamW kernel on the GPU (over fp32 lists), and the fake
    run runs it too: over fp32 masters and moments it writes in place and holds nothing; bf16
    parameters (their fp32 masters and gradients) and bf16 moments go through fp32 temporaries that
    span a chunk of parameters, at least the largest such one, and are part of the step's peak."""
    from estimation.fake_run import FakeRun

    run = FakeRun(_cfg("--optimizer.fused", "false", *extra), 1)
    try:
        r = run.step(2)
    finally:
        run.close()
    assert type(run.optimizer).__name__ == "MasterAdamW"
    excess = r.phase_peak["opt"] - sum(r.model_state.values())
    widened = [p for p in run.model.parameters() if p.dtype == torch.bfloat16 or extra[-1:] == ["bfloat16"]]
    scalars = 0.01 * max(p.numel() * 4 for p in run.model.parameters())  # the step's 0-d tensors
    assert excess >= 2 * 4 * max((p.numel() for p in widened), default=0)  # two fp32 temporaries of the largest
    assert excess <= 2 * 4 * sum(p.numel() for p in widened) + scalars  # no more than two of each such parameter
    assert bool(widened) == bool(extra)


def test_unfused_fsdp_step_is_torchs_fused_adamw():
    """fsdp without titanlite's kernel steps torch's AdamW, fused on CUDA, and so in the fake run: it
    writes in place and holds nothing beyond the model state (its foreach update would hold temporaries
    of whole parameters)."""
    from estimation.fake_run import FakeRun

    run = FakeRun(_cfg("--optimizer.fused", "false", "--parallelism.data_parallel", "fsdp"), 2)
    try:
        r = run.step(2)
    finally:
        run.close()
    assert type(run.optimizer) is torch.optim.AdamW and run.optimizer.defaults["fused"]
    scalars = 0.01 * max(p.numel() * 4 for p in run.model.parameters())
    assert r.phase_peak["opt"] - sum(r.model_state.values()) <= scalars


def test_peak_breakdown_and_activation_checkpointing():
    """The peak is the sum of its categories; full AC keeps fewer activations; FSDP gathers show up."""
    from estimation.fake_run import FakeRun

    peaks = {}
    for ac in ("none", "full"):
        # default debug vocabulary and seq 128: block activations, not the logits, dominate. The loss is
        # pinned to cross_entropy: the chunked loss holds its own fp32 chunk buffer through the forward
        # peak, which AC rightly does not touch and which would blur what this test isolates.
        cfg = load_config(["--model.flavor", "debug", "--training.seq_len", "128", "--parallelism.data_parallel",
                           "fsdp", "--activation_checkpoint.mode", ac, "--training.loss", "cross_entropy"])
        run = FakeRun(cfg, 2)
        try:
            r = run.step(8)
        finally:
            run.close()
        assert sum(r.breakdown.values()) == r.peak_bytes
        peaks[ac] = r
    assert peaks["full"].breakdown["activations"] < 0.4 * peaks["none"].breakdown["activations"]
    assert peaks["none"].breakdown["comm_buffers"] > 0  # the root's gathered embedding and output


def test_dtensor_shape_propagation_is_not_counted(monkeypatch):
    """DTensor works out an op's output shape by running it on global-shape stand-in tensors in the
    fake mode. torch 2.11 does this uncached on every step (optimizer ops included: 4x the full fp32
    model), which made the 2-GPU fsdp estimate 28.9 GiB against 21.9 measured. Whatever runs inside
    that propagation must count neither as memory nor as work: here it also allocates 1 GiB each time.

    torch 2.13 caches propagation per op schema, so there only a first sighting propagates: the
    vocabulary (2999, used by no other test) makes the first warm-up step below see new shapes.
    The second run is the reference (cached on 2.13; on 2.11 it propagates too, and the 1 GiB
    bound catches a tracker that counts it)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    from estimation.fake_run import FakeRun

    orig, calls = ShardingPropagator._propagate_tensor_meta_non_cached, []

    def with_stand_in(self, op_schema):
        import torch

        calls.append(1)
        torch.empty(2**28)  # 1 GiB of fp32, freed at once: only a tracker that counts it sees a new peak
        return orig(self, op_schema)

    monkeypatch.setattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", with_stand_in)
    peaks = []
    for _ in range(2):
        calls.clear()
        run = FakeRun(_cfg("--parallelism.data_parallel", "fsdp", "--model.vocab_size", "2999"), 2)
        run.close()
        peaks.append((run.tracker.peak, len(calls)))  # the warm-up step's peak
    (first, n_first), (second, n_second) = peaks
    assert n_first > 0  # shapes were propagated (else this test could not fail)
    assert first == second < 2**28


def test_lazy_chunks_are_fsdps_chunks():
    """FakeRun hands FSDP its chunks of a parameter one at a time, built when read: each is the one
    FSDP's own _chunk_with_empty makes (torch.chunk, padded with empty tensors to one per rank)."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from estimation.standins import LazyChunks

    for rows, ranks in [(5, 4), (3, 8), (8, 3), (7, 7), (32000, 16384), (1, 2)]:
        t = torch.arange(rows * 3.0).view(rows, 3)
        want, got = _chunk_with_empty(t, ranks, 0), LazyChunks(t, ranks, 0)
        assert len(got) == len(want) == ranks
        for i in {0, 1, ranks // 2, ranks - 1}:
            assert got[i].shape == want[i].shape and torch.equal(got[i], want[i]), (rows, ranks, i)
            assert got[i].numel() == 0 or got[i].data_ptr() == want[i].data_ptr()  # a view, as torch.chunk's


@pytest.mark.parametrize("mode", ["fsdp", "hsdp", "zero1", "ddp"])
def test_fake_run_work_does_not_grow_with_the_rank_count(mode):
    """The fake run builds rank 0's shard of each parameter, not every rank's, which grew with the rank
    count (FSDP's chunking made a piece per rank: 16384 ranks took five minutes with fsdp for the debug
    model). Counted, not timed: the torch calls that build and step at the largest count on fake tensors
    are no more than at 8 ranks (torch's rank lists, hsdp's device mesh and zero1's partition, are built
    outside them for every rank: the rank limit bounds those)."""
    from torch.overrides import TorchFunctionMode

    from estimation.fake_run import FakeRun

    class FakeCalls(TorchFunctionMode):
        """Counts torch calls made while a fake-tensor mode is active."""

        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.n += torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
            return func(*args, **(kwargs or {}))

    def calls(world):
        with FakeCalls() as counted:
            run = FakeRun(_cfg("--parallelism.data_parallel", mode, "--parallelism.shard_degree", "8"), world)
            try:
                run.step(2)
            finally:
                run.close()
        return counted.n

    calls(8)  # first-time caches out of the comparison
    small, big = calls(8), calls(MAX_RANKS)
    assert small > 1000 and big <= small, (small, big)


def test_a_rank_count_beyond_the_model_is_refused_in_one_line(tmp_path):
    """--estimate.ngpu 100000 ran on for more than ten minutes after its "building" line; now any count
    up to the largest the dry run models finishes (above), and a larger one is refused at once."""
    assert MAX_RANKS >= 4096  # 512 nodes of 8 GPUs
    p = _cli("--estimate.ngpu", "100000", "--model.flavor", "1.36B", tmp=tmp_path)
    assert p.returncode == 2 and p.stdout == "", p.stderr
    assert p.stderr.splitlines() == [
        f"error: estimate.ngpu must be <= {MAX_RANKS}; got 100000 (the largest count the dry run models within about "
        f"a minute: zero1's partition of the parameters and hsdp's device mesh are built for every rank)"]


def test_largest_batch_search():
    from estimation.estimate import _Fits, largest_batch

    seen = []

    def linear(b):
        seen.append(b)
        return 10 * 2**30 + b * 3 * 2**30

    fits = _Fits(usable_bytes=100 * 2**30, fragmentation=0.0)
    assert largest_batch(linear, fits, start=4, limit=512) == 30  # 10 + 3 * 30 = 100 GiB
    assert 30 in seen and 31 in seen and len(seen) <= 5
    # not linear: a jump at 17 (say, a new buffer); the search still brackets the boundary exactly
    jump = lambda b: (b + (50 if b >= 17 else 0)) * 2**30
    assert largest_batch(jump, _Fits(60 * 2**30, 0.0), start=4, limit=512) == 16
    assert largest_batch(jump, _Fits(0.5 * 2**30, 0.0), start=4, limit=512) == 0
    assert largest_batch(linear, fits, start=4, limit=20) == 20


def test_fit_is_the_usable_memory_and_the_headroom_only_comfort():
    """A peak inside the allocator's headroom still runs (its cache is released and retried before an
    out-of-memory error): it fits and is marked tight; the recommender keeps clear of it."""
    from estimation.estimate import GIB, _Fits, usable_bytes
    from titanlite.hardware import by_key

    fits, keeps = _Fits(100 * GIB, 0.02), _Fits(100 * GIB, 0.02, keep_headroom=True)
    assert fits(99 * GIB) and fits.tight(99 * GIB) and not keeps(99 * GIB)
    assert fits(98 * GIB) and not fits.tight(98 * GIB) and keeps(98 * GIB)
    assert not fits(100 * GIB + 1) and not fits.tight(100 * GIB + 1)
    assert 98 * GIB <= fits.comfortable < 99 * GIB  # the batch search answers clear of the headroom
    h100 = by_key("h100")
    one, eight = usable_bytes(_cfg().estimate, h100, 1), usable_bytes(_cfg().estimate, h100, 8)
    assert 0 < h100.memory_gib * GIB - one < eight < one  # NCCL's buffers come on top with several ranks
    assert usable_bytes(_cfg("--estimate.reserved_gib", "2").estimate, h100, 8) == (h100.memory_gib - 2) * GIB


def test_throughput_model_consistency():
    from estimation.throughput import Assumptions, predict
    from estimation.tracker import Collective, PhaseWork

    a = Assumptions(peak_tflops=1000, hbm_tbps=2.0, link_gbps=100, attention_backend="sdpa_cudnn",
                    attention_efficiency=0.25, gemm_efficiency=0.5, float8_efficiency=0.5, elementwise_efficiency=0.5,
                    fused_efficiency=0.5, optimizer_efficiency=0.5, link_efficiency=1.0, launch_us=0.0)
    coll = [Collective("_allgather_base_", 1e9, tuple(range(8)))] * 4  # 10 ms each at 100 GB/s, inside a node
    work = {"fwd_last": PhaseWork(matmul_flops=5e12, collectives=coll),        # 10 ms of matmul
            "bwd_last": PhaseWork(matmul_flops=10e12, attention_flops=2.5e12, collectives=coll),  # 20 + 10
            "opt": PhaseWork(memory_bytes=10e9)}                                 # 10 ms memory-bound
    p = predict(work, a, accum=1, tokens_per_step=100_000, flops_per_token=1e8, world=8)
    assert p["no_overlap"]["step_ms"] == pytest.approx(10 + 30 + 10 + 80)
    # overlap: 40 ms of compute hides 60 of the 80 ms of collectives; the first and last (20 ms) are exposed
    assert p["overlap"]["step_ms"] == pytest.approx(max(40, 60) + 20 + 10)
    assert p["dominant"] == "comm_exposed"
    o = p["overlap"]
    assert o["tokens_per_sec"] == pytest.approx(100_000 / (o["step_ms"] / 1000))
    assert o["mfu_pct"] == pytest.approx(100 * o["tokens_per_sec"] * 1e8 / (8 * 1000e12))


def test_cannot_fit_is_a_config_error():
    from estimation.estimate import estimate

    cfg = _cfg("--estimate.hardware", "a6000", "--estimate.reserved_gib", "47.5")
    with pytest.raises(ConfigError, match=r"does not fit even at local batch 1: .* GiB > 0\.04 GiB usable of 47\.54 GiB"):
        estimate(cfg, progress=lambda m: None)


def test_advice_never_names_the_configuration_it_refused():
    """llama/8B with an oversized vocabulary on 8 GPUs: the flavors the advice weighs keep this run's
    vocabulary (8B with its own would look smaller than itself), and the refused flavor is not one."""
    from estimation.estimate import estimate, floor_bytes
    from titanlite.models import MODEL_REGISTRY

    cfg = load_config(["--model.flavor", "8B", "--model.vocab_size", "10000000", "--estimate.ngpu", "8"])
    with pytest.raises(ConfigError) as e:
        estimate(cfg, progress=lambda m: None)
    head, advice = str(e.value).split("what could: ")
    assert head.startswith("llama/8B (8 x h100, fsdp) does not fit")
    assert "llama/8B" not in advice and "\n" not in advice
    named = advice.split("a smaller model (llama/")[1].split(" ")[0]
    assert named in MODEL_REGISTRY["llama"].flavors and "with model.vocab_size 10000000" in advice
    assert get_model_args("llama", named, 10_000_000).num_params() < get_model_args("llama", "8B", 10_000_000).num_params()
    own = get_model_args("llama", "8B")  # with its own vocabulary the flavor fits 8 GPUs with fsdp
    assert floor_bytes(own, cfg.training.seq_len, "fsdp", 8) < 78 * 2**30
    assert f"model.vocab_size {own.vocab_size} or less" in advice


def test_allocator_headroom_by_mode():
    """-1 (the default) takes the reserved/allocated headroom measured for the data-parallel mode;
    any other value is used as given."""
    from estimation.estimate import headroom
    from titanlite.parallel.modes import MODES

    assert headroom(-1, "none") == headroom(-1, "ddp") == 0.02 and headroom(-1, "fsdp") == MODES["hsdp"].headroom == 0.15
    assert headroom(0.07, "fsdp") == 0.07 and headroom(0.0, "ddp") == 0.0


def _cli(*args, tmp):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "estimation", *args], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=300)


def test_batch_search_answers_clear_of_the_headroom_and_names_the_tight_batch_above():
    """At the edge of the GPU a batch inside the allocator's headroom ran once and ran out of memory
    once: the search answers the largest batch clear of it, and names the tight one above."""
    from types import SimpleNamespace

    from estimation.estimate import GIB, _Fits, _search

    cfg = SimpleNamespace(training=SimpleNamespace(global_batch_size=-1))
    fits = _Fits(78.59 * GIB, 0.02)
    results = {b: SimpleNamespace(peak_bytes=int(p * GIB)) for b, p in {16: 61.8, 21: 75.6, 22: 78.4}.items()}
    s = _search(results, 21, cfg, 1, fits, {})
    assert s["largest_local_batch"] == 21 and s["tight_local_batch"] == 22
    assert [p["fits"] for p in s["probes"]] == [True, True, False] and s["probes"][2]["tight"]
    results[22] = SimpleNamespace(peak_bytes=int(81 * GIB))  # out of memory outright: nothing tight to name
    assert _search(results, 21, cfg, 1, fits, {})["tight_local_batch"] is None


def test_a_tight_local_batch_1_reads_as_one_sentence_per_line():
    """Where even local batch 1 sits inside the allocator's headroom (LLaMA-3.1-8B at seq 32768 with
    selective checkpointing on 4 x H200), the search's lines say so plainly: no empty figure, no
    "local batch <= 0"."""
    from types import SimpleNamespace

    from estimation.estimate import GIB, _Fits, _search, format_report

    fits = _Fits(138.71 * GIB, 0.15)
    tight = {1: SimpleNamespace(peak_bytes=int(122.45 * GIB))}
    cfg = SimpleNamespace(training=SimpleNamespace(global_batch_size=4))
    report = {**_estimate(), "batch_search": _search(tight, 0, cfg, 4, fits, tight)}
    report["config"]["ngpu"] = 4
    lines = format_report(report).splitlines()
    assert "largest local batch that fits: none clear of the allocator's headroom (probes: 1~; ~ tight, ! does not fit)" \
        in lines
    assert "global batch 4: no local batch fits clear of the allocator's headroom" in lines
    assert not [line for line in lines if "<= 0" in line or "(;" in line]


def test_the_local_batch_for_a_global_batch_is_measured_at_its_own_accumulation():
    """Local batch 2 x accumulation 4 (the search's probes: two micro-steps each), global batch 8, the
    search up to 12: the answer for the global batch is 8, with no accumulation, and its peak is that of
    its own run (one micro-step), not of 8 with accumulation; the configured run's memory and throughput
    stay those of the estimate without the search."""
    from estimation.estimate import estimate

    cfg = ["--training.global_batch_size", "8", "--estimate.max_local_batch", "12", "--compile.enable=false"]
    s = estimate(_cfg(*cfg), progress=lambda m: None)
    b = s["batch_search"]
    assert b["largest_local_batch"] == 12 and b["local_batch_for_global"] == 8 and b["gradient_accumulation_steps"] == 1
    own = _estimate("--training.local_batch_size", "8", "--training.global_batch_size", "8")["memory"]["peak_gib"]
    accumulating = _estimate("--training.local_batch_size", "8", "--training.global_batch_size", "16")
    assert b["peak_gib_for_global"] == own < accumulating["memory"]["peak_gib"]
    assert b["probes_for_global"] == [{"local_batch": 8, "gradient_accumulation_steps": 1, "peak_gib": own, "fits": True}]
    alone = _estimate(*cfg)
    assert (s["memory"], s["throughput"]) == (alone["memory"], alone["throughput"])


def test_cli_unknown_hardware(tmp_path):
    p = _cli("--estimate.hardware", "h1000", tmp=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "error: estimate.hardware 'h1000' is unknown; choose from a100, a100-40gb, a100-80gb, a6000, a800, b200, "
        "gb200, h100, h100-nvl, h100-pcie, h200, h800, l4, l40s"]


def test_cli_table_and_json(tmp_path):
    out = tmp_path / "est.json"
    p = _cli(*BASE, "--estimate.ngpu", "2", "--estimate.hardware", "h100", "--parallelism.data_parallel", "fsdp",
             "--training.global_batch_size", "24", "--estimate.max_local_batch", "16", "--estimate.output", str(out),
             tmp=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "largest local batch that fits: 16" in p.stdout and "dominant:" in p.stdout
    r = json.loads(out.read_text())
    m = r["memory"]
    assert sum(m["at_peak_gib"].values()) == pytest.approx(m["peak_gib"], abs=0.01)
    assert m["allocator_headroom"] == 0.15 and "allocator's 15% headroom" in p.stdout  # fsdp's measured default
    assert r["config"]["gradient_accumulation_steps"] == 6  # 24 / (2 x 2 ranks)
    s = r["batch_search"]
    assert s["local_batch_for_global"] == 12 and s["gradient_accumulation_steps"] == 1  # 12 x 2 = 24
    assert [p["fits"] for p in s["probes"]] == [True] * len(s["probes"])
    t = r["throughput"]
    tokens = 2 * 2 * 6 * 32
    assert t["overlap"]["tokens_per_sec"] == pytest.approx(tokens / (t["overlap"]["step_ms"] / 1000))
    assert t["overlap"]["step_ms"] <= t["no_overlap"]["step_ms"]


@pytest.mark.parametrize("extra", [[], ["--training.bf16_params=false"], ["--compile.enable"]])
def test_gemm_flops_are_the_model_flops(extra):
    """The fake step's GEMM work is 6 x (params without the input embedding) x tokens, whichever path
    computes the weight gradients (bf16 copies with fp32-output GEMMs, autocast, compiled blocks)."""
    from estimation.fake_run import FakeRun

    cfg = _cfg("--parallelism.data_parallel", "ddp", *extra)
    run = FakeRun(cfg, 1)
    try:
        work = run.step(2).work
    finally:
        run.close()
    tokens = 2 * 32
    want = 6 * get_model_args("llama", "debug", 32768).num_params(exclude_embedding=True) * tokens
    assert sum(w.matmul_flops for w in work.values()) == pytest.approx(want, rel=0.01)


@pytest.mark.parametrize("extra", [[], ["--training.bf16_params=false"]])
def test_ddp_all_reduces_each_bucket_beside_the_backward(extra):
    """ddp all-reduces its gradients bucket by bucket, in the layout DDP's reducer rebuilds after the
    first backward (buckets of ddp_bucket_cap_mb in the order gradients become ready: the output head's
    first, the input embedding's last), not as one collective of every gradient at the end of the
    backward: the throughput model hides all of them behind the backward but the last."""
    from estimation.fake_run import FakeRun
    from estimation.throughput import Assumptions, predict

    cfg = _cfg("--parallelism.data_parallel", "ddp", "--parallelism.ddp_bucket_cap_mb", "1", *extra)
    run = FakeRun(cfg, 2)
    try:
        work = run.step(2).work
        params = list(run.model.module.parameters())
    finally:
        run.close()
    colls = [c for w in work.values() for c in w.collectives]
    assert colls == work["bwd_last"].collectives  # every gradient all-reduce in the backward
    assert {name for name, _, _ in colls} == {"allreduce_"} and all(ranks == (0, 1) for _, _, ranks in colls)
    moved = [b for _, b, _ in colls]  # two ranks: a ring all-reduce moves the bucket's bytes once
    n = sum(p.numel() for p in params)
    assert sum(moved) == pytest.approx(4 * n)  # fp32 gradients, each in one bucket
    head, embedding = 4 * params[-1].numel(), 4 * params[0].numel()
    assert params[-1].shape == params[0].shape and head > 2**20  # output head, input embedding: (vocab, dim)
    assert len(moved) >= 4 and moved[0] == head  # the head alone (over the cap), ready first
    assert embedding <= moved[-1] < embedding + 2**20  # the embedding's bucket, ready last
    assert all(b <= 2 * 2**20 for b in moved[1:-1])  # closed once past the cap
    # a slow GPU (seconds of backward) beside a link of 1 GB/s (milliseconds a bucket)
    a = Assumptions(peak_tflops=0.001, hbm_tbps=2.0, link_gbps=1, attention_backend="sdpa_cudnn",
                    attention_efficiency=0.5, gemm_efficiency=0.5, float8_efficiency=0.5, elementwise_efficiency=0.5,
                    fused_efficiency=0.5, optimizer_efficiency=0.5, link_efficiency=1.0, launch_us=0.0)
    terms = predict(work, a, accum=1, tokens_per_step=128, flops_per_token=1.0, world=2)["terms_ms"]
    assert terms["comm_total"] == pytest.approx(1000 * sum(moved) / 1e9)
    assert terms["comm_exposed"] == pytest.approx(1000 * moved[-1] / 1e9)


@pytest.mark.parametrize("extra", [[], ["--float8.enable"]], ids=["fp32_buckets", "float8_bf16_buckets"])
def test_ddp_adds_only_the_gradient_copies_into_its_buckets(monkeypatch, extra):
    """With the default float32 reduce dtype the collective averages each bucket in place in its own
    dtype (fp32, and bf16 for float8's bf16 gradients, as mean_allreduce_hook does), and the bf16
    copies' masters keep their gradients in the buckets, where their GEMMs write them (as the real
    run's weight_grad does): against one GPU, ddp's backward adds one copy per other gradient
    (embeddings, norms, output, float8's matrices) and no other work (no pass over the buckets to
    convert or divide them, no add into a kept gradient); the all-reduce moves the gradients' own bytes."""
    from collections import Counter

    import estimation.tracker as tracker
    from estimation.fake_run import FakeRun

    counted = Counter()  # ops of the backward that move bytes, by name
    orig = tracker.StepTracker._work

    def work(self, func, name, args, kwargs, outs):
        w = self.work[self.phase]
        before = w.memory_bytes
        orig(self, func, name, args, kwargs, outs)
        if self.phase == "bwd_last" and w.memory_bytes > before:
            counted[name] += 1

    monkeypatch.setattr(tracker.StepTracker, "_work", work)
    seen = {}
    for world in (1, 2):
        run = FakeRun(_cfg("--parallelism.data_parallel", "ddp", *extra), world)
        try:
            counted.clear()  # the measured step only, not the warm-up
            work = run.step(2).work
            seen[world] = Counter(counted)
            params = list(run.model.parameters())
            copied = sum(1 for p in params if not run.masters.has_copy(p))
            masters = len(run.masters.copies)
        finally:
            run.close()
    assert masters + copied == len(params) and seen[2] - seen[1] == Counter({"copy_": copied})
    assert not seen[1] - seen[2]
    assert {p.dtype for p in params} == ({torch.float32, torch.bfloat16} if extra else {torch.float32})
    assert masters > 0 if not extra else masters == 0  # float8's matrices keep bf16 weights and gradients
    # two ranks: a ring all-reduce moves each bucket's bytes once
    assert sum(b for w in work.values() for _, b, _ in w.collectives) == sum(p.numel() * p.element_size() for p in params)


def test_fsdp_auto_reshard_follows_the_gpus_memory():
    """fsdp_reshard_after_forward=auto: the blocks keep their gathered parameters until backward where
    those are small beside the GPU's memory (so peak memory grows by about the gathered blocks less the
    local shard) and free them where they are not; the fake run decides with the target GPU's memory."""
    from estimation.fake_run import FakeRun
    from titanlite.parallel.fsdp import KEEP_GATHERED_SHARE, blocks_reshard

    assert blocks_reshard("auto", 10, 16 * 10) is False and blocks_reshard("auto", 11, 16 * 10) is True
    assert blocks_reshard("auto", 10, None) is True  # off CUDA: freed, as before
    assert [blocks_reshard(s, 10, 10**9) for s in ("default", "always", "never")] == [True, True, False]

    # activations dominate the peak here (at BASE's shapes the optimizer step's temporaries do)
    cfg = load_config(["--model.flavor", "debug", "--training.seq_len", "256", "--training.local_batch_size", "8",
                       "--parallelism.data_parallel", "fsdp"])
    peaks = {}
    for memory in (None, 10**12):
        run = FakeRun(cfg, 2, device_memory=memory)
        try:
            peaks[memory] = run.step(8).peak_bytes
            gathered = sum(p.numel() for p in run.model.layers.parameters()) * 2  # all blocks, bf16 (numel is global)
        finally:
            run.close()
    assert gathered < KEEP_GATHERED_SHARE * 10**12
    # kept: at the end of forward every block's gathered parameters are resident, not only the last one's
    assert peaks[10**12] - peaks[None] >= 0.75 * gathered, (peaks, gathered)


@pytest.mark.parametrize("name,transport", [("llama", "reduce_dtype"), ("qwen3", "reduce_dtype"), ("llama", "auto")])
def test_fsdp_reduces_the_head_before_the_embedding(name, transport):
    """fsdp puts the final norm and an untied output layer (llama's debug flavor) in a group of their
    own: its gradients reduce-scatter first in the backward, beside the blocks, and the step's last
    reduce-scatter (the one nothing hides) carries the embedding alone. A tied output (qwen3's debug
    flavor) stays in the root with the embedding, one group holding the shared matrix. The fake run
    records the real run's collectives in order: NCCL's float32 reduce-scatters, or, with the gradient
    transport in bf16 (auto, on a GPU's bf16 compute), all-to-alls of half the bytes."""
    from estimation.fake_run import FakeRun

    cfg = load_config(["--model.name", name, "--model.flavor", "debug", "--training.seq_len", "64",
                       "--parallelism.data_parallel", "fsdp", "--parallelism.fsdp_gradient_transport", transport])
    run = FakeRun(cfg, 2)
    try:
        work = run.step(2).work["bwd_last"].collectives
        a = run.args
    finally:
        run.close()
    op = "reduce_scatter" if transport == "reduce_dtype" else "alltoall"
    rs = [moved for o, moved, _ in work if op in o]
    other = "alltoall" if transport == "reduce_dtype" else "reduce_scatter"
    assert not [o for o, _, _ in work if other in o]  # one kind of gradient reduce
    half = (4 if transport == "reduce_dtype" else 2) / 2  # fp32 (or bf16) gradients, half leave each of 2 ranks
    embedding, head = a.vocab_size * a.dim * half, (a.vocab_size * a.dim + a.dim) * half
    if a.tie_embeddings:
        assert len(rs) == a.n_layers + 1 and rs[-1] == embedding + a.dim * half  # the root: embedding and norm
    else:
        assert len(rs) == a.n_layers + 2 and rs[0] == head and rs[-1] == embedding


@pytest.mark.parametrize("name,flavor,per", [("llama", "1.36B", 3), ("qwen3", "1.8B", 3), ("llama", "8B", 1),
                                               ("llama", "debug", 1)])
def test_fsdp_auto_groups_blocks_of_small_models(name, flavor, per):
    """fsdp_blocks_per_group=0 (auto): enough consecutive blocks for GROUP_MIN_PARAMS a group, at least
    MIN_BLOCK_GROUPS groups; a number is taken as it is, up to every block. The first block is a group of
    its own and every block is in exactly one group, in order."""
    import torch

    from titanlite.models import build_model, get_model_args
    from titanlite.parallel.fsdp import GROUP_MIN_PARAMS, MIN_BLOCK_GROUPS, block_groups, blocks_per_group

    args = get_model_args(name, flavor)
    with torch.device("meta"):
        block = build_model(args).layers["0"]
    params = sum(p.numel() for p in block.parameters())
    assert blocks_per_group(0, params, args.n_layers) == per
    if per > 1:  # the smallest such group
        assert (per - 1) * params < GROUP_MIN_PARAMS <= per * params or args.n_layers // per < MIN_BLOCK_GROUPS
    assert blocks_per_group(2, params, args.n_layers) == 2 and blocks_per_group(99, params, args.n_layers) == args.n_layers
    assert blocks_per_group(0, 1, 12) == 12 // MIN_BLOCK_GROUPS  # tiny blocks: still four groups
    groups = block_groups(args.n_layers, per)
    assert [i for a, b in groups for i in range(a, b)] == list(range(args.n_layers))
    assert groups[0] == (0, 1) and max(b - a for a, b in groups) == per
    assert block_groups(18, 3) == [(0, 1), (1, 4), (4, 7), (7, 10), (10, 13), (13, 16), (16, 18)]
    assert block_groups(2, 5) == [(0, 1), (1, 2)] and block_groups(3, 1) == [(0, 1), (1, 2), (2, 3)]


def test_fsdp_grouped_blocks_gather_once_a_group():
    """Blocks grouped: the fake run (and so the estimate) records one gather for each group of blocks (the
    first block alone, then three a group), and the same bytes in all."""
    from estimation.fake_run import FakeRun

    gathers = {}
    for per in ("1", "3"):
        cfg = load_config(["--model.flavor", "debug", "--training.seq_len", "64", "--parallelism.data_parallel", "fsdp",
                           "--parallelism.fsdp_blocks_per_group", per])
        run = FakeRun(cfg, 2)
        try:
            gathers[per] = [moved for op, moved, _ in run.step(2).work["fwd_last"].collectives if "allgather" in op]
        finally:
            run.close()
    # the debug flavor's four blocks: four groups, or two ([0], [1, 2, 3]); the root and the head's group
    # gather once each in both runs
    assert len(gathers["1"]) - len(gathers["3"]) == 2
    assert sum(gathers["1"]) == pytest.approx(sum(gathers["3"])) and max(gathers["3"]) > max(gathers["1"])


def test_hidden_collectives_slow_the_compute_beside_them():
    """A calibrated share of each hidden collective's time is added to the compute it hides behind (per
    kind: all-reduce, or gather and reduce-scatter); a run with no collective is unchanged, and a zero
    rate gives the plain overlap model."""
    from estimation.throughput import Assumptions, predict
    from estimation.tracker import Collective, PhaseWork

    def work(collectives):
        w = {p: PhaseWork() for p in ("fwd_last", "bwd_last", "opt")}
        for w_ in (w["fwd_last"], w["bwd_last"]):
            w_.matmul_flops = 1e12
        w["bwd_last"].collectives = collectives
        return w

    a = Assumptions(peak_tflops=1000, hbm_tbps=1, link_gbps=100, attention_backend="sdpa", attention_efficiency=1,
                    gemm_efficiency=1, float8_efficiency=1, elementwise_efficiency=1, fused_efficiency=1,
                    optimizer_efficiency=1, link_efficiency=1, launch_us=0,
                    beside_collectives={"all_reduce": 0.5, "sharded": 0.25})
    ring = [Collective("allreduce_", 1e8, (0, 1))] * 3  # 1 ms each on 100 GB/s: the last one stays exposed
    plain = predict(work([]), a, 1, 1000, 1.0, 1)["overlap"]["step_ms"]
    assert plain == pytest.approx(2.0)  # 2 TFLOP at 1000 TFLOP/s
    step = predict(work(ring), a, 1, 1000, 1.0, 2)
    assert step["terms_ms"]["comm_beside"] == pytest.approx(0.5 * 2.0)  # two hidden ms at 0.5
    assert step["overlap"]["step_ms"] == pytest.approx(2.0 + 1.0 + 1.0)  # compute, slowdown, the exposed last
    sharded = predict(work([Collective("_reduce_scatter_base_", 1e8, (0, 1))] * 3), a, 1, 1000, 1.0, 2)
    assert sharded["terms_ms"]["comm_beside"] == pytest.approx(0.25 * 2.0)
    a.beside_collectives = {}
    assert predict(work(ring), a, 1, 1000, 1.0, 2)["overlap"]["step_ms"] == pytest.approx(3.0)


def test_rates_take_the_gpus_own_fit_else_the_entrys_value():
    """A kernel rate fitted on one GPU (stored under its key by `estimation.calibrate --write`) is that
    GPU's; a GPU without its own takes the entry's value; each names the run its rate comes from."""
    from estimation.hardware import get_hardware
    from estimation.throughput import assumptions, load_calibration

    cal = load_calibration()
    cal["rates"]["fused_efficiency"] = {"value": 0.7, "of": "-", "source": "run A", "date": "d",
                                        "h200": {"value": 0.6, "source": "run B", "date": "e"}}
    cal["attention"]["sdpa_cudnn"] = {"value": 0.3, "of": "-", "source": "run C", "date": "d",
                                      "h200": {"value": 0.4, "source": "run D", "date": "e"}}
    est = _cfg().estimate
    h100, h200 = (assumptions(est, get_hardware(g), 1, "sdpa_cudnn", cal) for g in ("h100", "h200"))
    assert (h100.fused_efficiency, h100.sources["fused_efficiency"]) == (0.7, "run A (d)")
    assert (h200.fused_efficiency, h200.sources["fused_efficiency"]) == (0.6, "run B (e)")
    assert (h100.attention_efficiency, h200.attention_efficiency) == (0.3, 0.4)
    assert h200.sources["attention_efficiency"] == "run D (e)"


def test_attention_rate_follows_the_kernel_and_the_sequence_length():
    """An attention entry's rates at several sequence lengths are interpolated in log2 of the run's
    sequence, flat beyond the ends, each named with its run; unpinned `sdpa` takes the rate of the kernel
    torch picks on that GPU (cuDNN's from Hopper on, flash SDPA's before)."""
    from estimation.hardware import get_hardware
    from estimation.throughput import assumptions, load_calibration

    cal = load_calibration()
    cal["attention"]["sdpa_cudnn"] = {"value": 0.3, "at_seq_len": 2048, "of": "-", "source": "run C", "date": "d",
                                      "by_seq_len": {"8192": {"value": 0.5, "source": "run E", "date": "e"}}}
    est, h200 = _cfg().estimate, get_hardware("h200")
    rate = {s: assumptions(est, h200, 1, "sdpa_cudnn", cal, seq_len=s) for s in (0, 512, 2048, 4096, 8192, 32768)}
    assert [rate[s].attention_efficiency for s in (0, 512, 2048)] == [0.3, 0.3, 0.3]
    assert rate[4096].attention_efficiency == pytest.approx(0.4)  # halfway in log2 between 2048 and 8192
    assert rate[8192].attention_efficiency == rate[32768].attention_efficiency == 0.5
    assert rate[8192].sources["attention_efficiency"] == "run E (e)"
    assert "between 2048 (run C (d)) and 8192 (run E (e))" in rate[4096].sources["attention_efficiency"]
    unpinned = assumptions(est, h200, 1, "sdpa", cal, seq_len=8192)
    assert unpinned.attention_efficiency == 0.5
    a100 = assumptions(est, get_hardware("a100"), 1, "sdpa", cal, seq_len=8192)
    assert a100.attention_efficiency == cal["attention"]["sdpa_flash"]["value"]


def test_beside_rates_are_per_gpu_with_the_mean_elsewhere():
    """The compute slowed beside hidden collectives is fitted per GPU: a fitted GPU gets its own rate
    and names its run; another GPU gets the mean of the fits of that kind, and says so."""
    from estimation.hardware import get_hardware
    from estimation.throughput import assumptions, load_calibration

    cal = {"rates": load_calibration()["rates"], "attention": load_calibration()["attention"],
           "beside_collectives": {"all_reduce": {"of": "-", "h100": {"value": 0.1, "source": "run A", "date": "d"},
                                                 "h200": {"value": 0.5, "source": "run B", "date": "d"}}}}
    est = _cfg().estimate
    h100, b200 = (assumptions(est, get_hardware(g), 2, "sdpa", cal) for g in ("h100", "b200"))
    assert h100.beside_collectives == {"all_reduce": 0.1} and h100.sources["beside_all_reduce"] == "run A (d)"
    assert b200.beside_collectives == {"all_reduce": pytest.approx(0.3)}
    assert b200.sources["beside_all_reduce"] == "mean of the fits on h100, h200"


def test_fake_run_refuses_beside_a_live_process_group():
    """A fake run of several ranks starts a fake process group of its own: beside this process's own
    group it refuses in one clear line and leaves that group as it was (it must not replace it)."""
    import torch.distributed as dist

    from conftest import free_port
    from estimation.fake_run import FakeRun

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        with pytest.raises(RuntimeError, match=r"^estimation's fake run of 2 ranks starts a fake process group of "
                                               r"its own, and this process already has a live one"):
            FakeRun(_cfg("--parallelism.data_parallel", "ddp"), 2)
        assert dist.is_initialized() and dist.group.WORLD is group and dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()


def test_stand_ins_are_restored():
    """Every torch function the dry run stands in for (estimation.standins) is torch's own again once a
    fake run is closed, and while each stand-in's context is left."""
    import torch
    import torch._inductor.compile_fx as cfx
    import torch.distributed as dist
    import torch.nn.functional as F
    import torch.nn.init as init
    import torch.nn.parallel.distributed as ddp

    from estimation.fake_run import FakeRun
    from estimation.standins import inductor_without_codegen

    def torch_functions():
        return (F.rms_norm, init.trunc_normal_, dist.Reducer, ddp._verify_param_shape_across_processes,
                cfx.compile_fx)

    before = torch_functions()
    run = FakeRun(_cfg("--parallelism.data_parallel", "ddp"), 2)
    try:
        run.step(1)
    finally:
        run.close()
    assert torch_functions() == before and not dist.is_initialized()
    with inductor_without_codegen(lambda orig, *a, **k: orig(*a, **k)):
        assert cfx.compile_fx is not before[-1]
    assert torch_functions() == before


def test_estimation_imports_no_private_name_of_titanlite():
    """estimation/ reaches titanlite through its public names (the seams: parallelize's wrap=,
    build_optimizer's update=, parallel_dims over a fake process group), never an underscore name."""
    import ast

    private = []
    for path in sorted((ROOT / "estimation").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("titanlite"):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
                private += [f"{path.name}: {node.module}" for part in node.module.split(".") if part.startswith("_")]
            elif isinstance(node, ast.Import):
                private += [f"{path.name}: {a.name}" for a in node.names
                            if a.name.startswith("titanlite") and any(p.startswith("_") for p in a.name.split("."))]
    assert private == []
# ------------------------------------------------------------------------------------ several nodes
def _network_assumptions(**kw):
    from estimation.throughput import Assumptions

    return Assumptions(**{**dict(peak_tflops=1000, hbm_tbps=1, link_gbps=450, attention_backend="sdpa",
                                 attention_efficiency=1, gemm_efficiency=1, float8_efficiency=1, elementwise_efficiency=1,
                                 fused_efficiency=1, optimizer_efficiency=1, link_efficiency=1, launch_us=0,
                                 gpus_per_node=8, network_gbps=50), **kw})


def test_collectives_cross_the_links_their_ranks_span():
    """Inside a node: the GPU's link, no latency. Across nodes: the slower of that link and the NICs of
    the group's ranks on one node, plus the latency of a ring's steps (a tree's where an all-reduce's is
    less): fsdp over 2 x 8 GPUs shares 8 NICs (400 GB/s < NVLink's 450), hsdp's replicate all-reduce
    (one rank a node) has one NIC's 50 GB/s."""
    from estimation.throughput import LATENCY_US, collective_seconds
    from estimation.tracker import Collective

    a, gb = _network_assumptions(), 1e9
    lat = lambda nvlink, network: (LATENCY_US["call"] + nvlink * LATENCY_US["nvlink"]
                                   + network * LATENCY_US["network"]) * 1e-6
    assert collective_seconds(Collective("_allgather_base_", gb, tuple(range(8))), a) == pytest.approx(gb / 450e9)
    assert collective_seconds(Collective("_allgather_base_", gb, tuple(range(8, 16))), a) == pytest.approx(gb / 450e9)
    # 16 ranks on 2 nodes: a ring of 15 steps, one of them over the network
    assert collective_seconds(Collective("_reduce_scatter_base_", gb, tuple(range(16))), a) == pytest.approx(
        gb / 400e9 + lat(14, 1))
    # hsdp's replicate group: rank 0 of each of 2 nodes; ring and tree both cross the network twice
    assert collective_seconds(Collective("allreduce_", gb, (0, 8)), a) == pytest.approx(gb / 50e9 + lat(0, 2))
    # 32 nodes of 8: an all-reduce takes the tree (2 x (7 NVLink + 5 network) steps), not the ring's 2 x 255
    assert collective_seconds(Collective("allreduce_", gb, tuple(range(256))), a) == pytest.approx(
        gb / 400e9 + lat(14, 10))
    assert collective_seconds(Collective("_allgather_base_", gb, tuple(range(256))), a) == pytest.approx(
        gb / 400e9 + lat(224, 31))
    # nodes of 1 GPU (item: two "nodes" on one host): every collective is on the network
    one = _network_assumptions(gpus_per_node=1, network_gbps=5)  # link 450: min(450, 1 x 5)
    assert collective_seconds(Collective("allreduce_", gb, (0, 1)), one) == pytest.approx(gb / 5e9 + lat(0, 2))


def test_hsdp_estimate_shards_inside_the_node_and_all_reduces_across():
    """hsdp over 16 GPUs on nodes of 8: the fake run's launcher record says 8 ranks a host (the training
    run's LOCAL_WORLD_SIZE), from which the trainer's own layout shards inside the node; its gathers and
    reduce-scatters are over the rank's node, its gradient all-reduces over one rank of each node (the
    clip's norm, summed over the shards, stays in the node)."""
    from estimation.fake_run import FakeRun

    cfg = _cfg("--parallelism.data_parallel", "hsdp", "--estimate.ngpu", "16")
    run = FakeRun(cfg, 16)
    try:
        work = run.step(2).work
    finally:
        run.close()
    assert (run.dims.mesh.mesh_dim_names, tuple(run.dims.mesh.shape)) == (("dp_replicate", "dp_shard"), (2, 8))
    groups = {(phase, c.op, c.ranks) for phase, w in work.items() for c in w.collectives}
    node, across = tuple(range(8)), (0, 8)
    assert {(op, ranks) for phase, op, ranks in groups if phase == "bwd_last" and "allreduce" in op} == {
        ("allreduce_", across)}  # the gradient shards, over the replicas
    assert {ranks for phase, op, ranks in groups if "allreduce" not in op} == {node}  # gathers, reduce-scatters
    assert {(op, ranks) for phase, op, ranks in groups if phase == "opt"} == {("allreduce_", node)}  # the norm
    with pytest.raises(ConfigError, match=r"the world size \(12\); with both at -1 hsdp shards over a host's 8 "
                                          r"ranks, which do not divide the world size: set the degrees"):
        FakeRun(_cfg("--parallelism.data_parallel", "hsdp"), 12)  # not whole nodes: no launcher lays it out


def _estimate(*extra):
    from estimation.estimate import estimate

    return estimate(_cfg("--estimate.search=false", "--compile.enable=false", *extra), progress=lambda m: None)


def test_the_network_is_charged_only_above_one_node():
    """fsdp on 2 ranks: on one node the network setting changes nothing; on nodes of one GPU each
    collective runs at the network's bandwidth, so their transfer takes as much longer as the network is
    slower than NVLink (a network half as fast doubles it), plus a latency each."""
    one_node = [_estimate("--estimate.ngpu", "2", "--parallelism.data_parallel", "fsdp", "--estimate.inter_node_gbps",
                          g)["throughput"]["terms_ms"]["comm_total"] for g in ("400", "4")]
    assert one_node[0] == one_node[1]
    two = {g: _estimate("--estimate.ngpu", "2", "--parallelism.data_parallel", "fsdp", "--estimate.gpus_per_node", "1",
                        "--estimate.inter_node_gbps", g) for g in ("80", "40")}
    comm = {g: r["throughput"]["terms_ms"]["comm_total"] for g, r in two.items()}
    transfer = comm["40"] - comm["80"]  # half the bandwidth: the transfer time again; the latency the same
    assert transfer == pytest.approx(one_node[0] * 450 / 10)  # 10 GB/s against NVLink's 450
    assert 0 < comm["80"] - transfer < 0.1 * comm["80"]  # each collective's latency: the debug model's are small
    r = two["80"]
    assert r["config"]["gpus_per_node"] == 1 and r["config"]["inter_node_gbps"] == 80
    assert r["throughput"]["overlap"]["step_ms"] < two["40"]["throughput"]["overlap"]["step_ms"]


def test_recommend_weighs_hsdp_against_fsdp_on_whole_nodes():
    """hsdp is a candidate above one node when the GPUs fill whole nodes, sharded inside the node."""
    from estimation.fake_run import FakeRun
    from estimation.hardware import get_hardware
    from estimation.recommend import Knobs, _config, classes

    h100 = get_hardware("h100")
    modes = lambda world, *extra: {k.mode for k in classes(_cfg(*extra), world, h100)}
    assert modes(8) == {"ddp", "zero1", "fsdp"}
    assert modes(16) == {"ddp", "zero1", "fsdp", "hsdp"}
    assert modes(12) == {"ddp", "zero1", "fsdp"}
    assert modes(12, "--estimate.gpus_per_node", "4") == {"ddp", "zero1", "fsdp", "hsdp"}
    c = _config(_cfg("--estimate.gpus_per_node", "4"), Knobs("hsdp", "none", False, False, False), 1, 1, 12)
    # the degrees are left to the launcher's ranks per host, as the written TOML runs them: a node's 4
    assert (c.parallelism.replicate_degree, c.parallelism.shard_degree) == (-1, -1)
    run = FakeRun(c, 12)
    run.close()
    assert tuple(run.dims.mesh.shape) == (3, 4)


def test_collectives_longer_than_the_compute_slow_only_the_compute_beside_them():
    """On a slow network the collectives outlast the compute they hide behind: only the compute's length
    of them runs beside it, so the slowdown is the rate x that, not x the whole collective time."""
    from estimation.throughput import predict
    from estimation.tracker import Collective, PhaseWork

    a = _network_assumptions(gpus_per_node=1, network_gbps=0.1, beside_collectives={"all_reduce": 0.5})
    work = {p: PhaseWork() for p in ("fwd_last", "bwd_last", "opt")}
    work["fwd_last"].matmul_flops = work["bwd_last"].matmul_flops = 1e12  # 1 ms each at 1000 TFLOP/s
    work["bwd_last"].collectives = [Collective("allreduce_", 1e6, (0, 1))] * 3  # 10 ms each at 0.1 GB/s
    t = predict(work, a, 1, 1000, 1.0, 2)["terms_ms"]
    assert t["comm_total"] > 30 and t["comm_beside"] == pytest.approx(0.5 * 2.0)  # 2 ms of compute beside them


def test_the_estimate_refuses_what_the_trainer_refuses_at_its_world_size():
    """A combination the trainer refuses at estimate.ngpu ranks (CUDA graphs under fsdp) is refused by
    `python -m estimation` in the trainer's one line, exit 2, not estimated; the same at one rank runs."""
    base = [sys.executable, "-m", "estimation", "--training.cuda_graphs", "--parallelism.data_parallel", "fsdp",
            "--estimate.output", os.devnull]
    r = subprocess.run([*base, "--estimate.ngpu", "2"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: training.cuda_graphs with parallelism.data_parallel=fsdp: " + MODES["fsdp"].refuses["training.cuda_graphs"]]
    # one estimate of the configuration (the largest-batch search, whose probes take no part in the check, off)
    r = subprocess.run([*base, "--estimate.ngpu", "1", "--estimate.search=false"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_chunked_loss_gemms_on_fake_cpu_tensors_are_cudas():
    """The chunked loss's weight-gradient GEMMs are titanlite ops whose fake kernels give CUDA's tensors:
    on fake CPU tensors (the dry run's) one op each, the product an fp32 tensor, the add into the
    accumulator in place, and no widened fp32 copy of a bf16 operand (what the CPU's own path makes)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from titanlite.ops.loss import add_fp32_product_, fp32_product

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with FakeTensorMode():
        a, b = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(32, 16, dtype=torch.bfloat16)
        with Ops() as ops:
            acc = fp32_product(a, b)
            add_fp32_product_(acc, a, b)
    assert ops.seen == ["titanlite.fp32_mm.default", "titanlite.fp32_addmm_.default"]
    assert acc.dtype == torch.float32 and acc.shape == (64, 16)
    # the real ops on the CPU: the widened GEMM, the same values as a float64 reference to fp32 rounding
    a, b = torch.randn(64, 32).bfloat16(), torch.randn(32, 16).bfloat16()
    acc = fp32_product(a, b)
    add_fp32_product_(acc, a, b)
    torch.testing.assert_close(acc, 2 * (a.double() @ b.double()).float(), rtol=1e-6, atol=1e-5)


def test_accumulated_ddp_steps_hold_the_bucket_rebuild():
    """Under ddp with accumulation the masters' gradients stay views of DDP's buckets through the second
    step's bucket rebuild (titanlite.parallel.grads.release_grads), so every old bucket lives beside the
    new then: the estimate's peak is at least the model state and the gradients once more (on 4 x H200,
    zero1 at LLaMA 1.36B, local batch 2 x 2: 21.49 GiB measured where the steady step's was 18.78), and a
    step of one micro-step, which keeps no view through the rebuild, is not charged it."""
    from estimation.fake_run import FakeRun

    run = FakeRun(_cfg("--parallelism.data_parallel", "ddp", "--training.mixed_precision_param", "bfloat16"), 2)
    try:
        accumulated, single = run.step(2, micro_steps=2), run.step(2, micro_steps=1)
        grads = sum(p.numel() * p.element_size() for p in run.model.parameters())
    finally:
        run.close()
    assert accumulated.peak_bytes >= sum(accumulated.model_state.values()) + grads
    assert sum(accumulated.breakdown.values()) == accumulated.peak_bytes
    assert single.peak_bytes < sum(single.model_state.values()) + grads


def test_a_replayed_step_launches_nothing_from_the_host():
    """training.cuda_graphs: the estimate prices the step the run replays, as recommend does: the host's
    launches (which bind a small model at local batch 1) go; memory and the GPU's own terms stay."""
    eager = _estimate("--training.local_batch_size", "1")
    graphs = _estimate("--training.local_batch_size", "1", "--training.cuda_graphs")
    te, tg = eager["throughput"]["terms_ms"], graphs["throughput"]["terms_ms"]
    assert te["launch"] > 0 and tg["launch"] == 0
    assert {k: v for k, v in te.items() if k != "launch"} == {k: v for k, v in tg.items() if k != "launch"}
    assert graphs["memory"]["peak_gib"] == eager["memory"]["peak_gib"]
    assert (graphs["throughput"]["overlap"]["step_ms"]
            == pytest.approx(eager["throughput"]["overlap"]["step_ms"] - te["launch"], abs=0.01))


def test_rowwise_float8_throughput_comes_with_its_known_limit():
    """float8's rowwise recipe: the estimate warns that its tokens/s is predicted high (its casts' kernels,
    measured at about 3x the time the model gives them); the tensorwise recipe estimates without a warning."""
    import warnings

    from estimation.estimate import RowwiseFloat8

    with pytest.warns(RowwiseFloat8, match="float8.recipe rowwise: tokens/s predicted about 40% high"):
        r = _estimate("--float8.enable", "--float8.emulate", "--float8.recipe", "rowwise")
    assert r["throughput"]["overlap"]["tokens_per_sec"] > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", RowwiseFloat8)
        _estimate("--float8.enable", "--float8.emulate")


def test_recommend_tries_checkpointing_where_a_batch_that_does_not_fit_would_be_faster():
    """A class that reaches the target batch only through accumulation is measured again with selective
    checkpointing when its own prediction at the larger batch that does not fit beats its best that does
    (a larger micro-batch shares each micro-step's fixed work), and offered at the batches only it holds;
    where every batch fits it is not measured."""
    from estimation.estimate import GIB
    from estimation.fake_run import FakeRun
    from estimation.hardware import auto_attention, get_hardware
    from estimation.recommend import AC_WORTH, Knobs, _config, _peak_on_line, recommend

    args = ("--training.seq_len", "512", "--training.global_batch_size", "16", "--estimate.recommend",
            "--compile.enable=false", "--estimate.recommend_opt_in=false", "--estimate.recommend_top", "20")

    def run(*extra):
        said = []
        best = recommend(_cfg(*args, *extra), progress=said.append)["best"]
        return best, [s for s in said if "peak at local batch 1" in s]

    def screened(knobs):
        """The recommender's line through a class's peaks at local batch 1 and 2: local 8 x 2 and 16 x 1."""
        h100 = get_hardware("h100")
        fake = FakeRun(_config(_cfg(*args), knobs, 1, 16, 1), 1, auto_attention(h100), int(h100.memory_gib * GIB))
        r1, r2 = fake.step(1, micro_steps=2), fake.step(2, micro_steps=2)
        fake.close()
        return _peak_on_line(r1, r2, 8, 2), _peak_on_line(r1, r2, 16, 1)

    plain = Knobs("none", "none", False, True, False)
    roomy, measured = run()
    assert measured and not any("AC" in s for s in measured)  # every batch fits: no class measured again
    by_local = {c.local: c for c in roomy if c.knobs == plain}
    assert by_local[16].tokens_per_sec_per_gpu > (1 + AC_WORTH) * by_local[8].tokens_per_sec_per_gpu
    # a GPU on which the screening line puts 16 x 1 over the headroom without checkpointing and under it with
    # selective checkpointing, and 8 x 2 under it
    at8, at16 = screened(plain)
    _, selective16 = screened(dataclasses.replace(plain, ac="selective"))
    assert max(at8, selective16) < at16
    usable = (max(at8, selective16) + at16) / 2 * (1 + MODES["none"].headroom)
    tight, measured = run("--estimate.reserved_gib", str(get_hardware("h100").memory_gib - usable / GIB))
    assert any("AC selective" in s for s in measured), measured
    assert 16 not in {c.local for c in tight if c.knobs.ac == "none"}
    # checkpointing is offered only at the batch its class cannot hold without it
    assert {c.local for c in tight if c.knobs == dataclasses.replace(plain, ac="selective")} == {16}


def test_recommend_offers_the_whole_share_in_one_micro_step_where_accumulation_does_not_fit(monkeypatch):
    """Accumulation can cost more memory than the larger micro-batch it replaces (fsdp holds the whole
    model's gradients between micro-steps): a class whose local batch 1 fits only without accumulation is
    still searched, and its share in one micro-step offered. The fake step's peaks are set here: 100 GiB
    plus 1 a sequence with accumulation, 10 GiB a sequence without."""
    import estimation.fake_run
    from estimation.estimate import GIB
    from estimation.recommend import recommend

    real = estimation.fake_run.FakeRun

    class Peaks(real):
        def step(self, local_batch, micro_steps=1):
            r = super().step(local_batch, micro_steps=micro_steps)
            alone = 10 * local_batch * GIB
            r.phase_peak = {"fwd_accum": alone, "bwd_accum": alone, "opt": alone}
            r.peak_bytes = (100 + local_batch) * GIB if micro_steps > 1 else alone
            return r

    monkeypatch.setattr(estimation.fake_run, "FakeRun", Peaks)
    said = []
    best = recommend(_cfg("--training.global_batch_size", "4", "--estimate.recommend", "--compile.enable=false",
                          "--estimate.recommend_opt_in=false"), progress=said.append)["best"]
    assert best and {(c.local, c.accum, c.knobs.ac) for c in best} == {(4, 1, "none")}, said
    assert best[0].peak_bytes == 40 * GIB
