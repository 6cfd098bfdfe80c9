"""Load and fuzz test of `infinigen serve` on loopback (a command, not a test; results go to
docs/BENCHMARKS.md).

    python scripts/load_test.py [--model M] [--methods infinigen,full] [--batching static,continuous]
        [--clients 8,32] [--requests 4] [--burst LIMIT,CLIENTS,WORDS,MAX_TOKENS] [--fuzz 500]

Per method and batching policy: one server; per client count, that many threads each sending `requests`
requests of mixed kinds (chat or completions, 3/4 streamed), prompt lengths (--words) and max_tokens
(16-256) with the openai client; reports errors, p50/p99 latency and time to first token (streamed ones)
and generated tokens/s. --burst: admission under a small --max-pool-bytes (RSS measured). Then `fuzz` request bodies drawn by hypothesis from the server's OpenAPI schema (and
valid bodies with one field replaced by arbitrary JSON) against a server with a small max_tokens limit:
every answer must be < 500 and the server must still answer /health.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import requests

from infinigen_kv.bench.server import WORDS, quantiles, rss, start, stop

def one_request(client, model_id, rng, lengths):
    """One request of a random kind, prompt length and max_tokens; -> (latency, time to first token or None
    when not streamed, completion tokens)."""
    words = rng.choice(lengths)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    max_tokens = rng.choice([16, 32, 64, 128, 256])
    chat, stream = rng.random() < 0.5, rng.random() < 0.75
    t0 = time.perf_counter()
    if chat:
        kw = dict(model=model_id, messages=[{"role": "user", "content": text + "\nSummarize."}],
                  max_tokens=max_tokens, temperature=0.7, seed=rng.randrange(1000))
        create, piece = client.chat.completions.create, lambda c: c.choices and c.choices[0].delta.content
    else:
        kw = dict(model=model_id, prompt=text, max_tokens=max_tokens, temperature=0)
        create, piece = client.completions.create, lambda c: c.choices and c.choices[0].text
    if not stream:
        return time.perf_counter() - t0, None, create(**kw).usage.completion_tokens
    first = None
    for chunk in create(**kw, stream=True, stream_options={"include_usage": True}):
        if first is None and piece(chunk):
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return time.perf_counter() - t0, first, tokens


def load(url, model_id, clients, per_client, seed, lengths, ramp):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
    errors, latencies, ttfts, tokens = [], [], [], 0

    def worker(c):
        rng = random.Random(seed * 1000 + c)
        time.sleep(ramp * c / clients)  # clients start spread over the ramp (0: all at once, a burst)
        out = []
        for _ in range(per_client):
            try:
                out.append(one_request(client, model_id, rng, lengths))
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(e).__name__}: {e}")
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for out in pool.map(worker, range(clients)):
            for lat, first, n in out:
                latencies.append(lat)
                if first is not None:
                    ttfts.append(first)
                tokens += n
    wall = time.perf_counter() - t0
    (p50, p99), (t50, t99) = quantiles(latencies), quantiles(ttfts)
    return {"clients": clients, "ramp_s": ramp, "requests": clients * per_client, "errors": len(errors), "error_examples": errors[:3],
            "p50_s": p50, "p99_s": p99, "ttft_n": len(ttfts), "ttft_p50_s": t50, "ttft_p99_s": t99,
            "completion_tokens": tokens, "tokens_per_s": round(tokens / wall, 2), "wall_s": round(wall, 1)}


def burst(model, method, model_id, limit, clients, words, max_tokens):
    """Admission under memory pressure: `clients` long requests at once against --max-pool-bytes `limit`;
    every one must complete or be refused with 503 (none lost), and the server's RSS over its idle RSS must
    stay under the limit + 10%."""
    proc, url = start(model, method, ["--max-pool-bytes", str(limit), "--queue-size", str(clients)])
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
    idle, peak, pool_peak, done = rss(proc.pid), 0, 0, False
    text = " ".join(random.Random(0).choice(WORDS) for _ in range(words))

    def one(_):
        try:
            r = client.completions.create(model=model_id, prompt=text, max_tokens=max_tokens, temperature=0)
            return "ok" if r.usage.completion_tokens == max_tokens else "short"
        except openai.APIStatusError as e:
            return str(e.status_code)
        except Exception as e:  # noqa: BLE001 - reported
            return type(e).__name__

    def watch():
        nonlocal peak, pool_peak
        while not done:
            peak = max(peak, rss(proc.pid))
            text = requests.get(url + "/metrics", timeout=10).text
            pool_peak = max(pool_peak, *(float(l.split()[-1]) for l in text.splitlines()
                                         if l.startswith("infinigen_pool_bytes")))
            time.sleep(0.05)

    try:
        with ThreadPoolExecutor(clients + 1) as pool:
            watcher = pool.submit(watch)
            outcomes = list(pool.map(one, range(clients)))
            done = True
            watcher.result()
    finally:
        status = stop(proc)
    counts = {k: outcomes.count(k) for k in sorted(set(outcomes))}
    return {"method": method, "limit_bytes": limit, "clients": clients, "words": words, "max_tokens": max_tokens,
            "outcomes": counts, "idle_rss": idle, "peak_rss": peak, "rss_growth": peak - idle,
            "growth_over_limit": round((peak - idle) / limit, 3), "pool_bytes_peak": int(pool_peak),
            "exit_status": status}


def fuzz(url, model_id, count):
    from hypothesis import HealthCheck, given, settings  # the fuzzing only (serve_speed.py imports start/stop)
    from hypothesis import strategies as st
    from hypothesis_jsonschema import from_schema

    schema = requests.get(url + "/openapi.json").json()
    components = schema.get("components", {})

    def body_strategy(name):
        return from_schema({"$ref": f"#/components/schemas/{name}", "components": components})

    text = st.text() | st.text(st.characters(categories=["Cs"]) | st.characters(), min_size=1, max_size=8)  # lone surrogates too
    anything = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text,
                            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                            max_leaves=8)
    valid = {"/v1/chat/completions": {"model": model_id, "messages": [{"role": "user", "content": "hello"}],
                                      "max_tokens": 4},
             "/v1/completions": {"model": model_id, "prompt": "hello", "max_tokens": 4}}

    @st.composite
    def mutated(draw):
        path = draw(st.sampled_from(sorted(valid)))
        body = dict(valid[path])
        key = draw(st.sampled_from(sorted(body) + ["temperature", "top_p", "stop", "seed", "stream", "n",
                                                   "stream_options", "max_completion_tokens", "logprobs",
                                                   "top_logprobs", "tools", "tool_choice", "response_format"]))
        if draw(st.booleans()):
            body[key] = draw(anything)
        else:
            body.pop(key, None)
        return path, body

    schemas = {"/v1/chat/completions": "ChatRequest", "/v1/completions": "CompletionRequest"}
    from_api = st.sampled_from(sorted(schemas)).flatmap(
        lambda p: st.tuples(st.just(p), body_strategy(schemas[p])))
    raw = st.tuples(st.sampled_from(sorted(valid)), anything)
    statuses, server_errors = {}, []

    @settings(max_examples=count, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(from_api, mutated(), raw))
    def check(case):
        path, body = case
        r = requests.post(url + path, data=json.dumps(body), headers={"Content-Type": "application/json"},
                          timeout=300)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code >= 500:
            server_errors.append((path, body, r.text[:200]))
        if r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, r.text

    check()
    alive = requests.get(url + "/health", timeout=10).ok
    return {"bodies": sum(statuses.values()), "statuses": dict(sorted(statuses.items())),
            "server_errors": len(server_errors), "examples": server_errors[:3], "alive_after": alive}


def failover(model, method, model_id, clients, seconds, kill_at):
    """Ray Serve with 2 replicas: `clients` threads send requests for `seconds`; at `kill_at` one replica is
    killed (SIGKILL). Reports what succeeded and failed before and after, and when Ray had replaced it."""
    from infinigen_kv.serve.ray_app import replica_pids

    proc, url = start(model, method, ["--replicas", "2"])
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    results, t0 = [], time.time()
    until = t0 + seconds

    def worker(c):
        rng = random.Random(c)
        while time.time() < until:
            start_t = time.time()
            try:
                text = " ".join(rng.choice(WORDS) for _ in range(rng.choice([50, 200, 800])))
                r = client.completions.create(model=model_id, prompt=text, max_tokens=32, temperature=0)
                results.append((start_t - t0, time.time() - t0, r.usage.completion_tokens == 32, ""))
            except Exception as e:  # noqa: BLE001 - counted and reported
                results.append((start_t - t0, time.time() - t0, False, type(e).__name__))

    try:
        pids = replica_pids()
        with ThreadPoolExecutor(clients) as pool:
            futures = [pool.submit(worker, c) for c in range(clients)]
            time.sleep(kill_at)
            victim = min(pids)
            os.kill(victim, signal.SIGKILL)
            killed = time.time() - t0
            replaced = None
            while replaced is None and time.time() < until + 300:
                now = replica_pids()
                if victim not in now and len(now) == 2:
                    replaced = time.time() - t0
                time.sleep(0.5)
            for f in futures:
                f.result()
    finally:
        status = stop(proc)
    before = [r for r in results if r[1] <= killed]
    after = [r for r in results if r[1] > killed]
    return {"method": method, "clients": clients, "seconds": seconds, "replicas_before": len(pids),
            "killed_at_s": round(killed, 1), "replaced_after_s": round(replaced - killed, 1) if replaced else None,
            "ok_before": sum(r[2] for r in before), "failed_before": sum(not r[2] for r in before),
            "ok_after": sum(r[2] for r in after), "failed_after": sum(not r[2] for r in after),
            "failures": sorted({r[3] for r in results if not r[2]}),
            "ok_after_replacement": sum(r[2] for r in after if replaced and r[0] > replaced), "exit_status": status}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--methods", default="infinigen,full")
    ap.add_argument("--batching", default="static,continuous", help="server policies to compare (--batching)")
    ap.add_argument("--clients", default="8,32", help="concurrent clients, one run per count")
    ap.add_argument("--requests", type=int, default=4, help="per client (0: no load run)")
    ap.add_argument("--fuzz", type=int, default=500)
    ap.add_argument("--burst", default=None, metavar="LIMIT,CLIENTS,WORDS,MAX_TOKENS",
                    help="admission run: e.g. 400000000,12,2000,64 (default: none)")
    ap.add_argument("--failover", default=None, metavar="CLIENTS,SECONDS,KILL_AT",
                    help="Ray Serve run: 2 replicas, one killed at KILL_AT s, e.g. 4,180,60 (needs the ray extra)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ramp", type=float, default=10.0, help="seconds over which the clients start (0: a burst)")
    ap.add_argument("--words", default="50,200,800,2000", help="prompt lengths in words, drawn per request")
    ap.add_argument("--server-args", default="", help="extra arguments for every server, e.g. '--max-batch 16'")
    args = ap.parse_args()
    model_id = args.model or "SmolLM2-135M-Instruct"
    report = {"load": []}
    for method in args.methods.split(",") if args.requests else []:  # --requests 0: no load run
        for batching in args.batching.split(","):
            proc, url = start(args.model, method, ["--batching", batching, *args.server_args.split()])
            try:
                for clients in (int(c) for c in args.clients.split(",")):
                    row = {"method": method, "batching": batching,
                           **load(url, model_id, clients, args.requests, args.seed,
                                  [int(w) for w in args.words.split(",")], args.ramp)}
                    report["load"].append(row)
                    print(json.dumps(row), flush=True)
            finally:
                status = stop(proc)
            for row in report["load"]:
                row.setdefault("exit_status", status)
    if args.burst:
        limit, clients, words, max_tokens = (int(x) for x in args.burst.split(","))
        report["burst"] = burst(args.model, args.methods.split(",")[0], model_id, limit, clients, words, max_tokens)
        print("burst", json.dumps(report["burst"]), flush=True)
    if args.failover:
        clients, seconds, kill_at = (int(x) for x in args.failover.split(","))
        report["failover"] = failover(args.model, args.methods.split(",")[0], model_id, clients, seconds, kill_at)
        print("failover", json.dumps(report["failover"]), flush=True)
    if args.fuzz:
        proc, url = start(args.model, args.methods.split(",")[0], ["--max-tokens-limit", "16"])
        try:
            report["fuzz"] = fuzz(url, model_id, args.fuzz)
        finally:
            status = stop(proc)
        report["fuzz"]["exit_status"] = status
        print("fuzz", json.dumps(report["fuzz"]), flush=True)
    print(json.dumps(report, indent=1))
    ok = all(r["errors"] == 0 for r in report["load"]) and report.get("fuzz", {}).get("server_errors", 0) == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
