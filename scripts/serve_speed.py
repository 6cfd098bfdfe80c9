"""Decode speed of `infinigen serve` as a client sees it, beside `infinigen bench speed` in the same sitting (a
command, not a test; results go to docs/BENCHMARKS.md).

    python scripts/serve_speed.py [--model M] [--methods full,infinigen] [--prompt-len 4096] [--new-tokens 32]
        [--repeats 3]

One server per method (`infinigen serve --method M`, idle while the others run), and the model loaded here as
`bench speed` loads it. Then `repeats` rounds, each method in turn: one streamed completion of the prompt `bench
speed` times (the same token ids, sent as a list of ids, `ignore_eos`), then one `bench speed` run of it here
(`bench.speed.run_once`: the same generate call). Alternated so that the machine's drift hits both alike. The
server's decode speed is the tokens after the first over the time from the first streamed token to the last.
Prints medians and the ratio server / bench.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import openai

from infinigen_kv.bench.server import start, stop


def one_stream(client, model_id: str, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, decode tokens/s after it) of one streamed completion."""
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    for chunk in client.completions.create(model=model_id, prompt=ids, max_tokens=new_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            first = first or now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if tokens != new_tokens or first is None or last == first:
        raise SystemExit(f"expected {new_tokens} streamed tokens, got {tokens}")
    return first - t0, (tokens - 1) / (last - first)


def measure(model_name, methods, length, new_tokens, repeats) -> dict:
    import infinigen_kv as ig
    from infinigen_kv.bench.speed import machine_info, prompts, run_once

    model, tokenizer = ig.load_model(model_name)
    ids, mask = prompts(tokenizer, 1, length)
    servers = {m: start(model_name, m) for m in methods}
    runs = {m: {"serve": [], "first": [], "bench": []} for m in methods}
    try:
        clients = {m: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
                   for m, (_, url) in servers.items()}
        model_id = clients[methods[0]].models.list().data[0].id
        options = {"tokenizer": tokenizer}
        for m in methods:  # warm-up: the servers' and this process's first steps
            one_stream(clients[m], model_id, ids[0, -128:].tolist(), 4)
            run_once(model, m, ids[:, -128:], mask[:, -128:], 4, options)
        for rep in range(repeats):
            for m in methods:
                first, tps = one_stream(clients[m], model_id, ids[0].tolist(), new_tokens)
                res = run_once(model, m, ids, mask, new_tokens, options)[0]
                runs[m]["serve"].append(tps)
                runs[m]["first"].append(first)
                runs[m]["bench"].append(res.decode_tokens_per_s)
                print(f"  rep {rep} {m}: serve {tps:.2f} tok/s (first token {first:.2f} s), "
                      f"bench {res.decode_tokens_per_s:.2f} tok/s", file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    med = statistics.median
    rows = [{"method": m, "prompt_len": length, "new_tokens": new_tokens,
             "serve_tokens_per_s": round(med(r["serve"]), 2), "serve_first_token_s": round(med(r["first"]), 2),
             "bench_tokens_per_s": round(med(r["bench"]), 2),
             "serve_over_bench": round(med(r["serve"]) / med(r["bench"]), 3)} for m, r in runs.items()]
    return {"machine": machine_info(next(model.parameters()).device), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--methods", default="full,infinigen")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    print(json.dumps(measure(a.model, a.methods.split(","), a.prompt_len, a.new_tokens, a.repeats), indent=1))


if __name__ == "__main__":
    main()
