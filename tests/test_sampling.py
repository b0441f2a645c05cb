"""Lossless sampling, tested three ways: forced cases with +-inf logits, a seeded
chi-square test of the output distribution (with a companion test showing it catches a
broken sampler), and determinism under a seed."""
import numpy as np
import pytest
from scipy import stats as scipy_stats

from specdeploy.runtime import InputError, Session
from specdeploy.runtime.decoding import accept as accept_module
from specdeploy.runtime.decoding.accept import accept_greedy, accept_sampled
from specdeploy.runtime.decoding.sampling import SamplingParams, warp
from specdeploy.runtime.decoding.stops import StopMatcher
from tiny import PROMPTS

INF = np.inf
T1 = SamplingParams(temperature=1.0)


def onehot_logits(rows, vocab=6):
    """rows: the one token each row allows (all other logits -inf)."""
    logits = np.full((len(rows), vocab), -INF)
    for i, t in enumerate(rows):
        logits[i, t] = 0.0
    return logits


class Draws:
    """A stand-in rng whose uniforms are given: decides accept/reject paths exactly."""

    def __init__(self, *values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


def test_forced_accept_all_then_bonus():
    target = warp(onehot_logits([1, 2, 3, 4]), T1)  # [k+1, V]
    draft = warp(onehot_logits([1, 2, 3]), T1)
    n, token = accept_sampled(np.array([1, 2, 3]), draft, target, Draws(0.99, 0.99, 0.99, 0.5))
    assert (n, token) == (3, 4)


def test_forced_reject_first_samples_the_residual():
    target = warp(np.array([[0.0, 0.0, -INF, -INF], [0.0, -INF, -INF, -INF]]), T1)  # p0 = {0: .5, 1: .5}
    draft = warp(np.array([[-INF, 0.0, 0.0, -INF]]), T1)  # q0 = {1: .5, 2: .5}
    # draft proposed 2: p(2) = 0, rejected whatever the draw; residual max(0, p - q) = {0: .5} -> 0
    n, token = accept_sampled(np.array([2]), draft, target, Draws(0.0, 0.7))
    assert (n, token) == (0, 0)


def test_forced_reject_in_the_middle():
    target = warp(onehot_logits([1, 2, 5, 0]), T1)
    draft = warp(onehot_logits([1, 2, 3]), T1)
    n, token = accept_sampled(np.array([1, 2, 3]), draft, target, Draws(0.5, 0.5, 0.5, 0.5))
    assert (n, token) == (2, 5)


def test_forced_point_mass_draft():
    # n-gram drafts have no probabilities: q is a point mass. Accept 4 (p=1), reject 3 (p=0):
    # the residual is p with the drafted token removed.
    target = warp(np.array([[-INF] * 4 + [0.0, -INF], [0.0, -INF, -INF, 0.0, -INF, -INF]]), T1)
    n, token = accept_sampled(np.array([4, 3]), None, target, Draws(0.3, 0.999, 0.2))
    assert n == 1 and token == 0


def test_partial_acceptance_probability_is_p_over_q():
    target = warp(np.log(np.array([[0.2, 0.8], [0.5, 0.5]])), T1)
    draft = warp(np.log(np.array([[0.8, 0.2]])), T1)
    # accept token 0 with probability p/q = 0.25: a draw of 0.24 accepts, 0.26 rejects (-> residual {1})
    assert accept_sampled(np.array([0]), draft, target, Draws(0.24, 0.1))[0] == 1
    assert accept_sampled(np.array([0]), draft, target, Draws(0.26, 0.1)) == (0, 1)


def test_greedy_verify():
    logits = onehot_logits([1, 2, 3])
    assert accept_greedy(np.array([1, 2]), logits.argmax(axis=-1)) == (2, 3)
    assert accept_greedy(np.array([1, 0]), logits.argmax(axis=-1)) == (1, 2)


def test_warp_filters():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    np.testing.assert_allclose(warp(logits, SamplingParams(1.0, top_k=2)), [0.625, 0.375, 0, 0])
    np.testing.assert_allclose(warp(logits, SamplingParams(1.0, top_p=0.75)), [0.625, 0.375, 0, 0])
    np.testing.assert_allclose(warp(logits, SamplingParams(1.0, top_p=0.81)), [0.5, 0.3, 0.15, 0] / np.float64(0.95))
    assert warp(logits, SamplingParams(0.0)).tolist() == [1, 0, 0, 0]
    hot = warp(logits, SamplingParams(0.5))
    np.testing.assert_allclose(hot, np.array([0.25, 0.09, 0.0225, 0.0025]) / 0.365)
    with pytest.raises(InputError, match="top-p 0 is outside"):
        SamplingParams(1.0, top_p=0)


# -- the distribution test --------------------------------------------------------------

SAMPLES = 1500
ALPHA = 1e-3  # significance: a correct sampler fails a given seeded run with probability 0.1%
SETTINGS = [SamplingParams(1.0), SamplingParams(0.7, top_k=6), SamplingParams(1.3, top_p=0.9)]


def exact_first_two(session, prompt, params):
    """P(first two generated tokens) from the target engine's own logits: {(a, b): p}."""
    target = session.target
    ids = np.array(prompt)
    target.forward(ids, 0)
    first = warp(target.forward(ids[-1:], len(ids) - 1).copy(), params)[0]
    dist = {}
    for a in np.flatnonzero(first):
        second = warp(target.forward(np.array([a]), len(ids)).copy(), params)[0]
        for b in np.flatnonzero(second):
            dist[(a, b)] = first[a] * second[b]
    return dist


def sampled_first_two(session, prompt, params, n, draft_len=4):
    counts = {}
    for seed in range(n):
        kw = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed)
        ids = session.generate(prompt_ids=prompt, max_new_tokens=3, draft_len=draft_len, **kw).token_ids
        key = (ids[0], ids[1])
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square_pvalue(exact, counts, n):
    """Pearson chi-square; cells expected under 5 are pooled into one."""
    assert set(counts) <= set(exact), "sampled a pair the target gives zero probability"
    observed, expected = [], []
    pool_o = pool_e = 0.0
    for key, p in exact.items():
        if p * n >= 5:
            observed.append(counts.get(key, 0))
            expected.append(p * n)
        else:
            pool_o += counts.get(key, 0)
            pool_e += p * n
    if pool_e > 0:
        observed.append(pool_o)
        expected.append(pool_e)
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return float(scipy_stats.chi2.sf(chi2, len(expected) - 1)), len(expected)


def assert_drafts_keep_the_distribution(session, prompt, setting):
    """A drafter whose proposals carry weight (drafted and accepted over 20 seeds at k = 4) keeps
    the first two tokens' distribution the target's (chi-square, ALPHA)."""
    params = SETTINGS[setting]
    exact = exact_first_two(session, prompt, params)
    counts = sampled_first_two(session, prompt, params, SAMPLES)
    stats = [session.generate(prompt_ids=prompt, max_new_tokens=3, seed=s, temperature=1.0, draft_len=4).stats
             for s in range(20)]
    assert sum(s.drafted for s in stats) > 0 and sum(s.accepted for s in stats) > 0
    pvalue, cells = chi_square_pvalue(exact, counts, SAMPLES)
    assert cells >= 5 and pvalue > ALPHA, f"chi-square p = {pvalue:.2e} over {cells} cells"


def assert_a_familys_draft_keeps_the_distribution(folder, arch: str, draft: str = "self:dtype=int8",
                                                  prepare=None, **overrides):
    """A tiny 2-layer model of `arch` (make_model `overrides`) in `folder`, exported with `draft`
    (by default an int8 self-draft; `prepare(folder)` adds what the draft reads to the model's
    folder): seeded sampling's first two tokens over SAMPLES seeds against the target's exact
    distribution (chi-square, ALPHA)."""
    import tiny
    from specdeploy.export import build_bundle

    tiny.make_model(folder / "m", arch, seed=21, layers=2, vocab_size=tiny.VOCAB, initializer_range=0.5, **overrides)
    if prepare is not None:
        prepare(folder / "m")
    build_bundle(folder / "m", draft, folder / "b", max_seq=32, max_draft=4, prefill_chunk=8)
    session = Session(folder / "b")
    session.eos_token_ids = []
    prompt = tiny.prompt_with_a_fair_draft(session)
    exact = exact_first_two(session, prompt, SETTINGS[0])
    counts = sampled_first_two(session, prompt, SETTINGS[0], SAMPLES)
    assert session.generate(prompt_ids=prompt, max_new_tokens=3, seed=0, temperature=1.0, draft_len=4).stats.drafted
    pvalue, cells = chi_square_pvalue(exact, counts, SAMPLES)
    assert cells >= 5 and pvalue > ALPHA, f"chi-square p = {pvalue:.2e} over {cells} cells"


def assert_misreported_probabilities_are_caught(session, prompt, drafter, flat_width, monkeypatch):
    """The companion: `drafter` made to report its drafts as drawn from a uniform distribution
    over `flat_width(proposal, drafter)` tokens (None: keep the proposal's own probabilities):
    the verifier's p/q is then wrong, and the chi-square test must fail it."""
    from specdeploy.runtime.decoding.drafters import Proposal

    exact = exact_first_two(session, prompt, SETTINGS[0])
    honest = drafter.propose

    def misreported(self, *args, **kwargs):
        p = honest(self, *args, **kwargs)
        width = flat_width(p, self)
        flat = None if width is None else np.full((p.tokens.shape[0], width), 1.0 / width)
        return Proposal(p.tokens, flat, p.seconds, p.passes, p.caught_up, p.first_seconds)

    monkeypatch.setattr(drafter, "propose", misreported)
    counts = sampled_first_two(session, prompt, SETTINGS[0], SAMPLES)
    pvalue, _ = chi_square_pvalue(exact, counts, SAMPLES)
    assert pvalue < ALPHA, f"the misreported draft passed: p = {pvalue:.2e}"


@pytest.mark.parametrize("kind", ["model", "ngram", "self-int8"])
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_speculative_sampling_has_the_target_distribution(small_vocab, kind, setting):
    session, prompt = small_vocab[kind]
    params = SETTINGS[setting]
    exact = exact_first_two(session, prompt, params)
    counts = sampled_first_two(session, prompt, params, SAMPLES)
    # the draft path ran, at the draft length the samples used
    assert sum(session.generate(prompt_ids=prompt, max_new_tokens=3, seed=0, temperature=1.0, draft_len=4).stats.drafted
               for _ in range(3)) > 0
    pvalue, cells = chi_square_pvalue(exact, counts, SAMPLES)
    assert cells >= 5
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e} over {cells} cells"


def _broken_skips_residual(draft_tokens, draft_probs, target_probs, rng):
    """A wrong sampler: on rejection it samples from p instead of norm(max(0, p - q))."""
    from specdeploy.runtime.decoding.sampling import sample

    for i in range(draft_tokens.shape[0]):
        x = int(draft_tokens[i])
        q = 1.0 if draft_probs is None else draft_probs[i, x]
        if rng.random() * q < target_probs[i, x]:
            continue
        return i, sample(target_probs[i], rng)
    return draft_tokens.shape[0], sample(target_probs[-1], rng)


@pytest.mark.parametrize("kind", ["model", "ngram"])
def test_the_distribution_test_catches_a_broken_sampler(small_vocab, kind, monkeypatch):
    session, prompt = small_vocab[kind]
    params = SETTINGS[0]
    exact = exact_first_two(session, prompt, params)
    monkeypatch.setattr(accept_module, "accept_sampled", _broken_skips_residual)
    counts = sampled_first_two(session, prompt, params, SAMPLES)
    pvalue, _ = chi_square_pvalue(exact, counts, SAMPLES)
    assert pvalue < ALPHA, f"the broken sampler passed: p = {pvalue:.2e}"


# -- determinism, stops, adaptive draft length ----------------------------------------------


@pytest.mark.parametrize("speculate", [False, True])
def test_same_seed_same_text(bundles, speculate):
    session = Session(bundles("llama-model"))
    kw = dict(max_new_tokens=30, temperature=0.9, top_p=0.95, speculate=speculate)
    a = session.generate(PROMPTS[0], seed=123, **kw)
    b = session.generate(PROMPTS[0], seed=123, **kw)
    c = session.generate(PROMPTS[0], seed=124, **kw)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert c.token_ids != a.token_ids


def test_stop_matcher_holds_back_prefixes():
    m = StopMatcher(["END", "\n\n"])
    assert m.feed("abc E") == ("abc ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("X") == ("ENX", False)  # not a stop after all: released
    assert m.feed("\n") == ("", False)
    assert m.feed("\nmore") == ("", True)
    assert StopMatcher([]).feed("x") == ("x", False)


def test_stop_string_across_a_round_boundary(bundles):
    session = Session(bundles("llama-same"))  # every round commits several tokens
    gen = session.stream(PROMPTS[3], max_new_tokens=60, draft_len=3)
    pieces = [p.text for p in gen]
    full = "".join(pieces)
    i = next(i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]  # spans the boundary between two rounds
    cut = full.index(stop)
    result = session.generate(PROMPTS[3], max_new_tokens=60, draft_len=3, stop=[stop])
    assert result.text == full[:cut]
    assert result.stats.finish_reason == "stop"
    streamed = "".join(p.text for p in session.stream(PROMPTS[3], max_new_tokens=60, draft_len=3, stop=[stop]))
    assert streamed == full[:cut]


def test_auto_draft_length_never_changes_greedy_output(bundles):
    for name in ("llama-model", "llama-self", "llama-ngram", "llama-same"):
        session = Session(bundles(name))
        for prompt in PROMPTS[::2]:
            plain = session.generate(prompt, max_new_tokens=40, speculate=False)
            auto = session.generate(prompt, max_new_tokens=40, draft_len="auto")
            assert auto.token_ids == plain.token_ids, (name, prompt)


def test_auto_starts_from_the_sessions_last_greedy_generation(bundles):
    import copy

    from specdeploy.runtime.decoding.policy import DraftLength

    session = Session(bundles("llama-self"))
    first = session.generate(PROMPTS[1], max_new_tokens=30, draft_len="auto")
    assert first.stats.draft_len_history[1] == 0  # the T = 1 reference step, measured once
    ended = copy.deepcopy(session._auto)  # the first generation's policy as it ended
    assert ended.passes.measured and (ended.accepted, ended.rejected) != (2.0, 1.0)
    want = DraftLength(session.bundle.max_draft, cost_ratio=0.5).carry_from(ended)
    second = session.generate(PROMPTS[2], max_new_tokens=30, draft_len="auto")
    assert second.stats.draft_len_history[0] == want.choose()  # it starts where the first ended
    sampled = session.generate(PROMPTS[2], max_new_tokens=30, draft_len="auto", temperature=1.0, seed=3)
    again = Session(bundles("llama-self")).generate(PROMPTS[2], max_new_tokens=30, draft_len="auto", temperature=1.0,
                                                   seed=3)
    assert sampled.token_ids == again.token_ids  # sampled runs never depend on earlier requests
    assert sampled.stats.draft_len_history == again.stats.draft_len_history


def test_auto_draft_length_is_reported(bundles):
    session = Session(bundles("llama-ngram"))
    result = session.generate(PROMPTS[16], max_new_tokens=60, draft_len="auto")
    history = result.stats.draft_len_history
    assert len(history) == result.stats.target_passes
    assert result.stats.as_dict()["draft_len_histogram"] == {str(k): history.count(k) for k in sorted(set(history))}


@pytest.mark.parametrize("setting", [0, 2])
def test_fused_sampled_rounds_on_torch_have_the_target_distribution(small_vocab, setting):
    """The torch backend samples the draft chain on the device (one host sync per round);
    the output still has the target's exact distribution, and seeded runs replay."""
    ort_session, prompt = small_vocab["model"]
    session = Session(ort_session.bundle.path, backend="torch")
    session.eos_token_ids = []
    assert session.drafter.fused_with(session.target)
    params = SETTINGS[setting]
    exact = exact_first_two(ort_session, prompt, params)
    syncs0, draft_syncs0 = session.target.stats.host_syncs, session.drafter.engine.stats.host_syncs
    passes0 = session.target.stats.passes
    counts = sampled_first_two(session, prompt, params, SAMPLES)
    pvalue, cells = chi_square_pvalue(exact, counts, SAMPLES)
    assert cells >= 5 and pvalue > ALPHA, f"chi-square p = {pvalue:.2e} over {cells} cells"
    assert session.drafter.engine.stats.host_syncs == draft_syncs0  # draws stay on the device
    # one sync per target pass (prefill chunk or a round's verify), none per draft step
    assert session.target.stats.host_syncs - syncs0 == session.target.stats.passes - passes0
    kw = dict(prompt_ids=prompt, max_new_tokens=3, draft_len=4, temperature=params.temperature, top_k=params.top_k,
              top_p=params.top_p, seed=5)
    assert session.generate(**kw).token_ids == session.generate(**kw).token_ids
