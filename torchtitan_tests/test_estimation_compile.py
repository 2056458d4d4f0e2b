"""estimation/ for compiled runs, the fake run's use of TrainStep, the bounded search and --estimate.recommend."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

from titanlite.config import load_config

# debug shapes, seq 64: every graph compiles in seconds on a CPU
DEBUG = ["--model.flavor", "debug", "--training.seq_len", "64", "--training.local_batch_size", "4"]


def _run(cfg, world=1, batch=4, micro_steps=1):
    from estimation.fake_run import FakeRun

    run = FakeRun(cfg, world)
    try:
        return run, run.step(batch, micro_steps)
    finally:
        run.close()


def test_compiled_activations_below_eager():
    """torch.compile's partitioner keeps fewer activations than eager autograd (fused norms, SwiGLU,
    RoPE are recomputed in backward); the rest of the model state is the same."""
    # seq 256 and a small vocabulary: the blocks' activations, not the loss's chunk buffers, dominate
    shapes = DEBUG + ["--training.seq_len", "256", "--model.vocab_size", "256"]
    eager = _run(load_config(shapes))[1]
    compiled = _run(load_config(shapes + ["--compile.enable"]))[1]
    assert compiled.breakdown["activations"] < 0.85 * eager.breakdown["activations"]
    for k in ("params", "optimizer"):
        assert compiled.model_state[k] == eager.model_state[k]


def _forward_graph(block, x, rope):
    """Compile the block through Inductor's entry point with an inner compile that only records the
    graphs; returns the partitioned forward graph."""
    import torch
    import torch._inductor.compile_fx as cfx

    graphs = []

    def inner(gm, example_inputs, **kw):
        graphs.append(gm)
        run = lambda args: torch.fx.Interpreter(gm).boxed_run(args)  # noqa: E731
        run._boxed_call = True
        return run

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=lambda gm, ins: cfx.compile_fx(gm, ins, inner_compile=inner))
    compiled(x, rope)
    torch._dynamo.reset()
    return graphs[0]


def _partition_saved_bytes(block, x, rope):
    """A direct count: the new storages the forward graph returns (the block's output and the tensors
    the partitioner saves for backward), rounded as the tracker rounds them."""
    import torch

    from estimation.tracker import _aligned

    fw = _forward_graph(block, x, rope)
    out = next(n for n in fw.graph.nodes if n.op == "output")
    seen, total = set(), 0
    for node in out.all_input_nodes:
        t = node.meta["val"]
        st = t.untyped_storage()._cdata if not isinstance(t, torch._subclasses.FakeTensor) else id(t)
        if node.op == "placeholder":
            continue  # an input kept for backward (the block's input, a weight) exists already
        if st in seen:
            continue
        seen.add(st)
        total += _aligned(t.numel() * t.element_size())
    return total


def test_generated_kernels_count_each_element_at_most_two_bytes():
    """A generated kernel's traffic follows its elements (measured on H100: an fp32 residual stream's
    kernels take no longer per element than a bf16 one's): a kernel over fp32 costs what the same
    kernel over bf16 does, and a float8 output its one byte an element."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from estimation.compiled import _fused_kernels, materialized

    n = 1024

    def traffic(fn, x):
        graph = make_fx(fn, tracing_mode="fake")(x).graph
        return _fused_kernels(graph, materialized(graph)).kernel_bytes

    def pointwise(x):
        return torch.relu(x * 2.0 + 1.0)

    def to_float8(x):
        return (x * 2.0).to(torch.float8_e4m3fn)

    # one kernel: it reads x and writes the result, two bytes an element whether fp32 or bf16
    assert traffic(pointwise, torch.randn(n)) == traffic(pointwise, torch.randn(n, dtype=torch.bfloat16)) == 2 * n * 2
    assert traffic(to_float8, torch.randn(n, dtype=torch.bfloat16)) == n * 2 + n * 1


def test_compiled_block_keeps_exactly_the_partitioners_saved_tensors():
    """What a compiled block adds to memory across its forward (its output plus what it saves for
    backward) is what Inductor's partitioner returns from the forward graph, byte for byte."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from estimation.compiled import capture_compile
    from estimation.tracker import StepTracker
    from titanlite.models import build_model, get_model_args

    args = get_model_args("llama", "debug")
    with torch.device("meta"):
        model = build_model(args, "sdpa", 64)
    block = model.layers["0"].to_empty(device="cpu")
    x = torch.randn(4, 64, args.dim, requires_grad=True)
    rope = torch.randn(2, 64, args.hdim)
    expected = _partition_saved_bytes(block, x.detach().requires_grad_(), rope)

    fake, tracker = FakeTensorMode(allow_non_fake_inputs=True), StepTracker()
    with capture_compile(), fake, tracker:
        fx_, frope = torch.randn(4, 64, args.dim, requires_grad=True), torch.randn(2, 64, args.hdim)
        block_c = torch.compile(block, fullgraph=True)
        with torch.autocast("cpu", enabled=False):
            before = tracker.live
            out = block_c(fx_, frope)
            grown = tracker.live - before
        del out
    assert expected > 0 and grown == expected


def _wrapper_peak(fn, *inputs):
    """Peak bytes of the buffers Inductor's generated wrapper allocates for `fn` (CPU backend): each
    `empty_strided` adds one, `del` frees it, and `bufB = bufA; del bufA  # reuse` hands one over."""
    import math
    import re

    import torch
    from torch._inductor.utils import run_and_get_code

    from estimation.tracker import _aligned

    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(fn), *inputs)
    torch._dynamo.reset()
    live = peak = 0
    size = {}
    for line in codes[0][codes[0].index("def call("):].splitlines():
        if m := re.match(r"\s*(buf\d+) = empty_strided_\w+\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)", line):
            size[m[1]] = _aligned(math.prod(int(d) for d in m[2].split(",") if d.strip()) * getattr(torch, m[3]).itemsize)
            live += size[m[1]]
            peak = max(peak, live)
        elif m := re.match(r"\s*(buf\d+) = (?:reinterpret_tensor\()?(buf\d+)\b.*del \2\s*# reuse", line):
            size[m[1]] = size.pop(m[2])
        else:
            for name in re.findall(r"del (buf\d+)", line):
                live -= size.pop(name, 0)
    return peak


def _fake_peak(fn, *shapes):
    """The fake run's peak above its inputs for the same compiled function."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from estimation.compiled import capture_compile
    from estimation.tracker import StepTracker

    tracker = StepTracker()
    with capture_compile(), FakeTensorMode(allow_non_fake_inputs=True), tracker:
        inputs = [torch.randn(*s) for s in shapes]
        before = tracker.live
        tracker.reset_peak()
        out = torch.compile(fn)(*inputs)
        peak = tracker.peak - before
        del out
    return peak


def _inlined_reader(x, w):
    g = x @ w
    t = g * 2                   # inlined: each kernel reading t recomputes it from g, so g lives to the last
    u = x @ w.t()
    p, q = torch.sigmoid(u) * t, u * t   # one kernel with two outputs (they share their reads)
    return (p @ w) * (q @ w) + t


def _three_gradients(x, w):
    g, u, d = x @ w, x @ w.t(), x @ (w * 2)
    s = torch.sigmoid(g)  # SwiGLU's recomputed product and its two gradients: one kernel, three outputs
    h, dg, du = g * s * u, d * u * s * (1 + g * (1 - s)), d * g * s
    return h @ w, dg @ w, du @ w


@pytest.mark.parametrize("fn", [_inlined_reader, _three_gradients])
def test_compiled_graph_holds_its_buffers_as_inductors_wrapper_does(fn):
    """Inside a compiled graph the fake run holds memory as the code Inductor generates for it: a
    buffer until the last kernel that reads it (also through an inlined expression), the outputs of
    one fused kernel at once, a dead buffer handed to a later output of its size. Compared with the
    wrapper Inductor writes for the same function on this CPU."""
    expected = _wrapper_peak(fn, torch.randn(64, 64), torch.randn(64, 64))
    assert expected >= 3 * 64 * 64 * 4
    assert _fake_peak(fn, (64, 64), (64, 64)) == expected


def test_fake_run_steps_through_trainstep(monkeypatch):
    """The fake run's step is titanlite.step.TrainStep: its micro-batches, its one clip and one update."""
    import titanlite.step as step

    clips = []
    orig = step.clip_grad_norm
    monkeypatch.setattr(step, "clip_grad_norm", lambda *a, **k: clips.append(1) or orig(*a, **k))
    run, r = _run(load_config(DEBUG + ["--parallelism.data_parallel", "ddp"]), world=2, micro_steps=3)
    assert run.hooks.micro_steps == 1 + 3  # the warm-up step, then three micro-batches
    assert run.hooks.updates == 2 and len(clips) == 2
    assert {"fwd_accum", "bwd_accum", "fwd_last", "bwd_last", "opt"} <= set(r.work)


def _cli(*args, tmp):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "estimation", *args], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=600)


def test_search_is_bounded_and_says_does_not_fit_first(tmp_path):
    """A local batch far beyond the GPU is never run: the answer comes at once, says so before anything
    else, has no throughput, and exits 1 (search on or off)."""
    for search in ("true", "false"):
        p = _cli(*DEBUG, "--training.local_batch_size", "100000000", "--estimate.hardware", "l4",
                 f"--estimate.search={search}", "--estimate.output", str(tmp_path / "e.json"), tmp=tmp_path)
        assert p.returncode == 1, p.stderr
        assert "local batch 100000000:" not in p.stderr  # never probed
        assert "does not fit" in p.stderr.splitlines()[0]
        lines = p.stdout.splitlines()
        assert lines[1].startswith("DOES NOT FIT: local batch 100000000")
        assert "throughput:" not in p.stdout and "tokens/s" not in p.stdout and "MFU" not in p.stdout
        if search == "true":
            assert any(line.startswith("largest local batch that fits:") for line in lines)


def test_recommend_writes_a_toml_that_loads(tmp_path):
    out = tmp_path / "best.toml"
    p = _cli(*DEBUG, "--training.global_batch_size", "8", "--estimate.recommend", "--estimate.recommend_top", "2",
             "--estimate.recommend_output", str(out), "--lr_scheduler.warmup_steps", "2000", tmp=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "[recommend]" in p.stderr and f"best: {out}" in p.stdout
    rows = [line for line in p.stdout.splitlines() if line.lstrip()[:2] in ("1 ", "2 ")]
    assert len(rows) == 2
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    check = subprocess.run([sys.executable, "-m", "titanlite.config.check", "--job.config_file", str(out)],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    cfg = load_config(["--job.config_file", str(out)])
    t = cfg.training
    assert t.global_batch_size == 8 and 8 % t.local_batch_size == 0
    # a schedule that peaks within the run (the 2000-step warm-up asked for is not shorter than the
    # 1000 steps), the one-GPU mode it was ranked with, launched through run_train.sh
    assert cfg.lr_scheduler.warmup_steps == 100 and t.steps == 1000
    assert cfg.parallelism.data_parallel == "none"
    comments = [line for line in out.read_text().splitlines() if line.startswith("#")]
    assert f"# launch: ./run_train.sh --job.config_file {out}" in comments
    assert "# schedule: warm-up 100 of 1000 steps, then cosine decay to 0.1 x the peak lr" in comments


def test_recommended_launch_goes_through_run_train_sh():
    """run_train.sh checks the config and sets the allocator; its NGPU is the processes per node."""
    from estimation.recommend import launch_line

    assert launch_line(1, "b.toml") == "./run_train.sh --job.config_file b.toml"
    assert launch_line(8, "b.toml") == "NGPU=8 ./run_train.sh --job.config_file b.toml"
    assert launch_line(16, "b.toml") == (
        "sbatch --nodes 2 --gpus-per-node 8 scripts/slurm/train.sbatch --job.config_file b.toml; without SLURM, on "
        'each node: NGPU=8 TORCHRUN_ARGS="--nnodes 2 --node-rank R --rdzv-backend c10d --rdzv-endpoint HOST:29500" '
        "./run_train.sh --job.config_file b.toml")
    assert launch_line(16, "b.toml", node=4).startswith("sbatch --nodes 4 --gpus-per-node 4 ")


def test_recommend_target_below_the_configured_local_batch():
    """The recommender chooses the local batch: a target below the file's local batch is no error
    there, as it is for a training run."""
    from titanlite.config import ConfigError

    with pytest.raises(ConfigError, match=r"global_batch_size \(2\) is smaller than training.local_batch_size \(4\)"):
        load_config(DEBUG + ["--training.global_batch_size", "2"])
    assert load_config(DEBUG + ["--training.global_batch_size", "2", "--estimate.recommend"]).training.global_batch_size == 2


@pytest.mark.parametrize("extra,message", [
    (["--estimate.hardware", "h1000"], "error: estimate.hardware 'h1000' is unknown"),
    (["--estimate.target_tokens", "100"], "error: estimate.target_tokens (100) is not a whole number of sequences"),
    (["--estimate.ngpu", "3", "--parallelism.data_parallel", "ddp"], "error: a global batch of 8 sequences cannot be "
                                                                     "split evenly over 3 GPUs"),
    (["--estimate.hardware", "l4", "--estimate.reserved_gib", "22.04"], "error: llama/debug cannot fit on 1 x l4"),
])
def test_recommend_bad_input_is_one_line(tmp_path, extra, message):
    p = _cli(*DEBUG, "--training.global_batch_size", "8", "--estimate.recommend", *extra, tmp=tmp_path)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith(message) and not any("Traceback" in line for line in lines)
    assert not [line for line in lines if not line.startswith(("[recommend]", "error:"))]


def test_a_model_whose_state_cannot_fit_is_refused_before_any_fake_step(tmp_path):
    """LLaMA 8B on one H100: the fp32 parameters, gradients and AdamW moments alone exceed the GPU, so
    recommend and the plain estimate refuse in seconds, without building a fake run, and advise only
    what changes that (more GPUs with a sharded mode, a smaller model), not the checkpointing or
    sequence length that cannot."""
    import time

    preset = [str(ROOT / "train_configs" / "llama_1.36b_1xh100.toml"), "--model.flavor", "8B"]
    t0 = time.perf_counter()
    p = _cli("--job.config_file", *preset, "--training.global_batch_size", "32", "--estimate.recommend", tmp=tmp_path)
    assert time.perf_counter() - t0 < 60
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    err = p.stderr
    assert err.startswith("error: llama/8B cannot fit on 1 x h100") and "Traceback" not in err
    assert "GPUs with fsdp" in err and "a smaller model (llama/1.36B" in err
    assert "seq_len" not in err and "activation_checkpoint" not in err
    p = _cli("--job.config_file", *preset, "--activation_checkpoint.mode", "full", "--estimate.output",
             str(tmp_path / "e.json"), tmp=tmp_path)
    assert p.returncode == 2 and "model state alone" in p.stderr, p.stderr
    assert "local batch 1: peak" not in p.stderr and "activation_checkpoint.mode=full" not in p.stderr
    assert "GPUs with fsdp" in p.stderr


def test_calibrate_divides_each_terms_work_by_its_kernel_time(tmp_path, monkeypatch):
    """estimation.calibrate: rate = predicted work / (profiled kernel time x the GPU's peak)."""
    import json

    from estimation.calibrate import calibrate

    work = {"gemm_flops": 400e12, "float8_flops": 0.0, "attention_flops": 30e12, "elementwise_bytes": 2e9,
            "fused_bytes": 120e9, "optimizer_bytes": 40e9, "kernels": 1000, "comm_bytes": 0.0}
    a = {"attention_backend": "sdpa_cudnn", "link_gbps": 450.0}
    ms = {"gemm": 500.0, "attention": 100.0, "fused": 60.0, "elementwise": 2.0, "optimizer": 20.0}
    results = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "date": "2026-11-24", "cases": {
        "b8": {"ranks": 1, "predicted": {"work": work, "assumptions": a},
               "measured": {"profile_ms_per_step": {"steps": 2, "terms": ms}}}}}
    r = calibrate(results)
    assert r["gemm_efficiency"][0] == pytest.approx(400e12 / (0.5 * 989e12))
    assert r["attention:sdpa_cudnn"][0] == pytest.approx(30e12 / (0.1 * 989e12))
    assert r["fused_efficiency"][0] == pytest.approx(120e9 / (0.06 * 3.35e12))
    assert r["optimizer_efficiency"][0] == pytest.approx(40e9 / (0.02 * 3.35e12))
    assert "link_efficiency" not in r and "float8_efficiency" not in r  # no link, no float8 GEMMs here
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "estimation.calibrate", str(path)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "gemm_efficiency" in p.stdout and "(b8)" in p.stdout
    # --write: an H100's fits become each entry's value (what GPUs without their own take); another GPU's
    # are stored as its own, under its key; --only keeps the named rates; a kernel new to the table gets an entry
    import estimation.calibrate as calibrate_module
    from estimation.throughput import load_calibration

    from titanlite.hardware import lookup

    table = tmp_path / "calibration.json"
    table.write_text(json.dumps(load_calibration()))
    monkeypatch.setattr(calibrate_module, "CALIBRATION", str(table))
    before = load_calibration(str(table))
    b200 = lookup("NVIDIA B200")
    results["device"] = b200.device_name
    a["attention_backend"] = "a_new_kernel"
    path.write_text(json.dumps(results))
    calibrate_module.main([str(path), "--write", "--only", "gemm_efficiency,attention:a_new_kernel"])
    after = load_calibration(str(table))
    assert after["rates"]["gemm_efficiency"]["b200"]["value"] == pytest.approx(400e12 / (0.5 * b200.peak_tflops * 1e12),
                                                                              abs=1e-4)
    assert after["rates"]["gemm_efficiency"]["value"] == before["rates"]["gemm_efficiency"]["value"]
    assert "b200" not in after["rates"]["fused_efficiency"]  # not among --only
    assert after["attention"]["a_new_kernel"]["value"] == pytest.approx(30e12 / (0.1 * b200.peak_tflops * 1e12), abs=1e-4)
    results["device"] = "NVIDIA H100 80GB HBM3"
    path.write_text(json.dumps(results))
    calibrate_module.main([str(path), "--write", "--only", "fused_efficiency"])
    after = load_calibration(str(table))
    assert after["rates"]["fused_efficiency"]["value"] == pytest.approx(120e9 / (0.06 * 3.35e12), abs=1e-4)
    assert "h100" not in after["rates"]["fused_efficiency"] and after["rates"]["fused_efficiency"]["date"] == "2026-11-24"
    with pytest.raises(SystemExit) as e:
        calibrate_module.main([str(path), "--only", "float8_efficiency"])  # no float8 GEMMs were profiled
    assert e.value.code == 2


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compiled_full_checkpointing_saves_nothing_but_the_output(mode):
    """With the default bf16 copies (MasterLinear, a custom autograd.Function) a compiled block under
    full activation checkpointing keeps no activation of its own for backward: the forward graph's
    only new floating-point tensor is the block's output. Under selective 'op' it keeps the matmul
    outputs. (torch 2.11's plain checkpoint lost the recompute tags inside the autograd.Function and
    kept as much as selective does.)"""
    import torch

    from titanlite.config import parallel_settings
    from titanlite.models import build_model, get_model_args
    from titanlite.parallel.apply import apply_ac, apply_bf16_params

    args = get_model_args("llama", "debug")
    model = build_model(args, "sdpa", 64)
    apply_bf16_params(model, "none")
    apply_ac(model, parallel_settings(load_config(["--activation_checkpoint.mode", mode])).activation_checkpoint)
    x = torch.randn(4, 64, args.dim, requires_grad=True)
    fw = _forward_graph(model.layers["0"], x, torch.randn(2, 64, args.hdim))
    out = next(n for n in fw.graph.nodes if n.op == "output")
    new = [n.meta["val"] for n in out.all_input_nodes if n.op != "placeholder" and n.meta["val"].is_floating_point()]
    saved_bytes = sum(t.numel() * t.element_size() for t in new)
    if mode == "full":
        assert [tuple(t.shape) for t in new] == [tuple(x.shape)]
    else:  # q, k, v, attention, o, w1, w3, w2 outputs at least
        assert saved_bytes > 4 * x.numel() * x.element_size()


def test_memory_plan_falls_back_visibly(monkeypatch):
    """memory_plan keeps Inductor's own order where its reordered graph would not hold together, and
    says so: a MemoryPlanFallback warning, which the test suite turns into an error (pyproject.toml)."""
    import torch
    import torch.fx as fx

    import estimation.compiled as compiled

    def graph():
        g = fx.Graph()
        x = g.placeholder("x")
        y = g.call_function(torch.ops.aten.mm.default, (x, x))
        z = g.call_function(torch.ops.aten.relu.default, (y,))
        g.output(z)
        for n in g.nodes:
            n.meta["val"] = torch.empty(4, 4)
        return g

    def misplace(g, groups, mat):  # a reorder gone wrong: a node placed before its input
        nodes = list(g.nodes)
        nodes[1].prepend(nodes[2])
        return {}

    inductors_order = [n.name for n in graph().nodes]
    monkeypatch.setattr(compiled, "_run_groups_together", misplace)
    g = graph()
    with pytest.warns(compiled.MemoryPlanFallback, match="kept a graph's own order"):
        compiled.memory_plan(g, compiled.materialized(g))
    assert [n.name for n in g.nodes] == inductors_order
    g = graph()
    with pytest.raises(compiled.MemoryPlanFallback):  # an error under the tests
        compiled.memory_plan(g, compiled.materialized(g))
