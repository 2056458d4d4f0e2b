"""The statistics of diagnose's figures: one median and one jitter measure, used by every step."""

from __future__ import annotations

import math
import statistics


def iqr(values) -> float:
    """Inter-quartile range: the entry-to-entry jitter a difference must beat to count as evidence."""
    vals = sorted(float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v))
    if len(vals) < 2:
        return 0.0
    q = statistics.quantiles(vals, n=4, method="inclusive")
    return q[2] - q[0]


def median(values) -> float | None:
    """The median of the finite numbers among `values` (None where there are none): the one median of
    diagnose's figures."""
    vals = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return statistics.median(vals) if vals else None
