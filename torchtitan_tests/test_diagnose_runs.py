"""titanlite.diagnose on real CPU runs (gloo, 1, 2 and 4 processes) with faults injected on purpose.

One set of worker processes per world size trains several tiny jobs in turn in the same process
group (start-up is most of the cost on 2 cores). Every process uses one thread.

Why the 'healthy' pair is two clean 1-process runs: on a 2-core machine shared with other work, a
1 -> 2 process comparison is itself a compute stall whenever anything else runs, so it cannot be a
test of 'healthy'. Nor can two clean 2-process runs: measured on the 2-vCPU CI machine, one rank's
own work (compute, no waits) is 1.25-1.7x the other's for a whole run in about a third of such runs,
left to the scheduler, with the ranks pinned to one core each, and with both on the same core (the
two vCPUs run at unequal speeds, and time-sliced ranks lock into a fixed order). That rank really is slower, so 'straggler' is
the right answer there, not a false alarm. Two clean 1-process runs are like for like with no rank
to differ: 0 findings other than 'healthy' in 24 of 24 pairs. Each run records the share of its
wall time it spent on the CPU; a pair where other work took the core (share < 90%) is skipped.
Healthy multi-rank logs are covered by test_diagnose.py. Scaling across world sizes is tested with
the shared-device fault: 4 ranks pinned to one core against a 1-rank baseline.
"""

import json
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from titanlite.diagnose import diagnose

from conftest import free_port

BASE = ["--training.dataset", "synthetic", "--training.seq_len", "32", "--training.local_batch_size", "4",
        "--training.steps", "10", "--metrics.log_freq", "2", "--validation.enable=false", "--data.num_workers", "0",
        "--metrics.progress_bar=false", "--parallelism.data_parallel", "ddp", "--lr_scheduler.warmup_steps", "2"]

JOBS = {
    1: {"clean1": [], "clean1b": [], "seq64": ["--training.seq_len", "64"]},
    2: {"clean_a": [], "clean_b": [],
        "straggler": ["--debug.inject_compute_matmuls", "80", "--debug.inject_matmul_size", "512", "--debug.inject_rank", "1"],
        "data": ["--debug.inject_data_delay_ms", "60"],
        "comm": ["--debug.inject_comm_mb", "32"]},
    4: {"shared": ["--debug.inject_shared_device"]},
}


def _worker(rank, world, port, jobs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from titanlite.config import load_config
    from titanlite.train import Trainer

    for folder, extra in jobs:
        trainer = Trainer(load_config(BASE + ["--job.dump_folder", folder] + extra))
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.train()
        share = (time.process_time() - cpu) / (time.perf_counter() - wall)
        # freed now, as a temporary was before: a DDP model outliving destroy_process_group() below
        # can hang its rank while the process exits
        del trainer
        with open(os.path.join(folder, f"cpu_share_rank{rank}.json"), "w") as f:
            json.dump({"cpu_share": share}, f)
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    root = tmp_path_factory.mktemp("diag_runs")
    out = {}
    for world, jobs in JOBS.items():
        todo = [(str(root / name), extra) for name, extra in jobs.items()]
        mp.spawn(_worker, args=(world, free_port(), todo), nprocs=world, join=True)
        for name in jobs:
            (out[name],) = (root / name).glob("run_*.json")
    return out


def oversubscribed() -> bool:
    return os.getloadavg()[0] > (os.cpu_count() or 1)


def starved(*logs, limit: float = 0.9) -> str:
    """Which of these 1-process runs spent less than `limit` of its wall time on the CPU (other work
    took the core from it): such a run is slower for a reason outside the run."""
    for log in logs:
        for p in sorted(log.parent.glob("cpu_share_rank*.json")):
            share = json.loads(p.read_text())["cpu_share"]
            if share < limit:
                return f"{log.parent.name} ran on the CPU {share:.0%} of its wall time"
    return ""


def assert_diagnosed(rep, kind):
    """The injected fault is the verdict. When other work oversubscribes the CPU, that load makes
    real stragglers and stalls of its own, which may outrank the injected one: then the injected
    fault must still be among the findings."""
    found = [f["kind"] for f in rep["findings"]]
    if oversubscribed():
        assert kind in found, rep["findings"]
    else:
        assert rep["verdict"] == kind, rep["findings"]
    return next(f for f in rep["findings"] if f["kind"] == kind)


def check(tmp_path, *logs):
    a = diagnose([str(p) for p in logs], tmp_path / "report")
    rep = json.loads((tmp_path / "report" / "report.json").read_text())
    assert rep["verdict"] == a.verdict
    assert (tmp_path / "report" / "phases.png").stat().st_size > 0
    return rep


def test_healthy_clean_pair(logs, tmp_path):
    if oversubscribed():
        # other work on this machine slows one run and not the other: the tool then reports a real
        # stall, and 'healthy' is not the right answer to test for
        pytest.skip(f"CPU oversubscribed by other work (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    if why := starved(logs["clean1"], logs["clean1b"]):
        pytest.skip(f"not like for like: {why}")
    rep = check(tmp_path, logs["clean1"], logs["clean1b"])
    assert [f["kind"] for f in rep["findings"]] == ["healthy"], rep["findings"]
    assert rep["scaling_efficiency"]["mode"] == "same_world_size"
    assert all(c["ok"] for checks in rep["self_consistency"].values() for c in checks)


def test_shared_device_is_a_compute_stall(logs, tmp_path):
    """4 ranks on one core vs 1 rank: identical per-GPU work, compute per micro-step ~4x."""
    rep = check(tmp_path, logs["shared"], logs["clean1"])
    ev = assert_diagnosed(rep, "compute_stall")["evidence"]
    assert rep["scaling_efficiency"]["mode"] == "weak"
    assert ev["compute_ms_per_micro_step"] > 2 * ev["baseline_compute_ms_per_micro_step"]


def test_one_slow_rank_is_a_straggler(logs, tmp_path):
    rep = check(tmp_path, logs["clean_a"], logs["straggler"])
    f = assert_diagnosed(rep, "straggler")
    assert f["evidence"]["rank"] == 1 and f["evidence"]["phase"] == "compute"


def test_slow_data_path_is_a_data_stall(logs, tmp_path):
    rep = check(tmp_path, logs["clean_a"], logs["data"])
    assert assert_diagnosed(rep, "data_stall")["evidence"]["data_ms_per_micro_step"] >= 60


def test_extra_collective_traffic_is_communication(logs, tmp_path):
    rep = check(tmp_path, logs["clean_a"], logs["comm"])
    assert_diagnosed(rep, "communication")


def test_doctored_tokens_per_sec_is_a_measurement_inconsistency(logs, tmp_path):
    log = json.loads(logs["clean_b"].read_text())
    for e in log["training_iterations"]:
        e["tokens_per_sec"] *= 2  # e.g. a logger counting every token twice
    doctored = tmp_path / "doctored.json"
    doctored.write_text(json.dumps(log))
    rep = check(tmp_path, logs["clean_a"], doctored)
    assert rep["verdict"] == "measurement_inconsistency", rep["findings"]
    ev = rep["findings"][0]["evidence"]["tokens/s = tokens per step / step time"]
    assert ev["logged"] == pytest.approx(2 * ev["recomputed"], rel=1e-6)


def test_different_seq_len_is_a_config_mismatch(logs, tmp_path):
    rep = check(tmp_path, logs["clean1"], logs["seq64"])
    assert rep["verdict"] == "config_mismatch"
    assert "seq_len" in rep["findings"][0]["evidence"]


def test_cli_on_real_logs(logs, tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, "-m", "titanlite.diagnose", str(logs["clean1"]), str(logs["shared"]),
                        "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.startswith("verdict: compute_stall"), r.stdout + r.stderr
    assert (out / "report.md").read_text().startswith("# Scaling diagnosis\n\n**Verdict: `compute_stall`**")
    assert json.loads((out / "report.json").read_text())["verdict"] == "compute_stall"
    assert (out / "ranks.png").stat().st_size > 0
