"""A model's weights in their held form, saved once to one file in the user cache and mapped at every later load.

The first load of a checkpoint reads its safetensors into the held form (bfloat16 or int8 rows, q/k/v and gate/up
merged: weights.py), then writes every parameter as it is held, each at a page boundary, to one file; that load and
every later one map the file privately (copy-on-write, read-only in use) and point the parameters at their bytes, as
llama.cpp maps its GGUF. Loading then costs a mapping, not a copy: the pages come in as the first steps read them,
from the page cache where another process read them before, and the OS may drop them (clean, file-backed) rather
than swap them. An input embedding that is not the LM head is read one row a token: its pages are advised as random
(no read-ahead of neighbouring rows), so only the rows a prompt looks up are in memory.

The file begins with an 8-byte little-endian header length and a JSON header (each tensor's dtype, shape, offset);
its name digests the checkpoint's files (path, size, modification time), the model's facts and the held form: a
checkpoint changed in place is a new file. Where the cache cannot be written the weights stay in memory.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
import sys
from pathlib import Path

import torch

from ..config import cache_dir
from . import int4_rows, int8_rows

FORMAT = 3
PAGE = 4096  # every tensor starts at a page: views of any dtype, and madvise on a tensor's own pages
MADV_RANDOM = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
          "uint8": torch.uint8, "float8_e5m2": torch.float8_e5m2, "float8_e4m3fn": torch.float8_e4m3fn,
          "float8_e5m2fnuz": torch.float8_e5m2fnuz}


def key(files: list[Path], model) -> str:
    """The digest naming the held file of `model` (built, not yet loaded) read from checkpoint files `files`."""
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    facts = {"format": FORMAT, "files": stats, "args": repr(model.args), "weights": model.weights,
             "dtype": str(model.dtype), "group": int8_rows.GROUP}
    if model.plan is not None:  # each weight's form: two settings of the same forms (a Q4_1 file's own precision
        facts["weights"], facts["plan"] = "plan", sorted(model.plan.items())  # and --weights int4) share a file
    if model.weights in ("int4", "int5", "int8", "file"):  # weights in tiles of rows: a file of other tiles is not read
        facts["int4_tile"] = int4_rows.TILE
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:24]


def path_of(k: str) -> Path:
    return cache_dir() / "held" / f"{k}.bin"


def save(model, k: str) -> bool:
    """Write every parameter of `model` as held to file `k`, atomically (a process mapping an older file keeps it);
    False where the cache cannot be written."""
    params = dict(model.named_parameters())  # each parameter once (a tied LM head is the embedding)
    return write(k, {n: (p.dtype, tuple(p.shape)) for n, p in params.items()}, ((n, 0, p) for n, p in params.items()))


def write(k: str, shapes: dict, chunks) -> bool:
    """Write file `k` of tensors `shapes` ({name: (dtype, shape)}) from `chunks`, an iterable of (name, first row,
    rows as held), each written where its rows lie as it comes (so a conversion holds one chunk, not the model);
    atomically; False where the cache cannot be written (the chunks not all taken)."""
    table, offset = {}, 0
    for name, (dtype, shape) in shapes.items():
        table[name] = [str(dtype).replace("torch.", ""), list(shape), offset]
        numel = 1
        for s in shape:
            numel *= s
        offset += -(-numel * dtype.itemsize // PAGE) * PAGE
    header = json.dumps({"format": FORMAT, "tensors": table}).encode()
    start = -(-(8 + len(header)) // PAGE) * PAGE
    p_out = path_of(k)
    tmp = p_out.with_name(f"{p_out.name}.tmp{os.getpid()}")
    try:
        p_out.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for name, row, t in chunks:
                dtype, shape = shapes[name]
                row_bytes = t[0].numel() * t.element_size() if t.dim() and t.shape[0] else 0
                f.seek(start + table[name][2] + row * row_bytes)
                f.write(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            f.truncate(start + offset)
        os.replace(tmp, p_out)
        return True
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False


def load(model, k: str) -> bool:
    """Point `model`'s parameters at file `k`'s mapping; False (the model untouched) where there is no such file or it
    does not hold exactly the model's parameters."""
    p = path_of(k)
    try:
        with open(p, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        size = p.stat().st_size
        start = -(-(8 + n) // PAGE) * PAGE
        params = dict(model.named_parameters())
        table = header["tensors"]
        if header.get("format") != FORMAT or set(table) != set(params):
            return False
        views = {}
        raw = torch.from_file(str(p), shared=False, size=size, dtype=torch.uint8)
        for name, param in params.items():
            dtype, shape, offset = table[name]
            dt = DTYPES[dtype]
            if dt != param.dtype or tuple(shape) != tuple(param.shape):
                return False
            nbytes = param.numel() * param.element_size()
            if start + offset + nbytes > size:
                return False
            views[name] = raw[start + offset : start + offset + nbytes].view(dt).view(shape)
    except (OSError, RuntimeError, ValueError, KeyError, struct.error):
        return False
    for name, param in params.items():
        param.data = views[name]
    if not model.args.tie_embeddings:
        _advise_random(model.embed)
    model.mapped_from = k
    return True


def _advise_random(w: torch.Tensor) -> None:
    """No read-ahead on w's pages: a token's row faults in its own page, not its neighbours'."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(w.data_ptr(), w.numel() * w.element_size(), MADV_RANDOM)
    except (OSError, AttributeError):
        pass
