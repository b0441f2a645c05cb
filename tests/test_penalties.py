"""Penalties, min-p and log probabilities under speculation: presence, frequency and repetition
penalties applied to every verify row under the tokens before it (the committed ones, then the
drafts on its path), so that speculative output equals plain output token for token and the
log probabilities equal plain decoding's to the last bit; plain decoding itself checked against
an independent step-by-step reference and Hugging Face's `repetition_penalty`; sampled output
under penalties and min-p checked by the chi-square test, with a companion test showing it
catches rows penalized without their drafts."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from transformers import AutoModelForCausalLM

from specdeploy.runtime import Session
from specdeploy.runtime.decoding.batch import BatchSession
from specdeploy.runtime.decoding.sampling import EMPTY, SamplingParams, penalize, warp
from test_sampling import SAMPLES, ALPHA, chi_square_pvalue
from tiny import PROMPTS

NEW = 40
PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4)
LOOPS = dict(presence_penalty=0.4, frequency_penalty=-0.6, repetition_penalty=1.1)  # a text that repeats itself:
# drafts from its own history are accepted, while each row's penalties still depend on the drafts before it


def _rows_by_hand(logits, params, ids, prompt_len, before):
    """`penalize` written out token by token: the reference it is checked against."""
    out = logits.astype(np.float32).copy()
    for r, extra in enumerate(before):
        history = list(ids) + list(extra)
        generated = history[prompt_len:]
        for t in set(history):
            x = out[r, t]
            if params.repetition_penalty != 1.0:
                rp = np.float32(params.repetition_penalty)
                x = x / rp if x > 0 else x * rp
            c = generated.count(t)
            if params.frequency_penalty != 0.0:
                x = x - np.float32(params.frequency_penalty) * np.float32(c)
            if params.presence_penalty != 0.0 and c:
                x = x - np.float32(params.presence_penalty)
            out[r, t] = x
    return out


def test_each_row_is_penalized_under_the_drafts_before_it():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 12)).astype(np.float32)
    params = SamplingParams(**PENALTIES)
    ids, drafts = np.array([1, 2, 3, 3, 5]), np.array([3, 7, 7])
    before = [drafts[:i] for i in range(4)]
    assert np.array_equal(penalize(logits, params, ids, 2, before), _rows_by_hand(logits, params, ids, 2, before))
    # a row that ignored its drafts would differ: the rows' histories really differ
    assert not np.array_equal(penalize(logits, params, ids, 2, before)[3],
                              penalize(logits, params, ids, 2, [EMPTY] * 4)[3])


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    probs = warp(np.log(np.array([0.5, 0.3, 0.15, 0.05])), SamplingParams(1.0, min_p=0.35))
    assert np.allclose(probs, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])


def reference_decode(session, ids, new, params, top):
    """Plain greedy decoding by hand, one target step at a time, with the penalties by hand and
    each token's log-softmax from the step's raw row: -> (tokens, [(logprob, {alternative: logprob})])."""
    target = session.target
    target.forward(np.array(ids[:-1]), 0)
    seq, out, lps = list(ids), [], []
    for _ in range(new):
        row = target.forward(np.array(seq[-1:]), len(seq) - 1)[0].copy()
        token = int(_rows_by_hand(row[None], params, seq, len(ids), [EMPTY])[0].argmax())
        logp = row.astype(np.float64) - logsumexp(row.astype(np.float64))
        best = np.argsort(-logp, kind="stable")[:top]
        lps.append((logp[token], {int(t): logp[t] for t in best}))
        out.append(token)
        seq.append(token)
        if token in session.eos_token_ids:
            break
    return out, lps


def _tokens_and_logprobs(pieces):
    pieces = list(pieces)
    return [t for p in pieces for t in p.token_ids], [e for p in pieces for e in (p.logprobs or [])]


@pytest.mark.parametrize("name", ["llama-ngram", "llama-model", "llama-suffix"])
def test_penalized_speculative_output_and_logprobs_equal_plain(name, bundles):
    session = Session(bundles(name))
    accepted = trees = changed = 0
    for penalties in (PENALTIES, LOOPS):
        params = SamplingParams(**penalties)
        for prompt in PROMPTS[:5]:
            ids = session.encode(prompt)
            tokens, logprobs = _tokens_and_logprobs(
                session.stream(prompt_ids=ids, max_new_tokens=NEW, speculate=False, logprobs=3, **penalties))
            assert len(logprobs) == len(tokens)
            ref_tokens, ref_lps = reference_decode(session, ids, NEW, params, 3)
            assert tokens == ref_tokens, prompt
            for got, (lp, top) in zip(logprobs, ref_lps):
                assert got.logprob == pytest.approx(lp, abs=1e-9)
                assert [t for t, _ in got.top] == list(top)
                assert all(v == pytest.approx(top[t], abs=1e-9) for t, v in got.top)
            changed += tokens != session.generate(prompt_ids=ids, max_new_tokens=NEW, speculate=False).token_ids
            for k in (1, 3, 8, "auto"):
                gen = session.stream(prompt_ids=ids, max_new_tokens=NEW, draft_len=k, logprobs=3, **penalties)
                spec = _tokens_and_logprobs(gen)
                assert spec == (tokens, logprobs), (prompt, k)  # the logprobs to the last bit
                accepted += gen.stats.accepted
                # without logprobs, a suffix draft verifies token trees (logprobs verify chains)
                gen = session.stream(prompt_ids=ids, max_new_tokens=NEW, draft_len=k, **penalties)
                assert _tokens_and_logprobs(gen) == (tokens, []), (prompt, k)
                trees += sum(1 for size in gen.stats.tree_sizes if size > 1)
    assert changed > 0  # the penalties change what the model says
    assert accepted > 0  # drafts were judged by penalized rows, and held
    if name == "llama-suffix":
        assert trees > 0  # tree rounds ran under the penalties


def test_repetition_penalty_equals_hugging_face_generate(bundles, models):
    session = Session(bundles("llama-ngram"))
    hf = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32).eval()
    for prompt in PROMPTS[:6]:
        ids = session.encode(prompt)
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW, repetition_penalty=1.4,
                               eos_token_id=session.eos_token_ids, pad_token_id=0)[0, len(ids):].tolist()
        for k in (0, 4):
            got = session.generate(prompt_ids=ids, max_new_tokens=NEW, draft_len=k, repetition_penalty=1.4)
            assert got.token_ids == want, (prompt, k)


@pytest.mark.parametrize("name", ["llama-ngram", "llama-model", "llama-suffix"])
def test_a_batch_penalizes_and_reports_logprobs_as_a_session_alone(name, bundles):
    session = Session(bundles(name))
    kinds = [dict(PENALTIES), dict(LOOPS), dict(presence_penalty=1.5), dict(frequency_penalty=-0.5, repetition_penalty=0.8),
             dict(PENALTIES, temperature=0.9, seed=3, min_p=0.05), dict(LOOPS, draft_len=3), dict(LOOPS, temperature=0.7,
                                                                                                 seed=5)]
    jobs = [(prompt, kinds[i % len(kinds)]) for i, prompt in enumerate(PROMPTS[:10])]
    alone = [_tokens_and_logprobs(session.stream(p, max_new_tokens=24, logprobs=2, **kw)) for p, kw in jobs]
    batch = BatchSession(bundles(name), batch=3, max_queue=len(jobs))
    try:  # all at once: three run, the others wait and join as lanes leave
        with ThreadPoolExecutor(len(jobs)) as pool:
            together = list(pool.map(lambda job: _tokens_and_logprobs(
                batch.stream(job[0], max_new_tokens=24, logprobs=2, **job[1])), jobs))
    finally:
        batch.close()
    assert together == alone


# -- sampled: the chi-square test under penalties and min-p ------------------------------------

SAMPLED = [dict(temperature=1.0, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3),
           dict(temperature=0.8, min_p=0.1, presence_penalty=-1.0)]


def exact_first_two(session, prompt, settings):
    """P(first two generated tokens) from the target engine's own single steps, each row
    penalized by hand under the tokens before it: {(a, b): p}."""
    params = SamplingParams(**settings)
    target, ids = session.target, np.array(prompt)
    target.forward(ids, 0)
    row = target.forward(ids[-1:], len(ids) - 1).copy()
    first = warp(_rows_by_hand(row, params, prompt, len(prompt), [EMPTY]), params)[0]
    dist = {}
    for a in np.flatnonzero(first):
        row = target.forward(np.array([a]), len(ids)).copy()
        second = warp(_rows_by_hand(row, params, prompt + [int(a)], len(prompt), [EMPTY]), params)[0]
        for b in np.flatnonzero(second):
            dist[(a, b)] = first[a] * second[b]
    return dist


def sampled_first_two(session, prompt, settings):
    counts = {}
    for seed in range(SAMPLES):
        ids = session.generate(prompt_ids=prompt, max_new_tokens=3, draft_len=4, seed=seed, **settings).token_ids
        counts[ids[0], ids[1]] = counts.get((ids[0], ids[1]), 0) + 1
    return counts


@pytest.mark.parametrize("kind", ["self-int8", "ngram"])  # the target's int8 self: most of its drafts hold
@pytest.mark.parametrize("setting", range(len(SAMPLED)))
def test_penalized_speculative_sampling_has_the_penalized_target_distribution(small_vocab, kind, setting):
    session, prompt = small_vocab[kind]
    exact = exact_first_two(session, prompt, SAMPLED[setting])
    counts = sampled_first_two(session, prompt, SAMPLED[setting])
    runs = [session.generate(prompt_ids=prompt, max_new_tokens=3, draft_len=4, seed=s, **SAMPLED[setting]).stats
            for s in range(20)]
    assert sum(r.drafted for r in runs) > 0  # the samples' rounds judged drafts under the penalties
    if kind == "self-int8":
        assert sum(r.accepted for r in runs) > 0  # and accepted some: later rows saw them in their history
    pvalue, cells = chi_square_pvalue(exact, counts, SAMPLES)
    assert cells >= 5 and pvalue > ALPHA, f"chi-square p = {pvalue:.2e} over {cells} cells"


def test_the_distribution_test_catches_rows_penalized_without_their_drafts(small_vocab, monkeypatch):
    """A verifier that penalizes every row as the first (blind to the drafts before it) fails."""
    from specdeploy.runtime.decoding import accept as accept_module

    session, prompt = small_vocab["self-int8"]
    exact = exact_first_two(session, prompt, SAMPLED[0])
    blind = lambda logits, params, ids, n, before: penalize(logits, params, ids, n, [EMPTY] * len(before))  # noqa: E731
    monkeypatch.setattr(accept_module, "penalize", blind)
    pvalue, _ = chi_square_pvalue(exact, sampled_first_two(session, prompt, SAMPLED[0]), SAMPLES)
    assert pvalue < ALPHA, f"the blind verifier passed: p = {pvalue:.2e}"
