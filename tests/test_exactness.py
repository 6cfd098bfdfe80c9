"""The correctness anchor: with alpha very large and budget 1.0, InfiniGen fetches every valid entry and
must reproduce the full cache exactly (same greedy tokens, logits within float32 tolerance)."""

import pytest
import torch

import infinigen_kv as ig
from conftest import KINDS, left_padded_batch, tiny_hf

EXACT = dict(alpha=1e9, budget=1.0)


def hf_step_logits(hf, ids, mask, steps: int = 12, seed: int = 5):
    """step_logits of a transformers model with its own DynamicCache (the reference)."""
    from transformers import DynamicCache

    return step_logits(hf, DynamicCache(config=hf.config), ids, mask, steps, seed)


@torch.inference_mode()
def step_logits(model, cache, ids, mask, steps: int = 12, seed: int = 5):
    """Prefill, then teacher-force `steps` fixed random tokens; logits of every step: (steps + 1, B, V)."""
    B, n = ids.shape
    g = torch.Generator().manual_seed(seed)
    forced = torch.randint(3, model.config.vocab_size, (B, steps), generator=g)
    full_mask = torch.cat([mask, torch.ones(B, steps, dtype=mask.dtype)], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = [model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                 logits_to_keep=1).logits[:, -1]]
    for i in range(steps):
        p = pos[:, -1:] + 1 + i
        out.append(model(input_ids=forced[:, i : i + 1], attention_mask=full_mask[:, : n + i + 1], position_ids=p,
                         past_key_values=cache).logits[:, -1])
    return torch.stack(out)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", ["single", "padded"])
def test_logits_match_full(tiny_models, kind, batch):
    model = tiny_models[kind]
    if batch == "single":
        ids, mask = left_padded_batch(lengths=(45,))
    else:
        ids, mask = left_padded_batch(lengths=(48, 40, 31))
    ref = step_logits(model, ig.make_cache("full", model), ids, mask)
    cache = ig.make_cache("infinigen", model, **EXACT)
    got = step_logits(model, cache, ids, mask)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert cache.stats["fetched_fraction"] == pytest.approx(1.0)
    # and transformers' model with its own cache agrees with ours at its storage (float32; the default rounds rows
    # to bf16)
    hf = hf_step_logits(tiny_hf(kind), ids, mask)
    f32 = step_logits(model, ig.make_cache("full", model, kv_dtype="float32"), ids, mask)
    torch.testing.assert_close(f32, hf, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_offload_matches_full(tiny_models, kind):
    """Full offload moves every valid row every step: the full cache's logits, padding never attended."""
    model = tiny_models[kind]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    ref = step_logits(model, ig.make_cache("full", model), ids, mask)
    cache = ig.make_cache("offload", model)
    torch.testing.assert_close(step_logits(model, cache, ids, mask), ref, atol=1e-4, rtol=1e-4)
    assert cache.stats["fetched_fraction"] == pytest.approx(1.0)
    assert cache.calibration is None and all(layer.partial is None for layer in cache.layers)
    rows = sum(l.k.batch * l.k.heads for l in cache.layers)
    assert cache.stats["bytes_moved"] >= 12 * rows * 31 * (cache.layers[0].k.width * 2 * cache.layers[0].k.data.element_size())  # all rows, every step


@pytest.mark.parametrize("method", ["h2o", "streaming"])
@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2", "gemma3", "opt"])
def test_fixed_budget_baselines_exact_when_budget_covers_all(tiny_models, method, kind):
    """Budget 1.0 keeps every entry: the evicting caches reproduce the full cache."""
    model = tiny_models[kind]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    ref = step_logits(model, ig.make_cache("full", model), ids, mask)
    got = step_logits(model, ig.make_cache(method, model, budget=1.0), ids, mask)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_gemma3_local_layers(tiny_models):
    """Gemma 3's local layers: dense by default (their whole window, no speculation); speculated within
    their window with local_layers="speculate": still exactly the full cache at budget 1.0, so the keep of
    a local target is its own window, not the global layer's mask (and the other way round)."""
    model = tiny_models["gemma3"]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    full = ig.make_cache("full", model)
    ref = step_logits(model, full, ids, mask)
    # the full cache's reads: a local layer's decode step reads its last 16 rows, the global one all n
    kv = full.layers[0].k.data.element_size()  # the rows' storage (bf16 by default on CPU)
    row = 3 * 2 * 16 * kv * 2  # B x G x d x storage x (K and V)
    assert full.stats["kv_bytes_per_step"] == sum(3 * 16 + 48 + i for i in range(1, 13)) * row // 12
    dense = ig.make_cache("infinigen", model, **EXACT)
    assert [layer.dense for layer in dense.layers] == [True, True, False, True]
    torch.testing.assert_close(step_logits(model, dense, ids, mask), ref, atol=1e-4, rtol=1e-4)
    # a dense local layer (and the full cache's) holds its window, not the 60 tokens (W - 1 <= rows <= 2W),
    # and no partial keys
    for layer in dense.layers:
        assert layer.offset + layer.k.length == layer.seen == 60
        assert (layer.window is not None) == (layer.layer_idx in (0, 1, 3))
        assert 15 <= layer.k.length <= 32 if layer.window else layer.k.length == 60
        assert (layer.partial is None) == layer.dense
    kept = sum(l.k.length for l in dense.layers)
    assert dense.stats["pool_bytes"] == full.stats["pool_bytes"] == kept * row < 4 * 60 * row
    token = 2 * 16 * kv * 2  # one token of one sequence in one layer: G x d x storage x (K and V)
    part = dense.layers[2].partial
    part = part.heads * part.width * part.data.element_size()  # the global layer's partial keys
    assert dense.sequence_bytes(1000) == (1000 + 3 * 32) * token + 1000 * part  # the server's cost model
    assert full.sequence_bytes(1000) == (1000 + 3 * 32) * token
    spec = ig.make_cache("infinigen", model, local_layers="speculate", **EXACT)
    assert [layer.dense for layer in spec.layers] == [True, False, False, False]
    torch.testing.assert_close(step_logits(model, spec, ids, mask), ref, atol=1e-4, rtol=1e-4)
    stats = spec.stats
    assert stats["fetched_fraction"] == pytest.approx(1.0)
    assert max(stats["tokens_per_step"][l] for l in (1, 3)) <= 15  # a local layer fetches within its window


@pytest.mark.parametrize("kind", KINDS)
def test_generate_greedy_identical(tiny_models, kind):
    """ig.generate with the cache passed in: greedy tokens identical to the full cache, batch of 3."""
    model = tiny_models[kind]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    kw = dict(max_new_tokens=16, stop_at_eos=False)
    ref = ig.generate(model, ids, mask, cache=ig.make_cache("full", model), **kw).tokens
    got = ig.generate(model, ids, mask, cache=ig.make_cache("infinigen", model, **EXACT), **kw).tokens
    assert torch.equal(got, ref)


def test_generate_sampling_reproducible(tiny_models):
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(40, 33))
    runs = []
    for method in ("full", "infinigen"):
        cache = ig.make_cache(method, model, **EXACT)
        r = ig.generate(model, ids, mask, cache=cache, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=3,
                        stop_at_eos=False)
        runs.append(r.tokens)
    assert torch.equal(runs[0], runs[1])


def test_selective_decode_runs_and_caps(tiny_models):
    """With the default alpha and a small budget, decode runs, fetches at most the budget, and reports it."""
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(200, 150, 120))
    cache = ig.make_cache("infinigen", model, budget=0.1, min_budget=0)
    r = ig.generate(model, ids, mask, cache=cache, max_new_tokens=6, stop_at_eos=False)
    assert r.tokens.shape == (3, 6)
    s = cache.stats
    per_layer = s["fetched_fraction_per_layer"]
    assert per_layer[0] == pytest.approx(1.0)  # layer 0 attends fully
    assert all(0 < f <= 0.1 + 0.02 for f in per_layer[1:])  # ceil() rounding of the cap
    assert s["bytes_moved"] > 0 and s["decode_steps"] == 5


def test_sliding_window_respected():
    """Mistral with a window shorter than the sequence: the window arrives through the mask, so selection
    never leaves it and InfiniGen (exact settings) matches the full cache and transformers' sliding cache."""
    from conftest import tiny_hf

    from infinigen_kv.model.weights import from_hf

    hf = tiny_hf("mistral")
    hf.config.sliding_window = 16
    model = from_hf(hf)
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    ref = hf_step_logits(hf, ids, mask)
    full = step_logits(model, ig.make_cache("full", model, kv_dtype="float32"), ids, mask)  # transformers' storage
    got = step_logits(model, ig.make_cache("infinigen", model, **EXACT, kv_dtype="float32"), ids, mask)
    torch.testing.assert_close(full, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    hf.config.sliding_window = 4096
    wide = from_hf(hf)
    unwindowed = step_logits(wide, ig.make_cache("full", wide, kv_dtype="float32"), ids, mask)
    assert not torch.allclose(unwindowed, ref, atol=1e-3)  # the window did change the outputs


@pytest.mark.parametrize("T", [17, 50, 64])
def test_local_prefill_equals_the_masked_one(T):
    """A sliding-window prompt attended block by block (only the keys each block can reach) gives what the
    whole (T, T) window mask gives, with grouped KV heads."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # the reference

    from infinigen_kv.model.attention import _local_prefill

    module = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    q, k, v = torch.randn(1, 4, T, 8), torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
    i = torch.arange(T)
    mask = ((i.view(1, -1) <= i.view(-1, 1)) & (i.view(1, -1) > i.view(-1, 1) - 16)).view(1, 1, T, T)
    ref = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)[0]
    torch.testing.assert_close(_local_prefill(q, k, v, 16, 0.3), ref, atol=1e-5, rtol=1e-5)


def test_nucleus_sampling_from_the_top_k_equals_a_full_sort():
    """The sampler takes the nucleus from the top NUCLEUS_TOPK ids when it lies there and sorts the whole
    vocabulary when it does not: either way the draws of a full sort's nucleus, same seed."""
    from infinigen_kv.runtime.sampling import NUCLEUS_TOPK, Sampler, SamplingParams

    def reference(logits, temperature, top_p, seed):
        probs = torch.softmax(logits / temperature, dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
        return torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)).squeeze(-1)

    V = 4 * NUCLEUS_TOPK
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(6, V, generator=g) * 6  # nucleus well inside the top k
    flat = torch.randn(6, V, generator=g) * 0.1  # nucleus reaching past it: the full sort
    for logits in (peaked, flat):
        for seed in range(5):
            sampler = Sampler.for_batch("cpu", V, [SamplingParams(temperature=0.8, top_p=0.9)] * 6,
                                        shared_seed=seed, shared=True)
            assert torch.equal(sampler(logits), reference(logits, 0.8, 0.9, seed))


@pytest.mark.parametrize("method", ["full", "infinigen", "offload", "quant", "h2o", "streaming"])
def test_sequence_bytes_of_every_method(tiny_models, method):
    """The server's cost model on Gemma's local and global layers: window layers count at most 2W rows;
    the evicting caches count their budget's entries in every layer (what the window has left stays)."""
    model = tiny_models["gemma3"]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    cache = ig.make_cache(method, model, **({"budget": 0.3, "min_budget": 0} if method in ("h2o", "streaming") else {}))
    step_logits(model, cache, ids, mask, steps=2)
    per_token = sum(layer.token_bytes() for layer in cache.layers)
    got = cache.sequence_bytes(1000)
    if method in ("h2o", "streaming"):
        assert got == cache.entries(1000) * per_token
    elif method in ("full", "infinigen"):
        assert 0 < got < 1000 * per_token  # three of the four layers hold a window
    else:  # offload and quant keep every layer whole
        assert got == 1000 * per_token
