"""Writes this folder's checkpoint with the titanlite checkout on PYTHONPATH (the fixture was made by
commit 364d93a, before checkpoints were read through the restricted unpickler):

    PYTHONPATH=/path/to/old/checkout python torchtitan_tests/data/checkpoint_364d93a/make.py OUT

A 4-step run of a test-sized llama flavor ("tiny", registered here and by the test) on synthetic data,
checkpointed at step 2 (kept) and step 4 (removed); its per-step losses go to losses.json."""

import json
import shutil
import sys
from pathlib import Path

from titanlite.models import MODEL_REGISTRY
from titanlite.models.args import ModelArgs

TINY = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=64, ffn_dim=64)
ARGS = ["--model.flavor", "tiny", "--training.dataset", "synthetic", "--training.steps", "4",
        "--training.seq_len", "16", "--training.local_batch_size", "2", "--optimizer.lr", "3e-3",
        "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--validation.enable=false",
        "--metrics.progress_bar=false", "--data.num_workers", "0", "--checkpoint.enable",
        "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]


def main(out: str) -> None:
    from titanlite.config import load_config
    from titanlite.metrics.run_log import step_losses
    from titanlite.train import Trainer

    MODEL_REGISTRY["llama"].flavors["tiny"] = TINY
    run = Path(out) / "run"
    t = Trainer(load_config(ARGS + ["--job.dump_folder", str(run)]))
    t.train()
    t.close()
    losses = step_losses(t.run_log.data["training_iterations"])
    shutil.copytree(run / "checkpoint" / "step-2", Path(out) / "step-2")
    (Path(out) / "losses.json").write_text(json.dumps({str(k): v for k, v in losses.items()}, indent=1))
    shutil.rmtree(run)


if __name__ == "__main__":
    main(sys.argv[1])
