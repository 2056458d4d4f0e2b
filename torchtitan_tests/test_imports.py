"""Importing titanlite and estimation has no side effects on the process: no environment variable set,
no warnings filter installed. What a training process sets for itself, it sets where it starts
(titanlite.train.start_process)."""

import json
import os
import subprocess
import sys

from conftest import ROOT

_EVERY_MODULE = r"""
import importlib, json, os, sys, warnings
from pathlib import Path

import sympy  # noqa: F401  (sympy, which torch loads on first use, installs a filter of its own at import)
import torch  # torch's own import is torch's doing, not titanlite's

env, filters = dict(os.environ), list(warnings.filters)
changed, skipped = [], []
names = sorted(".".join(p.with_suffix("").parts).removesuffix(".__init__")  # found on disk: listing imports nothing
               for pkg in ("titanlite", "estimation") for p in Path(pkg).rglob("*.py"))
for name in names:
    e, f = dict(os.environ), list(warnings.filters)
    try:
        importlib.import_module(name)
    except ImportError as err:  # an optional dependency this machine lacks (triton off CUDA)
        if (err.name or "").split(".")[0] in ("titanlite", "estimation"):
            raise
        skipped.append(name)
        continue
    if dict(os.environ) != e:
        changed.append(f"{name} sets {sorted(k for k in set(os.environ) | set(e) if os.environ.get(k) != e.get(k))}")
    if list(warnings.filters) != f:
        changed.append(f"{name} adds warnings filters {[x for x in warnings.filters if x not in f]}")
print(json.dumps({"modules": len(names), "skipped": skipped, "changed": changed,
                  "env_same": dict(os.environ) == env, "filters_same": list(warnings.filters) == filters}))
"""


def test_importing_any_module_changes_no_environment_variable_and_no_warnings_filter():
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}  # as a fresh shell has it
    r = subprocess.run([sys.executable, "-c", _EVERY_MODULE], capture_output=True, text=True, cwd=ROOT,
                       env={**env, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["changed"] == [] and got["env_same"] and got["filters_same"], got
    assert got["modules"] > 80 and set(got["skipped"]) <= {"titanlite.ops.master_adamw"}, got  # triton: CUDA only
