"""Every rank of a job trains on the same configuration: the settings each rank resolved, compared.

Each node loads its own command line and config file, so two nodes started with different options
(a local batch of 4 on one and 8 on the other, another seed or learning rate) would otherwise train
on different settings while rank 0 logs its own. `job_settings` is what must agree; `disagreement`
the one line naming the keys that do not, their values and the ranks and hosts holding each. The
Trainer gathers every rank's settings once its process group starts, before anything else.
"""

from __future__ import annotations

from typing import Any

from titanlite.config.job_config import JobConfig
from titanlite.config.manager import to_dict

# What may differ between ranks: where the values came from (a config file's path, which is another
# on a node whose checkout lies elsewhere; the values read from it are compared), and the dry run's
# section, which training does not read.
MAY_DIFFER = {"job.config_file"}
MAY_DIFFER_SECTIONS = {"estimate"}


def job_settings(cfg: JobConfig) -> dict[str, Any]:
    """The settings every rank of a job must share, by dotted key."""
    return {f"{section}.{key}": value for section, table in to_dict(cfg).items() if section not in MAY_DIFFER_SECTIONS
            for key, value in table.items() if f"{section}.{key}" not in MAY_DIFFER}


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'."""
    spans, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = cur
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(spans)


def disagreement(every: list[tuple[str, dict[str, Any]]]) -> str | None:
    """The line naming what the ranks disagree on, from each rank's (host, job_settings) in rank order;
    None where they all agree."""
    keys = sorted({k for _, s in every for k in s})
    parts = []
    for key in keys:
        holders: dict[str, list[int]] = {}  # the value as written -> its ranks, in first-seen order
        for rank, (_, settings) in enumerate(every):
            holders.setdefault(repr(settings.get(key, "(unset)")), []).append(rank)
        if len(holders) > 1:
            parts.append(f"{key} is " + ", ".join(
                f"{value} on {_ranks(ranks)} ({', '.join(dict.fromkeys(every[r][0] for r in ranks))})"
                for value, ranks in holders.items()))
    if not parts:
        return None
    return ("the job's ranks resolved different configurations: " + "; ".join(parts)
            + "; start every node with the same options and config file")
