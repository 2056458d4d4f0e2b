"""Two torchrun invocations, one per "node", meet through the c10d rendezvous on localhost and train
together (gloo, FSDP); their losses match a single process training on the same global batch."""

import json
import os
import subprocess
import sys

import pytest

from titanlite.config import load_config
from titanlite.train import Trainer

from conftest import ROOT, free_port


def args(folder, local_batch):
    return ["--training.dataset", "python_stdlib", "--training.steps", "4", "--training.seq_len", "32",
            "--training.local_batch_size", str(local_batch), "--optimizer.lr", "3e-3",
            "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--validation.enable=false",
            "--metrics.progress_bar=false", "--data.num_workers", "0", "--parallelism.data_parallel", "fsdp",
            "--job.dump_folder", str(folder)]


def test_two_torchrun_nodes_match_single_process(tmp_cache):
    single = Trainer(load_config(args(tmp_cache / "single", 4)))
    single.train()
    expected = [v for e in single.run_log.data["training_iterations"] for v in e["step_losses"]]

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "titanlite-test",
           "-m", "titanlite.train", *args(tmp_cache / "multi", 2)]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = []
    for p in nodes:
        try:
            outputs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            pytest.fail("torchrun nodes did not finish within 300 s")
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-3000:] for o in outputs)

    (log_path,) = (tmp_cache / "multi").glob("run_*.json")  # written by global rank 0 only
    log = json.loads(log_path.read_text())
    assert log["startup_info"]["config"]["world_size"] == 2
    assert log["startup_info"]["config"]["data_parallel"] == "fsdp"
    got = [v for e in log["training_iterations"] for v in e["step_losses"]]
    assert got == pytest.approx(expected, rel=1e-5)
