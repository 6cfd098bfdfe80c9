#!/usr/bin/env python
"""A prefill's time and peak memory at PREFILL_CHUNK 2,048 and 512, alternated in one process (full, infinigen).

    python scripts/dev/prefill_chunk_ab.py MODEL WEIGHTS BATCH PROMPT_LEN REPEATS   # MODEL: default or a path
Peak: VmHWM above the resident memory before each prefill (reset through /proc/self/clear_refs; Linux)."""
import sys, gc, time, torch
def hwm():
    for l in open('/proc/self/status'):
        if l.startswith('VmHWM'): return int(l.split()[1]) // 1024
def rss():
    for l in open('/proc/self/status'):
        if l.startswith('VmRSS'): return int(l.split()[1]) // 1024
def reset(): open('/proc/self/clear_refs', 'w').write('5')
from infinigen_kv import load_model, make_cache, generate
from infinigen_kv.bench.speed import prompts
import infinigen_kv.runtime.generation as G, infinigen_kv.heap as H
model_name, weights, B, n, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model, tok = load_model(None if model_name == "default" else model_name, weights=weights)
ids, mask = prompts(tok, 1, 128)
for method in ("full", "infinigen"):
    c = make_cache(method, model, tokenizer=tok); generate(model, ids, mask, cache=c, max_new_tokens=4, stop_at_eos=False)
del c; gc.collect(); H.trim()
ids, mask = prompts(tok, B, n)
res = {}
for rep in range(reps):
    for method in ("full", "infinigen"):
        for chunk in (2048, 512):
            G.PREFILL_CHUNK = chunk
            c = make_cache(method, model, tokenizer=tok); gc.collect(); H.trim()
            r0 = rss(); reset(); t = time.perf_counter()
            out = generate(model, ids, mask, cache=c, max_new_tokens=1, stop_at_eos=False)
            dt = time.perf_counter() - t
            res.setdefault((method, chunk), []).append((dt, hwm() - r0))
            del c, out
for (m, ch), v in res.items():
    print(f"{model_name.split('/')[-1][:20]} {weights} B{B}x{n} {m:9s} chunk {ch:4d}: prefill s {[round(x[0],2) for x in v]} best {min(x[0] for x in v):.2f}  peak above start MiB {[x[1] for x in v]}", flush=True)
