"""Acquisition: worked examples T6-T9, the budget contract of every strategy, IVR exactness."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from focus_core.acquisition import (
    STRATEGIES,
    Candidates,
    IntegratedVariance,
    Request,
    advantage_sensitivity,
    allocate,
    combine_estimates,
    expected_error_reduction,
)
from focus_core.config import AcquisitionConfig
from focus_core.critic import ensemble_covariance

T9_MEMBERS = np.array([[0.2, 0.5, 0.9], [0.4, 0.5, 0.7], [0.3, 0.6, 0.8], [0.5, 0.4, 0.6]])
T9_COST = np.array([1000.0, 600.0, 300.0])


def test_t6_sensitivity_weights():
    k = np.arange(4)
    np.testing.assert_allclose(advantage_sensitivity(k, lam=0.5), [1, 1.25, 1.3125, 1.328125])
    np.testing.assert_allclose(advantage_sensitivity(k, lam=0.0), [1, 2, 2, 2])
    np.testing.assert_allclose(advantage_sensitivity(k, lam=1.0), [1, 1, 1, 1])


def test_t6_weights_match_the_derivative_definition():
    """W_k = Σ_j (∂A_j/∂V_k)², measured by finite differences on segment_td_lambda."""
    from focus_core.advantages import segment_td_lambda

    rewards, values = np.zeros(6), np.random.default_rng(0).random(7)
    values[-1] = 0.0
    for lam, gamma in ((0.5, 1.0), (0.8, 0.9)):
        base, _ = segment_td_lambda(rewards, values, gamma=gamma, lam=lam)
        for k in range(6):
            bumped = values.copy()
            bumped[k] += 1.0  # advantages are linear in values: a unit bump gives the derivative
            grad = segment_td_lambda(rewards, bumped, gamma=gamma, lam=lam)[0] - base
            assert np.sum(grad**2) == pytest.approx(advantage_sensitivity(k, gamma=gamma, lam=lam))


def test_t7_single_state_error_reduction():
    n = np.arange(5)
    delta = expected_error_reduction(np.full(5, 0.04), np.full(5, 0.24), n)
    np.testing.assert_allclose(delta, [0, 0.005714, 0.01, 0.013333, 0.016], atol=1e-6)
    np.testing.assert_allclose(np.diff(delta), [0.005714, 0.004286, 0.003333, 0.002667], atol=1e-6)


def test_t8_shrinkage():
    value, var = combine_estimates(np.array([0.4]), np.array([0.04]), np.array([0.75]), np.array([4]))
    assert value[0] == pytest.approx(0.54)
    assert var[0] == pytest.approx(0.024)
    value0, var0 = combine_estimates(np.array([0.4]), np.array([0.04]), np.array([np.nan]), np.array([0]))
    assert (value0[0], var0[0]) == (pytest.approx(0.4), pytest.approx(0.04))


def test_t9_ivr_covariance_gains_and_three_picks():
    sigma = ensemble_covariance(T9_MEMBERS, jitter=1e-4)
    np.testing.assert_allclose(T9_MEMBERS.mean(0), [0.35, 0.5, 0.75])
    np.testing.assert_allclose(sigma, [[0.016767, -0.006667, -0.016667], [-0.006667, 0.006767, 0.006667],
                                       [-0.016667, 0.006667, 0.016767]], atol=1e-6)
    cands = Candidates(T9_MEMBERS, cost=T9_COST, weight=np.ones(3))
    ivr = IntegratedVariance(T9_MEMBERS, np.ones(3), cands.outcome_variance / 2, 1e-4)
    np.testing.assert_allclose(ivr.gains(), [0.004623, 0.001022, 0.005459], atol=1e-6)
    for _ in range(3):
        ivr.condition(2)
    np.testing.assert_allclose(ivr.diag, [0.010982, 0.005841, 0.010912], atol=1e-6)
    first = allocate(cands, request(600, eps_uniform=0.0)).picks[0]
    assert first == 2  # the highest gain per token


def request(budget, strategy="ivr_greedy", seed=0, **settings):
    config = AcquisitionConfig(strategy=strategy, benchmark_only=True, **settings)
    return Request(budget_tokens=budget, config=config, seed=seed)


def _dense_gains(sigma, w, noise):
    return (w[:, None] * sigma**2).sum(0) / (np.diag(sigma) + noise)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), m=st.integers(2, 6), s=st.integers(1, 30), jitter=st.floats(1e-6, 1e-2))
def test_factored_ivr_equals_dense_rank_one_updates(seed, m, s, jitter):
    rng = np.random.default_rng(seed)
    members, w, noise = rng.random((m, s)), rng.random(s), rng.uniform(0.01, 0.2, s)
    sigma = ensemble_covariance(members, jitter=jitter)
    ivr = IntegratedVariance(members, w, noise, jitter)
    for _ in range(12):
        np.testing.assert_allclose(ivr.gains(), _dense_gains(sigma, w, noise), rtol=1e-7, atol=1e-12)
        np.testing.assert_allclose(ivr.diag, np.diag(sigma), rtol=1e-7, atol=1e-12)
        state = int(rng.integers(s))
        column = sigma[:, state].copy()
        sigma -= np.outer(column, column) / (sigma[state, state] + noise[state])
        ivr.condition(state)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), s=st.integers(1, 20))
def test_ivr_gain_of_a_repeatedly_picked_state_never_increases(seed, s):
    rng = np.random.default_rng(seed)
    ivr = IntegratedVariance(rng.random((5, s)), rng.random(s), rng.uniform(0.01, 0.2, s), 1e-4)
    state = int(rng.integers(s))
    gains = []
    for _ in range(10):
        gains.append(ivr.gains()[state])
        ivr.condition(state)
    assert all(b <= a * (1 + 1e-9) + 1e-15 for a, b in zip(gains, gains[1:], strict=False))


def _random_candidates(rng, s):
    return Candidates(
        member_predictions=rng.random((5, s)),
        cost=rng.integers(1, 400, size=s).astype(float),
        weight=rng.uniform(0, 3, size=s),
        already=rng.integers(0, 4, size=s),
        unseen=rng.integers(0, 2, size=s),
        entropy=rng.random(s),
        true_value=rng.random(s),
    )


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), s=st.integers(1, 40), budget=st.floats(0, 20_000),
       chunk=st.integers(1, 3), eps=st.floats(0, 1))
def test_every_strategy_respects_budget_cap_and_chunks_and_repeats_for_a_seed(seed, s, budget, chunk, eps):
    rng = np.random.default_rng(seed)
    cands = _random_candidates(rng, s)
    for name in STRATEGIES:
        rules = request(budget, name, seed, chunk_size=chunk, max_per_state=8, eps_uniform=eps)
        alloc = allocate(cands, rules)
        assert np.dot(alloc.counts, cands.cost) <= budget + 1e-6, name
        assert alloc.estimated_tokens == pytest.approx(np.dot(alloc.counts, cands.cost))
        if name == "uniform_all":
            assert (alloc.counts <= rules.config.vine_k).all()
            # Fewer than K only where the budget left could not pay one more continuation.
            left = budget - np.dot(alloc.counts, cands.cost)
            assert not ((alloc.counts < rules.config.vine_k) & (cands.cost < left - 1e-6)).any()
        else:
            assert (alloc.counts % chunk == 0).all(), name
            assert (alloc.counts + cands.already_counts <= 8)[alloc.counts > 0].all(), name
        again = allocate(cands, rules)
        np.testing.assert_array_equal(alloc.counts, again.counts)
        assert (alloc.reason[alloc.counts > 0] != "").all()


def test_strategies_use_most_of_a_budget_when_states_are_plentiful():
    rng = np.random.default_rng(3)
    cands = Candidates(rng.random((5, 200)), cost=np.full(200, 10.0), weight=np.ones(200), entropy=rng.random(200))
    for name in set(STRATEGIES) - {"oracle"}:
        alloc = allocate(cands, request(1000, name))
        assert alloc.estimated_tokens >= 1000 - 10 * 9, name  # at most one chunk (or vine) left unspent


def test_ivr_prefers_the_state_whose_error_is_shared_by_many():
    """Three states move together in the ensemble, one moves alone with the same variance: IVR
    picks the correlated group (observing it teaches the critic about all three)."""
    base = np.array([0.1, -0.1, 0.05, -0.05, 0.0])
    lone = np.array([0.0, 0.1, -0.1, 0.05, -0.05])
    members = 0.5 + np.stack([base, base, base, lone], axis=1)
    cands = Candidates(members, cost=np.ones(4), weight=np.ones(4))
    alloc = allocate(cands, request(2, eps_uniform=0.0))
    assert alloc.picks[0] in (0, 1, 2)
    eer = allocate(cands, request(2, "eer_diag", eps_uniform=0.0))
    assert eer.score[3] == pytest.approx(eer.score[0])  # a diagonal rule cannot tell them apart


def test_oracle_needs_true_values_and_goes_to_the_wrong_state():
    members = np.array([[0.5, 0.5, 0.5], [0.5, 0.5, 0.52]])
    with pytest.raises(ValueError, match="true_value"):
        allocate(Candidates(members, cost=np.ones(3), weight=np.ones(3)), request(2, "oracle"))
    cands = Candidates(members, cost=np.ones(3), weight=np.ones(3), true_value=np.array([0.5, 0.9, 0.5]))
    assert allocate(cands, request(2, "oracle")).picks == [1]


def test_unknown_strategy_and_bad_rules_are_clear_errors():
    with pytest.raises(ValueError, match="ivr_greedy"):
        AcquisitionConfig(strategy="thompson")
    with pytest.raises(ValueError, match="chunk_size"):
        AcquisitionConfig(chunk_size=4, max_per_state=2)
    with pytest.raises(ValueError, match="benchmark_only"):
        AcquisitionConfig(strategy="oracle")
    with pytest.raises(ValueError, match="budget_tokens"):
        Request(budget_tokens=-1)
    with pytest.raises(ValueError, match="one entry per state"):
        Candidates(np.zeros((3, 4)), cost=np.ones(3), weight=np.ones(4))


def test_entropy_branches_where_the_policy_is_least_decided():
    members = np.full((2, 4), 0.5)
    cands = Candidates(members, cost=np.ones(4), weight=np.ones(4), entropy=np.array([0.1, 2.0, 0.5, 1.0]))
    alloc = allocate(cands, request(4, "entropy", chunk_size=2, max_per_state=8))
    np.testing.assert_array_equal(alloc.counts, [0, 2, 0, 2])  # the two highest entropies, one chunk each
    more = allocate(cands, request(12, "entropy", chunk_size=2, max_per_state=4))
    capped = allocate(cands, request(100, "entropy", chunk_size=2, max_per_state=4))
    np.testing.assert_array_equal(capped.counts, [4, 4, 4, 4])
    np.testing.assert_array_equal(more.counts, [2, 4, 2, 4])  # passes in entropy order: the second reaches 1, 3
    with pytest.raises(ValueError, match="needs Candidates.entropy"):
        allocate(Candidates(members, cost=np.ones(4), weight=np.ones(4)), request(4, "entropy"))


def test_returns_a_state_already_has_count_against_the_cap_and_the_gain():
    members = np.array([[0.2, 0.2], [0.8, 0.8]])  # two identical states
    fresh = Candidates(members, cost=np.ones(2), weight=np.ones(2))
    known = Candidates(members, cost=np.ones(2), weight=np.ones(2), already=np.array([6, 0]))
    # eer_diag: the state with 6 returns gains less from 2 more, so the first pick goes to the other.
    assert allocate(known, request(2, "eer_diag", eps_uniform=0.0, chunk_size=2)).counts.tolist() == [0, 2]
    # The cap counts them: 6 + 2 = 8 is the most state 0 may reach.
    capped = allocate(known, request(100, "uniform_random", chunk_size=2, max_per_state=8))
    assert capped.counts[0] <= 2 and capped.counts[1] <= 8
    assert allocate(fresh, request(100, "uniform_random", chunk_size=2, max_per_state=8)).counts.tolist() == [8, 8]


def test_ivr_conditions_on_returns_the_critic_has_not_seen():
    rng = np.random.default_rng(1)
    members = rng.random((5, 6))
    plain = Candidates(members, cost=np.ones(6), weight=np.ones(6))
    seen_first = Candidates(members, cost=np.ones(6), weight=np.ones(6), unseen=np.array([50, 0, 0, 0, 0, 0]))
    first_plain = allocate(plain, request(2, "ivr_greedy", eps_uniform=0.0, chunk_size=2)).picks[0]
    scores = allocate(seen_first, request(2, "ivr_greedy", eps_uniform=0.0, chunk_size=2)).score
    assert scores[0] < allocate(plain, request(2, "ivr_greedy", eps_uniform=0.0, chunk_size=2)).score[0]
    assert first_plain in range(6) and np.isfinite(scores).all()
