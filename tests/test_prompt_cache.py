"""The prompt cache: a prompt that begins with what the KV buffers hold prefills only the
rest, and its output is the output of a session that prefills everything."""
import numpy as np
import pytest

from specdeploy.core.errors import BundleError
from specdeploy.runtime import Session
from tiny import PROMPTS

NEW = 24


def _fresh(bundle, ids, backend="ort", **kw):
    """The reference: a session without the cache, so every prompt is prefilled whole."""
    return Session(bundle, prompt_cache=False, backend=backend).generate(prompt_ids=ids, max_new_tokens=NEW, **kw).token_ids


@pytest.mark.parametrize("name", ["llama-model", "llama-ngram", "mistral-model"])
@pytest.mark.parametrize("speculate", [True, False])
def test_a_repeated_prompt_runs_no_prefill_pass_and_gives_the_same_tokens(bundles, name, speculate):
    session = Session(bundles(name))
    ids = session.encode(PROMPTS[6] + " " + PROMPTS[1], chat=True)
    first = session.generate(prompt_ids=ids, max_new_tokens=NEW, speculate=speculate)
    runs = session.target.runs
    again = session.generate(prompt_ids=ids, max_new_tokens=NEW, speculate=speculate)
    assert first.stats.cached_tokens == 0
    assert again.stats.cached_tokens == len(ids) - 1
    assert session.target.runs - runs == again.stats.target_passes  # verify passes only: no prefill
    assert first.token_ids == again.token_ids == _fresh(bundles(name), ids, speculate=speculate)


@pytest.mark.parametrize("name", ["llama-model", "llama-self", "mistral-model"])
def test_a_later_turn_reuses_the_earlier_turn_and_its_answer(bundles, name):
    session = Session(bundles(name))
    ids = session.encode(PROMPTS[0], chat=True)
    answer = session.generate(prompt_ids=ids, max_new_tokens=NEW).token_ids
    turn = ids + answer + session.encode(PROMPTS[4], chat=True)
    later = session.generate(prompt_ids=turn, max_new_tokens=NEW)
    # Every committed token but the last has its K/V written: the answer's last one does not.
    assert later.stats.cached_tokens == len(ids) + len(answer) - 1
    assert later.token_ids == _fresh(bundles(name), turn)


def test_a_prompt_sharing_only_a_prefix_prefills_from_where_it_differs(bundles):
    session = Session(bundles("llama-model"))
    a = session.encode(PROMPTS[2] + " and more words here", chat=True)
    session.generate(prompt_ids=a, max_new_tokens=NEW)
    b = a[:9] + session.encode(PROMPTS[3])
    assert b[9] != a[9]
    out = session.generate(prompt_ids=b, max_new_tokens=NEW)
    assert out.stats.cached_tokens == 9
    assert out.token_ids == _fresh(bundles("llama-model"), b)


def test_sampling_with_a_seed_replays_over_a_cached_prompt(bundles):
    session = Session(bundles("llama-model"))
    ids = session.encode(PROMPTS[1], chat=True)
    kw = dict(temperature=0.9, top_p=0.95, seed=7)
    first = session.generate(prompt_ids=ids, max_new_tokens=NEW, **kw)
    again = session.generate(prompt_ids=ids, max_new_tokens=NEW, **kw)
    assert again.stats.cached_tokens == len(ids) - 1
    assert first.token_ids == again.token_ids == _fresh(bundles("llama-model"), ids, **kw)


def test_anyone_elses_pass_voids_the_cache(bundles):
    # The target as its own draft: every draft token is accepted unless the draft's K/V is wrong.
    session = Session(bundles("llama-same"))
    ids = session.encode(PROMPTS[0], chat=True)
    session.generate(prompt_ids=ids, max_new_tokens=NEW, draft_len=4)
    session.target.forward(np.arange(20, 30), 3)  # overwrites positions 3..12 with other tokens
    session.drafter.engine.forward(np.arange(40, 45), 2)
    for kv in session.drafter.engine.kv_arrays:  # what that pass wrote, at its most poisonous
        kv[:, :, 2:7] = np.nan
    out = session.generate(prompt_ids=ids, max_new_tokens=NEW, draft_len=4)
    assert out.stats.cached_tokens == 0
    assert out.token_ids == _fresh(bundles("llama-same"), ids, draft_len=4)
    assert out.stats.accepted == out.stats.drafted  # the draft re-read the prompt too


class _FailOnce:
    """An InferenceSession whose `at`-th run raises (a pass that dies half-way)."""

    def __init__(self, real, at):
        self.real, self.left = real, at

    def run_with_iobinding(self, binding):
        self.left -= 1
        if self.left == 0:
            raise RuntimeError("the pass died")
        return self.real.run_with_iobinding(binding)

    def __getattr__(self, name):  # io_binding and the rest: the real session's
        return getattr(self.real, name)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_pass_that_failed_voids_what_it_may_have_written(bundles, role):
    session = Session(bundles("llama-model"))
    ids = session.encode(PROMPTS[4], chat=True)
    session.generate(prompt_ids=ids, max_new_tokens=NEW)
    engine = session.target if role == "target" else session.drafter.engine
    real = engine.session
    engine.session = _FailOnce(real, at=3)
    with pytest.raises(BundleError, match="ONNX Runtime failed a pass .*died"):  # k pinned: auto may have learnt not to draft here
        session.generate(prompt_ids=ids + [5, 6, 7], max_new_tokens=NEW, draft_len=4)
    engine.session = real
    out = session.generate(prompt_ids=ids, max_new_tokens=NEW)
    if role == "target":
        assert out.stats.cached_tokens == 0
    assert out.token_ids == _fresh(bundles("llama-model"), ids)


def test_a_generation_closed_early_leaves_a_cache_that_is_still_right(bundles):
    session = Session(bundles("llama-model"))
    ids = session.encode(PROMPTS[6], chat=True)
    gen = session.stream(prompt_ids=ids, max_new_tokens=NEW)
    next(iter(gen))
    gen.close()
    out = session.generate(prompt_ids=ids, max_new_tokens=NEW)
    assert out.stats.cached_tokens == len(ids) - 1
    assert out.token_ids == _fresh(bundles("llama-model"), ids)


def test_forked_sessions_keep_caches_of_their_own(bundles):
    one = Session(bundles("llama-model"))
    two = one.fork()
    a, b = one.encode(PROMPTS[0], chat=True), one.encode(PROMPTS[1], chat=True)
    one.generate(prompt_ids=a, max_new_tokens=NEW)
    out = two.generate(prompt_ids=a, max_new_tokens=NEW)
    assert out.stats.cached_tokens == 0  # two's buffers never held a
    two.generate(prompt_ids=b, max_new_tokens=NEW)
    assert one.generate(prompt_ids=a, max_new_tokens=NEW).stats.cached_tokens == len(a) - 1


def test_without_the_cache_every_prompt_is_prefilled_whole(bundles):
    session = Session(bundles("llama-model"), prompt_cache=False)
    ids = session.encode(PROMPTS[0], chat=True)
    for _ in range(2):
        assert session.generate(prompt_ids=ids, max_new_tokens=NEW).stats.cached_tokens == 0


def test_the_torch_backend_reuses_a_cached_prompt_too(bundles):
    pytest.importorskip("torch")
    session = Session(bundles("llama-model"), backend="torch")
    ids = session.encode(PROMPTS[1], chat=True)
    first = session.generate(prompt_ids=ids, max_new_tokens=NEW)
    again = session.generate(prompt_ids=ids, max_new_tokens=NEW)
    assert again.stats.cached_tokens == len(ids) - 1
    assert first.token_ids == again.token_ids == _fresh(bundles("llama-model"), ids, backend="torch")
