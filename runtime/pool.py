"""Many callers, one loaded bundle: a pool of sessions and a bounded wait queue.

The sessions share the engines' weights (ONNX Runtime sessions run concurrently from
several threads) and each owns its KV buffers. A request takes a free session, or waits
if fewer than `max_queue` requests are already waiting; past that it is refused at once
(`Overloaded`), so a burst never becomes an unbounded backlog.
"""
from __future__ import annotations

import queue
import threading
from pathlib import Path

from specdeploy.core.errors import SpecdeployError
from .session import Generation, Result, Session


class Overloaded(SpecdeployError):
    """Every session is busy and the wait queue is full."""


class SessionPool:
    def __init__(
        self, bundle: str | Path, workers: int = 1, max_queue: int = 8, threads: int | None = None,
        backend: str = "ort", wait_seconds: float | None = None,
    ):
        first = Session(bundle, threads=threads, backend=backend)
        self.sessions = [first] + [first.fork() for _ in range(workers - 1)]
        self.bundle = first.bundle
        self.tokenizer = first.tokenizer
        self.max_queue = max_queue
        self.wait_seconds = wait_seconds
        self._free: queue.Queue[Session] = queue.Queue()
        for s in self.sessions:
            self._free.put(s)
        self._lock = threading.Lock()
        self.waiting = 0
        self.in_flight = 0

    @property
    def session(self) -> Session:
        """A session for read-only work (encoding, limits); never generate with it directly."""
        return self.sessions[0]

    def acquire(self) -> Session:
        with self._lock:
            if self._free.empty() and self.waiting >= self.max_queue:
                raise Overloaded(
                    f"server busy: {len(self.sessions)} session(s) generating and {self.waiting} request(s) "
                    f"waiting (queue limit {self.max_queue}); retry later"
                )
            self.waiting += 1
        try:
            session = self._free.get(timeout=self.wait_seconds)
        except queue.Empty:
            raise Overloaded(f"server busy: no session free within {self.wait_seconds}s; retry later") from None
        finally:
            with self._lock:
                self.waiting -= 1
        with self._lock:
            self.in_flight += 1
        return session

    def release(self, session: Session) -> None:
        with self._lock:
            self.in_flight -= 1
        self._free.put(session)

    def stream(self, prompt: str | None = None, **kwargs) -> Generation:
        """Like Session.stream; the session returns to the pool when the generation ends,
        is cancelled or closed."""
        session = self.acquire()
        try:
            gen = session.stream(prompt, **kwargs)
        except BaseException:
            self.release(session)
            raise
        end = gen._on_end
        gen._on_end = lambda: (end(), self.release(session))
        return gen

    def generate(self, prompt: str | None = None, **kwargs) -> Result:
        return Session.collect(self.stream(prompt, **kwargs))
