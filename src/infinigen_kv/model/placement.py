"""A model's layers placed across devices (`--device-map`): our own per-layer placement, no module hooks; the
forward (transformer.Transformer) moves activations to each layer's device as it goes."""

from __future__ import annotations

import torch
from torch import nn

from .transformer import Transformer, _freq_name


def place(model: Transformer, device_map) -> None:
    """Layers across devices: "auto" spreads them evenly over the visible GPUs (the embedding with the first, the
    final norm and LM head with the last; a tied LM head, and the final norm, with the embedding); a dict maps "embed", "norm", "lm_head" and "layers.i" (or transformers'
    "model.layers.i", "model.embed_tokens") to a device. The forward moves activations between them."""
    n = model.args.n_layers
    if device_map == "auto":
        gpus = max(1, torch.cuda.device_count())
        kind = "cuda" if torch.cuda.is_available() else "cpu"
        per = [torch.device(kind, i * gpus // n) if kind == "cuda" else torch.device("cpu") for i in range(n)]
        top = {"embed": per[0], "norm": per[-1], "lm_head": per[-1]}
    elif isinstance(device_map, dict):
        names = {k.removeprefix("model.").replace("embed_tokens", "embed"): torch.device(v)
                 for k, v in device_map.items()}
        per = [names.get(f"layers.{i}", torch.device("cpu")) for i in range(n)]
        top = {k: names.get(k, per[0] if k == "embed" else per[-1]) for k in ("embed", "norm", "lm_head")}
    else:
        raise ValueError(f"device_map must be 'auto' or a dict of module names to devices, not {device_map!r}")
    if model.args.tie_embeddings:
        top["lm_head"] = top["embed"]
    top["norm"] = top["lm_head"]  # the forward moves x to the LM head's device before the final norm
    model.placed = True
    for block, dev in zip(model.layers, per):
        block.to(dev)
    with torch.no_grad():
        for name in ("embed", "lm_head"):
            if getattr(model, name) is not None and not (name == "lm_head" and model.args.tie_embeddings):
                setattr(model, name, nn.Parameter(getattr(model, name).to(top[name]), requires_grad=False))
        if model.args.tie_embeddings:
            model.lm_head = model.embed
        for m in (model.norm, model.project_in, model.project_out):
            if m is not None:
                m.to(top["norm"] if m is not model.project_in else top["embed"])
        if model.positions is not None:
            model.positions = nn.Parameter(model.positions.to(top["embed"]), requires_grad=False)
        for key, _ in model.args.ropes:
            setattr(model, _freq_name(key), getattr(model, _freq_name(key)).to(top["embed"]))
