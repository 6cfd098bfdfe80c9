"""Prefix reuse is exact: a prompt whose first blocks come from the prefix store gives the same logits (bit for bit),
tokens and, for InfiniGen, the same chosen entries as the same prompt prefilled whole in the same blocks; on every
architecture (Gemma 3's windowed layers included), alone and in a running batch, and from the disk tier."""

import pytest
import torch
from conftest import KINDS, tiny_model

import infinigen_kv as ig
from infinigen_kv.methods.infinigen.cache import InfiniGenCache
from infinigen_kv.runtime.batching import Prefill, RunningBatch
from infinigen_kv.runtime.prefix import PrefixStore, cache_namespace
from infinigen_kv.runtime.sampling import SamplingParams

BLOCK = 16
NEW = 10


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(3, 256, (75,), generator=g).tolist()
    b = a[:53] + torch.randint(3, 256, (30,), generator=g).tolist()  # shares 3 whole blocks (48 tokens) with a
    return a, b


def make(model, method, **opts):
    return ig.make_cache(method, model, **({"min_budget": 0, **opts} if method == "infinigen" else opts))


def store_for(model, method, block=BLOCK, **kw):
    ns = cache_namespace(model, make(model, method), block)
    return PrefixStore(ns, memory_bytes=kw.pop("memory_bytes", 1 << 30), block=block, **kw)


def decode(model, p, new=NEW):
    """Greedy tokens after prefill p, the logits of every step (exact floats), InfiniGen's choices per prefetch."""
    seen, real = [], InfiniGenCache.prefetch

    def spy(self, target, fetch):
        seen.append(fetch.idx.clone() if fetch.count is None else (fetch.idx.clone(), fetch.count.clone()))
        return real(self, target, fetch)

    InfiniGenCache.prefetch = spy
    logits = [p.logits.clone()]
    try:
        out = ig.generate(model, p.ids, cache=p.cache, max_new_tokens=new, stop_at_eos=False, prefilled=p.logits,
                          logprobs=5, on_step=lambda i, ids, lp: logits.append(lp[1].clone()))
    finally:
        InfiniGenCache.prefetch = real
    return out.tokens[0].tolist(), logits, seen


def run(model, method, ids, store, **opts):
    p = Prefill(model, make(model, method, **opts), ids, prefix=store)
    while not p.step():
        pass
    return p


def same(x, y):
    if isinstance(x, torch.Tensor):
        return torch.equal(x, y)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
    return x == y


@pytest.mark.parametrize("kind", KINDS)
def test_reuse_is_exact_on_every_architecture(kind):
    model = tiny_model(kind)
    a, b = prompts()
    for method, opts in [("full", {}), ("infinigen", {"budget": 1.0}), ("infinigen", {"budget": 0.25})]:
        ref = run(model, method, b, store_for(model, method), **opts)  # b alone: nothing stored
        assert ref.cached == 0
        store = store_for(model, method)
        run(model, method, a, store, **opts)  # a's 4 whole blocks stored
        got = run(model, method, b, store, **opts)
        assert got.cached == 3 * BLOCK, (kind, method)
        assert torch.equal(got.logits, ref.logits), (kind, method, opts)
        assert same(decode(model, got), decode(model, ref)), (kind, method, opts)


@pytest.mark.parametrize("method", ["quant", "offload"])
def test_reuse_is_exact_for_the_other_methods_that_keep_every_entry(method):
    model = tiny_model("llama-gqa")
    a, b = prompts(1)
    ref = run(model, method, b, store_for(model, method))
    store = store_for(model, method)
    run(model, method, a, store)
    got = run(model, method, b, store)
    assert got.cached == 3 * BLOCK
    assert same(decode(model, got), decode(model, ref))


@pytest.mark.parametrize("block", [4, 8, 16, 32])
def test_gemma_windowed_layers_restore_what_a_blockwise_prefill_leaves(block):
    """Window 16: blocks under, at and over the window, a restore after the window has slid several times."""
    model = tiny_model("gemma3")
    g = torch.Generator().manual_seed(3)
    a = torch.randint(3, 256, (150,), generator=g).tolist()
    b = a[:131] + torch.randint(3, 256, (9,), generator=g).tolist()
    for method in ("full", "infinigen"):
        store = store_for(model, method, block)
        run(model, method, a, store, budget=0.5)
        got = Prefill(model, make(model, method, budget=0.5), b, prefix=store)  # restored, nothing computed yet
        ref = Prefill(model, make(model, method, budget=0.5), b, prefix=store_for(model, method, block))
        assert got.cached == 131 // block * block
        while ref.done < got.cached:
            ref.step()
        for x, y in zip(got.cache.layers, ref.cache.layers):  # the same rows where the same positions are
            assert (x.offset, x.get_seq_length()) == (y.offset, y.get_seq_length())
            assert same([buf.valid() for buf in x.row_buffers()], [buf.valid() for buf in y.row_buffers()])
        while not got.step():
            pass
        while not ref.step():
            pass
        assert same(decode(model, got), decode(model, ref)), (method, block)


@pytest.mark.parametrize("method", ["full", "infinigen"])
def test_window_rows_are_kept_only_near_a_prompts_ends(method, tmp_path, monkeypatch):
    """Gemma's window layers' rows are stored only for the blocks a prefix ending in a prompt's first or last
    WINDOW_ENDS tokens reads: such a prefix restores exactly (from memory and from disk); one ending between finds
    no window rows there and restores the longest that has them (computing the rest), with the same answer."""
    import infinigen_kv.runtime.prefix as prefix_mod

    monkeypatch.setattr(prefix_mod, "WINDOW_ENDS", 32)
    model, block = tiny_model("gemma3"), 8  # window 16
    g = torch.Generator().manual_seed(7)
    a = torch.randint(3, 256, (150,), generator=g).tolist()
    near = a[:140] + torch.randint(3, 256, (9,), generator=g).tolist()  # shares 17 blocks, within a's last 32 tokens
    middle = a[:70] + torch.randint(3, 256, (30,), generator=g).tolist()  # shares 8 blocks: the first 4 restored
    cache = make(model, method)
    store = store_for(model, method, block)
    run(model, method, a, store)
    ends = set().union(*(cache.window_blocks(m, block) for m in [1, 2, 3, 4, 15, 16, 17, 18]))
    keys = store.keys(a)
    stored = {i for i, k in enumerate(keys) if k + prefix_mod.WINDOW in store.memory}
    assert stored == ends and len(ends) < len(keys) * 2 // 3
    assert all({n.split(".")[0] for n in store.memory.get(k)} == {"2"} for k in keys)  # layer 2 of 4 is global
    for ids, cached in [(near, 136), (middle, 32)]:
        ref = run(model, method, ids, store_for(model, method, block))
        got = run(model, method, ids, store)
        assert got.cached == cached
        assert torch.equal(got.logits, ref.logits) and same(decode(model, got), decode(model, ref))
    run(model, method, a, store_for(model, method, block, disk_dir=tmp_path))
    fresh = store_for(model, method, block, disk_dir=tmp_path)  # a new process: window rows from disk too
    got = run(model, method, near, fresh)
    assert got.cached == 136 and fresh.stats.disk_hits == 17 + len(cache.window_blocks(17, block))


def test_reuse_in_a_running_batch_matches_the_row_alone():
    model = tiny_model("llama-gqa")
    a, b = prompts(2)
    other = prompts(5)[0][:40]
    store = store_for(model, "infinigen")
    run(model, "infinigen", a, store, budget=0.25)
    alone = decode(model, run(model, "infinigen", b, store_for(model, "infinigen"), budget=0.25))[0]
    batch = RunningBatch(model)
    for ids in (other, b):
        p = run(model, "infinigen", ids, store, budget=0.25)
        batch.join(p, SamplingParams(temperature=0.0), NEW)
    assert p.cached == 3 * BLOCK
    rows = []
    for _ in range(NEW):
        ids, _ = batch.sample()
        rows.append(ids.tolist())
        batch.forward(ids)
    assert [r[1] for r in rows] == alone


def test_disk_tier_serves_a_new_process_and_survives_damage(tmp_path, caplog):
    model = tiny_model("qwen2")
    a, b = prompts(3)
    ref = decode(model, run(model, "infinigen", b, store_for(model, "infinigen"), budget=0.25))
    run(model, "infinigen", a, store_for(model, "infinigen", disk_dir=tmp_path), budget=0.25)
    fresh = store_for(model, "infinigen", disk_dir=tmp_path)  # a restarted server: nothing in memory
    got = run(model, "infinigen", b, fresh, budget=0.25)
    assert got.cached == 3 * BLOCK and fresh.stats.disk_hits == 3
    assert same(decode(model, got), ref)
    for f in sorted(tmp_path.rglob("*.safetensors"))[:2]:  # damaged entries: misses, the answer unchanged
        f.write_bytes(f.read_bytes()[:100])
    damaged = store_for(model, "infinigen", disk_dir=tmp_path)
    got = run(model, "infinigen", b, damaged, budget=0.25)
    assert got.cached < 3 * BLOCK
    assert same(decode(model, got), ref)


def test_int8_rows_are_stored_as_they_are_held(tmp_path):
    """kv_dtype="int8": blocks stored (in memory and on disk) as int8 rows with their scales, a namespace of their
    own, restored exactly."""
    from safetensors.torch import load_file

    model = tiny_model("llama-gqa")
    a, b = prompts(4)
    ns = cache_namespace(model, make(model, "infinigen", kv_dtype="int8"), BLOCK)
    assert ns != cache_namespace(model, make(model, "infinigen"), BLOCK)

    def store(**kw):
        return PrefixStore(ns, memory_bytes=1 << 30, block=BLOCK, **kw)

    ref = decode(model, run(model, "infinigen", b, store(), budget=0.25, kv_dtype="int8"))
    run(model, "infinigen", a, store(disk_dir=tmp_path), budget=0.25, kv_dtype="int8")
    fresh = store(disk_dir=tmp_path)
    got = run(model, "infinigen", b, fresh, budget=0.25, kv_dtype="int8")
    assert got.cached == 3 * BLOCK and fresh.stats.disk_hits == 3
    assert same(decode(model, got), ref)
    entry = load_file(next(tmp_path.rglob("*.safetensors")))
    assert {t.dtype for t in entry.values()} == {torch.int8}  # K/V rows and the int8 partial keys


def test_methods_that_cannot_reuse_say_so_and_other_namespaces_never_mix():
    model = tiny_model("llama-gqa")
    for method in ("h2o", "streaming"):
        assert cache_namespace(model, make(model, method), BLOCK) is None
    assert cache_namespace(model, make(model, "infinigen", capacity=0.5), BLOCK) is None
    names = {cache_namespace(model, make(model, m, **o), BLOCK) for m, o in [
        ("full", {}), ("infinigen", {}), ("infinigen", {"partial_dtype": "bfloat16"}), ("quant", {"bits": 4}),
        ("quant", {"bits": 8}), ("offload", {})]}
    assert len(names) == 6
    assert cache_namespace(model, make(model, "full"), 32) not in names
    assert cache_namespace(tiny_model("llama-gqa", seed=1), make(model, "full"), BLOCK) not in names


def test_prompt_logprobs_are_computed_not_restored():
    model = tiny_model("llama-gqa")
    a, b = prompts()
    store = store_for(model, "full")
    run(model, "full", a, store)
    p = Prefill(model, make(model, "full"), b, logprobs=2, prefix=store)
    while not p.step():
        pass
    assert p.cached == 0 and len(p.prompt_logprobs[0]) == len(b) - 1


def test_a_stored_block_that_does_not_fit_is_computed_instead(caplog):
    """A payload of another layout under this namespace (a store written by another version): a miss with one
    warning line, the prompt computed whole, the same answer."""
    model = tiny_model("llama-gqa")
    a, b = prompts()
    ref = run(model, "full", b, store_for(model, "full"))
    store = store_for(model, "full")
    for key in store.keys(a)[:2]:
        store.put(key, lambda: {"0.0": torch.zeros(2, BLOCK, 3)})  # the wrong width
    with caplog.at_level("WARNING", logger="infinigen_kv.prefix"):
        got = run(model, "full", b, store)
    assert got.cached == 0 and store.stats.disk_errors == 1
    assert [r.message for r in caplog.records if "unusable" in r.message]
    assert same(decode(model, got), decode(model, ref))
