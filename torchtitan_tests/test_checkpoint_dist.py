"""Checkpointing across processes (2 ranks, gloo, torchrun): kill -9 and resume bit for bit, ddp save ->
fsdp load, SIGTERM -> a loadable checkpoint at the step reached.

Each run is the real command line (`torchrun -m titanlite.train ...`). Steps are slowed with the debug
data-delay hook (it sleeps, so it changes no number) to leave time to kill or signal mid-run.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titanlite.config import load_config
from titanlite.metrics.run_log import step_losses
from titanlite.train import Trainer

from conftest import ROOT, child_env

pytestmark = pytest.mark.slow
STEPS = 8


def args(folder, *extra: str, local_batch: int = 2) -> list[str]:
    return ["--training.dataset", "python_stdlib", "--training.steps", str(STEPS), "--training.seq_len", "32",
            "--training.local_batch_size", str(local_batch), "--optimizer.lr", "3e-3",
            "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--validation.enable=false",
            "--metrics.progress_bar=false", "--data.num_workers", "0", "--job.dump_folder", str(folder),
            "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0", *extra]


def torchrun(*argv: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "titanlite.train", *argv]


ENV = child_env()


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def losses_by_step(log: Path) -> dict[int, float]:
    """{step: loss} from a run log (each entry holds the per-step losses since the previous one)."""
    return step_losses(json.loads(log.read_text())["training_iterations"])


def run_logs(folder: Path) -> list[Path]:
    return sorted(folder.glob("run_*[0-9].json"))


def job_pids(agent: int) -> list[int]:
    """The torchrun agent and every process below it (workers run in sessions of their own, so a
    process-group kill would miss them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [agent]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def signal_job(agent: int, sig: int) -> None:
    for pid in job_pids(agent):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def wait_for(predicate, proc, timeout: float = 180.0) -> None:
    end = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"run ended early:\n{proc.stdout.read()[-3000:]}"
        assert time.time() < end, "timed out"
        time.sleep(0.1)


FSDP = ("--parallelism.data_parallel", "fsdp", "--data.num_workers", "1")  # a loader worker's state too


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """fsdp on 2 ranks, 8 steps, a checkpoint every 2 steps, all kept: the run the kill -9 resume is held
    to and the one the rollback starts from (each test copies it); its folder and {step: loss}."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    run(torchrun(*args(folder, *FSDP)))
    expected = losses_by_step(run_logs(folder)[0])
    assert sorted(expected) == list(range(1, STEPS + 1))
    return folder, expected


def test_kill9_resume_is_bit_exact(tmp_cache, uninterrupted):
    """fsdp on 2 ranks: kill -9 after the step-4 checkpoint, run the same command again; every loss after
    the resume equals the uninterrupted run's bit for bit."""
    _, expected = uninterrupted
    folder = tmp_cache / "killed"
    cmd = torchrun(*args(folder, *FSDP, "--debug.inject_data_delay_ms", "300"))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: (folder / "checkpoint" / "step-4" / "complete.json").exists(), proc)
    signal_job(proc.pid, signal.SIGKILL)  # agent, both ranks and their loader workers: no chance to clean up
    proc.wait()
    assert not (folder / "checkpoint" / f"step-{STEPS}" / "complete.json").exists(), "killed too late"
    time.sleep(1.1)  # run logs are stamped to the second

    r = run(cmd)  # the same command resumes from the newest complete checkpoint
    resumed_from = int(re.search(r"resumed from checkpoint .*step-(\d+)", r.stdout + r.stderr).group(1))
    assert 4 <= resumed_from < STEPS
    got = losses_by_step(run_logs(folder)[-1])
    assert sorted(got) == list(range(resumed_from + 1, STEPS + 1))
    assert got == {s: expected[s] for s in got}, (resumed_from, got, expected, r.stdout[-3000:])  # bit for bit


def test_ddp_save_fsdp_load(tmp_cache):
    """A checkpoint written by ddp, resumed under fsdp (DCP reshards model and optimizer): the losses
    after the resume match the ddp run's within float tolerance."""
    run(torchrun(*args(tmp_cache, "--parallelism.data_parallel", "ddp", "--checkpoint.interval", "4")))
    ddp = losses_by_step(run_logs(tmp_cache)[0])
    time.sleep(1.1)
    r = run(torchrun(*args(tmp_cache, "--parallelism.data_parallel", "fsdp", "--checkpoint.load_step", "4")))
    assert "resumed from checkpoint" in r.stdout + r.stderr
    fsdp = losses_by_step(run_logs(tmp_cache)[-1])
    assert sorted(fsdp) == [5, 6, 7, 8]
    assert [fsdp[s] for s in fsdp] == pytest.approx([ddp[s] for s in fsdp], rel=1e-5)
    assert len({round(v, 3) for v in fsdp.values()}) > 1  # the losses move: a real comparison


def test_sigterm_saves_loadable_checkpoint(tmp_cache):
    """SIGTERM to the job (every process, as a scheduler sends it): the ranks agree, finish the step,
    save it and exit cleanly; the checkpoint then loads (here into one process: resharded)."""
    steps = 40
    cmd = torchrun(*args(tmp_cache, "--parallelism.data_parallel", "fsdp", "--training.steps", str(steps),
                         "--checkpoint.interval", "1000", "--debug.inject_data_delay_ms", "300"))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def logged_steps() -> int:
        logs = run_logs(tmp_cache)
        try:
            return len(json.loads(logs[-1].read_text())["training_iterations"]) if logs else 0
        except ValueError:
            return 0

    wait_for(lambda: logged_steps() >= 3, proc)
    signal_job(proc.pid, signal.SIGTERM)  # the agent also forwards it: each rank sees it twice
    out, _ = proc.communicate(timeout=120)
    m = re.search(r"SIGTERM: stopped after step (\d+); checkpoint saved", out)
    assert m, out[-3000:]
    step = int(m.group(1))
    assert 3 <= step < steps
    marker = json.loads((tmp_cache / "checkpoint" / f"step-{step}" / "complete.json").read_text())
    assert marker["step"] == step and marker["world_size"] == 2
    assert losses_by_step(run_logs(tmp_cache)[-1]).keys() == set(range(1, step + 1))  # the last step was logged

    # Loadable: one process with the same global batch resumes at that step.
    t = Trainer(load_config(args(tmp_cache / "single", "--training.steps", str(steps), "--checkpoint.folder",
                                 str(tmp_cache / "checkpoint"), "--checkpoint.load_step", str(step), local_batch=4)))
    assert t.state.step == step and t.state.tokens_seen == step * 4 * 32
    t.close()


def test_rollback_and_damage_with_two_ranks(tmp_cache, uninterrupted):
    """fsdp on 2 ranks: load_step=4 moves steps 6 and 8 aside (rank 0 moves them, rank 1 waits) and
    trains them again bit for bit. Then a file that rank 1 checks (the ranks share the checksum
    reading) is damaged in the new step-8: both ranks skip it, resume step-6 and train 7 and 8 again,
    with the same losses."""
    def cmd(*extra):
        return torchrun(*args(tmp_cache, *FSDP, *extra))

    # the uninterrupted run as if it had run here: its checkpoints and run log (stamped seconds before, at its start)
    shutil.copytree(uninterrupted[0], tmp_cache, dirs_exist_ok=True)
    first = losses_by_step(run_logs(tmp_cache)[0])
    root = tmp_cache / "checkpoint"
    assert {"rank_0.json", "rank_1.json", "rank_0.safetensors", "rank_1.safetensors"} <= {
        p.name for p in (root / "step-8").iterdir()}

    r = run(cmd("--checkpoint.load_step", "4"))
    aside = list(root.glob("abandoned-*"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step-6", "step-8"]
    assert (r.stdout + r.stderr).count("later checkpoints step-6, step-8 are moved to") == 1
    assert losses_by_step(run_logs(tmp_cache)[-1]) == {s: first[s] for s in (5, 6, 7, 8)}
    time.sleep(1.1)

    marker = json.loads((root / "step-8" / "complete.json").read_text())
    damaged = sorted(marker["crc32"])[1::2][0]  # the first file of rank 1's share
    path = root / "step-8" / damaged
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 256] = bytes(256)
    path.write_bytes(bytes(data))
    r = run(cmd())
    assert f"step-8 is unusable ({damaged} is damaged (crc32 " in r.stdout + r.stderr, r.stdout[-3000:]
    assert re.search(r"resumed from checkpoint .*step-6 \(step 6\)", r.stdout + r.stderr)
    assert losses_by_step(run_logs(tmp_cache)[-1]) == {7: first[7], 8: first[8]}
