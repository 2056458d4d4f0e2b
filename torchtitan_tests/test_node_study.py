"""benchmarks/node_study.py: the presets' weak-scaling options, the outside faults around the job, bad input,
failed runs as rows, and the whole script on CPU processes (the debug model, gloo) with its estimates."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import ROOT, child_env

sys.path.insert(0, str(ROOT / "benchmarks"))
import launch  # noqa: E402
import node_study  # noqa: E402

SCRIPT = str(ROOT / "benchmarks" / "node_study.py")


def script(*argv: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=timeout,
                          env=child_env(**(env or {})))


@pytest.mark.parametrize("model, gpu", [("llama", "h100"), ("qwen3", "h100"), ("llama", "h200"), ("qwen3", "b200")])
def test_presets_keep_their_per_gpu_work_at_every_world_size(model, gpu):
    """At 8 GPUs the options give the preset's own global batch; at k GPUs the same local batch and
    accumulation per GPU, so the global batch is k/8 of it."""
    from titanlite.config import load_config

    p = node_study.preset(model, gpu)
    as_written = load_config(["--job.config_file", p.args[1]]).training
    for k in (1, 2, 4, 8):
        t = load_config(p.at(k)).training
        assert t.local_batch_size == as_written.local_batch_size
        assert t.global_batch_size * 8 == as_written.global_batch_size * k
        assert t.global_batch_size // (t.local_batch_size * k) == p.accum >= 1


def test_world_sizes_double_up_to_the_node():
    assert node_study.sizes(8) == [1, 2, 4, 8] and node_study.sizes(4) == [1, 2, 4]
    assert node_study.sizes(6) == [1, 2, 4, 6] and node_study.sizes(2) == [1, 2]
    assert node_study.preset_gpus() == ["b200", "h100", "h200"]


def test_faults_come_from_outside_the_job(tmp_path, monkeypatch):
    """p2p: NCCL_P2P_DISABLE=1 in that run's environment only; load: another process computing while that
    run (and only it) runs, ended after it, its work reported in the row. Each pair in each mode asked,
    the 2-GPU run of the preset's own mode being the plain preset."""
    monkeypatch.setattr(launch, "WORK", tmp_path)
    seen = {}

    def fake_run_train(name, args, ngpus, steps, log_freq, timeout, env=None):
        loads = [pid for pid in launch._descendants(os.getpid()) if b"load started" in
                 Path(f"/proc/{pid}/cmdline").read_bytes()] if Path("/proc").is_dir() else []
        seen[name] = {"env": env, "loads": loads, "args": args}
        return launch.Result(name, ngpus, args, rc=0)

    monkeypatch.setattr(launch, "run_train", fake_run_train)
    rc = node_study.main(["--debug", "--ngpus", "2", "--parts", "faults", "--fault-modes", "ddp,fsdp",
                          "--out", str(tmp_path / "out"), "--predictions", str(tmp_path / "none.json")])
    assert list(seen) == ["llama_2gpu_ddp", "llama_2gpu_ddp_load", "llama_2gpu_ddp_p2p", "llama_2gpu",
                          "llama_2gpu_load", "llama_2gpu_p2p"]
    for mode, suffix in (("ddp", "_ddp"), ("fsdp", "")):
        pair, load, p2p = (seen[f"llama_2gpu{suffix}{fault}"] for fault in ("", "_load", "_p2p"))
        assert p2p["env"]["NCCL_P2P_DISABLE"] == "1" and "NCCL_P2P_DISABLE" not in pair["env"] | load["env"]
        assert len(load["loads"]) == 1 and not pair["loads"] and not p2p["loads"]
        assert pair["args"] == load["args"] == p2p["args"]
        assert ("--parallelism.data_parallel" in pair["args"]) == (mode == "ddp")
    rows = {x["name"]: x for x in json.loads((tmp_path / "out" / "node_study.json").read_text())["rows"]}
    load = rows["llama_2gpu_ddp_load"]["load"]
    assert load["pid"] == seen["llama_2gpu_ddp_load"]["loads"][0] and load["ran_to_the_end"] and load["gone"]
    assert load["summary"].startswith("load: ") and " on cpu in " in load["summary"]
    assert rows["llama_2gpu_ddp"]["mode"] == "ddp" and rows["llama_2gpu"]["mode"] == "fsdp"
    assert rc == 1  # no run left a log: the diagnoses could not run, which the table says
    table = (tmp_path / "out" / "node_study.md").read_text()
    assert "| load_ddp |  | not run: fewer than two runs of it have a log | straggler, rank 1 |" in table
    assert "| p2p_fsdp |  | not run: fewer than two runs of it have a log | communication |" in table


def test_calls_side_by_side_add_up_to_one_study(tmp_path, monkeypatch):
    """--sizes splits the study over calls on different GPUs of a host: a call without the node's size
    runs its sizes and diagnoses nothing; the call with it adds the others' rows (--merge), relates each
    run to its model's 1-GPU run wherever that ran, and diagnoses the whole series."""
    monkeypatch.setattr(launch, "WORK", tmp_path)
    ran = []

    def fake_run_train(name, args, ngpus, steps, log_freq, timeout, env=None):
        ran.append(name)
        r = launch.Result(name, ngpus, args, rc=0)
        r.entries = [{"iter": s, "tokens_per_sec_per_gpu": 1000.0 / ngpus, "memory_peak_gb": 1.0} for s in range(1, 9)]
        return r

    monkeypatch.setattr(launch, "run_train", fake_run_train)
    out = tmp_path / "out"
    common = ["--debug", "--ngpus", "4", "--models", "llama", "--steps", "8", "--skip", "2", "--out", str(out),
              "--predictions", str(tmp_path / "none.json")]
    node_study.main([*common, "--sizes", "1", "--tag", "one", "--parts", "study"])
    node_study.main([*common, "--sizes", "2", "--tag", "two"])
    assert ran == ["llama_1gpu", "llama_2gpu", "llama_2gpu_ddp"]
    for tag in ("one", "two"):
        assert json.loads((out / f"node_study_{tag}.json").read_text())["diagnoses"] == []
    node_study.main([*common, "--sizes", "4", "--merge", "one,two", "--tag", "node"])
    assert ran[3:] == ["llama_4gpu", "llama_4gpu_ddp_load", "llama_4gpu_ddp_p2p"]
    data = json.loads((out / "node_study_node.json").read_text())
    rows = {x["name"]: x for x in data["rows"]}
    assert list(rows) == ["llama_1gpu", "llama_2gpu", "llama_2gpu_ddp", "llama_4gpu", "llama_4gpu_ddp_load",
                          "llama_4gpu_ddp_p2p"]
    assert [rows[n]["of_one"] for n in ("llama_1gpu", "llama_2gpu", "llama_4gpu")] == [1.0, 0.5, 0.25]
    assert [(d["name"], d["expected"]) for d in data["diagnoses"]] == [
        ("llama", "healthy"), ("load_ddp", "straggler, rank 3"), ("p2p_ddp", "communication")]
    r = script("--debug", "--ngpus", "4", "--sizes", "4", "--merge", "nope", "--out", str(out), timeout=120)
    assert r.returncode == 2 and "node_study_nope.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_failed_runs_are_rows_with_the_line_that_says_why(tmp_path):
    """The presets of the GPU nvidia-smi names, started through run_train.sh: a bad option stops each run
    in its one line, which becomes the row; no diagnosis without logs; exit 1."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\ncase \"$*\" in *query-gpu=name*) for i in 0 1 2 3; do echo 'NVIDIA H200'; done;; esac\n")
    fake.chmod(0o755)
    r = script("--parts", "study", "--models", "qwen3", "--out", str(tmp_path), "--", "--training.no_such_key", "1",
               env={"PATH": f"{fake.parent}:{os.environ['PATH']}"})
    assert r.returncode == 1, r.stderr[-2000:]
    data = json.loads((tmp_path / "node_study.json").read_text())
    assert data["preset_gpu"] == "h200" and data["ngpus"] == 4 and data["gpu"] == "NVIDIA H200"
    assert [x["name"] for x in data["rows"]] == ["qwen3_1gpu", "qwen3_2gpu", "qwen3_4gpu"]
    assert all("exit 2" in x["error"] and "no_such_key" in x["error"] for x in data["rows"])
    assert all("train_configs/qwen3_1.8b_8xh200.toml" in " ".join(run["cmd"]) for run in data["runs"])
    assert data["diagnoses"][0]["error"] == "not run: fewer than two runs of it have a log"
    table = (tmp_path / "node_study.md").read_text()
    assert "| qwen3_4gpu | 4 | 16 x 2 x 4 = 128 | - |" in table and "no_such_key" in table


@pytest.mark.parametrize("argv", [["--models", "gpt"], ["--parts", "study,peer"], ["--faults", "slow"], ["--fault-modes", "zero1"],
                                  ["--preset-gpu", "a100", "--debug"], ["--preset-gpu", "h100,h200", "--debug"],
                                  ["--steps", "5"], ["--debug", "--ngpus", "1"], [], ["--debug", "--ngpus", "4", "--sizes", "3"],
                                  ["--measured", "/no/such.json", "--preset-gpu", "h100"]])
def test_bad_input_is_one_line(argv):
    """Also: no GPU here (no nvidia-smi) and no --debug or --preset-gpu."""
    r = script(*argv, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_node_study_end_to_end_on_cpu(tmp_path):
    """--predict-only, then the study and both faults on 1 -> 2 CPU processes: every run's figures, the
    estimate beside each clean run, the load's work, three diagnoses, the logs in one archive."""
    predictions = str(tmp_path / "predictions.json")
    own_work = {"TMPDIR": str(tmp_path)}  # its run folders (launch.WORK) here, apart from another test's
    r = script("--predict-only", "--debug", "--ngpus", "2", "--models", "llama", "--predictions", predictions,
               env=own_work)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    made = json.loads(Path(predictions).read_text())
    assert sorted(made) == ["llama | h100 | 1", "llama | h100 | 2", "llama | h200 | 1", "llama | h200 | 2"]
    assert all(p["peak_gib"] > 0 and p["tokens_per_sec_per_gpu"] > 0 for p in made.values())
    out = tmp_path / "out"
    r = script("--debug", "--models", "llama", "--steps", "4", "--skip", "1", "--log-freq", "1",
               "--predictions", predictions, "--tag", "cpu", "--out", str(out), env=own_work)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    data = json.loads((out / "node_study_cpu.json").read_text())
    rows = {x["name"]: x for x in data["rows"]}
    assert list(rows) == ["llama_1gpu", "llama_2gpu", "llama_2gpu_ddp", "llama_2gpu_ddp_load", "llama_2gpu_ddp_p2p"]
    assert all(x["tps_gpu"] > 0 and x["mem"] > 0 and x["log"] for x in rows.values())
    assert [rows[n]["global_batch"] for n in rows] == [4, 8, 8, 8, 8]
    for name in ("llama_1gpu", "llama_2gpu"):
        x, p = rows[name], made[f"llama | h100 | {rows[name]['k']}"]
        assert x["predicted"] == p and x["err_tps_gpu"] == pytest.approx(100 * (p["tokens_per_sec_per_gpu"] / x["tps_gpu"] - 1))
    assert "predicted" not in rows["llama_2gpu_ddp_load"] and "predicted" not in rows["llama_2gpu_ddp_p2p"]
    assert rows["llama_2gpu_ddp"]["predicted"] is None  # predict-only covers the study's runs, not the pairs' ddp
    assert rows["llama_2gpu_ddp_load"]["load"]["ran_to_the_end"] and rows["llama_2gpu_ddp_load"]["load"]["gone"]
    kinds = {"healthy", "scaling_loss", "compute_stall", "straggler", "communication", "host_overhead", "data_stall"}
    d = {x["name"]: x for x in data["diagnoses"]}
    assert list(d) == ["llama", "load_ddp", "p2p_ddp"] and all(x["verdict"] in kinds for x in d.values())
    assert [g for g, _ in d["llama"]["efficiency"]] == [1, 2] and d["load_ddp"]["gpus"] == [2, 2]
    assert d["load_ddp"]["logs"] == [rows["llama_2gpu_ddp"]["log"], rows["llama_2gpu_ddp_load"]["log"]]
    table = (out / "node_study_cpu.md").read_text()
    assert table.strip() in r.stdout
    assert f"| llama_2gpu | 2 | 2 x 2 x 2 = 8 | {rows['llama_2gpu']['tps_gpu']:,.0f} |" in table
    assert f"| load_ddp | 2, 2 | {d['load_ddp']['verdict']} | straggler, rank 1 |" in table
    with tarfile.open(out / "node_study_cpu_logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"llama_2gpu_ddp_load/{Path(rows['llama_2gpu_ddp_load']['log']).name}",
            "llama_2gpu_ddp_load/llama_2gpu_ddp_load.load.log",
            "llama_1gpu/llama_1gpu.log", "diagnose_p2p_ddp/report.md", "diagnose_llama/report.json"} <= names
