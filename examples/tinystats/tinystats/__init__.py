"""Small descriptive statistics."""

from tinystats.core import mean, median, moving_average, percentile, variance

__all__ = ["mean", "median", "moving_average", "percentile", "variance"]
__version__ = "0.3.1"
