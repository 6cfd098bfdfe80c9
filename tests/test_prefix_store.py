"""The prefix store (runtime/prefix.py, its tiers in prefix_tiers.py): block keys, the memory tier's LRU, the disk
tier across restarts and processes, and every way a disk entry or directory can be bad (a miss and one warning line, never wrong data)."""

import errno
import logging
import os
import threading

import pytest
import torch

from infinigen_kv.runtime import prefix_tiers
from infinigen_kv.runtime.prefix import PrefixStore, chain, namespace

NS = namespace(model="tiny", dtype="float32", method="infinigen")


def block_payload(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"k.0": torch.randn(1, 2, 4, 8, generator=g), "v.0": torch.randn(1, 2, 4, 8, generator=g),
            "p.1": torch.randn(1, 2, 4, 4, generator=g).bfloat16(),
            "p8.1": torch.randint(-128, 127, (1, 2, 4, 8), generator=g, dtype=torch.int8)}


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)


def test_keys_name_a_block_and_everything_before_it():
    a = list(range(20))
    b = a[:8] + [99] + a[9:]  # differs in block 2 (of 4 tokens)
    ka, kb = chain(NS, a, 4), chain(NS, b, 4)
    assert len(ka) == 5 and ka[:2] == kb[:2] and all(x != y for x, y in zip(ka[2:], kb[2:]))
    assert chain(NS, a[:19], 4) == ka[:4]  # a partial last block has no key
    assert chain(namespace(model="other"), a, 4)[0] != ka[0]  # namespaces never mix
    assert chain(NS, torch.tensor(a), 4) == ka


def test_memory_tier_lru_under_its_byte_limit():
    size = prefix_tiers.payload_bytes(block_payload(0))
    store = PrefixStore(NS, memory_bytes=2 * size, block=4)
    tokens = list(range(12))  # 3 blocks
    assert store.offer(tokens, block_payload) == 3
    assert len(store.memory) == 2 and store.stats.memory_evictions == 1
    keys, found = store.lookup(tokens)
    assert keys == [] and found == []  # block 0 was evicted: nothing starts the prompt
    store.offer(tokens[:4], block_payload)  # block 0 again (evicts block 1, the least recent)
    keys, found = store.lookup(tokens)
    assert len(found) == 1 and equal(found[0], block_payload(0))
    assert store.report()["memory_bytes"] == 2 * size


def test_lookup_takes_the_longest_prefix_and_counts_tokens():
    store = PrefixStore(NS, memory_bytes=1 << 20, block=4)
    store.offer(list(range(10)), block_payload)  # blocks 0, 1 (tokens 8, 9 are no whole block)
    keys, found = store.lookup(list(range(8)) + [50, 51, 52, 53, 54])
    assert len(found) == 2 and all(equal(f, block_payload(i)) for i, f in enumerate(found))
    assert store.stats.hit_tokens == 8 and store.stats.miss_tokens == 5
    keys, found = store.lookup(list(range(8)), max_tokens=7)  # the prefill keeps a token of its own
    assert len(found) == 1
    assert store.offer(list(range(8)), lambda i: pytest.fail("stored blocks are not made again")) == 0


def test_disk_tier_survives_a_restart_and_is_shared(tmp_path):
    tokens = list(range(16))
    a = PrefixStore(NS, memory_bytes=1 << 20, disk_dir=tmp_path, block=4)
    a.offer(tokens, block_payload)
    b = PrefixStore(NS, memory_bytes=1 << 20, disk_dir=tmp_path, block=4)  # a restart, or a second replica
    keys, found = b.lookup(tokens)
    assert len(found) == 4 and all(equal(f, block_payload(i)) for i, f in enumerate(found))
    assert b.stats.disk_hits == 4 and len(b.memory) == 4  # promoted
    b.lookup(tokens)
    assert b.stats.memory_hits == 4
    other = PrefixStore(namespace(model="other"), memory_bytes=1 << 20, disk_dir=tmp_path, block=4)
    assert other.lookup(tokens)[1] == []


def test_concurrent_writers_of_one_block(tmp_path):
    stores = [PrefixStore(NS, memory_bytes=1 << 20, disk_dir=tmp_path, block=4) for _ in range(4)]
    threads = [threading.Thread(target=s.offer, args=(list(range(8)), block_payload)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 2 and all(f.endswith(".safetensors") for f in files)  # no temporary left behind
    fresh = PrefixStore(NS, memory_bytes=1 << 20, disk_dir=tmp_path, block=4)
    assert len(fresh.lookup(list(range(8)))[1]) == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "empty"])
def test_a_bad_disk_entry_is_a_miss_with_one_warning(tmp_path, caplog, damage):
    tokens = list(range(8))
    PrefixStore(NS, memory_bytes=1 << 20, disk_dir=tmp_path, block=4).offer(tokens, block_payload)
    key = chain(NS, tokens, 4)[1]
    path = tmp_path / NS / key[:2] / f"{key}.safetensors"
    data = path.read_bytes()
    if damage == "flip":  # one byte of tensor data: only the digest can tell
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 0x40]) + data[-4:])
    elif damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # another namespace's entry under this name
        foreign = PrefixStore(namespace(model="other"), memory_bytes=0, disk_dir=tmp_path, block=4)
        foreign.offer(tokens, block_payload)
        fkey = chain(foreign.ns, tokens, 4)[1]
        path.write_bytes((tmp_path / foreign.ns / fkey[:2] / f"{fkey}.safetensors").read_bytes())
    store = PrefixStore(NS, memory_bytes=1 << 20, disk_dir=tmp_path, block=4)
    with caplog.at_level(logging.WARNING, logger="infinigen_kv.prefix"):
        keys, found = store.lookup(tokens)
        store.lookup(tokens)
    assert len(found) == 1 and equal(found[0], block_payload(0))  # block 0 good, block 1 a miss
    assert len(caplog.records) == 1 and "unusable" in caplog.records[0].getMessage()
    assert not path.exists()  # removed: the next offer writes a good one
    assert store.disk.used == du(tmp_path / NS)
    store.offer(tokens, block_payload)
    assert store.disk.used == du(tmp_path / NS)  # the replacement counted once, the damaged entry not at all
    assert len(PrefixStore(NS, memory_bytes=0, disk_dir=tmp_path, block=4).lookup(tokens)[1]) == 2


def du(root) -> int:
    """The bytes of the files under root (du -b)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_leaves_memory_serving(tmp_path, caplog, monkeypatch, err):
    def fail(*args, **kwargs):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(prefix_tiers.os, "replace", fail)
    store = PrefixStore(NS, memory_bytes=1 << 20, disk_dir=tmp_path, block=4)
    with caplog.at_level(logging.WARNING, logger="infinigen_kv.prefix"):
        assert store.offer(list(range(12)), block_payload) == 3
    assert len(caplog.records) == 1 and "cannot write" in caplog.records[0].getMessage()
    assert store.disk.writable == (err == errno.ENOSPC)
    assert len(store.lookup(list(range(12)))[1]) == 3  # memory still serves
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # no temporary left behind


def test_a_directory_that_cannot_be_made_turns_the_disk_tier_off(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="infinigen_kv.prefix"):
        store = PrefixStore(NS, memory_bytes=1 << 20, disk_dir=blocker, block=4)
        store.offer(list(range(8)), block_payload)
    assert len(caplog.records) == 1 and not store.disk.writable
    assert len(store.lookup(list(range(8)))[1]) == 2


def test_disk_eviction_by_last_use(tmp_path):
    store = PrefixStore(NS, memory_bytes=0, disk_dir=tmp_path, block=4)
    store.offer(list(range(4)), block_payload)
    size = store.disk.used
    store = PrefixStore(NS, memory_bytes=0, disk_dir=tmp_path, disk_bytes=3 * size, block=4)
    for start in range(0, 5):  # five distinct one-block prompts, oldest first
        store.offer([1000 * start + t for t in range(4)], block_payload)
        os.utime(store.disk.path(chain(NS, [1000 * start + t for t in range(4)], 4)[0]), (start, start))
    assert store.disk.used <= 3 * size and store.stats.disk_evictions >= 2
    assert store.disk.used == du(tmp_path / NS)
    newest = [1000 * 4 + t for t in range(4)]
    assert len(store.lookup(newest)[1]) == 1
    assert not store.lookup([0, 1, 2, 3])[1]  # the oldest went first
