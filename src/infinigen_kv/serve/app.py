"""The OpenAI-compatible HTTP app over the engine: its factory, the middleware that bounds bodies and counts
answers, and the error handlers (errors are always {"error": {message, type, param, code}}); the endpoints are
in routes.py.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import Counter
from starlette.exceptions import HTTPException

from .engine import Engine
from .errors import APIError, error_response, validation_error
from .routes import Service, router

log = logging.getLogger(__name__)

PATHS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"}


class Guard:
    """ASGI middleware: refuses bodies over `limit` bytes (413) before the app sees them, answers an
    exception no handler took with a 500 error JSON (one log line, no traceback dump), and counts every
    answered request, 5xx included, by path and status for /metrics."""

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

            return await self._call(scope, replay, counting_send)
        return await self._call(scope, receive, counting_send)

    async def _call(self, scope, receive, send):
        started = False

        async def tracking_send(message):
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:  # a bug of ours: never a traceback to the client, never uncounted
            log.error("%s %s failed: %s: %s", scope["method"], scope["path"], type(e).__name__, e,
                      exc_info=log.isEnabledFor(logging.DEBUG))
            if not started:
                await error_response(500, f"internal error: {type(e).__name__}")(scope, receive, tracking_send)


def create_app(engine: Engine, model_id: str, api_key: str | None = None, max_body_bytes: int = 1 << 20,
               max_tokens_limit: int = 2048, aliases: tuple[str, ...] = ()) -> FastAPI:
    """The app serving `engine` as `model_id`, also answering to `aliases` (its owner closes the engine: run_server,
    after the drain)."""
    app = FastAPI(title="infinigen-kv")
    app.state.service = Service(engine, model_id, api_key, max_tokens_limit, aliases)
    requests = Counter("infinigen_requests", "HTTP requests answered, by path and status", ["path", "status"],
                       registry=engine.metrics.registry)
    app.add_middleware(Guard, limit=max_body_bytes, counter=requests)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return validation_error(list(exc.errors()), request.headers.get("content-type"))

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail))

    app.include_router(router)
    return app
