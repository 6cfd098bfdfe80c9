"""A local safetensors checkpoint read into the model tensor by tensor.

transformers' from_pretrained maps every shard of a checkpoint at once and copies from the mappings: while a model
loads, the process holds the file's pages beside the model (a 0.5B checkpoint in float32: 2.5 GB of pages over a
1.3 GB model). Here the model is built without initializing its weights, in the dtypes it will compute with
(bfloat16 weights: `bfloat16_weights` first, so norms and biases are float32 before their values arrive), and each
tensor is read on its own (pread: no mapping) and copied into its parameter, cast as it goes. A checkpoint whose
names are not the model's own (an older layout transformers renames while loading) returns None: from_pretrained
loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .install import bfloat16_weights


def shards(source: Path) -> list[Path] | None:
    """The checkpoint's safetensors files in order, or None (no safetensors: .bin weights, a hub id)."""
    index = source / "model.safetensors.index.json"
    if index.is_file():
        files = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [source / f for f in files]
    single = source / "model.safetensors"
    return [single] if single.is_file() else None


def load_streamed(source: Path, config, dtype: torch.dtype, bf16_weights: bool):
    """The model of checkpoint directory `source` on CPU, its parameters in `dtype` (bf16_weights: bfloat16 linear
    and embedding weights, float32 elsewhere), or None where the checkpoint's names are not the model's."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    files = shards(source)
    if files is None:
        return None
    with no_init_weights():  # uninitialized storage, filled below; buffers (RoPE frequencies) computed as usual
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if bf16_weights:
        bfloat16_weights(model)
    targets = model.state_dict(keep_vars=True)  # name -> parameter or persistent buffer (tied ones share one)
    names = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            names.update((k, f) for k in h.keys())
    missing = {id(targets[k]) for k in targets if k not in names} - {id(targets[k]) for k in names if k in targets}
    if any(k not in targets for k in names) or missing:
        return None  # names transformers would rename, or weights the checkpoint lacks
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu", backend="pread") as h:
                for k in h.keys():
                    targets[k].copy_(h.get_tensor(k))  # (cast to the parameter's dtype)
    if (source / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(source))
    return model.eval()
