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

A model with sliding-window layers (Gemma 3's local ones) restores their rows only for a prefix's last blocks, the
window's span before the point it continues from: a block's window-layer rows are an entry of their own (its key +
`WINDOW`), offered only for the blocks that a prefix ending within the first or the last `WINDOW_ENDS` tokens of a
prompt needs (a system prompt; the same document with another question, a chat's next turn). A lookup finds the
longest stored prefix whose window rows are stored too. The window rows of a long document's middle, most of its
bytes on Gemma 3, are never kept.

The store has two tiers, each with a byte limit (prefix_tiers.py): memory (least recently used blocks out first)
and, optionally, disk (one safetensors file per block, shared by processes; a bad entry is a miss, never an error).
"""

from __future__ import annotations

import hashlib
import weakref
import json
import logging
import threading
from pathlib import Path

import torch

from ..model.kv import StepCache
from .prefix_tiers import FORMAT, DiskTier, MemoryTier, Payload, Stats, own

log = logging.getLogger("infinigen_kv.prefix")

DEFAULT_BLOCK = 256  # tokens a block (and a prefill chunk: the arithmetic of a reused prefix stays the same)
WINDOW = "w"  # a block's window layers' rows: the entry of its key + this
WINDOW_ENDS = 2048  # tokens: window rows are offered for prefixes ending this close to a prompt's start or end


def namespace(**facts) -> str:
    """A short digest of what changes the stored bytes (model fingerprint, dtype, method, options...): blocks of
    two namespaces never mix."""
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its fingerprint, made once


def model_fingerprint(model) -> str:
    """Every parameter's name, shape, dtype and a strided sample of its values (K/V of layer l depend on all weights
    below it), cached on the model: a checkpoint changed in place, or loaded in another dtype, is another namespace."""
    cached = _FINGERPRINTS.get(model)
    if cached is not None:
        return cached
    h = hashlib.blake2b(digest_size=16)
    file = getattr(model, "mapped_from", None)  # weights mapped from a held file: its key names their values (a
    for name, p in model.named_parameters():  # strided sample would read every page of it)
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|".encode())
        h.update(file.encode() if file else p.detach().reshape(-1)[::997].to("cpu", torch.float32).numpy().tobytes())
    fp = _FINGERPRINTS[model] = h.hexdigest()
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

    def lookup(self, tokens, max_tokens: int | None = None, keys: list[str] | None = None, windowed=None
               ) -> tuple[list[str], list[Payload]]:
        """The longest run of stored blocks at the start of `tokens` (at most max_tokens of them: a prefill must
        keep at least one token of its own to compute logits from): their keys and payloads, disk hits promoted
        to memory. Counts hit and miss tokens. The payloads are the store's own tensors: read them, never write.
        keys: self.keys(tokens), when the caller has them. windowed(m): the blocks whose window rows a prefix of m
        blocks needs (the cache's `window_blocks`): the run ends where they are stored, and those blocks' payloads
        hold both entries' tensors."""
        keys = self.keys(tokens) if keys is None else keys
        if max_tokens is not None:
            keys = keys[: max(0, max_tokens) // self.block]
        found: list[Payload] = []
        with self._lock:
            for key in keys:
                payload = self._get(key)
                if payload is None:
                    break
                found.append(payload)
            if windowed is not None:
                found = self._with_windows(keys, found, windowed)
            hit = len(found) * self.block
            self.stats.hit_tokens += hit
            self.stats.miss_tokens += len(torch.as_tensor(tokens).view(-1)) - hit
        return keys[: len(found)], found

    def _get(self, key: str) -> Payload | None:
        """An entry from memory, or from disk (then kept in memory too); None where neither has it."""
        payload = self.memory.get(key)
        if payload is not None:
            self.stats.memory_hits += 1
        elif self.disk is not None and (payload := self.disk.get(key)) is not None:
            self.stats.disk_hits += 1
            self.stats.memory_evictions += self.memory.put(key, payload)
        return payload

    def _with_windows(self, keys: list[str], found: list[Payload], windowed) -> list[Payload]:
        """The longest start of `found` whose window entries (windowed(m) of them) are stored, with them merged in."""
        for m in range(len(found), 0, -1):
            need = windowed(m)
            if not all(keys[b] + WINDOW in self.memory or (self.disk is not None and self.disk.path(
                    keys[b] + WINDOW).exists()) for b in need):
                continue
            rows = {b: self._get(keys[b] + WINDOW) for b in need}
            if all(p is not None for p in rows.values()):  # (a damaged file on disk: a shorter prefix)
                return [{**p, **rows[b]} if b in rows else p for b, p in enumerate(found[:m])]
        return []

    def window_ends(self, tokens: int, windowed) -> set[int]:
        """The blocks of a prompt of `tokens` tokens whose window rows are offered: those a prefix of it ending
        within its first or last WINDOW_ENDS tokens needs (windowed(m): as `lookup` takes it)."""
        n = tokens // self.block
        ends = set(range(1, min(n, WINDOW_ENDS // self.block) + 1))
        ends |= set(range(max(1, -(-(tokens - WINDOW_ENDS) // self.block)), n + 1))
        return set().union(*(windowed(m) for m in ends))

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
        payload = {name: own(t) for name, t in make_block().items()}  # never aliases a live cache
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
