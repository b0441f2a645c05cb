"""The server keeps its promises at shutdown and under large bodies, and serves only the bundle
it was pinned to. Over real loopback HTTP: `serve` in a subprocess that gets SIGTERM, or
`create_app` in a thread (tests/loopback.py).

1. Past the grace period every answer still running ends whole: a stream with an error event
   and `data: [DONE]` (never cut inside a chunk), a non-stream request and a request waiting
   for a session with a JSON 503; a new request during the grace period gets a JSON 503.
2. Large bodies are parsed off the event loop: /health answers while they are.
3. `serve --digest`: another bundle is refused in one line before listening; /health states
   the digest served.
"""
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

from specdeploy.core.errors import BundleError
from specdeploy.core.manifest import load_bundle
from specdeploy.runtime.serving import server
from specdeploy.runtime.serving.pool import SessionPool
from loopback import Server, free_port, slow_serve_script
from tiny import PROMPTS

GRACE = 1.5
LONG = {"max_tokens": 100, "temperature": 0, "draft_len": 0}  # 100 slowed passes: >= 5 s, past the grace

def start_serve(bundle, **options):
    """`serve` in a subprocess (two slowed sessions, a queue of 4); (process, url) once /health answers."""
    port = free_port()
    script = slow_serve_script(bundle, port, workers=2, max_queue=4, graceful_seconds=GRACE, **options)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "server did not start"
        time.sleep(0.1)


def read_stream(url, body, into: list) -> None:
    """Every raw `data:` line of a stream, then "END" if the response ended whole, or the error
    that cut it."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            into.append(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: "):
                    into.append(line[6:])
        into.append("END")
    except httpx.HTTPError as e:
        into.append(e)


def post(url, body) -> httpx.Response | Exception:
    try:
        return httpx.post(url + "/v1/completions", json=body, timeout=30)
    except httpx.HTTPError as e:
        return e


def assert_json_503(r) -> None:
    assert isinstance(r, httpx.Response), f"no answer: {r!r}"
    assert r.status_code == 503 and r.headers["content-type"].startswith("application/json"), r.text
    error = r.json()["error"]
    assert error["message"] and "\n" not in error["message"] and error["type"], error


# -- 1. shutdown past the grace period ------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_past_the_grace_period_every_answer_ends_whole_and_new_requests_get_503(bundles, sig):
    proc, url = start_serve(bundles("llama-model"))
    try:
        stream: list = []
        streaming = threading.Thread(target=read_stream,
                                     args=(url, {"prompt": PROMPTS[0], "stream": True, **LONG}, stream))
        streaming.start()
        with ThreadPoolExecutor(3) as ex:
            deadline = time.time() + 30
            while len(stream) < 3:  # the status and two events: the stream is generating
                assert time.time() < deadline and streaming.is_alive(), stream
                time.sleep(0.02)
            generating = ex.submit(post, url, {"prompt": PROMPTS[4], **LONG})  # the second session
            while httpx.get(url + "/health", timeout=5).json()["in_flight"] < 2:
                assert time.time() < deadline
                time.sleep(0.02)
            waiting = [ex.submit(post, url, {"prompt": PROMPTS[2 + stream_it], **LONG, "stream": stream_it})
                       for stream_it in (False, True)]  # no session free: they wait in the queue
            while httpx.get(url + "/health", timeout=5).json()["waiting"] < 2:
                assert time.time() < deadline
                time.sleep(0.02)

            proc.send_signal(sig)
            t0 = time.perf_counter()
            time.sleep(0.4)  # within the grace period: still listening, and refusing new work
            late = post(url, {"prompt": PROMPTS[3], "max_tokens": 2})
            assert_json_503(late)
            health = httpx.get(url + "/health", timeout=5)
            assert health.status_code == 503 and health.json()["status"] == "stopping"

            out, _ = proc.communicate(timeout=15)
            stopped = time.perf_counter() - t0
            streaming.join(timeout=5)
            answers = [generating.result(timeout=5)] + [w.result(timeout=5) for w in waiting]
        out = out.decode()
        assert proc.returncode in (0, -sig), out  # uvicorn re-raises the signal once it has shut down
        assert "Traceback" not in out, out
        assert stopped < GRACE + 3.0, f"{sig.name} took {stopped:.1f}s with a grace period of {GRACE}s"

        # the stream: whole chunks, then the error event, then [DONE], then the end of the response
        assert stream[0] == 200 and stream[-1] == "END", f"the stream was cut: {stream[-3:]!r}"
        assert stream[-2] == "[DONE]", stream[-3:]
        last = json.loads(stream[-3])
        assert set(last) == {"error"} and last["error"]["message"] and last["error"]["type"], last
        chunks = [json.loads(data) for data in stream[1:-3]]
        assert len(chunks) >= 2 and all("choices" in c for c in chunks)
        assert len(chunks) < 100  # it did not run to its end

        # the request generating without a stream, and both waiting ones: a JSON 503 each
        for r in answers:
            assert_json_503(r)
        print(f"\n{sig.name}: stopped {stopped:.1f}s after the signal (grace {GRACE}s), {len(chunks)} chunks streamed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- 2. large bodies off the event loop --------------------------------------------------------

BIG = json.dumps({"prompt": [1] * 1_300_000, "max_tokens": 1}).encode()  # 3.9 MB of token ids: a 400, slowly
CONCURRENT = 8


def test_large_bodies_in_flight_do_not_stall_health(bundles):
    pool = SessionPool(bundles("llama-model"), workers=1, max_queue=2)
    headers = {"content-type": "application/json"}
    with Server(pool) as s, httpx.Client(timeout=60) as client:

        def send_big():
            return client.post(s.url + "/v1/completions", content=BIG, headers=headers)

        def probe() -> float:
            t0 = time.perf_counter()
            assert httpx.get(s.url + "/health", timeout=60).status_code == 200
            return time.perf_counter() - t0

        t0 = time.perf_counter()
        assert send_big().status_code == 400  # too many tokens: parsed and checked, then refused
        alone = time.perf_counter() - t0  # this run's cost of one large body
        with ThreadPoolExecutor(CONCURRENT) as ex:
            bodies = [ex.submit(send_big) for _ in range(CONCURRENT)]
            time.sleep(min(0.1, alone / 4))  # the bodies are arriving, then parsing
            probes = []
            while not all(b.done() for b in bodies):
                probes.append(probe())
                time.sleep(0.01)
            assert {b.result().status_code for b in bodies} == {400}
        worst = max(probes)
        print(f"\none large body alone: {alone:.2f}s; /health with {CONCURRENT} in flight: worst {worst:.3f}s "
              f"of {len(probes)} probes")
        # On the event loop, a probe waits for the bodies parsed ahead of it: several times one body's
        # own time. Off it, for a JSON parse or two (each holds the GIL): a fraction of one body's time.
        assert worst < alone, f"/health took {worst:.2f}s while large bodies parsed ({alone:.2f}s each)"


def test_a_large_body_still_gets_its_answer_and_the_limit_holds(bundles):
    pool = SessionPool(bundles("llama-model"), workers=1, max_queue=2)
    with Server(pool, max_body_bytes=1 << 20) as s:
        # parsed in a worker thread (past OFF_LOOP_BYTES): the same answer as a small body's
        padded = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stop": ["x" * 10]}
        small = httpx.post(s.url + "/v1/completions", json=padded, timeout=30)
        big = json.dumps(padded) + " " * server.OFF_LOOP_BYTES  # JSON allows the trailing space
        r = httpx.post(s.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                       timeout=30)
        assert small.status_code == r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == small.json()["choices"][0]["text"]
        bad = b'{"prompt": "hi", "seed": -1}' + b" " * server.OFF_LOOP_BYTES
        r = httpx.post(s.url + "/v1/completions", content=bad, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
        too_big = b" " * ((1 << 20) + 1)
        r = httpx.post(s.url + "/v1/completions", content=too_big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "1048576" in r.json()["error"]["message"]


# -- 3. a pinned digest -------------------------------------------------------------------------

OTHER = "sha256:" + "0" * 64


def test_serve_refuses_another_bundle_before_loading_or_listening(bundles, monkeypatch):
    def no_pool(*a, **k):
        raise AssertionError("the sessions loaded before the digest was checked")

    monkeypatch.setattr(server, "SessionPool", no_pool)
    with pytest.raises(BundleError, match=r"bundle digest sha256:[0-9a-f]{64} is not the sha256:0{64} required"):
        server.serve(str(bundles("llama-model")), port=free_port(), digest=OTHER)


def test_the_cli_refuses_another_bundle_in_one_line(bundles):
    from click.testing import CliRunner

    from specdeploy.cli import main

    out = CliRunner().invoke(main, ["serve", str(bundles("llama-model")), "--port", str(free_port()),
                                    "--digest", OTHER])
    assert out.exit_code == 1
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "bundle digest" in lines[0], out.output
    out = CliRunner().invoke(main, ["serve", str(bundles("llama-model")), "--digest", "sha256:abc"])
    assert out.exit_code == 2 and "--digest" in out.output


def test_the_cli_passes_the_pinned_digest_on_and_says_it(bundles, monkeypatch):
    from click.testing import CliRunner

    from specdeploy.cli import main

    pinned = load_bundle(bundles("llama-model"), verify=False).digest
    seen = {}
    monkeypatch.setattr(server, "serve", lambda *a, **k: seen.update(args=a, kwargs=k))
    out = CliRunner().invoke(main, ["serve", str(bundles("llama-model")), "--port", str(free_port()),
                                    "--digest", pinned])
    assert out.exit_code == 0, out.output
    assert seen["kwargs"]["digest"] == pinned
    assert pinned in out.output  # the startup line states the digest served


def test_health_states_the_digest_served(bundles):
    pool = SessionPool(bundles("llama-model"), workers=1, max_queue=1)
    with Server(pool) as s:
        assert s.health()["digest"] == load_bundle(bundles("llama-model"), verify=False).digest


def test_serve_with_the_pinned_digest_serves_and_says_so(bundles):
    pinned = load_bundle(bundles("llama-model"), verify=False).digest
    proc, url = start_serve(bundles("llama-model"), digest=pinned)
    try:
        assert httpx.get(url + "/health", timeout=5).json()["digest"] == pinned
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=15)
