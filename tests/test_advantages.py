"""Advantage estimators: worked examples T1-T5 and T10, loop-vs-vectorised equivalence, invariances."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from focus_core.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_segments,
    dr_grpo_advantages,
    gae,
    get_advantage_estimator,
    grpo_advantages,
    lambda_token_for_halflife,
    rloo_advantages,
    segment_td_lambda,
    segment_td_lambda_batch,
    token_length_trace,
    vineppo_advantages,
    vineppo_advantages_batch,
    whiten,
)

R_T1 = np.array([0.0, 0.0, 0.0, 1.0])
V_T1 = np.array([0.5, 0.6, 0.3, 0.8, 0.0])


# ---------------------------------------------------------------------------- worked examples


def test_t1_segment_td_lambda():
    adv, ret = segment_td_lambda(R_T1, V_T1, gamma=1.0, lam=0.5)
    np.testing.assert_allclose(adv, [0.1, 0.0, 0.6, 0.2], atol=1e-12)
    np.testing.assert_allclose(ret, [0.6, 0.6, 0.9, 1.0], atol=1e-12)


def test_t2_limits_lambda_zero_is_vineppo_and_one_is_return_minus_value():
    adv0, _ = segment_td_lambda(R_T1, V_T1, gamma=1.0, lam=0.0)
    np.testing.assert_allclose(adv0, [0.1, -0.3, 0.5, 0.2], atol=1e-12)
    np.testing.assert_allclose(vineppo_advantages(R_T1, V_T1)[0], adv0)
    adv1, _ = segment_td_lambda(R_T1, V_T1, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv1, [0.5, 0.4, 0.7, 0.2], atol=1e-12)


def test_t3_per_segment_discount():
    adv, _ = segment_td_lambda(R_T1, V_T1, gamma=0.9, lam=0.5)
    np.testing.assert_allclose(adv, [-0.005225, -0.1005, 0.51, 0.2], atol=1e-12)


def test_t4_token_length_aware_trace():
    trace = token_length_trace(np.array([100, 300, 200, 400]), lambda_token_for_halflife(200))
    np.testing.assert_allclose(trace, [0.707107, 0.353553, 0.5, 0.25], atol=1e-6)
    adv, _ = segment_td_lambda(R_T1, V_T1, gamma=1.0, lam=0.9, trace=trace)
    np.testing.assert_allclose(adv, [0.037868, -0.087868, 0.6, 0.2], atol=1e-6)


def test_t5_broadcast():
    counts = np.array([3, 2, 4, 1])
    mask = np.array([1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 0, 0])  # env tokens between segments
    out = broadcast_segments(np.array([0.1, 0.0, 0.6, 0.2]), counts, mask)
    policy = out[mask == 1]
    np.testing.assert_allclose(policy, [0.1, 0.1, 0.1, 0.0, 0.0, 0.6, 0.6, 0.6, 0.6, 0.2])
    assert (out[mask == 0] == 0).all()


def test_t10_group_baselines():
    np.testing.assert_allclose(dr_grpo_advantages([1, 0, 1, 0], [0] * 4), [0.5, -0.5, 0.5, -0.5])
    np.testing.assert_allclose(grpo_advantages([1, 0, 1, 0], [0] * 4), [0.866025, -0.866025] * 2, atol=1e-6)
    np.testing.assert_allclose(grpo_advantages([1, 0, 1, 0], [0] * 4, unbiased=False), [1, -1, 1, -1], atol=1e-12)
    np.testing.assert_allclose(dr_grpo_advantages([1, 1, 1, 0], [0] * 4), [0.25, 0.25, 0.25, -0.75])
    np.testing.assert_allclose(grpo_advantages([1, 1, 1, 0], [0] * 4), [0.5, 0.5, 0.5, -1.5], atol=1e-12)
    np.testing.assert_allclose(rloo_advantages([1, 1, 1, 0], [0] * 4), [1 / 3, 1 / 3, 1 / 3, -1.0], atol=1e-12)


def test_zero_variance_and_singleton_groups_get_zero():
    rewards = np.array([0.1, 0.1, 0.1, 1.0])  # 0.1 sums with rounding error: must still be exactly 0
    assert (grpo_advantages(rewards, [0, 0, 0, 1]) == 0).all()
    assert (rloo_advantages(rewards, [0, 0, 0, 1])[3] == 0)


# ---------------------------------------------------------------------------- ragged batches

ragged_lengths = st.lists(st.integers(0, 12), min_size=1, max_size=25)


def _random_batch(lengths, seed):
    rng = np.random.default_rng(seed)
    n = int(sum(lengths))
    return rng.normal(size=n), rng.normal(size=n + len(lengths)), rng.uniform(0.5, 1.0, size=n)


@settings(max_examples=60, deadline=None)
@given(lengths=ragged_lengths, seed=st.integers(0, 10_000), lam=st.floats(0, 1), gamma=st.floats(0.5, 1))
def test_segment_td_lambda_batch_equals_loop(lengths, seed, lam, gamma):
    rewards, values, trace = _random_batch(lengths, seed)
    adv, ret = segment_td_lambda_batch(rewards, values, np.array(lengths), gamma=gamma, lam=lam)
    adv_t, _ = segment_td_lambda_batch(rewards, values, np.array(lengths), gamma=gamma, lam=0.9, trace=trace)
    r0, v0 = 0, 0
    for k in lengths:
        a, g = segment_td_lambda(rewards[r0:r0 + k], values[v0:v0 + k + 1], gamma=gamma, lam=lam)
        np.testing.assert_allclose(adv[r0:r0 + k], a, atol=1e-12)
        np.testing.assert_allclose(ret[r0:r0 + k], g, atol=1e-12)
        a_t, _ = segment_td_lambda(rewards[r0:r0 + k], values[v0:v0 + k + 1], gamma=gamma, lam=0.9,
                                   trace=trace[r0:r0 + k])
        np.testing.assert_allclose(adv_t[r0:r0 + k], a_t, atol=1e-12)
        r0, v0 = r0 + k, v0 + k + 1


@settings(max_examples=30, deadline=None)
@given(lengths=ragged_lengths, seed=st.integers(0, 10_000))
def test_batch_forms_agree_between_numpy_and_torch(lengths, seed):
    rewards, values, _ = _random_batch(lengths, seed)
    lengths = np.array(lengths)
    a_np, _ = segment_td_lambda_batch(rewards, values, lengths, gamma=1.0, lam=0.7)
    a_t, _ = segment_td_lambda_batch(torch.tensor(rewards), torch.tensor(values), torch.tensor(lengths),
                                     gamma=1.0, lam=0.7)
    assert isinstance(a_t, torch.Tensor)
    np.testing.assert_allclose(a_t.numpy(), a_np, atol=1e-12)
    v_np, _ = vineppo_advantages_batch(rewards, values, lengths)
    np.testing.assert_allclose(v_np, segment_td_lambda_batch(rewards, values, lengths, gamma=1.0, lam=0.0)[0])


@settings(max_examples=40, deadline=None)
@given(lengths=ragged_lengths, seed=st.integers(0, 10_000))
def test_lambda_limits_on_random_batches(lengths, seed):
    """λ=0 is r + V(next) − V; λ=1 (γ=1) is the return-to-go minus V, for every segment."""
    rewards, values, _ = _random_batch(lengths, seed)
    lengths = np.array(lengths)
    adv0, _ = segment_td_lambda_batch(rewards, values, lengths, gamma=1.0, lam=0.0)
    adv1, _ = segment_td_lambda_batch(rewards, values, lengths, gamma=1.0, lam=1.0)
    r0, v0 = 0, 0
    for k in lengths:
        r, v = rewards[r0:r0 + k], values[v0:v0 + k + 1]
        np.testing.assert_allclose(adv0[r0:r0 + k], r + v[1:] - v[:-1], atol=1e-12)
        return_to_go = np.cumsum(r[::-1])[::-1] + v[-1]
        np.testing.assert_allclose(adv1[r0:r0 + k], return_to_go - v[:-1], atol=1e-10)
        r0, v0 = r0 + k, v0 + k + 1


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=12), seed=st.integers(0, 10_000))
def test_group_estimators_equal_per_group_loop(sizes, seed):
    rng = np.random.default_rng(seed)
    group_ids = rng.permutation(np.repeat(np.arange(len(sizes)) * 7 + 3, sizes))  # unsorted, sparse ids
    rewards = rng.integers(0, 2, size=len(group_ids)).astype(float)
    grpo, dr, rloo = (grpo_advantages(rewards, group_ids), dr_grpo_advantages(rewards, group_ids),
                      rloo_advantages(rewards, group_ids))
    grpo_t = grpo_advantages(torch.tensor(rewards), torch.tensor(group_ids))
    np.testing.assert_allclose(grpo_t.numpy(), grpo, atol=1e-12)
    for g in np.unique(group_ids):
        idx = np.flatnonzero(group_ids == g)
        r = rewards[idx]
        np.testing.assert_allclose(dr[idx], r - r.mean(), atol=1e-12)
        std = r.std(ddof=1) if len(r) > 1 else 0.0
        np.testing.assert_allclose(grpo[idx], (r - r.mean()) / std if std > 1e-6 else 0 * r, atol=1e-9)
        for j, i in enumerate(idx):
            others = np.delete(r, j)
            expected = r[j] - others.mean() if len(others) else 0.0
            np.testing.assert_allclose(rloo[i], expected, atol=1e-12)


# ---------------------------------------------------------------------------- GAE


def _gae_loop(rewards, values, mask, gamma, lam):
    """Reference: run plain GAE on the policy tokens alone, then scatter back."""
    adv = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = np.flatnonzero(mask[b])
        next_value = next_adv = 0.0
        for t in idx[::-1]:
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[b, t]
            adv[b, t] = next_adv
    return adv


def _gae_batch(seed, b, t):
    rng = np.random.default_rng(seed)
    mask = (rng.random((b, t)) < 0.6).astype(np.int8)
    rewards = np.where(mask == 1, rng.normal(size=(b, t)), 0.0)
    return rewards, rng.normal(size=(b, t)), mask, rng


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 6), t=st.integers(1, 30),
       gamma=st.floats(0.8, 1), lam=st.floats(0, 1))
def test_gae_vectorised_equals_loop_over_policy_tokens(seed, b, t, gamma, lam):
    rewards, values, mask, _ = _gae_batch(seed, b, t)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    np.testing.assert_allclose(adv, _gae_loop(rewards, values, mask, gamma, lam), atol=1e-10)
    np.testing.assert_allclose(ret, np.where(mask == 1, adv + values, 0.0), atol=1e-12)
    adv_t, _ = gae(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), gamma=gamma, lam=lam)
    np.testing.assert_allclose(adv_t.numpy(), adv, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 5), t=st.integers(1, 25))
def test_gae_masked_value_invariance(seed, b, t):
    """Randomising the values at masked (environment) positions changes no advantage."""
    rewards, values, mask, rng = _gae_batch(seed, b, t)
    scrambled = np.where(mask == 1, values, rng.normal(scale=100.0, size=values.shape))
    a1, r1 = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    a2, r2 = gae(rewards, scrambled, mask, gamma=1.0, lam=0.95)
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_array_equal(r1, r2)
    assert (a1[mask == 0] == 0).all()


def test_gae_single_sequence_and_reward_on_masked_token_is_an_error():
    adv, _ = gae(np.array([0.0, 0.0, 1.0]), np.array([0.2, 9.0, 0.5]), np.array([1, 0, 1]), gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv, [0.8, 0.0, 0.5])  # λ=γ=1: R − V on policy tokens
    with pytest.raises(ValueError, match="masked"):
        gae(np.array([0.0, 1.0]), np.zeros(2), np.array([1, 0]), gamma=1.0, lam=1.0)


# ---------------------------------------------------------------------------- broadcast & misc


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(0, 6), min_size=1, max_size=10), seed=st.integers(0, 10_000))
def test_broadcast_preserves_segment_advantage_and_zeroes_masked(counts, seed):
    rng = np.random.default_rng(seed)
    counts = np.array(counts)
    adv = rng.normal(size=len(counts))
    env_tokens = rng.integers(0, 3, size=len(counts))
    parts = [np.r_[np.ones(c, np.int8), np.zeros(e, np.int8)] for c, e in zip(counts, env_tokens, strict=True)]
    mask = np.concatenate(parts)
    out = broadcast_segments(adv, counts, mask)
    assert (out[mask == 0] == 0).all()
    np.testing.assert_array_equal(out[mask == 1], np.repeat(adv, counts))
    out_t = broadcast_segments(torch.tensor(adv), torch.tensor(counts), torch.tensor(mask))
    np.testing.assert_array_equal(out_t.numpy(), out)


def test_broadcast_rejects_mismatched_mask():
    with pytest.raises(ValueError, match="policy tokens"):
        broadcast_segments(np.array([1.0, 2.0]), np.array([2, 2]), np.array([1, 1, 1, 0]))


def test_shape_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"values \[K\+1\]"):
        segment_td_lambda(np.zeros(3), np.zeros(3), gamma=1.0, lam=0.9)
    with pytest.raises(ValueError, match="sum\\(lengths\\)"):
        segment_td_lambda_batch(np.zeros(3), np.zeros(4), np.array([2, 1]), gamma=1.0, lam=0.9)


def _pipeline_batch(rng, episodes=5):
    from focus_core.advantages import AdvantageBatch

    lengths = rng.integers(1, 4, size=episodes)
    outcomes = rng.integers(0, 2, size=episodes).astype(float)
    rewards = np.concatenate([[0.0] * (k - 1) + [r] for k, r in zip(lengths, outcomes, strict=True)])
    masks = [np.r_[0, rng.integers(0, 2, size=rng.integers(2, 6))] for _ in range(int(lengths.sum()))]
    for m in masks:
        m[-1] = 1  # every segment has a policy token
    return AdvantageBatch(rewards=rewards, lengths=lengths, outcomes=outcomes,
                          groups=np.array(["a", "a", "b", "b", "b"])[:episodes], values=rng.random(int(lengths.sum())),
                          token_values=[rng.random(len(m)) for m in masks], token_masks=masks)


def test_registry_lists_every_estimator_under_one_signature():
    from focus_core.config import AdvantageConfig

    assert set(ADVANTAGE_ESTIMATORS) == {"segment_td_lambda", "vineppo", "grpo", "dr_grpo", "rloo", "gae"}
    batch, config = _pipeline_batch(np.random.default_rng(0)), AdvantageConfig(lam=0.7)
    for name, estimator in ADVANTAGE_ESTIMATORS.items():
        result = estimator(batch, config)
        n = int(batch.lengths.sum())
        assert result.advantage.shape == result.value.shape == result.next_value.shape == (n,), name
    with pytest.raises(ValueError, match="known estimators"):
        get_advantage_estimator("reinforce")


def test_registry_entries_compute_what_the_formulas_say():
    from focus_core.config import AdvantageConfig

    batch, config = _pipeline_batch(np.random.default_rng(1)), AdvantageConfig(lam=0.7)
    per_episode = rloo_advantages(batch.outcomes, batch.groups)
    np.testing.assert_allclose(get_advantage_estimator("rloo")(batch, config).advantage,
                               np.repeat(per_episode, batch.lengths))
    flat = np.insert(batch.values, np.cumsum(batch.lengths), 0.0)
    expected, _ = segment_td_lambda_batch(batch.rewards, flat, batch.lengths, gamma=1.0, lam=0.7)
    np.testing.assert_allclose(get_advantage_estimator("segment_td_lambda")(batch, config).advantage, expected)
    # gae: one episode's tokens over its segments, in order, equal gae on the concatenation.
    result = get_advantage_estimator("gae")(batch, config)
    k = int(batch.lengths[0])
    mask = np.concatenate(batch.token_masks[:k])
    values = np.concatenate(batch.token_values[:k])
    rewards = np.zeros(len(mask))
    rewards[np.flatnonzero(mask)[-1]] = batch.outcomes[0]
    direct, _ = gae(rewards, values, mask, gamma=1.0, lam=0.7)
    np.testing.assert_allclose(np.concatenate(result.token_advantages[:k]), direct)


def test_fill_missing_values_t1_style():
    """VinePPO beyond its cap: a state without returns gets r_k + V(s_{k+1}), so its δ is 0."""
    from focus_core.advantages import fill_missing_values

    rewards = np.array([0.0, 0.0, 0.0, 1.0])
    values = np.array([0.5, np.nan, 0.3, np.nan])
    known = np.array([True, False, True, False])
    np.testing.assert_allclose(fill_missing_values(rewards, values, known, np.array([4])), [0.5, 0.3, 0.3, 1.0])
    filled = fill_missing_values(rewards, values, known, np.array([4]))
    advantage, _ = vineppo_advantages(rewards, np.r_[filled, 0.0])
    np.testing.assert_allclose(advantage[~known], 0.0)
    # Two episodes in one ragged batch give the same as each alone.
    both = fill_missing_values(np.r_[rewards, 0.0, 1.0], np.r_[values, np.nan, np.nan], np.r_[known, False, False],
                               np.array([4, 2]))
    np.testing.assert_allclose(both, [0.5, 0.3, 0.3, 1.0, 1.0, 1.0])


@given(arrays(np.float64, st.integers(2, 50), elements=st.floats(-5, 5)))
def test_whiten_is_zero_mean_unit_std(x):
    out = whiten(x)
    if x.std() > 1e-3:
        # Dividing by std + eps (eps = 1e-8) leaves the std a hair under 1 for small spreads: 1 − 1e-5 at 1e-3.
        assert abs(out.mean()) < 1e-9 and abs(out.std() - x.std() / (x.std() + 1e-8)) < 1e-9
