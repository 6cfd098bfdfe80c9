"""Decode speed of `infinigen serve` as a client sees it, beside `infinigen bench speed` in the same sitting (a
command, not a test; results go to docs/BENCHMARKS.md).

    python scripts/serve_speed.py [--model M] [--methods full,infinigen] [--prompt-len 4096] [--new-tokens 32]
        [--repeats 3]

Per method: one server (`infinigen serve --method M`), then `repeats` streamed completions, one at a time, of the
prompt `bench speed` times (the same token ids, sent as a list of ids), with `ignore_eos`. The decode speed is the
tokens after the first over the time from the first streamed token to the last; the first token's time is the
prefill. Then `infinigen bench speed --batch 1` at the same shape and methods, and the ratio server / bench.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).parent))
from load_test import start, stop  # noqa: E402


def prompt_ids(model: str | None, length: int) -> list[int]:
    """The batch-1 prompt `bench speed` decodes after, as token ids."""
    from transformers import AutoTokenizer

    from infinigen_kv.bench.speed import prompts
    from infinigen_kv.model.load import resolve_source

    tokenizer = AutoTokenizer.from_pretrained(resolve_source(model))
    ids, _ = prompts(tokenizer, 1, length)
    return ids[0].tolist()


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


def serve_speeds(model, methods, ids, new_tokens, repeats) -> dict:
    out = {}
    for method in methods:
        proc, url = start(model, method)
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
            model_id = client.models.list().data[0].id
            one_stream(client, model_id, ids[-128:], 4)  # warm-up (calibration happened at start)
            runs = [one_stream(client, model_id, ids, new_tokens) for _ in range(repeats)]
            for ttft, tps in runs:
                print(f"  serve {method}: first token {ttft:.2f} s, decode {tps:.2f} tok/s", file=sys.stderr)
            out[method] = {"decode_tokens_per_s": statistics.median(r[1] for r in runs),
                           "first_token_s": statistics.median(r[0] for r in runs)}
        finally:
            stop(proc)
    return out


def bench_speeds(model, methods, length, new_tokens, repeats) -> dict:
    cmd = [sys.executable, "-m", "infinigen_kv.cli", "bench", "speed", "--methods", ",".join(methods), "--batch", "1",
           "--prompt-len", str(length), "--new-tokens", str(new_tokens), "--repeats", str(repeats), "--json"]
    if model:
        cmd += ["--model", model]
    res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return {r["method"]: r["decode_tokens_per_s"] for r in res["rows"]}, res["machine"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--methods", default="full,infinigen")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    methods = a.methods.split(",")
    ids = prompt_ids(a.model, a.prompt_len)
    served = serve_speeds(a.model, methods, ids, a.new_tokens, a.repeats)
    benched, machine = bench_speeds(a.model, methods, a.prompt_len, a.new_tokens, a.repeats)
    rows = [{"method": m, "prompt_len": a.prompt_len, "serve_tokens_per_s": round(served[m]["decode_tokens_per_s"], 2),
             "serve_first_token_s": round(served[m]["first_token_s"], 2), "bench_tokens_per_s": round(benched[m], 2),
             "serve_over_bench": round(served[m]["decode_tokens_per_s"] / benched[m], 3)} for m in methods]
    print(json.dumps({"machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
