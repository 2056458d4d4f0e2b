"""bf16 and float8 under fsdp, titanlite against torchtitan 0.2.2 and 0.3.0, batch by batch, in one call.

    python benchmarks/float8_fsdp.py --ngpus 4 --batches 4,16 --unfused       # LLaMA 1.36B, seq 2048
    python benchmarks/float8_fsdp.py --ngpus 4 --model 8B --batches 2 --peers 0.2.2,0.3.0 \\
        --extra="--model.attention_backend sdpa_cudnn" --extra-at bf16 --steps 12 --skip 6 \\
        --predictions benchmarks/results/float8_fsdp_predictions_8b_4xh200.json     # LLaMA-3.1-8B, seq 8192
    python benchmarks/float8_fsdp.py --predict --ngpus 4 --model 8B --batches 2 \\
        --extra="--model.attention_backend sdpa_cudnn" --extra-at bf16 \\
        --out benchmarks/results/float8_fsdp_predictions_8b_4xh200.json             # CPU, before the call

Every run is fsdp over all `--ngpus` GPUs with compile, one after another through benchmarks/launch.py.
For each local batch, in this order: titanlite in each of `--precisions` (bf16; float8: tensorwise,
weights all-gathered in float8); each torchtitan version of `--peers` in the same precisions (0.2.2's
float8: `quantize.linear.float8` with its fsdp float8 all-gather and scale precompute, output layer in
bf16 as titanlite's; 0.3.0's float8 has rowwise scaling only, so its float8 row says so and runs
nothing, and `--tt3-rowwise` adds 0.3.0's rowwise float8 as a row of its own); each `--extra` variant
of titanlite (at the precisions of `--extra-at`); with `--unfused`, titanlite with `--optimizer.fused
false` at the first batch (the optimizer's eager path). 0.3.0 runs from benchmarks/tt3_configs.py's
config functions (its own llama3 8B, or launch3's 1.36B), which this script puts on run.sh's path, on
c4_test joined into long documents (`--tt3-data`: 0.3.0 masks attention per document, so on c4_test's
own documents its attention would do less work than the others' causal attention over the sequence).
`--ac` is every row's activation checkpointing; `selective` is per-op for all three (0.2.2's takes
`selective_ac_option op`: its default checkpoints every second block whole). Ratios: every titanlite
row against each torchtitan version in the same precision at the same batch, and each float8 row
against titanlite's best bf16 row of the call. `--predictions FILE` (made by
`--predict` on the CPU: `python -m estimation` with each titanlite row's options, `--estimate.ngpu
NGPUS --estimate.hardware HW`) puts the estimate beside each titanlite row with its error (predicted /
measured - 1). `--budget S`: a row that would not finish within S seconds of the start is a row saying
so; the table and JSON are written after every row. Writes float8_fsdp.md and float8_fsdp.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402  (benchmarks/launch.py: the one launcher)

MODELS = {  # titanlite's options, torchtitan 0.2.2's, and the sequence length
    "1.36B": (["--model.name", "llama", "--model.flavor", "1.36B"], [], 2048),
    "8B": (["--model.name", "llama", "--model.flavor", "8B"], ["--model.flavor", "8B"], 8192),
}
PRECISIONS = ("bf16", "float8")
PEER_FLOAT8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.filter_fqns", "output",
               "--quantize.linear.float8.enable_fsdp_float8_all_gather",
               "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]
# 0.2.2's selective defaults to checkpointing every second block whole; its per-op policy (matmul and attention
# outputs saved, every second matmul recomputed) is the one like titanlite's, and 0.3.0's only selective mode
PEER_AC = {"none": [], "selective": ["--activation_checkpoint.mode", "selective",
                                     "--activation_checkpoint.selective_ac_option", "op"],
           "full": ["--activation_checkpoint.mode", "full"]}
# torchtitan 0.3.0: benchmarks/tt3_configs.py's config functions, on the path run.sh gives 0.3.0 (its PYTHONPATH's
# first folder), chosen by a --module/--config pair after run.sh's own (0.3.0's ConfigManager keeps the last)
TT3_CONFIGS = Path(__file__).resolve().parent / "tt3_configs.py"
TT3_SITE = Path("/tmp/site3")
TT3_CONFIG = {"bf16": "bf16", "float8 rowwise": "float8_rowwise"}
TT3_NO_TENSORWISE = ("not run: 0.3.0's float8 is rowwise only (Float8LinearConverter recipes rowwise, "
                     "rowwise_with_gw_hp): no tensorwise, float8 all-gather or scale precompute (--tt3-rowwise)")
# 0.3.0 masks attention per document (every attention backend its language models take), so on c4_test's
# documents (about 15k tokens of the anchor's tokenizer on average) its attention does less work than the causal
# attention over a whole sequence that titanlite and 0.2.2 run. --tt3-data long (the default) gives it c4_test
# joined into documents of LONG_DOC_CHARS characters (about 80k tokens), whose sequences are one document each.
C4_TEST = launch.ROOT / ".bench" / "torchtitan_anchor" / "assets" / "tests" / "assets" / "c4_test" / "data.json"
TT3_LONG_DOCS = launch.WORK / "tt3_long_docs"
LONG_DOC_CHARS = 100_000
FIRST_ROW_S = {"0.3.0": 120}  # s a row is taken to need against --budget until one of its library finished
FIRST_ROW_DEFAULT_S = 75


@dataclass
class Row:
    """One table row: a titanlite configuration or a torchtitan version, at one precision and local batch."""
    lib: str  # "titanlite" or a torchtitan version
    precision: str  # bf16, float8, or (0.3.0) float8 rowwise
    batch: int
    args: list[str]  # titanlite's options on top of base_options, or torchtitan's overrides
    variant: str = ""  # " unfused", " +model.attention_backend sdpa", ...
    env: dict = field(default_factory=dict)
    why: str | None = None  # set: the row does not run, this says why
    result: launch.Result | None = None

    @property
    def label(self) -> str:
        return ("titanlite" if self.lib == "titanlite" else f"torchtitan {self.lib}") + f" {self.precision}{self.variant}"


def base_options(model: str, ac: str) -> list[str]:
    """titanlite's options of every row (synthetic tokens, fsdp, compile) before the row's own."""
    ours, _, seq = MODELS[model]
    return ["--training.dataset", "synthetic", "--training.seq_len", str(seq), "--lr_scheduler.warmup_steps", "10",
            "--validation.enable=false", "--checkpoint.enable=false", "--metrics.progress_bar=false",
            "--compile.enable", "--parallelism.data_parallel", "fsdp", "--activation_checkpoint.mode", ac, *ours]


def options(a: argparse.Namespace, row: Row) -> list[str]:
    """A titanlite row's whole options: what it trains with and what its estimate is made for."""
    return [*base_options(a.model, a.ac), *row.args]


def plan(a: argparse.Namespace) -> list[Row]:
    """Every row, in the order they run (with --budget, the later ones are the ones cut)."""
    _, theirs, seq = MODELS[a.model]
    rows = []
    for b in a.batch_list:
        batch = ["--training.local_batch_size", str(b)]
        f8 = {"bf16": [], "float8": ["--float8.enable"]}
        rows += [Row("titanlite", p, b, [*batch, *f8[p]]) for p in a.precision_list]
        for v in a.versions:
            for p in a.peer_precisions:
                if v == "0.2.2":
                    rows.append(Row(v, p, b, [*theirs, "--training.seq_len", str(seq), "--training.steps", str(a.steps),
                                              *PEER_AC[a.ac], *batch, *(PEER_FLOAT8 if p == "float8" else [])]))
                elif p == "float8":
                    rows.append(Row(v, p, b, [], why=TT3_NO_TENSORWISE))
                else:
                    rows.append(tt3_row(a, p, b))
            if v == "0.3.0" and a.tt3_rowwise:
                rows.append(tt3_row(a, "float8 rowwise", b))
        for extra in a.extra:
            rows += [Row("titanlite", p, b, [*batch, *f8[p], *shlex.split(extra)], f" +{extra.replace('--', '')}")
                     for p in a.precision_list if p in a.extra_at]
        if a.unfused and b == a.batch_list[0]:
            rows += [Row("titanlite", p, b, [*batch, *f8[p], "--optimizer.fused", "false"], " unfused")
                     for p in a.precision_list]
    return rows


def tt3_row(a: argparse.Namespace, precision: str, b: int) -> Row:
    _, _, seq = MODELS[a.model]
    data = ["--dataloader.dataset_path", str(TT3_LONG_DOCS)] if a.tt3_data == "long" else []
    return Row("0.3.0", precision, b, ["--module", "tt3_configs", "--config", TT3_CONFIG[precision],
                                       "--training.local_batch_size", str(b), "--training.seq_len", str(seq),
                                       "--training.steps", str(a.steps), *data],
               env={"TT3_BENCH_FLAVOR": a.model, "TT3_BENCH_AC": a.ac})


def long_docs(source: Path, folder: Path, chars: int | None = None) -> Path:
    """c4_test's documents (JSON lines of "text") joined, in order, into documents of at least `chars`
    (LONG_DOC_CHARS) characters, the last taking what is left over, written as `folder`/data.json, a folder
    `--dataloader.dataset_path` takes as c4_test's."""
    chars, docs, cur, n = chars or LONG_DOC_CHARS, [], [], 0
    for line in source.read_text().splitlines():
        if line.strip():
            cur.append(json.loads(line)["text"])
            n += len(cur[-1])
        if n >= chars:
            docs.append(cur)
            cur, n = [], 0
    if cur:
        docs[-1:] = [docs[-1] + cur] if docs else [cur]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data.json").write_text("".join(json.dumps({"text": "\n".join(d)}) + "\n" for d in docs))
    return folder


def run_name(a: argparse.Namespace, row: Row) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"titanlite_{a.model}_{row.precision}{row.variant}_b{row.batch}")[:120]


def run(a: argparse.Namespace, row: Row) -> launch.Result:
    if row.lib == "titanlite":
        return launch.titanlite(run_name(a, row), row.args, a.ngpus, a.steps, 5, row_timeout(a, row),
                                base=base_options(a.model, a.ac))
    if row.lib == "0.3.0":
        TT3_SITE.mkdir(parents=True, exist_ok=True)
        shutil.copy(TT3_CONFIGS, TT3_SITE / TT3_CONFIGS.name)
        if "--dataloader.dataset_path" in row.args and C4_TEST.exists():
            long_docs(C4_TEST, TT3_LONG_DOCS)
    return launch.peer(row.lib, a.ngpus, row.args, timeout=row_timeout(a, row), env=row.env)


def row_timeout(a: argparse.Namespace, row: Row) -> int:
    limit = a.timeout if row.lib == "titanlite" else a.timeout + 180  # run.sh installs its wheels first
    return int(min(limit, a.left)) if a.budget else limit


# -------------------------------------------------------------------------------------------- the table
def key(row: Row) -> str:
    """What a prediction is for: the titanlite row at its batch (the options are checked too)."""
    return f"{row.label} | b{row.batch}"


def pct(predicted, measured) -> float | None:
    return 100 * (predicted / measured - 1) if predicted is not None and measured else None


def reference(rows: list[Row], row: Row, version: str) -> Row | None:
    """The torchtitan `version` row a titanlite row is compared with: the same precision at the same batch."""
    return next((r for r in rows if r.lib == version and r.precision == row.precision and r.batch == row.batch), None)


def tps(row: Row | None, skip: int) -> float | None:
    if row is None or row.result is None or row.result.error:
        return None
    return row.result.figures(skip).get("tps_gpu")


ORDER = {p: i for i, p in enumerate([*PRECISIONS, "float8 rowwise"])}


def table(rows: list[Row], versions: list[str], skip: int, predictions: dict | None = None,
          opts: dict[int, list[str]] | None = None) -> str:
    """Markdown: rows by batch, precision, library. `predictions`: the --predict file's content; `opts`:
    id(row) -> the titanlite row's options, which its prediction must have been made for."""
    preds = (predictions or {}).get("predictions", {})
    best = max((tps(r, skip) or 0 for r in rows if r.lib == "titanlite" and r.precision == "bf16" and not r.variant),
               default=0)
    head = ["run", "local batch", "tok/s/GPU", "predicted tok/s (err %)", "MFU %", "alloc GiB", "predicted GiB (err %)",
            "rsrvd GiB", "optimizer ms", "spread %", *[f"vs {v}" for v in versions], "vs best titanlite bf16", "s",
            "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    libs = ["titanlite", *versions]
    for row in sorted(rows, key=lambda r: (r.batch, ORDER.get(r.precision, 9), libs.index(r.lib) if r.lib in libs
                                           else 9, r.variant)):
        r = row.result
        f = r.figures(skip) if r is not None and not r.error else {}
        t = f.get("tps_gpu")
        pred, note = {}, row.why or (r.error if r is not None else "not run") or ""
        if row.lib == "titanlite" and predictions is not None:
            pred = preds.get(key(row)) or {}
            if not pred:
                note = note or "no prediction for this row"
            elif opts is not None and pred.get("options") != opts.get(id(row)):
                pred, note = {}, note or "predicted for other options"
        ratios = [launch.fmt(t / p if t and (p := tps(reference(rows, row, v), skip)) else None, ".3f")
                  if row.lib == "titanlite" else "-" for v in versions]
        vs_best = t / best if t and best and row.precision != "bf16" and row.lib == "titanlite" else None
        cells = [row.label, str(row.batch), launch.fmt(t, ",.0f"), versus(pred.get("tokens_per_sec_per_gpu"), t, ",.0f"),
                 launch.fmt(f.get("mfu"), ".1f"), launch.fmt(f.get("mem"), ".2f"),
                 versus(pred.get("peak_gib"), f.get("mem"), ".2f"), launch.fmt(f.get("reserved"), ".2f"),
                 launch.fmt(f.get("opt_ms"), ".1f"), launch.fmt(f.get("spread"), ".1f"), *ratios,
                 launch.fmt(vs_best, ".3f"), launch.fmt(r.wall_s if r is not None else None, ".0f"), note[:140]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def versus(predicted, measured, spec: str) -> str:
    return "-" if predicted is None else f"{predicted:{spec}} ({launch.fmt(pct(predicted, measured), '+.1f')})"


def header(a: argparse.Namespace, rows: list[Row]) -> str:
    first = next((r.result for r in rows if r.result is not None and r.result.startup), None)
    where = (f"{a.ngpus} x {first.startup['hardware'].get('name')}, torch {first.startup['software'].get('torch')}, "
             if first else f"{a.ngpus} GPUs, ")
    _, _, seq = MODELS[a.model]
    pred = f"; predicted: {a.predictions} ({a.pred.get('hardware')})" if a.predictions else ""
    data = (f"c4_test joined into documents of {LONG_DOC_CHARS:,} characters, so each sequence is causal over its "
            f"whole length as titanlite's and 0.2.2's" if a.tt3_data == "long" else "c4_test's own documents")
    tt3 = (f" torchtitan 0.3.0: its own llama3 model (fused QKV), FlexAttention with per-document masks (TT3_ATTN "
           f"chooses flex_flash or varlen) on {data}." if "0.3.0" in a.versions else "")
    return (f"{where}LLaMA {a.model}, seq {seq}, fsdp, compile, AC {a.ac}, {a.steps} steps, steady after {a.skip}{pred}\n"
            f"alloc: titanlite's allocated peak (what the estimate predicts); rsrvd: the caching allocator's reserved "
            f"peak, all torchtitan prints; err: predicted / measured - 1.{tt3}")


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = launch.Parser(__doc__)
    p.add_argument("--ngpus", type=int, default=4)
    p.add_argument("--model", choices=list(MODELS), default="1.36B")
    p.add_argument("--batches", default="4,16", help="comma-separated local batch sizes")
    p.add_argument("--ac", choices=list(PEER_AC), default="none")
    p.add_argument("--precisions", default="bf16,float8", help="comma-separated: bf16, float8 (titanlite and peers)")
    p.add_argument("--float8-only", action="store_true", help="the same as --precisions float8")
    p.add_argument("--peer-precisions", default="", help="comma-separated: the peers' precisions, where they differ "
                                                         "from --precisions (float8 alone: their float8 against "
                                                         "titanlite's both)")
    p.add_argument("--peers", default="0.2.2", help=f"comma-separated torchtitan versions ({', '.join(launch.PEERS)}); "
                                                     "'' for none")
    p.add_argument("--tt3-rowwise", action="store_true", help="also torchtitan 0.3.0's own float8 (rowwise)")
    p.add_argument("--tt3-data", choices=("long", "c4_test"), default="long",
                   help="0.3.0's text: c4_test joined into long documents (causal attention over whole sequences, "
                        "as the others), or c4_test's own documents (0.3.0's per-document masks cut attention's work)")
    p.add_argument("--extra", action="append", default=[], metavar="OPTIONS",
                   help="titanlite options of a variant row; write --extra=\"--a.b v\"; repeat for more variants")
    p.add_argument("--extra-at", default="bf16,float8", help="the precisions the --extra variants run at")
    p.add_argument("--unfused", action="store_true", help="also titanlite with --optimizer.fused false (first batch)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=15)
    p.add_argument("--timeout", type=int, default=480, help="seconds per titanlite run (torchtitan's: 180 more)")
    p.add_argument("--budget", type=int, default=0, help="seconds for the whole call; 0: no limit")
    p.add_argument("--predict", action="store_true", help="CPU: write each titanlite row's estimate to --out (a .json)")
    p.add_argument("--hardware", default="h200", help="--predict: the GPU key of titanlite/hardware.py")
    p.add_argument("--predictions", type=Path, help="the --predict file whose estimates the table sets beside the rows")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "outputs/float8_fsdp")))
    a = p.parse_args(argv)
    try:
        a.batch_list = [int(b) for b in a.batches.split(",")]
    except ValueError:
        p.error(f"--batches takes comma-separated integers; got {a.batches!r}")
    a.precision_list = ["float8"] if a.float8_only else [x for x in a.precisions.split(",") if x]
    a.extra_at = [x for x in a.extra_at.split(",") if x]
    a.versions = [v for v in a.peers.split(",") if v]
    a.peer_precisions = [x for x in a.peer_precisions.split(",") if x] or a.precision_list
    bad = [x for x in a.precision_list + a.peer_precisions + a.extra_at if x not in PRECISIONS] + [v for v in a.versions if v not in launch.PEERS]
    if bad:
        p.error(f"unknown precision or torchtitan version: {', '.join(bad)} (precisions: {', '.join(PRECISIONS)}; "
                f"versions: {', '.join(launch.PEERS)})")
    if not a.precision_list or min(a.batch_list) < 1 or a.ngpus < 1 or a.steps <= a.skip or a.skip < 0:
        p.error("give a precision, positive batches and GPUs, and --steps above --skip")
    if a.tt3_rowwise and "0.3.0" not in a.versions:
        p.error("--tt3-rowwise is torchtitan 0.3.0's row: add 0.3.0 to --peers")
    if a.predict and a.predictions:
        p.error("--predict writes predictions; --predictions reads them: one at a time")
    a.pred = {}
    if a.predictions:
        try:
            a.pred = json.loads(a.predictions.read_text())
        except (OSError, ValueError) as e:
            p.error(f"--predictions takes a file --predict wrote: {type(e).__name__}: {e}")
    return a


def predict(a: argparse.Namespace) -> int:
    """Each titanlite row's estimate (node_study's helper: `python -m estimation`), into --out."""
    import node_study

    path = a.out if a.out.suffix == ".json" else a.out / "float8_fsdp_predictions.json"
    rows = [r for r in plan(a) if r.lib == "titanlite"]
    done, failed = {}, 0
    for i, row in enumerate(rows):
        p = done[key(row)] = node_study.predict(options(a, row), a.ngpus, a.hardware, a.timeout)
        failed += "error" in p
        print(f"[{i + 1}/{len(rows)}] {key(row)}: " + (p.get("error") or f"{launch.fmt(p['tokens_per_sec_per_gpu'], ',.0f')} "
              f"tok/s/GPU, peak {p['peak_gib']:.2f} GiB"), flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"ngpus": a.ngpus, "hardware": a.hardware, "model": a.model, "predictions": done},
                                   indent=1) + "\n")
    print(f"predictions: {path}")
    return 1 if failed else 0


def write(a: argparse.Namespace, rows: list[Row], opts: dict, argv: list[str]) -> str:
    """The table and the JSON of the runs so far, in --out; the table's text."""
    text = header(a, rows) + "\n\n" + table(rows, a.versions, a.skip, a.pred if a.predictions else None, opts)
    launch.save(a.out, "float8_fsdp", text, [r.result for r in rows if r.result is not None],
                {"argv": argv, "rows": [{"label": r.label, "batch": r.batch, "why": r.why,
                                         "run": r.result.name if r.result else None} for r in rows]})
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.predict:
        return predict(a)
    rows, t0, took = plan(a), time.time(), {}
    if a.pred and a.pred.get("ngpus") != a.ngpus:
        print(f"float8_fsdp: {a.predictions} was made for {a.pred.get('ngpus')} GPUs, not {a.ngpus}", file=sys.stderr)
    opts = {id(r): options(a, r) for r in rows if r.lib == "titanlite"}
    for row in rows:
        if row.why:
            continue
        a.left = a.budget - (time.time() - t0)
        need = took.get(row.lib, FIRST_ROW_S.get(row.lib, FIRST_ROW_DEFAULT_S))
        if a.budget and a.left < need:
            row.why = f"not run: {max(a.left, 0):.0f} s of --budget left, a row takes about {need:.0f}"
            continue
        row.result = run(a, row)
        took[row.lib] = max(took.get(row.lib, 0), row.result.wall_s)
        if row.lib == "titanlite" and a.pred:
            p, t = a.pred.get("predictions", {}).get(key(row)) or {}, tps(row, a.skip)
            print(f"  {key(row)}: {launch.fmt(t, ',.0f')} tok/s/GPU, predicted {launch.fmt(p.get('tokens_per_sec_per_gpu'), ',.0f')}"
                  f" ({launch.fmt(pct(p.get('tokens_per_sec_per_gpu'), t), '+.1f')}%)", flush=True)
        write(a, rows, opts, argv)
    print("\n" + write(a, rows, opts, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
