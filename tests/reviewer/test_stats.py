"""Noise rule: median, spread, Mann-Whitney U (checked against brute-force enumeration), and `compare`."""

import itertools
import math
import random

import pytest

from reviewer.stats import compare, mann_whitney_u, median, smallest_possible_p, spread


def test_median_and_spread():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == 2.5
    assert spread([10.0]) == 0.0
    assert spread([9.0, 10.0, 11.0]) == pytest.approx(0.2)
    assert spread([0.0, 0.0]) == 0.0
    assert spread([-1.0, 0.0, 1.0]) == math.inf
    with pytest.raises(ValueError):
        median([])


def brute_force_p(a, b):
    """Two-sided permutation p of U: share of all splits of a+b whose U is at least as far from its mean."""
    pooled = list(a) + list(b)
    n1, n2 = len(a), len(b)

    def u_of(xs, ys):
        return sum(1.0 if x > y else 0.5 if x == y else 0.0 for x in xs for y in ys)

    observed = abs(u_of(a, b) - n1 * n2 / 2)
    hits = total = 0
    for idx in itertools.combinations(range(n1 + n2), n1):
        xs = [pooled[i] for i in idx]
        ys = [pooled[i] for i in range(n1 + n2) if i not in idx]
        total += 1
        hits += abs(u_of(xs, ys) - n1 * n2 / 2) >= observed - 1e-12
    return hits / total


@pytest.mark.parametrize("a,b", [
    ([1, 2, 3], [4, 5, 6]),
    ([1, 2, 3, 4], [5, 6, 7, 8]),
    ([1.0, 2.5, 3.1, 7.0], [2.0, 4.0, 5.5, 6.0, 9.0]),
    ([0.9, 1.1, 1.0, 1.05], [1.02, 0.97, 1.08]),
    ([5], [1, 2, 3, 4]),
])
def test_exact_p_matches_enumeration(a, b):
    u, p = mann_whitney_u(a, b)
    assert u == sum(1 for x in a for y in b if x > y)
    assert p == pytest.approx(brute_force_p(a, b))


def test_normal_approximation_with_ties_is_close_to_enumeration():
    a = [1, 2, 2, 3, 4, 4, 5]
    b = [3, 4, 5, 6, 6, 7, 8]
    _, p = mann_whitney_u(a, b)  # ties: normal approximation with tie correction
    assert p == pytest.approx(brute_force_p(a, b), abs=0.01)
    assert mann_whitney_u([2, 2, 2], [2, 2, 2])[1] == 1.0


def test_smallest_possible_p():
    assert smallest_possible_p(3, 3) == pytest.approx(0.1)
    assert smallest_possible_p(4, 4) == pytest.approx(2 / 70)


def test_clear_change_is_flagged_with_its_p_and_ratio():
    before = [10.0, 10.2, 9.9, 10.1, 10.0]
    after = [12.0, 12.3, 11.9, 12.1, 12.2]
    changed, p, ratio = compare(before, after)
    assert changed and p < 0.05 and ratio == pytest.approx(1.2, rel=0.01)
    assert compare(after, before).changed  # a speed-up is a change too


def test_small_effect_is_never_a_change_however_significant():
    before = [100.0 + i * 0.01 for i in range(20)]
    after = [104.0 + i * 0.01 for i in range(20)]  # 4% up, p tiny
    result = compare(before, after)
    assert result.p < 1e-6 and not result.changed


def test_three_percent_jitter_never_reads_as_a_change():
    rng = random.Random(20261129)
    flagged = 0
    for _ in range(2000):
        for n in (2, 3, 5, 8):
            # Uniform +-3%: the medians can never be 10% apart, whatever the draw.
            before = [100 * rng.uniform(0.97, 1.03) for _ in range(n)]
            after = [100 * rng.uniform(0.97, 1.03) for _ in range(n)]
            flagged += compare(before, after).changed
    assert flagged == 0


def test_gaussian_jitter_false_alarms_are_rare_and_real_changes_found():
    rng = random.Random(7)
    trials = 2000
    false = sum(compare([rng.gauss(1, 0.03) for _ in range(5)], [rng.gauss(1, 0.03) for _ in range(5)]).changed
                for _ in range(trials))
    found = sum(compare([rng.gauss(1, 0.03) for _ in range(5)], [rng.gauss(1.25, 0.03) for _ in range(5)]).changed
                for _ in range(trials))
    assert false / trials < 0.005
    assert found / trials > 0.99


def test_too_few_samples_and_small_samples():
    assert compare([10.0], [20.0]).method == "too few samples"
    assert not compare([10.0], [20.0]).changed  # one number each: no idea of the noise
    # 3 against 3 cannot reach p < 0.05 exactly: the ranges rule decides.
    apart = compare([10.0, 10.1, 10.2], [12.0, 12.1, 12.2])
    assert apart.method == "ranges" and apart.changed
    overlapping = compare([10.0, 10.1, 13.0], [12.0, 12.1, 12.2])
    assert not overlapping.changed
    with pytest.raises(ValueError):
        compare([], [1.0])
