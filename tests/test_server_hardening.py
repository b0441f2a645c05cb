"""Issue 18, the server's part: a client that goes away frees its session and its queue
slot, SIGTERM drains within a bound, limits are checked before any expensive work, no
input reaches a 500, and /metrics counts every outcome. Over real loopback HTTP."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specdeploy.runtime.decoding.batch import BatchSession
from specdeploy.runtime.serving.pool import SessionPool
from loopback import Server, free_port, slow_down, slow_serve_script, sse_events, sse_text
from tiny import PROMPTS

LONG = {"max_tokens": 100, "temperature": 0, "draft_len": 0}  # 100 slowed passes: >= 5 s


def _pool(kind: str, bundle, max_queue: int, **options):
    """Today's session pool, or continuous batching (serve --batch) over a batch of one."""
    if kind == "batch":
        return BatchSession(bundle, batch=1, max_queue=max_queue, **options)
    return SessionPool(bundle, workers=1, max_queue=max_queue, **options)


def _occupy(pool):
    """Make the only session (the batch's only slot) busy; -> what frees it."""
    if isinstance(pool, BatchSession):  # a long request, slowed down: it runs until closed
        slow_down(pool, 0.05)
        return pool.stream(PROMPTS[0], max_new_tokens=100, speculate=False).close
    held = pool.acquire()
    return lambda: pool.release(held)


@pytest.fixture(scope="module", params=["pool", "batch"])
def slow_server(bundles, request):
    """One session (or a batch of one), a queue of 2, every target pass 50 ms: a long request lasts seconds."""
    pool = _pool(request.param, bundles("llama-model"), 2)
    slow_down(pool, 0.05)
    with Server(pool) as s:
        yield s


@pytest.fixture(scope="module", params=["pool", "batch"])
def server(bundles, request):
    pool = _pool(request.param, bundles("llama-model"), 4)
    with Server(pool) as s:
        yield s


# -- 1. a client that leaves frees its session and its queue slot --------------------------

def test_a_streaming_client_that_disconnects_frees_its_session_at_once(slow_server):
    before = slow_server.requests_by_status("completions").get("cancelled", 0)
    body = {"prompt": PROMPTS[0], "stream": True, **LONG}
    with httpx.stream("POST", slow_server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r)
        next(events), next(events)
    # the client is gone after two events: the session returns within a round or two
    assert slow_server.wait_idle(within=1.5) < 1.5
    t0 = time.perf_counter()
    r = httpx.post(slow_server.url + "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and time.perf_counter() - t0 < 3
    assert slow_server.requests_by_status("completions").get("cancelled", 0) == before + 1


def test_a_chat_stream_left_midway_frees_its_session(slow_server):
    body = {"messages": [{"role": "user", "content": PROMPTS[2]}], "stream": True, **LONG, "max_tokens": 80}
    with httpx.stream("POST", slow_server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        events = sse_events(r)
        next(events), next(events), next(events)
    slow_server.wait_idle(within=1.5)


def test_a_client_that_leaves_a_non_streaming_request_frees_its_session(slow_server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.url + "/v1/completions", json={"prompt": PROMPTS[3], **LONG}, timeout=0.6)
    slow_server.wait_idle(within=1.5)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_gives_up_while_queued_gives_back_its_queue_slot(slow_server, stream):
    pool = slow_server.pool
    release = _occupy(pool)
    try:
        body = {"prompt": PROMPTS[4], "max_tokens": 4, "stream": stream}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(slow_server.url + "/v1/completions", json=body, timeout=0.5)
        t0 = time.perf_counter()
        while pool.waiting:
            assert time.perf_counter() - t0 < 1.0, "the vanished client still holds its queue slot"
            time.sleep(0.02)
    finally:
        release()
    slow_server.wait_idle(within=1.0)  # and it did not take the session once it came free


def test_sigterm_drains_in_flight_requests_then_stops_within_the_grace_period(bundles):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    script = slow_serve_script(bundles("llama-model"), port, workers=1, max_queue=4, graceful_seconds=1.5)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not start"
            time.sleep(0.1)
        got = []

        def long_stream():
            body = {"prompt": PROMPTS[0], "stream": True, **LONG}  # would run >= 5 s
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                    for event in sse_events(r):
                        got.append(event)
            except httpx.HTTPError:
                pass  # cut at the end of the grace period: allowed

        t = threading.Thread(target=long_stream)
        t.start()
        while len(got) < 2:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        t0 = time.perf_counter()
        out, _ = proc.communicate(timeout=15)
        stopped = time.perf_counter() - t0
        t.join(timeout=5)
        assert not t.is_alive()
        # uvicorn re-raises the signal once it has shut down: the exit status says SIGTERM
        assert proc.returncode in (0, -signal.SIGTERM), out.decode()
        assert b"Traceback" not in out, out.decode()
        assert stopped < 1.5 + 3.0, f"SIGTERM took {stopped:.1f}s with a grace period of 1.5s"
        print(f"\nSIGTERM: stopped {stopped:.1f}s after the signal (grace 1.5s), {len(got)} of 100 events sent")
        assert len(got) < 100
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_lets_a_request_that_fits_in_the_grace_period_finish(bundles):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    script = slow_serve_script(bundles("llama-model"), port, workers=1, max_queue=4, graceful_seconds=1.5)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline and proc.poll() is None, "server did not start"
            time.sleep(0.1)
        body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "draft_len": 0}  # about 0.7 s
        with ThreadPoolExecutor(1) as ex:
            answer = ex.submit(httpx.post, url + "/v1/completions", json=body, timeout=30)
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            r = answer.result()
        assert r.status_code == 200 and r.json()["specdeploy"]["finish_reason"] in ("length", "eos"), r.text
        proc.communicate(timeout=15)
        assert proc.returncode in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- 2. limits before work -------------------------------------------------------------------

def _count_encodes(pool):
    """Record the length of every text the tokenizer is asked to encode or render."""
    seen = []
    tok = pool.tokenizer
    encode, render = tok.encode, tok.apply_chat_template

    def counting_encode(text, *a, **k):
        seen.append(("encode", len(text)))
        return encode(text, *a, **k)

    def counting_render(messages, *a, **k):
        seen.append(("render", sum(len(m["content"]) for m in messages)))
        return render(messages, *a, **k)

    tok.encode, tok.apply_chat_template = counting_encode, counting_render
    return seen


def test_a_body_past_the_limit_gets_413_with_one_line(bundles):
    pool = SessionPool(bundles("llama-model"), workers=1, max_queue=1)
    with Server(pool, max_body_bytes=64 * 1024) as s:
        big = json.dumps({"prompt": "x" * 100_000})
        r = httpx.post(s.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413
        message = r.json()["error"]["message"]
        assert "\n" not in message and "65536" in message
        # without a content-length (chunked), the limit holds as the body arrives
        r = httpx.post(s.url + "/v1/completions", content=iter([big[:50_000].encode(), big[50_000:].encode()]),
                       headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "The", "max_tokens": 2}).status_code == 200
        assert s.requests_by_status("completions").get("413") == 2


def test_a_prompt_past_the_character_bound_is_refused_before_tokenizing(server):
    seen = _count_encodes(server.pool)
    try:
        huge = "The quick brown fox " * 50_000  # 1 MB of text: at most 128 tokens fit
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": huge}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "characters" in r.json()["error"]["message"]
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": huge}]},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert time.perf_counter() - t0 < 2
        assert not [s for s in seen if s[1] >= len(huge)], f"tokenized before the bound was checked: {seen}"
    finally:
        del server.pool.tokenizer.encode, server.pool.tokenizer.apply_chat_template


def test_chat_rendering_and_tokenizing_run_off_the_event_loop(server):
    tok = server.pool.tokenizer
    render = tok.apply_chat_template

    def slow_render(*a, **k):
        time.sleep(1.5)
        return render(*a, **k)

    tok.apply_chat_template = slow_render
    try:
        with ThreadPoolExecutor(1) as ex:
            chat = ex.submit(httpx.post, server.url + "/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=30)
            time.sleep(0.3)
            t0 = time.perf_counter()
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            assert time.perf_counter() - t0 < 0.5, "the event loop was blocked by the chat template"
            assert chat.result().status_code == 200
    finally:
        del tok.apply_chat_template


@pytest.mark.parametrize("kind", ["pool", "batch"])
def test_a_full_queue_refuses_before_any_tokenizing(bundles, kind):
    pool = _pool(kind, bundles("llama-model"), 0)
    with Server(pool) as s:
        release = _occupy(pool)
        seen = _count_encodes(pool)
        try:
            r = httpx.post(s.url + "/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert r.status_code == 503
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "The quick"})
            assert r.status_code == 503 and r.headers.get("retry-after")
        finally:
            release()
        assert seen == []


# -- 3. inputs that reached a 500; every outcome counted ---------------------------------------

BAD = [
    ({"prompt": "hi", "seed": -1}, "seed"),
    ({"prompt": "hi", "seed": 2**64}, "seed"),
    ({"prompt": "hi", "seed": 10**30}, "seed"),
    ({"prompt": [10**23]}, "prompt"),
    ({"prompt": [1, -(2**70)]}, "prompt"),
    ({"prompt": [1, -1]}, "prompt"),
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"prompt": "hi", "stop": ["\udfff"]}, "stop"),
    ({"prompt": "hi", "temperature": 10**400}, "temperature"),
    ({"prompt": "hi", "top_p": 10**400}, "top_p"),
    ({"prompt": "hi", "draft_len": 10**20}, "draft_len"),
    ({"prompt": "hi", "draft_len": -3}, "draft_len"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body, param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_inputs_that_reached_a_500_get_a_400_naming_the_field(server, body, param, stream):
    content = json.dumps({**body, "stream": stream})  # ASCII: lone surrogates as \ud800 escapes
    r = httpx.post(server.url + "/v1/completions", content=content, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400, r.text  # with stream: true too, before any 200 starts
    error = r.json()["error"]
    assert error["param"] == param and "\n" not in error["message"], error


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "a\xed\xa0\x80b"}', "prompt"),  # an encoded lone surrogate: invalid UTF-8
    (b'{"prompt": "a\xffb"}', None),  # not UTF-8 at all: the body is not JSON text
    (b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages"),
    (b"[" * 100_000 + b"]" * 100_000, None),  # nested past the parser's recursion limit
    (b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", None),  # past Python's int digit limit
])
def test_invalid_text_and_pathological_json_get_a_400(server, raw, param):
    endpoint = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = httpx.post(server.url + endpoint, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_streamed_request_with_a_bad_seed_is_a_400_and_counted_as_one(server):
    before = server.requests_by_status("completions")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "seed": -1, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    after = server.requests_by_status("completions")
    assert after.get("400", 0) == before.get("400", 0) + 1
    assert after.get("200", 0) == before.get("200", 0)


def test_an_unexpected_error_is_a_500_json_that_metrics_count(bundles):
    pool = SessionPool(bundles("llama-model"), workers=1, max_queue=2)
    for session in pool.sessions:
        def broken(*a, **k):
            raise RuntimeError("the engine broke")
        session.target.forward = broken
    with Server(pool) as s:
        for stream in (False, True):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "The", "max_tokens": 4, "stream": stream})
            assert r.status_code == 500, r.text
            assert r.json()["error"]["type"] == "server_error"
            assert "Traceback" not in r.text
        assert s.requests_by_status("completions").get("500") == 2
        assert s.health()["in_flight"] == 0  # the session came back after each failure


@pytest.mark.parametrize("kind", ["pool", "batch"])
def test_metrics_count_cancelled_and_timed_out_requests(bundles, kind):
    pool = _pool(kind, bundles("llama-model"), 2, wait_seconds=0.3)
    with Server(pool) as s:
        release = _occupy(pool)
        try:
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "The", "max_tokens": 2}, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["type"] == "timeout"
        finally:
            release()
        if kind == "pool":
            slow_down(pool, 0.05)
        with httpx.stream("POST", s.url + "/v1/completions", json={"prompt": "The", "stream": True, **LONG}) as r:
            next(sse_events(r))
        s.wait_idle(within=1.5)
        counts = s.requests_by_status("completions")
        assert counts.get("timeout") == 1 and counts.get("cancelled") == 1, counts


def test_the_server_still_answers_after_the_hostile_inputs(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                                                         "stream": True})
    assert r.status_code == 200
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True}) as r:
        assert sse_text(r)
    server.wait_idle(within=1.0)


def test_serve_passes_its_limits_and_grace_period_to_the_server(monkeypatch, bundles):
    """The limits as given; told neither --batch nor --workers, the server batches as the bundle allows
    (its graphs carry 8 sequences a pass here), and says so."""
    from click.testing import CliRunner

    from specdeploy.cli import main
    from specdeploy.runtime.serving import server as server_module

    seen = {}
    monkeypatch.setattr(server_module, "serve", lambda *a, **k: seen.update(args=a, kwargs=k))
    bundle = str(bundles("llama-ngram"))
    out = CliRunner().invoke(main, ["serve", bundle, "--max-body-bytes", "1000", "--max-prompt-chars", "500",
                                    "--queue-timeout", "2.5", "--graceful-seconds", "3"])
    assert out.exit_code == 0, out.output
    assert seen["kwargs"] == {"max_body_bytes": 1000, "graceful_seconds": 3.0, "queue_timeout": 2.5,
                              "max_prompt_chars": 500, "device": None, "trt_ep": False, "batch": 8}
    assert seen["args"][3] == 1 and "batches of up to 8" in out.output
    out = CliRunner().invoke(main, ["serve", bundle, "--batch", "4"])
    assert out.exit_code == 0 and seen["kwargs"]["batch"] == 4, out.output
    out = CliRunner().invoke(main, ["serve", bundle, "--workers", "2"])  # a pool, as asked
    assert out.exit_code == 0 and seen["kwargs"]["batch"] is None and seen["args"][3] == 2, out.output
    assert "2 session(s)" in out.output
    out = CliRunner().invoke(main, ["serve", bundle, "--batch", "4", "--workers", "2"])
    assert out.exit_code != 0 and "--batch runs every request in one batch" in out.output
    out = CliRunner().invoke(main, ["serve", bundle, "--graceful-seconds", "-1"])
    assert out.exit_code != 0 and "--graceful-seconds" in out.output
