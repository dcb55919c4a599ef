"""bench/advantage_agreement.py: its TD(λ) on rows in any order, and its agreement figures, by hand (the benchmark
itself reads an exact_values run; benchmarks.md has its figures)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.advantage_agreement import agreement, kind_bias, kind_persistence, segment_advantages, state_kind


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
    exact = np.array([0.5, -0.3, 0.05, 0.05])  # weighted mean 0 (weights 1, 2, 1, 1: 0.5 − 0.6 + 0.05 + 0.05)
    weight = np.array([1.0, 2.0, 1.0, 1.0])
    noise = 2 * 0.05 ** 2 / (0.25 + 2 * 0.09 + 2 * 0.05 ** 2)  # w·A*² on the non-decisive rows 2 and 3, over all
    assert agreement(exact, exact, weight) == pytest.approx({"correlation": 1.0, "sign": 1.0, "noise_share": noise})
    assert agreement(-exact, exact, weight) == pytest.approx({"correlation": -1.0, "sign": 0.0, "noise_share": noise})
    # Decisive segments are rows 0 and 1 (|A*| > 0.1), of weights 1 and 2. The estimate (weighted mean 0 too: 0.3 +
    # 0.4 − 0.1 − 0.6) gets row 0 right and row 1 wrong; its spread w·a² is 0.09, 0.08, 0.01, 0.36, of which rows 2
    # and 3 hold 0.37 of 0.54.
    estimate = np.array([0.3, 0.2, -0.1, -0.6])
    assert agreement(estimate, exact, weight)["sign"] == pytest.approx(1 / 3)
    assert agreement(estimate, exact, weight)["noise_share"] == pytest.approx(0.37 / 0.54)


def test_state_kind_reads_the_last_progress_line():
    first = "Q: name the town where Kalo Venris was born. Notes: none. Hops done: 0 of 5. Last: nothing yet."
    later = ("Q: … Notes: Loven Dra. Hops done: 1 of 5. Turn 4 of 14. Last: read a document, noted a name.\n"
             "Error: not one of the listed calls.")
    assert state_kind(first) == "0|nothing yet"
    assert state_kind(first + "\n" + later) == "1|read a document, noted a name"
    assert state_kind("Dial 3 shows 7.") is None


def test_kind_bias_and_persistence_by_hand():
    kinds = np.array(["a", "b", "a", "b"], dtype=object)
    biases = kind_bias(kinds, np.array([0.1, -0.2, 0.3, 0.0]))
    assert biases.keys() == {"a", "b"} and biases["a"]["rows"] == biases["b"]["rows"] == 2
    assert (biases["a"]["bias"], biases["b"]["bias"]) == pytest.approx((0.2, -0.1))
    before = {k: {"rows": 30, "bias": b} for k, b in zip("abcd", [0.1, -0.1, 0.2, 0.0], strict=True)}
    after = {k: {"rows": 30, "bias": 2 * b - 0.05} for k, b in zip("abcd", [0.1, -0.1, 0.2, 0.0], strict=True)}
    after["e"] = {"rows": 30, "bias": 1.0}  # not in `before`: left out
    before["d"]["rows"] = 5  # too few rows in one iteration: left out
    result = kind_persistence(before, after)
    assert result["kinds"] == 3 and result["correlation"] == pytest.approx(1.0)
    assert result["same_sign"] == pytest.approx(1.0) and result["mean_abs_bias"] == pytest.approx([0.4 / 3, 0.75 / 3])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1, 1), min_size=3, max_size=20), st.floats(0.1, 10), st.floats(-1, 1))
def test_agreement_ignores_the_shift_and_scale_whitening_applies(values, scale, shift):
    exact = np.array([*values, 2.0, -2.0])  # never constant, with decisive segments
    rng = np.random.default_rng(len(values))
    estimate, weight = exact + rng.normal(size=len(exact)), rng.uniform(0.5, 2.0, size=len(exact))
    before, after = agreement(estimate, exact, weight), agreement(scale * estimate + shift, exact, weight)
    assert after == pytest.approx(before, abs=1e-9)
