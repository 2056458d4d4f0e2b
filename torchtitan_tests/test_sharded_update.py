"""fsdp and hsdp step their local shards with MasterAdamW (with a fused kernel, as on CUDA): the same losses as
one process with torch's AdamW, the grad-norm clip reduced over the shards, and an exact resume."""

import json
import os

import pytest
import torch

from titanlite.config import load_config
from titanlite.train import Trainer

from conftest import free_port, gloo_rank, spawn
from test_parallel import base_args, step_losses

pytestmark = pytest.mark.slow
FUSED = ["--optimizer.fused", "true", "--training.max_norm", "0.5"]  # a clip that bites: the scale rides in the update
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0"]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world, port, out_dir) as out:
        _runs(rank, out_dir, out)


def _runs(rank: int, out_dir: str, out: dict) -> None:
    for name, mode in (("fsdp", ["--parallelism.data_parallel", "fsdp"]),
                       ("hsdp", ["--parallelism.data_parallel", "hsdp", "--parallelism.shard_degree", "2"])):
        folder = os.path.join(out_dir, name)
        t = Trainer(load_config(base_args(folder, 4, *mode, *FUSED, *CKPT)))
        t.train()
        resumed = Trainer(load_config(base_args(folder, 4, *mode, *FUSED, *CKPT, "--checkpoint.load_step", "4")))
        resumed.train()
        if rank == 0:  # the run log lives on rank 0
            norms = [e["grad_norm"] for e in t.run_log.data["training_iterations"]]
            out[name] = {"optimizer": type(t.optimizer).__name__, "losses": step_losses(t), "norms": norms,
                         "resumed": step_losses(resumed)}
        t.close()
        resumed.close()


def test_sharded_modes_step_their_shards_with_master_adamw(tmp_path):
    single = Trainer(load_config(base_args(tmp_path / "single", 8, *FUSED)))
    single.train()
    ref_losses = step_losses(single)
    ref_norms = [e["grad_norm"] for e in single.run_log.data["training_iterations"]]
    assert type(single.optimizer).__name__ == "AdamW"  # one process: torch's AdamW, the reference
    assert max(ref_norms) > 0.5  # the clip scales some steps
    single.close()
    spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    results = json.loads((tmp_path / "results.json").read_text())
    for name, r in results.items():
        assert r["optimizer"] == "MasterAdamW", name
        # the global norm: the shards' squares summed over the ranks (a rank's own shard alone is smaller)
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5), name
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), name
        # resumed from step 4: the optimizer's sharded state came back, bit for bit
        assert r["resumed"] == r["losses"][4:], name


def test_unfused_sharded_modes_keep_torch_adamw(tmp_path):
    """fused off (the CPU default): fsdp steps torch's AdamW over the DTensors, as before."""
    from titanlite.optim import build_optimizer

    cfg = load_config(base_args(tmp_path, 4, "--parallelism.data_parallel", "fsdp"))
    model = torch.nn.Linear(4, 4)
    assert type(build_optimizer(model, cfg, torch.device("cpu"), "fsdp")).__name__ == "AdamW"
    cfg.optimizer.fused = "true"
    assert type(build_optimizer(model, cfg, torch.device("cpu"), "fsdp")).__name__ == "MasterAdamW"
    assert type(build_optimizer(model, cfg, torch.device("cpu"), "none")).__name__ == "AdamW"
