"""An input embedding read from a file mapping: only the rows a prompt looks up are in memory.

A model whose LM head is not its input embedding (Qwen2.5, Llama 3, Mistral) reads the embedding one row a token;
held in memory it is a whole vocabulary of rows (the 0.5B's 151,936 x 896: 272 MB in bfloat16, 145 MB as int8 rows)
of which a prompt reads a few thousand. llama.cpp maps its GGUF and so holds only the pages it reads; here a local
checkpoint's embedding, as the model holds it (bfloat16 or int8 rows), is written once to the user cache and mapped
privately (copy-on-write, read-only in use), with the kernel told that reads are random (no read-ahead of
neighbouring rows). The values are the held ones, bit for bit. A tied embedding (the LM head reads every row every
step) stays in memory.

The file's name digests the checkpoint's shard files (path, size, modification time), the held dtype and shape:
a checkpoint changed in place is a new file. Where the cache cannot be written the embedding stays in memory.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from ..config import cache_dir

FORMAT = 1
MADV_RANDOM = 1


def key(files: list[Path], w: torch.Tensor) -> str:
    """The digest naming the mapped file of an embedding held as `w`, read from checkpoint shards `files`."""
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    facts = {"format": FORMAT, "files": stats, "dtype": str(w.dtype), "shape": list(w.shape)}
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:24]


def path_of(k: str) -> Path:
    return cache_dir() / "embeddings" / f"{k}.bin"


def load(k: str, shape, dtype: torch.dtype) -> torch.Tensor | None:
    """The mapped tensor of file `k`, or None where there is none of the right size."""
    p = path_of(k)
    numel = shape[0] * shape[1]
    try:
        if p.stat().st_size != numel * torch.empty((), dtype=dtype).element_size():
            return None
        w = torch.from_file(str(p), shared=False, size=numel, dtype=dtype).view(*shape)
    except (OSError, RuntimeError):
        return None
    _advise_random(w)
    return w


def save(k: str, w: torch.Tensor) -> bool:
    """Write `w`'s bytes as file `k`, atomically (a process mapping an older file keeps it); False where the cache
    cannot be written."""
    p = path_of(k)
    tmp = p.with_name(f"{p.name}.tmp{os.getpid()}")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        raw = w.detach().contiguous().view(torch.int8 if w.dtype == torch.int8 else torch.int16).numpy()
        raw.tofile(str(tmp))
        os.replace(tmp, p)
        return True
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False


def _advise_random(w: torch.Tensor) -> None:
    """No read-ahead on the mapping: a token's row faults in its own page, not its neighbours'."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(w.data_ptr(), w.numel() * w.element_size(), MADV_RANDOM)
    except (OSError, AttributeError):
        pass
