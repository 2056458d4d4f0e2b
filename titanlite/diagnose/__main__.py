"""python -m titanlite.diagnose LOG [LOG ...] --out DIR [--gpus N[,N...]] [--local-batch B] [--seq-len T]
[--accum A] [--hardware GPU] [--model NAME/FLAVOR] [--link-gbps G]

Logs: titanlite run logs, the earlier trainer's JSON run logs or saved console output, torchtitan's
console output (the format is detected). Exit 0 with a report under DIR; exit 2 with one line on
unreadable or incompatible input.
"""

from __future__ import annotations

import argparse
import sys

from titanlite.diagnose import DiagnoseError, Settings, diagnose
from titanlite.errors import to_pipe
from titanlite.hardware import by_key, keys
from titanlite.models import MODEL_REGISTRY

USAGE = "python -m titanlite.diagnose LOG [LOG ...] --out DIR"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other titanlite input error
        print(f"error: {message} (usage: {USAGE})", file=sys.stderr)
        sys.exit(2)


# flag -> (Settings field, type of one value)
PER_LOG = {"gpus": int, "local_batch": int, "seq_len": int, "accum": int, "hardware": str, "model": str}


def per_log(p: _Parser, args, n: int) -> list[Settings]:
    """Each flag takes one value for every log or a comma-separated value per log (argument order)."""
    out = [Settings() for _ in range(n)]
    for name, kind in PER_LOG.items():
        raw = getattr(args, name)
        if raw is None:
            continue
        flag = "--" + name.replace("_", "-")
        vals = [v.strip() for v in raw.split(",")]
        if len(vals) not in (1, n):
            p.error(f"{flag} takes one value or one per log ({n}), got {len(vals)}")
        for i, v in enumerate(vals * n if len(vals) == 1 else vals):
            if kind is int:
                if not v.isdigit() or int(v) < 1:
                    p.error(f"{flag} must be a positive integer, got {v!r}")
                v = int(v)
            elif name == "hardware" and by_key(v) is None:
                p.error(f"--hardware {v!r} is not in titanlite's GPU table ({', '.join(keys())}, or a device name)")
            elif name == "model" and (v.partition("/")[0] not in MODEL_REGISTRY
                                      or v.partition("/")[2] not in MODEL_REGISTRY[v.partition("/")[0]].flavors):
                known = ", ".join(f"{m}/{f}" for m, spec in MODEL_REGISTRY.items() for f in spec.flavors)
                p.error(f"--model {v!r} is not a registered model ({known})")
            setattr(out[i], name, v)
    return out


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m titanlite.diagnose",
                description="Diagnose scaling from the logs of one model at different world sizes; one log gives "
                            "a single-run report.")
    p.add_argument("logs", nargs="+", help="log files in any supported format (the smallest world size is the baseline)")
    p.add_argument("--out", default="diagnosis", help="folder for report.md, report.json and the PNGs")
    p.add_argument("--gpus", help="world size, for logs that do not say it or say it wrong (one, or one per log)")
    p.add_argument("--local-batch", dest="local_batch", help="sequences per GPU per micro-step (one, or one per log)")
    p.add_argument("--seq-len", dest="seq_len", help="sequence length (one, or one per log)")
    p.add_argument("--accum", help="micro-steps per GPU per optimizer step (one, or one per log)")
    p.add_argument("--hardware", help="GPU: a titanlite.hardware key such as h100, or a device name (one, or one per log)")
    p.add_argument("--model", help="NAME/FLAVOR of titanlite's model registry, for FLOPs per token (one, or one per log)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="per-GPU link bandwidth in GB/s for the expected all-reduce time "
                        "(default: from the GPU name; 1 for CPU/gloo)")
    args = p.parse_args(argv)
    if args.link_gbps is not None and args.link_gbps <= 0:
        p.error("--link-gbps must be > 0")
    settings = per_log(p, args, len(args.logs))
    try:
        a = diagnose(args.logs, args.out, args.link_gbps, settings=settings)
    except DiagnoseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write the report to {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"verdict: {a.headline().removeprefix('Verdict: ')} | {a.findings[0].title}")
    if a.settle:
        print(f"to settle it: {a.settle}")
    print(f"confidence: {a.confidence}" + "".join(f"\n  - {r}" for r in a.confidence_reasons))
    print(f"report: {args.out}/report.md (+ report.json" + (", phases.png, ranks.png)" if not a.notes else ")"))
    for note in a.notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(to_pipe(main))
