"""Whole decode steps of a git revision against the working tree's, in lock-step: two processes, one per tree (its
Python and its kernels), each prefilled once, take turns at one decode step each, so both see the same machine
(this 2-core machine's speed drifts by 1.5x between runs minutes apart: separate runs cannot show a few percent).

    python scripts/dev/step_ab.py --rev HEAD~1 [--batch 1] [--prompt-len 4096] [--steps 32] [--methods full,infinigen]
                                  [--model PATH] [--weights int4]

Prints each method's median step (ms) under the revision and the working tree, and their ratio. The step is the one
`generate` runs (our own where it serves the model), at the defaults, on the default model (--model to change).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(args) -> None:
    """One tree's side: prefill a cache per method, then one decode step per line read ("<method>"), answering the
    step's seconds."""
    import torch

    import infinigen_kv as ig
    from infinigen_kv.bench.speed import prompts

    torch.set_grad_enabled(False)
    model, tok = ig.load_model(args.model, weights=args.weights)
    B, n = args.batch, args.prompt_len
    ids, mask = prompts(tok, B, n)
    caches, pos = {}, {}
    for method in args.methods.split(","):
        cache = ig.make_cache(method, model)
        cache.reserve(n + 2 + 2 * args.steps)  # no buffer grows while timed
        ig.generate(model, ids, mask, cache=cache, max_new_tokens=2, stop_at_eos=False)
        caches[method], pos[method] = cache, n + 2
    x = torch.full((B,), 100)
    print("ready", flush=True)
    for line in sys.stdin:
        method = line.strip()
        cache = caches[method]
        p = torch.full((B, 1), pos[method])
        pos[method] += 1
        t = time.perf_counter()
        with torch.inference_mode():
            if hasattr(model, "decode"):  # our model
                model.decode(cache, x, p, None)
            else:  # a tree from before it: its own step
                from infinigen_kv.model import step as step_mod

                step_mod.decode_step(model, cache, x, p, None)
        print(time.perf_counter() - t, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="the git revision to compare the working tree with")
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--methods", default="full,infinigen")
    ap.add_argument("--gap", type=float, default=0.002, help="seconds between steps (OpenMP threads spin after one)")
    ap.add_argument("--weights", default=None, help="the held weights: bfloat16 (default), int8 or int4")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "rev"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), args.rev], check=True)
        try:
            compare(args, {args.rev: tree, "working tree": ROOT})
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def compare(args, trees: dict) -> None:
    procs = {}
    for name, tree in trees.items():  # one after the other: the prefills do not share the machine
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--batch", str(args.batch),
               "--prompt-len", str(args.prompt_len), "--steps", str(args.steps), "--methods", args.methods]
        if args.model:
            cmd += ["--model", args.model]
        if args.weights:
            cmd += ["--weights", args.weights]
        env = dict(os.environ, PYTHONPATH=str(tree / "src"),  # each tree its own kernel build (torch rebuilds an
                   TORCH_EXTENSIONS_DIR=str(Path(tempfile.gettempdir()) / f"step-ab-ext-{name.replace(' ', '-')}"))
        # extension whose source path changed)
        procs[name] = p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if p.stdout.readline().strip() != "ready":
            sys.exit(f"{name}: the child process failed")
    times = {(name, m): [] for name in trees for m in args.methods.split(",")}
    for _ in range(args.steps):
        for method in args.methods.split(","):
            for name, p in procs.items():
                time.sleep(args.gap)  # the other side's OpenMP threads stop spinning
                p.stdin.write(method + "\n")
                p.stdin.flush()
                times[(name, method)].append(float(p.stdout.readline()))
    for p in procs.values():
        p.stdin.close()
        p.wait()
    rev, work = trees
    print(f"B={args.batch} n={args.prompt_len}, median of {args.steps} steps, alternated step by step")
    for method in args.methods.split(","):
        a, b = (statistics.median(times[(name, method)]) * 1e3 for name in (rev, work))
        print(f"  {method}: {rev} {a:.2f} ms, working tree {b:.2f} ms ({b / a:.3f}x)")


if __name__ == "__main__":
    main()
