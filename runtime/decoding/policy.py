"""The policies of `auto`: how many tokens to draft each round (DraftLength), how many tree
nodes or looked-up tokens to verify (TreeSize), how wide a batch's verify pass is and how far
its model draft runs (BatchPolicy), from costs measured in seconds (PassCost).

Each prices the widths it may choose (expected tokens committed, seconds the round costs) and
`best_width` picks one: the most tokens per second, and a plain step unless a wider round beats
it by PAYS. Where plain steps won, each rests on them for SETTLED rounds before evaluating again,
with a probe now and then (Probes)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from specdeploy.runtime.decoding.stats import Round

if TYPE_CHECKING:
    from specdeploy.runtime.decoding.drafters import Proposal

# A wider round must promise this many times plain steps' tokens per second: the estimates are
# noisy, and a gain the model barely predicts is one the round's own overhead can take back.
PAYS = 1.03
# Plain rounds per evaluation of the rates once they chose plain steps: an evaluation is a few
# dozen small numpy calls on caches the pass before just emptied (about 2% of a SmolLM2 int4
# step), and only a probe's verdict changes the estimates much.
SETTLED = 8


def best_width(tokens: np.ndarray, seconds: np.ndarray, plain: bool = True) -> int:
    """The index of the width with the most expected tokens per second, given each width's
    expected tokens and seconds; where index 0 is a plain step (`plain`), 0 unless the best
    beats it by PAYS.

    >>> best_width(np.array([1.0, 1.9, 2.5]), np.array([1.0, 1.2, 2.0]))
    1
    >>> best_width(np.array([1.0, 1.2]), np.array([1.0, 1.18]))  # 1.7% faster: not enough
    0
    """
    rates = tokens / np.maximum(seconds, 1e-9)  # (a fit from wide passes alone may put v1 at 0)
    best = int(rates.argmax())
    if plain and best > 0 and rates[best] < PAYS * rates[0]:
        return 0
    return best


class PassCost:
    """What a pass (the target's, or a draft's) costs as a function of its tokens T:
    v(T) = v1 + slope * (T - 1) seconds, fitted by decayed least squares over the passes a
    generation runs.

    Every verify pass is a measurement at its own T, so the T = 1 cost (the rate plain
    decoding would run at) is never one sample: the first step after a prefill, say, runs a
    third slower than the steps after it, and a policy that priced everything against it
    would take a draft step for cheap and draft far too long. Where the passes measured span
    too few T to fit a slope (a policy that settled on one k), the slope is drawn toward
    `prior_slope` times v1 with the weight of RIDGE passes one token apart. Unmeasured, costs
    are relative: v1 = 1.

    The cost is not a line: ONNX Runtime's CPU kernels block the T rows, so a step from T = 5
    to 6 can cost next to nothing and one from 8 to 9 a lot (SmolLM2 fp32: T = 4 29 ms, 5
    29.5 ms, 8 34 ms). At each T measured (up to `max_tokens`) the cost is that T's own
    decayed mean, drawn toward the line with the weight of PER_T passes.
    """

    PRIOR_SLOPE = 0.05  # a target pass's extra cost per extra token, relative to T = 1
    RIDGE = 1.0
    PER_T = 2.0

    def __init__(self, decay: float = 0.97, prior_slope: float = PRIOR_SLOPE, max_tokens: int = 64):
        self.decay = decay  # per pass measured: a fit over a few dozen passes
        self.prior_slope = prior_slope
        self._sums = np.zeros(5)  # decayed: weight, x, x^2, y, x*y with x = T - 1, y = seconds
        self._at = np.zeros((max_tokens + 1, 2))  # decayed per T: weight, seconds

    @property
    def measured(self) -> bool:
        return self._sums[0] > 0

    def add(self, tokens: int, seconds: float, weight: float = 1.0) -> None:
        """One pass of `tokens` tokens that took `seconds` (or `weight` such passes, on average)."""
        x = tokens - 1.0
        self._sums = self.decay * self._sums + weight * np.array([1.0, x, x * x, seconds, x * seconds])
        self._at *= self.decay
        if tokens < self._at.shape[0]:
            self._at[tokens] += weight * np.array([1.0, seconds])

    def fit(self) -> tuple[float, float]:
        """(v1, slope) in seconds, or relative (1, prior_slope) before any pass is measured."""
        w, sx, sxx, sy, sxy = self._sums
        if w <= 0:
            return 1.0, self.prior_slope
        mx, my = sx / w, sy / w
        prior = self.prior_slope * my / (1.0 + self.prior_slope * mx)
        slope = (sxy - w * mx * my + self.RIDGE * prior) / (sxx - w * mx * mx + self.RIDGE)
        slope = min(max(slope, 0.0), my / max(mx, 1.0))  # never negative, never a v1 below 0
        return my - slope * mx, slope

    def seconds(self, tokens) -> "float | np.ndarray":
        v1, slope = self.fit()
        t = np.asarray(tokens)
        line = v1 + slope * (t - 1.0)
        if not self.measured:
            return line
        at = self._at[np.minimum(t, self._at.shape[0] - 1)]
        inside = t < self._at.shape[0]
        return np.where(inside, (self.PER_T * line + at[..., 1]) / (self.PER_T + at[..., 0]), line)

    def copy_from(self, other: "PassCost") -> None:
        self._sums = other._sums.copy()
        n = min(self._at.shape[0], other._at.shape[0])
        self._at[:] = 0.0
        self._at[:n] = other._at[:n]


class Probes:
    """When drafting does not pay, a probe of one draft token now and then, in case the text
    changed: every PROBE_EVERY plain rounds, twice as far apart after each probe that failed
    (up to MAX_EVERY), back to PROBE_EVERY after one that held. A probe costs a wider verify
    pass and, for a model draft, a pass that catches up on the tokens it skipped; a draft that
    never holds (SmolLM2's first 2 layers: 1-3% of its tokens) should cost next to nothing."""

    PROBE_EVERY = 8
    MAX_EVERY = 64

    def __init__(self):
        self.every = self.PROBE_EVERY
        self._waited = 0
        self.pending = False  # the round just chosen is a probe

    def due(self) -> bool:
        """Called on a round that would be a plain step: whether to probe instead."""
        self._waited += 1
        self.pending = self._waited >= self.every
        if self.pending:
            self._waited = 0
        return self.pending

    def carry_from(self, earlier: "Probes") -> None:
        """A new request after `earlier`'s: its text may differ, so its first probe comes after
        PROBE_EVERY plain rounds as ever; if that one fails, the spacing is the one `earlier`
        had reached, not PROBE_EVERY doubled again (a draft that held nowhere costs one probe
        a request, not four per 128 tokens)."""
        self.every = earlier.every
        self._waited = max(0, self.every - self.PROBE_EVERY)

    def settle(self, held: bool) -> None:
        """After a round: whether its draft tokens held (any)."""
        if self.pending:
            self.every = self.PROBE_EVERY if held else min(self.every * 2, self.MAX_EVERY)
            self.pending = False
        elif held:
            self.every = self.PROBE_EVERY


class DraftLength:
    """Chooses k each round: pinned, or `auto` within the bundle's maximum.

    auto picks the k (0 included: a plain step, when no draft length pays; it then probes
    with k = 1 now and then: Probes) that maximises expected tokens per second under the analytic
    model (docs/design.md, "The cost model") with the acceptance measured so far, per draft position:

        tokens(k) = 1 + sum over i <= k of (the chance that positions 1..i all hold)
        time(k) = first + (k - 1) * step + v(k + 1)

    with the draft's first pass (it feeds the tokens the last round committed: T = 2), its
    later steps and the verify pass v(T) (PassCost) all measured in seconds where it runs.
    When it measures (greedy), its second round is one plain step, a T = 1 pass for the fit.
    Greedy output never depends on k: it only changes the speed.
    """

    def __init__(
        self, max_k: int, fixed: int | None = None, min_confidence: float = 0.0,
        cost_ratio: float = 0.1, measure: bool = True, acceptance_decay: float = 0.95,
    ):
        self.max_k = max_k
        # Under sampling the chosen k decides how many random draws a round uses, so a
        # seeded run replays only if k never depends on wall-clock timings: then the costs
        # stay at their static estimates (`measure=False`). Greedy output does not depend on
        # k, so there the measured costs steer it.
        self.measure = measure
        self.fixed = fixed
        # A model draft may stop a round early when its own probability for its next token
        # falls below this (0: never). Off by default: a stop on an unsure token hides the
        # rejection it avoids from the acceptance estimate, which then looks higher than it
        # is, and auto drafts longer than pays (measured on SmolLM2 fp32 + int4 self-draft).
        self.min_confidence = 0.0 if fixed is not None else min_confidence
        # of the acceptance counts: over about twenty rounds, since the k that pays sits on a broad
        # optimum where a noisy estimate costs more than a slow one (a few rounds of every draft
        # token accepted put a at 0.99 and k at its maximum, far past what pays)
        self.acceptance_decay = acceptance_decay
        self.accepted = 2.0  # pseudo-counts: start at a = 2/3, optimistic enough to try drafting
        self.rejected = 1.0
        self.hits = np.zeros(max_k)  # decayed, per draft position: rounds it held, rounds it was judged
        self.trials = np.zeros(max_k)
        self.cost_ratio = cost_ratio  # draft step / target pass: the static estimate
        self.passes = PassCost(max_tokens=max_k + 1)  # the target's verify passes
        # the draft's passes: a round's first (T = 2 in a steady round), then steps (T = 1); a draft
        # step is small enough that a second token shows (SmolLM2's int4 draft: 1.15-1.4x)
        self.draft = PassCost(prior_slope=0.2, max_tokens=max_k + 1)
        self.probes = Probes()
        self._rounds = 0
        self._plain_left = 0  # plain rounds left before the rates are evaluated again (SETTLED)

    def carry_from(self, earlier: "DraftLength | None") -> "DraftLength":
        """Start from what an earlier greedy generation of the same session measured (its
        acceptance and costs) instead of the priors: the next request then drafts at the
        paying length from its first rounds, and skips the reference step. Greedy only
        (`measure`): under sampling k must not depend on earlier requests, or a seeded run
        would not replay."""
        if earlier is not None and self.measure and earlier.measure and self.fixed is None:
            self.accepted, self.rejected = earlier.accepted, earlier.rejected
            n = min(self.max_k, earlier.max_k)
            self.hits[:n], self.trials[:n] = earlier.hits[:n], earlier.trials[:n]
            self.passes.copy_from(earlier.passes)
            self.draft.copy_from(earlier.draft)
            self.probes.carry_from(earlier.probes)
        return self

    @property
    def acceptance(self) -> float:
        """The per-token acceptance a over every position (the geometric model's estimate)."""
        return self.accepted / (self.accepted + self.rejected)

    POSITION_PRIOR = 2.0  # rounds `acceptance` counts for at each position

    def held(self) -> np.ndarray:
        """The chance that draft position 1..max_k holds, given that the ones before it held:
        measured per position, drawn toward `acceptance` (the positions rarely judged follow
        it). It is not one number: SmolLM2's int4 self-draft held 0.92, 0.91, 0.90, 0.87, 0.84
        at positions 1..5, and a single rate drafts past where it pays."""
        a = min(self.acceptance, 0.999)
        return np.minimum((self.POSITION_PRIOR * a + self.hits) / (self.POSITION_PRIOR + self.trials), 0.999)

    def costs(self) -> tuple[float, float, np.ndarray]:
        """(first draft pass, draft step, verify pass at T = 1..max_k+1), in seconds once
        measured, else relative to a target pass."""
        verify = self.passes.seconds(np.arange(1, self.max_k + 2))  # relative until measured (never under sampling)
        if self.draft.measured:
            step, first = self.draft.seconds([1, 2])
        else:
            step = first = self.cost_ratio * float(verify[0])
        return float(first), float(step), verify

    def widths(self) -> tuple[np.ndarray, np.ndarray]:
        """Each k = 0..max_k's expected tokens committed and round seconds (relative to a
        target pass until measured)."""
        first, step, verify = self.costs()
        k = np.arange(1, self.max_k + 1)
        tokens = np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(self.held()))])
        return tokens, np.concatenate([verify[:1], first + (k - 1) * step + verify[1:]])

    def choose(self) -> int:
        if self.fixed is not None:
            return self.fixed
        self._rounds += 1
        if self.measure and not self.passes.measured and self._rounds == 2:
            return 0  # one plain step: a T = 1 pass for the verify cost's fit
        if self._plain_left > 0:  # settled on plain steps: a plain round moves the estimates little
            self._plain_left -= 1
            best_k = 0
        else:
            best_k = best_width(*self.widths())
            if best_k == 0:
                self._plain_left = self.SETTLED - 1
        if best_k == 0 and self.probes.due():
            return 1  # drafting does not pay so far: probe now and then in case the text changed
        return best_k

    PAYS = PAYS
    SETTLED = SETTLED

    def update(self, round: Round) -> None:
        """After each round: `proposed` draft tokens (0: the pass was a plain step at T = 1),
        `accepted` of them, the draft's and the verify pass's seconds, how many tokens the
        draft's first pass fed (`caught_up`) and how many passes it ran (0: as many as it
        proposed) and, where the drafter timed it, its first pass's seconds. A draft that
        stopped early on an unsure token ran one pass more than it proposed: its cost per step
        is per pass, not per proposed token. The first pass is priced on its own: priced per
        step, a round of one draft token would look dear and `auto` would settle on the short
        rounds that make it look so."""
        proposed, accepted, verify_seconds = round.proposed, round.accepted, round.verify_seconds
        a = self.acceptance_decay
        if proposed:
            self._plain_left = 0  # drafted (a probe, say): evaluate the rates again next round
            self.probes.settle(accepted > 0)
            self.accepted = a * self.accepted + accepted
            self.rejected = a * self.rejected + (accepted < proposed)
            self.hits *= a
            self.trials *= a
            self.trials[: min(accepted + 1, proposed)] += 1  # judged: the held ones and the first that did not
            self.hits[:accepted] += 1
        if verify_seconds <= 0 or not self.measure:
            return
        self.passes.add(proposed + 1, verify_seconds)
        if proposed == 0:
            return
        passes, first = round.draft_passes or proposed, round.first_seconds
        if not first:  # the round's passes timed as a whole (a chain on the device)
            self.draft.add(1, round.draft_seconds / passes, weight=passes)
            return
        if round.caught_up <= self.max_k + 1:  # not a prompt's or a long pause's catch-up
            self.draft.add(max(round.caught_up, 1), first)
        if passes > 1:  # the later passes are steps of T = 1
            self.draft.add(1, (round.draft_seconds - first) / (passes - 1), weight=passes - 1)


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
    T = N + 1 tokens costs v(T) (PassCost, fitted over the passes measured), plus the
    lookup's seconds. auto keeps the N best-ranked nodes that give the most tokens
    per unit of time; none (a plain step) unless that beats plain by PAYS, with a probe of one
    node now and then (Probes). Where wide passes are dear the tree shrinks to a chain or to
    nothing; where they are cheap it grows.

    With `chains` the candidates are a model-free drafter's chains, looked up before the
    policy chooses how much of them to verify (the lookup is free): rank r is the chain's
    token r+1, and its prior is the first token's measured rate to the power r+1.
    """

    PAYS = PAYS
    PRIOR = 1.0  # rounds the drafter's score counts for, per rank, before any is measured

    def __init__(self, max_nodes: int, fixed: int | None = None, decay: float = 0.9, measure: bool = True,
                 chains: bool = False):
        self.max_nodes = max_nodes
        # chains: the candidates are a model-free drafter's chains (a tree of one branch), the
        # node of rank r its r-th token: the policy then chooses a chain's length after the lookup
        self.chains = chains
        self.fixed = fixed
        self.decay = decay
        self.measure = measure  # as DraftLength: under sampling the size never depends on timings
        self.hits = np.zeros(max_nodes)  # decayed: rounds the node of each rank was accepted
        self.trials = np.zeros(max_nodes)  # decayed: rounds it was verified
        self.passes = PassCost(max_tokens=max_nodes + 1)
        self.lookup = 0.0  # the drafter's seconds per round, measured with the passes (0 before, and under sampling)
        self.probes = Probes()
        self._rounds = 0

    def carry_from(self, earlier: "TreeSize | None") -> "TreeSize":
        """Start from an earlier greedy generation's measurements (see DraftLength.carry_from)."""
        if earlier is not None and self.measure and earlier.measure and self.fixed is None and \
                earlier.chains == self.chains:
            n = min(self.max_nodes, earlier.max_nodes)
            self.hits[:n], self.trials[:n] = earlier.hits[:n], earlier.trials[:n]
            self.passes.copy_from(earlier.passes)
            self.lookup = earlier.lookup
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
        trials = self.trials[:n]
        weight = self.PRIOR / (1.0 + trials) ** 2  # the score counts less as measurements come in
        if probs is not None:
            prior = np.sort(probs)[::-1][:n]
        elif self.chains:  # a lookup's chain: each token holds as often as the first (geometric)
            first = (weight[:1] * 0.5 + self.hits[:1]) / (weight[:1] + trials[:1]) if n else np.ones(1)
            prior = first ** np.arange(1, n + 1)
        else:
            prior = np.full(n, 0.5)
        # no rank expected to do better than a better-ranked one: the scores' order is trusted
        return np.minimum.accumulate((weight * prior + self.hits[:n]) / (weight + trials))

    def choose(self, probs: np.ndarray | None, size: int) -> int:
        """The number of nodes to verify of a candidate tree of `size` nodes scored `probs`."""
        if self.fixed is not None:
            return min(self.fixed, size)
        self._rounds += 1
        if self.measure and not self.passes.measured and self._rounds == 2:
            return 0  # one plain step: a T = 1 pass for the verify cost's fit (see DraftLength)
        if size == 0:
            return 0
        n = min(size, self.max_nodes)
        tokens = np.concatenate([[1.0], 1.0 + np.cumsum(self.estimates(probs, n))])  # N = 0..n
        verify = self.passes.seconds(np.arange(1, n + 2))  # relative until measured (never under sampling)
        seconds = np.concatenate([verify[:1], verify[1:] + self.lookup])  # lookup: measured with the passes, else 0
        best = best_width(tokens, seconds)
        if best == 0:
            return 1 if self.probes.due() else 0
        return best

    def update(self, round: Round) -> None:
        """After each round: the verified tree's size (`proposed`; 0: a plain step at T = 1) and
        scores, the accepted path's node indices, the pass's and the lookup's seconds."""
        d, nodes = self.decay, round.proposed
        if nodes:
            self.probes.settle(bool(round.path))
            # every rank fades, verified or not: a rank left out for a while (after rounds that
            # went badly) drifts back to the drafter's score and is tried again
            rank = self.ranks(round.scores, nodes)
            self.hits *= d
            self.trials *= d
            self.trials[:nodes] += 1
            np.add.at(self.hits, rank[np.asarray(round.path, dtype=np.int64)], 1)
        if round.verify_seconds <= 0 or not self.measure:
            return
        self.passes.add(nodes + 1, round.verify_seconds)
        self.lookup = d * self.lookup + (1 - d) * round.draft_seconds


class BatchPolicy:
    """How wide the batch's verify pass is: T = 1 (plain steps) or 1 + the drafts verified.

    For the lanes whose draft length is the runtime's to choose (greedy, `auto`), a pass of T
    tokens commits, for lane b, 1 + the sum over its first min(chain_b, T - 1) looked-up tokens
    of the chance each holds (measured per lane, per rank: TreeSize.estimates). It costs
    v_B(T), fitted over the passes measured at this batch size B (PassCost): a wide pass is
    nearly free at B = 1 on memory-bound hardware, and B times the rows at B = 8. The policy
    takes the T with the most tokens per second, and plain steps unless that beats them by
    PAYS, with a probe of T = 2 now and then (Probes). Lanes with a pinned draft length, and
    sampled lanes, set the least T (their rounds are their own); the policy may widen it.
    """

    PAYS = PAYS
    PRIOR_SLOPE = 0.05  # the extra cost of a token per lane, relative to a plain pass, before any is measured
    # Plain rounds at a batch size before the rates are evaluated again, once they chose plain
    # steps there: those rounds look nothing up (a lookup and an estimate per lane is host work
    # every round of a batch that has settled on plain steps would pay for nothing).
    SETTLED = SETTLED

    def __init__(self, max_draft: int):
        self.max_draft = max_draft
        self.costs: dict[int, PassCost] = {}
        self.probes = Probes()
        self._resting: dict[int, int] = {}  # batch size -> plain rounds left before the next evaluation
        self._probe = False  # the round being planned is a probe
        self.probing = False  # choose_k's k is a probe: one lane drafts it
        # a draft graph's batched passes, by batch size (decayed means, seconds): a step (T = 1)
        # and the first pass of a round (catching up on the tokens the last round committed)
        self.step: dict[int, float] = {}
        self.first: dict[int, float] = {}

    def looks(self, lanes: int) -> bool:
        """Whether this round looks up the chains of the lanes the policy drafts for: not while
        it rests on plain steps at this batch size, except for a probe now and then."""
        left = self._resting.get(lanes, 0)
        if left <= 0:
            return True
        self._resting[lanes] = left - 1
        self._probe = self.probes.due()
        return self._probe

    def cost(self, lanes: int) -> PassCost:
        c = self.costs.get(lanes)
        if c is None:
            c = self.costs[lanes] = PassCost(prior_slope=self.PRIOR_SLOPE * lanes, max_tokens=self.max_draft + 1)
        return c

    def choose(self, lanes: int, least: int, chains: list[tuple[int, np.ndarray]]) -> int:
        """The pass's T: `least` the lanes that choose for themselves need; `chains` the (length,
        per-rank acceptance) of each lane the policy drafts for."""
        longest = max((n for n, _ in chains), default=0)
        probe, self._probe = self._probe, False
        if longest == 0 or least > longest:
            return least
        if probe:
            return max(least, 2)
        cost = self.cost(lanes)
        if not cost.measured:
            return least  # a pass at the least T first: the cost's fit starts from it
        ts = np.arange(least, longest + 2)
        tokens = np.zeros(ts.shape[0])
        for n, holds in chains:
            gained = np.concatenate([[0.0], np.cumsum(holds)])
            tokens += 1.0 + gained[np.minimum(ts - 1, n)]
        best = best_width(tokens, cost.seconds(ts), plain=least == 1)
        if least == 1 and best == 0:
            self._resting[lanes] = self.SETTLED - 1
            return 2 if self.probes.due() else 1
        return int(ts[best])

    def choose_k(self, lanes: int, least: int, holds: list[np.ndarray], prior: float) -> int:
        """A model draft's k for the lanes the policy drafts for (each runs k draft passes of its
        own before the verify pass: the first as measured at this batch size, each later one a
        step; before any is measured, a step costs `prior` seconds): `holds` each lane's chance
        that draft position 1..max holds given the ones before (DraftLength.held); `least` the k
        the lanes that choose for themselves draft anyway (their passes are spent either way).
        Plain steps (k = 0) unless a k beats them by PAYS."""
        step = self.step.get(lanes, prior)
        first = self.first.get(lanes, 1.2 * step)
        probe, self._probe = self._probe, False
        self.probing = False
        cost = self.cost(lanes)
        if not holds or not cost.measured:
            return least
        if probe:  # one lane drafts one token (catching up costs a draft pass per lane: one lane's is enough)
            self.probing = least == 0
            return max(least, 1)
        ks = np.arange(least, self.max_draft + 1)
        tokens = np.zeros(ks.shape[0])
        for held in holds:
            gained = np.concatenate([[0.0], np.cumsum(np.cumprod(held))])
            tokens += 1.0 + gained[ks]
        drafting = np.where(ks > 0, first + (ks - 1) * step, 0.0)  # one lane's draft passes
        best = best_width(tokens, len(holds) * drafting + cost.seconds(ks + 1), plain=least == 0)
        if least == 0 and best == 0:
            self._resting[lanes] = self.SETTLED - 1
            self.probing = self.probes.due()
            return 1 if self.probing else 0
        return int(ks[best])

    def drafted(self, proposal: Proposal, lanes: int) -> None:
        """A lane's draft passes in a round of `lanes` lanes, timed: what choose_k prices them by.
        The first pass feeds the tokens the draft has not seen (after a round, the ones it
        committed) and is priced on its own, as DraftLength prices it; a first pass that caught up
        on a whole prompt says nothing of a round's."""
        p = proposal
        if p.passes > 1:
            step = (p.seconds - p.first_seconds) / (p.passes - 1)
            self.step[lanes] = _decay(self.step.get(lanes), step)
        if p.first_seconds and p.caught_up <= self.max_draft + 1:
            self.first[lanes] = _decay(self.first.get(lanes), p.first_seconds)

    def update(self, lanes: int, t: int, seconds: float, drafted: bool, accepted: int,
               draft_seconds: float = 0.0) -> None:
        """After a round of `lanes` lanes at width `t` whose verify pass took `seconds` and whose
        draft passes `draft_seconds`; `accepted`: the draft tokens its lanes kept. A round that
        drafted counts as held (Probes) only if it paid: the tokens it committed per lane beat a
        plain pass by the width's measured cost and the draft's passes. In a batch, some lane's
        draft holds in most rounds, and probing on every such round would keep a wide pass
        running where it does not pay."""
        cost = self.cost(lanes)
        cost.add(t, seconds)
        if drafted:
            plain, wide = cost.seconds(np.array([1, t]))
            self.probes.settle((lanes + accepted) * plain >= self.PAYS * (wide + draft_seconds) * lanes)


def _decay(mean: float | None, value: float) -> float:
    return value if mean is None else 0.9 * mean + 0.1 * value
