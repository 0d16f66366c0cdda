"""The permutation test that the lookahead sampling test relies on: it holds its level and has power."""

from __future__ import annotations

import numpy as np

from .distribution import permutation_p_value


def test_same_distribution_is_rarely_rejected() -> None:
    rng = np.random.default_rng(1)
    probs = [0.5, 0.2, 0.1, 0.1, 0.05, 0.03, 0.02]
    p_values = [permutation_p_value(list(rng.choice(7, 200, p=probs)), list(rng.choice(7, 200, p=probs)),
                                    rounds=400, seed=i) for i in range(40)]
    # Under the null hypothesis p-values are uniform: about 2 of 40 fall below 0.05, none far below.
    assert sum(p < 0.05 for p in p_values) <= 6
    assert min(p_values) > 0.001


def test_a_shifted_distribution_is_rejected() -> None:
    rng = np.random.default_rng(2)
    a = list(rng.choice(4, 300, p=[0.55, 0.25, 0.15, 0.05]))
    b = list(rng.choice(4, 300, p=[0.40, 0.30, 0.20, 0.10]))
    assert permutation_p_value(a, b, rounds=2000) < 0.001


def test_categories_can_be_any_hashable_and_rare() -> None:
    a = [(1, 2), (1, 2), (1, 3), (9, 9, 9)] * 30
    b = [(1, 2), (1, 3), (1, 3), (7,)] * 30
    assert permutation_p_value(a, b, rounds=1000) < 0.01
    assert permutation_p_value(a, list(a), rounds=1000) > 0.5
