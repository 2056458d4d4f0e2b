"""python -m estimation.calibrate RESULTS.json [--write]: the throughput model's rates from measurements.

RESULTS.json is what benchmarks/estimation_gpu.py writes. For each profiled case it holds the GPU
kernel time per term (torch.profiler, per step) and the work the fake run predicted for the same
configuration (FLOPs, bytes). Each rate is that work over that time, as a fraction of the GPU's
peak (titanlite/hardware.py):

    gemm_efficiency          bf16 GEMM FLOPs / (bf16 GEMM kernel time x bf16 peak)
    float8_efficiency        float8 GEMM FLOPs / (float8 GEMM kernel time x twice the bf16 peak)
    attention (per backend)  causal attention FLOPs / (attention kernel time x bf16 peak)
    fused_efficiency         compiled graphs' kernel traffic (elements at <= 2 bytes) / (Triton kernel time x HBM bandwidth)
    elementwise_efficiency   eager element-wise bytes / (other kernel time x HBM bandwidth)
    optimizer_efficiency     optimizer-phase bytes / (optimizer kernel time x HBM bandwidth)
    link_efficiency          ring bytes on the link / (NCCL kernel time x link bandwidth)   (2+ GPUs)

A rate seen in several cases is their mean. It prints the GPU's current and new value of each rate
with the case it came from; --write stores them in estimation/calibration.json with the measurement's
date and device: an H100's (throughput.REFERENCE_GPU) as each entry's value, which every GPU without
a fit of its own takes, another GPU's as its own fit under its key (titanlite/hardware.py's, e.g.
"h200"). --only keeps the named rates (the others stay as they are). Launch time per kernel is host
time, which a kernel profile does not show: it keeps its entry.
"""

from __future__ import annotations

import argparse
import json
import sys

from titanlite.hardware import lookup

from estimation.throughput import CALIBRATION, REFERENCE_GPU, gpu_rate, load_calibration


def _rates_of(case: str, c: dict, hw) -> dict[str, float]:
    prof = (c.get("measured") or {}).get("profile_ms_per_step")
    pred = c.get("predicted") or {}
    work, a = pred.get("work"), pred.get("assumptions")
    if not prof or not work or not a:
        return {}
    ms = prof["terms"]
    peak, hbm = hw.peak_tflops * 1e12, hw.hbm_tbps * 1e12
    out = {}

    def rate(name, amount, term, scale):
        t = ms.get(term, 0.0) / 1000
        if amount > 0 and t > 0:
            out[name] = amount / (t * scale)

    rate("gemm_efficiency", work["gemm_flops"], "gemm", peak)
    rate("float8_efficiency", work["float8_flops"], "gemm_float8", 2 * peak)
    rate("attention:" + a["attention_backend"], work["attention_flops"], "attention", peak)
    rate("fused_efficiency", work["fused_bytes"], "fused", hbm)
    rate("elementwise_efficiency", work["elementwise_bytes"], "elementwise", hbm)
    rate("optimizer_efficiency", work["optimizer_bytes"], "optimizer", hbm)
    if c.get("ranks", 1) > 1:
        rate("link_efficiency", work["comm_bytes"], "comm", a["link_gbps"] * 1e9)
    return out


def calibrate(results: dict) -> dict[str, tuple[float, list[str]]]:
    """rate name -> (value, the cases it came from)."""
    hw = lookup(results["device"])
    if hw is None:
        raise SystemExit(f"error: no row in titanlite/hardware.py for '{results['device']}'")
    seen: dict[str, list[tuple[str, float]]] = {}
    for case, c in results["cases"].items():
        for name, v in _rates_of(case, c, hw).items():
            seen.setdefault(name, []).append((case, v))
    return {k: (sum(v for _, v in vs) / len(vs), [c for c, _ in vs]) for k, vs in seen.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m estimation.calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("results", help="estimation_gpu.json from benchmarks/estimation_gpu.py")
    ap.add_argument("--write", action="store_true", help="store the rates in estimation/calibration.json")
    ap.add_argument("--only", default="", help="comma-separated rates to keep (e.g. fused_efficiency); default all")
    opts = ap.parse_args(argv)
    try:
        with open(opts.results) as fh:
            results = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: cannot read {opts.results}: {e}", file=sys.stderr)
        sys.exit(2)
    cal = load_calibration(CALIBRATION)
    new = calibrate(results)
    only = [n for n in opts.only.split(",") if n]
    unknown = [n for n in only if n not in new]
    if unknown:
        print(f"error: --only {', '.join(unknown)}: not among the rates {opts.results} gives "
              f"({', '.join(sorted(new)) or 'none'})", file=sys.stderr)
        sys.exit(2)
    new = {n: v for n, v in new.items() if not only or n in only}
    if not new:
        print(f"error: {opts.results} holds no profiled case with its prediction", file=sys.stderr)
        sys.exit(2)
    gpu = lookup(results["device"]).key
    where = f"{results['device']}, torch {results['torch']}: {results.get('command', 'benchmarks/estimation_gpu.py')}"
    for name, (value, cases) in sorted(new.items()):
        table, key = (cal["attention"], name.split(":", 1)[1]) if name.startswith("attention:") else (cal["rates"], name)
        fit = {"value": round(value, 4), "source": f"profile of {', '.join(cases)} on {where}", "date": results["date"]}
        entry = table.get(key)
        print(f"{name:<28} {gpu_rate(entry, gpu)[0] if entry else '-':>8} -> {value:.4f}   ({', '.join(cases)})")
        if entry is None:  # a kernel no GPU had a rate for (a new attention backend): every GPU's until others fit it
            table[key] = {**fit, "of": ""}
        elif gpu == REFERENCE_GPU:
            entry.update(fit)
        else:
            entry[gpu] = fit
    if opts.write:
        with open(CALIBRATION, "w") as fh:
            json.dump(cal, fh, indent=2)
            fh.write("\n")
        print(f"wrote {CALIBRATION}")


if __name__ == "__main__":
    main()
