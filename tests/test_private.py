"""`private: true` leaves nothing a later request can observe: not the prompt cache (its
cached_tokens, or the prefill time it saves), not the draft's state. Companion: the same
sequence without `private` does show the shared prefix, so the test can see a leak."""
import pytest

from specdeploy.runtime import Session

SECRET = "My PIN is 4 7 1 9 and my name is Ada. Remember it."


@pytest.mark.parametrize("name", ["llama-model", "llama-ngram", "llama-suffix"])
def test_a_private_request_leaves_no_trace_in_the_next(bundles, name):
    session = Session(bundles(name))
    first = session.generate(SECRET, max_new_tokens=8, private=True)
    assert first.stats.cached_tokens == 0
    follow = session.generate(SECRET + " What is my PIN?", max_new_tokens=8)
    assert follow.stats.cached_tokens == 0  # nothing of the private prompt was left in the buffers' record
    fresh = Session(bundles(name), prompt_cache=False).generate(SECRET + " What is my PIN?", max_new_tokens=8)
    assert follow.token_ids == fresh.token_ids


def test_the_same_sequence_without_private_shows_the_shared_prefix(bundles):
    session = Session(bundles("llama-model"))
    session.generate(SECRET, max_new_tokens=8)
    follow = session.generate(SECRET + " What is my PIN?", max_new_tokens=8)
    assert follow.stats.cached_tokens > 0


def test_a_private_request_reads_no_cache_either(bundles):
    session = Session(bundles("llama-model"))
    session.generate(SECRET, max_new_tokens=8)
    assert session.generate(SECRET + " more", max_new_tokens=4, private=True).stats.cached_tokens == 0


def test_after_a_private_request_the_draft_starts_from_nothing(bundles):
    session = Session(bundles("llama-model"))
    session.generate(SECRET, max_new_tokens=8, private=True)
    assert session.drafter.length == 0  # its K/V of the private text are not trusted by the next request
