"""The GPU benchmark scripts' CPU parts: the launcher's steady-state rule, run and error handling,
torchtitan's log lines, the tables, and loss_parity's token stream, TensorBoard reading and plot.

The torchtitan samples are its console lines in the format its metrics code prints (0.2.2 and 0.3.0
alike), as run.sh passes them on (colours removed there; one sample keeps them to check the parser).
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, child_env

sys.path.insert(0, str(ROOT / "benchmarks"))
import compare_peer  # noqa: E402
import launch  # noqa: E402
import loss_parity  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_attention", ROOT / "benchmarks" / "attention.py")
bench_attention = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_attention)

PEER_022 = """\
[rank0]:[titanlite] Peak FLOPS used for computing MFU: 9.890e+14
[rank0]:\x1b[31mstep:  1  \x1b[32mloss: 10.87312  \x1b[33mgrad_norm: 11.2345  \x1b[36mmemory: 22.10GiB(23.25%)  \x1b[34mtps: 1,203  \x1b[36mtflops: 8.01  \x1b[35mmfu: 0.81%\x1b[39m
[rank0]:step: 20  loss:  3.51230  grad_norm:  0.8123  memory: 28.80GiB(30.31%)  tps: 53,311  tflops: 355.40  mfu: 44.94%
[rank0]:validate step: 20  loss:  3.6000  memory: 28.80GiB(30.31%)  tps: 99,999
[rank0]:step: 25  loss:  2.98760  grad_norm:  0.5500  memory: 28.79GiB(30.30%)  tps: 53,509  tflops: 356.72  mfu: 45.31%
[rank0]:step: 30  loss:  2.75503  grad_norm:  0.4012  memory: 28.80GiB(30.31%)  tps: 53,407  tflops: 356.04  mfu: 45.12%
"""
PEER_030_NA = "step: 30  loss:  2.75500  grad_norm:  0.4000  memory: 31.12GiB(32.74%)  tps: 46,205  tflops: 308.03  mfu: N/A\n"
PEER_030_FAILED = """\
[rank0]:[titanlite] launch3: torch 2.11 stand-ins installed by tt3_shim: ['torch.distributed.set_timeout']
[rank0]:Traceback (most recent call last):
[rank0]:TypeError: fully_shard() got an unexpected keyword argument 'dp_mesh_dims'
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


# -------------------------------------------------------------------------------- launch.py: reading
def entries(*iters, tps=1000.0, mem=10.0):
    return [{"iter": i, "tokens_per_sec_per_gpu": tps * i, "mfu": 1.0 * i, "time_ms": 100.0 / i,
             "memory_peak_gb": mem + i, "memory_reserved_peak_gb": mem + 2 * i} for i in iters]


def test_benchmarks_use_the_one_steady_rule():
    es = entries(1, 5, 10, 15, 20)
    assert [e["iter"] for e in launch.steady(es, 10)] == [15, 20]
    assert [e["iter"] for e in launch.steady(es, 30)] == [20]  # nothing after skip: the last entry (run_log.steady)
    assert [e["iter"] for e in launch.steady(es[:1], 30)] == [1]


def test_figures_average_the_steady_state_and_take_peaks_over_the_run():
    f = launch.figures(entries(1, 10, 20, 30), 10)
    assert f["tps_gpu"] == pytest.approx(25_000) and f["mfu"] == pytest.approx(25) and f["steps"] == 2
    assert f["mem"] == 40 and f["reserved"] == 70  # peaks include the warm-up entries
    assert launch.figures([], 10) == {}
    assert f["opt_ms"] is None  # a log without the step's breakdown (torchtitan's)
    es = entries(1, 10, 20, 30, 40)
    for e, ms in zip(es, (90.0, 3.0, 5.0, 4.0, 9.0)):
        e["breakdown"] = {"ranks": [{"optimizer_ms": ms}, {"optimizer_ms": 1.0}]}
    assert launch.figures(es, 10)["opt_ms"] == 5.0  # rank 0's median over the steady entries, not the warm-up's


def test_step_losses_place_every_optimizer_step():
    es = [{"iter": 2, "loss": 2.0, "step_losses": [3.0, 2.0]}, {"iter": 4, "loss": 1.0, "step_losses": [1.5, 1.0]},
          {"iter": 5, "loss": 0.5}]
    assert launch.step_losses(es) == {1: 3.0, 2: 2.0, 3: 1.5, 4: 1.0, 5: 0.5}


def test_torchtitan_step_lines_become_run_log_entries():
    es = launch.parse_peer(PEER_022)
    assert [e["iter"] for e in es] == [1, 20, 25, 30]  # the validation line is not a training step
    assert es[0] == {"iter": 1, "loss": 10.87312, "grad_norm": 11.2345, "memory_reserved_peak_gb": 22.10,
                     "tokens_per_sec_per_gpu": 1203.0, "tflops_per_gpu": 8.01, "mfu": 0.81}
    f = launch.figures(es, 15)
    assert f["tps_gpu"] == pytest.approx((53_311 + 53_509 + 53_407) / 3) and f["reserved"] == 28.80
    assert f["mem"] is None  # torchtitan reports reserved memory only
    assert "mfu" not in launch.parse_peer(PEER_030_NA)[0]  # 0.3.0's "N/A" under quantized training


@pytest.mark.parametrize("text,rc,why", [
    (PEER_030_FAILED, 1, "exit 1: TypeError: fully_shard() got an unexpected keyword argument 'dp_mesh_dims'"),
    ("loading\nerror: unknown config key 'training.nope'\n", 2, "exit 2: error: unknown config key 'training.nope'"),
    ("Killed\n", 137, "exit 137: Killed"),
    ("anything", None, "timeout after 30s"),
    ("Traceback\nValueError: bad\n", 0, None),
])
def test_error_line_names_the_cause(text, rc, why):
    assert launch.error_line(text, rc, 30) == why


def test_exception_line_is_a_row_cell_of_one_line():
    """What gemm_ceiling, attention and float8_blocks write for a row that raised: type, first line, cut."""
    assert launch.exception_line(RuntimeError("CUDA error: out of memory\nmore detail")) == \
        "RuntimeError: CUDA error: out of memory"
    assert launch.exception_line(ValueError("x" * 300), 120) == "ValueError: " + "x" * 120
    assert launch.exception_line(ValueError("y" * 300)) == "ValueError: " + "y" * 100
    assert launch.exception_line(KeyError()) == "KeyError: "


def test_peer_run_reports_why_it_failed_though_run_sh_exits_0(tmp_path, monkeypatch):
    script = tmp_path / launch.PEERS["0.3.0"]
    script.parent.mkdir(parents=True)
    script.write_text("")
    monkeypatch.setattr(launch, "ROOT", tmp_path)
    outputs = iter([(0, PEER_030_FAILED, 5.0), (0, PEER_022, 60.0), (0, "wheel install ok\n", 1.0)])
    monkeypatch.setattr(launch, "execute", lambda *a, **k: next(outputs))
    failed = launch.peer("0.3.0", work=tmp_path)
    assert failed.error == "TypeError: fully_shard() got an unexpected keyword argument 'dp_mesh_dims'"
    ok = launch.peer("0.3.0", work=tmp_path)
    assert ok.error is None and len(ok.entries) == 4
    assert launch.peer("0.3.0", work=tmp_path).error == "no step lines in torchtitan's output"
    assert "carry .bench" in launch.peer("0.2.2", work=tmp_path).error  # its run.sh is not there


# A stand-in for torchtitan's launch: torchrun as run.sh starts it (rank-prefixed console, its output through
# run.sh's grep and sed), the program printing torchtitan's start-up and step lines in colour.
FAKE_TORCHTITAN = r"""
print("[titan] 2026-11-26 10:00:02,223 - root - INFO - Building device mesh with parallelism: pp=1, "
      "dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=1, etp=1")
print("[titan] 2026-11-26 10:00:03,873 - root - INFO - CUDA capacity: NVIDIA H100 80GB HBM3 with 79.19GiB memory")
print("[titan] 2026-11-26 10:00:04,020 - root - INFO - Trainer is initialized with local batch size 4, global "
      "batch size 8, gradient accumulation steps 1, sequence length 2048, total steps 10 (warmup 2)")
for step in (1, 5, 10):
    print(f"[titan] 2026-11-26 10:00:1{step % 10},000 - root - INFO - \x1b[31mstep: {step:2}  \x1b[32mloss: 9.00000  "
          "\x1b[38;2;180;60;0mgrad_norm:  1.0000  \x1b[38;2;54;234;195mmemory: 21.54GiB(27.20%)  \x1b[34mtps: 48,978  "
          "\x1b[36mtflops: 408.56  \x1b[35mmfu: 41.31%\x1b[39m")
"""
FAKE_RUN_SH = """NGPU=$1; shift
python3 -m torch.distributed.run --standalone --nproc_per_node=$NGPU --local-ranks-filter 0 --role rank --tee 3 \\
  "$(dirname "$0")/fake_torchtitan.py" 2>&1 | grep -E "step:|Error|Traceback|Peak FLOPS" | sed 's/\\x1b\\[[0-9;]*m//g' | tail -12
"""


def test_peer_keeps_each_ranks_whole_output_and_peer_logs_packs_it(tmp_path, monkeypatch):
    """run.sh passes on step lines only; launch.peer has torchrun keep each rank's whole output
    (PET_LOG_DIR), and peer_logs.py packs both, named for diagnose's fixtures, the whole one read
    without flags."""
    import tarfile

    import peer_logs

    script = tmp_path / launch.PEERS["0.2.2"]
    script.parent.mkdir(parents=True)
    script.write_text(FAKE_RUN_SH)
    (script.parent / "fake_torchtitan.py").write_text(FAKE_TORCHTITAN)
    monkeypatch.setattr(launch, "ROOT", tmp_path)
    work = tmp_path / "work"
    r = launch.peer("0.2.2", 1, ["--training.steps", "10"], timeout=120, work=work)
    assert r.error is None and [e["iter"] for e in r.entries] == [1, 5, 10], r.output
    assert "Building device mesh" not in r.output and "[rank0]:" in r.output  # what run.sh passes on
    assert "\x1b" not in r.output
    whole = launch.peer_ranks_output(r.name, 0, work).read_text()
    assert "Building device mesh" in whole and "\x1b[31mstep:" in whole  # torchtitan's own, colours kept
    assert peer_logs.main(["--out", str(tmp_path / "out"), "--work", str(work)]) == 0
    with tarfile.open(tmp_path / "out" / "torchtitan_logs.tar.gz") as tar:
        tar.extractall(tmp_path / "fixtures", filter="data")
        assert sorted(tar.getnames()) == ["real_0.2.2_1gpu_fsdp.rank0.log", "real_0.2.2_1gpu_fsdp.runsh.log"]
    from titanlite.diagnose.readers import read

    log = read(tmp_path / "fixtures" / "real_0.2.2_1gpu_fsdp.rank0.log")
    assert log.config["world_size"] == 2 and log.config["data_parallel"] == "fsdp"  # the stand-in's mesh line
    assert peer_logs.fixture_stem(launch.peer("0.3.0", 2, compare_peer.PEER_MODES["ddp"](2), work=work).name) \
        == "real_0.3.0_2gpu_ddp"  # (no 0.3.0 here: the name is all this checks)


def test_bench_env_turns_multicast_off_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:native")
    env = launch.bench_env()
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["PYTORCH_ALLOC_CONF"] == "backend:native"
    assert launch.command(1, ["-m", "x"])[1:] == ["-m", "x"]
    assert "--nproc-per-node=4" in launch.command(4, ["-m", "x"])


def test_timeout_ends_the_run_and_everything_it_started(tmp_path):
    rc, text, wall = launch.execute("sleeper", ["bash", "-c", "sleep 60 & echo $!; sleep 60 & echo $!; wait"], 2,
                                    work=tmp_path)
    assert rc is None and wall < 30
    for pid in map(int, text.split()):
        state = Path(f"/proc/{pid}/stat")
        assert not state.exists() or state.read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.fixture(autouse=True)
def signal_handlers_as_they_were():
    """launch.execute makes SIGTERM, SIGHUP and SIGINT end its runs first (end_runs_on_signals): pytest's
    process gets its handlers back after each test."""
    saved = {sig: signal.getsignal(sig) for sig in launch._ENDING_SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


SIGNALLED = """import pathlib, signal, sys, threading
signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive shell starts it, whatever ours did
sys.path.insert(0, {bench!r})
import launch
work = pathlib.Path({work!r})
run = ['bash', '-c', 'setsid sleep 60 & echo $!; sleep 60 & echo $!; wait']
if {threads}:  # rows in a pool, as gpu_matrix runs them: one at a time, each its own sleepers
    launch.end_runs_on_signals()
    import concurrent.futures as futures
    with futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: launch.execute(f'run{{i:02d}}', run, 120, work=work), range(12)))
else:
    launch.execute('run00', run, 120, work=work)
"""


def _pids_in(work: Path) -> list[int]:
    return [int(line) for log in sorted(work.glob("run*.log")) for line in log.read_text().splitlines(True)
            if line.endswith("\n") and line.strip().isdigit()]


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_that_ends_a_benchmark_script_ends_its_runs_first(tmp_path, sig, threads):
    """A `timeout` (SIGTERM) or Ctrl-C (SIGINT) around a script that runs through execute, from its main thread
    or from a pool's, ends the runs it started and what they started in a session of their own (as torchrun's
    workers are), and no run starts after it, instead of leaving them on the GPUs under the next call's runs."""
    script = tmp_path / "script.py"
    script.write_text(SIGNALLED.format(bench=str(ROOT / "benchmarks"), work=str(tmp_path), threads=threads))
    p = subprocess.Popen([sys.executable, str(script)], env=child_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        deadline = time.time() + 60
        while len(pids := _pids_in(tmp_path)) < (8 if threads else 2) and time.time() < deadline:
            time.sleep(0.1)
        t0 = time.time()
        p.send_signal(sig)
        assert p.wait(timeout=90) == -sig and time.time() - t0 < 30  # at once, then the signal's own end
        time.sleep(1)
        pids = _pids_in(tmp_path)  # with those of any run a row's thread started meanwhile
        for pid in pids:
            state = Path(f"/proc/{pid}/stat")
            assert not state.exists() or state.read_text().rsplit(")", 1)[1].split()[0] == "Z"
        assert len(list(tmp_path.glob("run*.log"))) < (12 if threads else 2)  # the rows after it did not start
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if p.poll() is None:
            p.kill()


def test_timed_output_says_when_each_line_came_and_still_times_out(tmp_path):
    """execute(timed=True), what memory_fit times the memory check's line and the first step by: each line
    with the seconds since the start; the timeout still ends the run and what it started."""
    rc, text, _ = launch.execute("stamps", ["bash", "-c", "echo a; sleep 1.5; echo b"], 30, work=tmp_path, timed=True)
    (ta, a), (tb, b) = launch.timed_lines(text)
    assert rc == 0 and (a, b) == ("a", "b") and ta < 1.0 <= 1.4 <= tb - ta < 10
    assert (tmp_path / "stamps.log").read_text() == text
    rc, text, wall = launch.execute("stamped_sleeper", ["bash", "-c", "sleep 60 & echo $!; wait"], 2,
                                    work=tmp_path, timed=True)
    assert rc is None and wall < 30 and [line for _, line in launch.timed_lines(text)][-1].isdigit()


def test_launch_runs_titanlite_reads_its_log_and_names_a_bad_option(tmp_path):
    base = ["--model.name", "llama", "--model.flavor", "debug", "--training.dataset", "synthetic",
            "--training.local_batch_size", "2", "--training.seq_len", "32", "--validation.enable=false",
            "--metrics.progress_bar=false", "--data.num_workers", "0"]
    r = launch.titanlite("tiny", [], 1, 4, 2, 300, work=tmp_path, base=base)
    assert r.error is None and r.rc == 0 and [e["iter"] for e in r.entries] == [1, 2, 4]
    log = json.loads(next((tmp_path / "tiny").glob("run_*.json")).read_text())
    assert r.figures(2)["tps_gpu"] == log["training_iterations"][-1]["tokens_per_sec_per_gpu"]
    assert sorted(launch.step_losses(r.entries)) == [1, 2, 3, 4]
    bad = launch.titanlite("bad", ["--training.nope", "1"], 1, 4, 2, 300, work=tmp_path, base=base)
    assert bad.error.startswith("exit 2: error: unknown config key 'training.nope'") and not bad.entries


# ---------------------------------------------------------------------------------- compare_peer.py
def test_configurations_keep_only_and_add_each_extra_variant():
    rows = compare_peer.configurations(["single"], {"compile"}, ["--model.attention_backend flash_attn_4", "--a.b"])
    assert [n for n, _ in rows] == ["compile", "compile +model.attention_backend flash_attn_4", "compile +a.b"]
    assert rows[1][1] == ["--compile.enable", "--model.attention_backend", "flash_attn_4"]
    assert compare_peer.dp_mode(compare_peer.SUITES["knobs"]["ddp autocast"]) == "ddp"
    assert compare_peer.dp_mode(compare_peer.SUITES["single"]["compile"]) == "fsdp"


def test_peer_flag_runs_every_torchtitan_version_and_bad_input_is_one_line(capsys):
    assert compare_peer.parse_args(["--peer"]).versions == list(launch.PEERS) == ["0.2.2", "0.3.0"]
    assert compare_peer.parse_args(["--peers", "0.3.0", "--only", "compile"]).versions == ["0.3.0"]
    assert compare_peer.parse_args(["--peers", "0.3.0", "--peers-only"]).rows == []  # a peer's one-GPU rows alone
    for bad in (["--peers", "0.4.0"], ["--suite", "best"], ["--only", "nope"], ["--ngpus", "x"],
                ["--baseline", "/no/such/compare_peer.json"], ["--peers-only"]):
        with pytest.raises(SystemExit) as e:
            compare_peer.parse_args(bad)
        assert e.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def result(name, es, error=None, ngpus=1, backend=None):
    r = launch.Result(name, ngpus, [], 0, 1.0, error, es)
    if backend:
        r.startup = {"config": {"attention_backend": backend}}
    return r


def md_tables(text: str) -> list[list[dict[str, str]]]:
    """The markdown tables in `text`, each a list of rows keyed by the header's cells."""
    tables, rows = [], None
    for line in text.splitlines() + [""]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            if rows:
                tables.append(rows[1:])
            rows = None
        elif rows is None:
            rows, head = [cells], cells
        elif not set("".join(cells)) <= set("-:"):
            rows.append(dict(zip(head, cells)))
    return tables


def test_table_gives_each_titanlite_row_its_ratio_to_each_version():
    tt2 = result("tt2", entries(20, 30, tps=1000.0))
    tt3 = result("tt3", [], error="TypeError: fully_shard() got an unexpected keyword argument 'dp_mesh_dims'")
    ours = result("ours", entries(20, 30, tps=1100.0), backend="sdpa_cudnn")
    rows = [("torchtitan 0.2.2", tt2, {}), ("torchtitan 0.3.0", tt3, {}),
            ("compile", ours, {"0.2.2": tt2, "0.3.0": tt3})]
    by_config = {r["config"]: r for r in md_tables(compare_peer.table(rows, ["0.2.2", "0.3.0"], 15))[0]}
    mine = by_config["compile"]
    assert float(mine["vs 0.2.2"]) == pytest.approx(1100 / 1000, abs=1e-3)
    assert mine["vs 0.3.0"] == "-" and mine["note"] == "sdpa_cudnn"  # the failed version has no ratio
    assert "dp_mesh_dims" in by_config["torchtitan 0.3.0"]["note"]


def rates_after_warmup(*tps):
    """Log entries every 5 steps from step 10 (warm-up, slow) on, whose steady tokens/s per GPU are `tps`."""
    return [{"iter": 10, "tokens_per_sec_per_gpu": 1.0}] + \
        [{"iter": 15 + 5 * i, "tokens_per_sec_per_gpu": v} for i, v in enumerate(tps)]


def test_weak_scaling_is_against_the_same_librarys_one_gpu_runs_and_each_row_shows_its_spread(tmp_path):
    """"of 1 GPU": a run on several GPUs over the mean of its library's one-GPU runs of the same configuration
    (its data-parallel mode and run length aside), this call's and --baseline's; "spread %": the inter-quartile
    range of the steady log steps over their mean."""
    def ours(name, n, *opts, tps):
        launcher = ["python3", "-m", "torch.distributed.run", f"--nproc-per-node={n}"] if n > 1 else ["python3"]
        return launch.Result(name, n, [*launcher, "-m", "titanlite.train", "--compile.enable", *opts,
                                       "--training.steps", "30", "--job.dump_folder", f"/tmp/{name}"],
                             0, 1.0, None, rates_after_warmup(*tps))

    on_gpu0 = ours("compile_1gpu", 1, tps=[100.0] * 4)
    launch.save(tmp_path / "gpu1", "compare_peer", "", [ours("compile_1gpu", 1, tps=[110.0] * 4)])
    peer1 = launch.Result("torchtitan_0.3.0_1gpu_--training.steps_30", 1, [], 0, 1.0, None, rates_after_warmup(50.0))
    peer4 = launch.Result("torchtitan_0.3.0_4gpu_--parallelism.data_parallel_replicate_degree_4", 4, [], 0, 1.0, None,
                          rates_after_warmup(40.0, 45.0, 50.0, 45.0))
    ddp = ours("ddp_4gpu", 4, "--parallelism.data_parallel", "ddp", tps=[94.5] * 4)
    float8 = ours("f8_4gpu", 4, "--parallelism.data_parallel=ddp", "--float8.enable", tps=[99.0] * 4)
    # no parallelism option reaches one GPU: a knob's row (with a value, or a bare flag) has the same one-GPU rate
    knob = ours("fsdp_knob_4gpu", 4, "--parallelism.data_parallel", "fsdp", "--parallelism.fsdp_gradient_transport",
                "reduce_dtype", "--parallelism.ddp_bucket_view", tps=[94.5] * 4)
    a = compare_peer.parse_args(["--baseline", str(tmp_path / "gpu1" / "compare_peer.json")])
    rows = [("torchtitan 0.3.0", peer1, {}), ("compile", on_gpu0, {"0.3.0": peer1}),
            ("torchtitan 0.3.0 ddp", peer4, {}), ("ddp", ddp, {"0.3.0": peer4}), ("float8", float8, {"0.3.0": peer4}),
            ("fsdp knob", knob, {})]
    by_config = {r["config"]: r for r in md_tables(compare_peer.table(rows, ["0.3.0"], 10, a.baseline_runs))[0]}
    assert by_config["ddp"]["of 1 GPU"] == by_config["fsdp knob"]["of 1 GPU"] == "90.0%"  # 94.5 over (100 + 110) / 2
    assert by_config["torchtitan 0.3.0 ddp"]["of 1 GPU"] == "90.0%"  # 45 over its own version's 50
    assert by_config["float8"]["of 1 GPU"] == "-"  # no one-GPU run of that configuration
    assert by_config["compile"]["of 1 GPU"] == "-" and float(by_config["compile"]["vs 0.3.0"]) == 2.0
    assert float(by_config["ddp"]["spread %"]) == 0.0
    assert float(by_config["torchtitan 0.3.0 ddp"]["spread %"]) == pytest.approx(100 * 2.5 / 45, abs=0.05)


# ---------------------------------------------------------------------------------- attention.py
def test_attention_shapes_come_from_the_models_and_flops_count_the_causal_half():
    assert bench_attention.shape("llama 1.36B b8") == (8, 18, 18, 2048, 128)
    assert bench_attention.shape("qwen3 1.8B b4") == (4, 16, 8, 2048, 128)
    b, h, s, d = 4, 18, 2048, 128
    forward = 2 * (2 * b * h * s * s * d) / 2  # QK^T and PV, 2 FLOPs per multiply-add, half the square
    assert bench_attention.causal_flops(b, h, s, d) == pytest.approx(forward * 3.5)


def test_attention_table_relative_to_cudnn_and_failed_rows():
    dims = (4, 18, 18, 2048, 128)
    rows = [{"shape": "llama 1.36B b4", "dims": dims, "backend": "sdpa_cudnn", "ms": 10.0, "tflops": 300.0, "first_s": 1.0},
            {"shape": "llama 1.36B b4", "dims": dims, "backend": "flash_attn_4", "ms": 9.0, "tflops": 330.0,
             "first_s": 20.0},
            {"shape": "llama 1.36B b4", "dims": dims, "backend": "sdpa_flash", "error": "RuntimeError: no kernel"}]
    by_backend = {r["backend"]: r for r in md_tables(bench_attention.table(rows, {"llama 1.36B b4": "sdpa_cudnn",
                                                                                  "llama 8B b2": "flash_attn_4"}))[0]}
    assert set(by_backend) == {"sdpa_cudnn (auto)", "flash_attn_4", "sdpa_flash"}  # auto is named at its shape
    assert float(by_backend["sdpa_cudnn (auto)"]["vs sdpa_cudnn"]) == 1.0
    flash = by_backend["flash_attn_4"]
    assert float(flash["vs sdpa_cudnn"]) == pytest.approx(330 / 300, abs=1e-3)
    assert float(flash["ms fwd+bwd"]) == 9.0 and float(flash["first s"]) == 20.0
    assert by_backend["sdpa_flash"]["note"] == "RuntimeError: no kernel" and by_backend["sdpa_flash"]["TFLOP/s"] == "-"


# ---------------------------------------------------------------------------------- loss_parity.py
@pytest.fixture
def peer_assets(tmp_path):
    """A tokenizer folder like torchtitan's test asset (BOS/EOS named in tokenizer_config.json but not in
    tokenizer.json's vocabulary) and a c4_test-style data.json."""
    from titanlite.data.tokenizer import train_bpe

    docs = ["The quick brown fox jumps over the lazy dog.", "Lorem ipsum dolor sit amet, <unk> consectetur.",
            "A third document, with numbers 12345 and  spaces."]
    assets = tmp_path / "assets"
    (assets / "tokenizer").mkdir(parents=True)
    (assets / "c4_test").mkdir()
    train_bpe(docs * 20, 300, assets / "tokenizer" / "tokenizer.json")
    tok = json.loads((assets / "tokenizer" / "tokenizer.json").read_text())
    tok["added_tokens"] = []  # as in torchtitan's asset: the specials live only in tokenizer_config.json
    (assets / "tokenizer" / "tokenizer.json").write_text(json.dumps(tok))
    cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>",
           "added_tokens_decoder": {"128000": {"content": "<|begin_of_text|>", "special": True},
                                    "128001": {"content": "<|end_of_text|>", "special": True},
                                    "2001": {"content": "<|pad|>", "special": True}}}
    (assets / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(cfg))
    (assets / "c4_test" / "data.json").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return assets, docs


def test_prepared_text_is_torchtitans_token_stream(tmp_path, peer_assets):
    """prepare's shards hold, per document in file order, BOS + the plain tokenizer's ids + EOS, with
    BOS and EOS at the next free ids, as torchtitan's loader builds its stream."""
    from tokenizers import Tokenizer

    assets, docs = peer_assets
    folder, meta = loss_parity.prepare(tmp_path / "work", assets)
    plain = Tokenizer.from_file(str(assets / "tokenizer" / "tokenizer.json"))
    v = plain.get_vocab_size()
    bos, eos = v, v + 1  # new special tokens take the next free ids, in torchtitan's order: BOS, EOS, PAD
    expected = [t for d in docs for t in [bos, *plain.encode(d).ids, eos]]
    got = np.fromfile(folder / meta["splits"]["train"]["shards"][0]["file"], dtype=meta["dtype"]).tolist()
    assert got == expected
    assert meta["eos_id"] == eos and meta["splits"]["val"]["tokens"] == 0


def test_both_sides_get_the_same_optimizer_and_schedule_settings(tmp_path):
    from titanlite.config import load_config

    cfg = load_config(loss_parity.titanlite_options(tmp_path, 300, 10, 3e-4) + ["--training.steps", "300"])
    peer = loss_parity.peer_options(300, 10, 3e-4, tmp_path)
    assert cfg.optimizer.lr == float(peer[peer.index("--optimizer.lr") + 1]) == 3e-4
    assert cfg.lr_scheduler.warmup_steps == int(peer[peer.index("--lr_scheduler.warmup_steps") + 1]) == 10
    assert (cfg.lr_scheduler.decay_type, cfg.lr_scheduler.min_lr_factor) == ("linear", 0.0)  # torchtitan's default
    assert (cfg.optimizer.beta1, cfg.optimizer.beta2, cfg.optimizer.eps, cfg.optimizer.weight_decay) == (0.9, 0.95, 1e-8, 0.1)
    assert cfg.model.vocab_size == 32000 and cfg.data.shuffle is False and cfg.training.local_batch_size == 4


def test_tensorboard_losses_read_torchtitans_tag(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path / "tb" / "20261123-1200"))
    for step in range(1, 6):
        w.add_scalar("loss_metrics/global_avg_loss", 10.0 / step, step)
        w.add_scalar("grad_norm", 1.0, step)
    w.close()
    got = loss_parity.tensorboard_losses(tmp_path)
    assert list(got) == [1, 2, 3, 4, 5]
    assert got[4] == pytest.approx(2.5)


def test_report_and_plot_with_made_up_curves(tmp_path):
    tt = {s: 3.0 + 7.0 / s for s in range(1, 301)}
    ours = {s: 1.01 * v for s, v in tt.items()}
    runs, windows = md_tables(loss_parity.report({"torchtitan 0.2.2": tt, "titanlite": ours}, {}, 300,
                                                 {"titanlite": 232}))
    by_run = {r["run"]: r for r in runs}
    last = f"mean loss, last {loss_parity.LAST} steps"
    mean_tt = sum(tt[s] for s in range(301 - loss_parity.LAST, 301)) / loss_parity.LAST
    assert by_run["torchtitan 0.2.2"]["steps logged"] == "300"
    assert float(by_run["torchtitan 0.2.2"][last]) == pytest.approx(mean_tt, abs=1e-4)
    assert float(by_run["torchtitan 0.2.2"]["final loss"]) == pytest.approx(tt[300], abs=1e-4)
    assert float(by_run["titanlite / torchtitan"][last].split()[0]) == pytest.approx(1.01, abs=1e-4)
    assert [w["steps"] for w in windows][-1] == f"{301 - loss_parity.LAST}-300"  # windows reach the last step
    assert float(windows[0]["titanlite"]) == pytest.approx(1.01 * float(windows[0]["torchtitan 0.2.2"]), rel=1e-3)
    failed = md_tables(loss_parity.report({"torchtitan 0.2.2": {}, "titanlite": ours},
                                          {"torchtitan 0.2.2": "exit 1: OOM"}, 300, {}))[0]
    assert {r["run"]: r["note"] for r in failed} == {"torchtitan 0.2.2": "exit 1: OOM", "titanlite": ""}
    loss_parity.plot({"torchtitan 0.2.2": tt, "titanlite": ours}, tmp_path / "curves.png", {"titanlite": 232})
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------- other scripts
def test_stream_profile_bad_gpu_count_is_one_line():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stream_profile.py"), "--ngpus", "x"],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "stream_profile: --ngpus takes a positive integer"


def test_accum_numerics_decides_inside_the_spread_per_seed():
    import accum_numerics

    default, autocast = list(accum_numerics.PATHS)
    train = {default: {1: 2.5, 2: 2.6}, autocast: {1: 9.1, 2: 9.2}}  # shown, never decides
    inside = accum_numerics.report({default: {1: 1.24, 2: 1.25}, autocast: {1: 1.23, 2: 1.26}}, train, {}, "h")
    assert "spread: yes" in inside and "1.2300 - 1.2600" in inside and "9.1000 - 9.2000" in inside
    outside = accum_numerics.report({default: {1: 1.24, 2: 1.27}, autocast: {1: 1.23, 2: 1.26}}, train, {}, "h")
    assert "spread: NO;" in outside and "above autocast's highest: YES" in outside and "+0.0100, +0.0100" in outside
    below = accum_numerics.report({default: {1: 1.22, 2: 1.24}, autocast: {1: 1.23, 2: 1.26}}, train, {}, "h")
    assert "spread: NO (1 of 2 below it)" in below and "above autocast's highest: NO" in below
    failed = accum_numerics.report({default: {1: 1.24, 2: None}, autocast: {1: 1.23, 2: 1.26}}, train,
                                   {default: "seed 2: exit 1"}, "h")
    assert "not decided" in failed and "seed 2: exit 1" in failed


def test_accum_numerics_weighs_the_paired_differences_against_their_standard_error():
    import accum_numerics

    # differences 0.002, 0.004, 0.003, 0.005: mean 0.0035, standard error 0.000645
    higher = accum_numerics.paired([0.002, 0.004, 0.003, 0.005])
    assert "mean +0.0035, standard error 0.0006 over 4 seeds (the default higher" in higher
    assert "the default lower" in accum_numerics.paired([-0.002, -0.004, -0.003, -0.005])
    assert "not distinguishable" in accum_numerics.paired([0.010, -0.008, 0.004])
    default, autocast = list(accum_numerics.PATHS)
    text = accum_numerics.report({default: {1: 1.24, 2: 1.27}, autocast: {1: 1.23, 2: 1.25}}, {}, {}, "h")
    assert "mean +0.0150, standard error 0.0050 over 2 seeds (the default higher" in text


def _numerics_folder(folder: Path, head: str, finals: dict, trains: dict) -> Path:
    """An --out folder written as accum_numerics.main writes it (launch.save: the report, the JSON)."""
    launch.save(folder, "accum_numerics", head + "\n\nFinal loss ...", [], {"finals": finals, "train_last": trains})
    return folder


def test_accum_numerics_combines_the_seeds_of_several_calls(tmp_path):
    import accum_numerics

    default, autocast = list(accum_numerics.PATHS)
    one = _numerics_folder(tmp_path / "one", "setup A", {default: {1: 1.30, 2: 1.31}, autocast: {1: 1.29, 2: 1.32}},
                           {default: {1: 1.1, 2: 1.2}, autocast: {1: 1.1, 2: 1.2}})
    two = _numerics_folder(tmp_path / "two", "setup A", {default: {3: 1.33}, autocast: {3: 1.28}},
                           {default: {3: 1.3}, autocast: {3: 1.4}})
    text = accum_numerics.combine([one, two])
    assert text.startswith("setup A (combined from 2 runs")
    assert "| seed 1 | seed 2 | seed 3 |" in text and "1.2800 - 1.3200" in text
    assert "+0.0100, -0.0100, +0.0500" in text and "over 3 seeds" in text
    other = _numerics_folder(tmp_path / "other", "setup B", {default: {4: 1.3}, autocast: {4: 1.3}},
                             {default: {4: 1.3}, autocast: {4: 1.3}})
    with pytest.raises(ValueError, match="different setups"):
        accum_numerics.combine([one, other])
    with pytest.raises(ValueError, match="seed 3 is in more than one"):
        accum_numerics.combine([one, two, two])


def test_accum_numerics_starts_no_more_processes_than_the_cores_feed():
    from accum_numerics import runs_at_once

    assert runs_at_once(18, 2, 32) == 12  # 36 processes on 32 cores: most runs timed out
    assert runs_at_once(12, 2, 32) == 12 and runs_at_once(6, 2, 16) == 6 and runs_at_once(12, 1, 16) == 12
    assert runs_at_once(5, 1, 64) == 5  # never more than asked
    assert runs_at_once(6, 2, 2) == 1  # at least one


def test_accum_numerics_final_loss_is_the_held_out_loss_after_the_last_step():
    import accum_numerics
    import launch

    r = launch.Result("r", 1, [], validation=[{"iter": 250, "val_loss": 3.0}, {"iter": 500, "val_loss": 2.5}])
    assert accum_numerics.final_loss(r, 500) == 2.5 and accum_numerics.final_loss(r, 400) is None


@pytest.mark.parametrize("script, argv", [("presets.py", ["--only", "no such row"]),
                                          ("memory_fit.py", ["--cases", "llama,no_such_case"]),
                                          ("memory_fit.py", ["--ngpus", "0"]),
                                          ("accum_numerics.py", ["--seeds", "1,x"]),
                                          ("accum_numerics.py", ["--steps", "5"]),
                                          ("accum_numerics.py", ["--local", "0"]),
                                          ("accum_numerics.py", ["--shared-gpu"]),
                                          ("accum_numerics.py", ["--parallel", "-1"]),
                                          ("accum_numerics.py", ["--combine", "/no/such/folder"]),
                                          ("multinode.py", ["--modes", "fsdp,zero2"]),
                                          ("multinode.py", ["--layouts", "one,three"]),
                                          ("multinode.py", ["--debug", "--ngpus", "3"]),
                                          ("multinode.py", ["--steps", "5", "--skip", "10"]),
                                          ("estimation_nodes.py", ["--gpus", "16,12"]),
                                          ("estimation_nodes.py", ["--flavors", "70B"]),
                                          ("collectives.py", [])])
def test_new_scripts_refuse_bad_input_in_one_line(script, argv):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *argv], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_memory_fit_reads_what_the_start_up_did():
    """benchmarks/memory_fit.py's reading of a run's timed output lines: the launcher's memory-check
    line (started again, refused, ran), when it came, and the job's own failure line otherwise."""
    import memory_fit

    restart = ("memory check: llama/1.36B at local batch 24 needs a predicted 84.02 GiB per GPU (1 x NVIDIA H100 80GB "
               "HBM3), more than the 78.59 GiB usable of the GPU's 79.2 GiB; starting again at local batch 12 x "
               "accumulation 2, the largest that fits (55.24 GiB) and keeps the global batch 24 "
               "(training.memory_fit=adjust, 14 s)")
    lines = [(3.0, "[rank0]:run log: x.json"), (17.5, restart), (60.2, "[rank0]:step      1/12 | loss 10.9")]
    assert memory_fit.did(lines, 0, False) == ("local batch 12 x accumulation 2 (started again)", 17.5, restart)
    assert memory_fit.RESTART.search(restart).groups() == (None, "12", "2", "24")
    raised = ("memory check: llama/8B (4 x h100, fsdp) does not fit even at local batch 1: peak 93.1 GiB > 78.09 GiB "
              "usable of 79.19 GiB; starting again with activation_checkpoint.mode=full at local batch 1 x accumulation "
              "2, the largest that fits (61.09 GiB) and keeps the global batch 8 (training.memory_fit=adjust, 40 s)")
    assert memory_fit.did([(40.0, raised)], 0, False)[0] == "AC full, local batch 1 x accumulation 2 (started again)"
    tight = ("memory check: qwen3/8B at local batch 3 on 4 x NVIDIA B200, fsdp: predicted peak 175.14 GiB per GPU of "
             "178.3 GiB, inside the allocator's 15% headroom; starting again at local batch 2 x accumulation 3, the "
             "largest clear of it that keeps the global batch 24 (137.12 GiB; training.memory_fit=adjust, 35 s)")
    assert memory_fit.did([(35.0, tight)], 0, False)[0] == "local batch 2 x accumulation 3 (started again)"
    refusal = "error: llama/1.36B at local batch 24 needs a predicted 84.02 GiB per GPU (...): ./run_train.sh ..."
    assert memory_fit.did([(18.0, refusal)], 2, False) == ("refused", 18.0, refusal)
    nothing = "error: llama/8B (1 x h200) does not fit even at local batch 1 with activation_checkpoint.mode=full: ..."
    assert memory_fit.did([(63.0, nothing)], 2, False) == ("refused", 63.0, nothing)
    fits = "memory check: llama/1.36B at local batch 24 on 1 x NVIDIA H200: predicted peak 84.02 GiB per GPU of 139.8 GiB (12 s)"
    assert memory_fit.did([(12.0, fits)], 0, False)[:2] == ("ran as written", 12.0)
    assert memory_fit.did([(12.0, "warning: " + fits)], 0, False)[0] == "ran as written (tight)"
    assert memory_fit.did([(1.0, "[rank0]:step 1")], 0, True)[0] == "ran as written (no check)"
    oom = "error: out of memory in step 1 on rank 0: peak 77.5 GiB allocated ..."
    assert memory_fit.did([(45.0, oom)], 4, True) == ("exit 4", None, oom)
    assert memory_fit.FIRST_STEP.match("[rank0]:step      1/12 | loss") and not memory_fit.FIRST_STEP.match("step     10/12")


def kernel_terms(tmp_path, kernels: dict[str, float]) -> dict[str, float]:
    """estimation_gpu's sorting of a profile of `kernels` (name -> ms per step, over two steps)."""
    import estimation_gpu

    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": n, "dur": ms * 2000}
                                                 for n, ms in kernels.items()]}))
    return estimation_gpu.kernel_breakdown(str(trace), steps=2)["terms"]


def test_estimation_gpu_sorts_the_profiles_kernels_into_the_models_terms(tmp_path):
    """The profile that estimation.calibrate fits the rates on: MasterAdamW's Triton kernels count as the
    optimizer (not as element-wise work), Inductor's as fused, cuBLAS's and Inductor's GEMM templates as GEMMs,
    cuDNN's as attention, NCCL's as communication, FSDP's copies as element-wise: stream_profile's categories."""
    names = {"_master_adamw_kernel": 12.0, "_master_adamw_many_kernel": 1.0, "triton_poi_fused_add_6": 3.0,
             "nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_NNN": 80.0, "void at::native::vectorized_gather_kernel": 0.5,
             "cudnn_generated_fort_native_sdpa_sm90_flash_bprop": 9.0,
             "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<LpNormFunctor>": 2.0,
             "triton_tem_fused_mm_0": 4.0, "ncclDevKernel_AllGather_RING_LL": 6.0,
             "void at::native::split_with_sizes_copy_out_contiguous_no_cast_kernel<c10::BFloat16>": 0.25}
    assert kernel_terms(tmp_path, names) == {"optimizer": 15.0, "fused": 3.0, "gemm": 84.0, "elementwise": 0.75,
                                             "attention": 9.0, "comm": 6.0}


def test_inductors_float8_cast_kernels_count_as_fused_not_gemm(tmp_path):
    """Inductor names its kernels after the ATen ops they fuse: float8's casts carry _scaled_mm (their
    scales and transposes come from it) and may carry attention's ops; they are generated kernels (fused),
    while cuBLAS's float8 GEMMs (sm90_xmma's e4m3, nvjet's q/r type letters) stay float8 GEMMs."""
    names = {"triton_poi_fused__scaled_mm__to_copy_clamp_mul_reciprocal_t_view_4": 2.0,
             "triton_red_fused__to_copy_abs_clamp_max_mul_reciprocal_3": 0.5,
             "triton_per_fused__scaled_dot_product_cudnn_attention__to_copy_abs_max_1": 0.25,
             "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x64_cublas": 7.0,
             "nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT": 3.0,
             "nvjet_sm90_tss_192x192_64x3_1x2_h_badd_coopB_NTN": 1.5}
    assert kernel_terms(tmp_path, names) == {"fused": 2.75, "gemm_float8": 10.0, "gemm": 1.5}


def test_estimation_gpu_table_sets_each_profiled_term_beside_its_prediction():
    """A profiled case's table rows: each throughput term predicted beside the kernel time sorted into it
    (the model's GEMM term against cuBLAS's bf16 and float8 GEMMs, its element-wise term against the
    generated and the other element-wise kernels); an unprofiled case adds none."""
    import estimation_gpu

    pred = {"peak_gib": 20.0, "tokens_per_sec_per_gpu": 60000.0, "dominant": "gemm",
            "terms_ms": {"gemm": 50.0, "attention": 12.0, "elementwise": 30.0, "optimizer": 10.0, "comm_total": 8.0}}
    prof = {"steps": 2, "terms": {"gemm": 4.0, "gemm_float8": 40.0, "attention": 12.0, "fused": 27.0,
                                  "elementwise": 3.0, "optimizer": 8.0, "comm": 9.0}}
    results = {"cases": {"plain": {"ranks": 2, "predicted": pred, "measured": {"peak_gib": 20.0}},
                         "f8": {"ranks": 2, "predicted": pred, "measured": {"peak_gib": 20.0, "profile_ms_per_step": prof}}}}
    rows = [r for r in estimation_gpu.table(results).splitlines() if r.startswith("| f8 |") and r.count("|") == 6]
    assert rows == ["| f8 | gemm | 50.00 | 44.00 | +13.6 |", "| f8 | attention | 12.00 | 12.00 | +0.0 |",
                    "| f8 | elementwise | 30.00 | 30.00 | +0.0 |", "| f8 | optimizer | 10.00 | 8.00 | +25.0 |",
                    "| f8 | comm_total | 8.00 | 9.00 | -11.1 |"]
    assert not [r for r in estimation_gpu.table(results).splitlines() if r.startswith("| plain |") and r.count("|") == 6]


def test_every_master_adamw_kernel_counts_as_optimizer(tmp_path):
    """Each Triton kernel titanlite/ops/master_adamw.py defines, by the name a profile shows, is sorted
    into the optimizer term (needs Triton, as the kernels do)."""
    triton = pytest.importorskip("triton")
    import titanlite.ops.master_adamw as kernels

    names = [v.__name__ for v in vars(kernels).values() if isinstance(v, triton.runtime.jit.JITFunction)]
    launched = [n for n in names if n.endswith("_kernel")]  # the launched ones; the rest are inlined helpers
    assert launched and kernel_terms(tmp_path, dict.fromkeys(launched, 1.0)) == {"optimizer": float(len(launched))}


# ------------------------------------------------------------------------------------- multinode.py
def test_nodes_split_the_gpus_and_a_failed_node_stops_the_other(tmp_path, monkeypatch):
    """Each agent standing for a node sees its own GPUs and meets the others at one endpoint; when one
    fails, the others are ended after the grace period instead of waiting for it until the timeout."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    agents = launch.node_commands(2, 2, ["-m", "titanlite.train"], "job")
    assert [env for _, env in agents] == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert agents[0][0] == agents[1][0] and "--nnodes=2" in agents[0][0] and "--nproc-per-node=2" in agents[0][0]
    agents = [(["bash", "-c", "echo $CUDA_VISIBLE_DEVICES; exit 3"], {"CUDA_VISIBLE_DEVICES": "4,5"}),
              (["bash", "-c", "echo $CUDA_VISIBLE_DEVICES $NCCL_P2P_DISABLE; sleep 60"], {"CUDA_VISIBLE_DEVICES": "6,7"})]
    rc, text, wall = launch.execute_nodes("pair", agents, 120, work=tmp_path, env={"NCCL_P2P_DISABLE": "1"}, grace=1)
    assert rc == 3 and wall < 30
    assert [ln for ln in text.splitlines() if ln] == ["== node 0 ==", "4,5", "== node 1 ==", "6,7 1"]


def own_work(folder) -> dict:
    """The environment of a benchmark script run by a test: its run folders (launch.WORK, under TMPDIR)
    in the test's own folder, where a test running at the same time (pytest -n) cannot remove them."""
    return child_env(TMPDIR=str(folder))


@pytest.mark.slow
def test_multinode_two_nodes_against_one_node_on_cpu(tmp_path):
    """The script end to end on CPU (gloo, the debug model): fsdp as one node of 2, two nodes of 1 and
    two nodes over sockets, the collectives' bandwidth and the estimate given it. On CPU the two-node
    losses equal the one-node run's at every step."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multinode.py"), "--debug", "--ngpus", "2",
                        "--modes", "fsdp", "--layouts", "one,two,sockets", "--steps", "3", "--skip", "1",
                        "--log-freq", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env=own_work(tmp_path))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    data = json.loads((tmp_path / "multinode.json").read_text())
    rows = {x["layout"]: x for x in data["rows"]}
    assert sorted(rows) == ["one", "sockets", "two"] and all(x["tps_gpu"] > 0 for x in rows.values())
    for layout in ("two", "sockets"):
        assert rows[layout]["vs_one"]["step1_equal"] and rows[layout]["vs_one"]["max_diff"] == 0.0
    assert {op: len(v) for op, v in data["bandwidth"]["ops"].items()} == {"all_gather": 2, "all_reduce": 2,
                                                                          "reduce_scatter": 2}
    (v,) = data["validation"]
    assert v["busbw_gbps"] > 0 and v["predicted"] > 0 and "--estimate.gpus_per_node 1" in v["estimate"]
    table = (tmp_path / "multinode.md").read_text()
    assert "| fsdp | 2 nodes x 1, sockets |" in table and "| mode, sockets | bus bandwidth used, GB/s |" in table


@pytest.mark.slow
def test_multinode_resume_across_world_sizes_on_cpu(tmp_path):
    """--resume on CPU: 2 nodes x 1 -> 1 process and back, each resumed run equal to its uninterrupted
    one, the resharding and the stream position said by the resumed runs."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multinode.py"), "--debug", "--ngpus", "2",
                        "--resume", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env=own_work(tmp_path))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    data = json.loads((tmp_path / "multinode_resume.json").read_text())
    # the two layouts average the loss in another order (each rank's mean, then the ranks'; or one mean):
    # the same to the last bit of a float32 loss
    assert data["ok"] and data["spread"] <= 1e-6
    table = (tmp_path / "multinode_resume.md").read_text()
    assert "data stream at position 20): 2 -> 1 True, 1 -> 2 True" in table
    assert "| 6 | " in table and "| 10 | " in table


def test_host_trace_sums_each_code_part_own_time_per_thread(tmp_path):
    """host_trace.py: an event's own time (its length less its children's) goes to the innermost Python frame
    of a known part; ops with no Python frame above them to the autograd engine; a call still open when
    recording stopped is cut to the span of the ops; a thread without ops is left out; a bad file exits 2."""
    import gzip

    import host_trace

    def ev(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}

    fsdp = "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py(442): pre_forward"
    events = [ev("python_function", "titanlite/step.py(114): __call__", 0, 100),
              ev("cpu_op", "aten::empty", 0, 1),                        # the step's own op
              ev("python_function", fsdp, 10, 30),
              ev("cpu_op", "aten::split_with_sizes_copy", 15, 10),       # inside FSDP's hook: FSDP's
              ev("python_function", "/tmp/torchinductor_root/ab/cabc.py(9): call", 50, 20),
              ev("cpu_op", "aten::mm", 55, 5),
              ev("python_function", "torch/optim/optimizer.py(509): wrapper", 120, 10**7),  # open at the end
              *[ev("cpu_op", "aten::add_", 121 + i, 1) for i in range(10)],
              *[ev("cpu_op", "AddmmBackward0", 200 + 10 * i, 5, tid=2) for i in range(10)],   # engine thread
              ev("python_function", "threading.py(327): wait", 0, 300, tid=3)]
    out = host_trace.analyse(events)
    assert set(out) == {1, 2}
    busy, parts, funcs = out[1]
    us = lambda ms: round(ms * 1e3)
    assert us(busy) == 100 + (295 - 120)  # the step, then the optimizer's call cut at the last op's end
    assert us(parts["fsdp hooks"]) == 30 and us(parts["inductor generated code"]) == 20
    assert us(parts["titanlite step"]) == 100 - 30 - 20 and us(parts["optimizer"]) == 295 - 120
    assert us(funcs[fsdp]) == 30 and us(funcs["titanlite/step.py(114): __call__"]) == 50
    assert us(out[2][1][host_trace.ENGINE]) == 50 and us(out[2][0]) == 50

    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_trace.py"), str(path)], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "| fsdp hooks | 0.0 |" not in r.stdout and "## thread 1" in r.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_trace.py"), str(tmp_path / "none.json")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "cannot read" in bad.stderr
    (tmp_path / "odd.json").write_text("[1, 2]")  # JSON, not a trace
    odd = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_trace.py"), str(tmp_path / "odd.json")],
                         capture_output=True, text=True)
    assert odd.returncode == 2 and odd.stderr.count("\n") == 1 and "not a Chrome trace" in odd.stderr


@pytest.mark.parametrize("args", [["--launch", "sometimes"], ["--busy", "many"], ["--trace"]])
def test_step_host_time_refuses_a_bad_option_in_one_line(args):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_host_time.py"), *args], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("step_host_time: "), r.stderr


def test_every_measurement_record_is_in_the_index_and_every_index_link_exists():
    """benchmarks/results/README.md lists each dated record (docs/performance.md points there for history)."""
    results = ROOT / "benchmarks" / "results"
    index = (results / "README.md").read_text()
    records = {p.name for p in results.glob("20*.md")}
    linked = set(re.findall(r"\]\((20[^)]+\.md)\)", index))
    assert records - linked == set(), "records missing from benchmarks/results/README.md"
    assert linked - records == set(), "index links to records that do not exist"


@pytest.mark.parametrize("ngpus", [2, 4])
def test_gpu_matrix_covers_every_pair_and_each_row_is_what_the_checks_say(ngpus, monkeypatch):
    """benchmarks/gpu_matrix.py: every pair of values of two factors is in some row; a row meant to train
    passes titanlite's configuration check, and a pair no configuration can train is in a row the
    check refuses, with the line it refuses it with."""
    import gpu_matrix

    rows = gpu_matrix.design(ngpus)
    covered = set().union(*(gpu_matrix.pairs_of(r) for r in rows))
    assert covered == gpu_matrix.every_pair()
    assert all(set(r) >= set(gpu_matrix.FACTORS) for r in rows)
    for r in rows:
        why = gpu_matrix.refusal(r, ngpus)
        assert (why is None) == (r["expect"] == "train") and why == r["why"], r
    # pairs a trained row covers are not left to a refusal: a refused row holds some pair no trained row does
    trained = set().union(*(gpu_matrix.pairs_of(r) for r in rows if r["expect"] == "train"))
    assert all(gpu_matrix.pairs_of(r) - trained for r in rows if r["expect"] == "refused")
    assert {r["mode"] for r in rows if r["expect"] == "train" and r["precision"] == "float8"} >= {"fsdp", "hsdp"}
    labels = [gpu_matrix.label(r) for r in rows]
    assert len(set(labels)) == len(labels)  # each row's run folder and log are its own
    # the committed predictions serve every trained row, from whatever folder the checkout sits in
    pred = json.loads((ROOT / f"benchmarks/results/gpu_matrix_predictions_{ngpus}xh200.json").read_text())
    keys = {gpu_matrix.key(r, ngpus, "h200"): gpu_matrix.label(r) for r in rows if r["expect"] == "train"}
    assert {k: p["label"] for k, p in pred["predictions"].items()} == keys
    monkeypatch.setattr(gpu_matrix, "ROOT", Path("/elsewhere/checkout"))
    assert {gpu_matrix.key(r, ngpus, "h200") for r in rows if r["expect"] == "train"} == set(keys)


def test_gpu_matrix_lists_a_row_wider_than_the_host_as_not_run(tmp_path, monkeypatch):
    """On a host with fewer GPUs than a row needs, the row is listed as not run (and fails), never waited for."""
    import gpu_matrix

    started = []
    monkeypatch.setattr(gpu_matrix.launch, "run_train", lambda *a, **k: started.append(a) or None)
    row = next(r for r in gpu_matrix.design(2) if r["mode"] == "fsdp" and r["expect"] == "train")
    out = gpu_matrix.run_row(row, 2, gpu_matrix.Gpus([0]), "", None)
    assert not out["passed"] and out["error"] == "not run: needs 2 GPUs, the host lends 1" and not started


def test_float8_sweep_pairs_every_float8_run_with_its_bf16_run():
    """The float8 sweep: fsdp and hsdp in every compile x activation checkpointing x accumulation
    combination, each with a bf16 run of its mode and accumulation to compare its losses with."""
    import gpu_matrix

    rows = gpu_matrix.sweep_rows()
    f8 = {(r["mode"], r["compile"], r["ac"], r["accum"]) for r in rows if r["precision"] == "float8"}
    assert f8 == {(m, c, a, n) for m in ("fsdp", "hsdp") for c in (True, False)
                  for a in ("none", "selective", "full") for n in (1, 2)}
    assert {(r["mode"], r["accum"]) for r in rows if r["precision"] == "bf16"} == {(m, n) for m, _, _, n in f8}
    assert all(gpu_matrix.refusal(r, 4) is None for r in rows)


def test_a_chosen_float8_sweep_row_brings_its_bf16_run():
    """--only picks float8 rows; each comes with the bf16 run of its mode and accumulation (without it the
    row would have nothing to be compared with), once, in the sweep's order."""
    import gpu_matrix

    got = gpu_matrix.sweep_chosen(["fsdp_float8_ac-none_eager_accum1", "hsdp_float8_ac-full_compile_accum1",
                                   "hsdp_float8_ac-none_compile_accum1"])
    assert [gpu_matrix.label(r) for r in got] == [
        "fsdp_bf16_ac-none_compile_accum1_nographs_m-float32_fused_llama",
        "fsdp_float8_ac-none_eager_accum1_nographs_m-float32_fused_llama",
        "hsdp_bf16_ac-none_compile_accum1_nographs_m-float32_fused_llama",
        "hsdp_float8_ac-none_compile_accum1_nographs_m-float32_fused_llama",
        "hsdp_float8_ac-full_compile_accum1_nographs_m-float32_fused_llama"]
    assert gpu_matrix.sweep_chosen([]) == gpu_matrix.sweep_rows()


# ---------------------------------------------------------------------------------- float8_fsdp.py
EIGHT_B = ["--model", "8B", "--batches", "2", "--peers", "0.2.2,0.3.0",
           "--extra=--model.attention_backend sdpa_cudnn", "--extra-at", "bf16", "--steps", "12", "--skip", "6"]


def float8_fsdp():
    import float8_fsdp as f

    return f


def steady_run(name, tps, mem=None, reserved=50.0, error=None):
    """A launched run whose log steps after 6 run at `tps` tokens/s per GPU (step 5 is warm-up)."""
    es = [{"iter": i, "tokens_per_sec_per_gpu": 1.0 if i == 5 else tps, "mfu": 50.0, "memory_peak_gb": mem,
           "memory_reserved_peak_gb": reserved} for i in (5, 10, 12)]
    return launch.Result(name, 4, [], 0 if error is None else 1, 60.0, error, [] if error else es)


def test_float8_fsdp_rows_each_precision_each_peer_then_the_variants():
    """The 8B call's rows, in the order they run: titanlite bf16 and float8; each torchtitan version in both
    (0.3.0's float8 a row saying why it does not run); the --extra variant at bf16 only."""
    f = float8_fsdp()
    a = f.parse_args(EIGHT_B)
    rows = f.plan(a)
    assert [(r.label, r.batch) for r in rows] == [
        ("titanlite bf16", 2), ("titanlite float8", 2), ("torchtitan 0.2.2 bf16", 2), ("torchtitan 0.2.2 float8", 2),
        ("torchtitan 0.3.0 bf16", 2), ("torchtitan 0.3.0 float8", 2),
        ("titanlite bf16 +model.attention_backend sdpa_cudnn", 2)]
    by = {r.label: r for r in rows}
    assert by["titanlite float8"].args == ["--training.local_batch_size", "2", "--float8.enable"]
    assert by["titanlite bf16 +model.attention_backend sdpa_cudnn"].args[-2:] == ["--model.attention_backend",
                                                                                  "sdpa_cudnn"]
    assert f.options(a, by["titanlite bf16"])[-6:] == ["--model.name", "llama", "--model.flavor", "8B",
                                                       "--training.local_batch_size", "2"]
    peer = by["torchtitan 0.2.2 float8"].args
    assert peer[:2] == ["--model.flavor", "8B"] and peer[-len(f.PEER_FLOAT8):] == f.PEER_FLOAT8
    assert "--quantize.linear.float8.enable_fsdp_float8_all_gather" not in by["torchtitan 0.2.2 bf16"].args
    tt3 = by["torchtitan 0.3.0 bf16"]
    assert tt3.args[:4] == ["--module", "tt3_configs", "--config", "bf16"] and "8192" in tt3.args
    assert tt3.env == {"TT3_BENCH_FLAVOR": "8B", "TT3_BENCH_AC": "none"}
    assert by["torchtitan 0.3.0 float8"].why.startswith("not run: 0.3.0's float8 is rowwise only")
    # --tt3-rowwise: 0.3.0's own float8 as a row of its own; --float8-only: float8 rows alone; --unfused at the first batch
    rows = f.plan(f.parse_args([*EIGHT_B, "--tt3-rowwise"]))
    assert [r.args[3] for r in rows if r.label == "torchtitan 0.3.0 float8 rowwise"] == ["float8_rowwise"]
    # --peer-precisions: the peers' own precisions (their float8 alone against titanlite's both)
    rows = f.plan(f.parse_args(["--batches", "16", "--peer-precisions", "float8"]))
    assert [r.label for r in rows] == ["titanlite bf16", "titanlite float8", "torchtitan 0.2.2 float8"]
    rows = f.plan(f.parse_args(["--batches", "4,16", "--float8-only", "--unfused", "--peers", ""]))
    assert [(r.label, r.batch) for r in rows] == [("titanlite float8", 4), ("titanlite float8 unfused", 4),
                                                  ("titanlite float8", 16)]
    # --ac selective: titanlite's per-op policy against 0.2.2's per-op one (not its default, every second block) and
    # 0.3.0's (per-op only)
    a = f.parse_args([*EIGHT_B, "--ac", "selective"])
    by = {r.label: r for r in f.plan(a)}
    ours = f.options(a, by["titanlite bf16"])
    assert ours[ours.index("--activation_checkpoint.mode") + 1] == "selective"
    peer = by["torchtitan 0.2.2 bf16"].args
    i = peer.index("--activation_checkpoint.mode")
    assert peer[i:i + 4] == ["--activation_checkpoint.mode", "selective",
                             "--activation_checkpoint.selective_ac_option", "op"]
    assert by["torchtitan 0.3.0 bf16"].env["TT3_BENCH_AC"] == "selective"


@pytest.mark.parametrize("argv", [["--precisions", "fp16"], ["--peers", "0.1"], ["--batches", "2,x"],
                                  ["--extra-at", "int8"], ["--peer-precisions", "fp8"], ["--tt3-rowwise"], ["--steps", "6", "--skip", "6"],
                                  ["--predictions", "/no/such.json"], ["--predict", "--predictions", "x.json"]])
def test_float8_fsdp_refuses_bad_input_in_one_line(argv):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "float8_fsdp.py"), *argv], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_float8_fsdp_table_ratios_in_the_same_precision_and_predictions_beside_each_row():
    f = float8_fsdp()
    a = f.parse_args(EIGHT_B)
    rows = f.plan(a)
    measured = {"titanlite bf16": (10_000.0, 100.0), "titanlite float8": (14_000.0, 80.0),
                "torchtitan 0.2.2 bf16": (8_000.0, None), "torchtitan 0.2.2 float8": (14_000.0, None),
                "torchtitan 0.3.0 bf16": (9_000.0, None),
                "titanlite bf16 +model.attention_backend sdpa_cudnn": (9_000.0, 95.0)}
    for r in rows:
        if r.label in measured:
            r.result = steady_run(r.label, *measured[r.label])
    opts = {id(r): f.options(a, r) for r in rows if r.lib == "titanlite"}
    pred = {"ngpus": 4, "predictions": {
        f.key(rows[0]): {"options": opts[id(rows[0])], "tokens_per_sec_per_gpu": 10_500.0, "peak_gib": 99.0},
        f.key(rows[1]): {"options": ["--other"], "tokens_per_sec_per_gpu": 1.0, "peak_gib": 1.0}}}
    by = {r["run"]: r for r in md_tables(f.table(rows, a.versions, a.skip, pred, opts))[0]}
    ours = by["titanlite bf16"]
    assert (ours["vs 0.2.2"], ours["vs 0.3.0"]) == ("1.250", "1.111")  # against each version's bf16
    assert ours["predicted tok/s (err %)"] == "10,500 (+5.0)" and ours["predicted GiB (err %)"] == "99.00 (-1.0)"
    assert ours["vs best titanlite bf16"] == "-" and ours["alloc GiB"] == "100.00" and ours["rsrvd GiB"] == "50.00"
    f8 = by["titanlite float8"]
    assert (f8["vs 0.2.2"], f8["vs 0.3.0"], f8["vs best titanlite bf16"]) == ("1.000", "-", "1.400")
    assert f8["predicted tok/s (err %)"] == "-" and f8["note"] == "predicted for other options"
    sdpa = by["titanlite bf16 +model.attention_backend sdpa_cudnn"]
    assert sdpa["vs 0.2.2"] == "1.125" and sdpa["note"] == "no prediction for this row"
    assert by["torchtitan 0.3.0 float8"]["note"].startswith("not run: 0.3.0's float8 is rowwise only")
    assert by["torchtitan 0.2.2 bf16"]["vs 0.2.2"] == "-" and by["torchtitan 0.2.2 bf16"]["predicted tok/s (err %)"] == "-"
    # the rows by precision: bf16 (titanlite, 0.2.2, 0.3.0, the variant), then float8
    assert list(by) == ["titanlite bf16", "titanlite bf16 +model.attention_backend sdpa_cudnn", "torchtitan 0.2.2 bf16",
                        "torchtitan 0.3.0 bf16", "titanlite float8", "torchtitan 0.2.2 float8", "torchtitan 0.3.0 float8"]


def test_float8_fsdp_budget_cuts_the_last_rows_and_writes_after_every_row(tmp_path, monkeypatch):
    """Under --budget a row that would not finish in what is left (the longest of its library so far, or
    FIRST_ROW_S) is a row saying so; each run gets at most what is left; the files are there after each row."""
    f = float8_fsdp()
    clock = [0.0]
    monkeypatch.setattr(f.time, "time", lambda: clock[0])
    seen = []

    def fake_run(a, row):
        seen.append((row.label, f.row_timeout(a, row)))
        assert (tmp_path / "float8_fsdp.md").exists() == (len(seen) > 1)
        r = steady_run(row.label, 1000.0, 10.0)
        r.wall_s = 100.0 if row.lib == "titanlite" else 150.0
        clock[0] += r.wall_s
        return r

    monkeypatch.setattr(f, "run", fake_run)
    assert f.main([*EIGHT_B, "--budget", "400", "--timeout", "300", "--out", str(tmp_path)]) == 0
    assert seen == [("titanlite bf16", 300), ("titanlite float8", 300), ("torchtitan 0.2.2 bf16", 200)]
    notes = {r["run"]: r["note"] for r in md_tables((tmp_path / "float8_fsdp.md").read_text())[0]}
    assert notes["torchtitan 0.2.2 float8"] == "not run: 50 s of --budget left, a row takes about 150"
    assert notes["titanlite bf16 +model.attention_backend sdpa_cudnn"].startswith("not run: 50 s of --budget left")
    saved = json.loads((tmp_path / "float8_fsdp.json").read_text())
    assert [r["label"] for r in saved["rows"] if r["run"]] == [s for s, _ in seen]


def test_float8_fsdp_predict_writes_what_the_table_reads(tmp_path, monkeypatch):
    """--predict: node_study's estimate helper for each titanlite row, with its options, the GPU count and
    GPU; the table finds each prediction by the same key and options."""
    import node_study

    f = float8_fsdp()
    calls = []
    monkeypatch.setattr(node_study, "predict", lambda options, k, gpu, timeout: calls.append((options, k, gpu)) or
                        {"options": options, "tokens_per_sec_per_gpu": 100.0, "peak_gib": 9.0})
    out = tmp_path / "p.json"
    assert f.main([*EIGHT_B, "--predict", "--hardware", "h200", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert (saved["ngpus"], saved["hardware"]) == (4, "h200") and len(calls) == 3
    assert list(saved["predictions"]) == ["titanlite bf16 | b2", "titanlite float8 | b2",
                                          "titanlite bf16 +model.attention_backend sdpa_cudnn | b2"]
    a = f.parse_args([*EIGHT_B, "--predictions", str(out)])
    rows = f.plan(a)
    opts = {id(r): f.options(a, r) for r in rows if r.lib == "titanlite"}
    assert all(calls[i][0] == opts[id(r)] and calls[i][1:] == (4, "h200")
               for i, r in enumerate(r for r in rows if r.lib == "titanlite"))
    table = md_tables(f.table(rows, a.versions, a.skip, a.pred, opts))[0]
    assert {r["note"] for r in table if r["run"].startswith("titanlite")} == {"not run"}  # predictions found, nothing ran


def test_committed_8b_predictions_are_for_the_8b_calls_rows():
    """benchmarks/results/float8_fsdp_predictions_8b_4xh200.json holds an estimate for each titanlite row of
    the 8B call, made for the options that row trains with."""
    f = float8_fsdp()
    path = ROOT / "benchmarks" / "results" / "float8_fsdp_predictions_8b_4xh200.json"
    a = f.parse_args([*EIGHT_B, "--predictions", str(path)])
    assert (a.pred["ngpus"], a.pred["hardware"]) == (4, "h200")
    for r in f.plan(a):
        if r.lib == "titanlite":
            p = a.pred["predictions"][f.key(r)]
            assert p["options"] == f.options(a, r) and p["tokens_per_sec_per_gpu"] > 0 and p["peak_gib"] > 0


def test_tt3_runs_get_their_config_module_and_long_documents(monkeypatch, tmp_path):
    """0.3.0's rows: tt3_configs.py on run.sh's PYTHONPATH (TT3_SITE) before run.sh starts, the flavor and AC
    in the run's environment, and (--tt3-data long) c4_test joined into long documents as its dataset path."""
    f = float8_fsdp()
    c4 = tmp_path / "c4.json"
    c4.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a" * 60, "b" * 30, "c" * 50, "d" * 40, "e" * 5]))
    monkeypatch.setattr(f, "TT3_SITE", tmp_path / "site3")
    monkeypatch.setattr(f, "C4_TEST", c4)
    monkeypatch.setattr(f, "TT3_LONG_DOCS", tmp_path / "long")
    monkeypatch.setattr(f, "LONG_DOC_CHARS", 80)
    got = {}
    monkeypatch.setattr(launch, "peer", lambda v, n, overrides, timeout, env: got.update(
        v=v, env=env, args=overrides, there=(tmp_path / "site3" / "tt3_configs.py").exists()) or steady_run("p", 1.0))
    a = f.parse_args(EIGHT_B)
    a.left = 0
    f.run(a, next(r for r in f.plan(a) if r.label == "torchtitan 0.3.0 bf16"))
    assert {k: got[k] for k in ("v", "env", "there")} == \
        {"v": "0.3.0", "env": {"TT3_BENCH_FLAVOR": "8B", "TT3_BENCH_AC": "none"}, "there": True}
    assert got["args"][-2:] == ["--dataloader.dataset_path", str(tmp_path / "long")]
    docs = [json.loads(x)["text"] for x in (tmp_path / "long" / "data.json").read_text().splitlines()]
    assert docs == ["a" * 60 + "\n" + "b" * 30, "c" * 50 + "\n" + "d" * 40 + "\n" + "e" * 5]  # the rest joins the last
    assert 'os.environ.get("TT3_BENCH_FLAVOR"' in f.TT3_CONFIGS.read_text()
    c4_own = f.plan(f.parse_args([*EIGHT_B, "--tt3-data", "c4_test"]))
    assert "--dataloader.dataset_path" not in next(r for r in c4_own if r.label == "torchtitan 0.3.0 bf16").args


# -------------------------------------------------------------------------- attention.py, gemm_ceiling.py
def test_attention_8b_shapes_and_groups():
    assert bench_attention.shapes("8b") == ["llama 8B b2", "qwen3 8B b2"]
    assert [bench_attention.shape(s) for s in bench_attention.shapes("8b")] == [(2, 32, 8, 8192, 128)] * 2
    assert bench_attention.shapes("default,llama 1.36B b4,8b")[:3] == bench_attention.GROUPS["default"]
    assert bench_attention.parse_args(["--shapes", "8b"]).shapes == ["llama 8B b2", "qwen3 8B b2"]


def test_gemm_ceiling_counts_the_8b_steps_gemms_and_weighs_the_mean_by_flops():
    import gemm_ceiling as g

    assert g.linears("llama", "8B") == [("wq/wo", 4096, 4096, 64), ("wk/wv", 4096, 1024, 64),
                                        ("w1/w3", 4096, 14336, 64), ("w2", 14336, 4096, 32),
                                        ("output", 4096, 128256, 1)]
    assert [g.mnk(x, 16384, 4096, 1024) for x in g.GEMMS] == [(16384, 1024, 4096), (16384, 4096, 1024),
                                                              (1024, 4096, 16384)]
    rows = g.plan("llama", "8B", 16384, float8=True)
    assert len(rows) == 5 * 3 + 4 * 3 and not any(r["output"] for r in rows if r["precision"] == "float8")
    # the step's GEMM FLOPs: 6 x the linears' parameters x tokens
    params = sum(i * o * n for _, i, o, n in g.linears("llama", "8B"))
    assert sum(r["flops"] * r["count"] for r in rows if r["precision"] == "bf16") == pytest.approx(6 * params * 16384)
    for r in rows:  # bf16 at 500 TFLOP/s, float8 at 1000, but the block's forward GEMMs twice as fast
        r["ms"] = r["flops"] / (1e15 if r["precision"] == "float8" else 5e14) * 1e3
    assert g.mean_rate(rows, "bf16") == pytest.approx(500)
    out = [r for r in rows if r["output"]]
    f_out, f_all = sum(r["flops"] for r in out), sum(r["flops"] * r["count"] for r in rows if r["precision"] == "bf16")
    expected = f_all / ((f_all - f_out) / 1e15 + f_out / 5e14) / 1e12  # the output layer's GEMMs stay bf16
    assert g.mean_rate(rows, "float8") == pytest.approx(expected)
    assert g.mean_rate([{**r, "ms": None} if r["precision"] == "float8" else r for r in rows], "float8") is None
    means = {r["step's GEMMs"]: r for r in md_tables(g.table(rows, 1000.0, {"bf16": 0.7, "float8": 0.6}))[1]}
    assert means["bf16"]["flop-weighted TFLOP/s"] == "500" and means["bf16"]["of peak"] == "0.500"
    assert means["bf16"]["TFLOP/s the estimate takes"] == "700"
    assert means["float8 (output layer in bf16)"]["TFLOP/s the estimate takes"] == "1200"


def test_gemm_ceiling_lays_float8_operands_out_as_scaled_mm_takes_them():
    """torch._scaled_mm: row-major first operand, column-major second; e5m2 only for the output gradient;
    fast accumulation in the forward only."""
    import torch

    import gemm_ceiling as g

    x, w, dy = torch.randn(8, 16), torch.randn(4, 16), torch.randn(8, 4)
    for gemm, (a_dtype, fast) in zip(g.GEMMS, ((torch.float8_e4m3fn, True), (torch.float8_e5m2, False),
                                               (torch.float8_e5m2, False))):
        a, b, f = g.operands(gemm, "float8", x, w, dy)
        m, n, k = g.mnk(gemm, 8, 16, 4)
        assert (tuple(a.shape), tuple(b.shape)) == ((m, k), (k, n)) and (a.dtype, f) == (a_dtype, fast)
        assert a.stride() == (k, 1) and b.stride() == (1, k) and b.dtype == torch.float8_e4m3fn
        a, b, _ = g.operands(gemm, "bf16", x, w, dy)
        assert tuple((a @ b).shape) == (m, n)


@pytest.mark.parametrize("bad", [["--host-gpus", "0"], ["--row-timeout", "0"], ["--slots", "0"]])
def test_gpu_matrix_refuses_a_host_of_no_gpus_and_a_row_without_time(bad):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu_matrix.py"), "--ngpus", "2", *bad, "--design"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
        "--host-gpus and --slots must be at least 1 and --row-timeout positive")


def test_code_digest_names_the_files_not_the_folder_or_git(tmp_path):
    """The same code files in two folders give one digest; a changed line, another; caches, records
    and git metadata none."""
    import shutil

    import launch

    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        (root / "titanlite" / "__pycache__").mkdir(parents=True)
        (root / "titanlite" / "step.py").write_text("x = 1\n")
        (root / "train_configs").mkdir()
        (root / "train_configs" / "p.toml").write_text("[training]\n")
    (b / "titanlite" / "__pycache__" / "step.cpython-312.pyc").write_bytes(b"\0")
    (b / ".git").mkdir()
    (b / "notes.md").write_text("a record\n")
    assert launch.code_digest(a) == launch.code_digest(b)
    (b / "titanlite" / "step.py").write_text("x = 2\n")
    assert launch.code_digest(a) != launch.code_digest(b)
    shutil.copy(a / "titanlite" / "step.py", b / "titanlite" / "step.py")
    (b / "train_configs" / "p.toml").rename(b / "train_configs" / "q.toml")  # a renamed preset is other code
    assert launch.code_digest(a) != launch.code_digest(b)


@pytest.mark.parametrize("slots", [None, 1, 3])
def test_gpu_matrix_hands_each_gpu_to_as_many_rows_as_its_slots(slots, tmp_path, monkeypatch):
    """The matrix's rows share each GPU `--slots` at a time (two by default): the GPUs its rows are handed
    list each GPU that often, and two-GPU rows take distinct GPUs."""
    import gpu_matrix

    handed = []

    def row_run(row, ngpus, gpus, data, prediction, timeout):
        handed.append(sorted(gpus.free))
        ids = gpus.take(2)
        gpus.give(ids)
        return {**row, "label": gpu_matrix.label(row), "ranks": 2, "expect": "refused", "passed": len(set(ids)) == 2,
                "said": "", "wall_s": 0.0}

    # one fsdp row (the design itself takes seconds to build)
    row = {**{k: v[0] for k, v in gpu_matrix.FACTORS.items()}, "mode": "fsdp", "expect": "train", "why": None}
    monkeypatch.setattr(gpu_matrix, "design", lambda ngpus: [row])
    monkeypatch.setattr(gpu_matrix, "run_row", row_run)
    monkeypatch.setattr(gpu_matrix.launch, "gpu_names", lambda: [])
    code = gpu_matrix.run(2, None, "", tmp_path, [], **({} if slots is None else {"slots": slots}))
    assert code == 0 and handed == [sorted([0, 1] * (slots or 2))]


# -------------------------------------------------------------------------- float8_blocks.py
def test_float8_blocks_reads_variants_and_refuses_bad_ones_in_one_line():
    import float8_blocks as f

    v = f.parse_variant("float8:rowwise:fast-wk+wv")
    assert (v.float8, v.recipe, v.fast_accum, v.keep_bf16) == (True, "rowwise", True, {"wk", "wv"})
    assert f.parse_variant("bf16") == f.Variant("bf16", False)
    assert f.parse_variant("float8") == f.Variant("float8", True)
    for bad, says in (("bf16:fast", "bf16, or float8"), ("float8:x", "'x'"), ("float8-wq+zz", "'zz'"),
                      ("float8-", "''"), ("fp8", "bf16, or float8")):
        with pytest.raises(ValueError, match=re.escape(says)):
            f.parse_variant(bad)
    for argv, says in ((["--variants", "bf16,float8:slow"], "'slow'"), (["--tokens", "1000"], "whole number"),
                       (["--flavor", "9B"], "llama's flavors: debug"), (["--iters", "0"], "must be positive")):
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "float8_blocks.py"), *argv], capture_output=True,
                           text=True, env=child_env(), timeout=120)
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1 and says in r.stderr
    import torch

    if not torch.cuda.is_available():  # good options on a machine without a float8 GPU: one line, exit 2
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "float8_blocks.py"), "--flavor", "debug"],
                           capture_output=True, text=True, env=child_env(), timeout=120)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            "float8_blocks: needs a CUDA GPU that runs float8 matmuls (compute capability 8.9 or later)"]


def test_float8_blocks_converts_every_linear_but_those_kept_and_trains_them():
    """titanlite's float8 (emulated on the CPU) on a block's linears but the kept ones, which stay nn.Linear;
    the converted block runs forward and backward, gradients reaching every weight."""
    import torch
    import torch.nn as nn
    from torchao.float8.float8_linear import Float8Linear

    import float8_blocks as f
    from titanlite.models.transformer import rope_cache

    blocks, args = f.build("llama", "debug", 2, device="cpu")
    f.convert(blocks, f.parse_variant("float8:fast-wk+w2"), emulate=True)
    for block in blocks:
        kinds = {fqn.split(".")[-1]: type(m) for fqn, m in block.named_modules() if isinstance(m, nn.Linear)}
        assert set(kinds) == set(f.LINEARS)
        assert {n for n, k in kinds.items() if k is nn.Linear} == {"wk", "w2"}
        assert all(issubclass(k, Float8Linear) for n, k in kinds.items() if n not in ("wk", "w2"))
        assert block.attention.wq.config.gemm_config_grad_input.use_fast_accum
    x = torch.randn(2, 32, args.dim, dtype=torch.bfloat16, requires_grad=True)
    h = x
    for b in blocks:
        h = b(h, rope_cache(args.hdim, 32, args.rope_theta))
    h.float().pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in blocks.parameters())
    rows = [{"variant": "bf16", "ms": 4.0, "spread_ms": 0.1}, {"variant": "float8", "ms": 3.2, "spread_ms": 0.1},
            {"variant": "float8-wk+w2", "ms": 4.0, "spread_ms": 0.2}, {"variant": "float8:rowwise", "error": "X: y"}]
    got = {r["variant"]: r for r in md_tables(f.table(rows))[0]}
    assert (got["float8"]["vs bf16"], got["float8-wk+w2"]["vs float8"]) == ("1.250", "0.800")
    assert got["float8:rowwise"]["ms per block"] == "X: y" and got["bf16"]["vs float8"] == "0.800"
    from torchao.float8.config import ScalingGranularity

    rowwise, _ = f.build("llama", "debug", 1, device="cpu")
    f.convert(rowwise, f.parse_variant("float8:rowwise"), emulate=True)
    assert rowwise[0].feed_forward.w2.config.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE
    assert blocks[0].feed_forward.w1.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE
