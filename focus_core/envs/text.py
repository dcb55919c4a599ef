"""Text tools the environments share: tokenisers for BM25, a deterministic BM25 top-k, and line fitting.

Every environment's search is BM25 (``bm25s``) over its own documents with its own tokeniser; what they share
is here, so a change of ranking or tie-breaking is made once. Results are deterministic: ties go to the
earlier document, and scores can be rounded first so that float noise across platforms cannot reorder them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

_WORD = re.compile(r"(?u)\b\w\w+\b")  # bm25s's own token pattern; its tokenize() is slow on single strings


def english_words(text: str) -> tuple[str, ...]:
    """Lower-cased words of two or more characters, English stop words removed (bm25s's default tokens).

    Not cached here: a corpus build passes each document once; an environment that asks again caches."""
    from bm25s.stopwords import STOPWORDS_EN  # imported lazily: the registry imports every environment module

    return tuple(t for t in _WORD.findall(text.lower()) if t not in STOPWORDS_EN)


def identifier_words(text: str) -> list[str]:
    """Identifier-aware tokens: 'TextWrapper._wrap_chunks' -> textwrapper text wrapper wrap chunks ..."""
    out = []
    for word in re.findall(r"[A-Za-z0-9_]+", text):
        parts = [p for p in re.split(r"_|(?<=[a-z0-9])(?=[A-Z])", word) if p]
        out += [w.lower() for w in dict.fromkeys([word.strip("_"), *parts]) if len(w) > 1]  # ordered: stable sums
    return out


def ranked(scores: np.ndarray, k: int) -> list[int]:
    """The indices of the ``k`` best positive scores, best first; ties go to the lower index."""
    order = np.lexsort((np.arange(len(scores)), -scores))[:k]
    return [int(i) for i in order if scores[i] > 0]


class Bm25:
    """BM25 over token lists; ``top`` ranks with :func:`ranked`, on scores rounded to ``decimals`` if given."""

    def __init__(self, documents: Sequence[Sequence[str]], *, decimals: int | None = None) -> None:
        import bm25s  # deferred: only needed once a corpus is built

        self.index = bm25s.BM25()
        if documents:
            self.index.index([list(d) for d in documents], show_progress=False)
        self.decimals = decimals

    def scores(self, tokens: Sequence[str]) -> np.ndarray | None:
        """Every document's score for the query tokens, or None when no token is in the vocabulary."""
        vocabulary = getattr(self.index, "vocab_dict", {})
        ids = [vocabulary[t] for t in tokens if t in vocabulary]
        if not ids:
            return None
        scores = self.index.get_scores(ids).astype(np.float64)
        return scores if self.decimals is None else np.round(scores, self.decimals)

    def top(self, tokens: Sequence[str], k: int) -> list[int]:
        scores = self.scores(tokens)
        return [] if scores is None else ranked(scores, k)


def cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, an ellipsis marking the cut."""
    return text if len(text) <= width else text[: width - 1] + "…"


def fit(lines: list[str], budget: int) -> list[str]:
    """The longest prefix of ``lines`` (at least one) whose text fits in ``budget`` characters."""
    kept: list[str] = []
    for line in lines:
        if kept and sum(len(k) + 1 for k in kept) + len(line) > budget:
            break
        kept.append(line)
    return kept
