"""Acquisition: worked examples T6-T9, the budget contract of every strategy, IVR exactness."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from focus_core.acquisition import (
    STRATEGIES,
    Candidates,
    IntegratedVariance,
    Observations,
    Request,
    advantage_sensitivity,
    allocate,
    beta_posterior,
    calibrated_variance,
    combine_estimates,
    expected_error_reduction,
    knn_residual_error,
    spearman,
)
from focus_core.config import AcquisitionConfig
from focus_core.critic import ensemble_covariance

T9_MEMBERS = np.array([[0.2, 0.5, 0.9], [0.4, 0.5, 0.7], [0.3, 0.6, 0.8], [0.5, 0.4, 0.6]])
T9_COST = np.array([1000.0, 600.0, 300.0])


def test_t6_sensitivity_weights():
    k = np.arange(4)
    np.testing.assert_allclose(advantage_sensitivity(k, gamma=1.0, lam=0.5), [1, 1.25, 1.3125, 1.328125])
    np.testing.assert_allclose(advantage_sensitivity(k, gamma=1.0, lam=0.0), [1, 2, 2, 2])
    np.testing.assert_allclose(advantage_sensitivity(k, gamma=1.0, lam=1.0), [1, 1, 1, 1])


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


def test_calibrated_variance_worked_example():
    # Returns at three of four states: squared errors 0.25, 0.64, 0.64 (mean 0.51), the returns' own noise
    # μ(1−μ)/n = 0.0625, 0.04, 0.04 (mean 0.0475), so τ̂² = 0.4625 against a mean ensemble variance of 0.04/3.
    mean, var = np.array([0.5, 0.2, 0.8, 0.4]), np.array([0.01, 0.01, 0.02, 0.01])
    scaled, scale = calibrated_variance(mean, var, np.array([1.0, 1.0, 0.0, np.nan]), np.array([4, 4, 4, 0]))
    assert scale == pytest.approx(0.4625 / (0.04 / 3))
    np.testing.assert_allclose(scaled, var * scale)
    # A spread that already covers the error, or no returns at all, is left as it is.
    assert calibrated_variance(mean, var * 100, np.array([1.0, 1.0, 0.0, np.nan]), np.array([4, 4, 4, 0]))[1] == 1.0
    assert calibrated_variance(mean, var, np.full(4, np.nan), np.zeros(4))[1] == 1.0


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.2, 0.4))
def test_calibrated_variance_lets_returns_correct_an_overconfident_critic(seed, bias_sd):
    """A critic off by N(0, bias_sd²) that believes its error is 0.005 (8-30x too small; the traps' critic errs by
    0.27 on average): with the calibrated variance the combined value is closer to the truth than with the
    ensemble's, and the scale is never below 1."""
    rng = np.random.default_rng(seed)
    truth = rng.uniform(0.0, 1.0, 2000)
    critic = np.clip(truth + rng.normal(0.0, bias_sd, truth.size), 0.0, 1.0)
    n = rng.integers(0, 6, truth.size).astype(float)
    mc = np.where(n > 0, rng.binomial(n.astype(int), truth) / np.maximum(n, 1), np.nan)
    spread = np.full(truth.size, 0.005)
    scaled, scale = calibrated_variance(critic, spread, mc, n)
    assert scale >= 1.0
    before = np.mean((combine_estimates(critic, spread, mc, n)[0] - truth) ** 2)
    after = np.mean((combine_estimates(critic, scaled, mc, n)[0] - truth) ** 2)
    assert after < before


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


def _random_candidates(rng, s, observed_elsewhere=False):
    """Every field any strategy reads; with ``observed_elsewhere`` the error-predicting rules learn from a separate
    set of observed states that holds some of the candidates (as in the benchmark), else from the candidates."""
    count = rng.integers(0, 4, size=s)
    features = rng.random((s, 3))
    extra = {}
    if observed_elsewhere:
        r = int(rng.integers(0, 2 * s + 1))
        obs_count = rng.integers(0, 4, size=r).astype(float)
        observations = Observations(rng.random((r, 3)), rng.binomial(obs_count.astype(int), 0.5).astype(float),
                                    obs_count, rng.random(r), rng.random(r) if rng.random() < 0.5 else None)
        extra = {"observations": observations,
                 "observation_row": np.where(rng.random(s) < 0.5, rng.integers(0, max(r, 1), size=s), -1)
                 if r else np.full(s, -1)}
    return Candidates(
        member_predictions=rng.random((5, s)),
        cost=rng.integers(1, 400, size=s).astype(float),
        weight=rng.uniform(0, 3, size=s),
        already=rng.integers(0, 4, size=s),
        unseen=rng.integers(0, 2, size=s),
        entropy=rng.random(s),
        true_value=rng.random(s),
        features=features,
        return_sum=rng.binomial(count, 0.4).astype(float),
        return_count=count.astype(float),
        oof_mean=rng.random(s),
        **extra,
    )


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), s=st.integers(1, 40), budget=st.floats(0, 20_000),
       chunk=st.integers(1, 3), eps=st.floats(0, 1), observed_elsewhere=st.booleans())
def test_every_strategy_respects_budget_cap_and_chunks_and_repeats_for_a_seed(seed, s, budget, chunk, eps,
                                                                              observed_elsewhere):
    rng = np.random.default_rng(seed)
    cands = _random_candidates(rng, s, observed_elsewhere)
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
    count = rng.integers(1, 3, size=200).astype(float)
    cands = Candidates(rng.random((5, 200)), cost=np.full(200, 10.0), weight=np.ones(200), entropy=rng.random(200),
                       features=rng.random((200, 4)), return_sum=rng.binomial(count.astype(int), 0.5).astype(float),
                       return_count=count)
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


# --- the error-predicting rules: each prefers the state whose error is planted --------------------------------


def _two_clusters(n=6):
    """n states near (0, 0) and n near (5, 5) in feature space, every critic member saying 0.5 with a little spread."""
    rng = np.random.default_rng(0)
    features = np.concatenate([rng.normal(0, 0.1, (n, 2)), rng.normal(5, 0.1, (n, 2))])
    members = 0.5 + rng.normal(0, 0.01, (5, 2 * n))
    return features, members


def test_residual_knn_finds_the_cluster_whose_returns_contradict_the_critic():
    """Cluster A's 4 returns per state are all 0 (V = 0 there, the critic says 0.5: a planted bias); cluster B's are
    half 1 (the critic is right). The neighbours' returns, each state's own left out, find A; the ensemble's
    spread is the same everywhere."""
    features, members = _two_clusters()
    count = np.full(12, 4.0)
    successes = np.r_[np.zeros(6), np.full(6, 2.0)]
    cands = Candidates(members, cost=np.ones(12), weight=np.ones(12), features=features, return_sum=successes,
                       return_count=count, oof_mean=np.full(12, 0.5))
    error_sq, se2, p = knn_residual_error(cands, 4)
    # In A the 4 nearest other states returned 16 zeros: V̂₋ₛ = 0, ê = μ ≈ 0.5, p = (0 + μ)/(16 + 1) and
    # se² = p(1 − p)/16; in B, V̂₋ₛ = 8/16 and p = (8 + μ)/17.
    mu = cands.mean
    np.testing.assert_allclose(error_sq, np.r_[mu[:6] ** 2, (mu[6:] - 0.5) ** 2])
    np.testing.assert_allclose(p, np.r_[mu[:6] / 17, (8 + mu[6:]) / 17])
    np.testing.assert_allclose(se2, p * (1 - p) / 16)  # zeros that agree: little noise in A
    assert (np.maximum(error_sq[6:] - se2[6:], 0) == 0).all()  # B: |ê| ≈ 0.005 is well inside its se
    # Cross-fitted: a state's own returns (which the critic partly memorised) never enter its own estimate.
    flipped = Candidates(members, cost=np.ones(12), weight=np.ones(12), features=features,
                         return_sum=np.r_[4.0, successes[1:]], return_count=count)
    np.testing.assert_allclose(knn_residual_error(flipped, 4)[0][0], error_sq[0])
    alloc = allocate(cands, request(8, "residual_knn", eps_uniform=0.0, chunk_size=2))
    assert all(state < 6 for state in alloc.picks)
    assert alloc.score[:6].min() > alloc.score[6:].max()


def test_residual_knn_uses_observed_states_beyond_the_candidates():
    """The candidates have no returns of their own; observed neighbours near candidate 0 all returned 0."""
    features, members = _two_clusters(3)
    observations = Observations(features + 0.01, np.r_[np.zeros(3), np.full(3, 1.0)], np.full(6, 2.0),
                                critic_mean=np.full(6, 0.5), oof_mean=np.full(6, 0.5))
    cands = Candidates(members[:, [0, 3]], cost=np.ones(2), weight=np.ones(2), features=features[[0, 3]],
                       observations=observations, observation_row=np.array([-1, -1]))
    alloc = allocate(cands, request(2, "residual_knn", eps_uniform=0.0, chunk_size=2, neighbours=3))
    assert alloc.picks == [0]


def test_beta_posterior_worked_example():
    """μ = 0.3, κ = 4, two zeros: Beta(1.2, 4.8), mean 1.2/6 = 0.2, variance 0.2·0.8/7 = 0.022857."""
    mean, var = beta_posterior(np.array([0.3, 0.3, 0.5]), 4.0, np.array([0.0, 2.0, 3.0]), np.array([2.0, 2.0, 6.0]))
    np.testing.assert_allclose(mean, [0.2, (1.2 + 2) / 6, (2 + 3) / 10])
    np.testing.assert_allclose(var, [0.2 * 0.8 / 7, (3.2 / 6) * (2.8 / 6) / 7, 0.25 / 11])
    prior_mean, prior_var = beta_posterior(np.array([0.3]), 4.0, np.zeros(1), np.zeros(1))
    assert (prior_mean[0], prior_var[0]) == (pytest.approx(0.3), pytest.approx(0.042))


def test_beta_posterior_prefers_the_state_whose_returns_contradict_the_critic():
    """Both states: critic 0.5 and 6 returns. State 0's are all 0 (a doomed state the critic missed), state 1's
    are 3 of 6 (the critic is right): the posterior puts the error at state 0."""
    members = np.array([[0.49, 0.49], [0.51, 0.51]])
    cands = Candidates(members, cost=np.ones(2), weight=np.ones(2), return_sum=np.array([0.0, 3.0]),
                       return_count=np.array([6.0, 6.0]), oof_mean=np.array([0.5, 0.5]))
    alloc = allocate(cands, request(2, "beta_posterior", eps_uniform=0.0, chunk_size=2))
    assert alloc.picks == [0] and alloc.score[0] > alloc.score[1]


def test_novelty_prefers_the_state_far_from_every_observed_return():
    features, members = _two_clusters()
    lone = np.r_[features[:6], [[20.0, -20.0]]]  # six states observed together, one far away
    cands = Candidates(members[:, :7], cost=np.ones(7), weight=np.ones(7), features=lone,
                       return_sum=np.ones(7), return_count=np.full(7, 2.0))
    alloc = allocate(cands, request(2, "novelty", eps_uniform=0.0, chunk_size=2))
    assert alloc.picks == [6] and np.argmax(alloc.score) == 6
    # Once it has continuations its density rises: the next chunks go to the crowd's (now rarer) states too.
    more = allocate(cands, request(8, "novelty", eps_uniform=0.0, chunk_size=2))
    assert more.counts[6] >= 2 and more.counts[:6].sum() >= 2


def test_error_rules_need_their_inputs():
    members = np.full((2, 3), 0.5)
    bare = Candidates(members, cost=np.ones(3), weight=np.ones(3))
    for name, field in (("residual_knn", "features"), ("beta_posterior", "return_sum"), ("novelty", "features")):
        with pytest.raises(ValueError, match=f"{name}.*{field}|{field}"):
            allocate(bare, request(2, name))
    with pytest.raises(ValueError, match="observation_row"):
        Candidates(members, cost=np.ones(3), weight=np.ones(3),
                   observations=Observations(np.zeros((2, 1)), np.zeros(2), np.ones(2), np.full(2, 0.5)))


def test_spearman_worked_examples():
    assert spearman(np.array([1, 2, 3, 4]), np.array([10, 20, 40, 30])) == pytest.approx(0.8)
    # ties get their average rank: ranks (0.5, 0.5, 2, 3) against (0, 1, 2, 3) -> 4.5 / sqrt(4.5 * 5)
    assert spearman(np.array([1, 1, 2, 3]), np.array([1, 2, 3, 4])) == pytest.approx(4.5 / np.sqrt(22.5))
    assert np.isnan(spearman(np.ones(5), np.arange(5)))  # a uniform rule ranks nothing
    assert spearman(np.array([np.nan, 1, 2, 3]), np.array([5, 1, 2, 3])) == pytest.approx(1.0)


# --- the pipeline's figure of whether branching paid ---------------------------------------------------------


def test_fit_critic_reports_the_critic_error_before_and_its_rank_correlation_with_the_score(tmp_path):
    """Round 1's plan scored states a, b, c (critic 0.5, 0.5, 0.9) and branched all three; their continuations
    returned means 0.0, 0.5 and 0.5 (a cut-off continuation of b is not a return). Errors before: 0.5, 0, 0.4, so
    critic_error_before = 0.3; scores 3, 1, 2 rank them exactly as the errors: Spearman 1."""
    import pyarrow as pa

    from focus_core.artifacts import ArtifactStore
    from focus_core.config import load_config
    from focus_core.schemas import schema_for
    from tasks.fit_critic import acquisition_check
    from tasks.stage import RunContext

    store, run = ArtifactStore(tmp_path / "store"), "r"
    base = {"run_id": run, "iteration": 0, "policy_version": 0}
    plan = [{**base, "episode_id": "e", "segment_idx": 1, "state_id": s, "round": 1, "critic_mean": m,
             "critic_std": 0.1, "cost_estimate": 10.0, "score": score, "continuations": 2, "reason": "x"}
            for s, m, score in (("a", 0.5, 3.0), ("b", 0.5, 1.0), ("c", 0.9, 2.0), ("d", 0.2, 9.0))]
    store.commit(run, 0, "acquire_r1", version="v",
                 tables={"acquisition": pa.Table.from_pylist(plan, schema=schema_for("acquisition"))})
    returns = [("a", 0.0, False), ("a", 0.0, False), ("b", 1.0, False), ("b", 0.0, False), ("b", 1.0, True),
               ("c", 1.0, False), ("c", 0.0, False)]
    branches = [{**base, "episode_id": f"x{i}", "segment_idx": 1, "state_id": s, "branch_id": f"x{i}", "round": 1,
                 "return": g, "generated_tokens": 5, "truncated": False} for i, (s, g, _) in enumerate(returns)]
    episodes = [{**base, "episode_id": f"x{i}", "branch_id": f"x{i}", "task_id": "t", "split": "train",
                 "group_id": "g", "reward": g, "n_turns": 2, "n_segments": 1, "generated_tokens": 5, "is_branch": True,
                 "parent_state_id": s, "truncated": False, "budget_cut": cut} for i, (s, g, cut) in enumerate(returns)]
    grown = store.commit(run, 0, "branch_r1", version="v", tables={
        "branches": pa.Table.from_pylist(branches, schema=schema_for("branches")),
        "episodes": pa.Table.from_pylist(episodes, schema=schema_for("episodes"))})
    ctx = RunContext(store, run, load_config(None, []), tokens_per_iteration=1000)
    figures = acquisition_check(ctx, 0, 1, [grown])
    assert figures["critic_error_before"] == pytest.approx(0.3)
    assert figures["critic_error_before_states"] == 3
    assert figures["score_error_spearman"] == pytest.approx(1.0)
    assert acquisition_check(ctx, 0, 1, []) == {}  # nothing branched: no figures

    # MLflow logs every numeric stage figure as {stage}.{figure}.
    from dataclasses import replace

    from flows.tracking import _stage_metrics

    fit = replace(grown, stage="fit_critic_r1", figures=figures)
    metrics = _stage_metrics("fit_critic_r1", fit)
    assert metrics["fit_critic_r1.critic_error_before"] == pytest.approx(0.3)
    assert metrics["fit_critic_r1.score_error_spearman"] == pytest.approx(1.0)


def test_out_of_bag_mean_uses_the_members_that_never_saw_a_states_returns():
    from focus_core.config import CriticConfig
    from focus_core.critic import EnsembleCritic, out_of_bag_mean

    members = np.array([[0.2, 0.4], [0.6, 0.8], [0.1, 0.3]])
    weight = np.array([[0.0, 1.0], [1.0, 1.0], [0.0, 2.0]])
    # State 0: members 0 and 2 gave its returns weight 0 -> (0.2 + 0.1)/2; state 1: all saw it -> the mean.
    np.testing.assert_allclose(out_of_bag_mean(members, weight), [0.15, 0.5])
    critic = EnsembleCritic(CriticConfig(members=4, hidden=4, steps=2), n_features=3)
    critic.fit(np.random.default_rng(0).random((5, 3)), np.array([1.0, 0, 2, 0, 0]), np.array([1.0, 1, 3, 0, 2]))
    assert critic.bootstrap_weight.shape == (4, 5) and (critic.bootstrap_weight[:, 3] == 0).all()
