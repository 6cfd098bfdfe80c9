"""Continuous batching: sequences join a running cache after their own (chunked) prefill and
leave it when they end; what a sequence generates does not depend on what else shares its batch."""

import pytest
import torch

import infinigen_kv as ig
from conftest import left_padded_batch
from infinigen_kv.testing import prompt, run_plan
from infinigen_kv.runtime.batching import Prefill, RunningBatch
from infinigen_kv.methods.registry import make_cache
from infinigen_kv.runtime.generation import generate, prefill
from infinigen_kv.runtime.sampling import SamplingParams

# (name, method, options): exact at full budget for every method; infinigen also at its default budget
METHODS = [("full", "full", {}), ("infinigen-1.0", "infinigen", {"budget": 1.0}),
           ("infinigen-0.1", "infinigen", {}), ("offload", "offload", {}), ("quant", "quant", {}),
           ("h2o", "h2o", {"budget": 0.3, "min_budget": 0}), ("streaming", "streaming", {"budget": 0.3, "min_budget": 0}),
           ("quest-1.0", "quest", {"budget": 1.0}), ("snapkv-1.0", "snapkv", {"budget": 1.0}),
           ("shadowkv-1.0", "shadowkv", {"budget": 1.0, "rank": 4})]


@pytest.mark.parametrize("name,method,options", METHODS, ids=[m[0] for m in METHODS])
@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2", "gemma3", "opt"])
def test_a_sequence_does_not_depend_on_its_batch(tiny_models, kind, name, method, options):
    """Row "a" alone vs. sharing its steps with a longer prompt that joins later (a is then left-padded), a
    shorter one, and one that leaves early (the padding columns are trimmed away)."""
    model = tiny_models[kind]
    a = {"a": (0, prompt(40, 1), 14, None)}
    alone = run_plan(model, method, options, a)
    plan = {**a, "long": (3, prompt(70, 2), 6, None), "short": (5, prompt(9, 3), 12, None),
            "first": (0, prompt(25, 4), 2, None)}
    shared = run_plan(model, method, options, plan)
    assert shared["a"] == alone["a"]
    assert run_plan(model, method, options, {"long": (0, plan["long"][1], 6, None)})["long"] == shared["long"]


def test_infinigen_selects_the_same_entries_in_any_batch(tiny_models, monkeypatch):
    """At the default fraction every prefetch of row "a" picks the same positions (counted from its first real
    token) alone and in a batch that others join and leave."""
    from infinigen_kv.methods.infinigen.cache import InfiniGenCache

    real, seen = InfiniGenCache.prefetch, []

    def spy(self, target, fetch):
        keep = fetch.keep
        pad = int(keep[0, 0].long().argmax()) if keep is not None else 0  # row 0 ("a"): its padding
        idx, got = fetch.idx[0], fetch.count[0] if fetch.count is not None else None
        seen.append([sorted(int(i) - pad for i in (idx[g, : int(got[g])] if got is not None else idx[g][fetch.real[0, g]]))
                     for g in range(idx.shape[0])])
        return real(self, target, fetch)

    monkeypatch.setattr(InfiniGenCache, "prefetch", spy)
    model = tiny_models["llama-gqa"]
    a = {"a": (0, prompt(40, 1), 14, None)}
    run_plan(model, "infinigen", {"min_budget": 0}, a)  # the fraction as named: the tiny past is under the floor
    alone, seen[:] = list(seen), []
    run_plan(model, "infinigen", {"min_budget": 0}, {**a, "long": (3, prompt(70, 2), 20, None), "short": (5, prompt(9, 3), 4, None)})
    per_step = len(model.layers) - 1  # layer 1 for itself, then layers 2.. one layer ahead
    assert len(alone) == 13 * per_step and len(seen) > 13 * per_step  # "long" goes on after "a" is done
    assert seen[: 13 * per_step] == alone  # "a" is row 0 while it runs


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_models):
    model = tiny_models["llama-gqa"]
    a = {"a": (0, prompt(30, 1), 10, 7)}
    alone = run_plan(model, "infinigen", {"min_budget": 0}, a, temperature=1.0)
    shared = run_plan(model, "infinigen", {"min_budget": 0}, {**a, "b": (2, prompt(50, 2), 4, 8)}, temperature=1.0)
    assert shared["a"] == alone["a"]


@pytest.mark.parametrize("kind", ["llama-gqa", "gemma3"])
def test_chunked_prefill_equals_one_pass(tiny_models, kind):
    """A prompt prefilled in chunks decodes as when prefilled at once (full and infinigen at budget 1.0;
    Gemma's local layers keep only their window: chunks of 7 slide it within the prompt)."""
    model = tiny_models[kind]
    plan = {"a": (0, prompt(50, 5), 10, None)}
    for method, options in (("full", {}), ("infinigen", {"budget": 1.0})):
        assert run_plan(model, method, options, plan, chunk=7) == run_plan(model, method, options, plan, chunk=512)


@pytest.mark.parametrize("method,options", [("full", {}), ("infinigen", {"budget": 1.0}), ("h2o", {"budget": 0.5}),
                                            ("streaming", {"budget": 0.5}), ("quant", {})])
def test_a_long_prompt_is_prefilled_in_chunks(tiny_models, method, options, monkeypatch):
    """generate's prefill in chunks of PREFILL_CHUNK columns counted from the prompt's end (its activations stay
    batch x chunk, not batch x length): each forward sees at most a chunk, the greedy tokens are those of one pass
    (h2o's accumulated scores and streaming's window too), and each row's are those of the row alone."""
    from infinigen_kv.runtime import generation

    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        one = generate(model, ids, mask, cache=make_cache(method, model, **options), max_new_tokens=8, stop_at_eos=False)
        assert seen[0] == 48
        seen.clear()
        monkeypatch.setattr(generation, "PREFILL_CHUNK", 10)
        got = generate(model, ids, mask, cache=make_cache(method, model, **options), max_new_tokens=8,
                       stop_at_eos=False)
        assert seen[:5] == [8, 10, 10, 10, 10]  # 48 = 8 + 4 x 10 (decode steps: model/step.py)
        alone = generate(model, ids[2:, 17:], mask[2:, 17:], cache=make_cache(method, model, **options),
                         max_new_tokens=8, stop_at_eos=False)
    finally:
        hook.remove()
    assert torch.equal(got.tokens, one.tokens)
    if method in ("full", "infinigen", "quant"):  # (h2o and streaming keep per batch: the longest row's budget)
        assert torch.equal(alone.tokens[0], got.tokens[2])


def test_chunks_are_counted_from_the_end():
    from infinigen_kv.runtime.generation import chunks

    assert chunks(48, 10) == [(0, 8), (8, 18), (18, 28), (28, 38), (38, 48)]
    assert chunks(31, 10) == [(0, 1), (1, 11), (11, 21), (21, 31)]
    assert chunks(20, 10) == [(0, 10), (10, 20)] and chunks(7, 10) == [(0, 7)]


def test_rows_leaving_free_the_cache(tiny_models):
    model = tiny_models["llama-gqa"]
    batch = RunningBatch(model)
    for n, seed in ((60, 1), (20, 2)):
        p = Prefill(model, ig.make_cache("full", model), prompt(n, seed))
        p.step()
        batch.join(p, SamplingParams(), 5)
    both = batch.cache.layers[0].nbytes
    assert batch.mask.shape == (2, 60) and batch.mask[1].sum() == 20
    batch.retain([1])  # the long row leaves: the short one's 40 columns of padding go with it
    assert batch.mask.shape == (1, 20) and batch.cache.get_seq_length() == 20
    assert batch.cache.layers[0].nbytes < both / 2
    batch.retain([])
    assert batch.cache is None and len(batch) == 0


def test_a_row_leaving_moves_only_the_last_row(tiny_models):
    """A retire keeps the rows in place, the last one taking the place of the one that left, and keeps
    padding columns that are under a quarter of the batch's (dropping them would copy every row)."""
    model = tiny_models["llama-gqa"]
    batch = RunningBatch(model)
    for n, seed in ((60, 1), (50, 2), (55, 3)):
        p = Prefill(model, ig.make_cache("full", model), prompt(n, seed))
        p.step()
        batch.join(p, SamplingParams(), 5)
    store = batch.cache.layers[0].k.store
    assert batch.retain([1, 2]) == [2, 1]  # row 0 (60 tokens) leaves; row 2 takes its place
    assert batch.cache.layers[0].k.store is store  # in place
    assert batch.mask.shape == (2, 60) and batch.mask.sum(1).tolist() == [55, 50]  # 5 padding columns stay



@pytest.mark.parametrize("method", ["full", "infinigen"])
def test_a_prefill_that_reserves_its_decode_rows_joins_without_a_copy(tiny_models, method):
    """Prefill(reserve=prompt + max tokens): the first row's join keeps the prefill's buffers (no copy of the
    prompt's K/V into new ones); without it the join reallocates them."""
    model, ids = tiny_models["llama-gqa"], prompt(40, 6)
    for reserve, kept in ((40 + 2000, True), (0, False)):
        p = Prefill(model, ig.make_cache(method, model), ids, reserve=reserve)
        while not p.step():
            pass
        store = p.cache.layers[1].k.store
        batch = RunningBatch(model)
        batch.join(p, SamplingParams(), 2000)
        assert (batch.cache.layers[1].k.store is store) == kept


def test_only_the_last_chunk_projects_onto_the_vocabulary(tiny_models, monkeypatch):
    """A prefill's chunks before its last skip the LM head (no rows); prompt logprobs need every position."""
    model, ids = tiny_models["llama-gqa"], prompt(40, 7)
    rows, real = [], type(model).logits
    monkeypatch.setattr(type(model), "logits", lambda self, x: rows.append(x.shape[-2]) or real(self, x))
    for logprobs, want in ((None, [0, 0, 1]), (2, [16, 16, 8])):
        rows.clear()
        p = Prefill(model, ig.make_cache("full", model), ids, chunk=16, logprobs=logprobs)
        while not p.step():
            pass
        assert rows == want and p.logits.shape == (1, model.config.vocab_size)

def _decode(model, ids, cache, prefilled=None):
    """(tokens, per-step logprob of each chosen token, fetched fraction) of 10 greedy steps."""
    steps = []
    r = generate(model, ids, cache=cache, max_new_tokens=10, stop_at_eos=False, prefilled=prefilled, logprobs=1,
                 on_step=lambda i, t, lp: steps.append(lp[0]))
    return r.tokens, torch.stack(steps), cache.stats["fetched_fraction"]


def _assert_same(got, ref, what):
    assert torch.equal(got[0], ref[0]), what
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
    assert got[2] == ref[2], what


@pytest.mark.parametrize("kind", ["llama-gqa", "gemma3", "opt"])
def test_a_fork_decodes_as_a_fresh_cache(tiny_models, kind):
    """Prefill once, fork per budget: each fork decodes exactly as a cache prefilled on its own (tokens,
    logprobs, fetched share), and decoding a fork leaves the prefilled cache as it was."""
    model = tiny_models[kind]
    ids = torch.randint(3, 256, (1, 120), generator=torch.Generator().manual_seed(0))
    for method, budgets in (("infinigen", [0.2, 16, 0.5]), ("h2o", [0.2, 16]), ("streaming", [0.3, 16]),
                            ("full", [None]), ("quant", [None])):
        base = make_cache(method, model, budget=budgets[0], min_budget=0)
        logits = prefill(model, ids, None, base, 10)
        for b in budgets:
            _assert_same(_decode(model, ids, base.fork(budget=b), logits),
                         _decode(model, ids, make_cache(method, model, budget=b, min_budget=0)), (method, b))
    with pytest.raises(ValueError, match="no budget"):
        make_cache("full", model).fork(budget=0.1)
    decoded = make_cache("h2o", model, budget=0.2, min_budget=0)
    _decode(model, ids, decoded)
    with pytest.raises(RuntimeError, match="fixed once decoding"):  # its entries are gone: no other budget
        decoded.set_budget(0.5)
    with pytest.raises(ValueError, match="budget must be"):
        make_cache("streaming", model).fork(budget=0)


def test_a_cache_goes_with_its_last_reference(tiny_models):
    """No reference cycle holds a cache (or a fork) of any method: its buffers go when its last holder drops
    it, with the garbage collector off (a benchmark's forks or a server's finished requests would otherwise
    pile up until a collection: 8k-token caches ran a 24 GiB machine out of memory)."""
    import gc
    import weakref

    model = tiny_models["llama-gqa"]
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    gc.collect()
    gc.disable()
    try:
        for method in ("full", "infinigen", "offload", "h2o", "streaming", "quant"):
            cache = make_cache(method, model)
            logits = prefill(model, ids, None, cache, 4)
            twin = cache.fork()
            _decode(model, ids, twin, logits)
            gone = [weakref.ref(cache), weakref.ref(twin)]
            del cache, twin
            assert [w() for w in gone] == [None, None], method
    finally:
        gc.enable()


@pytest.mark.parametrize("chunk", [2048, 50])
def test_one_prefill_through_a_tee_serves_every_method(tiny_models, chunk, monkeypatch):
    """TeeCache: one prefill (in chunks or not) lands in full, infinigen, h2o (its prefill scores too), streaming
    and offload caches; each, forked per budget, decodes exactly as if prefilled alone."""
    from infinigen_kv.bench.tee import TeeCache
    from infinigen_kv.runtime import generation

    monkeypatch.setattr(generation, "PREFILL_CHUNK", chunk)

    for kind in ("llama-gqa", "gemma3", "qwen2"):
        model = tiny_models[kind]
        ids = torch.randint(3, 256, (1, 120), generator=torch.Generator().manual_seed(1))
        plan = [("full", None), ("infinigen", 0.2), ("h2o", 0.2), ("streaming", 0.3), ("offload", None)]
        caches = [make_cache(m, model, budget=b, min_budget=0) for m, b in plan]
        logits = prefill(model, ids, None, TeeCache(caches), 10)
        for (method, budget), cache in zip(plan, caches):
            for b in ([budget, 16] if budget else [None]):
                _assert_same(_decode(model, ids, cache.fork(budget=b), logits),
                             _decode(model, ids, make_cache(method, model, budget=b, min_budget=0)), (kind, method, b))


@pytest.mark.parametrize("method,options", [("full", {}), ("offload", {}), ("infinigen", {"min_budget": 0})])
def test_static_steps_once_the_rows_stay(tiny_models, method, options, monkeypatch):
    """Where graphs are on (CUDA; here forced, the same static steps without a graph), rows that decode together
    for RunningBatch.STABLE steps go on in static steps over their bucket of rows; a row joins into an unused row
    of the bucket and leaves by the last row moving into its place, in place; a batch that leaves its bucket goes
    back to eager steps until its rows stay again. The same tokens as eager steps throughout."""
    from infinigen_kv.methods.base import Rebatch
    from infinigen_kv.model import static
    from infinigen_kv.runtime.batching import bucket

    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 17)] == [1, 2, 4, 4, 8, 8, 16, 24]
    model = tiny_models["llama-gqa"]
    plan = {"a": (0, prompt(40, 1), 16, None), "b": (0, prompt(30, 2), 16, None), "c": (0, prompt(20, 3), 6, None),
            "d": (4, prompt(10, 4), 8, None)}
    eager = run_plan(model, method, options, plan)
    calls = []
    monkeypatch.setattr(static, "graphs_on", lambda model, device, flag=None: True)
    for cls, name in ((static.StaticDecoder, "__init__"), (Rebatch, "place"), (Rebatch, "move_rows")):
        monkeypatch.setattr(cls, name, lambda *a, f=getattr(cls, name), n=name, **k: calls.append(n) or f(*a, **k))
    assert run_plan(model, method, options, plan) == eager
    # three rows in a bucket of 4; "d" joins in place; "c" leaves, "d" moves into its place; "d" leaves: a bucket
    # of 2, static again
    assert calls == ["__init__", "place", "move_rows", "__init__"], calls


@pytest.mark.parametrize("method", ["quest", "snapkv", "shadowkv"])
def test_selection_methods_decode_under_a_binding_budget_in_a_changing_batch(tiny_models, method):
    """Rows join (left-padded) and leave a running batch while each step attends a budget's share of the past."""
    plan = {"a": (0, prompt(120, 1), 14, None), "long": (3, prompt(150, 2), 6, None), "short": (5, prompt(60, 3), 12, None)}
    out = run_plan(tiny_models["qwen2"], method, {"budget": 0.3, "min_budget": 0, "rank": 4}, plan)
    assert {k: len(v) for k, v in out.items()} == {"a": 14, "long": 6, "short": 12}
