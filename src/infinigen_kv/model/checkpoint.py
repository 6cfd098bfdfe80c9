"""A local safetensors checkpoint read into the model tensor by tensor.

transformers' from_pretrained maps every shard of a checkpoint at once and copies from the mappings: while a model
loads, the process holds the file's pages beside the model (a 0.5B checkpoint in float32: 2.5 GB of pages over a
1.3 GB model). Here the model is built without initializing its weights, in the dtypes it will compute with
(bfloat16 weights: `bfloat16_weights` first, so norms and biases are float32 before their values arrive), and each
tensor is copied into its parameter, cast as it goes, through a mapping of at most READ_BYTES at a time; an input
embedding that is not the LM head is then read from a file mapping of its held rows (mapped.py). A
checkpoint whose names are not the model's own (an older layout transformers renames while loading) returns None:
from_pretrained loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from . import int8_rows, mapped
from .install import bfloat16_weights, int8_weights


def shards(source: Path) -> list[Path] | None:
    """The checkpoint's safetensors files in order, or None (no safetensors: .bin weights, a hub id)."""
    index = source / "model.safetensors.index.json"
    if index.is_file():
        files = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [source / f for f in files]
    single = source / "model.safetensors"
    return [single] if single.is_file() else None


def load_streamed(source: Path, config, dtype: torch.dtype, weights: str | None):
    """The model of checkpoint directory `source` on CPU, its parameters in `dtype` (weights "bfloat16" or "int8":
    the linear and embedding weights held so, each slice quantized as it is read, float32 elsewhere), or None
    where the checkpoint's names are not the model's."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    files = shards(source)
    if files is None:
        return None
    with no_init_weights():  # uninitialized storage, filled below; buffers (RoPE frequencies) computed as usual
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.tie_weights()  # (no_init_weights skips it with the initialization)
    if weights == "bfloat16":
        bfloat16_weights(model)
    elif weights == "int8":
        int8_weights(model, values=False)  # the rows allocated; _read_shard quantizes into them
    targets = model.state_dict(keep_vars=True)  # name -> parameter or persistent buffer (tied ones share one)
    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            shapes.update((k, list(h.get_slice(k).get_shape())) for k in h.keys())
    missing = {id(targets[k]) for k in targets if k not in shapes} - {id(targets[k]) for k in shapes if k in targets}
    if missing or any(k not in targets or list(targets[k].shape) != _held_shape(targets[k], shape)
                      for k, shape in shapes.items()):
        return None  # names transformers would rename, shapes it would report, or weights the checkpoint lacks
    emb = mapped.untied_embedding(model) if weights in ("bfloat16", "int8") else None
    k = mapped.key(files, emb.weight) if emb is not None else None
    held = emb.weight if emb is not None else None
    if emb is not None and mapped.attach(emb, k):  # written by an earlier load: not read again
        targets, emb = {n: t for n, t in targets.items() if t is not held}, None
    with torch.no_grad():
        for f in files:
            _read_shard(f, targets)
    if emb is not None and mapped.save(k, emb.weight):
        mapped.attach(emb, k)  # (the rows read are freed)
    if (source / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(source))
    return model.eval()


def _held_shape(target: torch.Tensor, shape: list) -> list:
    """The shape a checkpoint tensor of `shape` has as `target` holds it: int8 rows are kv_width(in) bytes wide."""
    if target.dtype == torch.int8 and len(shape) == 2:
        return [shape[0], int8_rows.kv_width(shape[1])]
    return shape


READ_BYTES = 64 << 20  # most bytes of a shard mapped at once (a float32 LM head of a large vocabulary: in slices)


def _read_shard(path: Path, targets: dict) -> None:
    """Copy every tensor of shard `path` into its target (cast to the target's dtype), in row slices, through a
    mapping of the file reopened every READ_BYTES: the pages read are unmapped as the load goes (a mapping kept
    open holds the whole shard's pages in the process; reading without one, pread, reads a whole tensor per
    slice)."""
    from safetensors import safe_open

    h, mapped = None, 0
    try:
        with safe_open(str(path), framework="pt", device="cpu") as index:
            names = list(index.keys())
        for name in names:
            target = targets.get(name)
            if target is None or target.numel() == 0:  # (an embedding already mapped)
                continue
            rows = target.shape[0] if target.dim() else 1
            step = max(1, READ_BYTES // max(1, 4 * target.numel() // rows))
            for s in range(0, rows, step):
                if h is None or mapped >= READ_BYTES:
                    if h is not None:
                        h.__exit__(None, None, None)
                    h, mapped = safe_open(str(path), framework="pt", device="cpu").__enter__(), 0
                if target.dim() == 0:
                    target.copy_(h.get_tensor(name))
                else:
                    e = min(s + step, rows)  # (a slice past the end is an error)
                    part = h.get_slice(name)[s:e]
                    target[s:e].copy_(int8_rows.pack_kv(part) if target.dtype == torch.int8 else part)
                mapped += 4 * target.numel() * min(step, rows - s) // rows
    finally:
        if h is not None:
            h.__exit__(None, None, None)
