"""Prompt lookup: a drafter with no graph at all."""
from __future__ import annotations

import time

import numpy as np

from specdeploy.core.manifest import Bundle, DraftEntry

from specdeploy.runtime.backends import BackendChoice
from specdeploy.runtime.decoding.drafters.proposal import Proposal
from specdeploy.runtime.decoding.engine import Checked, Engine
from specdeploy.runtime.decoding.sampling import SamplingParams


class HostLookup:
    """What every model-free drafter shares: no graph, no draft passes, no fused round."""

    kind = "lookup"
    proposes_trees = keeps_history = reads_target = False
    model_free = True
    backends = None
    engine = None
    cost_ratio = 0.0  # a lookup on the host costs next to nothing beside a pass

    def fused_with(self, target: Engine) -> bool:
        return False  # a lookup on the host: the verify pass is an ordinary one

    def propose_and_verify(self, target, ids, k, params, rng) -> tuple[Proposal, Checked]:
        raise NotImplementedError(f"a {self.kind} round is never fused (see fused_with)")


class NgramDrafter(HostLookup):
    """Find the latest earlier occurrence of the text's last n tokens (n from max_ngram down
    to min_ngram) and propose what followed it.

    The text's n-grams are indexed as it grows (a dict per n from the n-gram to the position
    after its latest occurrence), so a round costs a few dict probes plus the tokens new since
    the last one, never a scan of the context: per-round host work that does not grow with the
    text. `lookup` below is the scan it is tested against."""

    kind = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.reset()

    @classmethod
    def from_bundle(cls, bundle: Bundle, backend: BackendChoice | str, threads: int | None) -> "NgramDrafter":
        entry = bundle.draft
        return cls(entry.max_ngram or 3, entry.min_ngram or 1)

    @staticmethod
    def describe(entry: DraftEntry) -> str:
        return f"prompt lookup, n-grams {entry.max_ngram}..{entry.min_ngram}, no graph"

    def fork(self) -> "NgramDrafter":
        return NgramDrafter(self.max_ngram, self.min_ngram)

    def reset(self) -> None:
        self._ids = np.empty(0, dtype=np.int64)  # the text indexed so far (its n-grams ending before its last token)
        self._after: dict[int, dict[bytes, int]] = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}

    def propose(self, ids: np.ndarray, k: int, params: SamplingParams, rng: np.random.Generator,
                min_confidence: float = 0.0) -> Proposal:
        t0 = time.perf_counter()
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self._catch_up(ids)
        n_ids = ids.shape[0]
        found = ids[:0]
        tail = ids[max(0, n_ids - self.max_ngram):].tobytes()
        for n in range(min(self.max_ngram, n_ids - 1), self.min_ngram - 1, -1):
            start = self._after[n].get(tail[8 * (len(tail) // 8 - n):])
            if start is not None:
                found = ids[start : start + k].copy()
                break
        return Proposal(found, None, time.perf_counter() - t0)

    def _catch_up(self, ids: np.ndarray) -> None:
        """Index the n-grams ending at positions up to the one before the last (the last
        n-gram is the one looked up: its own occurrence must not match it). A text that does
        not extend the indexed one (another request) is indexed afresh."""
        done = self._ids.shape[0]
        if done > ids.shape[0] or not np.array_equal(self._ids, ids[:done]):
            self.reset()
            done = 0
        end = ids.shape[0] - 1  # n-grams ending before this position
        if end <= done:
            return
        raw = ids.tobytes()
        for n, table in self._after.items():
            for last in range(max(done, n - 1), end):  # the n-gram ids[last-n+1 .. last]
                table[raw[8 * (last - n + 1) : 8 * (last + 1)]] = last + 1
        self._ids = ids[:end].copy()


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
