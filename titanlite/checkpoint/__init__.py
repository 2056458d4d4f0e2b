"""Checkpoints: DCP save/load with async modes, retention, lineage and integrity checks (manager,
lineage, integrity, state_file, writer), preemption handling, and the Hugging Face safetensors
layout for export and initial load (hf, export)."""

from titanlite.checkpoint.layout import checkpoint_root, complete_steps
from titanlite.checkpoint.manager import Checkpointer, CheckpointSaveError, finished_line
from titanlite.checkpoint.preemption import Preemption

__all__ = ["Checkpointer", "CheckpointSaveError", "Preemption", "checkpoint_root", "complete_steps", "finished_line"]
