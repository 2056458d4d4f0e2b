"""Run log, step timer, breakdown summary, console, TensorBoard and profiler on CPU (one process)."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn

from titanlite.config import load_config
from titanlite.metrics.breakdown import rank_breakdown, summarize
from titanlite.metrics.console import Console
from titanlite.metrics import run_log
from titanlite.metrics.run_log import RunLog, RunLogError, load, ran, steady
from titanlite.metrics.timing import StepTimer
from titanlite.train import Trainer

from conftest import ROOT, child_env

@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is as fast, and oversubscribed threads crawl on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY = ["--training.dataset", "synthetic", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--validation.enable=false", "--metrics.progress_bar=false", "--data.num_workers", "0"]


def test_logged_figures_agree_on_a_real_run(tmp_cache):
    """tokens/s = tokens per step / step time; tflops = tokens/s x flops/token; mfu = tflops / (GPUs x peak)."""
    cfg = load_config(TINY + ["--training.steps", "5", "--training.global_batch_size", "4", "--metrics.log_freq", "2",
                              "--metrics.peak_tflops", "0.05", "--job.dump_folder", str(tmp_cache)])
    t = Trainer(cfg)
    summary = t.train()
    log = json.loads(t.run_log.path.read_text())  # what is on disk, not the in-memory copy
    # the end-of-run summary is the run log's one rule over the steady entries (iter 1 is warm-up here)
    steady_its = log["training_iterations"][1:]
    assert summary == log["summary"] == {"steps": 5, **run_log.summarize(log["training_iterations"],
                                                                                 log["startup_info"]["config"])}
    assert summary["tokens_per_sec"] == round(sum(e["tokens_per_sec"] for e in steady_its) / 3)
    assert None not in summary.values() and "val_loss" not in summary
    c = log["startup_info"]["config"]
    assert (c["world_size"], c["batch_size"], c["gradient_accumulation_steps"]) == (1, 2, 2)
    for key in ("compile", "use_cuda_graphs", "use_dataloader"):
        assert key in c
    assert log["startup_info"]["hardware"]["peak_tflops_per_gpu"] == 0.05
    its = log["training_iterations"]
    assert [e["iter"] for e in its] == [1, 2, 4, 5]
    tokens_per_step = 4 * 32
    for e in its:
        assert e["tokens_per_sec"] == pytest.approx(tokens_per_step / (e["time_ms"] / 1000), rel=1e-9)
        assert e["tokens_per_sec_per_gpu"] == pytest.approx(e["tokens_per_sec"], rel=1e-12)
        assert e["tflops"] == pytest.approx(e["tokens_per_sec"] * t.flops_per_token / 1e12, rel=1e-9)
        assert e["mfu"] == pytest.approx(100 * e["tflops"] / (1 * 0.05), rel=1e-9)
        assert {"loss", "lr", "grad_norm", "memory_gb", "memory_peak_gb", "memory_reserved_gb"} <= e.keys()
        b = e["breakdown"]
        assert b["method"] == "wall_clock" and b["slowest_rank"] == 0 and len(b["ranks"]) == 1
        r = b["ranks"][0]
        assert r["step_ms"] == e["time_ms"]
        assert r["compute_ms"] > 0 and r["optimizer_ms"] > 0 and r["idle_ms"] >= 0
        assert b["stats"]["compute_ms"]["median"] == r["compute_ms"]


@pytest.mark.alone  # the idle it bounds is a timing: another test's load would add to it
def test_a_known_sleep_is_measured_in_the_phase_it_sits_in(tmp_cache):
    """40 ms slept after each micro-batch is fetched (debug.inject_data_delay_ms, inside the data
    phase): every logged step's data phase holds both micro-batches' sleeps, and neither compute
    nor the unaccounted remainder (idle) takes them."""
    cfg = load_config(TINY + ["--training.steps", "4", "--training.global_batch_size", "4", "--metrics.log_freq", "1",
                              "--debug.inject_data_delay_ms", "40", "--job.dump_folder", str(tmp_cache)])
    t = Trainer(cfg)
    t.train()
    t.close()
    for e in t.run_log.data["training_iterations"][1:]:
        r = e["breakdown"]["ranks"][0]
        assert r["data_ms"] >= 2 * 40 and r["compute_ms"] < r["step_ms"] - 2 * 40, r
        assert r["idle_ms"] < 40, r  # less than one sleep: none of them is left unaccounted


def test_killed_run_leaves_a_parseable_log(tmp_cache):
    """SIGKILL while the log is rewritten every step: the file on disk is always complete JSON."""
    proc = subprocess.Popen([sys.executable, "-m", "titanlite.train", *TINY, "--training.steps", "100000",
                             "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_cache)],
                            cwd=ROOT, env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            logs = list(tmp_cache.glob("run_*.json"))
            if logs and logs[0].stat().st_size > 0 and len(json.loads(logs[0].read_text())["training_iterations"]) >= 5:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = json.loads(next(tmp_cache.glob("run_*.json")).read_text())
    its = log["training_iterations"]
    assert len(its) >= 5 and [e["iter"] for e in its] == list(range(1, len(its) + 1))
    assert log["summary"] == {}  # it never finished


def test_run_log_one_line_and_unique_names(tmp_path):
    a, b = RunLog(tmp_path, {"config": {}}), RunLog(tmp_path, {"config": {}})
    assert a.path != b.path  # same second, different files
    a.append({"iter": 1, "mfu": 1.5})
    lines = a.path.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[-1])["training_iterations"][0]["mfu"] == 1.5  # `tail -1` parses


def test_run_log_appends_an_entry_without_rewriting_the_file(tmp_path, monkeypatch):
    """A log step writes its entry in place (a whole rewrite grows with the run); validation entries
    and the summary rewrite it. After every update the file is one line of JSON equal to the log."""
    log = RunLog(tmp_path, {"config": {"x": 1}})
    updates = [lambda i: log.append({"iter": i, "loss": 1.0 / i}), lambda i: log.add_validation({"iter": i}),
               lambda i: log.append({"iter": i, "loss": float("nan")}), lambda i: log.set_summary({"steps": i})]
    for i in range(1, 13):
        updates[i % 4](i)
        lines = log.path.read_text().splitlines()
        assert len(lines) == 1 and json.dumps(json.loads(lines[0])) == json.dumps(log.data)
    assert [e["iter"] for e in load(log.path).iterations] == [2, 4, 6, 8, 10, 12]

    def no_rewrite(_self):
        raise AssertionError("the whole file was rewritten for one entry")

    monkeypatch.setattr(RunLog, "flush", no_rewrite)
    log.append({"iter": 13, "loss": 0.5})
    assert json.loads(log.path.read_text())["training_iterations"][-1] == {"iter": 13, "loss": 0.5}


@pytest.mark.alone  # a 50 ms bound on what the intervals leave out: another test's load would stretch it
def test_log_intervals_tile_the_training_time_without_validation(tmp_cache):
    """The logged step times, each over its interval, add up to the time the loop took minus what
    it spent validating: the intervals meet end to end (each starts where the previous log step
    ended, whenever its entry is written) and validation is left out of the one it falls in."""
    cfg = load_config(TINY + ["--training.steps", "7", "--metrics.log_freq", "2", "--validation.enable",
                              "--validation.freq", "3", "--validation.steps", "20", "--debug.inject_data_delay_ms",
                              "30", "--job.dump_folder", str(tmp_cache)])
    t = Trainer(cfg)
    validating, validate = [], t.validate

    def timed_validate():
        start = time.perf_counter()
        out = validate()
        validating.append(time.perf_counter() - start)
        return out

    t.validate = timed_validate
    start = time.perf_counter()
    t.train()
    total = time.perf_counter() - start
    its = t.run_log.data["training_iterations"]
    logged = sum(e["time_ms"] / 1000 * n for e, n in zip(its, [1, 1, 2, 2, 1]))
    assert [e["iter"] for e in its] == [1, 2, 4, 6, 7] and len(validating) == 3  # steps 3, 6 and the end
    assert sum(validating) > 0.2 * total  # large enough that counting it would show
    assert total - sum(validating) - 0.05 < logged < total - sum(validating)
    t.close()


def test_log_step_is_written_while_the_next_step_runs(tmp_cache):
    """A log step's entry is written once the next step is queued (on a GPU the host then logs while
    that step runs), except where its figures are needed at once: the last step. Each entry holds
    exactly its steps' losses and its step's grad norm; a step that fails leaves the entry before it."""
    cfg = load_config(TINY + ["--training.steps", "7", "--metrics.log_freq", "2", "--job.dump_folder", str(tmp_cache)])
    t = Trainer(cfg)
    taken, written, step = [], [], t.train_step

    def train_step():
        loss, grad_norm = step()
        taken.append((loss.item(), grad_norm.item()))
        return loss, grad_norm

    log_step = t.report.log_step

    def record(at, step_losses, lr, grad_norm, *rest):
        written.append((at, len(taken), step_losses, grad_norm))
        log_step(at, step_losses, lr, grad_norm, *rest)

    t.train_step, t.report.log_step = train_step, record
    t.train()
    assert [(at, steps_taken) for at, steps_taken, _, _ in written] == [(1, 2), (2, 3), (4, 5), (6, 7), (7, 7)]
    firsts = [1, 2, 3, 5, 7]
    for (at, _, step_losses, grad_norm), first in zip(written, firsts):
        assert step_losses == pytest.approx([loss for loss, _ in taken[first - 1:at]], rel=1e-6)
        assert grad_norm == pytest.approx(taken[at - 1][1], rel=1e-6)
    assert [e["iter"] for e in t.run_log.data["training_iterations"]] == [1, 2, 4, 6, 7]
    t.close()

    t = Trainer(load_config(TINY + ["--training.steps", "9", "--metrics.log_freq", "3", "--job.dump_folder",
                                    str(tmp_cache / "failing")]))
    calls, step = [], t.train_step

    def failing_step():
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("step 5 failed")
        return step()

    t.train_step = failing_step
    with pytest.raises(RuntimeError, match="step 5 failed"):
        t.train()
    assert [e["iter"] for e in json.loads(t.run_log.path.read_text())["training_iterations"]] == [1, 3]
    t.close()


def _its(iters, **extra):
    return [{"iter": i, "loss": 3.0, "time_ms": 100.0 + i, "tokens_per_sec": 1000.0 * i, "mfu": None,
             "memory_peak_gb": float(i), **extra} for i in iters]


def test_one_steady_state_rule():
    """iter <= max(1, 10% of the last iter) is warm-up; CUDA graphs add their warm-up and capture step;
    entries a logger marks as warm-up are excluded; --warmup N replaces the cutoff; a log of warm-up
    only keeps its last entry and says so."""
    its = _its(range(0, 101, 10))
    assert [e["iter"] for e in steady(its).entries] == list(range(20, 101, 10))  # 0 and 10 <= 10
    graphs = steady(its, {"use_cuda_graphs": True, "training.cuda_graphs_warmup": 10})
    assert graphs.cutoff == 21 and [e["iter"] for e in graphs.entries] == list(range(30, 101, 10))
    marked = _its([0, 5, 10, 20])
    marked[2]["warmup"] = True
    assert [e["iter"] for e in steady(marked).entries] == [5, 20]
    assert [e["iter"] for e in steady(its, warmup_steps=50).entries] == [60, 70, 80, 90, 100]
    only = steady(_its([1]))
    assert only.only_warmup and [e["iter"] for e in only.entries] == [1] and "warm-up" in only.note
    assert not steady(its).only_warmup and steady(its).note == "" and steady(its).warmup == 2


def test_summarize_steady_means_and_no_none():
    its = _its([1, 2, 3, 4])
    s = run_log.summarize(its, {})
    assert s["tokens_per_sec"] == 3000 and s["step_ms"] == 103.0  # over iters 2-4
    assert s["peak_memory_gb"] == 4.0 and s["final_loss"] == 3.0  # over the whole run
    assert "mfu_pct" not in s and None not in s.values()  # a figure the log lacks is left out
    assert run_log.summarize([], {}) == {}


def test_typed_loader(tmp_path):
    a = RunLog(tmp_path, {"config": {"world_size": 2, "batch_size": 4, "compile": True}, "hardware": {"name": "x"}})
    for e in _its([1, 2]):
        a.append(e)
    run = load(a.path)
    assert (run.world_size, run.label, run.hardware["name"], len(run.iterations)) == (2, "2 GPUs, compile", "x", 2)
    # the label is what ran, by the resolved configuration; the free-text description is no part of it
    cfg = {"job.description": "a preset's words", "model.name": "qwen3", "model.flavor": "1.8B", "world_size": 1,
           "training.dataset": "prepared", "training.dataset_path": "data/c", "data_parallel": "fsdp",
           "use_cuda_graphs": True}
    assert ran(cfg, {}, {"device": "cuda"}) == "qwen3/1.8B, prepared data/c, 1 GPU, CUDA graphs"
    assert ran({**cfg, "world_size": 8}, {}, {"device": "cpu"}) == "qwen3/1.8B, prepared data/c, fsdp, 8 ranks, CUDA graphs"
    assert [e["iter"] for e in run.steady().entries] == [2]
    bad = tmp_path / "bad.json"
    for text, needle in (("{", "not valid JSON"), ('{"a": 1}', "not a run log"),
                         ('{"startup_info": {"config": {}}, "training_iterations": []}', "no training_iterations")):
        bad.write_text(text)
        with pytest.raises(RunLogError, match=needle):
            load(bad)
    with pytest.raises(RunLogError, match="no such file"):
        load(tmp_path / "missing.json")


class _Wrapper(nn.Module):
    """A DDP-shaped wrapper whose pre-forward 'collective' is a sleep."""

    def __init__(self, inner, wait_s):
        super().__init__()
        self.module, self.wait_s = inner, wait_s

    def forward(self, x):
        time.sleep(self.wait_s)
        return self.module(x)


def test_timer_splits_the_wrapper_wait_from_compute():
    model = _Wrapper(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1)), 0.03)
    timer = StepTimer(torch.device("cpu"), model)
    x = torch.randn(16, 64)
    for _ in range(2):
        with timer.phase("data"):
            time.sleep(0.01)
        with timer.phase("compute"):
            model(x).sum().backward()
        with timer.phase("optimizer"):
            pass
    out = timer.collect(timer.take())
    # sleeps only give lower bounds; the point is where each one lands
    assert out["comm"] >= 59  # two 30 ms waits before the wrapped forward
    assert out["data"] >= 19
    assert out["compute"] < 30  # neither wait is counted as compute
    assert timer.collect(timer.take()) == {"data": 0.0, "compute": 0.0, "optimizer": 0.0, "comm": 0.0}  # reset


def test_timer_reports_unknown_comm_when_no_gradient_hook_fires():
    timer = StepTimer(torch.device("cpu"))  # no model watched: like FSDP2, whose registered params get no hook
    with timer.phase("compute"):
        time.sleep(0.01)
    out = timer.collect(timer.take())
    assert out["comm"] is None and out["compute"] >= 9


def test_summary_stats_and_slowest_rank():
    ranks = [rank_breakdown(0, 100.0, {"data": 10, "compute": 120, "comm": 100, "optimizer": 20}, 2),
             rank_breakdown(1, 102.0, {"data": 110, "compute": 120, "comm": 0, "optimizer": 20}, 2),
             rank_breakdown(2, 101.0, {"data": 10, "compute": 130, "comm": 90, "optimizer": 20}, 2)]
    s = summarize(ranks, "wall_clock")
    assert s["slowest_rank"] == 1  # largest busy time, though its wall step equals the others'
    assert s["stats"]["data_ms"] == {"min": 5.0, "median": 5.0, "max": 55.0}
    assert s["stats"]["comm_ms"] == {"min": 0.0, "median": 45.0, "max": 50.0}
    assert ranks[0]["idle_ms"] == pytest.approx(100 - 5 - 60 - 50 - 10)
    unknown = summarize([rank_breakdown(0, 10.0, {"data": 1, "compute": 5, "comm": None, "optimizer": 1}, 1)], "x")
    assert unknown["stats"]["comm_ms"] == {"min": None, "median": None, "max": None}
    assert unknown["ranks"][0]["idle_ms"] == pytest.approx(3)


def test_console_writes_no_colour_codes_to_a_pipe(capsys):
    c = Console(True, 10, progress_bar=True)  # stderr is captured: not a terminal, so no bar
    assert c.bar is None
    c.log_step({"iter": 2, "loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "time_ms": 10.0, "tokens_per_sec": 100.0,
                "mfu": 12.5, "memory_peak_gb": 1.0})
    out = capsys.readouterr()
    assert "step      2/10" in out.out and "mfu  12.5%" in out.out and "eta" in out.out
    assert "\x1b" not in out.out + out.err


def wandb_records(path):
    """The protobuf records of a W&B run file (.wandb): a 7-byte header (':W&B', magic, version),
    then records in 32 KiB blocks, each with a 7-byte header (CRC-32, length, kind: 1 whole, 2 first,
    3 middle, 4 last piece); a block's tail shorter than a header is padding."""
    import struct

    from wandb.proto.wandb_internal_pb2 import Record

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zeros to the end of the block
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_holds_what_tensorboard_logs(tmp_cache, monkeypatch):
    """WANDB_MODE=offline, 3 steps: the offline run is under the run folder, named by the options,
    with the run log's losses by step, the other scalars TensorBoard logs, and the validation loss."""
    for var in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_ENTITY", "WANDB_DIR", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "from-the-variable")
    cfg = load_config(TINY + ["--training.steps", "3", "--metrics.log_freq", "1", "--metrics.enable_wandb",
                              "--metrics.wandb_run_name", "tiny-3", "--validation.enable", "--validation.steps", "1",
                              "--job.dump_folder", str(tmp_cache)])
    t = Trainer(cfg)
    t.train()
    t.close()
    (run_file,) = (tmp_cache / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(wandb_records(run_file))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "from-the-variable" and run.display_name == "tiny-3"
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(items["_step"], {}).update(items)
    entries = t.run_log.data["training_iterations"]
    assert sorted(history) == [1, 2, 3]
    assert [history[e["iter"]]["train/loss"] for e in entries] == pytest.approx([e["loss"] for e in entries], rel=1e-9)
    assert {"train/lr", "train/grad_norm", "perf/tokens_per_sec", "memory/peak_gb",
            "breakdown/compute_ms_median"} <= set(history[3])
    assert history[3]["val/loss"] == pytest.approx(t.run_log.data["validation"][-1]["val_loss"], rel=1e-9)


def test_wandb_offline_run_goes_where_wandb_dir_says(tmp_cache, monkeypatch):
    """W&B's own convention: with WANDB_DIR set the offline run is under $WANDB_DIR/wandb/, and nothing
    of it under the run folder (without it, the run folder: the test above)."""
    for var in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_ENTITY", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_cache / "wandb_home"))
    (tmp_cache / "wandb_home").mkdir()
    run_folder = tmp_cache / "run"
    cfg = load_config(TINY + ["--training.steps", "2", "--metrics.log_freq", "1", "--metrics.enable_wandb",
                              "--validation.enable=false", "--job.dump_folder", str(run_folder)])
    t = Trainer(cfg)
    t.train()
    t.close()
    assert len(list((tmp_cache / "wandb_home" / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    assert not (run_folder / "wandb").exists()


def test_tensorboard_and_profiler_files(tmp_cache):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(TINY + ["--training.steps", "4", "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
                              "--metrics.peak_tflops", "0.05", "--profiling.enable", "--profiling.start_step", "2",
                              "--profiling.num_steps", "2", "--job.dump_folder", str(tmp_cache)])
    t = Trainer(cfg)
    t.train()
    acc = EventAccumulator(t.report.tensorboard.log_dir)
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "perf/mfu_pct", "perf/tokens_per_sec", "breakdown/compute_ms_median"} <= set(tags)
    logged = [e["loss"] for e in t.run_log.data["training_iterations"]]
    assert [s.value for s in acc.Scalars("train/loss")] == pytest.approx(logged, rel=1e-6)
    trace = tmp_cache / "profile_traces" / "step2-3" / "rank0.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::mm" in ev.get("name", "") or "aten::addmm" in ev.get("name", "") for ev in events)


def test_eta_is_the_steps_left_at_the_steady_step_time(capsys):
    """Step 1 took 60 s (start-up, compilation), the next ones 20 s: with one step left the ETA is
    20 s, not the elapsed time per step; a resumed run counts from its own first step."""
    for start in (0, 100):
        console = Console(True, start + 10, progress_bar=False, start_step=start)
        for i, ms in enumerate([60000.0] + [20000.0] * 8, start=start + 1):
            console.log_step({"iter": i, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "time_ms": ms,
                              "tokens_per_sec": 1.0, "memory_peak_gb": 0.0})
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].endswith("eta 0:09:00")  # 9 steps left at the only time seen so far
        assert lines[-1].endswith("eta 0:00:20"), lines[-1]
