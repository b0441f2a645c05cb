"""Helpers for the server tests: a real uvicorn on a loopback port in a thread, SSE
reading, a pool slowed down so that a generation lasts long enough to leave it midway,
and /health and /metrics probes."""
from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from specdeploy.runtime.serving.server import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`create_app(pool, "tiny", **app_options)` served by uvicorn on 127.0.0.1 in a thread."""

    def __init__(self, pool, **app_options):
        self.pool = pool
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(pool, "tiny", **app_options), host="127.0.0.1", port=self.port,
                                log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def wait_idle(self, within: float) -> float:
        """Seconds until /health shows nothing in flight and nothing waiting; fails past `within`."""
        t0 = time.perf_counter()
        while True:
            h = self.health()
            if h["in_flight"] == 0 and h["waiting"] == 0:
                return time.perf_counter() - t0
            assert time.perf_counter() - t0 < within, f"still busy {within}s later: {h}"
            time.sleep(0.02)

    def requests_by_status(self, endpoint: str) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        pattern = r'specdeploy_requests_total\{endpoint="%s",status="([^"]+)"\} ([0-9.e+]+)' % endpoint
        return {m[1]: float(m[2]) for m in re.finditer(pattern, text)}


def sse_events(response):
    """The parsed `data:` payloads of an event stream, up to and without [DONE]."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            if line[6:] == "[DONE]":
                return
            yield json.loads(line[6:])


def sse_text(response, chat=False):
    text, done = [], False
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            break
        choice = json.loads(data)["choices"][0]
        text.append(choice["delta"].get("content", "") if chat else choice["text"])
    assert done
    return "".join(text)


def slow_down(pool, seconds: float) -> None:
    """Every target pass of every pool session sleeps `seconds` first: with draft_len 0 a
    generation of n tokens then lasts at least n * seconds."""
    pooled = hasattr(pool, "sessions")
    targets = [session.target for session in pool.sessions] if pooled else [pool.target]
    name = "forward" if pooled else "forward_batch"  # a SessionPool's sessions, or a BatchSession's batched passes
    for target in targets:
        forward = getattr(target, name)

        def slowed(*args, _forward=forward, **kwargs):
            time.sleep(seconds)
            return _forward(*args, **kwargs)

        setattr(target, name, slowed)


SLOW_SERVE = """
import sys
sys.path.insert(0, {tests!r})
from loopback import slow_down
from specdeploy.runtime.serving import server

class SlowPool(server.SessionPool):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        slow_down(self, {seconds!r})

server.SessionPool = SlowPool
server.serve({bundle!r}, port={port}, **{options!r})
"""


def slow_serve_script(bundle, port: int, seconds: float = 0.05, **options) -> str:
    """A `python -c` script that runs `serve` (with `options`) over sessions slowed by
    `seconds` a pass: for the tests that send the process signals."""
    return SLOW_SERVE.format(tests=str(Path(__file__).parent), bundle=str(bundle), port=port, seconds=seconds,
                             options=options)
