"""The draft-length policy: how many tokens to draft each round."""
from __future__ import annotations

import numpy as np

from specdeploy.core.analytic import predicted_speedup


class DraftLength:
    """Chooses k each round: pinned, or `auto` within the bundle's maximum.

    auto picks the k (0 included: a plain step, when no draft length pays; it then probes
    with k = 1 every few rounds) that maximises expected tokens per unit of time under the analytic
    model (DESIGN.md section 4) with the acceptance rate a and the cost ratio c measured so
    far in this generation: tokens(k) = (1 - a^(k+1)) / (1 - a), time(k) = k*c + v(k), where
    v(k) is the verify pass's cost at T = k+1 relative to T = 1 (it grows a little with T).
    When it measures (greedy), its second round is one plain step: the T = 1 pass that c
    and v(k) are measured against (a verify pass at T = 2 is not one).
    Under auto a model drafter also stops early when it is unsure of its next token (its
    confidence below `min_confidence`, which the loop hands it each round; 0 when k is
    pinned). Greedy output never depends on k: it only changes the speed.
    """

    def __init__(
        self, max_k: int, fixed: int | None = None, min_confidence: float = 0.3, decay: float = 0.8,
        cost_ratio: float = 0.1, measure: bool = True,
    ):
        self.max_k = max_k
        # Under sampling the chosen k decides how many random draws a round uses, so a
        # seeded run replays only if k never depends on wall-clock timings: then the cost
        # ratio stays at its static estimate (`measure=False`). Greedy output does not
        # depend on k, so there the measured costs steer it.
        self.measure = measure
        self.fixed = fixed
        self.min_confidence = 0.0 if fixed is not None else min_confidence
        self.decay = decay
        self.accepted = 2.0  # pseudo-counts: start at a = 2/3, optimistic enough to try drafting
        self.rejected = 1.0
        self.cost_ratio = cost_ratio  # draft step / verify pass: a static estimate, then measured
        self.first_extra = 0.0  # what a round's first draft pass costs beyond a step, relative to T = 1
        self.verify_slope = 0.05  # extra verify cost per extra token, relative to T = 1
        self._verify_t1: float | None = None
        self.probe_every = 8
        self._rounds = 0

    def carry_from(self, earlier: "DraftLength | None") -> "DraftLength":
        """Start from what an earlier greedy generation of the same session measured (its
        acceptance, costs and T = 1 reference) instead of the priors: the next request then
        drafts at the paying length from its first rounds, and skips the reference step.
        Greedy only (`measure`): under sampling k must not depend on earlier requests, or a
        seeded run would not replay."""
        if earlier is not None and self.measure and earlier.measure and self.fixed is None:
            self.accepted, self.rejected = earlier.accepted, earlier.rejected
            self.cost_ratio, self.verify_slope = earlier.cost_ratio, earlier.verify_slope
            self.first_extra = earlier.first_extra
            self._verify_t1 = earlier._verify_t1
        return self

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self) -> int:
        if self.fixed is not None:
            return self.fixed
        self._rounds += 1
        if self.measure and self._verify_t1 is None and self._rounds == 2:
            return 0  # one plain step: the T = 1 pass every other cost is measured against
        a = min(self.acceptance, 0.999)
        # k = 0: a plain step, one verify pass at T = 1 per token (rate 1)
        rates = [1.0] + [predicted_speedup(a, k, self.cost_ratio, self.verify_slope, self.first_extra)
                         for k in range(1, self.max_k + 1)]
        # Plain steps unless some k promises more than PAYS: the estimates are noisy, and a
        # gain the model barely predicts is one the round's own overhead can take back.
        best_k = max(range(len(rates)), key=rates.__getitem__)
        if rates[best_k] < self.PAYS:
            best_k = 0
        if best_k == 0 and self._rounds % self.probe_every == 0:
            return 1  # drafting does not pay so far: probe now and then in case the text changed
        return best_k

    PAYS = 1.03

    # A round leaves the draft's cache at most two tokens behind (the last draft token and the
    # target's own); a first pass over more is catching up (after plain steps, or the prompt),
    # and its time says nothing about what a draft step costs.
    STEADY_CATCH_UP = 2

    def update(self, proposed: int, accepted: int, draft_seconds: float, verify_seconds: float,
               caught_up: int = 1, draft_passes: int = 0, first_seconds: float = 0.0) -> None:
        """After each round: `proposed` draft tokens (0: the pass was a plain step at T = 1),
        `accepted` of them, the draft's and the verify pass's seconds, how many tokens the
        draft's first pass fed (`caught_up`) and how many passes it ran (0: as many as it
        proposed) and, where the drafter timed it, its first pass's seconds. A draft that
        stopped early on an unsure token ran one pass more than it proposed: its cost per step
        is per pass, not per proposed token. The first pass feeds the tokens the last round
        committed (T = 2 in a steady round) and costs more than a step: priced on its own
        (`first_extra`), or a round of one draft token would look dear per step and `auto`
        would settle on the short rounds that make it look so."""
        d = self.decay
        self.accepted = d * self.accepted + accepted
        self.rejected = d * self.rejected + (1 if accepted < proposed else 0)
        if verify_seconds <= 0 or not self.measure:
            return
        if proposed == 0:  # a plain step: the reference cost of a T = 1 pass
            t1 = self._verify_t1
            self._verify_t1 = verify_seconds if t1 is None else d * t1 + (1 - d) * verify_seconds
            return
        t1 = self._verify_t1 or verify_seconds / (1 + self.verify_slope * proposed)
        passes = draft_passes or proposed
        if first_seconds and passes > 1:  # the later passes are steps of T = 1
            step = (draft_seconds - first_seconds) / (passes - 1)
            self.cost_ratio = d * self.cost_ratio + (1 - d) * step / t1
        if caught_up <= self.STEADY_CATCH_UP:
            if first_seconds:
                extra = max(0.0, first_seconds / t1 - self.cost_ratio)
                self.first_extra = d * self.first_extra + (1 - d) * extra
            elif passes:
                self.cost_ratio = d * self.cost_ratio + (1 - d) * (draft_seconds / passes) / t1
        if self._verify_t1:
            slope = max(0.0, (verify_seconds / t1 - 1) / proposed)
            self.verify_slope = d * self.verify_slope + (1 - d) * slope


class TreeSize:
    """How many tree nodes to verify each round: pinned (`fixed`), or `auto` from the measured
    cost of a verify pass and the measured acceptance of each node rank.

    A tree of N nodes commits 1 + (the accepted path's length) tokens, and the path's expected
    length is the sum over its nodes of the chance each is on the accepted path. The nodes are
    ranked by the drafter's own score (`DraftTree.probs`; depth-first order without one), and
    for each rank the policy measures how often the node of that rank was accepted when
    verified (decayed counts), starting from the drafter's score as a prior worth PRIOR rounds
    whose weight falls with the square of the rounds measured: a drafter's scores have the right order more
    often than the right size (a suffix index's counts over a few occurrences are sure of
    long continuations that rarely hold). A pass of
    T = N + 1 tokens costs 1 + slope * N times a single step (slope measured as DraftLength
    measures it), plus the lookup. auto keeps the N best-ranked nodes that give the most tokens
    per unit of time; none (a plain step) unless that beats plain by PAYS, with a probe of one
    node every few rounds. Where wide passes are dear the tree shrinks to a chain or to
    nothing; where they are cheap it grows.
    """

    PAYS = DraftLength.PAYS
    PRIOR = 1.0  # rounds the drafter's score counts for, per rank, before any is measured

    def __init__(self, max_nodes: int, fixed: int | None = None, decay: float = 0.9, measure: bool = True):
        self.max_nodes = max_nodes
        self.fixed = fixed
        self.decay = decay
        self.measure = measure  # as DraftLength: under sampling the size never depends on timings
        self.hits = np.zeros(max_nodes)  # decayed: rounds the node of each rank was accepted
        self.trials = np.zeros(max_nodes)  # decayed: rounds it was verified
        self.verify_slope = 0.05
        self.lookup_cost = 0.0  # the drafter's time per round, relative to a T = 1 pass
        self._verify_t1: float | None = None
        self.probe_every = 8
        self._rounds = 0

    def carry_from(self, earlier: "TreeSize | None") -> "TreeSize":
        """Start from an earlier greedy generation's measurements (see DraftLength.carry_from)."""
        if earlier is not None and self.measure and earlier.measure and self.fixed is None:
            n = min(self.max_nodes, earlier.max_nodes)
            self.hits[:n], self.trials[:n] = earlier.hits[:n], earlier.trials[:n]
            self.verify_slope, self.lookup_cost = earlier.verify_slope, earlier.lookup_cost
            self._verify_t1 = earlier._verify_t1
        return self

    @staticmethod
    def ranks(probs: np.ndarray | None, size: int) -> np.ndarray:
        """Each node's rank (0: the best) by the drafter's score, depth-first order breaking
        ties: the order in which DraftTree.prune keeps nodes."""
        order = np.arange(size) if probs is None else np.argsort(-probs, kind="stable")
        rank = np.empty(size, dtype=np.int64)
        rank[order] = np.arange(size)
        return rank

    def estimates(self, probs: np.ndarray | None, n: int) -> np.ndarray:
        """The chance that the node of each rank 0..n-1 is accepted."""
        prior = np.sort(probs)[::-1][:n] if probs is not None else np.full(n, 0.5)
        trials = self.trials[:n]
        weight = self.PRIOR / (1.0 + trials) ** 2  # the score counts less as measurements come in
        # no rank expected to do better than a better-ranked one: the scores' order is trusted
        return np.minimum.accumulate((weight * prior + self.hits[:n]) / (weight + trials))

    def choose(self, probs: np.ndarray | None, size: int) -> int:
        """The number of nodes to verify of a candidate tree of `size` nodes scored `probs`."""
        if self.fixed is not None:
            return min(self.fixed, size)
        self._rounds += 1
        if self.measure and self._verify_t1 is None and self._rounds == 2:
            return 0  # one plain step: the T = 1 reference (see DraftLength)
        if size == 0:
            return 0
        n = min(size, self.max_nodes)
        tokens = 1.0 + np.cumsum(self.estimates(probs, n))  # N = 1..n
        cost = 1.0 + self.lookup_cost + self.verify_slope * np.arange(1, n + 1)
        rates = tokens / cost
        best = int(rates.argmax())
        if rates[best] < self.PAYS:
            return 1 if self._rounds % self.probe_every == 0 else 0
        return best + 1

    def update(self, probs: np.ndarray | None, nodes: int, path: list[int], verify_seconds: float,
               lookup_seconds: float) -> None:
        """After each round: the verified tree's scores and size (0: a plain step at T = 1), the
        accepted path's node indices, the pass's and the lookup's seconds."""
        d = self.decay
        if nodes:
            # every rank fades, verified or not: a rank left out for a while (after rounds that
            # went badly) drifts back to the drafter's score and is tried again
            rank = self.ranks(probs, nodes)
            self.hits *= d
            self.trials *= d
            self.trials[:nodes] += 1
            np.add.at(self.hits, rank[np.asarray(path, dtype=np.int64)], 1)
        if verify_seconds <= 0 or not self.measure:
            return
        if nodes == 0:
            t1 = self._verify_t1
            self._verify_t1 = verify_seconds if t1 is None else d * t1 + (1 - d) * verify_seconds
        t1 = self._verify_t1 or verify_seconds / (1 + self.verify_slope * nodes)
        self.lookup_cost = d * self.lookup_cost + (1 - d) * lookup_seconds / t1
        if nodes and self._verify_t1:
            slope = max(0.0, (verify_seconds / t1 - 1) / nodes)
            self.verify_slope = d * self.verify_slope + (1 - d) * slope
