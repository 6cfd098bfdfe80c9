"""How fast could a batch-1 CPU decode step be without transformers' modules around our kernels? A probe for the
eager overhead (docs/BENCHMARKS.md, "Where a step goes"): the default model's decode step written as one flat
function over the same weights, kernels and full-cache buffers (RMSNorm as F.rms_norm, RoPE on the step's
position, the `linear` and `attend` kernels), timed against the model's own step on a copy of the same prefilled
cache, logits compared.

    python scripts/own_step_probe.py [--batch 1] [--prompt-len 4096] [--steps 16]

A Llama-architecture probe, not a code path of the library: it writes the full cache's buffers directly.
"""

import argparse
import time

import torch
import torch.nn.functional as F

import infinigen_kv as ig
from infinigen_kv.bench.speed import prompts
from infinigen_kv.model import kernels


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, d) rotated (rotate-half layout) by cos, sin (B, 1, d)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def linear(kern, module, x: torch.Tensor) -> torch.Tensor:
    return kern.linear(x, module.weight, module.bias)  # (bfloat16 weights read as held)


@torch.inference_mode()
def own_step(model, kern, cache, ids: torch.Tensor, pos: int) -> torch.Tensor:
    """One decode step of a Llama model: ids (B,) at position pos -> logits (B, V); appends to cache's buffers."""
    cfg, base = model.config, model.model
    B = ids.shape[0]
    H, G = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // H
    x = base.embed_tokens(ids)  # (B, D)
    cos, sin = base.rotary_emb(x[:, None], torch.full((B, 1), pos))  # (B, 1, d)
    eps = cfg.rms_norm_eps
    for layer, cl in zip(base.layers, cache.layers):
        a = layer.self_attn
        h = F.rms_norm(x, (x.shape[-1],), layer.input_layernorm.weight, eps)
        q = rope(linear(kern, a.q_proj, h).view(B, H, d), cos, sin)
        k = rope(linear(kern, a.k_proj, h).view(B, G, d), cos, sin)
        v = linear(kern, a.v_proj, h).view(B, G, d)
        n = cl.k.length
        cl.k.data[:, :, n].copy_(k)
        cl.v.data[:, :, n].copy_(v)
        cl.k.length = cl.v.length = n + 1
        o = kern.attend(q.view(B, G, H // G, d).contiguous(), cl.k.data, cl.v.data, None, None, None, -1, None, n + 1,
                        a.scaling, torch.float32)
        x = x + linear(kern, a.o_proj, o.reshape(B, H * d))
        h = F.rms_norm(x, (x.shape[-1],), layer.post_attention_layernorm.weight, eps)
        m = layer.mlp
        x = x + linear(kern, m.down_proj, F.silu(linear(kern, m.gate_proj, h)) * linear(kern, m.up_proj, h))
    x = F.rms_norm(x, (x.shape[-1],), base.norm.weight, eps)
    return linear(kern, model.lm_head, x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    kern = kernels.cpu()
    if kern is None:
        raise SystemExit("own_step_probe: the CPU kernels are not built here")
    model, tok = ig.load_model()
    B, n = args.batch, args.prompt_len
    ids, mask = prompts(tok, B, n)
    cache = ig.make_cache("full", model)
    cache.reserve(n + 2 * args.steps + 8)
    ig.generate(model, ids, mask, cache=cache, max_new_tokens=1, stop_at_eos=False)  # the prompt, prefilled
    theirs = cache.fork()
    x = torch.full((B,), 100)
    start = cache.get_seq_length()
    got = own_step(model, kern, cache, x, start)
    with torch.inference_mode():
        ref = model(input_ids=x[:, None], past_key_values=theirs, position_ids=torch.full((B, 1), start)).logits[:, -1]
    print(f"logits: max |own - model's| {float((got - ref).abs().max()):.2e} (of max |logit| {float(ref.abs().max()):.1f}),"
          f" same argmax: {torch.equal(got.argmax(-1), ref.argmax(-1))}")
    times = {"own": [], "model": []}
    for i in range(1, args.steps + 1):
        t = time.perf_counter()
        own_step(model, kern, cache, x, start + i)
        times["own"].append(time.perf_counter() - t)
        t = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=x[:, None], past_key_values=theirs, position_ids=torch.full((B, 1), start + i))
        times["model"].append(time.perf_counter() - t)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    print(f"B{B} x {n}, full cache: model's step {med['model']:.1f} ms, own step {med['own']:.1f} ms "
          f"({med['model'] / med['own']:.2f}x)")


if __name__ == "__main__":
    main()
