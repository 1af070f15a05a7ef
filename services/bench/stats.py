"""Every statistic the benchmarks report: medians, percentiles, latency distributions and CDF points.

Percentiles interpolate linearly between the closest ranks (numpy's default method); NaN values (a
measurement that did not happen, such as the second token of a one-token reply) are left out of medians.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

PERCENTILES = (50, 90, 99)


def median(values: Iterable[float]) -> float:
    """The median of the values that are not NaN; NaN when none is left."""
    clean = [v for v in values if not math.isnan(v)]
    return statistics.median(clean) if clean else float("nan")


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolated linearly between the closest ranks; None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def percentile_or_nan(values: Iterable[float], q: float) -> float:
    """`percentile`, with NaN for no values (for results that keep NaN until they are written)."""
    found = percentile(values, q)
    return float("nan") if found is None else found


def distribution(values_s: Iterable[float]) -> dict[str, float | None]:
    """p50/p90/p99, the mean (ms, rounded to the microsecond) and the count of seconds `values_s`."""
    values = sorted(1000 * v for v in values_s)
    out: dict[str, float | None] = {f"p{q}": None for q in PERCENTILES}
    out |= {"mean": None, "count": len(values)}
    if values:
        out |= {f"p{q}": round(percentile(values, q) or 0.0, 3) for q in PERCENTILES}
        out["mean"] = round(sum(values) / len(values), 3)
    return out


def cdf_points(values_s: Iterable[float]) -> tuple[list[float], list[float]]:
    """Sorted values in ms and their cumulative fractions, for a CDF plot."""
    xs = sorted(1000 * v for v in values_s)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def median_row(rows: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    """The row whose `key` is the median (the lower middle one for an even count), as a copy."""
    ordered = sorted(rows, key=lambda r: r[key])
    return dict(ordered[(len(ordered) - 1) // 2])
