"""Does torch.compile (inductor, CPU) pay off around our kernels? Decode tok/s of the full cache at the defaults,
eager against three compiled variants, with the `linear` kernel registered as a custom op so that dynamo traces
through it, tokens compared with eager's:

  parts    each layer's MLP and RMSNorms compiled (90 small graphs)
  layers   each decoder layer compiled whole (the cache update and the attention traced too)
  around   each decoder layer compiled, the cache update and the attention function left eager (dynamo.disable)

    python scripts/compile_probe.py --variant around [--batch 1] [--prompt-len 4096] [--new-tokens 16]

A probe for the decode step's eager overhead (docs/BENCHMARKS.md, "Where a step goes"); it patches the model
in place: one variant per process.
"""

import argparse
import time
import types

import torch
from transformers import AttentionInterface

import infinigen_kv as ig
from infinigen_kv.bench.speed import prompts
from infinigen_kv.methods import full as full_mod
from infinigen_kv.model import install, kernels


def custom_linear():
    """The decode linears through a torch custom op wrapping the `linear` kernel (dynamo does not trace pybind)."""
    kern = kernels.cpu()

    @torch.library.custom_op("infinigen_probe::linear", mutates_args=())
    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return kern.linear(x, w, b)

    @linear.register_fake
    def _(x, w, b):
        return x.new_empty(x.shape[0], w.shape[0])

    def forward(self, x):
        rows = x.numel() // x.shape[-1]
        if rows <= install.KERNEL_ROWS:
            return linear(x.reshape(rows, -1).contiguous(), self.weight, self.bias).view(*x.shape[:-1], -1)
        return install.linear(x, self.weight, self.bias)  # (a bfloat16 weight converted for the call)

    return forward


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=["parts", "layers", "around"], default="around")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    if kernels.cpu() is None:
        raise SystemExit("compile_probe: the CPU kernels are not built here")
    torch._dynamo.config.cache_size_limit = 64
    model, tok = ig.load_model()
    ids, mask = prompts(tok, args.batch, args.prompt_len)

    def run():
        cache = ig.make_cache("full", model)
        cache.reserve(args.prompt_len + args.new_tokens + 8)
        t = time.perf_counter()
        r = ig.generate(model, ids, mask, cache=cache, max_new_tokens=args.new_tokens, stop_at_eos=False)
        return r.tokens, r.decode_tokens_per_s, time.perf_counter() - t

    ref, eager, _ = run()
    forward = custom_linear()
    for m in model.modules():
        if type(m) is torch.nn.Linear and getattr(m, "_infinigen_fast", False):
            m.forward = types.MethodType(forward, m)
    if args.variant == "around":
        full_mod.FullLayer.update = torch._dynamo.disable(full_mod.FullLayer.update)
        AttentionInterface.register(install.NAME, torch._dynamo.disable(install.infinigen_attention))
    for layer in model.model.layers:
        if args.variant == "parts":
            for part in (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
                part.forward = torch.compile(part.forward, dynamic=False)
        else:
            layer.forward = torch.compile(layer.forward, dynamic=False)
    tokens, first, wall = run()
    tokens2, second, _ = run()
    print(f"B{args.batch} x {args.prompt_len}, {args.variant}: eager {eager:.2f} tok/s; compiled first run {first:.2f} "
          f"({wall:.1f} s with the compile), second {second:.2f}; tokens as eager's: "
          f"{torch.equal(tokens, ref) and torch.equal(tokens2, ref)}")


if __name__ == "__main__":
    main()
