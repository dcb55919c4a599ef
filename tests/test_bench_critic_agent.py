"""bench/critic_agent.py's replay on synthetic pipeline tables: the reference draws never reach a strategy or
the critic, the budget holds, the reference-corrected MSE is unbiased, and a fixed seed gives fixed rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from bench import critic_agent
from focus_core.config import load_config
from focus_core.schemas import schema_for

TASKS, GROUP, SEGMENTS, FEATURES = 6, 2, 3, 4
SETTINGS = critic_agent.Settings(pool=9, reference=6)


def _tables(seed: int = 0) -> dict:
    """Segment-stage states of TASKS × GROUP main episodes (s_0 shared per task), their rollouts' log-probs and
    dense draws whose success probability is a function of the features (so a critic can learn it)."""
    rng = np.random.default_rng(seed)
    states, rollouts, dense, p_of = [], [], [], {}
    for t in range(TASKS):
        for g in range(GROUP):
            episode = f"t{t}-e{g}"
            reward = float(rng.integers(0, 2))
            for k in range(SEGMENTS):
                state = f"t{t}-s0" if k == 0 else f"{episode}-s{k}"
                if state not in p_of:
                    x = rng.normal(size=FEATURES)
                    p_of[state] = (1 / (1 + np.exp(-2 * x[0])), x)
                states.append({"run_id": "r", "iteration": 0, "episode_id": episode, "segment_idx": k,
                               "state_id": state, "branch_id": None, "policy_version": 0, "context_token_ids": [1],
                               "remaining_generated_tokens": 30 - 10 * k, "own_return": reward,
                               "segment_reward": reward if k == SEGMENTS - 1 else 0.0, "segment_generated_tokens": 10,
                               "features": p_of[state][1].astype(np.float32).tolist()})
                rollouts.append({"episode_id": episode, "segment_idx": k, "role": "policy",
                                 "logprobs": list(-rng.random(3))})
    for state, (p, _) in p_of.items():
        for d in range(SETTINGS.draws):
            dense.append({"state_id": state, "draw": d, "return": float(rng.random() < p),
                          "generated_tokens": int(rng.integers(5, 25))})
    cfg = load_config(None, ["critic.steps=40", "critic.hidden=8"])
    return {"states": pa.Table.from_pylist(states, schema=schema_for("states")),
            "rollouts": pa.Table.from_pylist(rollouts),
            "dense": pa.Table.from_pylist(dense, schema=critic_agent.DENSE_SCHEMA),
            "config": cfg, "run_id": "r"}


def _replay(data, strategy, split, ratio=1.0, seed=0):
    return critic_agent.replay(data, strategy, ratio * data.main_tokens, seed, split, SETTINGS, {})


def test_reference_draws_reach_neither_strategy_nor_critic():
    data = critic_agent.agent_data("synthetic", _tables(), SETTINGS)
    split = np.argsort(np.random.default_rng(1).random(data.draw_return.shape), axis=1)
    before = _replay(data, "ivr_greedy", split)
    reference = split[:, SETTINGS.pool:]
    flipped = data.draw_return.copy()
    np.put_along_axis(flipped, reference, 1.0 - np.take_along_axis(flipped, reference, 1), 1)
    data.draw_return = flipped
    after = _replay(data, "ivr_greedy", split)
    # The same purchases (spend, states) and so the same critic; only the score against the reference moves.
    assert (after["spent_tokens"], after["branched_states"]) == (before["spent_tokens"], before["branched_states"])
    assert after["critic_mse"] != pytest.approx(before["critic_mse"])


@pytest.mark.parametrize("strategy", ["uniform_random", "uniform_all", "ivr_greedy", "residual_knn", "oracle"])
def test_replay_spends_within_the_budget_and_is_deterministic(strategy):
    data = critic_agent.agent_data("synthetic", _tables(), SETTINGS)
    split = np.argsort(np.random.default_rng(2).random(data.draw_return.shape), axis=1)
    first = _replay(data, strategy, split, ratio=0.5, seed=3)
    assert 0 < first["spent_tokens"] <= 0.5 * data.main_tokens
    assert first == _replay(data, strategy, split, ratio=0.5, seed=3)


def test_corrected_mse_is_unbiased():
    rng = np.random.default_rng(0)
    truth = rng.random(50)
    estimate = np.clip(truth + rng.normal(0, 0.1, 50), 0, 1)
    exact = float(np.mean((estimate - truth) ** 2))
    draws = [critic_agent.corrected_mse(estimate, rng.random((50, 8)) < truth[:, None]) for _ in range(2000)]
    assert np.mean(draws) == pytest.approx(exact, abs=4 * np.std(draws) / np.sqrt(len(draws)))
    naive = np.mean([np.mean((estimate - (rng.random((50, 8)) < truth[:, None]).mean(1)) ** 2) for _ in range(200)])
    assert naive > exact + 0.01  # the uncorrected figure is inflated by the reference's noise


def test_agent_data_refuses_missing_draws():
    tables = _tables()
    tables["dense"] = tables["dense"].slice(0, tables["dense"].num_rows - 1)
    with pytest.raises(ValueError, match="dense returns are missing"):
        critic_agent.agent_data("synthetic", tables, SETTINGS)
