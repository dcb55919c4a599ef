"""Trap environments: exact values against Monte Carlo, MDP invariants, episodes, segments, text protocol."""

from __future__ import annotations

import functools
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from focus_core.envs import make_trap_env, trap_env_names
from focus_core.envs.traps import (
    READ,
    CombinationLock,
    ExactValueEnv,
    LockState,
    LookupChain,
    LookupState,
    TabularPolicy,
    TextSession,
)

ENV_CONFIGS = [
    ("combination_lock", {}),
    ("combination_lock", {"horizon": 6, "n_symbols": 2, "delay": 0, "seed": 4}),
    ("lookup_chain", {}),
    ("lookup_chain", {"hops": 2, "turn_budget": 6, "noise": 0.0, "seed": 5}),
    ("lookup_chain", {"hops": 5, "noise": 0.3, "seed": 6}),
]
CONFIG_IDS = [f"{name}-{i}" for i, (name, _) in enumerate(ENV_CONFIGS)]


def reachable_states(env: ExactValueEnv, limit: int = 5000) -> list:
    """Breadth-first over all actions and outcomes from the initial state, at most ``limit`` states."""
    seen = {env.initial_state()}
    queue = deque(seen)
    while queue and len(seen) < limit:
        state = queue.popleft()
        if env.is_terminal(state):
            continue
        for action_index in range(len(env.action_menu(state))):
            for _, next_state, _, _ in env.transitions(state, action_index):
                if next_state not in seen:
                    seen.add(next_state)
                    queue.append(next_state)
    return list(seen)


def monte_carlo_value(env, policy, start, episodes: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    returns = [env.sample_episode(policy, rng, start=start).episode_return for _ in range(episodes)]
    return float(np.mean(returns))


def optimal_action(env: ExactValueEnv, state) -> int:
    """The action with the highest optimal value (expectimax), for scripted play in tests."""

    @functools.cache
    def best_value(state) -> float:
        return 0.0 if env.is_terminal(state) else max(action_value(state, a) for a in range(menu_size(state)))

    def action_value(state, action_index: int) -> float:
        return sum(p * (reward + (0.0 if done else best_value(next_state)))
                   for p, next_state, reward, done in env.transitions(state, action_index))

    def menu_size(state) -> int:
        return len(env.action_menu(state))

    return max(range(menu_size(state)), key=lambda a: action_value(state, a))


@pytest.fixture(params=ENV_CONFIGS, ids=CONFIG_IDS)
def env(request) -> ExactValueEnv:
    name, kwargs = request.param
    return make_trap_env(name, **kwargs)


# --------------------------------------------------------------------------------------------- MDP invariants


def test_transitions_are_distributions_with_sparse_terminal_rewards(env):
    for state in reachable_states(env):
        if env.is_terminal(state):
            assert env.action_menu(state) == []
            continue
        for action_index in range(len(env.action_menu(state))):
            outcomes = env.transitions(state, action_index)
            assert sum(p for p, *_ in outcomes) == pytest.approx(1.0, abs=1e-12)
            for p, next_state, reward, done in outcomes:
                assert 0.0 < p <= 1.0
                assert env.turn(next_state) == env.turn(state) + 1 <= env.horizon
                assert done == env.is_terminal(next_state)
                assert reward in (0.0, 1.0)
                assert reward == 0.0 or done


def test_observations_are_short_and_menus_small(env):
    for state in reachable_states(env):
        assert 0 < len(env.observation(state)) < 300
        menu = env.action_menu(state)
        if env.is_terminal(state):
            continue
        assert 2 <= len(menu) <= 6
        assert len(set(menu)) == len(menu)
        for action_index, action in enumerate(menu):
            assert env.action_tokens(state, action_index) == len(action.split()) >= 1


@pytest.mark.parametrize("seed", range(12))
def test_longest_lookup_observations_stay_under_300_characters(seed):
    env = LookupChain(hops=5, turn_budget=20, seed=seed)
    assert max(len(env.observation(state)) for state in reachable_states(env)) < 300


def test_values_lie_in_unit_interval_and_follow_from_the_observation(env):
    """What determines V must be visible in the text: equal observations have equal values."""
    states = reachable_states(env)
    for policy in (env.default_policy(0), TabularPolicy.uniform(env)):
        values = env.exact_values(policy, states)
        assert np.all((values >= 0.0) & (values <= 1.0))
        value_of_observation = {}
        for state, value in zip(states, values, strict=True):
            seen = value_of_observation.setdefault(env.observation(state), value)
            assert seen == pytest.approx(value, abs=1e-12)


def test_known_value_shortcuts_agree_with_full_dynamic_programming():
    for name, kwargs in [("combination_lock", {"horizon": 6, "delay": 2, "seed": 1}),
                         ("combination_lock", {"horizon": 5, "n_symbols": 4, "delay": 0, "seed": 2}),
                         ("lookup_chain", {}),
                         ("lookup_chain", {"hops": 3, "turn_budget": 9, "noise": 0.25, "seed": 3})]:
        with_shortcuts = make_trap_env(name, **kwargs)
        full_dp = make_trap_env(name, **kwargs)
        full_dp.known_value = lambda state: None
        states = reachable_states(full_dp, limit=20_000)
        for policy_seed in (0, 1):
            expected = full_dp.exact_values(full_dp.default_policy(policy_seed), states)
            got = with_shortcuts.exact_values(with_shortcuts.default_policy(policy_seed), states)
            np.testing.assert_allclose(got, expected, atol=1e-12)


# ----------------------------------------------------------------------------------- exact values vs sampling


def _monte_carlo_cases():
    lock = CombinationLock()
    doomed = LockState((*lock.combination[:3], (lock.combination[3] + 1) % 3), doomed_turns_left=2)
    chain = LookupChain()
    mid_chain = LookupState(hop=2, phase=READ, turn=5, poisoned=False, last="found")
    short_of_time = LookupState(hop=1, phase=READ, turn=8, poisoned=False, last="irrelevant")
    return [
        (lock, "default", [lock.initial_state(), lock.live_state(7), doomed]),
        (lock, "uniform", [lock.live_state(9), lock.live_state(11)]),
        (chain, "default", [chain.initial_state(), mid_chain, short_of_time]),
        (chain, "uniform", [chain.initial_state(), mid_chain]),
    ]


@pytest.mark.parametrize("case", range(4))
def test_exact_values_match_monte_carlo(case):
    env, policy_kind, starts = _monte_carlo_cases()[case]
    policy = env.default_policy(3) if policy_kind == "default" else TabularPolicy.uniform(env)
    episodes = 20_000
    for index, start in enumerate(starts):
        exact = float(env.exact_values(policy, [start])[0])
        estimate = monte_carlo_value(env, policy, start, episodes, seed=index)
        standard_error = np.sqrt(exact * (1.0 - exact) / episodes)
        assert abs(estimate - exact) <= 4.0 * standard_error + 1e-12, (start, exact, estimate)


def test_lock_values_doomed_zero_and_live_product_of_right_symbol_probabilities():
    lock = CombinationLock(horizon=10, n_symbols=4, delay=2, seed=7)
    for policy in (lock.default_policy(0), lock.default_policy(1), TabularPolicy.uniform(lock)):
        for dial in range(lock.horizon):
            expected = np.prod([policy.probabilities(lock.live_state(later))[lock.combination[later]]
                                for later in range(dial, lock.horizon)])
            assert lock.exact_values(policy, [lock.live_state(dial)])[0] == pytest.approx(expected, rel=1e-12)
        doomed = [state for state in reachable_states(lock, limit=3000)
                  if lock.is_doomed(state) and not lock.is_terminal(state)]
        assert doomed
        assert np.all(lock.exact_values(policy, doomed) == 0.0)


@pytest.mark.parametrize(("delay", "mistake_dial", "turns_after_mistake"), [(3, 2, 3), (3, 10, 1), (0, 4, 0)])
def test_lock_plays_on_for_delay_turns_after_a_mistake(delay, mistake_dial, turns_after_mistake):
    lock = CombinationLock(horizon=12, delay=delay, seed=5)
    def always_wrong_symbol(state):
        return np.eye(3)[(lock.combination[len(state.entered)] + 1) % 3]

    always_wrong = TabularPolicy(lock, always_wrong_symbol)
    episode = lock.sample_episode(always_wrong, np.random.default_rng(0), start=lock.live_state(mistake_dial))
    assert len(episode.actions) == 1 + turns_after_mistake
    assert episode.done and episode.episode_return == 0.0
    assert all(lock.is_doomed(state) for state in episode.states[1:])
    assert all(lock.observation(state).startswith("Lock: dial") for state in episode.states[:-1])
    assert lock.observation(episode.states[-1]).startswith("Lock: jammed")


def test_lookup_poisoned_states_are_worth_zero_and_the_trap_is_invisible_until_the_end():
    chain = LookupChain(seed=2)
    policy = chain.default_policy(0)
    poisoned = [state for state in reachable_states(chain) if state.poisoned and not chain.is_terminal(state)]
    assert poisoned
    assert np.all(chain.exact_values(policy, poisoned) == 0.0)
    # A poisoned chain is played like a clean one: its menus advance through the hops as usual.
    assert any(state.hop == chain.hops for state in poisoned)
    assert chain.poisoned_chain[2] in chain.observation(max(poisoned, key=lambda state: state.hop))


def test_default_policies_have_varied_non_degenerate_initial_values():
    for name in trap_env_names():
        values = []
        for env_seed in range(10):
            env = make_trap_env(name, seed=env_seed)
            policies = [env.default_policy(seed) for seed in range(4)]
            values += [env.exact_values(policy, [env.initial_state()])[0] for policy in policies]
        assert min(values) >= 0.1 and max(values) <= 0.6
        assert 0.15 <= np.median(values) <= 0.6
        assert np.std(values) > 0.02


def test_default_policies_have_a_few_critical_steps_and_many_easy_ones():
    lock = CombinationLock(seed=1)
    policy = lock.default_policy(0)
    p_right = np.array([policy.probabilities(lock.live_state(dial))[lock.combination[dial]]
                        for dial in range(lock.horizon)])
    assert np.sum(p_right <= 0.7) == 2
    assert np.sum(p_right >= 0.88) >= 8

    chain = LookupChain(seed=1)
    policy = chain.default_policy(0)
    at_delayed_trap = LookupState(hop=1, phase=READ, turn=3, poisoned=False, last="found")
    menu = chain.action_menu(at_delayed_trap)
    right_read = menu.index(f"read {chain.true_chain[1]} (town guide)")
    assert 0.45 <= policy.probabilities(at_delayed_trap)[right_read] <= 0.7


# ------------------------------------------------------------------------------------------------- episodes


@settings(max_examples=60, deadline=None)
@given(env_index=st.integers(0, len(ENV_CONFIGS) - 1), env_seed=st.integers(0, 50),
       policy_seed=st.integers(0, 50), rng_seed=st.integers(0, 2**32), segment_every=st.integers(1, 5),
       start_fraction=st.floats(0.0, 0.99), uniform=st.booleans())
def test_segments_partition_episodes(env_index, env_seed, policy_seed, rng_seed, segment_every,
                                     start_fraction, uniform):
    name, kwargs = ENV_CONFIGS[env_index]
    env = make_trap_env(name, **{**kwargs, "seed": env_seed, "segment_every": segment_every})
    policy = TabularPolicy.uniform(env) if uniform else env.default_policy(policy_seed)
    rng = np.random.default_rng(rng_seed)
    prefix = env.sample_episode(policy, rng)
    start = prefix.states[int(start_fraction * (len(prefix.states) - 1))]
    episode = env.sample_episode(policy, rng, start=start)

    assert episode.done and not episode.truncated
    assert env.is_terminal(episode.states[-1])
    assert len(episode.states) - 1 == len(episode.actions) == len(episode.rewards) == len(episode.tokens)
    assert env.turn(episode.states[-1]) <= env.horizon
    assert episode.start_turn == env.turn(start)
    assert episode.rewards[:-1] == [0.0] * (len(episode.rewards) - 1)

    boundaries = episode.boundary_turns()
    assert boundaries[0] == 0
    assert all((episode.start_turn + t) % segment_every == 0 for t in boundaries[1:])
    later = [t for t in range(1, len(episode.actions)) if (episode.start_turn + t) % segment_every == 0]
    assert boundaries[1:] == later
    assert episode.boundary_states() == [episode.states[t] for t in boundaries]
    assert sum(episode.segment_rewards()) == episode.episode_return
    assert len(episode.segment_rewards()) == len(boundaries)
    assert sum(episode.segment_token_counts()) == episode.total_tokens


def test_boundaries_every_m_turns_from_the_initial_state():
    lock = CombinationLock(horizon=12, segment_every=3, delay=12)
    episode = lock.sample_episode(TabularPolicy.uniform(lock), np.random.default_rng(0))
    assert len(episode.actions) == 12
    assert episode.boundary_turns() == [0, 3, 6, 9]
    assert episode.segment_token_counts() == [15, 15, 15, 15]


def test_sampling_is_deterministic_given_the_generator_seed(env):
    policy = env.default_policy(0)
    first = [env.sample_episode(policy, np.random.default_rng(42)) for _ in range(3)]
    again = [env.sample_episode(policy, np.random.default_rng(42)) for _ in range(3)]
    assert first == again
    rng = np.random.default_rng(42)
    batch = [env.sample_episode(policy, rng).actions for _ in range(30)]
    assert len({tuple(actions) for actions in batch}) > 1


def test_max_tokens_truncates_before_the_budget_is_exceeded():
    lock = CombinationLock(delay=12)
    episode = lock.sample_episode(lock.default_policy(0), np.random.default_rng(0), max_tokens=12)
    assert episode.truncated and not episode.done
    assert episode.total_tokens == 10 and len(episode.actions) == 2
    assert not lock.is_terminal(episode.states[-1])
    assert episode.boundary_turns() == [0]

    nothing = lock.sample_episode(lock.default_policy(0), np.random.default_rng(0), max_tokens=4)
    assert nothing.truncated and nothing.actions == [] and nothing.states == [lock.initial_state()]
    assert nothing.boundary_turns() == [] and nothing.segment_rewards() == []

    chain = LookupChain()
    policy = chain.default_policy(0)
    rng = np.random.default_rng(1)
    for budget in range(0, 60, 3):
        episode = chain.sample_episode(policy, rng, max_tokens=budget)
        assert episode.total_tokens <= budget
        assert episode.truncated != episode.done
        if episode.truncated:
            assert not chain.is_terminal(episode.states[-1])
    assert not chain.sample_episode(policy, rng, max_tokens=10_000).truncated


def test_sampling_from_a_terminal_state_is_refused():
    lock = CombinationLock(horizon=3)
    with pytest.raises(ValueError, match="terminal"):
        lock.sample_episode(lock.default_policy(0), np.random.default_rng(0), start=lock.live_state(3))


# ------------------------------------------------------------------------------------------------- policies


def test_policy_output_is_validated():
    lock = CombinationLock()
    for bad in ([0.5, 0.6, -0.1], [0.5, 0.5], [0.2, 0.2, 0.2], [np.nan, 0.5, 0.5]):
        policy = TabularPolicy(lock, lambda state, bad=bad: bad, name="bad")
        with pytest.raises(ValueError, match="'bad'"):
            policy.probabilities(lock.initial_state())


def test_policy_samples_follow_its_probabilities_and_skip_zero_probability_actions():
    lock = CombinationLock()
    policy = TabularPolicy(lock, lambda state: [0.2, 0.0, 0.8])
    rng = np.random.default_rng(0)
    draws = np.array([policy.sample_action(lock.initial_state(), rng) for _ in range(20_000)])
    assert not np.any(draws == 1)
    assert np.mean(draws == 2) == pytest.approx(0.8, abs=4 * np.sqrt(0.16 / 20_000))


def test_exact_values_refuse_a_policy_of_another_environment():
    lock, twin = CombinationLock(), CombinationLock()
    with pytest.raises(ValueError, match="another environment"):
        lock.exact_values(twin.default_policy(0), [lock.initial_state()])


# -------------------------------------------------------------------------------------------------- seeding


def test_seeds_change_combinations_and_knowledge_bases():
    assert len({CombinationLock(seed=seed).combination for seed in range(10)}) == 10
    chains = [LookupChain(seed=seed) for seed in range(10)]
    assert len({chain.question for chain in chains}) == 10
    assert len({chain.answer for chain in chains}) == 10
    assert CombinationLock(seed=3).combination == CombinationLock(seed=3).combination
    assert LookupChain(seed=3).observation(LookupChain(seed=3).initial_state()) == \
        LookupChain(seed=3).observation(LookupChain().initial_state())


def test_lookup_names_are_distinct_and_the_question_hides_the_answer():
    for seed in range(20):
        chain = LookupChain(hops=5, seed=seed)
        names = [*chain.true_chain, *chain.poisoned_chain[2:], chain.lookalike_at_hop_2]
        assert len(set(names)) == len(names)
        assert chain.answer not in chain.question
        assert chain.true_chain[0] in chain.question


def test_registry_builds_environments_and_names_the_known_ones():
    assert isinstance(make_trap_env("combination_lock", horizon=5), CombinationLock)
    assert make_trap_env("lookup_chain", hops=3).hops == 3
    with pytest.raises(ValueError, match="combination_lock, lookup_chain"):
        make_trap_env("maze")


# -------------------------------------------------------------------------------------------- text protocol


def test_text_session_rejects_unknown_and_malformed_actions_without_using_a_turn(env):
    session = TextSession(env, seed=0)
    first = session.reset()
    for action in env.action_menu(env.initial_state()):
        assert f"- {action}" in first
    for bad in ("open sesame", "", None, 3, ["set dial 1 to A"]):
        observation, reward, done, info = session.step(bad)
        assert observation.startswith("Error: Unknown action")
        assert (reward, done, info["turn"], info["action_index"]) == (0.0, False, 0, None)
        assert info["state"] == env.initial_state()
        assert first in observation

    action = env.action_menu(env.initial_state())[0]
    observation, _, _, info = session.step(f"  {action.upper()}  ")
    assert info["error"] is None and info["action_index"] == 0
    assert info["tokens"] == len(action.split())
    assert info["turn"] == 1 and env.turn(session.state) == 1


def test_text_session_plays_a_whole_episode_and_refuses_steps_after_the_end(env):
    session = TextSession(env, seed=1)
    session.reset()
    total_reward, done = 0.0, False
    while not done:
        state = session.state
        _, reward, done, info = session.step(env.action_menu(state)[optimal_action(env, state)])
        total_reward += reward
    assert total_reward == 1.0
    observation, reward, done, info = session.step(env.action_menu(env.initial_state())[0])
    assert observation.startswith("Error: The episode is over") and done and reward == 0.0

    assert session.reset(seed=1).startswith(env.observation(env.initial_state()))
    with pytest.raises(RuntimeError, match="reset"):
        TextSession(env).step("anything")


# ---------------------------------------------------------------------------- paraphrased observations


def test_paraphrased_env_keeps_values_and_varies_texts():
    from focus_core.envs.traps import Paraphrased

    inner = CombinationLock(horizon=6, segment_every=2, seed=1)
    env = Paraphrased(inner, words=1, vocabulary=4)  # small, so the full-MDP recursion stays cheap
    policy = env.default_policy(0)
    rng = np.random.default_rng(0)
    episodes = [env.sample_episode(policy, rng) for _ in range(200)]
    states = [s for ep in episodes for s in ep.states if not env.is_terminal(s)]
    # Through the inner policy (fast path) and through the full paraphrased MDP: the same values.
    full_mdp_policy = TabularPolicy(env, policy.probabilities, name="reads-every-state")
    fast = env.exact_values(policy, states)
    np.testing.assert_allclose(env.exact_values(full_mdp_policy, states[:40]), fast[:40], atol=1e-12)
    np.testing.assert_allclose(fast, inner.exact_values(inner.default_policy(0), [s.inner for s in states]))
    texts = {env.observation(s) for s in states if s.inner == states[1].inner}
    assert len(texts) > 1  # one underlying state, several texts
    returns = np.array([ep.episode_return for ep in episodes])
    value = env.exact_values(policy, [env.initial_state()])[0]
    assert abs(returns.mean() - value) < 4 * np.sqrt(value * (1 - value) / len(returns)) + 1e-9
