"""Pearson chi-square for the distribution tests: the statistic with sparse cells merged, and the quantile
at a false-alarm rate of 1e-4 per test."""

from __future__ import annotations

import math
from collections.abc import Mapping

ALPHA_Z = 3.719  # one-sided standard normal quantile for alpha = 1e-4


def chi2_threshold(df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at 1 - 1e-4."""
    return df * (1 - 2 / (9 * df) + ALPHA_Z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(observed: Mapping, expected: Mapping, n: int) -> tuple[float, int]:
    """Pearson's statistic over `expected` (probabilities), cells expected below 5 merged into one;
    (statistic, degrees of freedom)."""
    assert sum(observed.values()) == n
    assert set(observed) <= {k for k, p in expected.items() if p > 0}, "an outcome the target gives no mass"
    stat, df, rest_e, rest_o = 0.0, -1, 0.0, 0
    for key, p in expected.items():
        if p * n < 5:
            rest_e, rest_o = rest_e + p * n, rest_o + observed.get(key, 0)
            continue
        stat += (observed.get(key, 0) - p * n) ** 2 / (p * n)
        df += 1
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        df += 1
    return stat, df
