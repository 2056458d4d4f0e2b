"""Weak scaling 1 -> 2 -> 4 GPUs and titanlite.diagnose on it, in one call on one multi-GPU host.

  python benchmarks/scaling_study.py [--ngpus 1,2,4] [--peer] [--steps 25] [--matmuls 60]

Every world size does the same per-GPU work (LLaMA 1.36B, local batch 4 x seq 2048, no accumulation,
compile): titanlite's defaults on 1 GPU and ddp, fsdp and zero1 on more (compare_peer's "scaling"
suite), torchtitan 0.2.2 and 0.3.0 (fsdp and ddp) at 1 GPU and at the largest size with --peer.
Then ddp at the largest size once more with every rank doing --matmuls extra 8192^3 bf16 matmuls a
micro-step (a compute stall), and two titanlite.diagnose reports over the ddp series: the clean one
(expected verdict: healthy) and the one ending in the stalled run (expected: compute_stall).
Writes scaling_study.md, scaling_study.json, diagnose_clean.md and diagnose_stall.md to --out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_peer  # noqa: E402
import launch  # noqa: E402  (benchmarks/launch.py: the one launcher)

EXPECTED = {"clean": "healthy", "stall": "compute_stall"}


def newest_log(folder: Path) -> str | None:
    log = launch.run_log(folder)
    return str(log) if log else None


def diagnose(name: str, logs: list[str | None], folder: Path | None = None) -> dict:
    """titanlite.diagnose over `logs` (its report in FOLDER, default WORK/diagnose_NAME): the verdict, its
    confidence, each run's scaling efficiency ([world size, efficiency]), the rank a straggler finding names, the first finding's
    title, the command; or the line that says why there is no report ("error")."""
    folder = folder or launch.WORK / f"diagnose_{name}"
    res = {"name": name, "verdict": None, "folder": str(folder), "logs": logs}
    if not all(logs):
        return {**res, "error": "not run (a run of the series has no log)"}
    cmd = [sys.executable, "-m", "titanlite.diagnose", *logs, "--out", str(folder)]
    res["command"] = " ".join(["python", *cmd[1:]])
    r = subprocess.run(cmd, cwd=launch.ROOT, capture_output=True, text=True, env=launch.bench_env())
    if r.returncode != 0:
        return {**res, "error": f"diagnose failed: {((r.stderr or r.stdout).strip().splitlines() or [''])[-1]}"}
    rep = json.loads((folder / "report.json").read_text())
    straggler = next((f for f in rep["findings"] if f["kind"] == "straggler"), None)
    return {**res, "verdict": rep.get("verdict"), "confidence": rep.get("confidence"),
            "efficiency": [[x["world_size"], x["efficiency"]] for x in (rep.get("scaling_efficiency") or {}).get("runs", [])],
            "straggler_rank": straggler["evidence"]["rank"] if straggler else None,
            "finding": rep["findings"][0]["title"] if rep["findings"] else ""}


def verdict_line(name: str, d: dict, out: Path) -> str:
    """One line of the study's output for diagnosis `d`; its report.md copied to OUT/diagnose_NAME.md."""
    if d.get("error"):
        return f"{name}: {d['error']}"
    shutil.copyfile(Path(d["folder"]) / "report.md", out / f"diagnose_{name}.md")
    return f"{name}: verdict {d['verdict']} (expected {EXPECTED[name]}) | {d['command']}"


def main(argv: list[str] | None = None) -> None:
    ap = launch.Parser(__doc__)
    ap.add_argument("--ngpus", default="1,2,4", help="comma-separated world sizes, smallest first")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--peer", action="store_true", help="torchtitan 0.2.2 and 0.3.0 at 1 GPU and the largest size")
    ap.add_argument("--matmuls", type=int, default=60, help="extra 8192^3 matmuls per micro-step in the stalled run")
    ap.add_argument("--timeout", type=int, default=420)
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/scaling_study"))
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    sizes = sorted({int(n) for n in a.ngpus.split(",")})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    versions = list(launch.PEERS) if a.peer else []
    rows, ddp_logs = [], []
    for n in sizes:
        peers: dict[str, dict[str, launch.Result]] = {}
        if n in (1, sizes[-1]):
            for mode in (["fsdp"] if n == 1 else ["fsdp", "ddp"]):
                for v in versions:
                    r = launch.peer(v, n, compare_peer.PEER_MODES[mode](n) + ["--training.steps", str(a.steps)],
                                    timeout=a.timeout + 180)
                    peers.setdefault(mode, {})[v] = r
                    rows.append((f"torchtitan {v} {mode}", r, {}))
        configs = {"compile": compare_peer.SUITES["single"]["compile"]} if n == 1 else compare_peer.SUITES["scaling"]
        for name, args in configs.items():
            r = launch.titanlite(f"{name}_{n}gpu", args, n, a.steps, 5, a.timeout)
            rows.append((name, r, peers.get(compare_peer.dp_mode(args)) or peers.get("fsdp", {})))
            if n == 1 or name == "ddp":
                ddp_logs.append(newest_log(launch.WORK / f"{name}_{n}gpu"))
    stall = launch.titanlite(f"ddp_stall_{sizes[-1]}gpu", compare_peer.SUITES["scaling"]["ddp"] + [
        "--debug.inject_compute_matmuls", str(a.matmuls), "--debug.inject_matmul_size", "8192"],
        sizes[-1], a.steps, 5, a.timeout)
    rows.append((f"ddp + {a.matmuls} matmuls/micro-step", stall, {}))
    verdicts = [verdict_line("clean", diagnose("clean", ddp_logs), out),
                verdict_line("stall", diagnose("stall", ddp_logs[:-1] + [newest_log(launch.WORK / stall.name)]), out)]
    text = (f"LLaMA 1.36B, local batch 4 x seq 2048 per GPU, compile, {a.steps} steps, steady state after step "
            f"{a.skip}\n\n" + compare_peer.table(rows, versions, a.skip) + "\n\n" + "\n".join(verdicts))
    print("\n" + text)
    launch.save(out, "scaling_study", text, [r for _, r, _ in rows])


if __name__ == "__main__":
    main()
