"""bench/critic_features.py: its poolings of the policy's hidden states and its out-of-fold critic, on the tiny
model and on synthetic returns (the benchmark itself reads an exact_values run; benchmarks.md has its figures)."""

from __future__ import annotations

import numpy as np
import pytest

from bench import critic_features
from focus_core.config import load_config
from focus_core.features import hashed_text_features, policy_context_features
from focus_core.policy.models import tiny_policy
from focus_core.policy.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def model():
    tokenizer = train_tokenizer(["look up the answer in the notes of the chain"] * 20, vocab_size=300)
    return tiny_policy(tokenizer, layers=1, hidden=32, heads=2, intermediate=64).model


def test_poolings_agree_with_the_pipeline_and_ignore_padding(model):
    contexts = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11], [5, 6, 7, 12, 13, 14, 15, 16, 17]]
    pooled = critic_features.pooled_hidden_states(model, contexts)
    assert np.allclose(pooled["mean"], policy_context_features(model, contexts), atol=1e-6)
    for row, context in enumerate(contexts):  # one context alone: no padding at all
        alone = critic_features.pooled_hidden_states(model, [context, context])
        assert np.allclose(pooled["last"][row], alone["last"][0], atol=1e-5)
    # The shared prefix [5, 6, 7] is left out of tail_mean: a context of one token beyond it pools that token only.
    assert np.allclose(pooled["tail_mean"][1], pooled["last"][1], atol=1e-6)
    assert not np.allclose(pooled["tail_mean"][0], pooled["mean"][0], atol=1e-4)
    maps = critic_features.feature_maps(model, contexts, np.array([0, 1, 2]))
    assert maps["segment_only"].tolist() == [[0.0], [1.0], [2.0]]
    assert maps["last"].shape == (3, 33) and maps["last"][:, -1].tolist() == [0.0, 1.0, 2.0]
    assert "text" not in maps
    # With a decoder: hashed words of the text after the shared prefix, beside the segment index, and beside mean.
    words = {5: "look", 6: "up", 7: "the", 8: "answer", 9: "in", 10: "notes", 11: "chain", 12: "of"}
    decode = lambda ids: " ".join(words.get(i, "x") for i in ids)  # noqa: E731
    maps = critic_features.feature_maps(model, contexts, np.array([0, 1, 2]), decode)
    assert maps["text"].shape == (3, critic_features.TEXT_DIM + 1) and maps["text"][:, -1].tolist() == [0.0, 1.0, 2.0]
    assert np.allclose(maps["text"][1, :-1], hashed_text_features(["chain"], dim=critic_features.TEXT_DIM)[0])
    assert np.allclose(maps["mean+text"], np.concatenate([maps["mean"], maps["text"][:, :-1]], axis=1))


def test_shared_prefix():
    assert critic_features._shared_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert critic_features._shared_prefix([[1, 2], [3]]) == 0


def test_out_of_fold_rows_never_see_their_own_folds_returns():
    config = load_config(None, ["critic.steps=50", "critic.hidden=8"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 4)).astype(np.float32)  # 6 distinct states
    inverse = np.repeat(np.arange(6), 4)  # 4 rows each
    row_fold = np.tile(np.arange(4), 6)
    returns = rng.integers(0, 2, size=24).astype(float)
    flipped = returns.copy()
    flipped[row_fold == 1] = 1.0 - flipped[row_fold == 1]
    before, _ = critic_features.out_of_fold(config, x, inverse, returns, np.ones(24), row_fold)
    after, _ = critic_features.out_of_fold(config, x, inverse, flipped, np.ones(24), row_fold)
    assert np.allclose(before[row_fold == 1], after[row_fold == 1], atol=1e-12)
    assert not np.allclose(before[row_fold == 0], after[row_fold == 0], atol=1e-6)  # the others did see them
