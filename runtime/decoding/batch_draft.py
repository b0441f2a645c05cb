"""A draft graph for the whole batch: one batched draft engine whose KV slots follow the target's
(each lane in the draft's slot of the same index as its target slot), in place of a forked draft
engine per lane (docs/batching.md, "Speculation that knows the batch").

Per slot the draft keeps what `ModelDrafter` keeps for one sequence: the tokens whose K/V its
slot holds (`fed`, a prefix of the lane's text once rolled back) and their count. Each lane's
passes feed exactly what `ModelDrafter.propose` feeds alone (its catch-up, then each draft but
the last), so its slot holds what it would hold alone.

Greedy lanes share their draft steps: each step is one pass for every run of neighbouring greedy
lanes that draft (`_together`). A greedy lane's tokens are the target's whatever its draft
proposes, so the last bits a shared pass may round differently (see `_alone`) can change a
proposal, never a token. A sampled lane's proposals are part of how its seed becomes tokens
(the draft probabilities enter the acceptance rule), so it drafts alone, from rows bit-identical
to its own engine's, and gives the tokens it gives alone.
"""
from __future__ import annotations

import time

import numpy as np

from specdeploy.runtime.decoding.drafters.proposal import Proposal
from specdeploy.runtime.decoding.sampling import sample, warp


class BatchDraft:
    """A batched draft engine's KV slots and what each holds."""

    def __init__(self, engine, cost_ratio: float, slots: int):
        self.engine = engine
        self.cost_ratio = cost_ratio
        self.fed = np.zeros((slots, engine.max_seq), dtype=np.int64)  # tokens whose K/V each slot holds
        self.length = np.zeros(slots, dtype=np.int64)

    def swap(self, a: int, b: int) -> None:
        """Slots a and b exchange what they hold (the scheduler moved their lanes)."""
        if a == b:
            return
        self.engine.swap(a, b, int(self.length[a]), int(self.length[b]))
        self.fed[[a, b]] = self.fed[[b, a]]
        self.length[[a, b]] = self.length[[b, a]]

    def release(self, slot: int) -> None:
        """A finished lane's slot: its draft K/V kept while they cost nothing (Engine.release)."""
        self.engine.release(slot)

    def forget(self, slot: int | None = None) -> None:
        """Trust nothing a slot holds (every slot's: None): a private request's text, or K/V a
        failed pass may have half written."""
        if slot is None:
            self.length[:] = 0
        else:
            self.length[slot] = 0

    def _rollback(self, slot: int, ids: np.ndarray) -> None:
        """The slot's length back to what its K/V and the lane's text agree on (never the last
        token: it opens the first pass), and for a draft with recurrent states to a position whose
        state the slot keeps."""
        m = min(int(self.length[slot]), ids.shape[0] - 1)
        same = self.fed[slot, :m] == ids[:m]
        self.length[slot] = self.engine.resumable(m if same.all() else int(same.argmin()), slot)

    def _feed(self, slot: int, tokens: np.ndarray) -> None:
        at = int(self.length[slot])
        self.fed[slot, at : at + tokens.shape[0]] = tokens
        self.length[slot] = at + tokens.shape[0]

    def propose(self, lanes: list, ks: list[int], min_confidence: list[float]) -> list[Proposal | None]:
        """Drafts for the lanes in slots 0..len(lanes)-1: lane i drafts up to ks[i] tokens
        (0: none) -> each drafting lane's Proposal (timed over its own passes), None for the
        others. `lanes[i]` has `ids`, `end`, `params` and `rng`.

        Each lane's passes feed exactly what ModelDrafter.propose feeds alone (its catch-up, then
        each draft but the last), so its slot holds what it would hold alone and its next
        round's catch-up is the same."""
        drafting = [i for i, k in enumerate(ks) if k > 0]
        if not drafting:
            return [None] * len(lanes)
        for i in drafting:
            self._rollback(i, lanes[i].ids[: lanes[i].end])
        feed = {i: lanes[i].ids[int(self.length[i]) : lanes[i].end] for i in drafting}
        caught_up = {i: feed[i].shape[0] for i in drafting}
        tokens = {i: np.empty(ks[i], dtype=np.int64) for i in drafting}
        probs = {i: None if lanes[i].params.greedy else np.empty((ks[i], self.engine.vocab_size)) for i in drafting}
        count = dict.fromkeys(drafting, 0)
        passes = dict.fromkeys(drafting, 0)
        seconds = dict.fromkeys(drafting, 0.0)
        first_seconds = dict.fromkeys(drafting, 0.0)
        step = 0
        while feed:
            following = {}
            rows = {}
            for run in _runs([i for i in sorted(feed) if lanes[i].params.greedy]):
                t0 = time.perf_counter()
                out = self._together(run, [feed[i] for i in run])
                share = (time.perf_counter() - t0) / len(run)  # a shared pass's time, split: the lanes' sum is the pass
                for i, logits in zip(run, out):
                    rows[i] = logits
                    seconds[i] += share
            for i in sorted(feed):
                if i not in rows:
                    t0 = time.perf_counter()
                    rows[i] = self._alone(i, feed[i])
                    seconds[i] += time.perf_counter() - t0
            for i, fed in sorted(feed.items()):
                logits = rows[i]
                if step == 0:
                    first_seconds[i] = seconds[i]
                self._feed(i, fed)
                passes[i] += 1
                lane = lanes[i]
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
        out: list[Proposal | None] = [None] * len(lanes)
        for i in drafting:
            c = count[i]
            out[i] = Proposal(tokens[i][:c], None if probs[i] is None else probs[i][:c], seconds[i], passes[i],
                              caught_up[i], first_seconds[i])
        return out

    def _together(self, slots: list[int], feeds: list[np.ndarray]) -> list[np.ndarray]:
        """One pass for the neighbouring `slots`, each fed its tokens at its length -> each slot's
        logits at its last token. A feed shorter than the longest is padded with its last token:
        the padding's K/V land past the slot's length, which is never read and is written over by
        its next pass. Each slot goes alone where the padding would pass the buffer's end, for
        a fused graph's passes of more than one token (GroupQueryAttention takes several tokens of
        one sequence only), and for a draft with recurrent states where the feeds differ in length
        (a padded slot's state must be the one after its own last token, which a pass returning
        its last row only would not give, and all rows of a long catch-up the ring would not keep)."""
        if len(slots) == 1:
            return [self._alone(slots[0], feeds[0])]
        starts = self.length[slots[0] : slots[-1] + 1].copy()
        sizes = np.array([f.shape[0] for f in feeds])
        t = int(sizes.max())
        if int(starts.max()) + t > self.engine.max_seq or (t > 1 and self.engine.spec.attention == "fused"):
            return [self._alone(i, f) for i, f in zip(slots, feeds)]
        tokens = np.empty((len(slots), t), dtype=np.int64)
        for row, f in zip(tokens, feeds):
            row[: f.shape[0]] = f
            row[f.shape[0]:] = f[-1]
        same = bool((sizes == t).all())
        if not same and self.engine.spec.state_names:  # a slot's state after its own last token, not the padding's
            return [self._alone(i, f) for i, f in zip(slots, feeds)]
        logits = self.engine.forward_batch(tokens, starts, first=slots[0], last=same, pad=False)
        # copies: the engine's logits buffer is the next pass's output
        return [logits[j, -1 if same else n - 1].copy() for j, n in enumerate(sizes)]

    def _alone(self, slot: int, tokens: np.ndarray) -> np.ndarray:
        """The logits of a pass of slot `slot` alone at its length, at its last token.

        One sequence a pass: several in one pass of the batched draft graph gave a sampled lane
        other tokens than alone in some batches (tests/test_batch.py's equality test, with a
        sliding-window draft in 2 runs of 3 and with the target as its own draft in 1 of 3; the
        rows' reductions run over the pass's longest window, so their rounding may depend on the
        other sequences). So a sampled lane's passes stay its own, as its own engine's were."""
        start = np.array([self.length[slot]], dtype=np.int64)
        # a copy: the engine's logits buffer is the next pass's output
        return self.engine.forward_batch(tokens[None], start, first=slot, last=True, pad=False)[0, -1].copy()


class SlotStates:
    """One KV slot of a batched target as its lane's head reads it: the hidden states the batch's
    passes wrote at that slot's positions (what `Eagle3Drafter` reads as `target.features`), and
    for a Gemma 4 assistant the slot's K/V."""

    def __init__(self, target, slot: int):
        self.target, self.slot = target, slot
        self.name = target.name

    @property
    def features(self) -> np.ndarray:
        return self.target.slot_features[self.slot]

    @property
    def kv_arrays(self) -> list[np.ndarray]:
        """The slot's K/V in the batch's buffers, [1, Hkv, S, D] each (what a Gemma 4 assistant reads)."""
        return [buffer[self.slot : self.slot + 1] for buffer in self.target.kv]


class BatchHeads:
    """EAGLE-3 heads for the whole batch: one head per KV slot (forks of the bundle's, each with the
    head's own small KV buffers), reading the hidden states the batched target wrote in that slot.
    A head follows its slot's contents: when the scheduler swaps two slots' K/V (and states), their
    heads swap too. Each lane's head runs exactly the passes `Eagle3Drafter.propose` runs alone,
    sampling with the lane's generator, so its proposals are the ones it would draft alone."""

    def __init__(self, head, target, slots: int):
        self.cost_ratio = head.cost_ratio
        self.heads = [head] + [head.fork() for _ in range(slots - 1)]
        self.views = [SlotStates(target, i) for i in range(slots)]
        for h, view in zip(self.heads, self.views):
            h.attach(view)

    def swap(self, a: int, b: int) -> None:
        if a == b:
            return
        self.heads[a], self.heads[b] = self.heads[b], self.heads[a]
        self.views[a], self.views[b] = self.views[b], self.views[a]
        self.views[a].slot, self.views[b].slot = a, b

    def forget(self, slot: int | None = None) -> None:
        for h in self.heads if slot is None else [self.heads[slot]]:
            h.reset()

    def release(self, slot: int) -> None:
        """Nothing: each head's K/V are its own, the target's slot is released by the batch."""

    def propose(self, lanes: list, ks: list[int], min_confidence: list[float]) -> list[Proposal | None]:
        """As BatchDraft.propose: lane i (in slot i) drafts up to ks[i] tokens with its slot's head."""
        return [self.heads[i].propose(lane.ids[: lane.end], k, lane.params, lane.rng, min_confidence[i]) if k > 0
                else None for i, (lane, k) in enumerate(zip(lanes, ks))]


def _runs(slots: list[int]) -> list[list[int]]:
    """Sorted slots as runs of neighbours: [0, 1, 3] -> [[0, 1], [3]] (a pass binds neighbouring slots)."""
    runs: list[list[int]] = []
    for i in slots:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _softmax_max(logits: np.ndarray) -> float:
    z = logits - logits.max()
    return float(1.0 / np.exp(z).sum())


__all__ = ["BatchDraft", "BatchHeads", "SlotStates"]
