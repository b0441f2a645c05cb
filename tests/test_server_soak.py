"""A bounded soak on loopback: REQUESTS streaming requests, CONCURRENCY at a time, of which
about a third disconnect at a random point (seeded): before any answer (while queued or
prefilling, from a raw socket), or after a random number of events. Afterwards nothing is
in flight or waiting, /metrics counts every request once (answered or cancelled), every
completed answer equals the same request run alone (greedy), and the process's resident
memory has grown by less than RSS_BOUND_MIB."""
import gc
import json
import os
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specdeploy.runtime import Session
from specdeploy.runtime.serving.pool import SessionPool
from loopback import Server, slow_down, sse_events
from tiny import PROMPTS

REQUESTS = 40
CONCURRENCY = 6
LEAVE_SHARE = 0.35
RSS_BOUND_MIB = 48  # the sessions' buffers are allocated once: 40 requests must not add up
MAX_TOKENS = (8, 16, 24, 32)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _leave_early(port: int, body: dict, after: float) -> None:
    """Send the request from a raw socket and close it `after` seconds later, unread."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
        time.sleep(after)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc")
def test_soak_streaming_clients_that_leave_at_random_points(bundles):
    rng = random.Random(18)
    plan = []
    for i in range(REQUESTS):
        prompt, max_tokens = PROMPTS[rng.randrange(len(PROMPTS))], rng.choice(MAX_TOKENS)
        leave = None
        if rng.random() < LEAVE_SHARE:
            leave = ("socket", rng.uniform(0.0, 0.05)) if rng.random() < 0.3 else ("events", rng.randint(1, 6))
        plan.append((prompt, max_tokens, leave))
    alone = Session(bundles("llama-model"))
    reference = {(p, n): alone.generate(p, max_new_tokens=n, speculate=False).text for p, n, _ in plan}

    pool = SessionPool(bundles("llama-model"), workers=2, max_queue=16)
    slow_down(pool, 0.003)  # a few ms a pass: a stream lasts long enough to be left midway
    with Server(pool) as server:
        def client(i):
            prompt, max_tokens, leave = plan[i]
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            if leave and leave[0] == "socket":
                _leave_early(server.port, body, leave[1])
                return None
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200, r.read()
                texts = []
                for k, event in enumerate(sse_events(r)):
                    if leave and k + 1 >= leave[1]:
                        return None  # closes the connection midway
                    texts.append(event["choices"][0]["text"])
                return "".join(texts)

        with ThreadPoolExecutor(CONCURRENCY) as ex:  # a warm-up round: buffers, threads, caches
            list(ex.map(client, range(CONCURRENCY)))
        server.wait_idle(within=5)
        gc.collect()
        before = server.requests_by_status("completions")
        rss_before = _rss_mib()
        started = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as ex:
            answers = list(ex.map(client, range(REQUESTS)))
        settle = server.wait_idle(within=3)
        elapsed = time.perf_counter() - started
        gc.collect()
        rss_after = _rss_mib()
        after = server.requests_by_status("completions")

    completed = [(i, a) for i, a in enumerate(answers) if a is not None]
    for i, text in completed:
        prompt, max_tokens, _ = plan[i]
        assert text == reference[(prompt, max_tokens)], (i, prompt, max_tokens)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    left = sum(1 for *_, leave in plan if leave)
    assert sum(delta.values()) == REQUESTS, delta  # every request counted once
    assert delta.get("200", 0) + delta.get("cancelled", 0) == REQUESTS, delta
    assert delta.get("200", 0) >= len(completed)
    assert 1 <= delta.get("cancelled", 0) <= left, (delta, left)
    print(f"\nsoak: {REQUESTS} streams, {CONCURRENCY} at a time, {left} clients left early "
          f"({delta.get('cancelled', 0):.0f} counted cancelled, the rest had their answer before leaving), "
          f"{len(completed)} completed and equal to the request alone; idle {settle:.2f}s after the last; "
          f"RSS {rss_before:.0f} -> {rss_after:.0f} MiB; {elapsed:.1f}s")
    assert rss_after - rss_before < RSS_BOUND_MIB, (rss_before, rss_after)
