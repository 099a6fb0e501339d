"""Noise-aware comparison of measurements: median, spread, and a Mann-Whitney U test on the repeats.

A persona measures something (install time, a benchmark) a few times per commit. Between two commits the medians always
differ a little; the question is whether the difference is beyond the noise. Like asv, we ask two things before
calling it a change:

1. the effect is large enough to matter: |median(after) / median(before) - 1| >= `min_effect` (default 10%, asv's
   default factor 1.1), so a persona's few-percent jitter never reads as a regression however many repeats there are;
2. the samples really differ: a two-sided Mann-Whitney U test gives p < `alpha` (0.05). With too few repeats for the
   test to ever reach `alpha` (e.g. 3 against 3: the smallest possible p is 0.1), we fall back to "the two ranges do
   not overlap" and require at least two samples on each side; a single number against a single number is never
   called a change, because nothing says how noisy it is.

Pure Python on purpose: the worker box has no scipy, and the sample sizes are tiny.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

MIN_EFFECT = 0.10
ALPHA = 0.05
# Up to this many samples per side (and no ties) the exact distribution of U is cheap; beyond, the normal approximation.
EXACT_LIMIT = 20


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def spread(values: Sequence[float]) -> float:
    """Relative spread (max - min) / |median|; 0 for a single value, inf when the median is 0 but values differ."""
    if not values:
        raise ValueError("spread of no values")
    width = max(values) - min(values)
    m = abs(median(values))
    if width == 0:
        return 0.0
    return width / m if m else math.inf


def _ranks(values: Sequence[float]) -> tuple[list[float], list[int]]:
    """Average ranks (1-based) and the sizes of the tie groups."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    ties: list[int] = []
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        if j > i:
            ties.append(j - i + 1)
        i = j + 1
    return ranks, ties


@lru_cache(maxsize=None)
def _u_counts(n1: int, n2: int) -> tuple[int, ...]:
    """counts[u] = number of arrangements of n1 x's and n2 y's whose U statistic is u (no ties)."""
    # Recurrence on the largest element: it is an x (adds n2 to U) or a y (adds nothing).
    if n1 == 0 or n2 == 0:
        return (1,)
    with_x = _u_counts(n1 - 1, n2)
    with_y = _u_counts(n1, n2 - 1)
    counts = [0] * (n1 * n2 + 1)
    for u, c in enumerate(with_x):
        counts[u + n2] += c
    for u, c in enumerate(with_y):
        counts[u] += c
    return tuple(counts)


def mann_whitney_u(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Two-sided Mann-Whitney U test: (U of `a`, p). Exact for small samples without ties, else the normal
    approximation with tie correction and continuity correction. p is 1.0 when either side is empty."""
    n1, n2 = len(a), len(b)
    if n1 == 0 or n2 == 0:
        return 0.0, 1.0
    ranks, ties = _ranks(list(a) + list(b))
    u1 = sum(ranks[:n1]) - n1 * (n1 + 1) / 2
    mean_u = n1 * n2 / 2
    if not ties and max(n1, n2) <= EXACT_LIMIT:
        counts = _u_counts(n1, n2)
        total = math.comb(n1 + n2, n1)
        k = int(round(min(u1, n1 * n2 - u1)))
        p = 2 * sum(counts[: k + 1]) / total
        return u1, min(1.0, p)
    n = n1 + n2
    tie_term = sum(t**3 - t for t in ties) / (n * (n - 1))
    var_u = n1 * n2 / 12 * ((n + 1) - tie_term)
    if var_u <= 0:  # every value equal
        return u1, 1.0
    z = (abs(u1 - mean_u) - 0.5) / math.sqrt(var_u)
    p = math.erfc(max(z, 0.0) / math.sqrt(2))
    return u1, min(1.0, p)


def smallest_possible_p(n1: int, n2: int) -> float:
    """The best p a two-sided exact test can give with these sample sizes (all of one side above the other)."""
    if n1 == 0 or n2 == 0:
        return 1.0
    return min(1.0, 2 / math.comb(n1 + n2, n1))


@dataclass
class Comparison:
    changed: bool
    p: float | None  # None when no test could be made
    ratio: float  # median(after) / median(before); inf or nan when the before median is 0
    method: str  # "mann-whitney", "ranges" or "too few samples"

    def __iter__(self):  # lets callers write `changed, p, ratio = compare(...)`
        return iter((self.changed, self.p, self.ratio))


def compare(before: Sequence[float], after: Sequence[float], *, min_effect: float = MIN_EFFECT,
            alpha: float = ALPHA) -> Comparison:
    """Did the measurement change between `before` and `after` (the repeats of two commits), beyond the noise?"""
    if not before or not after:
        raise ValueError("compare needs samples on both sides")
    m_before, m_after = median(before), median(after)
    if m_before == 0:
        ratio = 1.0 if m_after == 0 else math.copysign(math.inf, m_after)
    else:
        ratio = m_after / m_before
    big_enough = abs(ratio - 1) >= min_effect
    if len(before) < 2 or len(after) < 2:
        return Comparison(False, None, ratio, "too few samples")
    if smallest_possible_p(len(before), len(after)) < alpha:
        _, p = mann_whitney_u(before, after)
        return Comparison(big_enough and p < alpha, p, ratio, "mann-whitney")
    apart = max(before) < min(after) or max(after) < min(before)
    _, p = mann_whitney_u(before, after)
    return Comparison(big_enough and apart, p, ratio, "ranges")
