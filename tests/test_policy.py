"""The draft-length and chain-length policies, against simulated worlds whose costs and
acceptance are known: `auto` must come within 5% of the best fixed draft length's expected
rate (the bound docs/drafters.md, "The auto policy", holds measured runs to), and the bound is
shown to fail a policy pinned where it does not pay."""
import numpy as np
import pytest

from specdeploy.runtime.decoding.policy import DraftLength, PassCost, Probes, TreeSize
from specdeploy.runtime.decoding.stats import Round


class World:
    """A target pass of T tokens takes v1 + slope*(T-1) seconds, a round's first draft pass
    `first`, each later draft step `step`; each draft token holds with chance `a` (geometric);
    every timing carries multiplicative noise; the very first plain step after the prompt runs
    `cold` times slower (as a real one does)."""

    def __init__(self, a, step, first=None, v1=0.020, slope=0.0012, noise=0.08, cold=1.6, seed=0, passes=None):
        """`a`: one rate, or the chance each position holds given the ones before it held;
        `passes`: a target pass's seconds at T = 1, 2, ... (else v1 + slope * (T - 1))."""
        self.held = np.broadcast_to(np.asarray(a, dtype=np.float64), (8,))
        self.step, self.first = step, step * 1.15 if first is None else first
        self.v1, self.slope, self.noise, self.cold, self.passes = v1, slope, noise, cold, passes
        self.rng = np.random.default_rng(seed)

    def verify(self, t):
        return self.passes[t - 1] if self.passes is not None else self.v1 + self.slope * (t - 1)

    def expected_rate(self, k):
        """Expected tokens per second at a fixed k (k = 0: plain steps)."""
        if k == 0:
            return 1 / self.verify(1)
        tokens = 1 + np.cumprod(self.held[:k]).sum()
        return tokens / (self.first + (k - 1) * self.step + self.verify(k + 1))

    def jitter(self, seconds):
        return seconds * float(np.exp(self.rng.normal(0.0, self.noise)))

    def run(self, policy, rounds):
        """Realised tokens per second of `policy` over `rounds` rounds (the first 30 excluded)."""
        tokens = seconds = 0.0
        for r in range(rounds):
            k = policy.choose()
            if k == 0:
                verify = self.jitter(self.verify(1)) * (self.cold if r < 2 else 1.0)
                policy.update(Round(0, 0, verify))
                got, spent = 1, verify
            else:
                held = 0
                while held < k and self.rng.random() < self.held[held]:
                    held += 1
                first = self.jitter(self.first)
                draft = first + sum(self.jitter(self.step) for _ in range(k - 1))
                verify = self.jitter(self.verify(k + 1))
                policy.update(Round(k, held, verify, draft, draft_passes=k, caught_up=2, first_seconds=first))
                got, spent = held + 1, draft + verify
            if r >= 30:
                tokens, seconds = tokens + got, seconds + spent
        return tokens / seconds


WORLDS = {
    # the quantized self-draft measured on SmolLM2 (fp32 target, int4 draft): a step about 0.55
    # of a target pass, a = 0.93: k = 3..4 pays about 1.2x, k = 8 less
    "self-draft": dict(a=0.93, step=0.011),
    # the same pair as measured (positions 1-5; passes at T = 1, 2, 4, 5, 8: 25.8, 28.2, 31.1,
    # 31.6, 37.5 ms), the rest filled in: acceptance falling with depth, a pass cost no line
    "self-draft, measured": dict(a=[0.92, 0.91, 0.90, 0.87, 0.84, 0.80, 0.76, 0.72], step=0.0125, first=0.0145,
                                 passes=[0.0258, 0.0282, 0.0295, 0.0311, 0.0316, 0.0335, 0.0355, 0.0375, 0.0395]),
    "cheap and right": dict(a=0.97, step=0.002),  # the largest k pays most
    "dear": dict(a=0.9, step=0.019),  # drafting never pays: plain steps
    "wrong": dict(a=0.2, step=0.004),
}


@pytest.mark.parametrize("name", list(WORLDS))
def test_auto_comes_within_five_percent_of_the_best_fixed_length(name):
    world = World(**WORLDS[name])
    best = max(world.expected_rate(k) for k in range(9))
    realised = np.median([World(**WORLDS[name], seed=s).run(DraftLength(8, cost_ratio=0.4), 600) for s in range(3)])
    assert realised >= 0.95 * best, (name, realised / best)


def test_the_five_percent_bound_fails_a_length_pinned_where_it_does_not_pay():
    """Companion: the bound catches a policy that drafts too long (k = 8 in the self-draft
    world) or at all (k = 3 where the draft is dear)."""
    for name, k in (("self-draft", 8), ("dear", 3)):
        world = World(**WORLDS[name])
        best = max(world.expected_rate(j) for j in range(9))
        assert world.run(DraftLength(8, fixed=k), 600) < 0.95 * best, name


def test_auto_is_not_misled_by_a_slow_first_step():
    """The T = 1 reference is fitted over every pass, never one sample: a first plain step
    twice as slow as the rest must not make the draft look cheap and k run to its maximum."""
    world = World(**WORLDS["self-draft"], cold=2.0)
    policy = DraftLength(8, cost_ratio=0.4)
    world.run(policy, 200)
    v1, slope = policy.passes.fit()
    assert v1 == pytest.approx(world.v1, rel=0.1)
    assert policy.draft.seconds(1) == pytest.approx(world.step, rel=0.1)
    assert 2 <= policy.choose() <= 5


def test_pass_cost_fits_the_line_and_falls_back_on_the_prior_slope():
    cost = PassCost(decay=1.0)
    assert not cost.measured and cost.fit() == (1.0, PassCost.PRIOR_SLOPE)  # relative, before any pass
    for t in range(1, 10):
        cost.add(t, 0.020 + 0.002 * (t - 1))
    v1, slope = cost.fit()
    assert v1 == pytest.approx(0.020, rel=0.02) and slope == pytest.approx(0.002, rel=0.05)
    # passes of one length only: v1 follows from the prior slope
    one = PassCost()
    for _ in range(20):
        one.add(5, 0.024)
    v1, slope = one.fit()
    assert v1 == pytest.approx(0.024 / (1 + 4 * PassCost.PRIOR_SLOPE), rel=0.01)
    assert one.seconds(5) == pytest.approx(0.024)


def test_a_draft_measured_only_in_one_token_rounds_still_prices_its_steps():
    """Rounds of one draft token time only the first pass (T = 2); the step (T = 1) follows
    from the fit, so a policy that settled on k = 1 can still find that longer rounds pay."""
    policy = DraftLength(8, cost_ratio=0.9)
    policy.update(Round(0, 0, 0.020))
    for _ in range(20):
        policy.update(Round(1, 1, 0.021, 0.006, draft_passes=1, caught_up=2, first_seconds=0.006))
    assert policy.draft.seconds(1) == pytest.approx(0.006 / (1 + 0.2), rel=0.02)
    assert policy.choose() >= 3


def test_catch_up_passes_longer_than_a_round_do_not_price_the_draft():
    """After the prompt, a draft's first pass feeds every prompt token: not a step's cost."""
    policy = DraftLength(8, cost_ratio=0.4)
    policy.update(Round(1, 1, draft_seconds=0.300, verify_seconds=0.022, caught_up=120, draft_passes=1,
                        first_seconds=0.300))
    assert not policy.draft.measured
    for _ in range(10):  # steady rounds: a 15 ms first pass (T = 2), then two 9 ms steps
        policy.update(Round(3, 3, draft_seconds=0.033, verify_seconds=0.024, caught_up=2, draft_passes=3,
                            first_seconds=0.015))
    assert policy.draft.seconds([1, 2]) == pytest.approx([0.009, 0.015], rel=0.1)


def test_auto_draft_length_follows_acceptance_and_cost_unmeasured():
    """Under sampling (measure=False) k follows acceptance and the static cost ratio only."""
    def rounds(policy, n, accept_all):
        chosen = []
        for _ in range(n):
            k = policy.choose()
            chosen.append(k)
            if k:
                policy.update(Round(k, k if accept_all else 0, draft_seconds=0.0, verify_seconds=0.0))
        return chosen

    assert rounds(DraftLength(8, cost_ratio=0.05, measure=False), 10, True)[-1] == 8
    never = rounds(DraftLength(8, cost_ratio=0.05, measure=False), 200, False)
    assert max(never[40:]) == 1 and never[40:].count(0) >= 150
    assert max(rounds(DraftLength(8, cost_ratio=1.0, measure=False), 20, True)[5:]) <= 1
    assert set(rounds(DraftLength(8, fixed=3), 10, False)) == {3}


def _never_holds(policy, rounds):
    """A draft whose tokens never hold, a plain step of 20 ms, a draft step of 5 ms."""
    chosen = []
    for _ in range(rounds):
        k = policy.choose()
        chosen.append(k)
        if k:
            policy.update(Round(k, 0, 0.021 + 0.001 * k, 0.005 * k, draft_passes=k, caught_up=2, first_seconds=0.005))
        else:
            policy.update(Round(0, 0, 0.020))
    return chosen


def test_settled_on_plain_steps_the_rates_are_evaluated_once_in_a_while(monkeypatch):
    """Once the rates choose plain steps, they are evaluated again only every SETTLED plain
    rounds or after a probe: the same rounds as a policy that evaluates every round (the
    probes keep their schedule), at a fraction of the host work."""
    calls = []
    real = DraftLength.widths  # the evaluation: each width's tokens and seconds
    monkeypatch.setattr(DraftLength, "widths", lambda self: calls.append(self.SETTLED) or real(self))
    settled = _never_holds(DraftLength(8, cost_ratio=0.05), 400)
    settled_calls = len(calls)
    every = DraftLength(8, cost_ratio=0.05)
    every.SETTLED = 1
    calls.clear()
    assert _never_holds(every, 400) == settled
    probes = sum(1 for k in settled[50:] if k)
    assert probes >= 4 and max(settled[50:]) == 1  # plain steps, probed with one token now and then
    assert len(calls) >= 390 and settled_calls <= 400 // DraftLength.SETTLED + 2 * probes + 20


def test_a_later_request_probes_early_once_then_as_rarely_as_the_earlier_one_ended():
    earlier = DraftLength(8, cost_ratio=0.05)
    _never_holds(earlier, 400)
    assert earlier.probes.every == Probes.MAX_EVERY
    later = DraftLength(8, cost_ratio=0.05).carry_from(earlier)
    chosen = _never_holds(later, 200)
    probes = [r for r, k in enumerate(chosen) if k]
    assert probes[0] == Probes.PROBE_EVERY - 1  # a new text: the first probe comes as early as ever
    assert np.diff(probes).tolist() == [Probes.MAX_EVERY] * (len(probes) - 1)  # then as rarely as before
    fresh = _never_holds(DraftLength(8, cost_ratio=0.05), 200)
    assert sum(1 for k in fresh[2:] if k) > len(probes)  # a fresh policy probes more: 8, 16, 32, 64 apart
    assert DraftLength(8, cost_ratio=0.05, measure=False).carry_from(earlier).probes.every == Probes.PROBE_EVERY


# -- a model-free drafter's chains: looked up first, then cut -----------------------------------

def _chain_rounds(policy, rounds, holds, found=8, slope=0.002):
    """Chains of `found` looked-up tokens, of which the first `holds` always hold."""
    chosen = []
    for _ in range(rounds):
        n = policy.choose(None, found)
        chosen.append(n)
        path = tuple(range(min(n, holds)))
        policy.update(Round(n, len(path), 0.020 + slope * n, 0.0001, path=path))
    return chosen


def test_probes_back_off_while_they_fail_and_return_when_one_holds():
    from specdeploy.runtime.decoding.policy import Probes

    probes = Probes()
    at = []
    for r in range(400):
        if probes.due():
            at.append(r)
            probes.settle(held=r > 300)  # nothing holds until round 300
    gaps = np.diff([-1] + at).tolist()
    assert gaps[:5] == [8, 16, 32, 64, 64], gaps
    assert gaps[-3:] == [8, 8, 8]  # a probe held: every eighth round again


def test_lookup_chains_are_cut_where_they_stop_holding():
    # every looked-up token holds: the whole chain
    assert _chain_rounds(TreeSize(8, chains=True), 40, holds=8)[-5:] == [8] * 5
    # only the first two hold: two or three (a longer try now and then)
    tail = _chain_rounds(TreeSize(8, chains=True), 80, holds=2)[-20:]
    assert tail.count(2) >= 15 and min(tail) >= 1, tail
    # none holds: plain steps, with one-token probes ever further apart
    chosen = _chain_rounds(TreeSize(8, chains=True), 200, holds=0)
    assert set(chosen[40:]) == {0, 1} and np.diff(np.flatnonzero(chosen))[-2:].tolist() == [64, 64]


def test_the_ngram_index_finds_what_a_scan_of_the_text_finds():
    """The n-gram drafter indexes the text as it grows; the scan (`lookup`) is its reference,
    over growing texts of a small alphabet (many repeats) and texts that replace each other."""
    from specdeploy.runtime.decoding.drafters.ngram import NgramDrafter, lookup

    rng = np.random.default_rng(0)
    for max_n, min_n in ((3, 1), (4, 2)):
        drafter = NgramDrafter(max_n, min_n)
        for _ in range(60):
            text = rng.integers(0, 5, rng.integers(2, 60))
            for n in range(2, text.shape[0] + 1):
                proposal = drafter.propose(text[:n], 4, None, None)
                got, probs = proposal.tokens, proposal.probs
                assert probs is None and np.array_equal(got, lookup(text[:n], 4, max_n, min_n)), text[:n]


def test_a_lookup_bundle_under_auto_looks_up_first_and_stays_lossless(bundles):
    from specdeploy.runtime import Session
    from tiny import PROMPTS

    session = Session(bundles("llama-ngram"))
    for prompt in PROMPTS[14:18]:
        plain = session.generate(prompt, max_new_tokens=60, speculate=False)
        auto = session.generate(prompt, max_new_tokens=60, draft_len="auto")
        assert auto.token_ids == plain.token_ids, prompt
        stats = auto.stats.as_dict()
        assert stats["tree_rounds"] == 0 and len(auto.stats.draft_len_history) == auto.stats.target_passes
        assert max(auto.stats.draft_len_history) <= session.bundle.max_draft
    assert session._auto_tree is not None and session._auto_tree.chains  # the chain policy, carried over
    kw = dict(max_new_tokens=40, draft_len="auto", temperature=1.0, seed=3)
    assert session.generate(PROMPTS[15], **kw).token_ids == Session(bundles("llama-ngram")).generate(PROMPTS[15], **kw).token_ids
