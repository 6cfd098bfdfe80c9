"""`make demo`: a ~8,000-token prompt (near the default model's 8,192-token context) with a pass key hidden in it,
answered by `infinigen generate` once with the full cache and once with InfiniGen; prints both answers, both speeds
and the fetched fraction. At ~4,000 tokens InfiniGen's steps would attend densely on this model (speculation would
save less than it costs: docs/BENCHMARKS.md, "Never slower than full")."""

import json
import subprocess
import sys
from pathlib import Path

from infinigen_kv.bench.tasks import passkey
from infinigen_kv.config import DEFAULT_BUDGET, DEFAULT_MIN_BUDGET
from infinigen_kv.model.load import load_model

root = Path(__file__).resolve().parent.parent
build = root / "build"
build.mkdir(exist_ok=True)
print("Loading the default model (SmolLM2-135M-Instruct; the first run reads its GGUF into the held form once) ...",
      flush=True)
_, tokenizer = load_model()
sample = passkey(tokenizer, length=8000, seed=0)
prompt_file = build / "demo_prompt.txt"
prompt_file.write_text(sample.prompt)
print(f"Prompt: {prompt_file} ({len(tokenizer(sample.prompt)['input_ids'])} tokens), pass key {sample.answer} "
      f"hidden inside; the first InfiniGen run also calibrates the model (a prefill of ~2,000 tokens: ~5 s on 2 cores; "
      "cached after).\n", flush=True)

results = {}
for method in ("full", "infinigen"):
    cmd = [sys.executable, "-m", "infinigen_kv.cli", "generate", "--prompt-file", str(prompt_file),
           "--method", method, "--max-new-tokens", "16", "--json"]
    print("$ infinigen " + " ".join(cmd[3:]), flush=True)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        sys.exit(f"demo: infinigen generate --method {method} failed (exit {out.returncode})")
    results[method] = r = json.loads(out.stdout)
    print(f"  answer: {r['text']!r}\n  prefill {r['prefill_s']:.2f} s, decode {r['decode_tokens_per_s']:.1f} tokens/s, "
          f"fetched fraction {r['fetched_fraction']:.3f}\n", flush=True)

full, ig = results["full"], results["infinigen"]
print("Summary")
for name, r in results.items():
    ok = "correct" if sample.answer in r["text"] else "WRONG"
    print(f"  {name:10s} {ok:8s} decode {r['decode_tokens_per_s']:6.1f} tok/s  fetched {r['fetched_fraction']:.3f}  "
          f"KV+weights read/step {r['bytes_read_per_step'] / 1e6:.0f} MB")
print(f"  InfiniGen fetched {ig['fetched_fraction']:.1%} of the past KV entries per layer and step (the budget, "
      f"{DEFAULT_BUDGET:.0%} of the past but at least {DEFAULT_MIN_BUDGET:,} entries, caps what a speculated layer "
      f"fetches; layer 0 attends whole, no layer before it to speculate from: the share over all layers is above "
      f"the budget); decode speed "
      f"{ig['decode_tokens_per_s'] / full['decode_tokens_per_s']:.2f}x the full cache's (batch 1, CPU: the weights "
      f"dominate the bytes here; see docs/BENCHMARKS.md for batch x context where the cache dominates).")
