"""Checkpoints: DCP save/load with async modes and retention (manager), preemption handling,
and the Hugging Face safetensors layout for export and initial load (hf, export)."""

from titanlite.checkpoint.manager import Checkpointer, checkpoint_root, complete_steps
from titanlite.checkpoint.preemption import Preemption

__all__ = ["Checkpointer", "Preemption", "checkpoint_root", "complete_steps"]
