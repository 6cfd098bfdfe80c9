import sys, torch
sys.path.insert(0, "scripts/dev")
from kernel_ab import build, show, KERNELS, FILES
from kernel_bench import alternated
from pathlib import Path
torch.set_num_threads(2)
old = build({f: show("HEAD", f"{KERNELS}/{f}") for f in FILES})
new = build({f: Path(KERNELS, f).read_text() for f in FILES})
for B, r, d, n in [tuple(map(int, a.split(","))) for a in sys.argv[1:]]:
    G, L = 2, 24
    pools = [(torch.randn(B, G, n + 64, d).bfloat16(), torch.randn(B, G, n + 64, d).bfloat16()) for _ in range(L)]
    q = torch.randn(B, G, r, d)
    step = lambda k: [k.attend(q, K, V, None, None, None, -1, None, n, d ** -0.5, torch.float32) for K, V in pools]
    ms = alternated([lambda: step(old), lambda: step(new)], 20)
    a, b = step(old), step(new)
    err = max((x - y).abs().max().item() for x, y in zip(a, b))
    print(f"B{B} r{r} d{d} n{n}: HEAD {ms[0]:.2f} ms, tree {ms[1]:.2f} ({ms[1]/ms[0]:.3f}x), max diff {err:.2e}", flush=True)
