"""OpenAI-compatible server: `infinigen serve` (FastAPI + uvicorn) over the batching engine."""

from __future__ import annotations

import signal

from .app import create_app
from .engine import Engine, Job

__all__ = ["Engine", "Job", "create_app", "run_server"]


def run_server(engine: Engine, model_id: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               max_body_bytes: int = 1 << 20, max_tokens_limit: int = 2048, graceful_s: float = 30.0) -> None:
    """Serve until SIGTERM/SIGINT: then stop accepting, let in-flight responses finish (up to graceful_s,
    then cancel them), stop the engine and return (exit status 0)."""
    import uvicorn

    app = create_app(engine, model_id, api_key, max_body_bytes, max_tokens_limit)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=graceful_s)
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler makes that a clean exit.
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.Server(config).run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        engine.close()
