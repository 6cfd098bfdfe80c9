"""The prefix store's two tiers (prefix.py), each under a byte limit, for payloads: dicts of named CPU tensors.

- memory: LRU by block (an OrderedDict), its bytes counted against its limit;
- disk: one safetensors file per block under DIR/<namespace>/, written to a temporary name and renamed (atomic: a
  reader sees a whole entry or none, several processes may share DIR), with the payload's blake2b digest in its
  header. A truncated, corrupt or foreign entry is a miss (one warning line, the file removed), a full or read-only
  disk a miss too (logged once per kind); no error reaches the request. Files are evicted by age of last use (mtime,
  touched on each hit) when the directory passes its limit.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as st_load, save as st_save

log = logging.getLogger("infinigen_kv.prefix")

FORMAT = "infinigen-kv-prefix-1"

Payload = dict[str, torch.Tensor]


def payload_bytes(payload: Payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload.values())


def digest(payload: Payload) -> str:
    """blake2b of the payload's names, dtypes, shapes and bytes, in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(payload):
        t = payload[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass
class Stats:
    """Counters since the store was made (reported by the server's /metrics and the responses' usage)."""
    hit_tokens: int = 0
    miss_tokens: int = 0
    memory_hits: int = 0  # blocks
    disk_hits: int = 0
    memory_evictions: int = 0
    disk_evictions: int = 0
    disk_errors: int = 0  # entries that were unreadable, or writes that failed
    warned: set = field(default_factory=set)


def own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of t made in one copy (t may be a strided view of a live cache's buffer)."""
    c = t.detach().to("cpu").contiguous()
    return c.clone() if c.data_ptr() == t.data_ptr() else c


class MemoryTier:
    """Blocks in host memory, least recently used out first, under `limit` bytes."""

    def __init__(self, limit: int):
        self.limit, self.bytes = int(limit), 0
        self.blocks: OrderedDict[str, Payload] = OrderedDict()

    def get(self, key: str) -> Payload | None:
        payload = self.blocks.get(key)
        if payload is not None:
            self.blocks.move_to_end(key)
        return payload

    def put(self, key: str, payload: Payload) -> int:
        """Keeps payload (the store's own tensors); returns how many blocks were evicted for it."""
        size = payload_bytes(payload)
        if key in self.blocks or size > self.limit:
            return 0
        evicted = self.evict_to(self.limit - size)
        self.blocks[key] = payload
        self.bytes += size
        return evicted

    def evict_to(self, limit: int) -> int:
        """Least recently used blocks out until at most `limit` bytes are held; returns how many went."""
        evicted = 0
        while self.blocks and self.bytes > limit:
            _, old = self.blocks.popitem(last=False)
            self.bytes -= payload_bytes(old)
            evicted += 1
        return evicted

    def __contains__(self, key: str) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)


class DiskTier:
    """One safetensors file per block under root/<namespace>/<key[:2]>/<key>.safetensors (see the module doc)."""

    def __init__(self, root, ns: str, limit: int | None, stats: Stats):
        self.dir, self.ns, self.limit, self.stats = Path(root) / ns, ns, limit, stats
        self.writable = True
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.writable = False
            self._warn("mkdir", f"prefix cache: {self.dir} cannot be created ({e.strerror or e}); disk tier off")
        self.used = self._scan_bytes()

    def path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.safetensors"

    def _warn(self, kind: str, line: str) -> None:
        if kind not in self.stats.warned:  # one line per kind of failure
            self.stats.warned.add(kind)
            log.warning(line)

    def _files(self) -> list[os.DirEntry]:
        out = []
        try:
            for sub in os.scandir(self.dir):
                if sub.is_dir():
                    out.extend(e for e in os.scandir(sub.path) if e.name.endswith(".safetensors"))
        except OSError:
            pass
        return out

    def _scan_bytes(self) -> int:
        total = 0
        for e in self._files():
            try:
                total += e.stat().st_size
            except OSError:  # removed by another process meanwhile
                pass
        return total

    def get(self, key: str) -> Payload | None:
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            self.stats.disk_errors += 1
            self._warn("read", f"prefix cache: cannot read {path} ({e.strerror or e}): a miss")
            return None
        try:
            n = int.from_bytes(data[:8], "little")
            meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
            if meta.get("format") != FORMAT or meta.get("namespace") != self.ns or meta.get("key") != key:
                raise ValueError("an entry of another format or namespace")
            payload = st_load(data)
            if digest(payload) != meta.get("digest"):
                raise ValueError("its bytes do not match their digest")
        except Exception as e:  # truncated, corrupt, foreign: never wrong data, never an error for the request
            self.stats.disk_errors += 1
            self._warn("corrupt", f"prefix cache: {path} is unusable ({type(e).__name__}: {str(e)[:120]}); "
                       "removed, a miss")
            if self._remove(path):
                self.used = max(0, self.used - len(data))  # its bytes leave the count with it
            return None
        try:
            os.utime(path)  # its last use: what disk eviction orders by
        except OSError:
            pass
        return payload

    def put(self, key: str, payload: Payload) -> None:
        if not self.writable:
            return
        path = self.path(key)
        if path.exists():
            return
        meta = {"format": FORMAT, "namespace": self.ns, "key": key, "digest": digest(payload)}
        data = st_save({name: t.contiguous() for name, t in payload.items()}, metadata=meta)
        if self.limit is not None and len(data) > self.limit:
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: readers see the whole entry or none
        except OSError as e:
            self.stats.disk_errors += 1
            self._remove(tmp)
            if e.errno in (errno.EACCES, errno.EROFS):  # no write will succeed
                self.writable = False
            self._warn(f"write-{e.errno}", f"prefix cache: cannot write to {self.dir} ({e.strerror or e}): "
                       "entries stay in memory only" + ("" if self.writable else "; disk writes off"))
            return
        self.used += len(data)
        if self.limit is not None and self.used > self.limit:
            self._evict()

    def _evict(self) -> None:
        """Oldest-used files out until the directory is under 90% of its limit (shared: sizes read anew)."""
        files = []
        for e in self._files():
            try:
                st = e.stat()
                files.append((st.st_mtime, st.st_size, e.path))
            except OSError:
                pass
        files.sort()
        total = sum(size for _, size, _ in files)
        for _, size, p in files:
            if total <= 0.9 * self.limit:
                break
            if self._remove(Path(p)):
                self.stats.disk_evictions += 1
            total -= size
        self.used = total

    @staticmethod
    def _remove(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except OSError:
            return False
