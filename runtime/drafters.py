"""Drafters propose the next tokens; the target decides.

Protocol: `propose(ids, k, params, rng) -> (draft_tokens [k'], draft_probs [k', V] or None)`
with k' <= k. None means a point mass on each proposed token (a model-free drafter), so
one verifier serves every drafter. Under sampling, a model drafter samples its tokens from
its own warped distribution, which the verifier needs as `draft_probs`.
"""
from __future__ import annotations

import time

import numpy as np

from .backends import Engine
from .sampling import SamplingParams, sample, warp


class ModelDrafter:
    """A draft graph with its own KV buffers, run one token at a time.

    `min_confidence` stops a round early when the draft's own probability for the token
    it is about to propose falls below it (0: never); the adaptive draft length sets it.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.fed = np.empty(engine.max_seq, dtype=np.int64)  # tokens whose K/V the cache holds
        self.length = 0
        self.passes = 0
        self.seconds = 0.0
        self.min_confidence = 0.0
        self._runs = None  # the engine's pass count when `fed` was last true (see OrtEngine.runs)

    def reset(self) -> None:
        self.length = 0

    def _rollback(self, ids: np.ndarray) -> np.ndarray:
        """Rollback is moving the length back to what the cache and the text agree on; the
        first pass then catches up on every token the cache has not seen (returned). If
        anyone else ran the engine since (or a pass of ours failed), nothing is trusted."""
        if getattr(self.engine, "runs", None) != self._runs:
            self.length = 0
        m = min(self.length, ids.shape[0] - 1)
        same = self.fed[:m] == ids[:m]
        self.length = m if same.all() else int(same.argmin())
        return ids[self.length :]

    def fused_with(self, target: Engine) -> bool:
        """Whether a round can run draft and verify on the device with one host
        synchronisation (engines that offer draft_chain / verify_chain, on one device)."""
        return (
            hasattr(self.engine, "draft_chain") and hasattr(target, "verify_chain")
            and getattr(self.engine, "device", None) == getattr(target, "device", None)
        )

    def propose_and_verify(self, target: Engine, ids: np.ndarray, k: int, params: SamplingParams,
                           rng: np.random.Generator):
        """The fused round: k draft tokens chained on the device, verified by the target from
        device memory, one host synchronisation. Returns (draft tokens [k], draft probs
        [k, V] or None when greedy, the target's argmax per row (greedy) or its logits
        [k+1, V] (sampled), the verify's share of the time in seconds). Under sampling the
        device generator is seeded from `rng`, so a seeded run replays."""
        t0 = time.perf_counter()
        pending = self._rollback(ids)
        if params.greedy:
            chain = self.engine.draft_chain(pending, self.length, k)
            drafts, target_out = target.verify_chain(int(ids[-1]), chain, ids.shape[0] - 1)
            draft_probs = None
        else:
            chain, probs = self.engine.draft_chain(pending, self.length, k, params, int(rng.integers(1 << 62)))
            drafts, draft_probs, target_out = target.verify_chain(int(ids[-1]), chain, ids.shape[0] - 1, probs)
        fed = np.concatenate([pending, drafts[:-1]])  # the chain fed every draft token but the last
        self.fed[self.length : self.length + fed.shape[0]] = fed
        self.length += fed.shape[0]
        self.passes += k
        self._runs = getattr(self.engine, "runs", None)
        draft_seconds = self.engine.chain_seconds()
        self.seconds += draft_seconds
        return drafts, draft_probs, target_out, time.perf_counter() - t0 - draft_seconds

    def propose(self, ids: np.ndarray, k: int, params: SamplingParams, rng: np.random.Generator):
        """ids [n] committed tokens -> up to k draft tokens and their draft probs."""
        t0 = time.perf_counter()
        pending = self._rollback(ids)
        tokens = np.empty(k, dtype=np.int64)
        probs = None if params.greedy else np.empty((k, self.engine.vocab_size), dtype=np.float64)
        count = 0
        for i in range(k):
            logits = self.engine.forward(pending, self.length)[-1]
            self.fed[self.length : self.length + pending.shape[0]] = pending
            self.length += pending.shape[0]
            self.passes += 1
            if params.greedy:
                token = int(logits.argmax())
                confidence = _softmax_max(logits) if self.min_confidence else 1.0
            else:
                probs[i] = warp(logits, params)
                token = sample(probs[i], rng)
                confidence = probs[i, token]
            if i > 0 and confidence < self.min_confidence:
                break  # unsure: stop drafting here (the first token is always proposed)
            tokens[i] = token
            count += 1
            pending = tokens[i : i + 1]
        self._runs = getattr(self.engine, "runs", None)
        self.seconds += time.perf_counter() - t0
        return tokens[:count], None if probs is None else probs[:count]


def _softmax_max(logits: np.ndarray) -> float:
    z = logits - logits.max()
    return float(1.0 / np.exp(z).sum())


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the text's last n tokens
    (n from max_ngram down to min_ngram) and propose what followed it. No graph at all."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.passes = 0
        self.seconds = 0.0
        self.min_confidence = 0.0  # no probabilities: nothing to be unsure about

    def reset(self) -> None:
        pass

    def propose(self, ids: np.ndarray, k: int, params: SamplingParams, rng: np.random.Generator):
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
