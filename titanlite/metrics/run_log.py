"""The run log: <dump_folder>/run_<timestamp>.json, valid JSON at every moment.

Each update rewrites a temporary file and renames it over the log (atomic on POSIX), so a run
killed at any point leaves the last complete version. The layout is what the seed guides'
analysis snippets read: {"startup_info": {...}, "training_iterations": [{...}, ...]}. It is
written on one line, so `tail -1 run_*.json | python -c "import json,sys; json.load(sys.stdin)"`
(the seeds' live-MFU monitor) parses it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class RunLog:
    def __init__(self, folder: str | os.PathLike, startup_info: dict, stamp: str | None = None):
        self.folder = Path(folder)
        self.stamp = stamp or _unique_stamp(self.folder)
        self.path = self.folder / f"run_{self.stamp}.json"
        self.data = {"startup_info": startup_info, "training_iterations": [], "validation": [], "summary": {}}
        self.flush()

    def append(self, entry: dict) -> None:
        self.data["training_iterations"].append(entry)
        self.flush()

    def add_validation(self, entry: dict) -> None:
        self.data["validation"].append(entry)
        self.flush()

    def set_summary(self, summary: dict) -> None:
        self.data["summary"] = summary
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        with open(tmp, "w") as fh:
            json.dump(self.data, fh, separators=(",", ":"))
            fh.write("\n")
        os.replace(tmp, self.path)


def _unique_stamp(folder: Path) -> str:
    """run_<YYYYmmdd_HHMMSS>, suffixed _1, _2, ... when several runs start in the same second."""
    base = time.strftime("%Y%m%d_%H%M%S")
    stamp, n = base, 0
    while (folder / f"run_{stamp}.json").exists():
        n += 1
        stamp = f"{base}_{n}"
    return stamp
