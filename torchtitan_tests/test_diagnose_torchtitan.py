"""diagnose reads torchtitan's console output with no flags: the world size from the device-mesh line
(or global batch / (local batch x accumulation) where one GPU builds no mesh), the data-parallel mode
from the mesh's degrees, the model from its printed parameter count, the GPU and its peak from the
start-up lines.

The logs are the files in torchtitan_tests/data/diagnose/torchtitan/ (its README gives the naming):
real outputs of torchtitan 0.2.2 and 0.3.0 runs where they have been added, and logs constructed from
torchtitan's format strings. Every file named by the scheme is tested, so adding a real log adds it.
"""

import json
import re
import statistics
import subprocess
import sys

import pytest

from titanlite.diagnose import Settings
from titanlite.diagnose.readers import read, torchtitan_world
from titanlite.diagnose.reconstruct import model_args
from titanlite.hardware import lookup
from titanlite.metrics.run_log import RunLogError

from conftest import ROOT, concurrently

FOLDER = ROOT / "torchtitan_tests" / "data" / "diagnose" / "torchtitan"
NAME = re.compile(r"^(?P<origin>constructed|real)_(?P<version>\d+\.\d+\.\d+)_(?P<gpus>\d+)gpu_(?P<mode>fsdp|ddp)"
                  r"\.(?P<form>tee|rank0|runsh)\.log$")
LOGS = {p.name: NAME.match(p.name).groupdict() for p in sorted(FOLDER.glob("*.log")) if NAME.match(p.name)}
WHOLE = [n for n, m in LOGS.items() if m["form"] != "runsh"]  # the whole output: everything diagnose needs
RUNSH = [n for n, m in LOGS.items() if m["form"] == "runsh"]


def test_every_log_is_named_by_the_scheme():
    """A file the scheme does not name would be silently left out of the tests."""
    assert sorted(p.name for p in FOLDER.glob("*.log")) == sorted(LOGS)
    for version in ("0.2.2", "0.3.0"):  # both releases, one and two GPUs, both modes
        have = {(m["gpus"], m["mode"]) for m in LOGS.values() if m["version"] == version and m["form"] != "runsh"}
        assert {("1", "fsdp"), ("2", "fsdp"), ("2", "ddp")} <= have, (version, have)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "titanlite.diagnose", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("name", WHOLE)
def test_whole_output_reads_without_flags(name):
    meta, text = LOGS[name], (FOLDER / name).read_text()
    if meta["form"] == "tee":  # the file is what it says: torchrun's prefix and torchtitan's colours
        assert text.startswith("[rank0]:") and "\x1b[" in text
    log = read(FOLDER / name)
    cfg, world = log.config, int(meta["gpus"])
    assert cfg["world_size"] == world and not log.overrides
    assert cfg.get("data_parallel") == (meta["mode"] if world > 1 else None)
    assert cfg["global_batch_size"] == cfg["batch_size"] * cfg["gradient_accumulation_steps"] * world
    assert cfg["compile"] is True
    assert model_args(log) is not None and f"{log.model['name']}/{log.model['flavor']}" == "llama/1.36B"
    hw = lookup(log.hardware["name"])
    assert hw is not None and log.hardware["peak_tflops_per_gpu"] == pytest.approx(hw.peak_tflops, rel=0.01)
    steps = [e["iter"] for e in log.iterations]
    assert steps == sorted(set(steps)) and len(steps) >= 2  # the real runs: 8 steps, logged at 1 and 5
    assert all(e["tokens_per_sec_per_gpu"] > 0 and e["memory_reserved_peak_gb"] > 0 for e in log.iterations)


@pytest.mark.parametrize("name", RUNSH)
def test_step_lines_alone_ask_for_the_world_size(commands, name):
    """run.sh passes on step lines only: no line says the world size, so diagnose asks for it (one line,
    exit 2) and reads the log once it is given."""
    gpus = LOGS[name]["gpus"]
    r, _ = commands[name]
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "pass --gpus" in r.stderr, r.stderr
    log = read(FOLDER / name, Settings(gpus=int(gpus), local_batch=4, seq_len=2048))
    assert log.config["world_size"] == int(gpus) and log.overrides["world_size"] == (None, int(gpus))


def pairs():
    """Each two-GPU whole log with the one-GPU whole log of the same origin and version."""
    out = []
    for name, m in LOGS.items():
        if name in WHOLE and m["gpus"] != "1":
            one = [n for n in WHOLE if LOGS[n]["gpus"] == "1" and all(LOGS[n][k] == m[k] for k in ("origin", "version"))]
            out += [pytest.param(one[0], name, id=name)] if one else []
    return out


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """The commands of the run.sh-log and pair tests, run two at a time (each is mostly its start-up):
    {name: (its result, its --out folder)} for each run.sh log alone and each pair of whole logs."""
    todo = {name: [FOLDER / name] for name in RUNSH}
    todo |= {(p.values[0], p.values[1]): [FOLDER / p.values[0], FOLDER / p.values[1]] for p in pairs()}
    outs = {key: tmp_path_factory.mktemp("diagnose") / "out" for key in todo}
    results = concurrently(*[lambda key=key: cli(*todo[key], "--out", outs[key]) for key in todo])
    return {key: (r, outs[key]) for key, r in zip(todo, results)}


@pytest.mark.parametrize("one,two", pairs())
def test_one_and_two_gpus_diagnosed_without_flags(commands, one, two):
    """The pair gives a report with no flag: world sizes, model and GPU from the logs, each log read as
    it says (torchtitan's MFU is titanlite's convention on the same dense peak)."""
    r, out = commands[one, two]
    assert r.returncode == 0, r.stderr
    rep = json.loads((out / "report.json").read_text())
    runs = rep["reconstruction"]["runs"]
    assert [x["gpus"] for x in runs] == [1, 2] and all(x["overrides"] == {} for x in runs)
    assert "--gpus" not in rep["settle_with"] and "--model" not in rep["settle_with"]
    assert rep["scaling_efficiency"]["mode"] == "weak"
    for x, name in zip(runs, (one, two)):
        assert x["reading"] == [] and x["plausibility"] == "possible", x["why"]
        logged = statistics.median(e["mfu"] for e in read(FOLDER / name).steady().entries)
        assert x["mfu_dense_pct"] == pytest.approx(logged, rel=0.01)


def test_world_size_rules():
    """The mesh's data-parallel degrees give the world size and mode; a mesh that also splits the model
    gives none (diagnose models data parallelism); without a mesh line, global batch over local batch x
    accumulation."""
    cases = [("pp=1, dp_replicate=2, dp_shard=4, cp=1, tp=1, ep=1", {}, 8, "hsdp"),
             ("pp=1, dp_replicate=1, dp_shard=8, cp=1, tp=1, ep=8, etp=1", {}, 8, "fsdp"),
             ("pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=2, ep=1", {}, None, None),
             (None, {"global_batch_size": 32, "batch_size": 4, "gradient_accumulation_steps": 2}, 4, None),
             (None, {"global_batch_size": 30, "batch_size": 4, "gradient_accumulation_steps": 2}, None, None)]
    for mesh, cfg, world, mode in cases:
        notes = []
        text = f"[titan] - root - INFO - Building device mesh with parallelism: {mesh}\n" if mesh else ""
        torchtitan_world(text, cfg, notes)
        assert (cfg.get("world_size"), cfg.get("data_parallel")) == (world, mode), (mesh, cfg)
        assert bool(notes) == ("tp=2" in (mesh or ""))
    with pytest.raises(RunLogError, match="pass --gpus"):
        read(FOLDER / RUNSH[0])
