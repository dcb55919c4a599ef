"""bench/advantage_agreement.py: its TD(λ) on rows in any order, and its agreement figures, by hand (the benchmark
itself reads an exact_values run; benchmarks.md has its figures)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.advantage_agreement import agreement, segment_advantages


def test_segment_advantages_on_shuffled_rows():
    # Rows of two episodes, shuffled: a has segments 0, 1, 2 at rows 2, 4, 1; b has 0, 1 at rows 3, 0.
    episodes = np.array(["b", "a", "a", "b", "a"], dtype=object)
    segments = np.array([1, 2, 0, 0, 1])
    value = np.array([0.5, 0.9, 0.2, 0.4, 0.6])
    reward = np.array([1.0, 0.0, 0.0, 0.0, 0.0])  # b succeeds in its last segment, a fails in its
    # b: A_0 = 0 + 0.5 − 0.4 = 0.1, A_1 = 1 − 0.5 = 0.5; a: A_0 = 0.6 − 0.2 = 0.4, A_1 = 0.9 − 0.6 = 0.3, A_2 = −0.9
    np.testing.assert_allclose(segment_advantages(reward, value, episodes, segments, lam=0.0),
                               [0.5, -0.9, 0.4, 0.1, 0.3])
    # λ = 1: R − V(s_k), b's return 1, a's 0.
    np.testing.assert_allclose(segment_advantages(reward, value, episodes, segments, lam=1.0),
                               [0.5, -0.9, -0.2, 0.6, -0.6])


def test_agreement_by_hand():
    exact = np.array([0.5, -0.3, 0.05, -0.2])  # weighted mean 0 (weights 1, 2, 1, 1 sum 0.5 − 0.6 + 0.05 − 0.2)
    weight = np.array([1.0, 2.0, 1.0, 1.0])
    assert agreement(exact, exact, weight) == pytest.approx({"correlation": 1.0, "sign": 1.0})
    assert agreement(-exact, exact, weight) == pytest.approx({"correlation": -1.0, "sign": 0.0})
    # Decisive segments are rows 0, 1, 3 (|A*| > 0.1), of weights 1, 2, 1. The estimate, centred on its weighted
    # mean 0 (0.3 − 0.4 − 0.1 + 0.2 = 0), gets rows 0 and 3 right.
    estimate = np.array([0.3, 0.2, -0.1, -0.2])
    assert agreement(estimate, exact, weight)["sign"] == pytest.approx(2 / 4)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1, 1), min_size=3, max_size=20), st.floats(0.1, 10), st.floats(-1, 1))
def test_agreement_ignores_the_shift_and_scale_whitening_applies(values, scale, shift):
    exact = np.array([*values, 2.0, -2.0])  # never constant, with decisive segments
    rng = np.random.default_rng(len(values))
    estimate, weight = exact + rng.normal(size=len(exact)), rng.uniform(0.5, 2.0, size=len(exact))
    before, after = agreement(estimate, exact, weight), agreement(scale * estimate + shift, exact, weight)
    assert after == pytest.approx(before, abs=1e-9)
