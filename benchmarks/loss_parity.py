"""Loss parity with torchtitan 0.2.2: both train LLaMA 1.36B on the same text for 300 steps, one GPU.

  python benchmarks/loss_parity.py [--steps 300] [--extra="--training.bf16_params"]

The text is torchtitan's c4_test asset (124 documents, carried in .bench), tokenized for titanlite by
`python -m titanlite.data.prepare` with torchtitan's test tokenizer as torchtitan loads it: its
tokenizer.json plus the special tokens its tokenizer_config.json names, which torchtitan adds at
load. Each document is written with <|begin_of_text|> in front and prepared with <|end_of_text|> as
its end, so titanlite's token stream is torchtitan's, id for id, in file order (no shuffle).

Set alike on both sides: the model (LLaMA 1.36B, vocabulary 32000 from the flavor, as torchtitan's,
though the tokenizer emits 2004 ids), local batch 4 x seq 2048 on one GPU, bf16 compute, compile,
AdamW (lr, betas 0.9/0.95, eps 1e-8, weight decay 0.1, fused), gradient clip 1.0, linear warm-up then
linear decay to zero (torchtitan's default schedule), the steps, seed 42. DIFFERENCES lists what
neither side has a setting for; the output repeats it under the table.

torchtitan runs through .bench/torchtitan_anchor/run.sh with its TensorBoard log on (the per-step
losses are read from it). Prints the mean loss over the last 50 steps of each and their ratio;
writes loss_parity.md, loss_parity.json and loss_parity.png (both curves) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402  (benchmarks/launch.py: the one launcher)

ASSETS = launch.ROOT / ".bench" / "torchtitan_anchor" / "assets" / "tests" / "assets"
# torchtitan's HuggingFaceTokenizer adds the tokens these config keys name, then every entry of
# added_tokens_decoder, as special tokens in this order (new ones take the next free ids).
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")
LAST = 50  # the table's window: mean loss over the last this-many steps
SEQ, BATCH = 2048, 4

DIFFERENCES = [
    "init: both draw the same scheme (titanlite's --model.init per_layer), but from their own random "
    "streams, and torchtitan truncates at +-2 absolute where titanlite truncates at 3 std",
    "RoPE: torchtitan's llama3 applies Llama 3.1 frequency scaling (factor 8, original length 8192) to theta "
    "10000; titanlite rotates with plain theta 10000",
    "weight decay: torchtitan decays every parameter, titanlite matrices only (not norm weights)",
    "schedule: torchtitan warms up to the peak at step W and decays to 1/(T - W) of it at step T; titanlite "
    "warms up to it at step W + 1 and decays to zero at step T",
    "data order: torchtitan's sequences take 2049 fresh tokens each, titanlite's overlap by one (the last "
    "label is the next input), so titanlite trails by one token per sequence; each repeats the text after "
    "its first pass, torchtitan carrying the leftover tokens over, titanlite dropping them",
    "precision: torchtitan runs bf16 through FSDP's mixed-precision policy (one GPU too), titanlite through "
    "autocast (or its bf16-parameter path where that is the default); torchtitan's loss is cross-entropy on "
    "full logits, titanlite's the chunked linear + cross-entropy",
]


# ------------------------------------------------------------------------------------------- the text
def peer_tokenizer(src: Path, dest: Path) -> tuple[str, str]:
    """Write to `dest` the tokenizer.json of folder `src` with the special tokens torchtitan adds from
    src/tokenizer_config.json; return the (BOS, EOS) token strings."""
    from tokenizers import AddedToken, Tokenizer

    cfg = json.loads((src / "tokenizer_config.json").read_text())
    content = lambda v: v if isinstance(v, str) else v["content"]
    names = [content(cfg[k]) for k in SPECIAL_KEYS if cfg.get(k) is not None]
    names += [v["content"] for v in cfg.get("added_tokens_decoder", {}).values()]
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(n, special=True) for n in dict.fromkeys(names)])
    dest.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(dest))
    return content(cfg["bos_token"]), content(cfg["eos_token"])


def write_documents(src: Path, dest: Path, bos: str) -> int:
    """c4_test's documents (one JSON object a line, field "text") as jsonl with `bos` in front; returns the count."""
    n = 0
    with open(src) as fin, open(dest, "w") as fout:
        for line in fin:
            if line.strip():
                fout.write(json.dumps({"text": bos + json.loads(line)["text"]}) + "\n")
                n += 1
    return n


def prepare(work: Path, assets: Path = ASSETS, val_every: int = 0) -> tuple[Path, dict]:
    """The prepared folder of c4_test for titanlite, and its metadata; every `val_every`-th document
    goes to the validation split (0: none, all text trains)."""
    tok = work / "tokenizer.json"
    bos, eos = peer_tokenizer(assets / "tokenizer", tok)
    docs = write_documents(assets / "c4_test" / "data.json", work / "c4_test.jsonl", bos)
    folder = work / "prepared"
    cmd = [sys.executable, "-m", "titanlite.data.prepare", "--input", str(work / "c4_test.jsonl"), "--output",
           str(folder), "--tokenizer", str(tok), "--eos-token", eos, "--val-every", str(val_every), "--workers", "2", "--overwrite"]
    rc, text, _ = launch.execute("prepare_c4_test", cmd, 300, work)
    if rc != 0:
        sys.exit(f"loss_parity: prepare failed: {launch.error_line(text, rc, 300)}")
    meta = json.loads((folder / "meta.json").read_text())
    print(f"prepared {docs} documents, {meta['splits']['train']['tokens']:,} train / {meta['splits']['val']['tokens']:,} "
          f"validation tokens, vocabulary {meta['vocab_size']}", flush=True)
    return folder, meta


# ------------------------------------------------------------------------------------------- the runs
def titanlite_options(prepared: Path, steps: int, warmup: int, lr: float) -> list[str]:
    return ["--model.name", "llama", "--model.flavor", "1.36B", "--model.vocab_size", "32000", "--model.init", "per_layer",
            "--training.dataset", "prepared", "--training.dataset_path", str(prepared), "--data.shuffle=false",
            "--training.local_batch_size", str(BATCH), "--training.seq_len", str(SEQ), "--training.max_norm", "1.0",
            "--training.seed", "42", "--optimizer.lr", str(lr), "--optimizer.beta1", "0.9", "--optimizer.beta2", "0.95",
            "--optimizer.eps", "1e-8", "--optimizer.weight_decay", "0.1", "--lr_scheduler.warmup_steps", str(warmup),
            "--lr_scheduler.decay_type", "linear", "--lr_scheduler.min_lr_factor", "0", "--compile.enable",
            "--validation.enable=false", "--checkpoint.enable=false", "--metrics.progress_bar=false"]


def peer_options(steps: int, warmup: int, lr: float, dump: Path) -> list[str]:
    """torchtitan 0.2.2 options on top of its run.sh's TOML (LLaMA 1.36B, batch 4, seq 2048, c4_test, compile)."""
    return ["--training.steps", str(steps), "--lr_scheduler.warmup_steps", str(warmup), "--optimizer.lr", str(lr),
            "--debug.seed", "42", "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
            "--job.dump_folder", str(dump)]


def tensorboard_losses(folder: Path, tag: str = "loss_metrics/global_avg_loss") -> dict[int, float]:
    """step -> loss from the TensorBoard event files under `folder` (torchtitan's metrics log)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for events in sorted(folder.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            out.update({e.step: e.value for e in acc.Scalars(tag)})
    return dict(sorted(out.items()))


# ------------------------------------------------------------------------------------------- the report
def mean_last(losses: dict[int, float], n: int = LAST) -> float | None:
    steps = sorted(losses)[-n:]
    return sum(losses[s] for s in steps) / len(steps) if steps else None


def report(curves: dict[str, dict[int, float]], errors: dict[str, str | None], steps: int, epoch: dict[str, int]) -> str:
    """The markdown table: per run the mean loss over the last LAST steps, final and lowest loss; the
    ratio titanlite / torchtitan; the means of every LAST-step window; then DIFFERENCES."""
    lines = [f"LLaMA 1.36B, c4_test, local batch {BATCH} x seq {SEQ}, 1 GPU, {steps} steps; the text repeats after "
             + ", ".join(f"{k} step {v}" for k, v in epoch.items()), "",
             f"| run | steps logged | mean loss, last {LAST} steps | final loss | lowest loss | note |",
             "|---|---|---|---|---|---|"]
    for name, c in curves.items():
        if not c:
            lines.append(f"| {name} | 0 | - | - | - | {errors.get(name) or 'no losses'} |")
            continue
        lines.append(f"| {name} | {len(c)} | {mean_last(c):.4f} | {c[max(c)]:.4f} | {min(c.values()):.4f} | "
                     f"{errors.get(name) or ''} |")
    tl, tt = (mean_last(curves.get(k, {})) for k in ("titanlite", "torchtitan 0.2.2"))
    if tl and tt:
        lines.append(f"| titanlite / torchtitan | | {tl / tt:.4f} ({100 * (tl / tt - 1):+.2f}%) | | | |")
    windows = [(a, min(a + LAST - 1, steps)) for a in range(1, steps + 1, LAST)]
    lines += ["", "| steps | " + " | ".join(curves) + " |", "|---|" + "---|" * len(curves)]
    for a, b in windows:
        cells = []
        for c in curves.values():
            vals = [c[s] for s in range(a, b + 1) if s in c]
            cells.append(f"{sum(vals) / len(vals):.4f}" if vals else "-")
        lines.append(f"| {a}-{b} | " + " | ".join(cells) + " |")
    lines += ["", "What differs (neither side has a setting for it):"] + [f"- {d}" for d in DIFFERENCES]
    return "\n".join(lines)


def plot(curves: dict[str, dict[int, float]], path: Path, epoch: dict[str, int], smooth: int = 10) -> None:
    """Both loss curves, per step (thin) and as a `smooth`-step moving mean (thick), to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (name, c), color in zip(curves.items(), ("tab:blue", "tab:orange")):
        if not c:
            continue
        xs, ys = list(c), list(c.values())
        ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
        mov = [sum(ys[max(0, i - smooth + 1):i + 1]) / (i + 1 - max(0, i - smooth + 1)) for i in range(len(ys))]
        ax.plot(xs, mov, color=color, linewidth=2, label=f"{name} (mean of {smooth} steps)")
    last = max((max(c) for c in curves.values() if c), default=0)
    for step in sorted({s for s in epoch.values() if s < last}):
        ax.axvline(step, color="gray", linestyle=":", linewidth=1)
        ax.annotate("text repeats", (step, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=8, color="gray")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"LLaMA 1.36B on c4_test, batch {BATCH} x {SEQ}: titanlite and torchtitan 0.2.2")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = launch.Parser(__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10, help="warm-up steps (torchtitan's TOML for these shapes)")
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (the same TOML's)")
    ap.add_argument("--extra", default="", help="titanlite options added to its run, e.g. --extra=\"--training.bf16_params\"")
    ap.add_argument("--skip-peer", action="store_true", help="titanlite only (torchtitan's curve is absent)")
    ap.add_argument("--timeout", type=int, default=280, help="seconds per training run (both fit one 10-minute call)")
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/loss_parity"))
    a = ap.parse_args(argv)
    if a.steps <= LAST:
        ap.error(f"--steps must exceed {LAST} (the table averages the last {LAST})")
    if not 0 <= a.warmup < a.steps:
        ap.error("--warmup must be between 0 and --steps")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if not (ASSETS / "c4_test" / "data.json").exists():
        sys.exit("loss_parity: torchtitan's c4_test asset is not here: carry .bench (cp -r ../shared/bench .bench)")
    work = launch.WORK / "loss_parity"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    prepared, meta = prepare(work)
    tokens = meta["splits"]["train"]["tokens"]
    epoch = {"titanlite": (tokens - 1) // SEQ // BATCH, "torchtitan": tokens // (SEQ + 1) // BATCH}
    results, curves, errors = [], {}, {}
    if not a.skip_peer:
        dump = work / "torchtitan"
        r = launch.peer("0.2.2", 1, peer_options(a.steps, a.warmup, a.lr, dump), a.timeout, name="loss_parity_torchtitan")
        results.append(r)
        curves["torchtitan 0.2.2"] = tensorboard_losses(dump) if dump.exists() else {}
        errors["torchtitan 0.2.2"] = r.error
    r = launch.titanlite("loss_parity_titanlite", shlex.split(a.extra), 1, a.steps, 10, a.timeout,
                         base=titanlite_options(prepared, a.steps, a.warmup, a.lr))
    results.append(r)
    curves["titanlite"], errors["titanlite"] = launch.step_losses(r.entries), r.error
    text = report(curves, errors, a.steps, epoch)
    print("\n" + text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(curves, out / "loss_parity.png", epoch)
    launch.save(out, "loss_parity", text, results, {"losses": {k: list(c.items()) for k, c in curves.items()},
                                                    "argv": sys.argv[1:] if argv is None else argv})
    print(f"curves: {out / 'loss_parity.png'}")


if __name__ == "__main__":
    main()
