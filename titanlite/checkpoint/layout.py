"""Where checkpoints live on disk and which of them count.

`<job.dump_folder>/<checkpoint.folder>/step-N/` holds one checkpoint; it counts once `complete.json`
(the marker, written last) is in it. Steps abandoned by a resume from an earlier step live under
`abandoned-<time>/step-N/` beside them (titanlite.checkpoint.lineage) and never count.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

MARKER = "complete.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
# Version of the layout inside a step folder: 2 = titanlite's own state as JSON + safetensors
# (rank_<r>.json / rank_<r>.safetensors), per-file checksums in the marker.
FORMAT = 2


def checkpoint_root(cfg) -> Path:
    return Path(cfg.job.dump_folder) / cfg.checkpoint.folder


def step_dirs(root: Path) -> dict[int, Path]:
    """step -> folder for every step-N folder under root (complete or not)."""
    if not root.is_dir():
        return {}
    return {int(m.group(1)): p for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()}


def read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def complete_steps(root: Path) -> list[int]:
    """Steps with a completion marker, newest first."""
    return sorted((s for s, p in step_dirs(root).items() if read_marker(p) is not None), reverse=True)
