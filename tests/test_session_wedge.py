"""Every way out of a generation gives the session back: a request refused after the session
was taken, a consumer that raises inside its loop (with or without `with`), a generation left
unread. Companion: a generation running a round in another thread still makes a second start
an error (one at a time)."""
import threading

import pytest

from specdeploy.runtime import InputError, Session, SessionPool


def test_a_bad_argument_leaves_the_session_free(bundles):
    session = Session(bundles("llama-ngram"))
    for bad in (dict(stop=None), dict(max_new_tokens="abc"), dict(prompt_ids=[1.7]), dict(temperature=None)):
        with pytest.raises(InputError):
            session.generate(**{"prompt_ids": [1, 2, 3], "max_new_tokens": 4, **bad})
    assert len(session.generate(prompt_ids=[1, 2, 3], max_new_tokens=4).token_ids) == 4


def test_a_consumer_that_raises_inside_its_loop_does_not_wedge_the_session(bundles):
    session = Session(bundles("llama-ngram"))
    gen = session.stream(prompt_ids=[1, 2, 3], max_new_tokens=16)
    try:
        for _ in gen:
            raise ValueError("the consumer's own bug")
    except ValueError:
        pass
    # `gen` is still referenced here: the next generation supersedes it instead of failing
    assert len(session.generate(prompt_ids=[1, 2, 3], max_new_tokens=4).token_ids) == 4
    with pytest.raises(InputError, match="another one started on its session"):
        next(gen)
    assert gen.stats.finish_reason == "cancelled"
    with pytest.raises(ValueError):
        with session.stream(prompt_ids=[1, 2, 3], max_new_tokens=16) as held:
            next(held)
            raise ValueError
    assert held.ended


def test_a_pool_keeps_serving_after_a_bad_request(bundles):
    pool = SessionPool(bundles("llama-ngram"), workers=1, max_queue=2)
    with pytest.raises(InputError):
        pool.generate(prompt_ids=[1, 2, 3], max_new_tokens=4, stop=None)
    assert len(pool.generate(prompt_ids=[1, 2, 3], max_new_tokens=4).token_ids) == 4


def test_a_round_running_in_another_thread_still_refuses_a_second_start(bundles):
    session = Session(bundles("llama-ngram"))
    gen = session.stream(prompt_ids=[1, 2, 3], max_new_tokens=32)
    inside, release = threading.Event(), threading.Event()
    rounds = gen._pieces

    def slow():  # the first round waits inside next() until the test has tried to start another
        inside.set()
        release.wait(10)
        yield from rounds

    gen._pieces = slow()
    worker = threading.Thread(target=lambda: next(gen))
    worker.start()
    inside.wait(10)
    with pytest.raises(InputError, match="already generating in another thread"):
        session.stream(prompt_ids=[1, 2, 3], max_new_tokens=4)
    release.set()
    worker.join(10)
    gen.close()
    assert len(session.generate(prompt_ids=[1, 2, 3], max_new_tokens=4).token_ids) == 4
