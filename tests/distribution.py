"""A two-sample permutation test on categorical samples: do two lists come from one distribution?

Exact under the null hypothesis whatever the number of categories or how rare they are (no chi-square
approximation), provided the samples are independent: each sample here is its own request with its own
seed. The statistic is the chi-square statistic of the 2-by-K contingency table.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


def chi_square(counts_a: np.ndarray, counts_b: np.ndarray) -> float:
    total = counts_a + counts_b
    n_a, n_b = counts_a.sum(), counts_b.sum()
    expected_a = total * n_a / (n_a + n_b)
    expected_b = total * n_b / (n_a + n_b)
    return float(((counts_a - expected_a) ** 2 / expected_a).sum() + ((counts_b - expected_b) ** 2 / expected_b).sum())


def permutation_p_value(a: Sequence[Hashable], b: Sequence[Hashable], rounds: int = 4000, seed: int = 0) -> float:
    """P-value of "a and b are drawn from the same distribution" (small: they are not)."""
    categories = {value: i for i, value in enumerate(dict.fromkeys([*a, *b]))}
    labels = np.array([categories[v] for v in [*a, *b]])
    k, n_a = len(categories), len(a)

    def statistic(order: np.ndarray) -> float:
        return chi_square(np.bincount(order[:n_a], minlength=k).astype(float),
                          np.bincount(order[n_a:], minlength=k).astype(float))

    observed = statistic(labels)
    rng = np.random.default_rng(seed)
    at_least = sum(statistic(rng.permutation(labels)) >= observed - 1e-9 for _ in range(rounds))
    return (at_least + 1) / (rounds + 1)
