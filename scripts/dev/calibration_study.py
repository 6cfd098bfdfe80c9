"""Which calibration predicts attention best? Recall of the true attention mass by the speculated top
`budget` share of tokens, at the last position of held-out prompts, per calibration text, skew and
channel rule. Speculation as the cache does it: layer l+1 from layer l's input (layer 1 from its own).

    python scripts/dev/calibration_study.py --data DIR [--model M] [--budget 0.2]

Prints a markdown table (the source of the defaults `skew=auto`, `channel_rule=qk`; docs/BENCHMARKS.md).
"""

import argparse
import math
import statistics
from pathlib import Path

import torch

import infinigen_kv as ig
from infinigen_kv.model.arch import get_arch
from infinigen_kv.bench.tasks import passkey
from infinigen_kv.methods.infinigen.calibration import skew_layer
from infinigen_kv.methods.infinigen.offline import collect_qk, generated_text_ids, text_file_ids


def capture(model, arch, ids):
    """Attention inputs x_l (1, n, D) and RoPE of every layer for one prompt."""
    X, R = {}, {}

    def hook(mod, args, kw):
        X[mod.layer_idx], R[mod.layer_idx] = kw["hidden_states"], kw.get("position_embeddings")

    hs = [a.register_forward_pre_hook(hook, with_kwargs=True) for a in arch.attns]
    try:
        model(ids, use_cache=False, logits_to_keep=1)
    finally:
        for h in hs:
            h.remove()
    return X, R


def last(rope):
    return None if rope is None else tuple(t[:, -1:] for t in rope)


def recall(model, arch, prompts, AP, budget):
    """Mean over prompts, layers >= 1 and query heads of the true attention mass on the selected tokens."""
    G, r, d = arch.num_kv_heads, arch.group, arch.head_dim
    out = []
    for X, R in prompts:
        n = X[0].shape[1]
        k = math.ceil(budget * n)
        for l in range(1, arch.num_layers):
            src = 1 if l == 1 else l - 1  # as the cache: layer 1 from its own input, others one layer ahead
            K = arch.key(l, X[l], R[l], model.backend)[0]  # (G, n, d)
            q = arch.query(l, X[l][:, -1:], last(R[l]), model.backend)[0].view(G, r, d)
            p = ((q @ K.transpose(-1, -2)) * arch.score_scale).softmax(-1)  # (G, r, n)
            qs = arch.query(l, X[src][:, -1:], last(R[src]), model.backend)[0].view(G, r, d)
            s = (qs @ AP[l]) @ (K @ AP[l]).transpose(-1, -2)
            rel = (s - s.amax(-1, keepdim=True)).amax(1)  # (G, n)
            idx = rel.topk(k, -1).indices
            out.append(torch.gather(p, 2, idx[:, None].expand(-1, r, -1)).sum(-1).mean().item())
    return statistics.mean(out)


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="directory with wikitext-2/test.txt and pg19/firstbook.txt")
    ap.add_argument("--model", default=None)
    ap.add_argument("--budget", type=float, default=0.2)
    args = ap.parse_args()
    data = Path(args.data)
    model, tok = ig.load_model(args.model)
    arch = get_arch(model)
    wiki = (data / "wikitext-2" / "test.txt").read_text()
    held_out = [tok(passkey(tok, 4000, seed=s).prompt, return_tensors="pt").input_ids for s in (0, 1)]
    held_out.append(tok(wiki[200000:260000], return_tensors="pt").input_ids[:, :4000])  # not in the calib. slice
    prompts = [capture(model, arch, ids) for ids in held_out]
    sources = {
        "generated": generated_text_ids(model, 4096),
        "pg19": text_file_ids(str(data / "pg19" / "firstbook.txt"), tok, 4096),
        "wikitext": text_file_ids(str(data / "wikitext-2" / "test.txt"), tok, 4096),
    }
    print(f"| calibration text | partial_ratio | skew | channel rule | recall at budget {args.budget} |")
    print("|---|---|---|---|---|")
    for name, ids in sources.items():
        qs, ks = collect_qk(model, arch, ids)
        for ratio in (0.2, 0.3):
            p = math.ceil(ratio * arch.head_dim)
            for skew in ("svd", "none"):
                for rule in ("q", "qk"):
                    AP = []
                    for l in range(arch.num_layers):
                        A, P = skew_layer(qs[l], ks[l], arch.group, p, rule, skew)
                        AP.append(torch.gather(A, 2, P.unsqueeze(1).expand(-1, A.shape[1], -1)))
                    print(f"| {name} | {ratio} | {skew} | {rule} | {recall(model, arch, prompts, AP, args.budget):.3f} |",
                          flush=True)


if __name__ == "__main__":
    main()
