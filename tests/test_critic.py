"""Ensemble critic: it learns values from (successes, trials), its members disagree where data is
thin, it is deterministic for a seed, and checkpoints round-trip without pickles."""

import numpy as np
import pytest

from focus_core.config import CriticConfig
from focus_core.critic import CONFIG_FILE, WEIGHTS_FILE, EnsembleCritic, ensemble_covariance


def _data(seed=0, states=600, features=8):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(states, features)).astype(np.float32)
    true_value = 1 / (1 + np.exp(-(1.5 * x[:, 0] - x[:, 1])))
    trials = rng.integers(1, 9, size=states)
    successes = rng.binomial(trials, true_value)
    return x, successes, trials, true_value


CONFIG = CriticConfig(members=5, hidden=32, steps=300, batch_size=256, lr=1e-2)


def make_critic(config=CONFIG):
    return EnsembleCritic(config, n_features=8)


def test_fit_learns_values_far_better_than_a_constant():
    x, y, n, truth = _data()
    critic = make_critic()
    report = critic.fit(x, y, n)
    mean, var = critic.predict(x)
    constant_mse = np.mean((truth - (y.sum() / n.sum())) ** 2)
    assert np.mean((mean - truth) ** 2) < 0.2 * constant_mse
    assert report.states == 600 and report.trials == n.sum()
    assert (var > 0).all() and ((mean > 0) & (mean < 1)).all()


def test_members_disagree_less_as_data_grows():
    """Epistemic variance is what acquisition spends on: it must shrink with more data."""
    x, y, n, _ = _data(states=2400)
    held_out = x[2000:]
    variances = []
    for size in (40, 2000):
        critic = make_critic()
        critic.fit(x[:size], y[:size], n[:size])
        variances.append(np.mean(critic.predict(held_out)[1]))
    assert variances[1] < 0.5 * variances[0]


def test_fit_is_deterministic_for_a_seed_and_differs_across_seeds():
    x, y, n, _ = _data()
    a, b = make_critic(), make_critic()
    a.fit(x, y, n)
    b.fit(x, y, n)
    np.testing.assert_array_equal(a.predict_members(x), b.predict_members(x))
    c = make_critic(CONFIG.model_copy(update={"seed": 1}))
    c.fit(x, y, n)
    assert not np.allclose(a.predict_members(x), c.predict_members(x))


def test_states_without_trials_are_ignored():
    """Zero-trial states change nothing: not the feature scaling, not the bootstrap draws, not the fit."""
    x, y, n, _ = _data(states=100)
    n_masked, y_masked = n.copy(), y.copy()
    n_masked[:30], y_masked[:30] = 0, 0
    x_masked = x.copy()
    x_masked[:30] = 1e3  # far-off features: they would move the scaling if zero-trial states were seen
    a, b = make_critic(), make_critic()
    a.fit(x[30:], y[30:], n[30:])
    report = b.fit(x_masked, y_masked, n_masked)
    assert report.states == 70 and report.trials == n[30:].sum()
    np.testing.assert_array_equal(a.predict_members(x[30:]), b.predict_members(x[30:]))


def test_covariance_matches_numpy_and_has_jitter():
    x, y, n, _ = _data(states=50)
    critic = make_critic()
    critic.fit(x, y, n)
    members = critic.predict_members(x[:7])
    expected = np.cov(members.T, ddof=1) + 1e-3 * np.eye(7)
    np.testing.assert_allclose(critic.covariance(x[:7], jitter=1e-3), expected)
    np.testing.assert_allclose(ensemble_covariance(members, jitter=0.0).diagonal(), members.var(0, ddof=1))


def test_save_load_round_trip(tmp_path):
    x, y, n, _ = _data(states=80)
    critic = make_critic()
    critic.fit(x, y, n)
    critic.save(tmp_path / "critic")
    assert {p.name for p in (tmp_path / "critic").iterdir()} == {CONFIG_FILE, WEIGHTS_FILE}
    loaded = EnsembleCritic.load(tmp_path / "critic")
    np.testing.assert_array_equal(loaded.predict_members(x), critic.predict_members(x))
    assert loaded.config == critic.config and loaded.n_features == 8


def test_warm_start_continues_from_the_loaded_weights(tmp_path):
    x, y, n, _ = _data(states=80)
    critic = make_critic()
    critic.fit(x, y, n)
    critic.save(tmp_path / "critic")
    one_step = CONFIG.model_copy(update={"steps": 1})
    warm = EnsembleCritic.load(tmp_path / "critic")
    warm.config = one_step
    warm.fit(x[:40], y[:40], n[:40], warm_start=True)
    cold = EnsembleCritic.load(tmp_path / "critic")
    cold.config = one_step
    cold.fit(x[:40], y[:40], n[:40])  # without warm_start: re-initialised, one step from scratch
    before = critic.predict_members(x)
    # One step from the loaded weights stays close to them; one step from a fresh init does not.
    assert np.abs(warm.predict_members(x) - before).mean() < 0.05
    assert np.abs(cold.predict_members(x) - before).mean() > 3 * np.abs(warm.predict_members(x) - before).mean()
    # The feature scaling of the first fit is kept (inputs stay on the scale the heads were trained on).
    np.testing.assert_array_equal(warm.feature_mean.numpy(), critic.feature_mean.numpy())


def test_bad_input_is_a_clear_error(tmp_path):
    critic = make_critic()
    with pytest.raises(ValueError, match=r"features of shape \[states, 8\]"):
        critic.predict(np.zeros((3, 5)))
    with pytest.raises(ValueError, match="successes <= trials"):
        critic.fit(np.zeros((2, 8)), np.array([3, 0]), np.array([1, 1]))
    with pytest.raises(ValueError, match="no state with trials > 0"):
        critic.fit(np.zeros((2, 8)), np.zeros(2), np.zeros(2))
    with pytest.raises(FileNotFoundError, match="no critic checkpoint"):
        EnsembleCritic.load(tmp_path / "missing")
    with pytest.raises(ValueError, match="members"):
        CriticConfig(members=1)


def test_regression_few_distinct_states_with_many_returns_are_fitted_by_every_member():
    """Regression: bootstrapping *states* dropped ~37% of a handful of states from each member, which
    then extrapolated them, so more data made the error grow. Bootstrapping returns keeps every
    state in every member: with 16 well-sampled states the members agree with each other, and the
    ensemble is far closer to the Monte-Carlo means than a constant is."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    truth = rng.uniform(0.1, 0.9, size=16)
    trials = np.full(16, 40)
    successes = rng.binomial(trials, truth)
    critic = make_critic(CONFIG.model_copy(update={"steps": 400}))
    critic.fit(x, successes, trials)
    members = critic.predict_members(x)
    mc_mean = successes / trials
    # ≈ the bootstrap spread of a 40-return mean (≤ 0.08); dropped states would push it well above 0.1
    assert members.std(axis=0, ddof=1).mean() < 0.09
    assert np.mean((members.mean(0) - mc_mean) ** 2) < 0.5 * np.mean((mc_mean - mc_mean.mean()) ** 2)


def test_regression_one_return_states_are_not_memorised_into_worse_than_a_constant():
    """Regression: without a weight prior the critic memorised one-return labels through
    identifier-like features and ended worse than predicting the mean return (measured: 1.5 × the
    constant's error with prior_precision=0, 0.27 × with the default prior)."""
    rng = np.random.default_rng(1)
    states = 300
    signal = rng.normal(size=(states, 2))
    identifiers = rng.normal(size=(states, 30)) * (rng.random((states, 30)) < 0.1) * 5  # rare, state-specific
    x = np.concatenate([signal, identifiers], axis=1).astype(np.float32)
    truth = 1 / (1 + np.exp(-1.5 * signal[:, 0]))
    successes = rng.binomial(1, truth)
    critic = EnsembleCritic(CriticConfig(hidden=64, steps=1000, lr=1e-2), n_features=x.shape[1])
    critic.fit(x, successes, np.ones(states))
    mean, _ = critic.predict(x)
    constant_mse = np.mean((truth - successes.mean()) ** 2)
    assert np.mean((mean - truth) ** 2) < 0.6 * constant_mse


# --- randomised prior functions (focus_core.critic.PriorFunctionCritic, the critic-budget experiment) -------------


def test_prior_functions_of_scale_zero_leave_the_ensemble_as_it_is():
    """The subclass adds the prior and nothing else: at scale 0 it is the plain ensemble, draw for draw."""
    from focus_core.critic import PriorFunctionCritic

    x, y, n, _ = _data()
    plain, prior = make_critic(), PriorFunctionCritic(CONFIG, 8, prior_scale=0.0)
    plain.fit(x, y, n)
    prior.fit(x, y, n)
    np.testing.assert_array_equal(plain.predict_members(x), prior.predict_members(x))


def test_prior_functions_keep_members_apart_away_from_the_data():
    """Trained where the data are (x₀ ∈ [−1, 1]), the members agree there; far from them (x₀ = 6) the plain heads
    still share one extrapolation, while each prior-function member keeps its own prior: larger spread."""
    from focus_core.critic import PriorFunctionCritic

    rng = np.random.default_rng(3)
    x = np.zeros((400, 8), dtype=np.float32)
    x[:, 0] = rng.uniform(-1, 1, 400)
    trials = np.full(400, 8)
    successes = rng.binomial(trials, 0.3)
    far = np.zeros((50, 8), dtype=np.float32)
    far[:, 0] = 6.0
    far[:, 1:] = rng.normal(size=(50, 7)) * 3
    plain, prior = make_critic(), PriorFunctionCritic(CONFIG, 8, prior_scale=1.0)
    plain.fit(x, successes, trials)
    prior.fit(x, successes, trials)
    _, near_var = prior.predict(x)
    _, far_var = prior.predict(far)
    _, plain_far_var = plain.predict(far)
    assert far_var.mean() > 4 * near_var.mean()
    assert far_var.mean() > 2 * plain_far_var.mean()
    assert abs(prior.predict(x)[0].mean() - 0.3) < 0.05  # the heads learn to cancel their priors on the data


def test_prior_function_critic_round_trips_and_a_plain_checkpoint_is_refused(tmp_path):
    from focus_core.critic import PriorFunctionCritic

    x, y, n, _ = _data()
    critic = PriorFunctionCritic(CONFIG, 8, prior_scale=1.5)
    critic.fit(x, y, n)
    loaded = PriorFunctionCritic.load(critic.save(tmp_path / "prior"))
    assert loaded.prior_scale == 1.5
    np.testing.assert_allclose(loaded.predict_members(x), critic.predict_members(x), rtol=0, atol=1e-7)
    plain = make_critic()
    plain.fit(x, y, n)
    with pytest.raises(FileNotFoundError, match="plain EnsembleCritic"):
        PriorFunctionCritic.load(plain.save(tmp_path / "plain"))
    with pytest.raises(ValueError, match="prior_scale must be >= 0"):
        PriorFunctionCritic(CONFIG, 8, prior_scale=-1.0)
