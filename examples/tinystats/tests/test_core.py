import pytest

from tinystats import mean, median, moving_average, percentile, variance


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_median_odd():
    assert median([3, 1, 2]) == 2


def test_variance_sample():
    assert variance([2, 4, 4, 4, 5, 5, 7, 9]) == pytest.approx(4.571428, rel=1e-5)


def test_percentile_sorted():
    assert percentile([1, 2, 3, 4, 5], 50) == 3


def test_percentile_unsorted():
    assert percentile([5, 1, 3], 100) == 5


def test_moving_average():
    assert moving_average([1, 2, 3, 4], window=2) == [1.5, 2.5, 3.5]


def test_empty_raises():
    with pytest.raises(ValueError):
        mean([])
