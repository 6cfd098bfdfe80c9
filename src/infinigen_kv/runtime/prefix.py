"""The prefix store: KV blocks of past requests kept in host memory and on disk, keyed by the tokens that produced
them, so that a request whose prompt starts the same way skips that part of its prefill.

A block is `block` consecutive tokens of a sequence. Its key is a hash chain, as vLLM's prefix caching keys its
blocks: h_0 = H(namespace), h_i = H(h_{i-1}, tokens of block i), so a key names a block *and everything before
it*; the namespace holds what changes the stored bytes (the model's fingerprint, dtype, method and its options).
A block's payload is whatever a cache needs to continue from that point, made and restored by the caches
(methods/base.py: `Rebatch.prefix_block`, `restore_prefix`): a dict of named CPU tensors. This module only stores
payloads; it never looks inside them. `batching.Prefill` uses both sides: it restores the longest stored prefix of a
prompt and offers each block it computes. Exactness rests on one rule: every prompt is prefilled in chunks of
exactly `block` tokens from position 0, so a block's K/V are the same bits whether the prompt around it was
restored or computed (a chunk boundary elsewhere changes the last bits of the following rows).

Two tiers, each with a byte limit:
- memory: LRU by block (an OrderedDict), its bytes counted against `memory_bytes`;
- disk (optional): one safetensors file per block under DIR/<namespace>/, written to a temporary name and renamed
  (atomic: a reader sees a whole entry or none, several processes may share DIR), with the payload's blake2b
  digest in its header. A truncated, corrupt or foreign entry is a miss (one warning line, the file removed), a
  full or read-only disk a miss too (logged once per kind); no error reaches the request. Files are evicted by
  age of last use (mtime, touched on each hit) when the directory passes `disk_bytes`.
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

from ..model.kv import StepCache
from ..model.mapped import mapped_key

log = logging.getLogger("infinigen_kv.prefix")

FORMAT = "infinigen-kv-prefix-1"
DEFAULT_BLOCK = 256  # tokens a block (and a prefill chunk: the arithmetic of a reused prefix stays the same)

Payload = dict[str, torch.Tensor]


def namespace(**facts) -> str:
    """A short digest of what changes the stored bytes (model fingerprint, dtype, method, options...): blocks of
    two namespaces never mix."""
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def model_fingerprint(model) -> str:
    """Every parameter's name, shape, dtype and a strided sample of its values (K/V of layer l depend on all weights
    below it), cached on the model: a checkpoint changed in place, or loaded in another dtype, is another namespace."""
    cached = getattr(model, "_prefix_fingerprint", None)
    if cached is not None:
        return cached
    h = hashlib.blake2b(digest_size=16)
    for name, p in model.named_parameters():
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|".encode())
        file = mapped_key(p)  # a mapped embedding: its file's key (a strided sample would read every page)
        h.update(file.encode() if file else p.detach().reshape(-1)[::997].to("cpu", torch.float32).numpy().tobytes())
    fp = h.hexdigest()
    try:
        model._prefix_fingerprint = fp
    except Exception:
        pass
    return fp


def cache_namespace(model, cache, block: int) -> str | None:
    """The namespace of `cache`'s blocks for `model` (None: its method does not reuse prefixes)."""
    facts = cache.prefix_facts(model) if isinstance(cache, StepCache) else None
    if facts is None:
        return None
    return namespace(format=FORMAT, model=model_fingerprint(model), method=cache.method, block=block, **facts)


def chain(ns: str, tokens, block: int) -> list[str]:
    """The keys of the whole blocks of `tokens` (a sequence of ints), each hashing its block and every one before."""
    ids = torch.as_tensor(list(tokens) if not torch.is_tensor(tokens) else tokens, dtype=torch.int64).cpu()
    keys, prev = [], hashlib.blake2b(ns.encode(), digest_size=16).digest()
    for i in range(len(ids) // block):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(ids[i * block:(i + 1) * block].numpy().tobytes())
        prev = h.digest()
        keys.append(prev.hex())
    return keys


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


def _own(t: torch.Tensor) -> torch.Tensor:
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


class PrefixStore:
    """Blocks of `block` tokens in memory (`memory_bytes`) and, with `disk_dir`, on disk (`disk_bytes`; None: no
    limit), for the namespace `ns` (`namespace(...)`). Thread-safe: a server's engine and its handlers may share it.

        store = PrefixStore.for_cache(model, make_cache("infinigen", model), disk_dir="~/.cache/infinigen_kv/prefix")
        ig.generate(model, ids, cache=make_cache("infinigen", model), prefix=store)   # a batch of one prompt
        Prefill(model, cache, ids, prefix=store)   # your own loop (runtime/batching.py): restores, then offers

    Underneath: `lookup(ids)` -> the longest stored prefix's keys and payloads, `put(key, make_block)` stores one.
    """

    def __init__(self, ns: str, memory_bytes: int, disk_dir=None, disk_bytes: int | None = None,
                 block: int = DEFAULT_BLOCK):
        if block < 1 or memory_bytes < 0:
            raise ValueError("block must be >= 1 and memory_bytes >= 0")
        self.ns, self.block = ns, int(block)
        self.stats = Stats()
        self.memory = MemoryTier(memory_bytes)
        self.disk = DiskTier(Path(disk_dir).expanduser(), ns, disk_bytes, self.stats) if disk_dir else None
        self._lock = threading.Lock()

    @classmethod
    def for_cache(cls, model, cache, memory_bytes: int = 2 << 30, disk_dir=None, disk_bytes: int | None = None,
                  block: int = DEFAULT_BLOCK) -> "PrefixStore":
        """A store for the blocks of `cache`'s method on `model` (ValueError for a method that does not reuse)."""
        ns = cache_namespace(model, cache, block)
        if ns is None:
            raise ValueError(f"{type(cache).__name__} does not reuse prefixes: the entries it keeps depend on the whole "
                             "prompt (or its pool has a capacity)")
        return cls(ns, memory_bytes, disk_dir, disk_bytes, block)

    def check(self, model, cache) -> None:
        """ValueError unless this store holds blocks of `cache`'s method and options on `model`."""
        if cache_namespace(model, cache, self.block) != self.ns:
            raise ValueError("this prefix store holds blocks of another model, method or option set than this cache's "
                             "(PrefixStore.for_cache(model, cache) makes the right one)")

    def keys(self, tokens) -> list[str]:
        return chain(self.ns, tokens, self.block)

    def lookup(self, tokens, max_tokens: int | None = None, keys: list[str] | None = None
               ) -> tuple[list[str], list[Payload]]:
        """The longest run of stored blocks at the start of `tokens` (at most max_tokens of them: a prefill must
        keep at least one token of its own to compute logits from): their keys and payloads, disk hits promoted
        to memory. Counts hit and miss tokens. The payloads are the store's own tensors: read them, never write.
        keys: self.keys(tokens), when the caller has them."""
        keys = self.keys(tokens) if keys is None else keys
        if max_tokens is not None:
            keys = keys[: max(0, max_tokens) // self.block]
        found: list[Payload] = []
        with self._lock:
            for key in keys:
                payload = self.memory.get(key)
                if payload is not None:
                    self.stats.memory_hits += 1
                elif self.disk is not None and (payload := self.disk.get(key)) is not None:
                    self.stats.disk_hits += 1
                    self.stats.memory_evictions += self.memory.put(key, payload)
                else:
                    break
                found.append(payload)
            hit = len(found) * self.block
            self.stats.hit_tokens += hit
            self.stats.miss_tokens += len(torch.as_tensor(tokens).view(-1)) - hit
        return keys[: len(found)], found

    def offer(self, tokens, make_block) -> int:
        """Stores the whole blocks of `tokens` not stored yet; make_block(i) gives block i's payload (called only
        for those). Returns how many were stored."""
        return sum(self.put(key, lambda i=i: make_block(i)) for i, key in enumerate(self.keys(tokens)))

    def put(self, key: str, make_block) -> bool:
        """Stores the block `key` unless it is stored already; make_block() gives its payload (called only then)."""
        with self._lock:
            if key in self.memory:
                self.memory.get(key)  # offered again: recently used
                return False
            if self.memory.limit == 0 and self.disk is not None and self.disk.path(key).exists():
                return False  # disk only, and there already
        payload = {name: _own(t) for name, t in make_block().items()}  # never aliases a live cache
        with self._lock:
            self.stats.memory_evictions += self.memory.put(key, payload)
            if self.disk is not None:
                self.disk.put(key, payload)
        return True

    def unusable(self, why: str) -> None:
        """A looked-up prefix its cache could not take: logged once, counted as a disk error."""
        with self._lock:
            self.stats.disk_errors += 1
            if "restore" not in self.stats.warned:
                self.stats.warned.add("restore")
                log.warning("prefix cache: a stored prefix was unusable (%s): prefilled instead", why)

    def resize(self, limit: int) -> None:
        """A new memory limit; least recently used blocks go until the memory holds at most `limit` bytes (the
        server's admission makes room for a request's cache)."""
        with self._lock:
            self.memory.limit = max(0, int(limit))
            self.stats.memory_evictions += self.memory.evict_to(self.memory.limit)

    def report(self) -> dict:
        """Counters and bytes per tier (the server's /metrics)."""
        s = self.stats
        return {"hit_tokens": s.hit_tokens, "miss_tokens": s.miss_tokens, "memory_hits": s.memory_hits,
                "disk_hits": s.disk_hits, "memory_evictions": s.memory_evictions, "disk_evictions": s.disk_evictions,
                "disk_errors": s.disk_errors, "memory_blocks": len(self.memory), "memory_bytes": self.memory.bytes,
                "memory_limit_bytes": self.memory.limit,
                "disk_bytes": self.disk.used if self.disk is not None else 0}
