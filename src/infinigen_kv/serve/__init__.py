"""OpenAI-compatible server: `infinigen serve` (FastAPI + uvicorn) over the batching engine."""

from __future__ import annotations

import logging
import socket
import time

from .app import create_app
from .engine import Engine, Job

__all__ = ["Engine", "Job", "create_app", "listen", "run_server"]

log = logging.getLogger("uvicorn.error")  # uvicorn's log: where a server's operator looks


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (before the model loads, so a busy port fails in a second, not after
    it); uvicorn starts listening on it. OSError says why it cannot be had."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is not "busy"
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _draining_server(engine: Engine, grace_s: float):
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, with the shutdown a serving engine needs. The first SIGTERM/SIGINT stops admitting
        (new requests and /health answer 503) while the queue and the running batch go on; at grace_s (or
        at once on a second signal) what is left ends with an error event, streams get their [DONE]; once
        the engine is idle uvicorn closes the connections and the process exits 0, without re-raising the
        signal."""

        deadline: float | None = None

        def handle_exit(self, sig, frame):
            if self.deadline is None:
                log.info("draining: no new requests; up to %.0f s for the %d in flight", grace_s, engine.queue_depth)
                self.deadline = time.monotonic() + grace_s
                engine.drain()
            else:  # a second signal: end everything now
                self.deadline = time.monotonic()

        async def on_tick(self, counter: int) -> bool:
            if self.deadline is not None and not engine.stopping and time.monotonic() >= self.deadline:
                if not engine.idle:
                    log.info("grace period over: ending %d request(s)", engine.queue_depth)
                engine.abort()
            if self.deadline is not None and engine.idle:
                self.should_exit = True
            return await super().on_tick(counter)

    return DrainingServer


def log_like_the_server() -> None:
    """The package's own log lines (the prefix cache's warnings, the engine's) through the handlers uvicorn set up
    (its Config does): the same level prefix and stream as the server's lines around them."""
    pkg, server = logging.getLogger("infinigen_kv"), logging.getLogger("uvicorn")
    if server.handlers:
        pkg.handlers, pkg.propagate = list(server.handlers), False
        pkg.setLevel(logging.INFO)


def run_server(engine: Engine, model_id: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               max_body_bytes: int = 1 << 20, max_tokens_limit: int = 2048, grace_s: float = 30.0,
               sock: socket.socket | None = None, aliases: tuple[str, ...] = ()) -> None:
    """Serve until SIGTERM/SIGINT, then drain (see DrainingServer) and return; the engine is closed."""
    import uvicorn

    app = create_app(engine, model_id, api_key, max_body_bytes, max_tokens_limit, aliases)
    # the streams have all ended when uvicorn's own shutdown starts: its timeout only covers stragglers
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    log_like_the_server()
    sock = sock or listen(host, port)
    try:
        _draining_server(engine, grace_s)(config).run(sockets=[sock])
    finally:
        sock.close()
        engine.close()
