"""The prefix cache through the server, with the openai client (a command, not a test: results go to
docs/BENCHMARKS.md).

    python scripts/prefix_bench.py --data DIR [--model M] [--methods infinigen,full]
        [--scenarios chat,shared,restart,memory,questions] [--out docs/results/prefix-DATE]

chat     a ~4,000-token document, then 8 user turns (64 tokens each answer, greedy, EOS ignored): time to first
         token per turn with the prefix cache and without (--prefix-cache-bytes 0), per method.
shared   8 and 32 clients at once, each request a shared 2,000-token system prompt then load_test.py's mix (chat or
         completions shape, prompt lengths, max_tokens 16-256): p50/p99 TTFT and generated tokens/s, with and without.
restart  a server with --prefix-cache-dir asked about the document, stopped, started again and asked again: the
         restarted server's first TTFT against a cold start's.
memory   distinct 2,000-token system prompts under a small --max-pool-bytes and --prefix-cache-bytes: RSS growth over
         idle against the two limits, and every request's outcome (none lost).
questions  one long document (--questions-doc-words: ~32k tokens, a 32k model's context) and 5 questions about it, each
         a fresh completion request (the document, then the question), with the prefix cache and without: time to
         first token of each, whether the answers are identical, the server's peak RSS (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import requests

from infinigen_kv.bench.server import WORDS, quantiles, rss, start, stop

MODEL_ID = "default"
QUESTIONS = ["What is this text about?", "Who are the main people in it?", "Where does it take place?",
             "What happens first?", "What happens at the end?", "Quote one sentence from the middle.",
             "What is the tone of the text?", "Summarize it in two sentences."]


def document(data: str, words: int, offset: int = 0) -> str:
    """`words` words of WikiText-2 from word `offset` (~1.3 tokens a word with the default model)."""
    text = (Path(data) / "wikitext-2" / "test.txt").read_text(encoding="utf-8").split()
    return " ".join(text[offset: offset + words])


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)


def streamed_chat(client, messages, max_tokens=64, **kw):
    """(time to first token, answer text, prompt tokens, cached tokens) of one streamed greedy chat request."""
    return streamed(client.chat.completions.create, lambda c: c.choices[0].delta.content, messages=messages,
                    max_tokens=max_tokens, **kw)


def streamed_completion(client, prompt: str, max_tokens=64):
    """The same for a completion request (a prompt as it is: any model, no chat template needed)."""
    return streamed(client.completions.create, lambda c: c.choices[0].text, prompt=prompt, max_tokens=max_tokens)


def streamed(create, piece, **kw):
    t0, first, parts, usage = time.perf_counter(), None, [], None
    for chunk in create(model=MODEL_ID, temperature=0, stream=True, stream_options={"include_usage": True}, **kw):
        text = piece(chunk) if chunk.choices else None
        if text:
            first = first or time.perf_counter() - t0
            parts.append(text)
        if chunk.usage is not None:
            usage = chunk.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return first, "".join(parts), usage.prompt_tokens, cached


def chat(args, method: str, reuse: bool) -> dict:
    proc, url = start(args.model, method, ["--served-model-name", MODEL_ID] + ([] if reuse else
                                                                             ["--prefix-cache-bytes", "0"]))
    try:
        client, doc = client_for(url), document(args.data, args.doc_words)
        messages, turns = [{"role": "user", "content": f"{doc}\n\n{QUESTIONS[0]}"}], []
        for i in range(args.turns):
            ttft, answer, prompt, cached = streamed_chat(client, messages, extra_body={"ignore_eos": True})
            turns.append({"turn": i + 1, "ttft_s": round(ttft, 3), "prompt_tokens": prompt, "cached_tokens": cached})
            print(json.dumps({"scenario": "chat", "method": method, "reuse": reuse, **turns[-1]}), flush=True)
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": QUESTIONS[(i + 1) % len(QUESTIONS)]}]
    finally:
        stop(proc)
    return {"scenario": "chat", "method": method, "reuse": reuse, "turns": turns}


def shared_request(client, system: str, rng: random.Random):
    """One request of load_test.py's mix after the shared system prompt: (TTFT, completion tokens)."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.choice([50, 200, 400])))
    max_tokens = rng.choice([16, 32, 64, 128, 256])
    t0, first, tokens = time.perf_counter(), None, 0
    if rng.random() < 0.5:
        kw = dict(messages=[{"role": "system", "content": system}, {"role": "user", "content": text + "\nSummarize."}],
                  temperature=0.7, seed=rng.randrange(1000))
        create, piece = client.chat.completions.create, lambda c: c.choices and c.choices[0].delta.content
    else:
        kw = dict(prompt=system + "\n\n" + text, temperature=0)
        create, piece = client.completions.create, lambda c: c.choices and c.choices[0].text
    for chunk in create(model=MODEL_ID, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
                        **kw):
        if first is None and piece(chunk):
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first, tokens


def load(url, clients: int, per_client: int, systems: list[str], seed: int) -> dict:
    client, errors = client_for(url), []

    def worker(c):
        rng, out = random.Random(seed * 1000 + c), []
        for r in range(per_client):
            try:
                out.append(shared_request(client, systems[(c * per_client + r) % len(systems)], rng))
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(e).__name__}: {e}")
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [x for out in pool.map(worker, range(clients)) for x in out]
    wall = time.perf_counter() - t0
    ttfts = [f for f, _ in results if f is not None]
    (t50, t99), tokens = quantiles(ttfts), sum(n for _, n in results)
    return {"clients": clients, "requests": clients * per_client, "errors": len(errors), "error_examples": errors[:3],
            "ttft_p50_s": t50, "ttft_p99_s": t99, "completion_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2), "wall_s": round(wall, 1)}


def shared(args, method: str, reuse: bool) -> list[dict]:
    proc, url = start(args.model, method, ["--served-model-name", MODEL_ID] + ([] if reuse else
                                                                             ["--prefix-cache-bytes", "0"]))
    out = []
    try:
        system = document(args.data, args.system_words, offset=50_000)
        for clients in args.clients:
            row = {"scenario": "shared", "method": method, "reuse": reuse,
                   **load(url, clients, args.requests, [system], args.seed)}
            print(json.dumps(row), flush=True)
            out.append(row)
    finally:
        stop(proc)
    return out


def restart(args, method: str) -> dict:
    doc = document(args.data, args.doc_words)
    with tempfile.TemporaryDirectory() as disk:
        times = []
        for i, question in enumerate(QUESTIONS[:2]):  # the cold start, then a restarted server on the same disk
            proc, url = start(args.model, method, ["--served-model-name", MODEL_ID, "--prefix-cache-dir", disk])
            try:
                ttft, _, prompt, cached = streamed_chat(client_for(url), [{"role": "user", "content": f"{doc}\n\n{question}"}])
                times.append({"ttft_s": round(ttft, 3), "prompt_tokens": prompt, "cached_tokens": cached})
            finally:
                stop(proc)
    row = {"scenario": "restart", "method": method, "cold": times[0], "restarted": times[1],
           "ratio": round(times[1]["ttft_s"] / times[0]["ttft_s"], 4)}
    print(json.dumps(row), flush=True)
    return row


def questions(args, method: str) -> list[dict]:
    """The document and each question as its own completion request (any model: no chat template needed), with the
    prefix cache and then without (a second server): per question TTFT, prompt / cached tokens, and the answers
    compared across the two runs."""
    doc, runs = document(args.data, args.questions_doc_words), {}
    for reuse in (True, False):
        proc, url = start(args.model, method, ["--served-model-name", MODEL_ID] + ([] if reuse else
                                                                                 ["--prefix-cache-bytes", "0"]))
        try:
            client, rows = client_for(url), []
            for i, question in enumerate(QUESTIONS[: args.questions]):
                ttft, answer, prompt, cached = streamed_completion(client, f"{doc}\n\nQuestion: {question}\nAnswer:")
                rows.append({"question": i + 1, "ttft_s": round(ttft, 3), "prompt_tokens": prompt,
                             "cached_tokens": cached, "answer": answer})
                print(json.dumps({"scenario": "questions", "method": method, "reuse": reuse,
                                  "peak_rss": rss(proc.pid, "VmHWM"), **rows[-1]}), flush=True)
            runs[reuse] = {"rows": rows, "peak_rss": rss(proc.pid, "VmHWM"), "prefix_bytes": stored_bytes(url)}
        finally:
            stop(proc)
    out = []
    for reuse, run in runs.items():
        rows = run["rows"]
        later = [r["ttft_s"] for r in rows[1:]]
        row = {"scenario": "questions", "method": method, "reuse": reuse, "peak_rss": run["peak_rss"],
               "prefix_bytes": run["prefix_bytes"], "first_ttft_s": rows[0]["ttft_s"], "later_ttft_s": later,
               "later_over_first_max": round(max(later) / rows[0]["ttft_s"], 4) if later else None,
               "identical_answers": ([a["answer"] == b["answer"] for a, b in zip(rows, runs[False]["rows"])]
                                     if reuse else None),
               "questions": rows}
        print(json.dumps({k: v for k, v in row.items() if k != "questions"}), flush=True)
        out.append(row)
    return out


def stored_bytes(url: str) -> int:
    """The bytes the server's prefix store holds in memory now (/metrics)."""
    text = requests.get(url + "/metrics", timeout=10).text
    return int(sum(float(l.split()[-1]) for l in text.splitlines()
                   if l.startswith("infinigen_prefix_cache_memory_bytes")))


def memory(args, method: str) -> dict:
    pool, prefix = args.memory_limits
    proc, url = start(args.model, method, ["--served-model-name", MODEL_ID, "--max-pool-bytes", str(pool),
                                           "--prefix-cache-bytes", str(prefix), "--queue-size", "256"])
    idle, peak, done = rss(proc.pid), 0, False
    stored_peak = 0

    def watch():
        nonlocal peak, stored_peak
        while not done:
            peak = max(peak, rss(proc.pid))
            text = requests.get(url + "/metrics", timeout=10).text
            stored_peak = max([stored_peak] + [float(l.split()[-1]) for l in text.splitlines()
                                               if l.startswith("infinigen_prefix_cache_memory_bytes")])
            time.sleep(0.1)

    try:
        systems = [document(args.data, args.system_words, offset=60_000 + 5_000 * i) for i in range(8)]
        with ThreadPoolExecutor(1) as pool_:
            watcher = pool_.submit(watch)
            result = load(url, 16, 2, systems, args.seed)
            done = True
            watcher.result()
        metrics = requests.get(url + "/metrics", timeout=10).text
    finally:
        status = stop(proc)
    evictions = sum(float(l.split()[-1]) for l in metrics.splitlines()
                    if l.startswith("infinigen_prefix_cache_memory_evictions"))
    row = {"scenario": "memory", "method": method, "pool_limit": pool, "prefix_limit": prefix, **result,
           "idle_rss": idle, "peak_rss": peak, "rss_growth": peak - idle,
           "growth_over_limits": round((peak - idle) / (pool + prefix), 3), "prefix_bytes_peak": int(stored_peak),
           "prefix_evictions": int(evictions), "exit_status": status}
    print(json.dumps(row), flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="the evaluation data directory (wikitext-2/ inside)")
    p.add_argument("--model", default=None)
    p.add_argument("--methods", default="infinigen,full")
    p.add_argument("--scenarios", default="chat,shared,restart,memory")
    p.add_argument("--doc-words", type=int, default=3000, help="chat/restart document (~4,000 tokens)")
    p.add_argument("--system-words", type=int, default=1500, help="shared system prompt (~2,000 tokens)")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--questions-doc-words", type=int, default=24_900,
                   help="questions: the document (~32k tokens with the 0.5B's tokenizer, within a 32k context)")
    p.add_argument("--questions", type=int, default=5)
    p.add_argument("--clients", default="8,32")
    p.add_argument("--requests", type=int, default=1, help="shared: requests per client")
    p.add_argument("--memory-limits", default="1GiB,256MiB", help="memory: --max-pool-bytes,--prefix-cache-bytes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="a directory for results.jsonl")
    args = p.parse_args()
    if not (Path(args.data) / "wikitext-2" / "test.txt").is_file():
        raise SystemExit(f"no wikitext-2/test.txt under {args.data}")
    from infinigen_kv.cli import _size

    args.clients = [int(c) for c in args.clients.split(",")]
    args.memory_limits = [_size(x) for x in args.memory_limits.split(",")]
    rows = []
    for scenario in args.scenarios.split(","):
        for method in args.methods.split(","):
            if scenario == "chat":
                rows += [chat(args, method, reuse) for reuse in (True, False)]
            elif scenario == "shared":
                for reuse in (True, False):
                    rows += shared(args, method, reuse)
            elif scenario == "restart":
                rows.append(restart(args, method))
            elif scenario == "memory":
                rows.append(memory(args, method))
            elif scenario == "questions":
                rows += questions(args, method)
            else:
                raise SystemExit(f"unknown scenario {scenario}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "results.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
