"""`infinigen serve` in a child process, for the serving benchmarks (scripts/load_test.py, prefix_bench.py,
serve_speed.py): started on a free loopback port and waited for, stopped; latency quantiles; a process's resident
memory."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import requests

WORDS = ("the pool keeps every key and value while each layer fetches only the few entries that matter "
         "speculated one layer ahead so that the transfer hides behind the compute of the previous layer").split()


def start(model, method, extra=()):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "infinigen_kv.cli", "serve", "--port", str(port), "--method", method, *extra]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if requests.get(url + "/health", timeout=1).ok:
                return proc, url
        except (requests.ConnectionError, requests.Timeout):  # not up yet (Ray's proxy: busy deploying)
            time.sleep(0.5)
    raise SystemExit("server did not start")


def stop(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(120)


def quantiles(xs):
    """(p50, p99) of xs, rounded."""
    if not xs:
        return None, None
    q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else xs * 99
    return round(q[49], 2), round(q[98], 2)


def rss(pid, field: str = "VmRSS") -> int:
    """Resident bytes of a process now (VmRSS), or at its peak so far (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
