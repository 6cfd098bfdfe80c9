"""Scale-out on Ray Serve: `infinigen serve --replicas 2` on loopback answers the openai client
(plain and streaming) through Ray's proxy from both replicas; a replica killed mid-load leaves the other
serving, and Ray starts a new one."""

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from test_serve import MODEL, Server

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
from infinigen_kv.serve.ray_app import replica_pids  # noqa: E402


def test_two_replicas_serve_and_survive_a_killed_one(tmp_path):
    from conftest import save_tiny

    model_dir = save_tiny(tmp_path / "model", eos_never_greedy=True)
    s = Server(model_dir, tmp_path / "server.log", "--method", "full", "--replicas", "2", "--grace-period", "5")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        args = dict(model=MODEL, messages=[{"role": "user", "content": "The pass key is 12345."}], max_tokens=6,
                    temperature=0)
        plain = client.chat.completions.create(**args)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**args, stream=True)
                           if c.choices)
        assert plain.usage.completion_tokens == 6 and streamed == plain.choices[0].message.content
        pids = replica_pids()
        assert len(pids) == 2, open(tmp_path / "server.log").read()[-3000:]
        def busy(_):  # a request, then which replica answers /health
            client.completions.create(model=MODEL, prompt="hi there", max_tokens=30)
            return requests.get(s.url + "/health", timeout=30).json()["replica"]

        # Under concurrent load the proxy spreads requests over both. Its router picks between replicas by their
        # queue lengths as last probed, so one burst may all land on one: ask in bursts until both have answered.
        answered, deadline = set(), time.time() + 300
        with ThreadPoolExecutor(8) as pool:
            while answered != pids and time.time() < deadline:
                answered |= set(pool.map(busy, range(16)))
        assert answered == pids

        results, stop = [], threading.Event()

        def load():
            while not stop.is_set():
                try:
                    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=20,
                                                  temperature=0)
                    results.append((time.time(), r.usage.completion_tokens == 20))
                except openai.OpenAIError:
                    results.append((time.time(), False))

        threads = [threading.Thread(target=load) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(3)
        victim, killed = sorted(pids)[0], time.time()
        os.kill(victim, signal.SIGKILL)
        def served_after() -> int:
            return sum(ok for when, ok in list(results) if when > killed)

        # until Ray has started a new one and the survivor has answered ten requests since the kill (however slow
        # the machine is: a busy one serves fewer a second, never other answers)
        deadline = time.time() + 600
        while time.time() < deadline and (victim in replica_pids() or len(replica_pids()) < 2 or served_after() < 10):
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(60)
        after = [ok for when, ok in results if when > killed]
        assert len(replica_pids() - {victim}) == 2  # Ray started a new one
        assert sum(after) >= 10 and not all(not ok for ok in after[-5:])  # the survivor served throughout
        assert sum(not ok for ok in after) <= 3  # at most the requests in flight on the killed replica
    finally:
        s.stop()
    assert s.proc.returncode == 0
