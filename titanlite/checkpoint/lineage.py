"""Lineage: the step a run resumes from becomes the head of the line it trains.

Resuming from step N (an explicit `checkpoint.load_step`, or the previous checkpoint when the newer
ones are damaged) abandons every complete checkpoint after N. They are moved, whole, into
`<root>/abandoned-<time>/` and kept: the newest checkpoint under `<root>` is then always the newest
of the current line, a plain restart continues that line, and retention (which only looks at
`<root>/step-N`) neither deletes nor revives them. Moving one back by hand undoes the choice.

The move is journaled (`<root>/rollback.json`, written before the first folder moves, removed
after the last): a run killed half-way through it is finished by the next start before anything is
listed. Only rank 0 calls these functions; the others wait on a barrier.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from titanlite.checkpoint.layout import read_marker, step_dirs

JOURNAL = "rollback.json"
ABANDONED = "abandoned-"


def abandon_after(root: Path, step: int) -> str | None:
    """Move the complete checkpoints after `step` aside; the one log line saying so, or None."""
    later = [s for s, p in step_dirs(root).items() if s > step and read_marker(p) is not None]
    if not later:
        return None
    into = _new_folder_name(root)
    tmp = root / (JOURNAL + ".tmp")
    tmp.write_text(json.dumps({"head": step, "into": into}))
    os.replace(tmp, root / JOURNAL)
    return finish_interrupted(root, f"resuming from step-{step}")


def finish_interrupted(root: Path, why: str = "") -> str | None:
    """Carry out the journaled move, if there is one (all of it, or what a killed run left); the
    log line begins with `why` (by default: a rollback a killed run left half done)."""
    try:
        journal = json.loads((root / JOURNAL).read_text())
    except (OSError, ValueError):
        return None
    head, into = int(journal["head"]), root / Path(journal["into"]).name  # never outside root
    into.mkdir(exist_ok=True)
    moved = sorted(s for s, p in step_dirs(root).items() if s > head and read_marker(p) is not None)
    for s in moved:
        os.rename(root / f"step-{s}", into / f"step-{s}")
    already = sorted(s for s in step_dirs(into) if s not in moved)
    (root / JOURNAL).unlink()
    steps = ", ".join(f"step-{s}" for s in sorted(moved + already))
    return (f"{why or f'finishing the interrupted rollback to step-{head}'}: the later checkpoints {steps} are "
            f"moved to {into} (kept; they are no longer resumed or deleted by retention)")


def abandoned_steps(root: Path) -> dict[int, Path]:
    """step -> folder of every abandoned complete checkpoint (for error messages)."""
    out = {}
    if root.is_dir():
        for folder in sorted(root.glob(ABANDONED + "*")):
            out.update({s: p for s, p in step_dirs(folder).items() if read_marker(p) is not None})
    return out


def _new_folder_name(root: Path) -> str:
    base = name = ABANDONED + time.strftime("%Y%m%d-%H%M%S")
    n = 1
    while (root / name).exists():  # a second resume within the same second
        n += 1
        name = f"{base}-{n}"
    return name
