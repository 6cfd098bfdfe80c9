"""A GGUF into our model, read as it lies: its metadata as the config, its vocabulary as the tokenizer, its tensors
tensor by tensor into the held forms (gguf_blocks.py), at the file's precision unless `weights` says otherwise.

What the cache keeps for a file (cache_dir()/models/<stem>-<key>, key: the file's path, size and modification time):
config.json, generation_config.json, tokenizer.json, tokenizer_config.json and gguf.json (its tensor table and the
checkpoint's digest), written once; and the weights as held, one file a form (model/mapped.py), written once and
mapped at every load. No copy larger than the held form is ever written: a conversion reads each tensor with pread
(no mapping of the GGUF) a slice of rows at a time, writes its held rows where they lie in the held file and keeps
nothing, so its memory is one slice.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from .. import heap
from ..config import cache_dir
from ..progress import Progress
from . import gguf_blocks, gguf_model, int4_rows, int5_rows, int6_tiles, int8_tiles, mapped, ops
from .gguf import GGUF
from .hparams import from_config
from .transformer import Transformer
from .weights import target

SLICE_BYTES = 32 << 20  # a conversion's slice of a tensor's rows in its float32 values at most
ENTRY = 3  # the entry's format: a change makes every file's entry anew


class GGUFLoadError(ValueError):
    """The GGUF cannot be read into a model here; the message says why in one line."""


def entry(path: Path) -> tuple[Path, GGUF | None]:
    """The cache folder of GGUF `path` (its config, tokenizer and tensor table), written on first use; and the file's
    parsed header where this call parsed it (None: the folder was there)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{ENTRY}".encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"{path.stem}-{key}"
    if (out / "gguf.json").is_file():
        return out, None
    g = _write_entry(path, out)
    g.metadata = {}  # (the vocabulary's strings, and the tokenizer's build, ~100 MB, back to the OS)
    heap.trim()
    return out, g


def _write_entry(path: Path, out: Path) -> GGUF:
    from .gguf_tokenizer import build

    print(f"infinigen: reading {path.name}'s config and vocabulary (once) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    g = GGUF(path)
    config = gguf_model.config(g)
    names = gguf_model.names(g)
    tok, special = build(g)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": gguf_model.eos_ids(g)}))
        tok.save(str(tmp / "tokenizer.json"))
        template = special.pop("chat_template", None)
        (tmp / "tokenizer_config.json").write_text(json.dumps(special, indent=1))
        if template:
            (tmp / "chat_template.jinja").write_text(template)
        tensors = {n: [t.kind, list(t.shape)] for n, t in g.tensors.items() if n in names}
        table = {"file": str(path.resolve()), "tensors": tensors, "names": names, "checkpoint": _digest(g, names),
                 "seconds": round(time.perf_counter() - t0, 2)}
        (tmp / "gguf.json").write_text(json.dumps(table))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return g


def _digest(g: GGUF, names: dict) -> str:
    """The checkpoint's identity from its bytes as stored (whatever form it is later held in): the tensor table and
    the first row of every q and k projection."""
    h = hashlib.sha256()
    for n, t in g.tensors.items():
        h.update(f"{n}:{t.kind}:{t.shape};".encode())
        if ".attn_q." in n or ".attn_k." in n:
            h.update(g.read(t, 0, 1))
    return "gguf:" + h.hexdigest()[:32]


def load(path: Path, device: torch.device, weights: str | None, dtype: torch.dtype, held: bool):
    """(model, its cache folder) of GGUF `path`. held: weights held apart from the compute dtype on CPU (`weights`:
    None for the file's precision, else one form); otherwise every weight in `dtype` (float32 on CPU, bfloat16 /
    float16 on a GPU), in memory."""
    folder, g = entry(path)
    table = json.loads((folder / "gguf.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    args = from_config(config)
    eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    args = replace(args, eos_token_id=eos if eos is not None else args.eos_token_id)
    parts = _parts(args, table)
    form = None
    if held:  # each 2-D weight's rows: its parts' (a merged weight's parts fill it)
        kinds = {name[: -len(".weight")] if name.endswith(".weight") else name: [(s, r, k) for s, r, k, *_ in ps]
                 for name, ps in parts.items() if len(table["tensors"][ps[0][3]][1]) == 2}
        cols = {name[: -len(".weight")] if name.endswith(".weight") else name: table["tensors"][ps[0][3]][1][1]
                for name, ps in parts.items() if len(table["tensors"][ps[0][3]][1]) == 2}
        form = gguf_model.plan({n: (sum(r for _, r, _ in ps), cols[n]) for n, ps in kinds.items()}, kinds, weights)
    with torch.device(device):
        model = Transformer(args, (weights or "file") if held else None, dtype, source=str(folder),
                            checkpoint=table["checkpoint"], plan=form)
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in parts]
    if missing:
        raise GGUFLoadError(f"{path} has no tensor for {missing[0]}")
    if held and device.type == "cpu":
        k = mapped.key([path], model)
        if mapped.load(model, k):
            return model, folder
        g = g or GGUF(path)  # (the header, for the tensors' offsets: ~0.3 s)
        total = sum(g.tensors[n].nbytes for n in table["tensors"])
        shapes = {n: (p.dtype, tuple(p.shape)) for n, p in params.items()}
        bar = Progress(f"converting {path.name} (once)", total, " MB", scale=1e6)
        chunks = _chunks(g, parts, params, bar)
        if mapped.write(k, shapes, chunks):
            seconds = bar.close()
            size = mapped.path_of(k).stat().st_size
            print(f"infinigen: converted {path.name} in {seconds:.1f} s: {size / 1e6:.0f} MB held "
                  f"({mapped.path_of(k).parent})", file=sys.stderr, flush=True)
            if mapped.load(model, k):
                return model, folder
        bar.close()
    g = g or GGUF(path)
    with torch.no_grad():
        for name, row, t in _chunks(g, parts, params, None):
            params[name][row : row + t.shape[0]].copy_(t) if t.dim() else params[name].copy_(t)
    return model, folder


def _parts(args, table: dict) -> dict:
    """{our parameter: [(first row, rows, GGML type, GGUF tensor name, fix-up)]}, each part's rows where they go."""
    out = {}
    for name, (theirs, fix) in table["names"].items():
        where = target(args, theirs)
        if where is None:
            continue
        kind, shape = table["tensors"][name]
        rows = shape[0] if len(shape) > 1 else 1
        out.setdefault(where[0], []).append((where[1], rows, kind, name, fix))
    return out


def _chunks(g: GGUF, parts: dict, params: dict, bar):
    """(our parameter, first row, rows as held) for every tensor of the GGUF, a slice of rows at a time: a weight in
    whole tiles of 16 where its parts lie on tiles, else (int4 rows of odd parts) the weight's rows gathered first."""
    done, tensors, count = 0, 0, sum(len(ps) for ps in parts.values())
    for name, ps in parts.items():
        p = params[name]
        form = _form_of(p)
        aligned = not ops.tiled(p) or all(s % 16 == 0 and (r % 16 == 0 or s + r == p.shape[0]) for s, r, *_ in ps)
        whole = [] if not aligned else None
        for start, rows, kind, tname, fix in ps:
            tensors += 1
            t = g.tensors[tname]
            cols = t.columns if len(t.shape) > 1 else t.shape[0]
            step = rows if fix is not None else max(16, SLICE_BYTES // (4 * cols) // 16 * 16)
            for s in range(0, rows, step):
                e = min(rows, s + step)
                data = g.read(t, s, e)
                if len(t.shape) == 1:
                    x = gguf_blocks.values(kind, torch.frombuffer(bytearray(data), dtype=torch.uint8), 1, cols)[0]
                    if fix == "norm_minus_one":
                        x = x - 1.0
                    yield name, start, x.to(p.dtype)  # (a bias's part: its first element)
                    done += len(data)
                    continue
                if fix is not None and fix[0] == "permute":  # Llama's q / k: permuted rows moved back, as they are
                    data = gguf_model.unpermute(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(e - s, -1),
                                                fix[1]).contiguous().numpy().tobytes()
                held = gguf_blocks.held_rows(kind, data, e - s, cols, form)
                if form in ("float32", "bfloat16"):
                    held = held.to(p.dtype)
                if whole is not None:
                    whole.append((start + s, held))
                elif form == "int4":
                    yield name, start + s, int4_rows.tiled(held)
                elif form == "int5":
                    yield name, start + s, int5_rows.tiled(held)
                elif form == "int6":
                    yield name, start + s, int6_tiles.tiled(held)
                elif p.dtype == int8_tiles.DTYPE:
                    yield name, start + s, int8_tiles.tiled(held)
                else:
                    yield name, start + s, held.view(p.dtype) if held.dtype != p.dtype else held
                done += len(data)
                if bar is not None:
                    bar(done, note=f"{tensors}/{count} tensors")
        if whole:
            int4 = p.dtype == torch.uint8
            rows = torch.empty(p.shape, dtype=torch.uint8 if int4 else torch.int8)
            for s, h in whole:
                rows[s : s + h.shape[0]] = h
            yield name, 0, int4_rows.tiled(rows) if int4 else int8_tiles.tiled(rows)


def _form_of(p: torch.Tensor) -> str:
    return {torch.uint8: "int4", int5_rows.DTYPE: "int5", int6_tiles.DTYPE: "int6", torch.int8: "int8",
            int8_tiles.DTYPE: "int8",
            torch.bfloat16: "bfloat16"}.get(p.dtype, "float32")
