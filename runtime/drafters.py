"""Drafters propose the next tokens; the target decides.

Protocol: `propose(ids, k) -> (draft_tokens [k'], draft_logits [k', V] or None)` with
k' <= k. None means a point mass on each proposed token (a model-free drafter).
"""
from __future__ import annotations

import time

import numpy as np

from .backends import Engine


class ModelDrafter:
    """A draft graph with its own KV buffers, run one token at a time."""

    has_probs = True

    def __init__(self, engine: Engine):
        self.engine = engine
        self.fed = np.empty(engine.max_seq, dtype=np.int64)  # tokens whose K/V the cache holds
        self.length = 0
        self.passes = 0
        self.seconds = 0.0

    def reset(self) -> None:
        self.length = 0

    def propose(self, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        """ids [n] committed tokens -> k draft tokens and the draft logits they came from."""
        t0 = time.perf_counter()
        n = ids.shape[0]
        # Rollback is moving the length back to what the cache and the text agree on;
        # the first pass then catches up on every token the cache has not seen.
        same = self.fed[: min(self.length, n - 1)] == ids[: min(self.length, n - 1)]
        self.length = int(same.argmin()) if not same.all() else same.shape[0]
        pending = ids[self.length :]
        tokens = np.empty(k, dtype=np.int64)
        logits = np.empty((k, self.engine.vocab_size), dtype=np.float32)
        for i in range(k):
            out = self.engine.forward(pending, self.length)
            self.fed[self.length : self.length + pending.shape[0]] = pending
            self.length += pending.shape[0]
            logits[i] = out[-1]
            tokens[i] = logits[i].argmax()
            pending = tokens[i : i + 1]
        self.passes += k
        self.seconds += time.perf_counter() - t0
        return tokens, logits


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the text's last n tokens
    (n from max_ngram down to min_ngram) and propose what followed it. No graph at all."""

    has_probs = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.passes = 0
        self.seconds = 0.0

    def reset(self) -> None:
        pass

    def propose(self, ids: np.ndarray, k: int) -> tuple[np.ndarray, None]:
        t0 = time.perf_counter()
        found = lookup(ids, k, self.max_ngram, self.min_ngram)
        self.seconds += time.perf_counter() - t0
        return found, None


def lookup(ids: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> np.ndarray:
    """The up-to-k tokens that followed the latest earlier match of ids' last n tokens.

    >>> lookup(np.array([5, 6, 7, 8, 5, 6]), 2, 3, 1)
    array([7, 8])
    """
    n_ids = ids.shape[0]
    for n in range(min(max_ngram, n_ids - 1), min_ngram - 1, -1):
        pattern = ids[n_ids - n :]
        windows = np.lib.stride_tricks.sliding_window_view(ids[: n_ids - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + k].copy()
    return np.empty(0, dtype=np.int64)
