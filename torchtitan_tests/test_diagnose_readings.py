"""titanlite.diagnose reconstructs what ran from logs whose logger misreports it, in every log format.

Each test simulates one logger: a pair of runs (2 and 8 H100s, LLaMA 1.36B, local batch 16, seq 2048)
with a known truth (micro-steps each GPU ran, tokens/s per GPU), written in one of the formats
diagnose reads, with chosen misreports. The reconstruction must name exactly those misreports, give
the true micro-steps, tokens/s per GPU and MFU on the dense peak within 1%, and the verdict.
"""

import json
import subprocess
import sys

import pytest

from titanlite.diagnose import Settings, diagnose
from titanlite.diagnose.advice import REMEDIES
from titanlite.diagnose.reconstruct import MISREPORTS
from titanlite.hardware import by_key
from titanlite.models import get_model_args

from conftest import ROOT, concurrently

ARGS = get_model_args("llama", "1.36B")
SEQ, LOCAL = 2048, 16
F_DENSE = ARGS.flops_per_token(SEQ)
F_EMBED = F_DENSE + 6 * (ARGS.num_params() - ARGS.num_params(exclude_embedding=True))
H100 = by_key("h100")
PEAK = H100.peak_tflops
PER_GPU = 50_000.0  # true tokens/s per GPU: 42% MFU on the dense peak
SCOPE = {"titanlite": "one_gpu", "json_log": "one_gpu", "console": "one_gpu", "torchtitan": "all_gpus"}


def simulate(gpus: int, micro_steps: int, misreports: set[str], fmt: str, per_gpu: float = PER_GPU,
             printed_accum: int | None = None) -> dict:
    """The figures a logger with `misreports` writes for a run that really ran `micro_steps` per GPU
    per step at `per_gpu` tokens/s per GPU."""
    accum = printed_accum or (micro_steps * gpus if "accumulation_split" in misreports else micro_steps)
    scale = {"tokens_per_sec_is_one_gpu": 1 / gpus, "tokens_per_sec_is_all_gpus": gpus}
    s = next((v for k, v in scale.items() if k in misreports), 1.0)
    fx = F_EMBED if "flops_with_embedding" in misreports else F_DENSE
    c = 4 if "peak_4x_dense" in misreports else 2 if "peak_2x_dense" in misreports else 1
    q = 1 / gpus if "mfu_per_gpu_over_all_gpus" in misreports else gpus if "mfu_all_gpus_over_one" in misreports else 1
    rate = per_gpu * s * (1 if fmt == "torchtitan" else gpus)  # what the format documents: per GPU, or all GPUs
    return {"gpus": gpus, "accum": accum, "step_ms": 1000 * LOCAL * micro_steps * SEQ / per_gpu, "rate": rate,
            "tflops": rate * fx / 1e12, "mfu": 100 * per_gpu * fx * q / (c * PEAK * 1e12), "peak": c * PEAK,
            "flops": fx}


def iterations(sim: dict):
    """Iter 0 holds start-up (slow, marked); iters 10..50 the steady state, with a little jitter."""
    for i, it in enumerate(range(0, 51, 10)):
        yield it, sim["step_ms"] * (20 if it == 0 else 1 + 0.002 * (i % 3 - 1))


def write_titanlite(path, sim):
    its = [{"iter": it, "loss": 3.0, "time_ms": t, "tokens_per_sec": sim["rate"] * sim["step_ms"] / t,
            "tokens_per_sec_per_gpu": sim["rate"] * sim["step_ms"] / t / sim["gpus"],
            "tflops": sim["tflops"] * sim["step_ms"] / t, "mfu": sim["mfu"] * sim["step_ms"] / t,
            "memory_peak_gb": 61.2} for it, t in iterations(sim)]
    cfg = {"world_size": sim["gpus"], "batch_size": LOCAL, "gradient_accumulation_steps": sim["accum"],
           "global_batch_size": LOCAL * sim["accum"] * sim["gpus"], "seq_len": SEQ, "compile": True,
           "use_cuda_graphs": False, "use_dataloader": True, "data_parallel": "ddp", "model.name": "llama",
           "model.flavor": "1.36B", "training.mixed_precision_param": "bfloat16"}
    log = {"startup_info": {"config": cfg, "hardware": {"device": "cuda", "name": H100.device_name,
                                                        "peak_tflops_per_gpu": sim["peak"]},
                            "software": {"titanlite": "0.1.0"},
                            "model": {"name": "llama", "flavor": "1.36B", "params": ARGS.num_params(),
                                      "params_without_input_embedding": ARGS.num_params(exclude_embedding=True),
                                      "flops_per_token": sim["flops"]}},
           "training_iterations": its}
    path.write_text(json.dumps(log))


def write_json_log(path, sim):
    """The earlier trainer's JSON run log: nanoGPT names (block_size, dt_ms), no breakdown."""
    its = [{"iter": it, "loss": 3.0, "dt_ms": t, "tokens_per_sec": sim["rate"] * sim["step_ms"] / t,
            "mfu": sim["mfu"] * sim["step_ms"] / t} for it, t in iterations(sim)]
    cfg = {"world_size": sim["gpus"], "batch_size": LOCAL, "gradient_accumulation_steps": sim["accum"],
           "block_size": SEQ, "compile": True, "use_cuda_graphs": False, "use_dataloader": False}
    log = {"startup_info": {"config": cfg, "hardware": {"gpu_name": H100.device_name, "peak_tflops": sim["peak"]},
                            "model": {"params": ARGS.num_params(), "flops_per_token": sim["flops"]}},
           "training_iterations": its}
    path.write_text(json.dumps(log))


def write_console(path, sim):
    """That trainer's console output, tqdm and separator lines included."""
    g = sim["gpus"]
    lines = ["Loading checkpoint... none", "=" * 70, "⚙️  TRAINING CONFIGURATION:",
             f"  Batch size (micro):    {LOCAL}", f"  Gradient accum steps:  {sim['accum']}",
             f"  Effective batch size:  {LOCAL * sim['accum'] * g}",
             f"  Tokens per iteration:  {LOCAL * sim['accum'] * g * SEQ:,}", "🖥️  HARDWARE:",
             f"  Device:                {H100.device_name}", f"  GPUs:                  {g}",
             "  Precision:             bfloat16", "  Compile:               True", "  Parallelism:           DDP",
             "📈 THEORETICAL PERFORMANCE:", f"  Hardware peak:         {sim['peak']:.1f} TFLOPS (H100 bf16)",
             f"  FLOPs per token:       {sim['flops'] / 1e9:.2f} GFLOPs", "=" * 70]
    for it, t in iterations(sim):
        f = sim["step_ms"] / t
        if it == 0:
            lines.append(f"Iter 0: loss 10.8400, time {t:.0f}ms (warming up...)")
            continue
        lines += [f"Training: {it}%|██        | {it}/100 [00:{it:02d}<01:21,  1.10it/s]\r"
                  f"Training: {it}%|██        | {it}/100 [00:{it:02d}<01:20,  1.11it/s]",
                  f"📍 Iter {it:>6} │ Loss: 10.7701 │ Time: {t:.0f}ms │ LR: 1.50e-06",
                  f"⚡ MFU: {sim['mfu'] * f:.2f}% │ Achieved: {sim['tflops'] * f:.1f} TF │ Peak: {sim['peak']:.1f} TF",
                  f"   Tokens/s: {sim['rate'] * f:.0f} │ FLOPs/token: {sim['flops'] / 1e9:.2f} GF "
                  f"(6N+12LHQT: N={ARGS.num_params() / 1e9:.3f}B)",
                  "💾 Memory: 12.10 GB alloc │ 61.20 GB peak │ 66.00 GB reserved", "-" * 70]
    path.write_text("\n".join(lines) + "\n")


def write_torchtitan(path, sim):
    """torchtitan's console: colour codes, a rank prefix; per-GPU tps; no step time, accumulation or world size."""
    c = {"red": "\x1b[31m", "green": "\x1b[32m", "yellow": "\x1b[33m", "blue": "\x1b[34m", "reset": "\x1b[39m"}
    lines = [f"[rank0]:[titan] 2026-11-23 10:00:00,000 - root - INFO - CUDA capacity: {H100.device_name} with "
             "79.11GiB memory"]
    for it, t in iterations(sim):
        if it == 0:
            continue
        f = sim["step_ms"] / t
        lines.append(f"[rank0]:[titan] 2026-11-23 1{sim['gpus']}:00:{it:02d},000 - root - INFO - {c['red']}step: {it:2}  "
                     f"{c['green']}loss:  7.1234  {c['yellow']}memory: 34.70GiB(43.86%)  {c['blue']}tps: "
                     f"{round(sim['rate'] * f):,}  tflops: {sim['tflops'] * f:,.2f}  mfu: {sim['mfu'] * f:.2f}%{c['reset']}")
    path.write_text("\n".join(lines) + "\n")


WRITERS = {"titanlite": write_titanlite, "json_log": write_json_log, "console": write_console,
           "torchtitan": write_torchtitan}
SUFFIX = {"titanlite": "json", "json_log": "json", "console": "log", "torchtitan": "log"}
# torchtitan logs carry no step time and no accumulation: the work per step cannot be questioned there
ACCUMULATION = {"accumulation_split", "accumulation_differs"}


def pair(tmp_path, fmt, misreports, per_gpu_b=PER_GPU):
    """2 and 8 GPUs, the same printed settings (local batch 16, accumulation 32 unless a misreport
    changes what each GPU ran), the true per-GPU rate PER_GPU (and `per_gpu_b` at 8 GPUs)."""
    runs = []
    for gpus, rate in ((2, PER_GPU), (8, per_gpu_b)):
        if "accumulation_split" in misreports:
            sim = simulate(gpus, 32 // gpus, misreports, fmt, rate)  # printed 32, each GPU runs 32 / GPUs
        elif "accumulation_differs" in misreports and gpus == 2:
            sim = simulate(gpus, 2, misreports, fmt, rate, printed_accum=32)  # prints 32, runs 2
        else:
            sim = simulate(gpus, 32 if fmt != "torchtitan" else 1, misreports - ACCUMULATION, fmt, rate)
        path = tmp_path / f"{fmt}_{gpus}.{SUFFIX[fmt]}"
        WRITERS[fmt](path, sim)
        runs.append((path, sim))
    return runs


def settings(fmt):
    if fmt != "torchtitan":
        return None
    return [Settings(gpus=g, local_batch=LOCAL, seq_len=SEQ, model="llama/1.36B") for g in (2, 8)]


def expected(fmt, misreports, gpus):
    out = set(misreports)
    if "tokens_per_sec_is_one_gpu" in out and fmt == "torchtitan":
        out = out - {"tokens_per_sec_is_one_gpu"} | {"tokens_per_sec_is_all_gpus"}
    if "accumulation_differs" in out and gpus == 8:
        out.discard("accumulation_differs")  # the 8-GPU run ran what it printed
    return sorted(out)


CASES = [set(), {"tokens_per_sec_is_one_gpu"}, {"accumulation_split"}, {"accumulation_differs"},
         {"mfu_per_gpu_over_all_gpus"}, {"peak_2x_dense"}, {"peak_4x_dense"}, {"flops_with_embedding"},
         # two together: a per-GPU rate divided by all GPUs' peak (titanlite's MFU formula fed a per-GPU rate),
         # the sparse-fp8 peak with N counting the embedding (the earlier trainer's MFU line), a split
         # accumulation with a 2x peak, a different accumulation with a per-GPU rate
         {"tokens_per_sec_is_one_gpu", "mfu_per_gpu_over_all_gpus"}, {"peak_4x_dense", "flops_with_embedding"},
         {"accumulation_split", "peak_2x_dense"}, {"accumulation_differs", "tokens_per_sec_is_one_gpu"}]


# Logs whose figures two readings predict equally well, only one of them the truth. With the GPU and the
# model known (every writer here names them), the MFU each reading implies ranks them: the truth implies
# 42% of the dense peak at both sizes, the other 21% and 5%, so the truth ranks first and the report says
# why. {(format, misreports): the other reading's misreports}.
RANKED = {
    # a per-GPU rate logged as the total with MFU over all GPUs' peak predicts every figure exactly as
    # each GPU running accumulation / GPUs does; only a printed effective batch tells them apart, and
    # the earlier trainer's JSON log has none
    ("json_log", frozenset({"tokens_per_sec_is_one_gpu", "mfu_per_gpu_over_all_gpus"})): ["accumulation_split"],
    ("json_log", frozenset({"tokens_per_sec_is_one_gpu"})): ["accumulation_split", "mfu_all_gpus_over_one"],
    ("json_log", frozenset({"accumulation_differs", "tokens_per_sec_is_one_gpu"})):
        ["accumulation_split", "mfu_all_gpus_over_one"],
    # without a step time, tps per GPU with MFU over all GPUs' peak reads exactly like a total tps with
    # a right MFU
    ("torchtitan", frozenset({"mfu_per_gpu_over_all_gpus"})): ["tokens_per_sec_is_all_gpus"],
}


@pytest.mark.parametrize("fmt,misreports", [
    pytest.param(fmt, m, id=f"{fmt}-{'+'.join(sorted(m)) or 'none'}") for fmt in WRITERS for m in CASES
    if not (fmt == "torchtitan" and m & ACCUMULATION)])  # torchtitan prints no accumulation, no step time
def test_reading_and_corrected_figures(tmp_path, fmt, misreports):
    if fmt == "torchtitan" and "tokens_per_sec_is_one_gpu" in misreports:
        misreports = misreports - {"tokens_per_sec_is_one_gpu"} | {"tokens_per_sec_is_all_gpus"}
    runs = pair(tmp_path, fmt, misreports)
    a = diagnose([str(p) for p, _ in runs], tmp_path / "out", settings=settings(fmt))
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    rec = rep["reconstruction"]
    if (fmt, frozenset(misreports)) in RANKED:  # a tie the implied MFU breaks, and the report says why
        (ranking,) = rec["ranking"]
        assert list(ranking["first_mfu_pct"].values()) == pytest.approx([42.2, 42.2], abs=0.1)
        (other,) = ranking["others_mfu_pct"]
        assert list(other.values()) == pytest.approx([21.1, 5.3], abs=0.1)
        assert ranking["band_pct"][0] <= 42.2 <= ranking["band_pct"][1]
        assert all(m in ranking["text"] for m in RANKED[fmt, frozenset(misreports)])
        assert "**Why this reading:** The reading ranked first" in (tmp_path / "out" / "report.md").read_text()
        assert not any(got["ambiguous_with"] for got in rec["runs"]) and rep["other_readings"] == []
    else:
        assert rec["ranking"] == []
    if fmt == "torchtitan":  # no step time: read through the logged rate, and the report says so
        assert rep["confidence"] == "medium" and all("no time per iteration" in r for r in rep["confidence_reasons"])
    else:
        assert rep["confidence"] == "high", rep["confidence_reasons"]
    for (path, sim), got in zip(runs, rec["runs"]):
        assert got["path"] == str(path) and got["format"] == fmt  # argument order, format detected
        assert got["reading"] == expected(fmt, misreports, sim["gpus"]), got["why"]
        micro = 2 if "accumulation_differs" in misreports and sim["gpus"] == 2 else (
            32 // sim["gpus"] if "accumulation_split" in misreports else 32 if fmt != "torchtitan" else 1)
        assert got["micro_steps_per_step"] == micro
        assert got["tokens_per_sec_per_gpu"] == pytest.approx(PER_GPU, rel=0.01)
        assert got["mfu_dense_pct"] == pytest.approx(100 * PER_GPU * F_DENSE / (PEAK * 1e12), rel=0.01)
        assert got["gpus"] == sim["gpus"] and got["plausibility"] == "possible"
    assert rec["scaling_efficiency"] == pytest.approx(1.0, rel=0.01)
    if misreports:
        assert a.verdict == "measurement_inconsistency"
        assert a.findings[0].title.startswith("No scaling loss"), a.findings[0].title
        assert a.findings[0].cause == "misreport"
        # every misreport the simulated loggers made, in its own field: remedies are for the run, not the logger
        assert a.findings[0].misreports == sorted(misreports) and a.findings[0].remedies == []
        assert rep["findings"][0]["misreports"] == sorted(misreports)
        assert not {"compute_stall", "communication", "straggler"} & {f.kind for f in a.findings}
    else:
        assert a.verdict == "healthy", a.findings[0].title
    for f in rep["findings"]:  # each list holds keys of its own table
        assert set(f["remedies"]) <= set(REMEDIES) and set(f["misreports"]) <= set(MISREPORTS), f
    md = (tmp_path / "out" / "report.md").read_text()
    assert md.index("## What the logs say, reconstructed") < md.index("## Findings, ranked")


def test_readings_that_fit_equally_give_each_verdict_and_what_settles_it(tmp_path):
    """The JSON logs of RANKED's first case without a GPU name or parameter count: the two readings fit
    equally and the MFU cannot rank them. One (each GPU ran 32 / GPUs micro-steps) means the 8-GPU run
    computes 4x slower per GPU, the other (a per-GPU rate logged as the total) that nothing is lost: the
    first line names both verdicts, the next what would settle them. With the GPU and the model, the
    implied MFU ranks the truth first and the verdict is one."""
    runs = pair(tmp_path, "json_log", {"tokens_per_sec_is_one_gpu", "mfu_per_gpu_over_all_gpus"})
    paths = [str(p) for p, _ in runs]
    for p in paths:
        log = json.loads(open(p).read())
        del log["startup_info"]["hardware"], log["startup_info"]["model"]
        open(p, "w").write(json.dumps(log))
    r = run_cli(*paths, "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert rep["verdicts"] == ["compute_stall", "measurement_inconsistency"]
    (other,) = rep["other_readings"]
    assert other["verdict"] == "measurement_inconsistency" and other["summary"].startswith("No scaling loss")
    assert [x["micro_steps_per_step"] for x in other["runs"]] == [32, 32]
    assert [x["micro_steps_per_step"] for x in rep["reconstruction"]["runs"]] == [16, 4]
    first = r.stdout.splitlines()[0]
    assert first.startswith("verdict: compute_stall or measurement_inconsistency (two readings fit the logs equally)")
    assert (tmp_path / "o" / "report.md").read_text().startswith(
        "# Verdict: compute_stall or measurement_inconsistency (two readings fit the logs equally), confidence medium")
    assert rep["settle_with"].split(" --") == ["--hardware GPU", "model NAME/FLAVOR", "accum A"]
    assert rep["settle_logs"] == ["the effective batch or the tokens seen"]
    assert r.stdout.splitlines()[1] == ("to settle it: rerun diagnose with --hardware GPU --model NAME/FLAVOR --accum A, "
                                        "or give logs that show the effective batch or the tokens seen")
    r = run_cli(*paths, "--hardware", "h100", "--model", "llama/1.36B", "--out", str(tmp_path / "p"))
    rep = json.loads((tmp_path / "p" / "report.json").read_text())
    assert r.returncode == 0 and rep["verdicts"] == ["measurement_inconsistency"] and rep["other_readings"] == []
    assert [x["micro_steps_per_step"] for x in rep["reconstruction"]["runs"]] == [32, 32]
    assert len(rep["reconstruction"]["ranking"]) == 1 and rep["confidence"] == "high"
    r = run_cli(*paths, "--accum", "32", "--out", str(tmp_path / "q"))  # the accumulation given: no split reading
    rep = json.loads((tmp_path / "q" / "report.json").read_text())
    assert r.returncode == 0 and rep["verdicts"] == ["measurement_inconsistency"], rep["verdicts"]


@pytest.mark.parametrize("fmt", ["titanlite", "console"])
def test_a_real_loss_behind_a_misreport_is_still_found(tmp_path, fmt):
    """The logger splits accumulation by world size and the 8-GPU run really is slower per GPU (60%):
    corrected, the loss is a compute stall, and the misreport is found beside it."""
    runs = pair(tmp_path, fmt, {"accumulation_split"}, per_gpu_b=0.6 * PER_GPU)
    a = diagnose([str(p) for p, _ in runs], tmp_path / "out")
    assert a.verdict == "compute_stall" and "measurement_inconsistency" in [f.kind for f in a.findings]
    rec = json.loads((tmp_path / "out" / "report.json").read_text())["reconstruction"]
    assert rec["scaling_efficiency"] == pytest.approx(0.6, rel=0.01)
    assert [r["micro_steps_per_step"] for r in rec["runs"]] == [16, 4]


ISSUE_RUN = """⚙️  TRAINING CONFIGURATION:
  Batch size (micro):    16
  Gradient accum steps:  32
  Effective batch size:  {eff}
  Tokens per iteration:  {tokens:,}
🖥️  HARDWARE:
  Device:                NVIDIA H100 80GB HBM3
  GPUs:                  {gpus}
  Precision:             bfloat16
  Compile:               True
  Parallelism:           DDP
📈 THEORETICAL PERFORMANCE:
  Hardware peak:         3958.0 TFLOPS (H100 bf16)
  FLOPs per token:       8.78 GFLOPs
Iter 0: loss 10.8400, time 21003ms (warming up...)
Training:  10%|█         | 10/100 [00:39<01:21,  1.10it/s]
──────────────────────────────────────────────────────────────────────
📍 Iter     10 │ Loss: 10.7701 │ Time: {ms}ms │ LR: 1.50e-06
⚡ MFU: 16.15% │ Achieved: 639.3 TF │ Peak: 3958.0 TF
   Tokens/s: 72818 │ FLOPs/token: 8.78 GF (6N+12LHQT: N=1.294B)
💾 Memory: 12.10 GB alloc │ 61.20 GB peak │ 66.00 GB reserved
"""


def issue_pair(tmp_path):
    paths = []
    for gpus, ms in ((2, 900), (8, 14400)):
        p = tmp_path / f"console_{gpus}gpu.txt"
        p.write_text(ISSUE_RUN.format(eff=16 * 32 * gpus, tokens=16 * 32 * gpus * 2048, gpus=gpus, ms=ms))
        paths.append(str(p))
    return paths


def test_console_example_is_no_scaling_loss(tmp_path):
    """Run A prints 32 micro-steps but its step time and rate fit 2 (32 would need ten times an H100's
    dense peak); run B ran its 32. One logged iteration after warm-up each: a verdict, lower confidence."""
    a = diagnose(issue_pair(tmp_path), tmp_path / "out")
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    rec = rep["reconstruction"]
    assert rep["verdict"] == "measurement_inconsistency" and rep["summary"].startswith("No scaling loss: the runs did "
                                                                                        "different work per step")
    assert rec["scaling_efficiency"] == pytest.approx(1.0, abs=0.02)
    assert [r["micro_steps_per_step"] for r in rec["runs"]] == [2, 32]
    assert rec["runs"][0]["printed_dense_peak_share"] > 9  # as printed: about ten times the dense peak
    assert {"peak_4x_dense", "flops_with_embedding", "tokens_per_sec_is_one_gpu"} <= set(rec["runs"][1]["reading"])
    assert "accumulation_differs" in rec["runs"][0]["reading"]
    assert rec["runs"][0]["mfu_dense_pct"] == pytest.approx(100 * 72818 * F_DENSE / (PEAK * 1e12), rel=0.01)
    assert rep["confidence"] == "low" and any("1 steady log entry" in r for r in rep["confidence_reasons"])
    assert not {"compute_stall", "communication", "straggler"} & {f["kind"] for f in rep["findings"]}
    assert a.findings[0].cause == "misreport" and a.findings[0].remedies == []
    assert a.findings[0].misreports == ["accumulation_differs", "flops_with_embedding", "peak_4x_dense",
                                        "tokens_per_sec_is_one_gpu"]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "titanlite.diagnose", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_flags_supply_and_override_and_are_marked(tmp_path):
    """torchtitan logs lack the world size: without --gpus, one line naming the flag; with it, the
    report marks the values that came from the command line. A flag also overrides what a log says.
    (The seven commands are independent and run two at a time.)"""
    runs = pair(tmp_path, "torchtitan", set())
    paths = [str(p) for p, _ in runs]
    # the H100 of the titanlite log replaced by an H200: same peak, the override is recorded
    t = pair(tmp_path, "titanlite", set())
    bads = ((["--gpus", "2,8,4"], "one per log"), (["--hardware", "tpu"], "not in titanlite's GPU table"),
            (["--model", "gpt/9B"], "not a registered model"), (["--seq-len", "0"], "positive integer"))
    asked, flagged, h200, *refused = concurrently(
        lambda: run_cli(*paths, "--out", str(tmp_path / "x")),
        lambda: run_cli(*paths, "--gpus", "2,8", "--local-batch", "16", "--seq-len", "2048", "--model", "llama/1.36B",
                        "--out", str(tmp_path / "o")),
        lambda: run_cli(*[str(p) for p, _ in t], "--hardware", "h200", "--out", str(tmp_path / "h")),
        *[lambda bad=bad: run_cli(*paths, *bad, "--out", str(tmp_path / "x")) for bad, _ in bads])
    r = asked
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "pass --gpus" in r.stderr and paths[0] in r.stderr
    r = flagged
    assert r.returncode == 0 and r.stdout.startswith("verdict: healthy"), r.stdout + r.stderr
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert rep["reconstruction"]["runs"][1]["overrides"]["world_size"] == {"log": None, "flag": 8}
    assert "(flag)" in (tmp_path / "o" / "report.md").read_text()
    r = h200
    got = json.loads((tmp_path / "h" / "report.json").read_text())["reconstruction"]["runs"][0]
    assert r.returncode == 0 and got["overrides"]["hardware"] == {"log": H100.device_name, "flag": "NVIDIA H200"}
    for r, (_, needle) in zip(refused, bads):
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr
