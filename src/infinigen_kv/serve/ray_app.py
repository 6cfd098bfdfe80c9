"""Scale-out on Ray Serve: N replicas of the server (each its own engine, model and KV pool) behind Ray's
HTTP proxy, which spreads requests over them and restarts a replica that dies. Needs the `ray` extra
(`pip install 'infinigen-kv[ray]'`); the plain server (`infinigen serve`) does not.

    infinigen serve --replicas 2 [--ray-address auto] ...         # the CLI: local Ray, or a running cluster
    serve run infinigen_kv.serve.ray_app:app_builder model=/path/to/ckpt method=infinigen replicas=2

Each replica serves the same OpenAI-compatible app as the plain server (serve/app.py), so clients, /health
and /metrics (per replica: the proxy answers from whichever replica it picks) are unchanged.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from ..config import DEFAULT_METHOD

log = logging.getLogger("uvicorn.error")


def import_serve():
    try:
        from ray import serve
    except ImportError:
        raise RuntimeError("--replicas needs Ray Serve: pip install 'infinigen-kv[ray]'") from None
    return serve


class Replica:
    """One replica: loads the model, starts an engine and hands Ray the ASGI app (ray.serve.ingress)."""

    def __init__(self, load: dict, method: str, options: dict, engine: dict, app: dict, threads: int | None,
                 fixed_threads: int | None = None):
        import torch

        from ..model.load import load_model
        from .app import create_app
        from .engine import Engine

        if fixed_threads:
            load = {**load, "threads": fixed_threads}  # --threads N: the backend's fixed count
        elif threads:
            torch.set_num_threads(threads)  # replicas on one machine share its cores (fewer while busy: threads.py)
        self.engine = Engine.on_one_thread(lambda: load_model(**load), method, options, **engine)
        self.asgi = create_app(self.engine, **app)  # (not self.app: a property of Ray's wrapper)

    def __serve_build_asgi_app__(self):
        return self.asgi

    def check_health(self) -> None:
        """Ray's periodic health check: a replica whose engine worker died is restarted."""
        if not self.engine.thread.is_alive():
            raise RuntimeError("the engine's worker thread is gone")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close(timeout=5)


def application(replicas: int, load: dict, method: str, options: dict, engine: dict, app: dict,
                cpus: float | None = None, gpus: float = 0, grace_s: float = 30.0, threads: int | None = None):
    """The Ray Serve application: `replicas` copies of Replica, each asking Ray for `cpus` CPUs (default: the
    machine's cores shared out) and `gpus` GPUs; a replica being stopped gets grace_s for its requests; threads:
    each replica's fixed thread count (default: its CPUs, fewer while measured faster)."""
    serve = import_serve()
    cpus = cpus if cpus is not None else max(1, (os.cpu_count() or 1) // replicas)
    deployment = serve.deployment(serve.ingress()(Replica), name="infinigen", num_replicas=replicas,
                                  ray_actor_options={"num_cpus": cpus, "num_gpus": gpus},
                                  max_ongoing_requests=engine.get("queue_size", 64) + engine.get("max_batch", 8),
                                  health_check_period_s=5, health_check_timeout_s=30,
                                  graceful_shutdown_timeout_s=grace_s)
    return deployment.bind(load, method, options, engine, app, int(cpus) or None, threads)


def app_builder(args: dict):
    """For `serve run infinigen_kv.serve.ray_app:app_builder key=value ...`: model, device, method, budget,
    min_budget, replicas, served_model_name, api_key, max_batch, queue_size, max_pool_bytes, prefill_chunk, batching,
    prefix_cache_bytes, prefix_cache_dir, prefix_cache_disk_bytes (strings, as Ray passes them)."""
    model = args.get("model")
    options = {"budget": float(args["budget"])} if "budget" in args else {}
    if "min_budget" in args:
        options["min_budget"] = int(args["min_budget"])
    engine = {k: int(args[k]) for k in ("max_batch", "queue_size", "max_pool_bytes", "prefill_chunk",
                                        "prefix_cache_bytes", "prefix_cache_disk_bytes") if k in args}
    for k in ("batching", "prefix_cache_dir"):
        if k in args:
            engine[k] = args[k]
    from ..model.source import served_ids

    model_id, aliases = served_ids(model, args.get("served_model_name"))
    app = {"model_id": model_id, "aliases": aliases, "api_key": args.get("api_key")}
    return application(int(args.get("replicas", 1)), {"name": model, "device": args.get("device")},
                       args.get("method", DEFAULT_METHOD), options, engine, app)


def replica_pids() -> set[int]:
    """Processes of this machine running a replica of ours (Ray titles them ServeReplica:<app>:<deployment>)."""
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"ServeReplica:infinigen:" in f.read():
                    pids.add(int(pid))
        except OSError:
            pass
    return pids


def run(application_, host: str, port: int, address: str | None = None) -> None:
    """Start Ray (or join the cluster at `address`), serve the application on host:port until SIGTERM or
    SIGINT, then shut Serve down (each replica drains for the deployment's graceful_shutdown_timeout_s)."""
    import ray

    # Ray Serve kills an HTTP proxy that misses three 5-10 s checks; a machine busy with other work (or a replica's
    # model loading on every core) delays them that long, and the proxy then dies before it serves: 60 s each,
    # unless the environment says otherwise (read by Ray's processes, which inherit it).
    for name in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        os.environ.setdefault(name, "60")
    serve = import_serve()
    ray.init(address=address, include_dashboard=False, log_to_driver=True,
             **({} if address else {"num_cpus": os.cpu_count()}))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application_, name="infinigen", route_prefix="/")
        log.info("serving on http://%s:%d/v1 with Ray Serve", host, port)
        stop.wait()
        log.info("shutting down Ray Serve")
    finally:
        serve.shutdown()
        ray.shutdown()
