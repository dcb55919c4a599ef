"""Hashed text features: deterministic across processes, unit norm, sensitive to words and word order."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from focus_core.features import hashed_text_features, with_scalar_features

TEXTS = [
    "Lock: dial 5 of 12. Set so far: 1=B 2=A 3=C 4=A. Choose a symbol for dial 5.",
    "Lock: dial 5 of 12. Set so far: 1=B 2=A 3=C 4=B. Choose a symbol for dial 5.",
    "Q: name the town where Kalo Venris was born. Notes: none. Hops done: 0 of 1. Turn 0 of 4.",
    "a b",
    "b a",
]


def test_shape_dtype_and_unit_norm():
    for dim in (1, 8, 64, 1000):
        features = hashed_text_features(TEXTS, dim=dim)
        assert features.shape == (len(TEXTS), dim) and features.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(features, axis=1), 1.0, rtol=1e-6)
    assert hashed_text_features([], dim=16).shape == (0, 16)


def test_texts_without_words_map_to_the_zero_vector():
    features = hashed_text_features(["", " .,; ", "word"], dim=32)
    assert np.all(features[:2] == 0.0)
    assert np.linalg.norm(features[2]) == pytest.approx(1.0)


def test_deterministic_and_seed_dependent():
    np.testing.assert_array_equal(hashed_text_features(TEXTS, dim=64, seed=3),
                                  hashed_text_features(list(TEXTS), dim=64, seed=3))
    assert not np.array_equal(hashed_text_features(TEXTS, dim=64, seed=0),
                              hashed_text_features(TEXTS, dim=64, seed=1))


def test_identical_across_processes_with_different_hash_salts():
    script = ("import json, sys; from focus_core.features import hashed_text_features; "
              "print(json.dumps(hashed_text_features(json.loads(sys.argv[1]), dim=64, seed=7).tolist()))")
    outputs = []
    for hash_seed in ("1", "2"):
        environment = {**os.environ, "PYTHONHASHSEED": hash_seed}
        completed = subprocess.run([sys.executable, "-c", script, json.dumps(TEXTS)], env=environment,
                                   capture_output=True, text=True, check=True)
        outputs.append(np.array(json.loads(completed.stdout), dtype=np.float32))
    np.testing.assert_array_equal(outputs[0], outputs[1])
    np.testing.assert_array_equal(outputs[0], hashed_text_features(TEXTS, dim=64, seed=7))


def test_different_texts_give_different_vectors():
    features = hashed_text_features(TEXTS, dim=256)
    for i in range(len(TEXTS)):
        for j in range(i + 1, len(TEXTS)):
            assert not np.allclose(features[i], features[j]), (TEXTS[i], TEXTS[j])


def test_words_are_lower_cased_and_keep_equals_signs():
    same = hashed_text_features(["Set 3=B now", "set 3=b NOW."], dim=128)
    np.testing.assert_array_equal(same[0], same[1])
    split = hashed_text_features(["3=B", "3 B"], dim=128)
    assert not np.allclose(split[0], split[1])


def test_bigrams_make_word_order_matter_and_unigrams_overlap():
    texts = ["alpha beta gamma", "gamma beta alpha", "alpha beta gamma delta"]
    features = hashed_text_features(texts, dim=512)
    assert not np.allclose(features[0], features[1])
    assert features[0] @ features[1] > 0.3  # same unigrams
    assert features[0] @ features[2] > 0.6  # one extra word


def test_invalid_arguments():
    with pytest.raises(TypeError, match="sequence of strings"):
        hashed_text_features("one text")
    with pytest.raises(ValueError, match="dim"):
        hashed_text_features(TEXTS, dim=0)
    with pytest.raises(ValueError, match="seed"):
        hashed_text_features(TEXTS, seed=-1)


def test_scalar_features_are_appended_as_columns():
    features = hashed_text_features(TEXTS[:3], dim=8)
    one = with_scalar_features(features, [0.0, 0.5, 1.0])
    assert one.shape == (3, 9) and one.dtype == np.float32
    np.testing.assert_array_equal(one[:, :8], features)
    np.testing.assert_array_equal(one[:, 8], [0.0, 0.5, 1.0])
    two = with_scalar_features(features, np.array([[0.1, 1.0], [0.2, 2.0], [0.3, 3.0]]))
    assert two.shape == (3, 10)
    np.testing.assert_allclose(two[:, 9], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="shape"):
        with_scalar_features(features, [1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        with_scalar_features(features, [1.0, np.inf, 2.0])
