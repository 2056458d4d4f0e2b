"""The run log: <dump_folder>/run_<timestamp>.json, valid JSON at every moment.

Each update rewrites a temporary file and renames it over the log (atomic on POSIX), so a run
killed at any point leaves the last complete version. The layout is what the seed guides'
analysis snippets read: {"startup_info": {...}, "training_iterations": [{...}, ...]}.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class RunLog:
    def __init__(self, folder: str | os.PathLike, startup_info: dict, stamp: str | None = None):
        self.folder = Path(folder)
        self.stamp = stamp or time.strftime("%Y%m%d_%H%M%S")
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
            json.dump(self.data, fh, indent=1)
        os.replace(tmp, self.path)
