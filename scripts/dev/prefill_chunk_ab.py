#!/usr/bin/env python
"""A prefill's time and peak memory at PREFILL_CHUNK 2,048 and 512, alternated in one process (full, infinigen).

    python scripts/dev/prefill_chunk_ab.py MODEL WEIGHTS BATCH PROMPT_LEN REPEATS   # MODEL: default or a path

Peak: VmHWM above the resident memory before each prefill (the mark reset through /proc/self/clear_refs; Linux).
"""

import gc
import sys
import time

from infinigen_kv import generate, load_model, make_cache
from infinigen_kv import heap
from infinigen_kv.bench.speed import prompts
from infinigen_kv.runtime import generation


def status_mib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) // 1024
    raise KeyError(field)


def main(name: str, weights: str, batch: int, length: int, repeats: int) -> None:
    model, tok = load_model(None if name == "default" else name, weights=weights)
    ids, mask = prompts(tok, 1, 128)
    for method in ("full", "infinigen"):  # warm-up (and calibration, once per model)
        generate(model, ids, mask, cache=make_cache(method, model, tokenizer=tok), max_new_tokens=4, stop_at_eos=False)
    ids, mask = prompts(tok, batch, length)
    runs = {}
    for _ in range(repeats):
        for method in ("full", "infinigen"):
            for chunk in (2048, 512):
                generation.PREFILL_CHUNK = chunk
                cache = make_cache(method, model, tokenizer=tok)
                gc.collect()
                heap.trim()
                before = status_mib("VmRSS")
                open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
                t = time.perf_counter()
                generate(model, ids, mask, cache=cache, max_new_tokens=1, stop_at_eos=False)
                runs.setdefault((method, chunk), []).append((time.perf_counter() - t, status_mib("VmHWM") - before))
                del cache
    for (method, chunk), r in runs.items():
        print(f"{name.split('/')[-1][:20]} {weights} B{batch}x{length} {method:9s} chunk {chunk:4d}: prefill s "
              f"{[round(s, 2) for s, _ in r]} best {min(s for s, _ in r):.2f}  peak above start MiB {[p for _, p in r]}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
