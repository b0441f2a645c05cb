"""Structured output under speculation: each row of a verify pass masked by the grammar under
the tokens before it, so that constrained speculative output equals constrained plain output
token for token (greedy, every draft kind, k = 1, 3, 8 and auto, in a Session and in a batch),
seeded sampling under a grammar keeps the masked target's distribution (the chi-square test,
with a companion showing that masking only the first row fails it); drafts the grammar forbids
are cut, the tokens it forces drafted for free; bad structures refused with one line naming the
field, before any work."""
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from specdeploy.core.errors import InputError
from specdeploy.runtime import Session
from specdeploy.runtime.decoding import grammar as grammar_module
from specdeploy.runtime.decoding.batch import BatchSession
from specdeploy.runtime.decoding.request import structure_of
from specdeploy.runtime.decoding.sampling import SamplingParams, warp
from test_sampling import ALPHA, SAMPLES, chi_square_pvalue
from tiny import PROMPTS

NEW = 40
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
          "required": ["a", "b"], "additionalProperties": False}
STRUCTURES = {
    "json": {"json": SCHEMA},
    "json_object": {"json_object": True},
    "regex": {"regex": r"[a-z]{2,6}( [a-z]{2,6}){0,4}\."},
    "grammar": {"grammar": 'start: item ("," item)*\nitem: /[0-9]{1,3}/ | "yes" | "no"'},
    "choice": {"choice": ["alpha", "beta gamma", "delta"]},
}


def _matches(session, structure, tokens) -> bool:
    """Whether the grammar takes these tokens in turn (a fresh matcher): the output is in it."""
    constraint = session.grammars.constraint(session.grammars.compile(structure_of(structure)))
    return constraint.valid(np.array(tokens, dtype=np.int64)) == len(tokens) or constraint.matcher.is_stopped()


@pytest.mark.parametrize("name", ["llama-ngram", "llama-suffix", "llama-model"])
def test_constrained_speculative_output_equals_constrained_plain(name, bundles):
    session = Session(bundles(name))
    drafted = forced = ended = 0
    for kind, structure in STRUCTURES.items():
        for prompt in PROMPTS[:3]:
            plain = session.generate(prompt, max_new_tokens=NEW, speculate=False, structure=structure)
            free = session.generate(prompt, max_new_tokens=NEW, speculate=False)
            assert plain.token_ids != free.token_ids  # the grammar changes what the model says
            assert _matches(session, structure, plain.token_ids), (kind, plain.text)
            if plain.stats.finish_reason == "eos":
                ended += 1
                if kind in ("json", "json_object"):
                    json.loads(plain.text)
            for k in (1, 3, 8, "auto"):
                spec = session.generate(prompt, max_new_tokens=NEW, draft_len=k, structure=structure)
                assert spec.token_ids == plain.token_ids, (kind, prompt, k)
                drafted += spec.stats.drafted
                forced += spec.stats.forced
    assert drafted > 0 and forced > 0 and ended > 0


@pytest.mark.parametrize("name", ["llama-ngram", "llama-suffix", "llama-model"])
def test_a_batch_constrains_each_lane_as_a_session_alone(name, bundles):
    session = Session(bundles(name))
    kinds = list(STRUCTURES.values())
    jobs = []
    for i, prompt in enumerate(PROMPTS[:12]):  # greedy and seeded sampled lanes, each grammar, some pinned
        jobs.append((prompt, dict(structure=kinds[i % len(kinds)], **(dict(temperature=0.8, seed=i) if i % 2 else {}),
                                  **(dict(draft_len=3) if i % 3 == 2 else {}),
                                  private=True)))  # a suffix index of its own text alone: the order others ran in
        # (which a batch changes) would change a sampled lane's drafts, and so its random draws
    jobs.append((PROMPTS[0], {}))  # and one free lane beside them
    alone = [session.generate(p, max_new_tokens=30, **kw).token_ids for p, kw in jobs]
    batch = BatchSession(bundles(name), batch=3, max_queue=len(jobs))
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            together = list(pool.map(lambda job: batch.generate(job[0], max_new_tokens=30, **job[1]).token_ids, jobs))
    finally:
        batch.close()
    assert together == alone


def test_drafts_the_grammar_forbids_are_cut_and_forced_tokens_come_free(bundles):
    session = Session(bundles("llama-ngram"))
    long_literal = {"grammar": 'start: "the quick brown fox jumps over the lazy dog, " /[a-z]{1,8}/'}
    out = session.generate(PROMPTS[0], max_new_tokens=NEW, draft_len=4, structure=long_literal)
    plain = session.generate(PROMPTS[0], max_new_tokens=NEW, speculate=False, structure=long_literal)
    assert out.token_ids == plain.token_ids
    assert out.text.startswith("the quick brown fox jumps over the lazy dog, ")
    assert out.stats.forced >= 10  # the literal's tokens, each the only one the grammar allowed
    assert out.stats.target_passes < plain.stats.target_passes  # drafted for free, verified together
    # an n-gram draft that leaves the grammar is cut there: every verified draft was one it allowed
    judge_cuts = []
    original = grammar_module.Constraint.valid

    def spy(self, tokens, after=None):
        n = original(self, tokens, after)
        judge_cuts.append((tokens.shape[0], n))
        return n

    grammar_module.Constraint.valid = spy
    try:
        digits = {"regex": r"[0-9 ]{1,30}"}  # the prompt's continuations are words: the drafts leave it
        repeat = "one two three one two three one two three one two"
        cut = session.generate(repeat, max_new_tokens=20, draft_len=4, structure=digits)
    finally:
        grammar_module.Constraint.valid = original
    assert cut.token_ids == session.generate(repeat, max_new_tokens=20, speculate=False, structure=digits).token_ids
    assert any(n < given for given, n in judge_cuts)  # some drafts were cut


def test_forced_tokens_and_the_lookup_after_them_stay_within_the_room_left(bundles):
    """A forced literal longer than the tokens left, with an n-gram lookup after it: the round's
    drafts never pass the request's last token (they once did, and the verify pass wrote past
    the KV buffer)."""
    session = Session(bundles("llama-ngram"))
    literal = {"grammar": 'start: "' + "abc " * 60 + '"'}
    ids = session.encode("abc abc abc abc abc abc abc abc")
    room = session.bundle.max_seq - len(ids)
    for k in (4, "auto"):
        out = session.generate(prompt_ids=ids, max_new_tokens=room, draft_len=k, structure=literal)
        assert len(out.token_ids) == room and out.stats.forced > 0
    batch = BatchSession(bundles("llama-ngram"), batch=2)
    try:
        assert len(batch.generate(prompt_ids=ids, max_new_tokens=room, draft_len=4, structure=literal).token_ids) == room
    finally:
        batch.close()


@pytest.mark.parametrize("structure, fragment", [
    ({"json": {"type": "foo"}}, "does not compile"),
    ({"regex": "[0-9]+("}, "does not compile"),
    ({"grammar": "start: x\nx: 'a' | "}, "does not compile"),
    ({"regex": ""}, "'regex' must be non-empty text"),
    ({"json": "not json"}, "'json' must be a JSON schema"),
    ({"choice": []}, "'choice' must be a non-empty array"),
    ({"xml": "<a/>"}, "must be an object with one of json"),
])
def test_bad_structures_are_refused_in_one_line_before_any_work(bundles, structure, fragment):
    session = Session(bundles("llama-ngram"))
    with pytest.raises(InputError) as e:
        session.stream(PROMPTS[0], max_new_tokens=8, structure=structure)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert session.target.runs == 0  # nothing ran


def test_a_grammar_that_cannot_finish_ends_at_the_token_limit(bundles):
    session = Session(bundles("llama-ngram"))
    out = session.generate(PROMPTS[0], max_new_tokens=6, draft_len=3, structure={"regex": "[a-z]{20}"})
    assert len(out.token_ids) == 6 and out.stats.finish_reason == "length"


# -- sampled: the chi-square test under a grammar ---------------------------------------------

def token_class(session, prompt) -> dict:
    """A grammar of one or more of five one-character tokens of the tiny vocabulary: the prompt's
    (so the n-gram draft, the prompt's third token, is one the grammar allows) and two more."""
    chars = {session.tokenizer.decode([t]) for t in prompt[:3] + [3, 4]}
    return {"grammar": "start: t+\nt: " + " | ".join(json.dumps(c) for c in sorted(chars))}


def _exact_first_two(session, prompt, params, structure):
    """P(first two tokens) from the target's single steps, each masked by the grammar after the
    tokens before it: {(a, b): p}."""
    grammars = session.grammars
    grammar = grammars.compile(structure_of(structure))
    target, ids = session.target, np.array(prompt)
    target.forward(ids, 0)
    first_mask = grammars.constraint(grammar).allowed()
    first = warp(np.where(first_mask, target.forward(ids[-1:], len(ids) - 1)[0], -np.inf), params)
    dist = {}
    for a in np.flatnonzero(first):
        constraint = grammars.constraint(grammar)
        constraint.commit([a])
        row = target.forward(np.array([a]), len(ids))[0]
        second = warp(np.where(constraint.allowed(), row, -np.inf), params)
        for b in np.flatnonzero(second):
            dist[(a, b)] = first[a] * second[b]
    return dist


def _sampled_first_two(session, prompt, params, structure):
    counts = {}
    for seed in range(SAMPLES):
        ids = session.generate(prompt_ids=prompt, max_new_tokens=3, draft_len=4, seed=seed, structure=structure,
                               temperature=params.temperature).token_ids
        counts[ids[0], ids[1]] = counts.get((ids[0], ids[1]), 0) + 1
    return counts


@pytest.mark.parametrize("kind", ["self-int8", "ngram"])
def test_constrained_speculative_sampling_has_the_masked_target_distribution(small_vocab, kind):
    session, prompt = small_vocab[kind]
    params, structure = SamplingParams(1.0), token_class(session, prompt)
    exact = _exact_first_two(session, prompt, params, structure)
    runs = [session.generate(prompt_ids=prompt, max_new_tokens=3, draft_len=4, seed=s, structure=structure,
                             temperature=1.0).stats for s in range(20)]
    assert sum(r.drafted for r in runs) > 0
    pvalue, cells = chi_square_pvalue(exact, _sampled_first_two(session, prompt, params, structure), SAMPLES)
    assert cells >= 5 and pvalue > ALPHA, f"chi-square p = {pvalue:.2e} over {cells} cells"


def test_the_distribution_test_catches_a_verifier_that_masks_the_first_row_only(small_vocab, monkeypatch):
    session, prompt = small_vocab["self-int8"]
    params, structure = SamplingParams(1.0), token_class(session, prompt)
    exact = _exact_first_two(session, prompt, params, structure)
    first_only = grammar_module.mask_rows
    monkeypatch.setattr("specdeploy.runtime.decoding.accept.mask_rows", lambda logits, masks: first_only(logits, masks[:1]))
    monkeypatch.setattr(grammar_module.Constraint, "commit", lambda self, tokens: None)  # takes whatever comes
    counts = _sampled_first_two(session, prompt, params, structure)
    outside = sum(n for pair, n in counts.items() if pair not in exact)
    pvalue = chi_square_pvalue(exact, counts, SAMPLES)[0] if not outside else 0.0
    assert outside or pvalue < ALPHA, f"the broken verifier passed: p = {pvalue:.2e}"
