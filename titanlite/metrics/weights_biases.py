"""Weights & Biases logging (metrics.enable_wandb), rank 0 only: the scalars TensorBoard gets
(titanlite.metrics.tensorboard.step_scalars), by the same tags and steps, and the validation loss.

Project, run name and entity come from the metrics options, else from W&B's own variables
(WANDB_PROJECT, WANDB_NAME, WANDB_ENTITY); WANDB_MODE=offline keeps the run on disk, with no
network (`wandb sync` uploads it later). Its files go where W&B's own WANDB_DIR says ($WANDB_DIR/wandb/),
else under the run folder (<dump_folder>/wandb/). The resolved configuration is the run's config.
"""

from __future__ import annotations

import os

from titanlite.errors import require
from titanlite.metrics.tensorboard import step_scalars


class WandB:
    def __init__(self, cfg, config: dict, run_name: str):
        wandb = require("wandb", "metrics.enable_wandb")
        m = cfg.metrics
        self.run = wandb.init(project=m.wandb_project or os.environ.get("WANDB_PROJECT") or "titanlite",
                              name=m.wandb_run_name or os.environ.get("WANDB_NAME") or run_name,
                              entity=m.wandb_entity or os.environ.get("WANDB_ENTITY") or None,
                              dir=os.environ.get("WANDB_DIR") or cfg.job.dump_folder, config=config)

    def log_step(self, e: dict) -> None:
        self.run.log(step_scalars(e), step=e["iter"])

    def log_validation(self, step: int, val_loss: float) -> None:
        self.run.log({"val/loss": val_loss}, step=step)

    def close(self) -> None:
        self.run.finish()
