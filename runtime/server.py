"""`specdeploy serve`: an OpenAI-compatible HTTP server over a SessionPool.

POST /v1/completions and /v1/chat/completions (with `stream: true` as server-sent
events), GET /health, GET /metrics (Prometheus text). Built on Starlette and uvicorn;
generation runs in worker threads, never on the event loop. Requests past the pool's
bounded queue get 503 at once.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specdeploy.core.errors import InputError, SpecdeployError
from .pool import Overloaded, SessionPool

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop", "": None}


class BadRequest(InputError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# -- request validation -------------------------------------------------------------------

def _field(body: dict, name: str, kinds: tuple, default: Any, what: str) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int in Python; a JSON true is never a number here
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise BadRequest(f"'{name}' must be {what}, got {json.dumps(value)[:40]}", name)
    return value


def parse_request(body: Any, chat: bool, max_seq: int) -> dict:
    """A validated request: prompt (text, ids or messages) and generation settings."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    req: dict[str, Any] = {}
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array of {role, content} objects", "messages")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise BadRequest(f"'messages[{i}]' must be an object with string 'role' and 'content'", "messages")
        req["messages"] = [{"role": m["role"], "content": m["content"]} for m in messages]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            req["prompt"] = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            req["prompt_ids"] = prompt
        else:
            raise BadRequest("'prompt' must be a string or a non-empty array of token ids", "prompt")
    req["max_new_tokens"] = _field(body, "max_tokens", (int,), 16 if not chat else 256, "an integer")
    if not 1 <= req["max_new_tokens"] <= max_seq:
        raise BadRequest(f"'max_tokens' {req['max_new_tokens']} is outside [1, {max_seq}]", "max_tokens")
    req["temperature"] = float(_field(body, "temperature", (int, float), 1.0, "a number"))
    if not 0.0 <= req["temperature"] <= 2.0:
        raise BadRequest(f"'temperature' {req['temperature']} is outside [0, 2]", "temperature")
    req["top_p"] = float(_field(body, "top_p", (int, float), 1.0, "a number"))
    if not 0.0 < req["top_p"] <= 1.0:
        raise BadRequest(f"'top_p' {req['top_p']} is outside (0, 1]", "top_p")
    req["top_k"] = _field(body, "top_k", (int,), 0, "an integer")
    if req["top_k"] < 0:
        raise BadRequest(f"'top_k' {req['top_k']} must be >= 0", "top_k")
    req["seed"] = _field(body, "seed", (int,), None, "an integer")
    stop = _field(body, "stop", (str, list), [], "a string or an array of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be at most 4 non-empty strings", "stop")
    req["stop"] = stop
    req["draft_len"] = _field(body, "draft_len", (int, str), "auto", "an integer or 'auto'")
    if isinstance(req["draft_len"], str) and req["draft_len"] != "auto":
        raise BadRequest("'draft_len' must be an integer or 'auto'", "draft_len")
    req["stream"] = _field(body, "stream", (bool,), False, "a boolean")
    if _field(body, "n", (int,), 1, "an integer") != 1:
        raise BadRequest("only 'n' = 1 is supported", "n")
    return req


# -- the app -------------------------------------------------------------------------------

class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("specdeploy_requests", "Requests by endpoint and HTTP status", ["endpoint", "status"], registry=r)
        self.tokens = Counter("specdeploy_generated_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("specdeploy_drafted_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("specdeploy_accepted_tokens", "Draft tokens accepted", registry=r)
        self.acceptance = Gauge("specdeploy_acceptance_rate", "Accepted / drafted tokens since start", registry=r)
        self.draft_len = Histogram("specdeploy_draft_length", "Draft length chosen per round",
                                   buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16), registry=r)
        self.latency = Histogram("specdeploy_request_seconds", "Whole request latency", registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.ttft = Histogram("specdeploy_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
        self.queue = Gauge("specdeploy_queue_waiting", "Requests waiting for a session", registry=r)
        self.in_flight = Gauge("specdeploy_in_flight", "Requests generating", registry=r)
        self._drafted = self._accepted = 0

    def record(self, stats, seconds: float) -> None:
        self.tokens.inc(stats.new_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self._drafted += stats.drafted
        self._accepted += stats.accepted
        if self._drafted:
            self.acceptance.set(self._accepted / self._drafted)
        for k in stats.draft_len_history:
            self.draft_len.observe(k)
        self.latency.observe(seconds)
        if stats.new_tokens:
            self.ttft.observe(stats.first_token_seconds)


def create_app(pool: SessionPool, model_name: str = "specdeploy") -> Starlette:
    metrics = Metrics()
    max_seq = pool.bundle.max_seq

    def error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)

    async def completions(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        started = time.perf_counter()
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequest(f"the request body is not valid JSON ({e})") from None
            req = parse_request(body, chat, max_seq)
            if chat:
                req["prompt_ids"] = pool.session.encode_messages(req.pop("messages"))
            stream = req.pop("stream")
            gen = await run_in_threadpool(_start, pool, req)
        except Overloaded as e:
            metrics.requests.labels(endpoint, "503").inc()
            return error(503, str(e), "overloaded")
        except BadRequest as e:
            metrics.requests.labels(endpoint, "400").inc()
            return error(400, str(e), "invalid_request_error", e.param)
        except SpecdeployError as e:
            metrics.requests.labels(endpoint, "400").inc()
            return error(400, str(e), "invalid_request_error")
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        base = {"id": ident, "created": created, "model": model_name}
        metrics.requests.labels(endpoint, "200").inc()

        def done(stats):
            metrics.record(stats, time.perf_counter() - started)

        if stream:
            return StreamingResponse(_sse(gen, base, chat, done), media_type="text/event-stream")
        texts, ids = [], []
        result_stats = gen.stats

        def collect():
            for piece in gen:
                texts.append(piece.text)
                ids.extend(piece.token_ids)

        await run_in_threadpool(collect)
        done(result_stats)
        text = "".join(texts)
        finish = FINISH[result_stats.finish_reason]
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            if chat
            else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        )
        return JSONResponse({
            **base,
            "object": "chat.completion" if chat else "text_completion",
            "choices": [choice],
            "usage": _usage(result_stats),
            "specdeploy": result_stats.as_dict(),
        })

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": model_name, "sessions": len(pool.sessions),
                             "in_flight": pool.in_flight, "waiting": pool.waiting, "max_queue": pool.max_queue})

    async def metrics_endpoint(request: Request) -> Response:
        metrics.queue.set(pool.waiting)
        metrics.in_flight.set(pool.in_flight)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "specdeploy"}]})

    async def completions_route(request: Request) -> Response:
        return await completions(request, chat=False)

    async def chat_route(request: Request) -> Response:
        return await completions(request, chat=True)

    return Starlette(routes=[
        Route("/v1/completions", completions_route, methods=["POST"]),
        Route("/v1/chat/completions", chat_route, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ])


def _start(pool: SessionPool, req: dict):
    return pool.stream(req.pop("prompt", None), **req)


def _usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}  # reused from the prompt cache


def _sse(gen, base: dict, chat: bool, done):
    """Server-sent events in the OpenAI chunk format; a sync iterator Starlette runs in a
    worker thread. A client that disconnects closes it, which frees the session."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(payload) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    try:
        if chat:
            yield event({**base, "object": kind, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        for piece in gen:
            if not piece.text:
                continue
            choice = {"index": 0, "delta": {"content": piece.text}} if chat else {"index": 0, "text": piece.text}
            yield event({**base, "object": kind, "choices": [{**choice, "finish_reason": None}]})
        finish = FINISH[gen.stats.finish_reason]
        last = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
        yield event({**base, "object": kind, "choices": [{**last, "finish_reason": finish}], "usage": _usage(gen.stats)})
        yield "data: [DONE]\n\n"
        done(gen.stats)
    finally:
        gen.close()


def serve(bundle: str, host: str = "127.0.0.1", port: int = 8000, workers: int = 1, max_queue: int = 8,
          threads: int | None = None, model_name: str | None = None) -> None:
    import uvicorn

    pool = SessionPool(bundle, workers=workers, max_queue=max_queue, threads=threads)
    app = create_app(pool, model_name or pool.bundle.path.name)
    uvicorn.run(app, host=host, port=port, log_level="warning")
