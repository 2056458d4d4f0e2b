"""Reading run logs for the tools: expand files and folders, load, label, average the steady part.

Unreadable input (missing path, invalid JSON, not a titanlite/seed run log) raises RunLogError with
one line naming the file; the CLIs turn it into `error: ...` and exit code 2.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


class RunLogError(Exception):
    pass


@dataclass
class Run:
    path: Path
    data: dict

    @property
    def config(self) -> dict:
        return self.data["startup_info"]["config"]

    @property
    def iterations(self) -> list[dict]:
        return self.data["training_iterations"]

    @property
    def label(self) -> str:
        """job.description if set, else the seeds' naming: compile / DL / CG options joined, or 'baseline'."""
        cfg = self.config
        if cfg.get("job.description"):
            return cfg["job.description"]
        opts = [name for key, name in (("compile", "compile"), ("use_dataloader", "DL"), ("use_cuda_graphs", "CG"))
                if cfg.get(key)]
        return "+".join(opts) if opts else "baseline"

    def steady(self, warmup: int) -> list[dict]:
        """Entries after the first `warmup` ones (the seeds skip 50); half of them if the run is shorter."""
        it = self.iterations
        return it[warmup:] if len(it) > warmup else it[len(it) // 2:]


def expand(inputs: list[str]) -> list[Path]:
    """Files as given; folders become their run_*.json files, oldest first."""
    out = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(p.glob("run_*.json"), key=os.path.getmtime)
            if not found:
                raise RunLogError(f"{p}: no run_*.json run logs in this folder")
            out.extend(found)
        elif p.exists():
            out.append(p)
        else:
            raise RunLogError(f"{p}: no such file or folder")
    return out


def load(path: Path) -> Run:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise RunLogError(f"{path}: cannot read ({e})") from None
    except json.JSONDecodeError as e:
        raise RunLogError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or "training_iterations" not in data or "config" not in data.get("startup_info", {}):
        raise RunLogError(f"{path}: not a run log (needs startup_info.config and training_iterations)")
    if not data["training_iterations"]:
        raise RunLogError(f"{path}: the run log has no training iterations yet")
    return Run(path, data)


def load_all(inputs: list[str]) -> list[Run]:
    return [load(p) for p in expand(inputs)]


def mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None
