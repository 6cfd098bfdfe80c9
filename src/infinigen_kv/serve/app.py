"""OpenAI-compatible HTTP API over the engine: /v1/models, /v1/completions, /v1/chat/completions (plain and
SSE streaming), /health and /metrics (Prometheus). Errors are always {"error": {message, type, param, code}}.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from .engine import Engine, Job, QueueFull
from .schemas import ChatRequest, CompletionRequest

PATHS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"}
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
               503: "server_error", 500: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


class Guard:
    """ASGI middleware: refuses bodies over `limit` bytes (413) before the app sees them, and counts
    answered requests by path and status for /metrics."""

    def __init__(self, app, limit: int, counter: Counter):
        self.app, self.limit, self.counter = app, limit, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in PATHS else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counter.labels(path, str(message["status"])).inc()
            await send(message)

        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await error_response(413, f"request body over {self.limit} bytes")(scope, receive, counting_send)
        if scope["method"] in ("POST", "PUT", "PATCH"):  # read the body here, bounded, then replay it
            body, more = b"", True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > self.limit:
                    return await error_response(413, f"request body over {self.limit} bytes")(
                        scope, receive, counting_send)
            replayed = False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            return await self.app(scope, replay, counting_send)
        return await self.app(scope, receive, counting_send)


def create_app(engine: Engine, model_id: str, api_key: str | None = None, max_body_bytes: int = 1 << 20,
               max_tokens_limit: int = 2048) -> FastAPI:
    registry = CollectorRegistry()
    requests = Counter("infinigen_requests", "HTTP requests answered, by path and status", ["path", "status"],
                       registry=registry)
    prompt_tokens = Counter("infinigen_prompt_tokens", "prompt tokens of finished requests", registry=registry)
    completion_tokens = Counter("infinigen_completion_tokens", "generated tokens of finished requests",
                                registry=registry)
    cancelled = Counter("infinigen_cancelled_requests", "requests whose client left before the end",
                        registry=registry)
    for name, doc, fn in [
        ("infinigen_decode_tokens_per_second", "decode tokens/s of the last batch", "decode_tokens_per_s"),
        ("infinigen_fetched_fraction", "share of past KV entries fetched per layer and step, last batch",
         "fetched_fraction"),
        ("infinigen_pool_bytes", "bytes of the KV pool of the last batch", "pool_bytes"),
    ]:
        Gauge(name, doc, registry=registry).set_function(lambda key=fn: float(engine.last.get(key, 0.0)))
    Gauge("infinigen_queue_depth", "requests waiting or running", registry=registry).set_function(
        lambda: engine.queue_depth)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(engine.close)  # after uvicorn has let in-flight responses finish

    app = FastAPI(title="infinigen-kv", lifespan=lifespan)
    app.add_middleware(Guard, limit=max_body_bytes, counter=requests)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return error_response(400, "the body is not valid JSON", None, "invalid_json")
        where = ".".join(loc)
        return error_response(400, f"{where}: {err.get('msg')}" if where else str(err.get("msg")),
                              loc[0] if loc else None, err.get("type"))

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}")

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or invalid API key (Authorization: Bearer ...)", code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != model_id:
            raise APIError(404, f"model {name!r} not found; this server serves {model_id!r}", "model",
                           "model_not_found")

    def make_job(req, ids: list[int], field: str, max_tokens: int | None) -> Job:
        if not ids:
            raise APIError(400, "the prompt is empty", field)
        ctx = engine.context
        if max_tokens is None:
            max_tokens = min(max_tokens_limit, (ctx - len(ids)) if ctx else max_tokens_limit)
        if max_tokens > max_tokens_limit:
            raise APIError(400, f"max_tokens {max_tokens} is over this server's limit of {max_tokens_limit}",
                           "max_tokens")
        if ctx and len(ids) + max(max_tokens, 1) > ctx:
            raise APIError(400, f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: more than the "
                                f"model's context of {ctx} tokens", field, "context_length_exceeded")
        job = Job(ids, max(max_tokens, 1), req.temperature, req.top_p, req.seed, list(req.stop or []))
        try:
            return engine.submit(job)
        except QueueFull as e:
            raise APIError(503, f"server busy: {e}; retry later", code="queue_full") from None

    def usage(job: Job) -> dict:
        p, c = len(job.prompt_ids), job.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def account(job: Job) -> None:
        prompt_tokens.inc(len(job.prompt_ids))
        completion_tokens.inc(job.completion_tokens)

    async def collect(job: Job) -> tuple[str, str]:
        parts = []
        try:
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    parts.append(value)
                elif kind == "done":
                    account(job)
                    return "".join(parts), value
                else:
                    raise APIError(503 if "shutting down" in value else 500, value)
        finally:
            job.cancelled = True  # a no-op once done; frees the place if this request was cancelled

    def sse(job: Job, chunk, include_usage: bool) -> StreamingResponse:
        """chunk(text or None, finish_reason or None, first) -> the OpenAI chunk object."""

        async def events():
            finished = False
            try:
                yield f"data: {json.dumps(chunk(None, None, True))}\n\n"
                while True:
                    kind, value = await job.events.get()
                    if kind == "text":
                        yield f"data: {json.dumps(chunk(value, None, False))}\n\n"
                    elif kind == "done":
                        finished = True
                        account(job)
                        yield f"data: {json.dumps(chunk(None, value, False))}\n\n"
                        if include_usage:
                            last = {**chunk(None, None, False), "choices": [], "usage": usage(job)}
                            yield f"data: {json.dumps(last)}\n\n"
                        break
                    else:
                        finished = True
                        err = {"message": value, "type": "server_error", "param": None, "code": None}
                        yield f"data: {json.dumps({'error': err})}\n\n"
                        break
                yield "data: [DONE]\n\n"
            finally:
                if not finished:
                    job.cancelled = True
                    cancelled.inc()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id, "method": engine.method, "queue_depth": engine.queue_depth}

    @app.get("/metrics", dependencies=[Depends(authorize)])
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                            "owned_by": "infinigen-kv"}]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(req: CompletionRequest):
        check_model(req.model)
        if isinstance(req.prompt, str):
            ids = await run_in_threadpool(engine.encode, req.prompt)
        else:
            vocab = engine.model.config.vocab_size
            if any(not 0 <= t < vocab for t in req.prompt):
                raise APIError(400, f"token ids must be in [0, {vocab})", "prompt")
            ids = list(req.prompt)
        job = make_job(req, ids, "prompt", req.max_tokens)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, finish, first):
            return {"id": rid, "object": "text_completion", "created": created, "model": model_id,
                    "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}

        if req.stream:
            return sse(job, chunk, bool(req.stream_options and req.stream_options.include_usage))
        text, finish = await collect(job)
        return {**chunk(text, finish, False), "usage": usage(job)}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(req: ChatRequest):
        check_model(req.model)
        messages = [m.plain() for m in req.messages]
        try:
            ids = await run_in_threadpool(engine.chat_ids, messages)
        except Exception as e:  # a template that refuses the conversation (e.g. roles out of order)
            raise APIError(400, f"messages: the chat template refused them: {e}", "messages") from None
        job = make_job(req, ids, "messages", req.max_completion_tokens or req.max_tokens)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, finish, first):
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_id,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        if req.stream:
            return sse(job, chunk, bool(req.stream_options and req.stream_options.include_usage))
        text, finish = await collect(job)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": finish}],
                "usage": usage(job)}

    return app
