import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from titanlite.config import load_config
from titanlite.optim import lr_factor
from titanlite.train import Trainer

from conftest import ROOT, child_env


@pytest.mark.slow
def test_debug_config_learns(tmp_cache):
    """The README's ./run_train.sh default config: loss falls to <= 60% of the first step's."""
    r = subprocess.run(["./run_train.sh", "--job.dump_folder", str(tmp_cache), "--metrics.log_freq", "1",
                        "--metrics.progress_bar=false"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    log = json.loads(next(tmp_cache.glob("run_*.json")).read_text())
    losses = [e["loss"] for e in log["training_iterations"]]
    assert len(losses) == 200
    assert sum(losses[-10:]) / 10 <= 0.6 * losses[0]
    assert log["validation"] and log["summary"]["val_loss"] is not None
    assert "validation loss" in r.stdout
    assert next(tmp_cache.glob("run_*_config.toml")).read_text().startswith("[job]")


def test_logged_figures_are_consistent(tmp_cache):
    cfg = load_config(["--training.dataset", "synthetic", "--training.steps", "4", "--training.seq_len", "32",
                       "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_cache),
                       "--metrics.log_freq", "2", "--validation.enable=false"])
    t = Trainer(cfg)
    t.train()
    for e in t.run_log.data["training_iterations"]:
        assert e["tokens_per_sec"] == pytest.approx(2 * 32 / (e["time_ms"] / 1000), rel=1e-9)
        assert e["tflops"] == pytest.approx(e["tokens_per_sec"] * t.flops_per_token / 1e12, rel=1e-9)


def test_a_run_warming_up_past_its_end_says_so_at_start(tmp_cache, caplog):
    """warmup_steps >= steps: one warning line at start, before step 1, naming where the lr ends; the
    logged lr of the last step is that value."""
    cfg = load_config(["--training.dataset", "synthetic", "--training.steps", "3", "--training.seq_len", "16",
                       "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_cache), "--metrics.log_freq",
                       "1", "--validation.enable=false", "--lr_scheduler.warmup_steps", "5", "--optimizer.lr", "1e-3"])
    with caplog.at_level("WARNING", logger="titanlite"):
        t = Trainer(cfg)
    lines = [r.getMessage() for r in caplog.records if "warmup_steps" in r.getMessage()]
    assert len(lines) == 1 and "rises linearly to 50% of its peak (5.00e-04 of 1.00e-03)" in lines[0], lines
    t.train()
    t.close()
    assert t.run_log.data["training_iterations"][-1]["lr"] == pytest.approx(5e-4)


def test_tight_memory_is_said_once_from_the_allocators_retries(tmp_cache, monkeypatch, caplog):
    """alloc_retries (the CUDA allocator's cache releases, cumulative) goes into every log entry; a
    rise after the first log step is warned about once, naming the count; the first step's own
    retries (compilation, warm-up) only set the baseline."""
    import titanlite.metrics.reporter as reporter

    counts = iter([5, 5, 8, 12])
    monkeypatch.setattr(reporter, "memory_stats", lambda device: {"memory_gb": 1.0, "memory_peak_gb": 1.0,
                                                                   "memory_reserved_gb": 1.0,
                                                                   "alloc_retries": next(counts)})
    cfg = load_config(["--training.dataset", "synthetic", "--training.steps", "4", "--training.seq_len", "32",
                       "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_cache),
                       "--metrics.log_freq", "1", "--validation.enable=false", "--metrics.progress_bar=false"])
    t = Trainer(cfg)
    with caplog.at_level("WARNING", logger="titanlite"):
        t.train()
    assert [e["alloc_retries"] for e in t.run_log.data["training_iterations"]] == [5, 5, 8, 12]
    warned = [r.getMessage() for r in caplog.records if "memory is tight" in r.getMessage()]
    assert len(warned) == 1 and "released its cache 3 time(s) since the last log step" in warned[0]


def test_nan_stops_naming_the_step(tmp_cache):
    r = subprocess.run([sys.executable, "-m", "titanlite.train", "--training.dataset", "synthetic",
                        "--training.steps", "3", "--training.seq_len", "16", "--training.local_batch_size", "2",
                        "--optimizer.lr", "1e30", "--training.max_norm", "0", "--lr_scheduler.warmup_steps", "0",
                        "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_cache)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 3 and "non-finite at step" in r.stderr


def test_lr_schedules():
    f = lambda t, **kw: [lr_factor(s, 100, 10, t, 0.1, 0.2) for s in range(100)]
    for kind in ("cosine", "linear", "wsd"):
        v = f(kind)
        assert v[0] < v[9] and max(v) == pytest.approx(1.0, abs=0.1) and v[-1] == pytest.approx(0.1, abs=0.02)
    wsd = f("wsd")
    assert wsd[50] == 1.0 and wsd[85] < 1.0


def _losses(tmp, *extra):
    base = ["--training.dataset", "python_stdlib", "--training.steps", "6", "--training.seq_len", "32",
            "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--validation.enable=false",
            "--job.dump_folder", str(tmp), "--metrics.progress_bar=false", "--lr_scheduler.warmup_steps", "0"]
    t = Trainer(load_config(base + list(extra)))
    t.train()
    return [e["loss"] for e in t.run_log.data["training_iterations"]]


def test_fused_clip_matches_explicit_clip(tmp_cache):
    """The clip scale handed to the fused AdamW kernel gives the update explicit clipping gives."""
    # eps = 1 makes the AdamW update depend on the gradient scale, so clipping visibly matters
    clip = ["--training.max_norm", "0.05", "--optimizer.lr", "1e-2", "--optimizer.eps", "1.0"]
    fused = _losses(tmp_cache / "a", *clip, "--optimizer.fused", "true")
    plain = _losses(tmp_cache / "b", *clip, "--optimizer.fused", "false")
    unclipped = _losses(tmp_cache / "c", "--training.max_norm", "0", "--optimizer.lr", "1e-2", "--optimizer.eps", "1.0")
    assert fused == pytest.approx(plain, rel=1e-4)
    assert fused[-1] != pytest.approx(unclipped[-1], rel=1e-3)  # the clip did change the run


def test_chunked_loss_matches_logits_loss(tmp_cache):
    chunked = _losses(tmp_cache / "a", "--training.loss", "chunked")
    plain = _losses(tmp_cache / "b", "--training.loss", "cross_entropy")
    assert chunked == pytest.approx(plain, rel=1e-5)


@pytest.mark.parametrize("fused", ["true", "false"])
def test_skip_of_nonfinite_step(tmp_cache, monkeypatch, fused):
    """on_nan=skip: a poisoned step leaves the weights untouched, decided on device by the fused kernel
    or on the (global) gradient norm otherwise."""
    cfg = load_config(["--training.dataset", "synthetic", "--training.steps", "1", "--training.seq_len", "16",
                       "--training.local_batch_size", "2", "--optimizer.fused", fused, "--training.on_nan", "skip",
                       "--job.dump_folder", str(tmp_cache), "--validation.enable=false"])
    t = Trainer(cfg)
    assert t.step.skips_on_device == (fused == "true")
    before = [p.detach().clone() for p in t.model.parameters()]
    monkeypatch.setattr(t.step, "forward_loss", lambda i, l: t.model(i, l) * float("nan"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.train_step()
    assert all(torch.equal(a, b) for a, b in zip(before, t.model.parameters()))
    # the skipped step still uses up its lr, without torch's misordered-call warning
    assert t.lr_scheduler.last_epoch == 1
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("interval", [0, 3])
def test_garbage_is_collected_at_the_steps_every_rank_agrees_on(tmp_cache, monkeypatch, interval):
    """gc_interval 3 over 7 steps: Python's collector is off while the steps run, the young generations are
    collected after the first step (what start-up left), after steps 3 and 6 and nowhere else, and the
    collector is on again once train returns. gc_interval 0 leaves Python's collector on throughout."""
    import gc
    gc.enable()  # as a process starts (another test may have left it off)
    cfg = load_config(["--training.dataset", "synthetic", "--training.steps", "7", "--training.seq_len", "16",
                       "--training.local_batch_size", "2", "--validation.enable=false", "--job.dump_folder",
                       str(tmp_cache), "--metrics.progress_bar=false", "--training.gc_interval", str(interval),
                       # no loader workers: the monkeypatched step keeps this Trainer in a reference cycle, and
                       # workers left to the collector cost 5 s each to join wherever it next runs
                       "--data.num_workers", "0"])
    t = Trainer(cfg)
    seen, train_step = [], t.train_step
    collected = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append((t.state.step, generation)))

    def step():
        seen.append(gc.isenabled())
        return train_step()
    monkeypatch.setattr(t, "train_step", step)
    t.train()
    assert gc.isenabled()
    t.close()
    assert seen == [interval == 0] * 7
    assert collected == ([] if interval == 0 else [(1, 1), (3, 1), (6, 1)])


def test_a_failing_step_leaves_pythons_garbage_collector_on(tmp_cache, monkeypatch):
    import gc
    gc.enable()
    cfg = load_config(["--training.dataset", "synthetic", "--training.steps", "4", "--training.seq_len", "16",
                       "--training.local_batch_size", "2", "--validation.enable=false", "--job.dump_folder",
                       str(tmp_cache), "--metrics.progress_bar=false", "--data.num_workers", "0"])
    t = Trainer(cfg)

    def failing_step():
        raise RuntimeError("planted")
    monkeypatch.setattr(t, "train_step", failing_step)
    with pytest.raises(RuntimeError, match="planted"):
        t.train()
    assert gc.isenabled()
    t.close()


def test_validation_time_does_not_inflate_throughput(tmp_cache):
    """Validation between log steps is excluded from step time without dropping the steps before it:
    with a 60 ms injected data delay per step, no logged step can be faster than 60 ms."""
    cfg = load_config(["--training.dataset", "synthetic", "--training.steps", "8", "--training.seq_len", "16",
                       "--training.local_batch_size", "2", "--metrics.log_freq", "4", "--validation.freq", "2",
                       "--validation.steps", "1", "--debug.inject_data_delay_ms", "60",
                       "--job.dump_folder", str(tmp_cache), "--metrics.progress_bar=false"])
    t = Trainer(cfg)
    t.train()
    for e in t.run_log.data["training_iterations"]:
        assert e["time_ms"] >= 60, e["time_ms"]


def test_nan_stop_writes_no_checkpoint_of_nan_weights(tmp_cache):
    """A checkpoint step between log steps checks the losses first: the run stops, nothing is saved."""
    r = subprocess.run([sys.executable, "-m", "titanlite.train", "--training.dataset", "synthetic",
                        "--training.steps", "6", "--training.seq_len", "16", "--training.local_batch_size", "2",
                        "--optimizer.lr", "1e30", "--training.max_norm", "0", "--lr_scheduler.warmup_steps", "0",
                        "--metrics.log_freq", "10", "--checkpoint.enable", "--checkpoint.interval", "3",
                        "--job.dump_folder", str(tmp_cache)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 3 and "non-finite at step" in r.stderr
    assert not list((tmp_cache / "checkpoint").glob("step-*"))


@pytest.mark.parametrize("error,code", [(RuntimeError("boom"), 1), (KeyboardInterrupt(), 130)])
def test_failed_run_frees_the_trainer_before_the_process_group(tmp_cache, monkeypatch, capsys, error, code):
    """A DDP wrapper that outlives destroy_process_group can hang its rank at exit. After a crash the
    traceback holds train()'s frames, so main() must still get rid of the Trainer before the teardown,
    and exit with a code (1; 130 for Ctrl-C) after printing the traceback."""
    import weakref

    import titanlite.train as T

    trainers, seen = [], []
    init = T.Trainer.__init__

    def tracked_init(self, *args):
        init(self, *args)
        trainers.append(weakref.ref(self))

    def crash(self):
        raise error

    monkeypatch.setattr(T.Trainer, "__init__", tracked_init)
    monkeypatch.setattr(T.Trainer, "train", crash)
    monkeypatch.setattr(T.dist, "is_initialized", lambda: True)  # as under torchrun
    monkeypatch.setattr(T.dist, "destroy_process_group", lambda: seen.append(trainers[0]() is None))
    with pytest.raises(SystemExit) as exit_info:
        T.main(["--training.steps", "2", "--training.seq_len", "32", "--training.dataset", "synthetic",
                "--data.num_workers", "0", "--metrics.progress_bar=false", "--job.dump_folder", str(tmp_cache)])
    assert exit_info.value.code == code
    assert seen == [True]  # torn down once, with the Trainer already gone
    assert type(error).__name__ in capsys.readouterr().err  # the traceback was shown


def test_relative_paths_are_the_callers(tmp_cache):
    """run_train.sh from the user's folder: its config file and dump folder are relative to that folder;
    the default config (a repository file) works from there too."""
    (tmp_cache / "mine.toml").write_text('[training]\ndataset = "synthetic"\nsteps = 2\nseq_len = 16\n'
                                         'local_batch_size = 2\n[validation]\nenable = false\n')
    quick = ["--metrics.progress_bar=false", "--data.num_workers", "0"]
    r = subprocess.run([str(ROOT / "run_train.sh"), "--job.config_file", "mine.toml", "--job.dump_folder", "out", *quick],
                       capture_output=True, text=True, cwd=tmp_cache, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    log = json.loads(next((tmp_cache / "out").glob("run_*[0-9].json")).read_text())
    assert log["startup_info"]["resolved_config"]["job"]["config_file"] == str(tmp_cache / "mine.toml")
    assert len(log["training_iterations"]) == 2 and not (ROOT / "out").exists()

    r = subprocess.run([str(ROOT / "run_train.sh"), "--training.steps", "1", "--validation.enable=false", *quick],
                       capture_output=True, text=True, cwd=tmp_cache, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    log = json.loads(next((tmp_cache / "outputs" / "debug").glob("run_*[0-9].json")).read_text())  # the TOML's ./outputs/debug
    assert log["startup_info"]["resolved_config"]["job"]["config_file"] == str(ROOT / "train_configs" / "debug_model.toml")


def test_summary_holds_only_figures_the_run_produced(tmp_cache, capsys):
    """No validation, no MFU on a CPU: the summary and its console line leave them out, never 'None'."""
    cfg = load_config(["--training.dataset", "synthetic", "--training.steps", "2", "--training.seq_len", "16",
                       "--training.local_batch_size", "2", "--validation.enable=false", "--metrics.progress_bar=false",
                       "--job.dump_folder", str(tmp_cache)])
    t = Trainer(cfg)
    summary = t.train()
    t.close()
    assert None not in summary.values() and "val_loss" not in summary and summary["steps"] == 2
    assert t.run_log.data["summary"] == summary
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("steps 2 | final_loss ") and "None" not in last


@pytest.mark.slow
def test_ranks_stop_when_their_launcher_is_killed(tmp_cache):
    """kill -9 of torchrun at a 2-rank gloo run: the ranks notice within seconds, stop as on SIGTERM
    (finish the step, save it) and exit; no checkpoint appears after that one."""
    from test_checkpoint_dist import job_pids

    ckpt = tmp_cache / "checkpoint"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "titanlite.train", "--training.dataset", "synthetic", "--training.steps", "1000", "--training.seq_len", "32",
           "--training.local_batch_size", "2", "--parallelism.data_parallel", "ddp", "--validation.enable=false",
           "--metrics.progress_bar=false", "--data.num_workers", "0", "--checkpoint.enable", "--checkpoint.interval",
           "2", "--checkpoint.keep_latest_k", "0", "--debug.inject_data_delay_ms", "200", "--job.dump_folder",
           str(tmp_cache)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while not (ckpt / "step-4" / "complete.json").exists():
            assert proc.poll() is None and time.time() < deadline, "the run ended or stalled before step 4"
            time.sleep(0.2)
        ranks = [p for p in job_pids(proc.pid) if p != proc.pid]
        assert len(ranks) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 20  # under the watch's hard-exit grace: the SIGTERM path itself must end them
        while [p for p in ranks if alive(p)]:
            assert time.time() < deadline, "ranks still training after their launcher died"
            time.sleep(0.2)
        out = proc.stdout.read()  # both ranks are gone: the pipe is at its end
    finally:
        for p in [proc.pid] + [p for p in job_pids(proc.pid) if p != proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    # A rank whose watch has not fired yet learns of the stop from its peer's flag at the next step,
    # and may save and exit before its own watch looks: one notice, then both ranks stopping, is enough.
    assert out.count(f"the launcher (pid {proc.pid}) is gone: stopping as on SIGTERM") >= 1, out[-3000:]
    # rank 0 names SIGTERM, or rank 1's flag when that reached it before its own watch fired
    stopped = re.search(r"(?:SIGTERM|a signal on another rank): stopped after step (\d+); checkpoint saved", out)
    assert stopped, out[-3000:]
    step = int(stopped.group(1))
    saved = lambda: max(int(p.name.split("-")[1]) for p in ckpt.glob("step-*"))
    assert 4 <= step < 1000 and saved() == step and (ckpt / f"step-{step}" / "complete.json").exists()
    time.sleep(2)
    assert saved() == step


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_launcher_watch_only_under_torchrun(monkeypatch):
    """A process started by a shell is not watched: a run under nohup must outlive its shell."""
    from titanlite.parallel.launcher_env import Launch
    from titanlite.parallel.launcher_watch import watch_launcher

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert watch_launcher(Launch.from_environ()) is None


def test_the_launchers_environment_is_read_once_into_a_record():
    """torchrun's variables become one typed record (what a process with none of them set is: one rank
    alone), which the entry points hand down."""
    from titanlite.parallel.launcher_env import Launch

    assert Launch.from_environ({}) == Launch(world_size=1, rank=0, local_rank=0, ranks_per_host=None, torchrun=False)
    got = Launch.from_environ({"WORLD_SIZE": "16", "RANK": "9", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8",
                               "TORCHELASTIC_RUN_ID": "x"})
    assert got == Launch(world_size=16, rank=9, local_rank=1, ranks_per_host=8, torchrun=True) and not got.is_main


def test_a_training_process_sets_mkls_reproducible_mode_where_it_starts(monkeypatch):
    """start_process (the first thing titanlite.train's main does) sets MKL's strict AVX2 mode unless the
    user set a value of their own; importing titanlite sets nothing (test_imports.py)."""
    from titanlite.train import start_process

    monkeypatch.delenv("MKL_CBWR", raising=False)
    start_process()
    assert os.environ["MKL_CBWR"] == "AVX2,STRICT"
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    start_process()
    assert os.environ["MKL_CBWR"] == "COMPATIBLE"


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's reproducibility mode (x86 builds of torch)")
def test_cpu_runs_do_not_depend_on_the_thread_count(tmp_cache):
    """Same seed on 1 and 2 intra-op threads: the same weights after every step, bit for bit. Without
    MKL's strict reproducibility mode the weight gradients (a GEMM over 1,024 tokens) round differently
    from step 1 on, and the loss leaves the other run's trajectory a few steps later."""
    assert os.environ["MKL_CBWR"] == "AVX2,STRICT"  # set by conftest's start_process, before MKL's first call
    before, weights = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            t = Trainer(load_config(["--training.dataset", "synthetic", "--training.steps", "3", "--training.seq_len",
                                     "128", "--training.local_batch_size", "8", "--validation.enable=false",
                                     "--data.num_workers", "0", "--job.dump_folder", str(tmp_cache / str(threads))]))
            steps = []
            for _ in range(3):
                t.train_step()
                steps.append([p.detach().clone() for p in t.model.parameters()])
            weights.append(steps)
            t.close()
    finally:
        torch.set_num_threads(before)
    for step, (one, two) in enumerate(zip(*weights), start=1):
        assert all(torch.equal(a, b) for a, b in zip(one, two)), f"step {step}"


_ONE_PROCESS = """
import hashlib, sys, torch
from titanlite.config import load_config
from titanlite.train import Trainer, start_process
start_process()  # what titanlite.train's main does first
t = Trainer(load_config(["--training.dataset", "synthetic", "--training.steps", "2", "--training.seq_len", "256",
                         "--training.local_batch_size", "16", "--validation.enable=false", "--data.num_workers", "0",
                         "--metrics.progress_bar=false", "--job.dump_folder", sys.argv[1]]))
for _ in range(2):
    t.train_step()
h = hashlib.sha256()
for p in t.model.parameters():
    h.update(p.detach().numpy().tobytes())
print(h.hexdigest())
"""


@pytest.mark.slow
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL's reproducibility mode (x86 builds of torch)")
def test_cpu_runs_are_the_same_in_every_process(tmp_path):
    """Six processes, same seed, the debug run's shapes: the same weights after two steps, bit for bit.
    With MKL's AUTO code path on an AVX-512 CPU two processes in ten rounded their GEMMs differently.
    Two run at a time (most of a process is its single-threaded start-up)."""
    from concurrent.futures import ThreadPoolExecutor

    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}  # the value start_process sets
    one = lambda i: subprocess.run([sys.executable, "-c", _ONE_PROCESS, str(tmp_path / str(i))], capture_output=True,
                                   text=True, env=env, timeout=300)
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(one, range(6)))
    digests = set()
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
        digests.add(r.stdout.strip().splitlines()[-1])
    assert len(runs) == 6 and len(digests) == 1, digests
