"""`specdeploy serve`: an OpenAI-compatible HTTP server over a BatchSession (continuous
batching: every running request in one pass per round), by default where the bundle batches,
or over a SessionPool (`--workers`, and bundles a batch cannot run: `running`).

POST /v1/completions and /v1/chat/completions (with `stream: true` as server-sent
events), GET /health, GET /metrics (Prometheus text). Built on Starlette and uvicorn.

The event loop never does the heavy work: the chat template, tokenizing and every round
of generation run in worker threads, one round per call, so the loop sees a client
disconnect between rounds at the latest; it then cancels the generation, which gives its
session back as soon as the round in progress returns. A request waiting for a session
gives up its place the same way. Checked before any expensive work, in this order: the
body size (413), the request's fields and the prompt's length in characters (400), the
queue bound (503); only then the template and the tokenizer. A large body is parsed and
checked in a worker thread, one at a time, so that its JSON and its field checks do not hold
the event loop. Every request is counted in /metrics exactly once, by its outcome.

On SIGTERM / Ctrl-C (`serve`) the server drains: it keeps listening and answers every new
request with a JSON 503, while requests in flight finish for `graceful_seconds`. When the
grace period ends, each answer still running ends whole (`Shutdown.end_grace`): a stream
with an error event and `data: [DONE]`, never cut inside a chunk; a non-stream request and
a request still waiting for a session with a JSON 503. Only then does the server stop
listening; the rounds left running in worker threads end their generations when they return.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import sys
import threading
import time
import uuid
from dataclasses import replace
from typing import Any, NamedTuple

import anyio
import uvicorn
from uvicorn.main import STARTUP_FAILURE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specdeploy.core.errors import InputError, SpecdeployError
from specdeploy.core.manifest import Bundle, load_bundle
from specdeploy.runtime.decoding.request import (
    NUMBER, SEED_END, SETTINGS, Limits, Request, RequestError, message_of, validate, wire_names,
)
from specdeploy.runtime.decoding.batch import BatchSession
from specdeploy.runtime.decoding.tools import call_id, calls_close, content_before_calls, parse_calls
from specdeploy.runtime.serving.pool import Cancelled, Overloaded, QueueTimeout, SessionPool, default_batch

log = logging.getLogger("specdeploy.server")

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop", "": None}
MAX_N = 8  # answers a request may ask for (`n`); at most the batch's slots
DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: a max_seq of 8k tokens as JSON-escaped non-ASCII text still fits
DEFAULT_GRACEFUL_SECONDS = 10.0
OFF_LOOP_BYTES = 64 << 10  # a body this large is parsed in a worker thread: its JSON alone can take milliseconds
FINAL_WRITE_SECONDS = 2.0  # after the grace period: how long the answers ended by the shutdown get to be sent
SHUTDOWN_MESSAGE = "the server shut down before the answer was complete"
_ENDED = object()  # what `_Run._round` gives when the grace period ended before the round


class BadRequest(InputError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class TooLarge(InputError):
    pass


# -- request validation -------------------------------------------------------------------

# a request field -> its name in a body (the `param` of a 400); the fields mapped by hand (below)
# by their usual names
NAMES = {**wire_names("prompt"), "logprobs": "logprobs", "structure": "response_format", "tools": "tools",
         "tool_choice": "tool_choice"}


def _field(body: dict, name: str, kinds: tuple, default: Any, what: str) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int in Python; a JSON true is never a number here
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise BadRequest(f"'{name}' must be {what}, got {json.dumps(value)[:40]}", name)
    return value


def _json_number(value: Any) -> Any:
    """JSON has one kind of number: an integer given for a number is a float (one past a
    float's range stays as given, and its field's range refuses it)."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return value
    return value


class Parsed(NamedTuple):
    request: Request
    stream: bool  # the answer as server-sent events
    include_usage: bool = False  # `stream_options.include_usage`: a last chunk with the usage alone
    names: dict[str, str] = NAMES  # a request field -> the body's name for it (the `param` of a 400)
    n: int = 1  # answers to the one prompt, each a generation of its own


def parse_request(body: Any, chat: bool, limits: Limits) -> Parsed:
    """The validated request and how to answer it. The body's fields are mapped to the request
    schema's (OpenAI's names: `max_tokens`, or `max_completion_tokens`; chat's `logprobs` and
    `top_logprobs`, or a completion's `logprobs` count) and checked by its one `validate`.
    Cheap: nothing here tokenizes, and each error names the field at fault."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    given: dict[str, Any] = {}
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array of {role, content} objects", "messages")
        turns = []
        for i, m in enumerate(messages):
            try:
                turns.append(message_of(m))
            except ValueError as e:
                raise BadRequest(f"'messages[{i}]': {e}", "messages") from None
        given["messages"] = tuple(turns)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            given["prompt"] = prompt
        elif isinstance(prompt, list) and prompt:
            given["prompt_ids"] = prompt
        else:
            raise BadRequest("'prompt' must be a string or a non-empty array of token ids", "prompt")
    for name, s in SETTINGS.items():
        value = body.get(s.wire) if s.wire is not None else None
        if value is not None:  # JSON null: absent, the default
            given[name] = _json_number(value) if s.kind is NUMBER else value
    names = {**NAMES, **_openai_fields(body, chat, given)}
    try:
        req = validate(given, limits, {name: f"'{wire}'" for name, wire in names.items()})
    except RequestError as e:
        raise BadRequest(str(e), names[e.field]) from None
    stream = _field(body, "stream", (bool,), False, "a boolean")
    n = _field(body, "n", (int,), 1, "an integer")
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"'n' {n} is outside [1, {MAX_N}]", "n")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise BadRequest("'stream_options' is only allowed with 'stream': true", "stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest(f"'stream_options' must be an object, got {json.dumps(options)[:40]}", "stream_options")
    usage = _field(options or {}, "include_usage", (bool,), False, "a boolean") if options is not None else False
    return Parsed(req, stream, usage, names, n)


def _openai_fields(body: dict, chat: bool, given: dict[str, Any]) -> dict[str, str]:
    """The fields OpenAI's API names in two ways, into `given` -> the wire names they came by
    (for errors). `max_completion_tokens` is chat's newer `max_tokens`; log probabilities are
    chat's `logprobs: true` with `top_logprobs` alternatives, a completion's `logprobs` count."""
    names = {"logprobs": "top_logprobs" if chat else "logprobs"}
    newer = body.get("max_completion_tokens")
    if newer is not None:
        older = body.get("max_tokens")
        if older is not None and older != newer:
            raise BadRequest("give 'max_tokens' or 'max_completion_tokens', not two different values",
                             "max_completion_tokens")
        given["max_new_tokens"] = newer
        names["max_new_tokens"] = "max_completion_tokens"
    if chat:
        wanted = _field(body, "logprobs", (bool,), False, "a boolean")
        top = body.get("top_logprobs")
        if top is not None and not wanted:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if wanted:
            given["logprobs"] = 0 if top is None else top
    elif body.get("logprobs") is not None:
        given["logprobs"] = body["logprobs"]
    if chat and body.get("tools") is not None:
        given["tools"] = body["tools"]
        if body.get("tool_choice") is not None:
            given["tool_choice"] = body["tool_choice"]
    elif body.get("tool_choice") not in (None, "none"):
        raise BadRequest("'tool_choice' needs 'tools'" if chat else "'tools' need the chat endpoint", "tool_choice")
    formats = [name for name in ("response_format", "structured_outputs", "structure") if body.get(name) is not None]
    if len(formats) > 1:
        raise BadRequest(f"give one of {', '.join(repr(f) for f in formats)}", formats[-1])
    if formats == ["response_format"]:
        structure = _response_format(body["response_format"])
        if structure is not None:
            given["structure"] = structure
    elif formats:
        given["structure"] = body[formats[0]]  # vLLM's form and the request schema's own name for it
        names["structure"] = formats[0]
    return names


def _response_format(value: Any) -> dict | None:
    """OpenAI's `response_format` as the request schema's structure (None: plain text)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise BadRequest("'response_format.json_schema.schema' must be a JSON schema object", "response_format")
        return {"json": spec["schema"]}
    raise BadRequest("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                     "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": ...}}", "response_format")


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON ({str(e).splitlines()[0][:120]})") from None
    except RecursionError:
        raise BadRequest("the request body is not valid JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer past Python's digit limit
        raise BadRequest(f"the request body is not valid JSON ({str(e).splitlines()[0][:120]})") from None


def _parse(raw: bytes, chat: bool, limits: Limits) -> Parsed:
    """The body's JSON, then its fields: `parse_request`. A 4 MB array of token ids takes the
    two about half a second, which is why a large body runs this in a worker thread."""
    return parse_request(_parse_json(raw), chat, limits)


async def _read_body(request: HttpRequest, limit: int) -> bytes:
    """The body, refused (`TooLarge`) as soon as it is known to pass `limit` bytes: from its
    Content-Length before reading, or as it arrives when it is chunked."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the request body of {declared} bytes is larger than the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the request body is larger than the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


# -- metrics -------------------------------------------------------------------------------

class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "specdeploy_requests",
            "Requests by endpoint and outcome: the HTTP status sent, 'cancelled' (the client left, or the server "
            "shut down, before the answer was complete) or 'timeout' (no session came free in time; sent as 503)",
            ["endpoint", "status"], registry=r)
        self.tokens = Counter("specdeploy_generated_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("specdeploy_drafted_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("specdeploy_accepted_tokens", "Draft tokens accepted", registry=r)
        self.acceptance = Gauge("specdeploy_acceptance_rate", "Accepted / drafted tokens since start", registry=r)
        self.draft_len = Histogram("specdeploy_draft_length", "Draft length chosen per round",
                                   buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16), registry=r)
        self.tree_nodes = Histogram("specdeploy_tree_nodes", "Token-tree nodes verified per tree round (0: a plain step)",
                                    buckets=(0, 1, 2, 4, 8, 12, 16, 24, 32), registry=r)
        self.path_length = Histogram("specdeploy_accepted_path_length", "Accepted path length per tree round",
                                     buckets=(0, 1, 2, 3, 4, 6, 8), registry=r)
        self.latency = Histogram("specdeploy_request_seconds", "Whole request latency", registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.ttft = Histogram("specdeploy_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
        self.queue = Gauge("specdeploy_queue_waiting", "Requests waiting for a session", registry=r)
        self.in_flight = Gauge("specdeploy_in_flight", "Requests generating", registry=r)
        self._drafted = self._accepted = 0
        self._lock = threading.Lock()

    def record(self, stats, seconds: float) -> None:
        self.tokens.inc(stats.new_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        with self._lock:
            self._drafted += stats.drafted
            self._accepted += stats.accepted
            if self._drafted:
                self.acceptance.set(self._accepted / self._drafted)
        for k in stats.draft_len_history:
            self.draft_len.observe(k)
        for nodes, path in zip(stats.tree_sizes, stats.path_lengths):
            self.tree_nodes.observe(nodes)
            self.path_length.observe(path)
        self.latency.observe(seconds)
        if stats.new_tokens:
            self.ttft.observe(stats.first_token_seconds)


class _Outcome:
    """Counts one request once, by how it ended."""

    def __init__(self, metrics: Metrics, endpoint: str):
        self.metrics, self.endpoint, self.status = metrics, endpoint, None

    def __call__(self, status: str) -> None:
        if self.status is None:
            self.status = status
            self.metrics.requests.labels(self.endpoint, status).inc()


def _error_body(message: str, kind: str, param: str | None = None) -> dict:
    """The OpenAI error object, its message one line whatever raised it."""
    return {"error": {"message": (message.splitlines() or [""])[0], "type": kind, "param": param, "code": None}}


def _error(status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(_error_body(message, kind, param), status, headers=headers)


def _next(gen):
    return next(gen, None)


# -- shutting down ---------------------------------------------------------------------------

class Shutdown:
    """The app's side of a drain, on the event loop: `begin()` when the signal comes (new
    requests get 503), `end_grace()` when the grace period is over (every answer still
    running ends now, whole). `serve` drives it; a server that never calls `begin` still gets
    `end_grace` from the app's lifespan shutdown."""

    def __init__(self, pool: SessionPool):
        self.pool = pool
        self.stopping = False  # the signal came: new requests are refused
        self.over = False  # the grace period is over: running answers end
        self.runs: set[_Run] = set()  # the answers running now

    def reopen(self) -> None:
        """Serve again (a server starting over the same pool)."""
        self.pool.reopen()
        self.stopping = self.over = False

    def begin(self) -> None:
        self.stopping = True

    def end_grace(self) -> None:
        self.stopping = self.over = True
        # waiting requests give up their place (and get their 503); generations end after their round
        self.pool.shutdown()
        for run in list(self.runs):
            run.end_now()


# -- the app -------------------------------------------------------------------------------

def create_app(
    pool: SessionPool, model_name: str = "specdeploy", *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_prompt_chars: int | None = None, shutdown: Shutdown | None = None,
) -> Starlette:
    """`shutdown`: how `serve` drains the app (see Shutdown); by default one of its own."""
    metrics = Metrics()
    limits = Limits.of(pool.session, max_chars=max_prompt_chars)  # the prompt's characters: see Limits.of
    shutdown = shutdown if shutdown is not None else Shutdown(pool)
    limiter: list[anyio.CapacityLimiter] = []  # made on the event loop, at the first request
    parse_limiter: list[anyio.CapacityLimiter] = []

    def acquire_limiter() -> anyio.CapacityLimiter:
        # Threads that wait for a session are kept out of the default pool (40 threads) that
        # runs rounds and tokenizing, so a full queue cannot starve them.
        if not limiter:
            limiter.append(anyio.CapacityLimiter(pool.max_queue + pool.capacity + 64))
        return limiter[0]

    def acquire_parse_limiter() -> anyio.CapacityLimiter:
        # Large bodies are parsed one at a time: json's parser holds the GIL for a whole body,
        # so each one more at once is one more the event loop may wait behind.
        if not parse_limiter:
            parse_limiter.append(anyio.CapacityLimiter(1))
        return parse_limiter[0]

    async def completions(request: HttpRequest, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        outcome = _Outcome(metrics, endpoint)
        started = time.perf_counter()
        if shutdown.stopping:
            outcome("503")
            return _error(503, "the server is shutting down; retry later", "overloaded",
                          headers={"connection": "close", "retry-after": "1"})
        try:
            raw = await _read_body(request, max_body_bytes)
            if len(raw) < OFF_LOOP_BYTES:
                parsed = _parse(raw, chat, limits)
            else:
                parsed = await anyio.to_thread.run_sync(_parse, raw, chat, limits, limiter=acquire_parse_limiter())
            req = parsed.request
            if parsed.n > 1 and not isinstance(pool, BatchSession):  # n sessions at once could wait on each other
                raise BadRequest("'n' > 1 needs the batch (serve without --workers)", "n")
            if parsed.n > 1 and parsed.n > pool.batch:
                raise BadRequest(f"'n' {parsed.n} is more than the batch's {pool.batch} slots", "n")
            pool.check_capacity()  # before the template and the tokenizer
            req = await run_in_threadpool(_encode, pool, req, parsed.names)
        except TooLarge as e:
            outcome("413")
            return _error(413, str(e), "invalid_request_error", None, {"connection": "close"})
        except Overloaded as e:
            outcome("503")
            return _error(503, str(e), "overloaded", headers={"retry-after": "1"})
        except BadRequest as e:
            outcome("400")
            return _error(400, str(e), "invalid_request_error", e.param)
        except SpecdeployError as e:
            outcome("400")
            return _error(400, str(e), "invalid_request_error", "messages" if chat else "prompt")
        except ClientDisconnect:
            outcome("cancelled")
            return Response(status_code=499)  # nobody reads it
        except Exception as e:
            log.exception("unexpected error while reading a request")
            outcome("500")
            return _error(500, f"internal error ({type(e).__name__})", "server_error")
        return _Run(pool, metrics, outcome, req, parsed, chat, model_name, started, acquire_limiter(), shutdown)

    async def health(request: HttpRequest) -> Response:
        stopping = shutdown.stopping or pool.closing.is_set()
        return JSONResponse({"status": "stopping" if stopping else "ok", "model": model_name,
                             "digest": pool.bundle.digest,  # the bundle served, as `specdeploy inspect` prints it
                             "sessions": pool.capacity, "in_flight": pool.in_flight, "waiting": pool.waiting,
                             "max_queue": pool.max_queue}, 503 if stopping else 200)

    async def metrics_endpoint(request: HttpRequest) -> Response:
        metrics.queue.set(pool.waiting)
        metrics.in_flight.set(pool.in_flight)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "specdeploy"}]})

    async def completions_route(request: HttpRequest) -> Response:
        return await completions(request, chat=False)

    async def chat_route(request: HttpRequest) -> Response:
        return await completions(request, chat=True)

    async def unexpected(request: HttpRequest, exc: Exception) -> Response:
        # the last net: anything that escaped the handlers is a JSON 500, counted
        endpoint = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(request.url.path, "other")
        metrics.requests.labels(endpoint, "500").inc()
        return _error(500, f"internal error ({type(exc).__name__})", "server_error")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        shutdown.reopen()
        yield
        # the grace period is over (or nothing was in flight): end what still runs
        shutdown.end_grace()

    return Starlette(
        routes=[
            Route("/v1/completions", completions_route, methods=["POST"]),
            Route("/v1/chat/completions", chat_route, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_endpoint, methods=["GET"]),
        ],
        exception_handlers={Exception: unexpected},
        lifespan=lifespan,
    )


def _encode(pool: SessionPool, req: Request, names: dict[str, str] = NAMES) -> Request:
    """In a worker thread: the chat template and the tokenizer, then the checks that need the
    token count or the tokenizer (a structure's grammar), each naming its field as `names` do."""
    try:
        return pool.session.prepare(req, {name: f"'{wire}'" for name, wire in names.items()})
    except RequestError as e:
        raise BadRequest(str(e), names[e.field]) from None


class _Run:
    """The ASGI response that runs a validated request: waits for a session, generates one
    round per worker-thread call and sends the answer, while a second task listens for the
    client's disconnect. Nothing is sent before the first round has run, so a failure up to
    there is a JSON error with its own status, never a 200 cut short."""

    def __init__(self, pool, metrics, outcome, req: Request, parsed: Parsed, chat, model_name, started, limiter,
                 shutdown: Shutdown):
        self.pool, self.metrics, self.outcome, self.req, self.chat = pool, metrics, outcome, req, chat
        self.started, self.limiter, self.shutdown = started, limiter, shutdown
        self.stream, self.include_usage = parsed.stream, parsed.include_usage
        self.logprobs = req.logprobs is not None
        # tools the model may call: its calls are read from the whole answer (a stream sends the
        # content before them as it comes, the calls at the end)
        self.tools = chat and req.tools is not None and req.tool_choice != "none"
        self.base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                     "model": model_name}
        self.cancel = threading.Event()  # set when the client leaves
        # `n` choices: one generation each, the seeds of sampled ones apart (seed + i)
        self.reqs = [req] + [replace(req, seed=None if req.seed is None else (req.seed + i) % SEED_END)
                             for i in range(1, parsed.n)]
        self.gens: list = []
        self.round_scope: anyio.CancelScope | None = None  # while a round runs in its worker thread

    def end_now(self) -> None:
        """The grace period is over: stop waiting for the round in progress (its thread ends
        the generation when it returns) and end the answer (see `_generate`)."""
        if self.round_scope is not None:
            self.round_scope.cancel()

    def _client_left(self) -> None:
        self.cancel.set()
        self._end_all()

    async def __call__(self, scope, receive, send) -> None:
        async def watch():
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self._client_left()
                    return

        async def safe_send(message) -> None:
            if self.cancel.is_set():
                return
            try:
                await send(message)
            except OSError:  # ASGI 2.4 servers say so when the client has gone
                self._client_left()

        self.shutdown.runs.add(self)
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(watch)
                try:
                    await self._run(safe_send)
                finally:
                    tasks.cancel_scope.cancel()
        finally:
            self.shutdown.runs.discard(self)
            self.outcome("cancelled")  # counted already, unless it ended without an answer

    async def _json(self, send, status: int, payload: dict, headers: dict | None = None) -> None:
        response = JSONResponse(payload, status, headers=headers)
        await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": False})

    async def _fail(self, send, status: int, message: str, kind: str, label: str | None = None,
                    param: str | None = None, headers: dict | None = None) -> None:
        self.outcome(label or str(status))
        await self._json(send, status, _error_body(message, kind, param), headers)

    async def _run(self, send) -> None:
        if self.shutdown.over:  # made before the grace period ended, run after
            return await self._fail(send, 503, SHUTDOWN_MESSAGE, "overloaded", "cancelled")
        try:
            for req in self.reqs:  # one generation a choice (`n`): lanes of the batch
                self.gens.append(await anyio.to_thread.run_sync(
                    functools.partial(self.pool.start, req, cancel=self.cancel), limiter=self.limiter))
        except BaseException as e:
            self._end_all()  # the choices started already
            if isinstance(e, Cancelled):
                if self.cancel.is_set():  # the client left: nobody reads an answer
                    self.outcome("cancelled")
                    return
                # the server shut down while it waited for a session
                return await self._fail(send, 503, SHUTDOWN_MESSAGE, "overloaded", "cancelled",
                                        headers={"retry-after": "1"})
            if isinstance(e, QueueTimeout):
                return await self._fail(send, 503, str(e), "timeout", "timeout", headers={"retry-after": "1"})
            if isinstance(e, Overloaded):
                return await self._fail(send, 503, str(e), "overloaded", headers={"retry-after": "1"})
            if isinstance(e, SpecdeployError):
                return await self._fail(send, 400, str(e), "invalid_request_error")
            if not isinstance(e, Exception):
                raise
            log.exception("unexpected error while starting a generation")
            return await self._fail(send, 500, f"internal error ({type(e).__name__})", "server_error")
        try:
            if self.cancel.is_set():  # left while the session was being taken
                self._end_all()
            await self._generate(send)
        finally:
            self._end_all(unless_ended=True)  # failed, or cancelled from outside (uvicorn past its grace period)

    def _end_all(self, unless_ended: bool = False) -> None:
        for gen in self.gens:
            if not (unless_ended and gen.ended):
                gen.cancel()
                gen.close()  # at once, or when the round in its thread returns: the session goes back

    async def _round(self, gen):
        """The next piece (one round, in a worker thread; None at the end), or `_ENDED` when
        the grace period ends first: the round then goes on in its thread, and the generation
        ends when it returns."""
        with anyio.CancelScope() as self.round_scope:
            try:
                return await anyio.to_thread.run_sync(_next, gen, abandon_on_cancel=True)
            finally:
                self.round_scope = None
        return _ENDED

    async def _generate(self, send) -> None:
        """The choices' pieces, read in turn (each choice's generation runs in the batch whether
        read or not), streamed as they come or gathered into one answer."""
        chat, kind = self.chat, "chat.completion.chunk" if self.chat else "text_completion"
        choices = [_Choice(i, gen) for i, gen in enumerate(self.gens)]
        for c in choices:
            c.logprobs_form = LogprobsForm(self.pool.session.tokenizer, chat) if self.logprobs else None
        started_stream = False

        def event(payload) -> dict:
            return {"type": "http.response.body", "body": f"data: {json.dumps(payload)}\n\n".encode(), "more_body": True}

        async def shut() -> None:
            # the grace period is over: the answer ends whole, a stream after its last whole chunk
            self._end_all()
            if not started_stream:
                return await self._fail(send, 503, SHUTDOWN_MESSAGE, "overloaded", "cancelled",
                                        headers={"retry-after": "1"})
            self.outcome("cancelled")
            await send(event(_error_body(SHUTDOWN_MESSAGE, "overloaded")))
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

        try:
            active = list(choices)
            while active:
                for c in list(active):
                    if self.cancel.is_set():
                        self.outcome("cancelled")
                        return
                    if self.shutdown.over:
                        return await shut()
                    piece = await self._round(c.gen)
                    if self.cancel.is_set():
                        self.outcome("cancelled")
                        return
                    if piece is _ENDED:
                        return await shut()
                    if self.stream and not started_stream:
                        started_stream = True
                        await send({"type": "http.response.start", "status": 200, "headers": [
                            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]})
                        if chat:
                            await send(event({**self.base, "object": kind, "choices": [
                                {"index": d.index, "delta": {"role": "assistant"}, "finish_reason": None}
                                for d in choices]}))
                    if piece is None:
                        active.remove(c)
                        continue
                    c.token_ids += piece.token_ids
                    if self.stream and not self.tools:
                        if piece.text or (self.logprobs and piece.logprobs):
                            choice = ({"index": c.index, "delta": {"content": piece.text}} if chat
                                      else {"index": c.index, "text": piece.text})
                            if self.logprobs:
                                choice["logprobs"] = c.logprobs_form.part(piece.logprobs)
                            await send(event({**self.base, "object": kind, "choices": [{**choice, "finish_reason": None}]}))
                    else:  # the answer whole (or, with tools, its calls read whole)
                        c.texts.append(piece.text)
                        c.logprobs += piece.logprobs or []
                        if self.stream:  # with tools: the content before any call streams as it comes,
                            form = self.pool.session.tool_form  # and each call once its block has closed
                            raw = self.pool.session.tool_text(c.token_ids)
                            upto = content_before_calls(raw, form)
                            delta = {"content": raw[c.sent:upto]} if upto > c.sent else {}
                            c.sent = max(c.sent, upto)
                            closed = parse_calls(raw, form)[1] if calls_close(form) else []
                            if len(closed) > len(c.calls):
                                first = len(c.calls)
                                c.calls += _call_entries(closed[first:], form)
                                delta["tool_calls"] = [{"index": first + i, **call}
                                                       for i, call in enumerate(c.calls[first:])]
                            if delta:
                                await send(event({**self.base, "object": kind, "choices": [
                                    {"index": c.index, "delta": delta, "finish_reason": None}]}))
        except Exception as e:
            if isinstance(e, InputError):
                status, kind_, message = 400, "invalid_request_error", str(e)
            else:
                if not isinstance(e, SpecdeployError):
                    log.exception("unexpected error while generating")
                status, kind_, message = 500, "server_error", (
                    str(e) if isinstance(e, SpecdeployError) else f"internal error ({type(e).__name__})")
            if not started_stream:
                return await self._fail(send, status, message, kind_)
            # mid-stream: an error event, as OpenAI's API sends, then the end of the stream
            self.outcome(str(status))
            await send(event(_error_body(message, kind_)))
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            return
        if any(c.gen.stats.finish_reason == "cancelled" for c in choices):  # ended by the shutdown, not the client
            return await shut()
        for c in choices:
            self.metrics.record(c.gen.stats, time.perf_counter() - self.started)
            self._read(c)
        usage = _usage([c.gen.stats for c in choices])
        self.outcome("200")
        if self.stream:
            for c in choices:
                if self.tools:  # the rest of its content, then its calls
                    delta = {"content": c.rest} if c.rest else {}
                    if len(c.calls) > c.streamed:  # those not sent as they closed
                        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(c.calls)
                                               if i >= c.streamed]
                    if delta:
                        choice = {"index": c.index, "delta": delta, "finish_reason": None}
                        if self.logprobs:
                            choice["logprobs"] = c.logprobs_form.part(c.logprobs)
                        await send(event({**self.base, "object": kind, "choices": [choice]}))
                last = {"index": c.index, "delta": {}} if chat else {"index": c.index, "text": ""}
                with_usage = not self.include_usage and c is choices[-1]  # the usage rides on the last chunk
                await send(event({**self.base, "object": kind, "choices": [{**last, "finish_reason": c.finish}],
                                  **({"usage": usage} if with_usage else {})}))
            if self.include_usage:  # OpenAI's form: the usage alone in a last chunk with no choices
                await send(event({**self.base, "object": kind, "choices": [], "usage": usage}))
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            return
        answers = []
        for c in choices:
            choice = ({"index": c.index, "message": {"role": "assistant", "content": c.text if c.text or not c.calls
                                                     else None}, "finish_reason": c.finish}
                      if chat else {"index": c.index, "text": c.text, "finish_reason": c.finish})
            if c.calls:
                choice["message"]["tool_calls"] = c.calls
            choice["logprobs"] = c.logprobs_form.part(c.logprobs) if self.logprobs else None
            answers.append(choice)
        stats = [c.gen.stats.as_dict() for c in choices]
        await self._json(send, 200, {
            **self.base,
            "object": "chat.completion" if chat else "text_completion",
            "choices": answers,
            "usage": usage,
            "specdeploy": stats[0] if len(stats) == 1 else stats,
        })

    def _read(self, c: "_Choice") -> None:
        """A choice's text, tool calls and finish reason, once its generation has ended (and, for
        a stream with tools, the content not streamed yet)."""
        c.text, c.finish = "".join(c.texts), FINISH[c.gen.stats.finish_reason]
        if self.tools:
            raw = self.pool.session.tool_text(c.token_ids)
            content, calls = parse_calls(raw, self.pool.session.tool_form)
            c.rest = (content if calls else raw)[c.sent:]
            if calls:
                c.text, c.finish = content.strip(), "tool_calls"
                c.streamed = len(c.calls)  # sent as their blocks closed: the ids given then are kept
                c.calls += _call_entries(calls[c.streamed:], self.pool.session.tool_form)


class _Choice:
    """One of a request's `n` answers: its generation and what was read of it."""

    def __init__(self, index: int, gen):
        self.index, self.gen = index, gen
        self.texts, self.logprobs, self.token_ids = [], [], []
        self.text, self.finish, self.calls = "", None, []  # calls: OpenAI's entries, in the order written
        self.sent, self.rest = 0, ""  # a stream with tools: characters of content sent, and what is left
        self.streamed = 0  # a stream with tools: calls sent before the answer ended
        self.logprobs_form = None  # the request's LogprobsForm, one a choice (a completion's offsets are its own)


def _call_entries(calls, form) -> list[dict]:
    """Parsed calls as OpenAI's `tool_calls` entries, each with a new id in the form's shape."""
    return [{"id": call_id(form), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in calls]


def _usage(stats: list) -> dict:
    """A request's usage: its prompt once, the tokens of all its choices."""
    prompt, completion = stats[0].prompt_tokens, sum(s.new_tokens for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": stats[0].cached_tokens}}  # reused from the prompt cache


class LogprobsForm:
    """Log probabilities as OpenAI's API gives them: chat's `{"content": [{token, logprob,
    bytes, top_logprobs}]}`, a completion's `{tokens, token_logprobs, top_logprobs,
    text_offset}`; a token's text is its id decoded alone (special tokens included)."""

    def __init__(self, tokenizer, chat: bool):
        self.chat = chat
        self.text = functools.lru_cache(maxsize=4096)(lambda t: tokenizer.decode([t], skip_special_tokens=False))
        self.offset = 0  # a completion's: characters of text before the next token

    def part(self, entries) -> dict:
        """The log probabilities of a piece's tokens (or of a whole answer's)."""
        entries = entries or []
        if self.chat:
            return {"content": [{**self._one(e.token, e.logprob), "top_logprobs": [self._one(t, lp) for t, lp in e.top]}
                                for e in entries]}
        tokens, offsets = [self.text(e.token) for e in entries], []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) for e in entries],
                "top_logprobs": [{self.text(t): _finite(lp) for t, lp in e.top} for e in entries], "text_offset": offsets}

    def _one(self, token: int, logprob: float) -> dict:
        text = self.text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}


def _finite(logprob: float) -> float:
    """JSON has no -Infinity: a token the row rules out reads as vLLM gives it."""
    return max(logprob, -9999.0)


def running(bundle: Bundle, workers: int | None, batch: int | None, device: str | None = None,
            trt_ep: bool = False) -> tuple[int, int | None, str]:
    """What a server runs: `batch` N (continuous batching), `workers` N (a pool of sessions), or,
    told neither, continuous batching where the bundle batches (pool.default_batch).
    -> (workers, batch or None, in words)."""
    if batch:
        return 1, batch, f"batches of up to {batch}"
    if workers is not None:
        return workers, None, f"{workers} session(s)"
    batch, why = default_batch(bundle, "ort", device, trt_ep)
    return 1, batch, why if batch else f"1 session: {why}"


class _Draining(uvicorn.Server):
    """uvicorn, draining as the module docstring says: on the signal it keeps listening (so a
    new request gets its 503, not a refused connection) while the requests in flight finish,
    for `grace` seconds at most; then `Shutdown.end_grace` ends the answers left, and uvicorn
    stops as it does, giving them FINAL_WRITE_SECONDS to be sent."""

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown, grace: float):
        super().__init__(config)
        self.drain, self.grace = shutdown, grace

    async def shutdown(self, sockets=None) -> None:
        self.drain.begin()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # an idle keep-alive connection closes; a busy one after its answer
        deadline = time.monotonic() + self.grace
        while self.server_state.tasks and not self.force_exit and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.drain.end_grace()
        await super().shutdown(sockets)


def serve(bundle: str, host: str = "127.0.0.1", port: int = 8000, workers: int | None = None, max_queue: int = 8,
          threads: int | None = None, model_name: str | None = None, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          graceful_seconds: float = DEFAULT_GRACEFUL_SECONDS, queue_timeout: float | None = None,
          max_prompt_chars: int | None = None, device: str | None = None, trt_ep: bool = False,
          digest: str | None = None, batch: int | None = None) -> None:
    """Serve until SIGINT / SIGTERM; then drain for `graceful_seconds` as the module
    docstring says. `device`, `trt_ep`: where the sessions run (as for Session). `digest`
    ("sha256:...", as `specdeploy inspect` prints it): the bundle must be that one; any other
    is refused (BundleError, one line) before the sessions load and before listening. /health
    states the digest served. `batch` N: continuous batching (runtime/decoding/batch.py), up to N
    requests in one pass per round; `workers` N: a pool of N sessions instead; neither: what
    `running` chooses (pool.default_batch)."""
    manifest = load_bundle(bundle, verify=False, digest=digest)  # the manifest alone: another bundle is refused at once
    # and the sessions' load compares it again, so a manifest changed in between is refused too
    workers, batch, _ = running(manifest, workers, batch, device, trt_ep)
    if batch:
        pool = BatchSession(bundle, batch=batch, max_queue=max_queue, threads=threads, wait_seconds=queue_timeout,
                            device=device, digest=digest)
    else:
        pool = SessionPool(bundle, workers=workers, max_queue=max_queue, threads=threads, wait_seconds=queue_timeout,
                           device=device, trt_ep=trt_ep, digest=digest)
    shutdown = Shutdown(pool)
    app = create_app(pool, model_name or pool.bundle.path.name, max_body_bytes=max_body_bytes,
                     max_prompt_chars=max_prompt_chars, shutdown=shutdown)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=FINAL_WRITE_SECONDS)
    server = _Draining(config, shutdown, graceful_seconds)
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C, re-raised once the server has drained (as uvicorn.run does)
        pass
    if not server.started:  # uvicorn said why (the port taken, ...); its exit status, as uvicorn.run's
        sys.exit(STARTUP_FAILURE)
