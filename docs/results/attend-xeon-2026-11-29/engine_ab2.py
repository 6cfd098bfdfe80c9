"""In-engine A/B: HEAD's kernels against the tree's (pairs_upto 64 and 0), alternated step by step."""
import sys, time, torch
sys.path.insert(0, "scripts/dev")
from pathlib import Path
from kernel_ab import build, show, KERNELS, FILES
import infinigen_kv as ig
from infinigen_kv.model import kernels, backend as backends
from infinigen_kv.bench.speed import prompts
from infinigen_kv.runtime.generation import prefill
torch.set_num_threads(2)
old = build({f: show("HEAD", f"{KERNELS}/{f}") for f in FILES})
new = build({f: Path(KERNELS, f).read_text() for f in FILES})
model, tok = ig.load_model(sys.argv[1], weights="int4")
B, n, method = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ids, mask = prompts(tok, B, n)
cache = ig.make_cache(method, model, **({"min_saving": 0} if method == "infinigen" else {}))
cache.reserve(n + 400)
prefill(model, ids, mask, cache, 400)
be = backends.cpu()
configs = {"HEAD": (old, None), "pairs+pf": (new, 64), "widened+pf": (new, 0)}
res = {k: [] for k in configs}
pos = n
for rnd in range(int(sys.argv[5]) if len(sys.argv) > 5 else 8):
    for name, (mod, upto) in configs.items():
        object.__setattr__(be, "ops", mod)
        kernels._module = mod
        if upto is not None:
            mod.set_attend_pairs_upto(upto)
        for i in range(3):
            t = time.perf_counter()
            model.decode(cache, torch.full((B,), 100), torch.full((B, 1), pos), None)
            if i:
                res[name].append((time.perf_counter() - t) * 1e3)
            pos += 1
base = sorted(res["HEAD"])[len(res["HEAD"]) // 2]
for name, v in res.items():
    med = sorted(v)[len(v) // 2]
    print(f"B{B} x {n} {method} {name}: step {med:.1f} ms ({med / base:.3f}x HEAD)")
