"""Many callers, one loaded bundle: a pool of sessions and a bounded wait queue.

The sessions share the engines' weights (ONNX Runtime sessions run concurrently from
several threads) and each owns its KV buffers. A request takes a free session, or waits
if fewer than `max_queue` requests are already waiting; past that it is refused at once
(`Overloaded`), so a burst never becomes an unbounded backlog. A waiting request gives up
its place as soon as its `cancel` event is set (its client left), after `wait_seconds`
(`QueueTimeout`), or when the pool shuts down.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

from specdeploy.core.manifest import Bundle, memory_budget
from specdeploy.runtime.decoding.admission import POLL_SECONDS, Cancelled, Overloaded, QueueTimeout
from specdeploy.runtime.decoding.request import Request
from specdeploy.runtime.decoding.session import Generation, Result, Session


DEFAULT_BATCH = 8  # what `serve` and a Triton instance batch when told neither --batch nor --workers


def default_batch(bundle: Bundle, backend: str = "ort", device: str | None = None, trt_ep: bool = False,
                  budget: int | None = None) -> tuple[int | None, str]:
    """What a server runs when its user chose neither a batch nor a pool: continuous batching
    of up to DEFAULT_BATCH requests (fewer where the bundle's graphs, or half this machine's
    memory, hold fewer KV slots), or one session at a time where the bundle cannot batch.
    -> (the batch, None for one session; why, in words).

    The batch, not a pool, is the default: at one stream it decodes level with a session (the
    same rounds), and from two streams on every request shares each pass
    (results/batching/README.md). One session is kept where a batch lacks what the bundle
    needs: ONNX Runtime on a GPU or TensorRT (batched passes run on ONNX Runtime's CPU and on
    the torch backend; a Gemma 4 assistant's and a model with recurrent states (its MTP layer's
    too) on ONNX Runtime's CPU only), or graphs that carry one
    sequence a pass (exported with --max-batch 1, or before batching)."""
    if bundle.manifest.recurrent and backend != "ort":
        return None, f"its linear-attention layers keep recurrent states, which batched passes keep on ONNX Runtime's CPU only, not {backend}"
    if bundle.draft_kind == "assistant" and backend != "ort":
        return None, f"its Gemma 4 assistant batches on ONNX Runtime's CPU, not {backend}"
    on_gpu = device is not None and not str(device).startswith("cpu")
    if backend == "trt" or (backend == "ort" and (on_gpu or trt_ep)):
        return None, f"batched passes run on ONNX Runtime's CPU or the torch backend, not {backend}" + (
            f" on {device}" if on_gpu else "")
    if bundle.max_batch < 2:
        return None, "its graphs carry one sequence a pass (re-export with --max-batch 8 to batch)"
    per_slot = bundle.manifest.kv_bytes()
    budget = memory_budget() if budget is None else budget
    n = min(DEFAULT_BATCH, bundle.max_batch, budget // max(per_slot, 1))
    if n < 2:
        return None, f"two KV slots ({2 * per_slot / 2**30:.1f} GiB) do not fit half this machine's memory"
    return n, f"batches of up to {n}"


class SessionPool:
    def __init__(
        self, bundle: str | Path, workers: int = 1, max_queue: int = 8, threads: int | None = None,
        backend: str = "ort", wait_seconds: float | None = None, device: str | None = None, trt_ep: bool = False,
        digest: str | None = None,
    ):
        """`device`, `trt_ep`, `digest`: as for Session. Sessions capturing CUDA graphs load a session of
        ONNX Runtime each (see OrtEngine.fork): the weights are then loaded once per worker."""
        first = Session(bundle, threads=threads, backend=backend, device=device, trt_ep=trt_ep, digest=digest)
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
        self._live: weakref.WeakSet[Generation] = weakref.WeakSet()  # running generations
        self.closing = threading.Event()

    @property
    def capacity(self) -> int:
        """Requests that generate at once: one per session."""
        return len(self.sessions)

    @property
    def session(self) -> Session:
        """A session for read-only work (encoding, limits); never generate with it directly."""
        return self.sessions[0]

    def _refuse_if_full(self) -> None:
        if self._free.empty() and self.waiting >= self.max_queue:
            raise Overloaded(
                f"server busy: {len(self.sessions)} session(s) generating and {self.waiting} request(s) "
                f"waiting (queue limit {self.max_queue}); retry later"
            )

    def check_capacity(self) -> None:
        """Raise `Overloaded` now if a request would be refused: the cheap check a server
        makes before any work on a request (it is made again when the request acquires)."""
        with self._lock:
            self._refuse_if_full()

    def acquire(self, cancel: threading.Event | None = None) -> Session:
        """A free session, waiting for one if the queue has room. Raises `Overloaded` (queue
        full), `QueueTimeout` (past `wait_seconds`) or `Cancelled` (`cancel` set, or the pool
        shutting down) and then holds no place in the queue."""
        with self._lock:
            if self.closing.is_set():
                raise Cancelled("the server is shutting down")
            self._refuse_if_full()
            self.waiting += 1
        deadline = None if self.wait_seconds is None else time.monotonic() + self.wait_seconds
        try:
            while True:
                if cancel is not None and cancel.is_set():
                    raise Cancelled("the request was cancelled while it waited for a session")
                if self.closing.is_set():
                    raise Cancelled("the server is shutting down")
                wait = POLL_SECONDS if deadline is None else min(POLL_SECONDS, deadline - time.monotonic())
                if wait <= 0:
                    raise QueueTimeout(f"server busy: no session came free within {self.wait_seconds}s; retry later")
                try:
                    session = self._free.get(timeout=wait)
                    break
                except queue.Empty:
                    continue
            with self._lock:
                self.in_flight += 1
        finally:
            with self._lock:
                self.waiting -= 1
        return session

    def release(self, session: Session) -> None:
        with self._lock:
            self.in_flight -= 1
        self._free.put(session)

    def stream(self, prompt: str | None = None, cancel: threading.Event | None = None, **kwargs) -> Generation:
        """Like Session.stream; the session returns to the pool when the generation ends,
        is cancelled or closed. `cancel`: an event that, set while the request waits for a
        session, makes it give up its place (`Cancelled`)."""
        return self._run(lambda session: session.stream(prompt, **kwargs), cancel)

    def start(self, req: Request, cancel: threading.Event | None = None) -> Generation:
        """Like Session.start (a request `validate` passed), returning its session as `stream` does."""
        return self._run(lambda session: session.start(req), cancel)

    def _run(self, begin: Callable[[Session], Generation], cancel: threading.Event | None) -> Generation:
        session = self.acquire(cancel)
        try:
            gen = begin(session)
        except BaseException:
            self.release(session)
            raise
        end, ref = gen._on_end, weakref.ref(gen)  # no cycle: a dropped generation is freed at once

        def on_end():
            try:
                end()
            finally:
                with self._lock:
                    g = ref()
                    if g is not None:
                        self._live.discard(g)
                self.release(session)

        gen._on_end = on_end
        with self._lock:
            self._live.add(gen)
        return gen

    def generate(self, prompt: str | None = None, **kwargs) -> Result:
        return Session.collect(self.stream(prompt, **kwargs))

    def shutdown(self) -> None:
        """Refuse new requests, make waiting ones give up (`Cancelled`), and end every running
        generation (each after its current round): what a server does when its grace
        period for draining is over."""
        self.closing.set()
        with self._lock:
            live = list(self._live)
        for gen in live:
            gen.cancel()
            gen.close()

    def reopen(self) -> None:
        """Serve again after `shutdown` (a server starting over the same pool)."""
        self.closing.clear()
