"""titanlite.diagnose on synthetic run logs: the user's 2 -> 8 GPU story, schema variants, CLI errors.

Real CPU runs with injected faults are in test_diagnose_runs.py; here the logs are built from a few
numbers so each rule is tested on exactly the situation it is for.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titanlite.diagnose import Settings, diagnose
from titanlite.diagnose.advice import advise
from titanlite.parallel.comm_model import calibrated_link
from titanlite.diagnose import load_run
from titanlite.models import get_model_args

from conftest import ROOT, concurrently

FLOPS_PER_TOKEN = 8.34e9  # llama 1.36B at seq 2048
PARAMS = 1_294_159_104


def make_log(path, world, step_ms, *, local=8, accum=4, seq=2048, precision="bfloat16", memory=61.2,
             tps=None, phases=None, flat_breakdown=None, entries=12, log_freq=10, gpu="NVIDIA B200", peak=2250.0,
             gpu_readings=None):
    """A run log as titanlite writes it. `phases`: {phase: ms per step} for every rank, or
    {rank: {phase: ms}}; `tps` overrides the logged tokens/s (a buggy logger); `gpu_readings`: the GPU's
    own readings (gpu_util_pct, power_w, sm_clock_mhz) of every rank and log step."""
    tokens_per_step = local * accum * world * seq
    config = {"world_size": world, "batch_size": local, "gradient_accumulation_steps": accum,
              "global_batch_size": local * accum * world, "seq_len": seq, "compile": True, "use_cuda_graphs": False,
              "use_dataloader": True, "attention_backend": "sdpa_cudnn", "data_parallel": "ddp" if world > 1 else "none",
              "model.name": "llama", "model.flavor": "1.36B", "training.mixed_precision_param": precision,
              "training.dataset": "python_stdlib", "float8.enable": False, "activation_checkpoint.mode": "none"}
    its = []
    for i in range(entries):
        it = 1 if i == 0 else i * log_freq
        t = step_ms * (5 if i == 0 else 1 + 0.01 * (i % 3))  # the first entry holds start-up
        logged = (tps if tps is not None else tokens_per_step / (t / 1000))
        tflops = logged * FLOPS_PER_TOKEN / 1e12
        e = {"iter": it, "loss": 3.0, "lr": 1e-4, "grad_norm": 1.0, "time_ms": t, "tokens_per_sec": logged,
             "tokens_per_sec_per_gpu": logged / world, "tflops": tflops, "mfu": 100 * tflops / (world * peak),
             "memory_gb": memory - 10, "memory_peak_gb": memory, "memory_reserved_gb": memory + 2,
             "tokens_seen": it * tokens_per_step}
        if phases is not None:
            per_rank = phases if all(isinstance(k, int) for k in phases) else {r: phases for r in range(world)}
            ranks = []
            for r in range(world):
                ph = {f"{p}_ms": v * t / step_ms for p, v in per_rank[r].items()}
                known = sum(v for v in ph.values() if v is not None)
                ranks.append({"rank": r, "step_ms": t, "idle_ms": max(t - known, 0.0), **ph, **(gpu_readings or {})})
            e["breakdown"] = {"ranks": ranks, "method": "cuda_events", "slowest_rank": 0, "stats": {}}
        if flat_breakdown is not None:
            e["breakdown"] = dict(flat_breakdown)
        e.update(gpu_readings or {})
        its.append(e)
    log = {"startup_info": {"config": config, "hardware": {"device": "cuda", "name": gpu, "count": world,
                                                          "peak_tflops_per_gpu": peak},
                            "model": {"name": "llama", "flavor": "1.36B", "params": PARAMS,
                                      "flops_per_token": FLOPS_PER_TOKEN}},
           "training_iterations": its}
    path.write_text(json.dumps(log))
    return str(path)


def report(tmp_path, *logs):
    a = diagnose(logs, tmp_path / "out")
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["verdict"] == a.verdict == rep["findings"][0]["kind"]
    return rep


def kinds(rep):
    return [f["kind"] for f in rep["findings"]]


def causes(rep):
    """Why the confidence is not high: (run, cause) in order."""
    return [(c["run"], c["cause"]) for c in rep["confidence_causes"]]


CONFIDENCES = ("high", "medium", "low")


def first_line_claims(tmp_path, rep) -> tuple[set, set]:
    """The finding kinds and confidence levels the report's first line names, checked against the
    body: the verdict is the top finding, the confidence the one stated below it."""
    md = (tmp_path / "out" / "report.md").read_text()
    first = md.splitlines()[0]
    words = set(first.replace(",", " ").replace("`", " ").replace("(", " ").replace(")", " ").split())
    body = md.split("**Confidence: ", 1)[1].split(".", 1)[0]
    assert body == rep["confidence"]
    return words & {f["kind"] for f in rep["findings"]} | words & {"healthy"}, words & set(CONFIDENCES)


@pytest.mark.parametrize("with_breakdown", [False, True])
def test_user_story_2_to_8_gpus(tmp_path, with_breakdown):
    """The users' 2 -> 8 GPU report: same per-GPU work at 2 and 8 B200s, the same logged aggregate tokens/s (MFU
    falls 4x), the step grows far more than 4x tokens explain, identical memory, and the logged
    tokens/s disagrees with tokens per step / step time."""
    two = 2 * 8 * 4 * 2048 / 1.0  # tokens/s at 2 GPUs with a 1.0 s step
    ph2 = {"data": 5.0, "compute": 850.0, "comm": 40.0, "optimizer": 60.0} if with_breakdown else None
    ph8 = {"data": 5.0, "compute": 5700.0, "comm": 80.0, "optimizer": 60.0} if with_breakdown else None
    a = make_log(tmp_path / "a.json", 2, 1000.0, phases=ph2)
    b = make_log(tmp_path / "b.json", 8, 6000.0, tps=two, phases=ph8)  # logger reports the 2-GPU rate
    rep = report(tmp_path, b, a)  # order of arguments does not matter: the smallest world is the baseline
    assert rep["verdict"] == "compute_stall"
    assert "measurement_inconsistency" in kinds(rep)
    stall = rep["findings"][0]
    assert stall["severity"] == "high" and stall["cause"] == "gpu"
    assert stall["next_check"] == advise("compute_stall", "gpu")
    mi = next(f for f in rep["findings"] if f["kind"] == "measurement_inconsistency")
    check = mi["evidence"]["tokens/s = tokens per step / step time"]
    assert check["logged"] == pytest.approx(two, rel=0.02)
    assert check["recomputed"] == pytest.approx(8 * 8 * 4 * 2048 / 6.0, rel=0.02)
    eff = {r["world_size"]: r for r in rep["scaling_efficiency"]["runs"]}
    assert rep["scaling_efficiency"]["mode"] == "weak"
    assert eff[8]["efficiency"] == pytest.approx((4 / 6) / 4, rel=0.02)  # 4x tokens in 6x the time, 4x the GPUs
    assert eff[8]["efficiency_from_logged_tokens_per_sec"] == pytest.approx(0.25, rel=0.02)  # the "MFU fell 4x"
    if not with_breakdown:  # reasoned from step time, memory and the all-reduce estimate
        assert stall["evidence"]["memory_gb"] == stall["evidence"]["baseline_memory_gb"]
        assert stall["evidence"]["excess_ms_per_step"] > 100 * stall["evidence"]["expected_comm_ms"]
    else:
        assert stall["evidence"]["compute_ms_per_micro_step"] == pytest.approx(5700 / 4, rel=0.05)
    assert first_line_claims(tmp_path, rep) == ({"compute_stall"}, {rep["confidence"]})


@pytest.mark.parametrize("with_breakdown", [False, True])
@pytest.mark.parametrize("readings, cause, says", [
    ({"gpu_util_pct": 78.0, "power_w": 626.0, "sm_clock_mhz": 1935.0}, "gpu_waiting", "waited inside the step"),
    ({"gpu_util_pct": 100.0, "power_w": 700.0, "sm_clock_mhz": 1400.0}, "gpu_throttled", "ran at lower clocks"),
    ({"gpu_util_pct": 100.0, "power_w": 330.0, "sm_clock_mhz": 1560.0}, "gpu_waiting", "kernels waiting"),
    ({"gpu_util_pct": 99.0, "power_w": 695.0, "sm_clock_mhz": 1650.0}, "gpu", ""),
    (None, "gpu", "")])
def test_a_compute_stall_tells_from_the_gpus_readings_whether_they_waited_or_ran_slower(tmp_path, readings, cause,
                                                                                          says, with_breakdown):
    """The shape of 4 x H100 fsdp runs on a disturbed host: compute 1.38x one GPU's. Where the GPUs' utilisation
    fell 10 points or more under the baseline's they waited (host, copy-engine collectives), as they did where they
    stayed busy on a quarter less power (kernels spinning in a wait); busy at a clock 10% lower they were
    throttled; otherwise, or without readings, the kernels themselves are slower."""
    base = {"gpu_util_pct": 100.0, "power_w": 690.0, "sm_clock_mhz": 1605.0}
    a = make_log(tmp_path / "a.json", 1, 138.3, accum=1, phases={"compute": 123.3, "optimizer": 15.0} if with_breakdown
                 else None, gpu_readings=base)
    b = make_log(tmp_path / "b.json", 4, 175.3, accum=1, phases={"compute": 169.6, "optimizer": 3.7} if with_breakdown
                 else None, gpu_readings=readings)
    rep = report(tmp_path, a, b)
    stall = rep["findings"][0]
    assert rep["verdict"] == "compute_stall" and stall["cause"] == cause
    assert stall["next_check"] == advise("compute_stall", cause)
    assert says in stall["title"] and ("wait" in stall["title"]) == (cause == "gpu_waiting")
    if readings:
        assert stall["evidence"]["gpu_util_pct"] == readings["gpu_util_pct"]
        assert stall["evidence"]["baseline_sm_clock_mhz"] == base["sm_clock_mhz"]
    else:
        assert "gpu_util_pct" not in stall["evidence"]


def test_healthy_pair_and_warmup_excluded(tmp_path):
    ph = {"data": 2.0, "compute": 800.0, "comm": 30.0, "optimizer": 50.0}
    a = make_log(tmp_path / "a.json", 2, 900.0, phases=ph)
    b = make_log(tmp_path / "b.json", 4, 930.0, phases={**ph, "comm": 60.0})
    rep = report(tmp_path, a, b)
    assert kinds(rep) == ["healthy"]
    eff = {r["world_size"]: r["efficiency"] for r in rep["scaling_efficiency"]["runs"]}
    assert eff[4] == pytest.approx(900 / 930, rel=0.02)  # the 5x first entry did not count
    # iters 1, 10, ..., 110: the stated rule drops iter <= 11 (10% of 110), i.e. iters 1 and 10
    assert all(r["warmup_entries_excluded"] == 2 and r["steady_entries"] == 10 for r in rep["runs"])
    assert "excluded" in rep["warmup_rule"]


def test_a_loss_beyond_the_prediction_names_where_it_goes(tmp_path):
    """1 -> 2 GPUs with ddp: compute grows 10% (below the stall thresholds) while 3 ms of communication
    is exposed, where the model, world size and link predict a few ms. Not healthy: a scaling loss, whose
    finding names the loss, the collectives' most, and compute as the largest loss, most likely the
    overlapped all-reduce; with the same compute the run is healthy and there is no such sentence."""
    ph = {"data": 1.0, "compute": 800.0, "comm": 0.0, "optimizer": 100.0}
    a = make_log(tmp_path / "a.json", 1, 901.0, phases=ph)
    b = make_log(tmp_path / "b.json", 2, 984.0, phases={**ph, "compute": 880.0, "comm": 3.0})
    rep = report(tmp_path, a, b)
    (f,) = rep["findings"]
    loss = f["evidence"]["largest_loss"]
    assert f["kind"] == "scaling_loss" and (loss["run"], loss["phase"]) == ("2 GPUs", "compute"), f["title"]
    ev = f["evidence"]
    assert ev["per_gpu_work_ms"] == ev["baseline_step_ms"]  # the same work per GPU
    assert ev["predicted_step_ms"] == pytest.approx(ev["per_gpu_work_ms"] + ev["collectives_overlapped_ms"], abs=0.01)
    assert ev["loss_ms_per_step"] == pytest.approx(ev["step_ms"] - ev["predicted_step_ms"], abs=0.01)
    assert 0 < ev["collectives_overlapped_ms"] < ev["collectives_none_hidden_ms"] < ev["loss_ms_per_step"]
    assert ev["left_for_something_else_ms"] == pytest.approx(
        ev["step_ms"] - ev["per_gpu_work_ms"] - ev["collectives_none_hidden_ms"], abs=0.01)
    assert f"{ev['loss_ms_per_step']:,.1f} ms per step" in f["title"] and "at most" in f["title"]
    assert loss["cause"] == "overlap_contention" and loss["excess_ms_per_step"] == pytest.approx(80, abs=1)
    assert loss["exposed_comm_ms_per_step"] == pytest.approx(3.0, abs=0.1)
    # ddp without a bf16 all-reduce: that first, then fsdp with its gathers on the copy engines
    assert f["cause"] == "overlap_contention" and f["remedies"] == ["ddp_reduce_bf16", "fsdp_instead"]
    assert f["next_check"] == advise("scaling_loss", "overlap_contention", f["remedies"])
    b16 = make_log(tmp_path / "b16.json", 2, 984.0, phases={**ph, "compute": 880.0, "comm": 3.0})
    log = json.loads((tmp_path / "b16.json").read_text())
    log["startup_info"]["config"]["parallelism.ddp_reduce_dtype"] = "bfloat16"
    (tmp_path / "b16.json").write_text(json.dumps(log))
    (f,) = report(tmp_path, a, b16)["findings"]
    assert f["cause"] == "overlap_contention" and f["remedies"] == ["fsdp_instead"]
    c = make_log(tmp_path / "c.json", 2, 904.0, phases={**ph, "comm": 3.0})
    (f,) = report(tmp_path, a, c)["findings"]
    assert f["kind"] == "healthy" and "largest_loss" not in f["evidence"], f["title"]


def test_fsdp_contention_remedy_follows_the_copy_engine_setting(tmp_path):
    """fsdp losing compute beside its collectives: where the run gathered on SM kernels (the option off, or
    a log that does not name it) the remedy names the copy-engine gathers; where it asked for them (`on`,
    or True in an older log) it says they ran; under `auto` it points at the start-up log's choice."""
    ph = {"data": 1.0, "compute": 800.0, "comm": 0.0, "optimizer": 100.0}
    a = make_log(tmp_path / "a.json", 1, 901.0, phases=ph)
    checks = {}
    for setting in ("off", None, "on", True, "auto"):
        path = tmp_path / f"fsdp_{setting}.json"
        make_log(path, 2, 984.0, phases={**ph, "compute": 880.0, "comm": 3.0})
        log = json.loads(path.read_text())
        log["startup_info"]["config"]["data_parallel"] = "fsdp"
        if setting is not None:
            log["startup_info"]["config"]["parallelism.fsdp_copy_engine_all_gather"] = setting
        path.write_text(json.dumps(log))
        (f,) = report(tmp_path, a, str(path))["findings"]
        assert f["evidence"]["largest_loss"]["cause"] == "overlap_contention", f["title"]
        checks[setting] = f["remedies"]
    for setting in ("off", None):
        assert checks[setting] == ["fsdp_copy_engine_gathers", "fsdp_reduce_bf16"]
    for setting in ("on", True):
        assert checks[setting] == ["fsdp_reduce_bf16", "fsdp_gathers_ran_on_copy_engines"]
    assert checks["auto"] == ["fsdp_reduce_bf16", "fsdp_gathers_auto"]


def test_strong_scaling_efficiency(tmp_path):
    """Same global batch: 2 GPUs x accum 8 vs 4 GPUs x accum 4; ideal step halves."""
    a = make_log(tmp_path / "a.json", 2, 2000.0, accum=8)
    b = make_log(tmp_path / "b.json", 4, 1500.0, accum=4)
    rep = report(tmp_path, a, b)
    s = rep["scaling_efficiency"]
    assert s["mode"] == "strong"
    assert s["runs"][1]["efficiency"] == pytest.approx(2000 * 2 / (1500 * 4), rel=0.02)
    # half the work per GPU should take ~1000 ms (+ ~3 ms more all-reduce); 1500 ms is not comm-sized
    assert rep["verdict"] == "compute_stall"
    assert rep["findings"][0]["evidence"]["predicted_step_ms"] == pytest.approx(1000, rel=0.02)


@pytest.mark.parametrize("key,kw", [("precision", {"precision": "float32"}), ("seq_len", {"seq": 1024})])
def test_config_mismatch(tmp_path, key, kw):
    a = make_log(tmp_path / "a.json", 2, 1000.0)
    b = make_log(tmp_path / "b.json", 8, 1100.0, **kw)
    rep = report(tmp_path, a, b)
    assert rep["verdict"] == "config_mismatch"
    assert any(key in k for k in rep["findings"][0]["evidence"])
    row = next(r for r in rep["like_for_like"] if r["setting"] == key)
    assert not row["same"] and not row["ok"]


def test_straggler_from_breakdown(tmp_path):
    fast = {"data": 2.0, "compute": 800.0, "comm": 300.0, "optimizer": 50.0}
    slow = {"data": 2.0, "compute": 1100.0, "comm": 5.0, "optimizer": 50.0}
    a = make_log(tmp_path / "a.json", 2, 900.0, phases={"data": 2.0, "compute": 800.0, "comm": 40.0, "optimizer": 50.0})
    b = make_log(tmp_path / "b.json", 4, 1200.0, phases={0: fast, 1: fast, 2: slow, 3: fast})
    rep = report(tmp_path, a, b)
    assert rep["verdict"] == "straggler"
    f = rep["findings"][0]
    assert f["evidence"]["rank"] == 2 and f["evidence"]["phase"] == "compute"
    assert f["cause"] == "gpu" and f["next_check"] == advise("straggler", "gpu", rank=2)
    assert "compute_stall" not in kinds(rep)  # the fastest rank computes as fast as the baseline


def test_flat_rank0_breakdown_is_read(tmp_path):
    """The first run-log schema: a flat {data_ms, compute_ms, optimizer_ms} for rank 0."""
    a = make_log(tmp_path / "a.json", 1, 100.0, accum=1, flat_breakdown={"data_ms": 1, "compute_ms": 80, "optimizer_ms": 10})
    b = make_log(tmp_path / "b.json", 2, 150.0, accum=1, flat_breakdown={"data_ms": 45, "compute_ms": 80, "optimizer_ms": 10})
    run = load_run(b)
    assert sorted(run.rank_phases) == [0] and run.phase("data", 0) == pytest.approx(45, rel=0.02)
    rep = report(tmp_path, a, b)
    assert rep["verdict"] == "data_stall"


def test_warmup_only_log_gives_no_stall(tmp_path):
    """The 8-GPU log holds only its first entry (start-up and compilation, 5x a step): no compute_stall,
    a verdict that says too little was logged, low confidence with the reason."""
    a = make_log(tmp_path / "a.json", 2, 1000.0)
    b = make_log(tmp_path / "b.json", 8, 1000.0, entries=1)
    rep = report(tmp_path, a, b)
    assert kinds(rep) == ["insufficient_data"] and rep["findings"][0]["evidence"] == {
        "8 GPUs": {"last_iter": 1, "entries": 1}}
    assert rep["confidence"] == "low" and causes(rep)[0] == ("8 GPUs", "warmup_only")


def test_one_steady_entry_still_gives_a_verdict(tmp_path):
    """Iters 1 and 10: one steady entry each. The stall is still found, with the confidence lowered and why."""
    a = make_log(tmp_path / "a.json", 2, 1000.0, entries=2)
    b = make_log(tmp_path / "b.json", 8, 3000.0, entries=2)
    rep = report(tmp_path, a, b)
    assert rep["verdict"] == "compute_stall" and all(r["steady_entries"] == 1 for r in rep["runs"])
    assert rep["confidence"] == "low" and causes(rep) == [("2 GPUs", "few_entries"), ("8 GPUs", "few_entries")]
    c = make_log(tmp_path / "c.json", 2, 1000.0, entries=3)  # iters 1, 10, 20: two steady entries
    d = make_log(tmp_path / "d.json", 8, 1000.0, entries=3)
    rep = report(tmp_path, c, d)
    assert rep["confidence"] == "medium" and causes(rep) == [("2 GPUs", "few_entries"), ("8 GPUs", "few_entries")]


def test_log_without_step_time_still_gives_a_verdict(tmp_path):
    """One log of the pair has no time per iteration: its step time comes from its logged rate, the
    verdict stands (the same as with the time), and the confidence says why it is lower."""
    a = make_log(tmp_path / "a.json", 2, 1000.0)
    b = make_log(tmp_path / "b.json", 8, 3000.0)
    with_time = report(tmp_path, a, b)
    log = json.loads((tmp_path / "b.json").read_text())
    for e in log["training_iterations"]:
        del e["time_ms"]
    (tmp_path / "b.json").write_text(json.dumps(log))
    rep = report(tmp_path, a, b)
    assert rep["verdict"] == with_time["verdict"] == "compute_stall"
    assert rep["reconstruction"]["runs"][1]["step_time"] == "derived from the logged rate"
    assert rep["reconstruction"]["runs"][1]["step_ms"] == pytest.approx(3000.0, rel=0.02)
    assert rep["confidence"] == "medium" and causes(rep) == [("8 GPUs", "no_step_time")]
    assert with_time["confidence"] == "high" and causes(with_time) == []


def test_single_log_is_a_single_run_report(tmp_path):
    a = make_log(tmp_path / "a.json", 8, 1000.0)
    rep = report(tmp_path, a)
    assert kinds(rep) == ["healthy"] and rep["scaling_efficiency"]["mode"] == "single_run"
    assert [r["efficiency"] for r in rep["scaling_efficiency"]["runs"]] == [None]
    assert rep["reconstruction"]["scaling_efficiency"] is None and rep["like_for_like"] == []
    # its one figure is the run's own per-GPU rate: 8 x 4 x 2048 tokens per GPU in a ~1 s step
    assert rep["findings"][0]["evidence"]["tokens_per_sec_per_gpu"] == pytest.approx(8 * 4 * 2048 / 1.01, rel=0.02)


def test_same_log_twice_is_refused(tmp_path):
    a = make_log(tmp_path / "a.json", 2, 1000.0)
    (tmp_path / "copy.json").write_text((tmp_path / "a.json").read_text())
    for second, words in ((a, "are the same file"), (str(tmp_path / "copy.json"), "are identical logs")):
        r = run_cli(a, second, "--out", str(tmp_path / "x"))
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr and a in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()


DOCS = ROOT / "docs"


@pytest.mark.parametrize("study,verdict,cause,effs,rank", [
    ("h200_1_2_4_clean", "scaling_loss", "overlap_contention", [1.0, 0.885, 0.878], None),
    ("h200_1_2_4_stall", "compute_stall", "gpu", [1.0, 0.885, 0.527], None),
    ("h200_presets_1_2_4_clean", "healthy", "", [1.0, 0.994, 0.991], None),
    ("h200_2_4_straggler", "straggler", "gpu", [1.0, 0.463], 3),
    ("h200_2_4_p2p_local4", "communication", "", [1.0, 0.406], None),
    ("h200_2_4_p2p_local32", "healthy", "slow_link", [1.0, 0.976], None),
    ("h100_1_4_fsdp_clean", "healthy", "overlap_contention", [1.0, 0.989], None),
    ("h100_1_4_fsdp_disturbed", "compute_stall", "gpu_waiting", [1.0, 0.789], None)])
def test_gpu_reports_keep_their_verdicts(tmp_path, study, verdict, cause, effs, rank):
    """docs/diagnosis' studies on 4 x H200 and 4 x H100 rerun from what ships: the run logs the reports name (beside
    them, or docs/observability's real 2-GPU log) give the published verdict, its cause (NCCL without
    peer-to-peer at local batch 32: healthy, the all-reduce hidden, but named as a slow link),
    efficiencies and named rank, and the reconstruction reads every log as it says (dense peak,
    titanlite's FLOPs convention)."""
    folder = DOCS / "diagnosis" / study
    published = json.loads((folder / "report.json").read_text())
    logs = [str(ROOT / r["path"]) for r in published["runs"]]
    assert [Path(p).is_file() for p in logs] == [True] * len(effs)
    rep = report(tmp_path, *logs)
    assert rep["verdict"] == verdict == published["verdict"]
    assert rep["findings"][0]["cause"] == cause == published["findings"][0]["cause"]
    assert rep["findings"][0]["evidence"].get("rank") == rank
    assert [r["efficiency"] for r in rep["scaling_efficiency"]["runs"]] == pytest.approx(effs, abs=0.002)
    assert all(r["reading"] == [] and r["plausibility"] == "possible" for r in rep["reconstruction"]["runs"])
    assert [r["mfu_dense_pct"] for r in rep["reconstruction"]["runs"]] == pytest.approx(
        [r["mfu_logged"] for r in published["runs"]], rel=0.01)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "titanlite.diagnose", *args], capture_output=True, text=True, cwd=ROOT)


def test_cli_report_and_exit_codes(tmp_path):
    """The six commands are independent and run two at a time."""
    a = make_log(tmp_path / "a.json", 2, 900.0)
    b = make_log(tmp_path / "b.json", 4, 910.0)
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"hello": 1}')
    (tmp_path / "empty.json").write_text(json.dumps({"startup_info": {"config": {"world_size": 2, "batch_size": 8,
                                                                                  "seq_len": 2048}},
                                                     "training_iterations": []}))
    cases = {str(tmp_path / "missing.json"): "no such file", str(tmp_path / "bad.json"): "not valid JSON",
             str(tmp_path / "other.json"): "not a titanlite run log", str(tmp_path / "empty.json"): "no training_iterations"}
    r, *refused, no_logs = concurrently(lambda: run_cli(a, b, "--out", str(tmp_path / "rep")),
                                        *[lambda path=path: run_cli(a, path, "--out", str(tmp_path / "x")) for path in cases],
                                        lambda: run_cli("--out", str(tmp_path / "x")))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("verdict: healthy")
    for name in ("report.md", "report.json", "phases.png", "ranks.png"):
        assert (tmp_path / "rep" / name).stat().st_size > 0
    for r, msg in zip(refused, cases.values()):
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr
    r = no_logs
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1



def test_cli_without_matplotlib_writes_the_report_and_says_why(tmp_path):
    """Without matplotlib (the plot extra) diagnose writes report.md and report.json, no figures, and exits
    0; its note, on the console and under the report's figures, is the one line for a missing package."""
    from titanlite.errors import missing_package

    a, b = make_log(tmp_path / "a.json", 2, 900.0), make_log(tmp_path / "b.json", 4, 910.0)
    out = tmp_path / "rep"
    hide = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv[0] = 'diagnose'; "
            "runpy.run_module('titanlite.diagnose', run_name='__main__')")  # import matplotlib now fails
    r = subprocess.run([sys.executable, "-c", hide, str(a), str(b), "--out", str(out)], capture_output=True,
                       text=True, cwd=ROOT)
    note = missing_package("matplotlib", "drawing the figures")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.startswith("verdict: healthy") and f"note: {note}; the report is written without them" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]
    assert note in (out / "report.md").read_text().split("## Figures")[1]
    assert json.loads((out / "report.json").read_text())["notes"] == [f"{note}; the report is written without them"]

# ------------------------------------------------------------------------------ what the logs determine
def json_log(path, gpus, micro, printed_accum, per_gpu, *, local=16, seq=2048, mfu_peak=2250.0, fpt=8.34e9,
             hardware=None, params=None, entries=11):
    """The earlier trainer's JSON run log as its users' snippets read it: startup_info.config and
    training_iterations only (no GPU name, no parameter count unless given). The run really ran
    `micro` micro-steps per GPU per step at `per_gpu` tokens/s per GPU; its config prints
    `printed_accum`; its tokens/s (all GPUs) and MFU are right."""
    step_ms = 1000 * local * micro * seq / per_gpu
    its = []
    for i in range(entries):
        it = 10 * i
        t = step_ms * (20 if it == 0 else 1 + 0.002 * (i % 3 - 1))
        its.append({"iter": it, "loss": 3.0, "dt_ms": t, "tokens_per_sec": per_gpu * gpus * step_ms / t,
                    "mfu": 100 * per_gpu * fpt / (mfu_peak * 1e12) * step_ms / t})
    start = {"config": {"world_size": gpus, "batch_size": local, "gradient_accumulation_steps": printed_accum,
                        "block_size": seq, "compile": True}}
    if hardware:
        start["hardware"] = hardware
    if params:
        start["model"] = {"params": params}
    path.write_text(json.dumps({"startup_info": start, "training_iterations": its}))
    return str(path)


def measured_agree(run_reading) -> bool:
    return all(f["agrees"] for f in run_reading["facts"] if f["source"] in ("rates", "tokens seen"))


def test_seed_json_without_gpu_or_model_reads_what_its_figures_say(tmp_path):
    """The users' 2 -> 8 B200 JSON logs without GPU, model or flags: each GPU ran 4 micro-steps (the
    printed 32 is neither that nor 32 / GPUs at 2 GPUs), which tokens/s x step time / (batch x seq x
    GPUs) says. The reading that agrees with the log's rates is chosen, there is no scaling loss, and
    since the dense-peak check could not run, the confidence is not high and the report's first lines
    name the flags that would settle it."""
    a = json_log(tmp_path / "b2.json", 2, 4, 32, 106_968.0)
    b = json_log(tmp_path / "b8.json", 8, 4, 32, 106_968.0)
    rep = report(tmp_path, a, b)
    runs = rep["reconstruction"]["runs"]
    assert [r["micro_steps_per_step"] for r in runs] == [4, 4]
    assert [r["tokens_per_sec_per_gpu"] for r in runs] == pytest.approx([106_968.0] * 2, rel=0.01)
    assert all(measured_agree(r) for r in runs), [r["why"] for r in runs]
    assert rep["verdict"] != "compute_stall" and "compute_stall" not in kinds(rep)
    assert rep["confidence"] != "high"
    assert "--hardware" in rep["settle_with"] and "--model" in rep["settle_with"]
    head = "\n".join((tmp_path / "out" / "report.md").read_text().splitlines()[:4])
    assert "--hardware" in head and "--model" in head
    flagged = diagnose([a, b], tmp_path / "flagged", settings=Settings(hardware="b200", model="llama/1.36B"))
    assert flagged.verdict == rep["verdict"] and flagged.confidence == "high"
    assert [r.micro_steps_per_step for r in flagged.reconstruction.runs] == [4, 4]


def test_inferred_accumulation_on_another_pair(tmp_path):
    """1 -> 4 H100 logs of another trainer: each GPU ran 3 micro-steps of 8 x 4096 tokens (printed 6:
    neither 3 nor 6 / 4), the GPU named but not the model, and the 4-GPU run really is slower per GPU
    (60%). The accumulation is inferred from the rates, the loss is still found, and with the model
    unknown the all-reduce cannot be estimated: no ratio over it, and the confidence is not high."""
    h100 = {"gpu_name": "NVIDIA H100 80GB HBM3"}
    a = json_log(tmp_path / "one.json", 1, 3, 6, 40_000.0, local=8, seq=4096, mfu_peak=989.0, hardware=h100)
    b = json_log(tmp_path / "four.json", 4, 3, 6, 24_000.0, local=8, seq=4096, mfu_peak=989.0, hardware=h100)
    rep = report(tmp_path, a, b)
    runs = rep["reconstruction"]["runs"]
    assert [r["micro_steps_per_step"] for r in runs] == [3, 3]
    assert all(measured_agree(r) for r in runs), [r["why"] for r in runs]
    assert rep["verdict"] == "compute_stall"
    stall = rep["findings"][0]
    assert "expected_comm_ms" not in stall["evidence"]
    assert "x what" not in stall["title"]  # no multiple of an all-reduce that was never estimated
    assert rep["confidence"] != "high" and "--model" in rep["settle_with"]
    assert ("4 GPUs", "allreduce_unknown") in causes(rep)


def test_the_model_given_sizes_the_all_reduce(tmp_path):
    """--model on logs that print no parameter count (the earlier trainer's JSON run log): the report
    never asks for --model, and the all-reduce's estimate is the given model's gradients; given another
    model than the log's, the estimate follows the model given."""
    h100 = {"gpu_name": "NVIDIA H100 80GB HBM3"}
    a = json_log(tmp_path / "one.json", 1, 3, 3, 40_000.0, local=8, seq=4096, mfu_peak=989.0, hardware=h100)
    b = json_log(tmp_path / "four.json", 4, 3, 3, 24_000.0, local=8, seq=4096, mfu_peak=989.0, hardware=h100)
    for model in ("llama/1.36B", "llama/8B"):
        out = tmp_path / model.replace("/", "_")
        r = run_cli(a, b, "--model", model, "--out", str(out))
        assert r.returncode == 0, r.stderr
        rep = json.loads((out / "report.json").read_text())
        assert rep["verdict"] == "compute_stall"
        assert "allreduce_unknown" not in [c["cause"] for c in rep["confidence_causes"]]
        assert "--model" not in rep["settle_with"] and "--model" not in r.stdout
        assert "pass --model" not in (out / "report.md").read_text()
        params = get_model_args(*model.split("/")).num_params()
        link = calibrated_link(rep["link_gbps_assumed"]["4 GPUs"], "h100")  # ddp's ring all-reduce of fp32 gradients
        ring = 2 * 3 / 4 * params * 4 / (link.gbps * 1e9 * link.efficiency) * 1000
        assert rep["findings"][0]["evidence"]["expected_comm_ms"] == pytest.approx(ring, rel=1e-3)


def test_no_ratio_over_an_all_reduce_of_zero(tmp_path):
    """A stall at the same world size's all-reduce (1 -> 2 GPUs of a model with a known size) prints the
    all-reduce's estimate, and the ratio it prints is the excess over it."""
    a = make_log(tmp_path / "a.json", 1, 1000.0)
    b = make_log(tmp_path / "b.json", 2, 3000.0)
    rep = report(tmp_path, a, b)
    stall = rep["findings"][0]
    assert rep["verdict"] == "compute_stall" and stall["evidence"]["expected_comm_ms"] > 0
    ratio = stall["evidence"]["excess_ms_per_step"] / stall["evidence"]["expected_comm_ms"]
    assert f"{ratio:,.0f}x" in stall["title"]


def cpu_log(path, world, step_ms, threads, *, host=True):
    """A titanlite run log of a CPU run (gloo), with the host facts the run log records."""
    make_log(path, world, step_ms, accum=1, local=4, seq=64)
    log = json.loads(path.read_text())
    log["startup_info"]["hardware"] = {"device": "cpu", "name": "cpu", "count": world}
    log["startup_info"]["config"]["model.flavor"] = "debug"
    log["startup_info"]["model"] = {"name": "llama", "flavor": "debug", "params": 1_377_408}
    for e in log["training_iterations"]:
        del e["tflops"], e["mfu"]
    if host:
        log["startup_info"]["hardware"]["host"] = {"cpus": 2, "threads_per_process": threads, "data_workers": 0}
    path.write_text(json.dumps(log))
    return str(path)


def test_cpu_pair_with_torchruns_thread_default_is_no_compute_stall(tmp_path):
    """1 and 2 CPU processes on 2 cores: the one process used both cores, torchrun gave each of the two
    one thread, and the step took 2.04x as long. That is not a stall: the runs differ in threads per
    process, and the advice speaks of threads and CPUs, not GPUs."""
    a = cpu_log(tmp_path / "a.json", 1, 100.0, threads=2)
    b = cpu_log(tmp_path / "b.json", 2, 204.0, threads=1)
    rep = report(tmp_path, a, b)
    assert rep["verdict"] != "compute_stall" and "compute_stall" not in kinds(rep)
    assert rep["verdict"] == "config_mismatch"
    assert rep["findings"][0]["evidence"]["threads_per_process"] == [2, 1]
    row = next(r for r in rep["like_for_like"] if r["key"] == "threads_per_process")
    assert row["values"] == [2, 1] and not row["same"]
    assert rep["findings"][0]["cause"] == "cpu"  # the host's advice: threads per process, not nvidia-smi
    # the same threads per process: a real per-process slowdown is a stall, with CPU advice
    c = cpu_log(tmp_path / "c.json", 1, 100.0, threads=1)
    rep = report(tmp_path, c, b)
    assert rep["verdict"] == "compute_stall" and rep["findings"][0]["cause"] == "cpu"
    # logs without the host facts: the stall cannot rule out fewer threads, so it is not high
    rep = report(tmp_path, cpu_log(tmp_path / "d.json", 1, 100.0, 2, host=False),
                 cpu_log(tmp_path / "e.json", 2, 204.0, 1, host=False))
    assert rep["verdict"] == "compute_stall" and rep["confidence"] != "high"
    assert any(c["cause"] == "host_unknown" for c in rep["confidence_causes"])


@pytest.mark.parametrize("case", ["healthy", "warmup_only", "no_step_time", "unknown_gpu"])
def test_first_line_is_the_verdict_with_the_bodys_confidence(tmp_path, case):
    """Whatever the confidence, the report's first line names the verdict and that confidence, and no
    other level (a finding's severity) that could be taken for it."""
    a = make_log(tmp_path / "a.json", 2, 900.0)
    b = make_log(tmp_path / "b.json", 4, 910.0 if case != "warmup_only" else 900.0,
                 entries=1 if case == "warmup_only" else 12)
    if case == "no_step_time":
        log = json.loads((tmp_path / "b.json").read_text())
        for e in log["training_iterations"]:
            del e["time_ms"]
        (tmp_path / "b.json").write_text(json.dumps(log))
    if case == "unknown_gpu":
        a = json_log(tmp_path / "a2.json", 2, 4, 4, 50_000.0)
        b = json_log(tmp_path / "b2.json", 8, 4, 4, 30_000.0)
    rep = report(tmp_path, a, b)
    verdicts, levels = first_line_claims(tmp_path, rep)
    assert verdicts == {rep["verdict"]} and levels == {rep["confidence"]}
    assert rep["confidence"] == {"healthy": "high", "warmup_only": "low", "no_step_time": "medium",
                                 "unknown_gpu": "medium"}[case]


def test_advice_table_covers_every_finding_and_fills_its_placeholders(tmp_path):
    """Every finding kind has advice (for the kinds whose checks depend on what computes, for GPU and CPU
    runs); each text's placeholders are the ones advise fills; each remedy the overlap rule can name
    exists, and the rule names them all across the modes and settings it tells apart."""
    import string

    from titanlite.diagnose.advice import ADVICE, REMEDIES
    from titanlite.diagnose.detectors import PHASE_KIND, overlap_remedies

    kinds = set(PHASE_KIND.values()) | {"straggler", "config_mismatch", "measurement_inconsistency",
                                         "insufficient_data", "healthy", "scaling_loss"}
    assert {k for k, _ in ADVICE} == kinds
    for kind in ("compute_stall", "straggler", "host_overhead", "config_mismatch"):
        assert {(kind, "gpu"), (kind, "cpu")} <= set(ADVICE)
    for (kind, cause), text in ADVICE.items():
        fields = {f for _, f, _, _ in string.Formatter().parse(text) if f}
        assert fields <= {"rank", "fixes", "remedies"}, (kind, cause, fields)
        out = advise(kind, cause, ["fsdp_reduce_bf16", "fsdp_gathers_auto"], rank=3, fixes="FIX")
        assert "{" not in out and ("3" in out if "rank" in fields else True)
    named, path = set(), make_log(tmp_path / "r.json", 2, 100.0)
    for mode, shards in (("ddp", False), ("zero1", False), ("fsdp", True), ("hsdp", True)):
        for extra in ({}, {"parallelism.ddp_reduce_dtype": "bfloat16"}, {"parallelism.fsdp_copy_engine_all_gather": "on"},
                      {"parallelism.fsdp_copy_engine_all_gather": "auto"}, BF16_GRADIENTS):
            run = load_run(path)
            run.config.update(extra, data_parallel=mode)
            named |= set(overlap_remedies(mode, shards, run))
    assert named == set(REMEDIES)


# titanlite's fsdp with bf16 compute, one micro-step a step and its default gradient transport: the bf16
# gradients cross as they are
BF16_GRADIENTS = {"parallelism.fsdp_gradient_transport": "auto", "parallelism.fsdp_reduce_dtype": "float32",
                  "training.mixed_precision_param": "bfloat16", "parallelism.fsdp_copy_engine_all_gather": "auto",
                  "gradient_accumulation_steps": 1}


def test_gradients_that_crossed_in_bf16_count_two_bytes_and_are_not_told_to_halve(tmp_path):
    """A run whose fsdp gradients crossed the link in bf16 (parallelism.fsdp_gradient_transport) reduced two
    bytes a parameter, not four, and the overlap advice says so instead of offering fsdp_reduce_dtype bfloat16
    to halve them, also where each micro-step of several reduced into the shard; with the transport off, with
    accumulation kept unsharded (float32 sums, NCCL's reduce-scatter), on a CPU
    run's float32 compute, or under ddp, the float32 bytes and that remedy stand."""
    from titanlite.diagnose.detectors import overlap_remedies
    from titanlite.diagnose.expected import gradient_bytes

    path = make_log(tmp_path / "r.json", 2, 100.0)
    runs = {}
    for name, extra, mode in (("crossed", BF16_GRADIENTS, "fsdp"),
                              ("nccl", {**BF16_GRADIENTS, "parallelism.fsdp_gradient_transport": "reduce_dtype"}, "fsdp"),
                              ("accumulated", {**BF16_GRADIENTS, "gradient_accumulation_steps": 4}, "fsdp"),
                              ("cpu", {**BF16_GRADIENTS, "training.mixed_precision_param": "auto"}, "fsdp"),
                              ("ddp", BF16_GRADIENTS, "ddp"),
                              ("accumulated_sharded", {**BF16_GRADIENTS, "gradient_accumulation_steps": 4,
                                                       "parallelism.fsdp_accumulate": "sharded"}, "fsdp")):
        runs[name] = load_run(path)
        runs[name].config.update(extra, data_parallel=mode)
        runs[name].accum = extra["gradient_accumulation_steps"]  # as the log's figures would reconstruct it
        runs[name].source = "titanlite"  # its settings: titanlite's gradient transport and accumulation
    runs["cpu"].hardware["device"] = "cpu"
    four = {name: gradient_bytes(r) for name, r in runs.items()}
    # each of the 4 micro-steps reduced into the shard (parallelism.fsdp_accumulate=sharded): bf16 each time
    assert four.pop("crossed") * 2 == four.pop("accumulated_sharded") * 2 == four["nccl"] and len(set(four.values())) == 1
    assert overlap_remedies("fsdp", True, runs["crossed"]) == ["fsdp_grads_crossed_bf16", "fsdp_gathers_auto"]
    assert overlap_remedies("fsdp", True, runs["nccl"]) == ["fsdp_reduce_bf16", "fsdp_gathers_auto"]
    assert overlap_remedies("fsdp", True, runs["accumulated_sharded"])[0] == "fsdp_grads_crossed_bf16"


@pytest.mark.parametrize("command", [["titanlite.diagnose", "LOGS", "--out", "OUT"], ["titanlite.tools.compare", "LOGS"],
                                     ["estimation", "--estimate.ngpu", "1", "--estimate.search=false", "--estimate.output",
                                      "OUT/e.json"]])
def test_a_reader_that_goes_away_ends_the_command_quietly(command, tmp_path):
    """`CMD | head`: stdout's reader is gone before the first line; the command ends with exit 1 and
    no BrokenPipeError traceback (the estimator's progress lines on stderr stay). The estimator's report
    reaches stdout in one print whether or not it holds the largest-batch search's line, so the search
    (twice the estimate's time) is left out."""
    logs = [str(p) for p in sorted((ROOT / "docs" / "diagnosis" / "h200_presets_1_2_4_clean").glob("run_*.json"))]
    argv = [a for x in command for a in (logs if x == "LOGS" else [x.replace("OUT", str(tmp_path))])]
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the command writes
    r = subprocess.run([sys.executable, "-m", *argv], stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    os.close(write)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr[-2000:]


def with_host(path, **host):
    """Give a log made by make_log the host record titanlite's run log writes (run_log.host_facts)."""
    log = json.loads(Path(path).read_text())
    log["startup_info"]["hardware"]["host"] = {"cpus": 64, "cpu_quota": None, "threads_per_process": 8,
                                               "data_workers": 2, **host}
    Path(path).write_text(json.dumps(log))
    return path


def test_host_time_that_grows_with_fewer_cpus_per_rank_is_host_starved(tmp_path):
    """1 -> 4 GPUs on one host: the four ranks share the CPUs the one had (16 each against 64), and their
    host time (idle outside the measured phases) grows 90 ms a step: host-starved, naming both CPU
    counts. The same growth with as many CPUs per rank is host overhead of another cause; a CPU quota
    under the affinity counts as the job's CPUs."""
    ph = {"data": 1.0, "compute": 800.0, "comm": 0.0, "optimizer": 100.0}
    a = with_host(make_log(tmp_path / "a.json", 1, 1000.0, phases=ph), cpus_affinity=64, ranks_per_host=1)
    b = with_host(make_log(tmp_path / "b.json", 4, 1100.0, phases={**ph, "comm": 10.0}), cpus_affinity=64,
                  ranks_per_host=4)
    rep = report(tmp_path, a, b)
    f = next(f for f in rep["findings"] if f["kind"] == "host_overhead")
    assert f["cause"] == "host_starved" and "host-starved" in f["title"] and "16 CPUs per rank against 64" in f["title"]
    assert f["evidence"]["idle_ms_per_step"] - f["evidence"]["predicted_idle_ms_per_step"] == pytest.approx(90, abs=3)
    assert f["next_check"] == advise("host_overhead", "host_starved")
    rows = {r["key"]: r for r in rep["like_for_like"]}
    assert rows["cpus_per_rank"]["values"] == [64, 16] and rows["cpus_per_rank"]["ok"]
    even = with_host(make_log(tmp_path / "even.json", 1, 1000.0, phases=ph), cpus_affinity=16, ranks_per_host=1)
    rep = report(tmp_path, even, b)
    assert not any(f["cause"] == "host_starved" for f in rep["findings"]), rep["findings"]
    capped = with_host(make_log(tmp_path / "capped.json", 4, 1100.0, phases={**ph, "comm": 10.0}), cpus_affinity=64,
                       cpu_quota=8.0, ranks_per_host=4)
    rep = report(tmp_path, even, capped)  # 8 CPUs of quota over 4 ranks: 2 each against 16
    f = next(f for f in rep["findings"] if f["kind"] == "host_overhead")
    assert f["cause"] == "host_starved" and f["evidence"]["cpus_per_rank"] == 2


def test_cpu_runs_with_fewer_cpus_per_rank_say_so(tmp_path):
    """On CPU the job's CPUs are its compute: a run whose ranks had fewer (affinity or quota) is compared
    (the like-for-like table shows both), and its compute stall names the CPUs per rank of both runs."""
    paths = []
    for name, world, step, cpus in (("a", 1, 1000.0, 2), ("b", 2, 30000.0, 1)):  # beyond gloo's all-reduce
        p = make_log(tmp_path / f"{name}.json", world, step)
        log = json.loads(Path(p).read_text())
        log["startup_info"]["hardware"]["device"] = "cpu"
        Path(p).write_text(json.dumps(log))
        paths.append(with_host(p, cpus=2, cpus_affinity=cpus, ranks_per_host=world))
    rep = report(tmp_path, *paths)
    rows = {r["key"]: r for r in rep["like_for_like"]}
    assert rows["cpus_job"]["values"] == [2, 1] and rows["cpus_per_rank"]["values"] == [2, 0.5]
    f = rep["findings"][0]
    assert rep["verdict"] == "compute_stall" and f["cause"] == "cpu"
    assert "0.5 CPUs per rank against the baseline's 2: on CPU they are its compute" in f["title"]
    assert (f["evidence"]["cpus_per_rank"], f["evidence"]["baseline_cpus_per_rank"]) == (0.5, 2)


def test_cgroup_cpu_quota_is_read_in_either_version(tmp_path):
    """The run log's CPU quota: cgroup v2's cpu.max (quota and period, `max` for none), else v1's CFS
    files (a quota of -1 for none)."""
    from titanlite.metrics.run_log import cpu_quota

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("250000 100000\n")
    assert cpu_quota(v2) == 2.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    for quota, cpus in (("150000", 1.5), ("-1", None)):
        (v1 / "cpu" / "cpu.cfs_quota_us").write_text(quota + "\n")
        assert cpu_quota(v1) == cpus
    assert cpu_quota(tmp_path / "none") is None
