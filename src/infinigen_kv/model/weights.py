"""A checkpoint's tensors into our model classes (transformer.py), tensor by tensor, each into its held form.

Checkpoints name their tensors as transformers' models do (model.layers.3.self_attn.q_proj.weight). `STACKED` maps
those names to ours, q/k/v into one merged weight and gate/up into another at their row offsets (as vLLM's
stacked_params_mapping): a weight is never re-pointed after loading. A safetensors file is read through a mapping of at
most READ_BYTES at a time, each slice converted (bfloat16, int8 rows) as it is copied, so loading holds the model and
one slice; a model held in bfloat16 or int8 rows is saved as held once and mapped at later loads (mapped.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from . import int4_rows, int5_rows, int8_rows, int8_tiles, mapped, ops
from .hparams import ModelArgs

# (a checkpoint's name inside a layer, ours, which part of a merged weight: its index among the parts)
STACKED = [
    ("self_attn.q_proj", "attn.wqkv", 0), ("self_attn.k_proj", "attn.wqkv", 1), ("self_attn.v_proj", "attn.wqkv", 2),
    ("mlp.gate_proj", "mlp.w1", 0), ("mlp.up_proj", "mlp.w1", 1),
]
RENAMED = {"self_attn.o_proj": "attn.wo", "self_attn.out_proj": "attn.wo", "mlp.down_proj": "mlp.w2",
           "fc1": "mlp.w1", "fc2": "mlp.w2", "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm",
           "input_layernorm": "attn_norm", "self_attn_layer_norm": "attn_norm", "final_layer_norm": "mlp_norm"}
SANDWICH = {"post_attention_layernorm": "attn_post_norm", "pre_feedforward_layernorm": "mlp_norm",
            "post_feedforward_layernorm": "mlp_post_norm"}  # Gemma 3's four norms a layer
TOP = {"embed_tokens.weight": "embed", "lm_head.weight": "lm_head", "norm.weight": "norm.weight",
       "final_layer_norm.weight": "norm.weight", "final_layer_norm.bias": "norm.bias",
       "embed_positions.weight": "positions", "project_in.weight": "project_in.weight",
       "project_out.weight": "project_out.weight"}


def part_sizes(args: ModelArgs, ours: str) -> list[int]:
    """The row counts of a merged weight's parts, in order."""
    if ours == "attn.wqkv":
        return [args.n_heads * args.head_dim] + [args.n_kv_heads * args.head_dim] * 2
    return [args.intermediate, args.intermediate]


def target(args: ModelArgs, name: str) -> tuple[str, int] | None:
    """(our parameter's name, its first row for this tensor) of a checkpoint tensor's name; None: not a weight we
    hold (a rotary buffer, a tied LM head's copy)."""
    for prefix in ("model.decoder.", "model.", "decoder."):
        if name.startswith(prefix) and not name.startswith("model.lm_head"):
            name = name[len(prefix):]
            break
    if not name.startswith("layers."):
        ours = TOP.get(name)
        if ours == "lm_head" and args.tie_embeddings:
            return None
        return (ours, 0) if ours is not None else None
    _, i, rest = name.split(".", 2)
    module, _, leaf = rest.rpartition(".")
    for theirs, ours, part in STACKED:
        if module == theirs:
            return f"layers.{i}.{ours}.{leaf}", sum(part_sizes(args, ours)[:part])
    if args.sandwich and module in SANDWICH:
        return f"layers.{i}.{SANDWICH[module]}.{leaf}", 0
    if module == "post_attention_layernorm":  # Llama's norm before the MLP
        return f"layers.{i}.mlp_norm.{leaf}", 0
    ours = RENAMED.get(module)
    return None if ours is None else (f"layers.{i}.{ours}.{leaf}", 0)


def copy_rows(dst: torch.Tensor, start: int, rows: torch.Tensor) -> None:
    """rows (n, in) or (n,) of a checkpoint into dst[start : start + n] in dst's held form."""
    n = rows.shape[0] if rows.dim() else 1
    if dst.dim() == 0:
        dst.copy_(rows)
    elif dst.dtype == torch.int8:  # int8 rows (an embedding apart from the LM head; inputs not whole groups)
        dst[start : start + n].copy_(rows if rows.dtype == torch.int8 else int8_rows.pack_kv(rows.float()))
    elif dst.dtype in (torch.uint8, int8_tiles.DTYPE):  # int4 and int8 tiles: the tiles the rows touch are rewritten
        int4 = dst.dtype == torch.uint8
        tiles = int4_rows if int4 else int8_tiles
        lo = start // int4_rows.TILE * int4_rows.TILE
        hi = min(dst.shape[0], -(-(start + n) // int4_rows.TILE) * int4_rows.TILE)
        if (lo, hi) == (start, start + n):  # whole tiles (or the rows after the last)
            dst[start : start + n].copy_(ops.held(rows, "int4" if int4 else "int8"))
        else:
            block = tiles.rows_of(dst[lo:hi])
            block[start - lo : start - lo + n] = (int4_rows.pack_rows if int4 else int8_rows.pack_kv)(rows.float())
            dst[lo:hi].copy_(tiles.tiled(block))
    elif dst.dtype == int5_rows.DTYPE:  # int5: whole tiles of rows (a weight of other shapes is held as int8 rows)
        if start % int5_rows.TILE or n % int5_rows.TILE:
            raise ValueError(f"rows [{start}, {start + n}) of an int5 weight are not whole tiles of {int5_rows.TILE}")
        dst[start : start + n].copy_(int5_rows.pack(rows.float()))
    else:
        dst[start : start + n].copy_(rows)


def load_state_dict(model, state: dict) -> None:
    """A checkpoint's tensors given as a dict (a transformers model's state_dict) into `model`; KeyError for a weight
    the model needs and the dict lacks."""
    params = dict(model.named_parameters(remove_duplicate=False))
    filled = set()
    with torch.no_grad():
        for name, t in state.items():
            where = target(model.args, name)
            if where is None or where[0] not in params:
                continue
            copy_rows(params[where[0]], where[1], t)
            filled.add((where[0], where[1]))
    _check_filled(model, filled)


def _check_filled(model, filled: set) -> None:
    """Every parameter got all of its parts (merged weights: each part's offset)."""
    args = model.args
    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0].split(".", 2)[-1] if name.startswith("layers.") else ""
        starts = [0]
        if module in ("attn.wqkv", "mlp.w1") and not (module == "mlp.w1" and args.act == "relu"):
            sizes = part_sizes(args, module)
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
        missing = [s for s in starts if (name, s) not in filled]
        if missing:
            raise KeyError(f"the checkpoint has no tensor for {name} (rows from {missing[0]})")


def shards(source: Path) -> list[Path] | None:
    """The checkpoint's safetensors files in order, or None (no safetensors)."""
    index = source / "model.safetensors.index.json"
    if index.is_file():
        files = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [source / f for f in files]
    single = source / "model.safetensors"
    return [single] if single.is_file() else None


def checkpoint_id(files: list[Path]) -> str:
    """The checkpoint's identity from its tensors as stored (whatever form they are held in): their names, dtypes and
    shapes, and the first row of every q and k projection."""
    import hashlib

    from safetensors import safe_open

    h = hashlib.sha256()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                h.update(f"{name}:{sl.get_dtype()}:{sl.get_shape()};".encode())
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    h.update(sl[0:1].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return "st:" + h.hexdigest()[:32]


READ_BYTES = 64 << 20  # most bytes of a shard mapped at once (a float32 LM head of a large vocabulary: in slices)


def load_files(model, files: list[Path]) -> None:
    """Every tensor of safetensors `files` into `model`, in row slices through a mapping reopened every READ_BYTES (the
    pages read are unmapped as the load goes). A model whose weights are held apart from its compute dtype (bfloat16,
    int8 rows) on CPU is then saved as held to the user cache and mapped from there, at this load and every later one
    (mapped.py)."""
    k = mapped.key(files, model) if model.weights is not None and model.device.type == "cpu" else None
    if k is not None and mapped.load(model, k):
        return
    params = dict(model.named_parameters(remove_duplicate=False))
    filled = set()
    with torch.no_grad():
        for f in files:
            filled |= _read_shard(f, model.args, params)
    _check_filled(model, filled)
    if k is not None and mapped.save(model, k):
        mapped.load(model, k)


def _read_shard(path: Path, args: ModelArgs, params: dict) -> set:
    from safetensors import safe_open

    filled, h, read = set(), None, 0
    try:
        with safe_open(str(path), framework="pt", device="cpu") as index:
            names = list(index.keys())
        for name in names:
            where = target(args, name)
            if where is None or where[0] not in params:
                continue
            dst, start = params[where[0]], where[1]
            if h is None or read >= READ_BYTES:
                if h is not None:
                    h.__exit__(None, None, None)
                h, read = safe_open(str(path), framework="pt", device="cpu").__enter__(), 0
            sl = h.get_slice(name)
            shape = sl.get_shape()
            rows = shape[0] if shape else 1
            row_bytes = 4 * max(1, (shape[1] if len(shape) > 1 else 1))
            step = max(int4_rows.TILE, READ_BYTES // row_bytes // int4_rows.TILE * int4_rows.TILE)  # whole tiles
            for s in range(0, rows, step):
                if read >= READ_BYTES:
                    h.__exit__(None, None, None)
                    h, read = safe_open(str(path), framework="pt", device="cpu").__enter__(), 0
                    sl = h.get_slice(name)
                e = min(rows, s + step)
                part = sl[s:e] if shape else h.get_tensor(name)
                copy_rows(dst, start + s, part)
                read += row_bytes * (e - s)
            filled.add(where)
    finally:
        if h is not None:
            h.__exit__(None, None, None)
    return filled


def from_hf(model, weights: str | None = None):
    """Our model of a transformers model (its config and weights, copied into our held forms): what tests compare
    against transformers, and a way in for a model built in memory. weights: "bfloat16" or "int8" rows (float32
    compute) or None (held in the model's own dtype)."""
    from .hparams import from_config
    from .transformer import Transformer

    dtype = torch.float32 if weights is not None else next(model.parameters()).dtype
    device = next(model.parameters()).device
    with torch.device(device):
        ours = Transformer(from_config(model.config.to_dict()), weights, dtype)
    load_state_dict(ours, model.state_dict())
    return ours.eval()
