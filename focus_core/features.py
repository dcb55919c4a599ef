"""Frozen text features for critics: hashed word unigrams and bigrams.

In benchmarks these stand in for the policy's mean-pooled hidden states of a compressed context: a fixed
map from observation text to a vector, identical in every process and on every machine. Each lower-cased
word (a run of letters, digits, underscores and "=", so "3=B" is one word) and each pair of adjacent words
is hashed with BLAKE2b, salted by ``seed``, to a column and a sign of +1 or -1 (the "hashing trick"); the
signed counts are summed and every row is scaled to unit L2 norm. Python's ``hash()`` is not used, because
it is salted per process.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence

import numpy as np

_WORD = re.compile(r"[\w=]+")
_MAX_SEED = 2**128  # blake2b takes a salt of at most 16 bytes


def hashed_text_features(texts: Sequence[str], dim: int = 64, *, seed: int = 0) -> np.ndarray:
    """Map each text to a unit-norm float32 vector of length ``dim``; returns shape (len(texts), dim).

    A text without any word maps to the zero vector (it has no direction to normalise).
    """
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings, not a single string")
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    if not 0 <= seed < _MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**128), got {seed}")
    features = np.zeros((len(texts), dim), dtype=np.float64)
    for row, text in enumerate(texts):
        for gram in _word_grams(text):
            column, sign = _hashed_column(gram, dim, seed)
            features[row, column] += sign
    norms = np.linalg.norm(features, axis=1, keepdims=True)
    np.divide(features, norms, out=features, where=norms > 0)
    return features.astype(np.float32)


def with_scalar_features(features: np.ndarray, scalars: np.ndarray | Sequence[float]) -> np.ndarray:
    """Append scalar columns (e.g. segment index / number of segments, turn / horizon) to a feature matrix.

    ``scalars`` has shape (n,) for one column or (n, k) for k columns; returns float32 of shape (n, d + k).
    """
    features = np.asarray(features, dtype=np.float32)
    scalars = np.asarray(scalars, dtype=np.float32)
    if scalars.ndim == 1:
        scalars = scalars[:, None]
    if features.ndim != 2 or scalars.ndim != 2 or scalars.shape[0] != features.shape[0]:
        raise ValueError(
            f"need features of shape (n, d) and scalars of shape (n,) or (n, k); "
            f"got {features.shape} and {scalars.shape}"
        )
    if not np.all(np.isfinite(scalars)):
        raise ValueError("scalar features must be finite")
    return np.concatenate([features, scalars], axis=1)


def _word_grams(text: str) -> list[str]:
    """The unigrams and bigrams of a text, tagged so that a word and a pair never share a hash input."""
    words = _WORD.findall(text.lower())
    unigrams = [f"w {word}" for word in words]
    bigrams = [f"b {first} {second}" for first, second in zip(words, words[1:], strict=False)]
    return unigrams + bigrams


@functools.lru_cache(maxsize=1 << 18)
def _hashed_column(gram: str, dim: int, seed: int) -> tuple[int, float]:
    digest = hashlib.blake2b(gram.encode("utf-8"), digest_size=8, salt=seed.to_bytes(16, "little")).digest()
    column = int.from_bytes(digest[:7], "little") % dim
    sign = 1.0 if digest[7] & 1 else -1.0
    return column, sign


def context_hidden_states(model, contexts: Sequence[Sequence[int]], *, batch_size: int = 16):
    """The causal LM's last hidden states over each context, without gradients, ``batch_size`` contexts at a time
    (right-padded): yields (hidden [b, width, hidden_size] in the model's dtype, mask [b, width]) per batch."""
    import torch

    decoder = model.get_decoder()
    with torch.no_grad():
        for start in range(0, len(contexts), batch_size):
            chunk = [list(c) for c in contexts[start:start + batch_size]]
            width = max(len(c) for c in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, context in enumerate(chunk):
                ids[row, : len(context)] = torch.tensor(context)
                mask[row, : len(context)] = 1
            yield decoder(input_ids=ids, attention_mask=mask).last_hidden_state, mask


def state_features(model, contexts: Sequence[Sequence[int]], segment_idx: np.ndarray) -> np.ndarray:
    """The critic's features of segment start states: the policy's mean-pooled hidden states over each context plus
    the segment index (what stage segment stores, and what fit_critic and advantage compute for continuations)."""
    return with_scalar_features(policy_context_features(model, contexts), np.asarray(segment_idx, np.float32))


def policy_context_features(model, contexts: Sequence[Sequence[int]], *, batch_size: int = 16) -> np.ndarray:
    """Mean-pooled last hidden states of a causal LM over each context: the critic's state features.

    The critic reads the state the way the policy does (DESIGN.md, "Models and generation"): each
    compressed context is run through the policy's decoder once, without gradients, and its hidden
    states are averaged over the context's tokens. Returns float32 [len(contexts), hidden_size].
    """
    rows = []
    for hidden, mask in context_hidden_states(model, contexts, batch_size=batch_size):
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        rows.append(((hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)).float().numpy())
    if not rows:
        return np.zeros((0, model.config.hidden_size), dtype=np.float32)
    return np.concatenate(rows).astype(np.float32)
