"""python -m titanlite.diagnose RUN_A.json RUN_B.json [RUN_C.json ...] --out DIR [--link-gbps G]

Exit 0 with a report under DIR; exit 2 with one line on unreadable or incompatible input.
"""

from __future__ import annotations

import argparse
import sys

from titanlite.diagnose import DiagnoseError, diagnose


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other titanlite input error
        print(f"error: {message} (usage: python -m titanlite.diagnose RUN.json [RUN.json ...] --out DIR)",
              file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m titanlite.diagnose",
                description="Diagnose scaling from titanlite run logs of one model at different world sizes.")
    p.add_argument("logs", nargs="+", help="run_<timestamp>.json files (the smallest world size is the baseline)")
    p.add_argument("--out", default="diagnosis", help="folder for report.md, report.json and the PNGs")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="per-GPU link bandwidth in GB/s for the expected all-reduce time "
                        "(default: from the GPU name; 1 for CPU/gloo)")
    args = p.parse_args(argv)
    if args.link_gbps is not None and args.link_gbps <= 0:
        p.error("--link-gbps must be > 0")
    try:
        a = diagnose(args.logs, args.out, args.link_gbps)
    except DiagnoseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write the report to {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"verdict: {a.verdict} | {a.findings[0].title}")
    print(f"report: {args.out}/report.md (+ report.json" + (", phases.png, ranks.png)" if not a.notes else ")"))
    for note in a.notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
