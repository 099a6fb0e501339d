"""The statistics. Inputs are sequences of numbers; empty input raises ValueError."""

from __future__ import annotations

from collections.abc import Sequence


def _check(values: Sequence[float]) -> None:
    if len(values) == 0:
        raise ValueError("need at least one value")


def mean(values: Sequence[float]) -> float:
    _check(values)
    return sum(values) / len(values)


def median(values: Sequence[float]) -> float:
    _check(values)
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def variance(values: Sequence[float], sample: bool = True) -> float:
    _check(values)
    m = mean(values)
    squares = sum((v - m) ** 2 for v in values)
    return squares / (len(values) - 1 if sample else len(values))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    _check(values)
    if not 0 <= q <= 100:
        raise ValueError("q must be between 0 and 100")
    rank = round(q / 100 * (len(values) - 1))
    return values[rank]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    _check(values)
    if window < 1:
        raise ValueError("window must be positive")
    return [sum(values[i : i + window]) / window for i in range(len(values) - window + 1)]
