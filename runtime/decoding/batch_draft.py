"""A draft graph run for the whole batch: one pass per draft step for every lane that drafts,
each lane in the draft's KV slot of the same index as its target slot (docs/batching.md,
"Drafts in a batch").

Per slot the draft keeps what `ModelDrafter` keeps for one sequence: the tokens whose K/V its
slot holds (`fed`, a prefix of the lane's text once rolled back) and their count. A round of
k drafts for the lanes in slots first..last is

    catch up   each lane's tokens since its last round, one pass of T = the most any lane
               has (a longer catch-up, a joining lane's prompt, in a pass of its own), its
               last real row giving each lane's first draft
    k - 1      single steps, every drafting lane fed its previous draft

so the batch pays k draft passes a round, not k per lane. Each lane's passes feed what
`ModelDrafter.propose` feeds alone (its catch-up, then each draft but the last), and it samples
from its own rows with its own generator in the same order, so its proposals are the ones it
would draft alone: the rows of a batched pass equal those of a pass of one sequence
(runtime/backends/ort_batch.py). A row a pass carries for a slot between the drafting ones
that drafts nothing in it sits past that slot's trusted length: what it writes there is never
read, the length says so.
"""
from __future__ import annotations

import time

import numpy as np

from specdeploy.runtime.decoding.drafters.proposal import Proposal
from specdeploy.runtime.decoding.sampling import sample, warp


class BatchDraft:
    """A batched draft engine's KV slots and what each holds."""

    def __init__(self, engine, cost_ratio: float, slots: int, catch_up: int):
        self.engine = engine
        self.cost_ratio = cost_ratio
        self.catch_up = catch_up  # the longest catch-up taken inside the batched pass (longer: alone first)
        self.fed = np.zeros((slots, engine.max_seq), dtype=np.int64)  # tokens whose K/V each slot holds
        self.length = np.zeros(slots, dtype=np.int64)

    def swap(self, a: int, b: int) -> None:
        """Slots a and b exchange what they hold (the scheduler moved their lanes)."""
        if a == b:
            return
        self.engine.swap(a, b, int(self.length[a]), int(self.length[b]))
        self.fed[[a, b]] = self.fed[[b, a]]
        self.length[[a, b]] = self.length[[b, a]]

    def forget(self, slot: int | None = None) -> None:
        """Trust nothing a slot holds (every slot's: None): a private request's text, or K/V a
        failed pass may have half written."""
        if slot is None:
            self.length[:] = 0
        else:
            self.length[slot] = 0

    def _rollback(self, slot: int, ids: np.ndarray) -> None:
        """The slot's length back to what its K/V and the lane's text agree on (never the last
        token: it opens the first pass)."""
        m = min(int(self.length[slot]), ids.shape[0] - 1)
        same = self.fed[slot, :m] == ids[:m]
        self.length[slot] = m if same.all() else int(same.argmin())

    def _feed(self, slot: int, tokens: np.ndarray) -> None:
        at = int(self.length[slot])
        self.fed[slot, at : at + tokens.shape[0]] = tokens
        self.length[slot] = at + tokens.shape[0]

    def propose(self, lanes: list, ks: list[int], min_confidence: list[float]) -> list[Proposal | None]:
        """Drafts for the lanes in slots 0..len(lanes)-1: lane i drafts up to ks[i] tokens
        (0: none) -> each drafting lane's Proposal (its costs are the batch's passes), None for
        the others. `lanes[i]` has `ids`, `end`, `params` and `rng`.

        Each lane's passes feed exactly what ModelDrafter.propose feeds alone (its catch-up, then
        each draft but the last), so its slot holds what it would hold alone and its next
        round's catch-up is the same."""
        drafting = [i for i, k in enumerate(ks) if k > 0]
        if not drafting:
            return [None] * len(lanes)
        t0 = time.perf_counter()
        for i in drafting:
            self._rollback(i, lanes[i].ids[: lanes[i].end])
        feed = {i: lanes[i].ids[int(self.length[i]) : lanes[i].end] for i in drafting}
        caught_up = {i: feed[i].shape[0] for i in drafting}
        tokens = {i: np.empty(ks[i], dtype=np.int64) for i in drafting}
        probs = {i: None if lanes[i].params.greedy else np.empty((ks[i], self.engine.vocab_size)) for i in drafting}
        count = dict.fromkeys(drafting, 0)
        passes = dict.fromkeys(drafting, 0)
        first_seconds, step = 0.0, 0
        while feed:
            rows = self._pass(feed)
            if step == 0:
                first_seconds = time.perf_counter() - t0
            following = {}
            for i, fed in feed.items():
                self._feed(i, fed)
                passes[i] += 1
                lane, logits = lanes[i], rows[i]
                if lane.params.greedy:
                    token = int(logits.argmax())
                    confidence = _softmax_max(logits) if min_confidence[i] else 1.0
                else:
                    probs[i][step] = warp(logits, lane.params)
                    token = sample(probs[i][step], lane.rng)
                    confidence = probs[i][step, token]
                if step > 0 and confidence < min_confidence[i]:
                    continue  # unsure: its drafts stop here (the first is always proposed)
                tokens[i][step] = token
                count[i] += 1
                if count[i] < ks[i]:
                    following[i] = tokens[i][step : step + 1]
            feed, step = following, step + 1
        seconds = time.perf_counter() - t0
        out: list[Proposal | None] = [None] * len(lanes)
        for i in drafting:
            c = count[i]
            out[i] = Proposal(tokens[i][:c], None if probs[i] is None else probs[i][:c], seconds, passes[i],
                              caught_up[i], first_seconds)
        return out

    def _pass(self, feed: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """One pass over the slots from the first to the last in `feed`: slot i's tokens
        `feed[i]` at its length; a slot between them not in `feed` gets one row past its
        length. Rows are padded after each slot's own, at positions past its length (never
        trusted), or before them, recomputing the tokens it holds where there is no room after.
        -> each fed slot's logits at its last token."""
        # A catch-up longer than a round's (a joining lane's prompt, or the tokens of rounds it
        # rested through) runs alone, as one pass of its own: the others' rows are not padded to
        # it. So does every catch-up where the engine batches single steps only (fused attention),
        # whose rows are equal from one pass shape to another only up to rounding: a lane's
        # catch-up is then exactly the pass it would run alone.
        alone = {i for i, x in feed.items() if x.shape[0] > self.catch_up}
        several = len(feed) > 1
        if several and (not self.engine.batched_steps or
                        not self.engine.wide_batches and any(x.shape[0] > 1 for x in feed.values())):
            alone = set(feed)
        logits = {i: self._alone(i, feed[i]) for i in sorted(alone)}
        feed = {i: x for i, x in feed.items() if i not in alone}
        if not feed:
            return logits
        first, last = min(feed), max(feed)
        b = last - first + 1
        t = max(x.shape[0] for x in feed.values())
        tokens = np.empty((b, t), dtype=np.int64)
        starts = np.empty(b, dtype=np.int64)
        at_row = {}
        for j in range(b):
            i = first + j
            own = feed.get(i)
            length = int(self.length[i])
            if own is None:
                own = self.fed[i, max(length - 1, 0) : max(length, 1)]  # any token: its row writes past the length
            r = own.shape[0]
            if length + t <= self.engine.max_seq:
                tokens[j, :r] = own
                tokens[j, r:] = own[-1]
                starts[j] = length
                at_row[i] = r - 1
            else:  # no room after: the tokens it holds, recomputed where they are, before its own
                shift = t - r
                tokens[j, :shift] = self.fed[i, length - shift : length]
                tokens[j, shift:] = own
                starts[j] = length - shift
                at_row[i] = t - 1
        whole = any(at_row[i] != t - 1 for i in feed)
        # pad=False: a torch engine's padding lanes would write into other slots' trusted K/V
        rows = self.engine.forward(tokens, starts, first=first, last=not whole, pad=False)
        logits.update({i: rows[i - first, at_row[i] if whole else 0] for i in feed})
        return logits

    def _alone(self, slot: int, tokens: np.ndarray) -> np.ndarray:
        """The logits of a pass of slot `slot` alone at its length, at its last token."""
        start = np.array([self.length[slot]], dtype=np.int64)
        # a copy: the engine's logits buffer is the next pass's output
        return self.engine.forward(tokens[None], start, first=slot, last=True, pad=False)[0, -1].copy()


def _softmax_max(logits: np.ndarray) -> float:
    z = logits - logits.max()
    return float(1.0 / np.exp(z).sum())


__all__ = ["BatchDraft"]
