"""Two nodes on one host: two torchrun agents meeting through the c10d rendezvous on localhost, each with
half of the host's k GPUs, against the same k GPUs as one node.

    python benchmarks/multinode.py [--modes fsdp,hsdp,ddp] [--layouts one,two] [--steps 20] [--out DIR]
    python benchmarks/multinode.py --layouts sockets --modes fsdp,ddp     # estimation's check across nodes
    python benchmarks/multinode.py --resume                                # another world size, on GPUs

Layouts (LLaMA 1.36B at the peer's shapes, compile, synthetic tokens, `--steps` steps):
- one: one torchrun agent of k processes (--standalone);
- two: two agents of k/2 processes each (LOCAL_WORLD_SIZE k/2: hsdp shards inside a "node" and
  replicates across; fsdp's copy-engine gathers are off, by design, for groups spanning hosts);
- sockets: two agents with NCCL held to sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, over the
  loopback interface), a network between the two "nodes". Beside it, the bus bandwidth of all-reduce, all-gather and
  reduce-scatter over the same transport (benchmarks/collectives.py on two agents), and the estimator
  given that bandwidth (`--estimate.inter_node_gbps`, nodes of one GPU: every hop on sockets,
  `link_efficiency` 1 since the figure is achieved bandwidth): predicted against measured tok/s/GPU.

The table gives, per mode and layout, tok/s/GPU (steady after --skip), peak memory, and the losses
against the one-node run of the same mode: step 1 (same weights, same samples; 2 ranks' mean is the
same sum either way) within --step1-tol: bit for bit on the CPU (gloo, the tests), within 1e-4 on GPUs,
where each process picks its own kernels (Inductor benchmarks its generated kernels' launch configs,
cuBLAS its algorithms), which sum in their own orders; later steps within --tol, the spread GPU runs have by
themselves (nondeterministic kernels: two identical 1.36B runs differed by up to 5.4e-3 by step 10,
docs/checkpoint.md) with hsdp's 2 x 1 against 1 x 2 also summing the clip's norm in another order.

--resume: a checkpoint of 2 nodes x 1 GPU resumed on 1 GPU and one of 1 GPU resumed on 2 nodes x 1
(fsdp; global batch 8 = 2 x 4 or 4 x 2 accumulation; eager; 10 steps, checkpoint at 5): losses around
the resume against each uninterrupted run, and how far the two uninterrupted layouts differ from
each other (the yardstick: the same training on another reduction order).

Writes multinode.md and multinode.json (resume: multinode_resume.*) to --out; exit 1 if a check fails.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402  (benchmarks/launch.py: the one launcher)

MODES = ("fsdp", "hsdp", "ddp")
LAYOUTS = ("one", "two", "sockets")
# NCCL between the two "nodes" over TCP sockets (loopback: both are this host), as over a network
SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"}
# a CPU check of the script itself (tests): the debug model, gloo
DEBUG_SHAPES = ["--model.flavor", "debug", "--training.dataset", "synthetic", "--training.local_batch_size", "2",
                "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "2", "--validation.enable=false",
                "--checkpoint.enable=false", "--metrics.progress_bar=false"]
BANDWIDTH_OPS = {"ddp": ("all_reduce",), "fsdp": ("all_gather", "reduce_scatter")}


def run(mode: str, layout: str, a, base: list[str]) -> launch.Result:
    name = f"{mode}_{layout}"
    args = ["--parallelism.data_parallel", mode, *a.extra]
    nodes = 1 if layout == "one" else 2
    return launch.titanlite(name, args, a.ngpus, a.steps, a.log_freq, a.timeout, base=base, nodes=nodes,
                            env=SOCKETS if layout == "sockets" else None)


def compare(ref: launch.Result, other: launch.Result, tol: float, step1_tol: float = 0.0) -> dict:
    """Step 1's difference against `step1_tol`, the largest difference over the later steps both logged
    against `tol`."""
    a, b = launch.step_losses(ref.entries), launch.step_losses(other.entries)
    common = sorted(set(a) & set(b))
    if not common or 1 not in common:
        return {"step1_equal": None, "step1_diff": None, "max_diff": None, "ok": False}
    later = [abs(a[s] - b[s]) for s in common if s > 1]
    worst = max(later) if later else 0.0
    step1 = abs(a[1] - b[1])
    return {"step1_equal": a[1] == b[1], "step1": [a[1], b[1]], "step1_diff": step1, "max_diff": worst,
            "steps": len(common), "ok": step1 <= step1_tol and worst <= tol}


def bandwidth(a, work: Path) -> dict | None:
    """collectives.py on two agents with NCCL held to sockets: its JSON (None if it failed)."""
    out = work / "collectives.json"
    out.unlink(missing_ok=True)
    sizes = "1,4" if a.debug else "16,64,256"
    agents = launch.node_commands(2, a.ngpus // 2, [str(Path(__file__).parent / "collectives.py"), "--sizes-mb", sizes,
                                                    "--out", str(out)], "collectives")
    rc, text, _ = launch.execute_nodes("collectives_sockets", agents, a.timeout, work, env=SOCKETS)
    print("\n".join(ln for ln in text.splitlines() if ln.startswith("|") or "bus bandwidth" in ln), flush=True)
    return json.loads(out.read_text()) if rc == 0 and out.exists() else None


def busbw(measured: dict, mode: str, per_node: int) -> float:
    """GB/s the mode's collectives reach at the largest size measured: ddp's all-reduce, fsdp's gathers and
    reduce-scatters; hsdp's all-reduce across (and its gathers inside when a node has several GPUs)."""
    ops = BANDWIDTH_OPS.get(mode) or (("all_reduce",) if per_node == 1 else ("all_reduce", "all_gather",
                                                                           "reduce_scatter"))
    return sum(measured["ops"][op][-1]["busbw_gbps"] for op in ops) / len(ops)


def predict(mode: str, gbps: float, a, base: list[str], hardware: str) -> tuple[float | None, str]:
    """The estimator's tok/s/GPU for `mode` on k ranks, nodes of one GPU, the network at `gbps` GB/s."""
    # every hop is on sockets: nodes of one GPU for the model, hsdp's mesh as the run's (a "node" of k/2)
    mesh = ["--parallelism.shard_degree", str(a.ngpus // 2)] if mode == "hsdp" else []
    options = [*base, "--parallelism.data_parallel", mode, *mesh, *a.extra, "--estimate.ngpu", str(a.ngpus),
               "--estimate.gpus_per_node", "1", "--estimate.inter_node_gbps", f"{8 * gbps:.4g}",
               "--estimate.link_efficiency", "1", "--estimate.search=false", "--estimate.hardware", hardware]
    report, error, _ = launch.estimate(f"estimate_{mode}_sockets", options, a.timeout)
    if report is None or not report["memory"]["fits"]:
        return None, error or "the estimate says the run does not fit"
    return (report["throughput"].get("overlap") or {}).get("tokens_per_sec_per_gpu"), " ".join(["estimation", *options])


def hardware_key() -> str:
    import torch

    from titanlite.hardware import lookup

    hw = lookup(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    return hw.key if hw else "h100"


def throughput(a, base: list[str], out: Path) -> int:
    results, rows, checks, validation = [], [], [], []
    measured = bandwidth(a, launch.WORK) if "sockets" in a.layouts else None
    if "sockets" in a.layouts and measured is None:
        print("the collective benchmark over sockets failed (see WORK/collectives_sockets.node*.log)", flush=True)
    for mode in a.modes:
        done = {layout: run(mode, layout, a, base) for layout in a.layouts}
        results += done.values()
        ref = done.get("one")
        for layout, r in done.items():
            f = r.figures(a.skip)
            c = compare(ref, r, a.tol, a.step1_tol) if ref is not None and layout != "one" and not r.error else None
            if c is not None:
                checks.append(c["ok"])
            rows.append({"mode": mode, "layout": layout, "error": r.error, **f, "vs_one": c})
            if layout == "sockets" and measured is not None and not r.error:
                gbps = busbw(measured, mode, a.ngpus // 2)
                pred, how = predict(mode, gbps, a, base, hardware_key())
                err = None if pred is None or not f.get("tps_gpu") else 100 * (pred / f["tps_gpu"] - 1)
                validation.append({"mode": mode, "busbw_gbps": gbps, "measured": f.get("tps_gpu"), "predicted": pred,
                                   "err_pct": err, "estimate": how})
        one = next((x for x in rows if x["mode"] == mode and x["layout"] == "one"), None)
        for x in rows:
            if x["mode"] == mode and one and one.get("tps_gpu") and x.get("tps_gpu"):
                x["of_one"] = x["tps_gpu"] / one["tps_gpu"]
    text = table(rows, validation, a)
    print("\n" + text, flush=True)
    launch.save(out, "multinode", text, results, {"rows": rows, "validation": validation, "bandwidth": measured})
    # the estimate is of the GPU; on the CPU (--debug) it is shown, not judged
    off = [v for v in validation if v["err_pct"] is None or abs(v["err_pct"]) > 10]
    unmeasured = "sockets" in a.layouts and measured is None
    return 1 if any(r.error for r in results) or not all(checks) or unmeasured or (off and not a.debug) else 0


def table(rows: list[dict], validation: list[dict], a) -> str:
    k = a.ngpus
    names = {"one": f"1 node x {k}", "two": f"2 nodes x {k // 2}", "sockets": f"2 nodes x {k // 2}, sockets"}
    lines = [f"| mode | layout | tok/s/GPU | of one node | peak GiB (alloc / rsrvd) | step 1 loss diff (tol {a.step1_tol:g}) | "
             f"max loss diff, steps 2-{a.steps} (tol {a.tol:g}) |", "|---|---|---|---|---|---|---|"]
    for x in rows:
        if x["error"]:
            lines.append(f"| {x['mode']} | {names[x['layout']]} | {x['error']} | | | | |")
            continue
        c = x["vs_one"]
        eq = ("-" if c is None else "no loss" if c["step1_diff"] is None else
              "0 (bit for bit)" if c["step1_equal"] else f"{c['step1_diff']:.2e}")
        diff = "-" if c is None or c["max_diff"] is None else f"{c['max_diff']:.2e}" + ("" if c["ok"] else " (over)")
        lines.append(f"| {x['mode']} | {names[x['layout']]} | {launch.fmt(x.get('tps_gpu'), ',.0f')} | "
                     f"{launch.fmt(x.get('of_one'), '.3f')} | {launch.fmt(x.get('mem'), '.2f')} / "
                     f"{launch.fmt(x.get('reserved'), '.2f')} | {eq} | {diff} |")
    if validation:
        lines += ["", "| mode, sockets | bus bandwidth used, GB/s | measured tok/s/GPU | predicted | err % |",
                  "|---|---|---|---|---|"]
        for v in validation:
            lines.append(f"| {v['mode']} | {v['busbw_gbps']:.2f} | {launch.fmt(v['measured'], ',.0f')} | "
                         f"{launch.fmt(v['predicted'], ',.0f')} | {launch.fmt(v['err_pct'], '+.1f')} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- resume
def resume(a, base: list[str], out: Path) -> int:
    """2 nodes x 1 -> 1 GPU and 1 GPU -> 2 nodes x 1, each against its uninterrupted run."""
    steps, at = 10, 5
    work = launch.WORK / "resume"
    shutil.rmtree(work, ignore_errors=True)
    shape = [*base, "--parallelism.data_parallel", "fsdp", "--training.global_batch_size",
             str(2 * int(_option(base, "--training.local_batch_size"))), "--lr_scheduler.warmup_steps", "2",
             "--metrics.log_freq", "1", *a.extra]
    save = ["--checkpoint.enable", "--checkpoint.interval", str(at), "--checkpoint.keep_latest_k", "0"]

    def train(name: str, nodes: int, *extra: str) -> launch.Result:
        r = launch.titanlite(name, list(extra), 2 if nodes == 2 else 1, steps, 1, a.timeout, work=work, base=shape,
                             nodes=nodes, env=None if nodes == 2 else {"CUDA_VISIBLE_DEVICES": _first_gpu()})
        if r.error:
            print(f"{name}: {r.error}\n" + "\n".join(r.output.splitlines()[-30:]), flush=True)
        return r

    results, pairs = [], []
    position = at * int(_option(shape, "--training.global_batch_size"))  # the stream position saved at step `at`
    for first, then in ((2, 1), (1, 2)):
        ref = train(f"uninterrupted_{first}", first, *save)
        got = train(f"resumed_{first}_to_{then}", then, "--checkpoint.enable=false", "--checkpoint.load_step", str(at),
                    "--checkpoint.folder", str(work / f"uninterrupted_{first}" / "checkpoint"))
        shutil.rmtree(work / f"uninterrupted_{first}" / "checkpoint", ignore_errors=True)  # 15.5 GB a step at 1.36B
        results += [ref, got]
        resharded = (f"checkpoint saved by {first} ranks, this run has {then}" in got.output
                     and f"re-sharding the stream at position {position} " in got.output)
        pairs.append((first, then, launch.step_losses(ref.entries), launch.step_losses(got.entries), resharded))
    a_ref, c_ref = pairs[0][2], pairs[1][2]
    spread = max((abs(a_ref[s] - c_ref[s]) for s in set(a_ref) & set(c_ref)), default=None)
    lines = ["| step | 2 nodes x 1, uninterrupted | 1 GPU, resumed | diff | 1 GPU, uninterrupted | "
             "2 nodes x 1, resumed | diff |", "|---|---|---|---|---|---|---|"]
    ok = all(not r.error for r in results)
    for s in range(at - 1, steps + 1):
        cells = []
        for _, _, ref, got, _ in pairs:
            d = abs(got[s] - ref[s]) if s in got and s in ref else None
            ok &= s <= at or (d is not None and d <= a.tol)
            cells += [launch.fmt(ref.get(s), '.6f'), launch.fmt(got.get(s), '.6f'), launch.fmt(d, '.2e')]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines.append(f"\nresharded (DCP's model and optimizer, the data stream at position {position}): 2 -> 1 "
                 f"{pairs[0][4]}, 1 -> 2 {pairs[1][4]}; the two "
                 f"uninterrupted layouts differ by up to {launch.fmt(spread, '.2e')} over steps 1-{steps}; "
                 f"tolerance {a.tol:g}")
    ok &= pairs[0][4] and pairs[1][4]
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    launch.save(out, "multinode_resume", text, results, {"spread": spread, "ok": ok})
    return 0 if ok else 1


def _option(argv: list[str], key: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(key) + 1]


def _first_gpu() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = launch.Parser(__doc__)
    ap.add_argument("--ngpus", type=int, default=0, help="k: GPUs of this host (default: all visible)")
    ap.add_argument("--modes", default="fsdp,hsdp,ddp")
    ap.add_argument("--layouts", default="one,two", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=10, help="log steps up to this one are warm-up")
    ap.add_argument("--log-freq", type=int, default=5)
    ap.add_argument("--tol", type=float, default=1e-2, help="largest loss difference after step 1")
    ap.add_argument("--step1-tol", type=float, default=1e-3,
                    help="largest difference of step 1's loss (GPU processes pick their own kernels; 0: bit for bit)")
    ap.add_argument("--timeout", type=int, default=420, help="seconds before a run is killed")
    ap.add_argument("--resume", action="store_true", help="the world-size resume check instead")
    ap.add_argument("--debug", action="store_true", help="the debug model, no compile (a CPU check of the script)")
    ap.add_argument("--out", default=".", help="folder for the table and JSON")
    a = ap.parse_args(own)
    a.extra = extra
    a.modes, a.layouts = a.modes.split(","), a.layouts.split(",")
    if bad := [m for m in a.modes if m not in MODES]:
        ap.error(f"--modes: unknown {', '.join(bad)}; choose from {', '.join(MODES)}")
    if bad := [x for x in a.layouts if x not in LAYOUTS]:
        ap.error(f"--layouts: unknown {', '.join(bad)}; choose from {', '.join(LAYOUTS)}")
    if a.steps < 2 or a.steps <= a.skip:
        ap.error(f"--steps ({a.steps}) must be at least 2 and above --skip ({a.skip})")
    if not a.ngpus:
        import torch

        a.ngpus = torch.cuda.device_count()
        if a.ngpus < 2 and not a.debug:
            ap.error(f"two nodes need at least 2 GPUs on this host; {a.ngpus} visible")
        a.ngpus = max(a.ngpus, 2)
    if a.ngpus % 2:
        ap.error(f"--ngpus must be even (two nodes of k/2 GPUs); got {a.ngpus}")
    out = Path(a.out)
    if a.debug:
        return resume(a, DEBUG_SHAPES, out) if a.resume else throughput(a, DEBUG_SHAPES, out)
    return resume(a, launch.PEER_SHAPES, out) if a.resume else throughput(a, [*launch.PEER_SHAPES, "--compile.enable"], out)


if __name__ == "__main__":
    sys.exit(main())
