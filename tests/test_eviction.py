"""Pool capacity and eviction: the pool never holds more than its capacity, each policy evicts what it says,
a capacity that covers everything changes nothing."""

import math

import pytest
import torch

import infinigen_kv as ig
from infinigen_kv.methods.infinigen.pool import Slots
from conftest import left_padded_batch
from test_exactness import EXACT, step_logits


def test_policies_pick_their_victims():
    s = Slots(1, 2, "cpu", "fifo")
    s.append(0, 5)  # positions 0..4 in slots 0..4
    s.record(torch.tensor([[[4, 3, 0], [1, 2, 0]]]), torch.tensor([[[True, True, True], [True, True, False]]]))  # head 1: its slot 0 is padding
    s.record(torch.tensor([[[4, 0, 0], [1, 0, 0]]]), torch.tensor([[[True, False, False], [True, False, False]]]))
    assert s.hits.valid()[0, :, :, 0].tolist() == [[1, 0, 0, 1, 2], [0, 2, 1, 0, 0]]
    assert s.victim().tolist() == [[0, 0]]  # fifo: the oldest position
    s.policy = "counter"
    assert s.victim().tolist() == [[1, 0]]  # fewest fetches, ties to the oldest
    s.policy = "lru"
    assert s.victim().tolist() == [[1, 0]]  # never fetched first, then the least recent
    s.replace(torch.tensor([[1, 0]]), 5)
    assert s.pos.valid()[0, :, :, 0].tolist() == [[0, 5, 2, 3, 4], [5, 1, 2, 3, 4]]
    assert s.victim().tolist() == [[2, 3]]  # head 0: slot 2 (never fetched, oldest); head 1: slot 3 (pos 3 < 4)


@pytest.mark.parametrize("eviction", ["fifo", "lru", "counter"])
def test_pool_never_exceeds_capacity(tiny_models, eviction):
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    cache = ig.make_cache("infinigen", model, budget=0.3, min_budget=0, capacity=0.5, eviction=eviction)
    out = ig.generate(model, ids, mask, cache=cache, max_new_tokens=20, stop_at_eos=False)
    assert out.tokens.shape == (3, 20)
    seen = 48 + 19  # the last token is sampled, not fed
    for layer in cache.layers[1:]:
        assert layer.seen == seen and layer.get_seq_length() == seen
        assert layer.k.length == math.floor(0.5 * seen) == layer.partial.length == layer.slots.pos.length
        pos = layer.slots.pos.valid()[..., 0]
        assert int(pos.max()) == seen - 1  # the newest token is always kept
        assert (pos.sort(-1).values.diff(dim=-1) > 0).all()  # each position at most once per (sequence, head)
    assert cache.layers[0].k.length == seen  # layer 0 attends fully from the device: not limited


@pytest.mark.parametrize("kv,row", [("float32", 16 * 4), ("bfloat16", 16 * 2), ("int8", 16 + 2)])  # d = 16
def test_byte_capacity_bounds_the_allocation(tiny_models, kv, row):
    """The byte limit counts the rows as they are stored (kv_dtype)."""
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(48, 40))
    G = 2
    limit = 30 * G * 2 * row  # 30 rows of K+V per sequence and layer
    cache = ig.make_cache("infinigen", model, budget=0.5, min_budget=0, capacity_bytes=limit, kv_dtype=kv)
    ig.generate(model, ids, mask, cache=cache, max_new_tokens=10, stop_at_eos=False)
    for layer in cache.layers[1:]:
        assert layer.k.length == 30 and layer.nbytes <= 2 * limit  # two sequences
    assert cache.stats["pool_bytes"] <= cache.layers[0].nbytes + (len(cache.layers) - 1) * 2 * limit


def test_capacity_one_is_exact(tiny_models):
    """capacity 1.0 never evicts: the full cache's logits with everything fetched."""
    model = tiny_models["qwen2"]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    ref = step_logits(model, ig.make_cache("full", model), ids, mask)
    got = step_logits(model, ig.make_cache("infinigen", model, capacity=1.0, eviction="lru", **EXACT), ids, mask)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_fifo_keeps_the_newest_window(tiny_models):
    """FIFO at capacity 0.8: each pool holds exactly the newest floor(0.8 x seen) positions, and decoding
    over it (everything it holds fetched) stays finite."""
    model = tiny_models["llama-mha"]
    ids, mask = left_padded_batch(lengths=(40,))
    cache = ig.make_cache("infinigen", model, capacity=0.8, eviction="fifo", **EXACT)
    got = step_logits(model, cache, ids, mask, steps=6)
    assert torch.isfinite(got).all()
    layer = cache.layers[2]
    assert layer.slots.evicted > 0 and layer.k.length == int(0.8 * layer.seen)
    # fifo keeps a contiguous window of the newest positions
    pos = layer.slots.pos.valid()[0, 0, :, 0].sort().values
    assert pos.tolist() == list(range(layer.seen - layer.k.length, layer.seen))


def test_config_and_cli_validate_capacity():
    with pytest.raises(ig.ConfigError, match="capacity"):
        ig.InfiniGenConfig(capacity=1.5)
    with pytest.raises(ig.ConfigError, match="eviction"):
        ig.InfiniGenConfig(eviction="random")
    from infinigen_kv.cli import _capacity

    assert _capacity("0.5") == ("fraction", 0.5) and _capacity("512MiB") == ("bytes", 512 * 2**20)
    assert _capacity("2GB") == ("bytes", 2 * 10**9)


@pytest.mark.parametrize("eviction", ["fifo", "counter"])
def test_victim_fetched_this_step_is_attended_not_the_new_token_twice(tiny_models, eviction):
    """Everything fetched, pool full: the victim is always among the selected rows. The working set must be
    [new token, the rows as they were], never the new token twice."""
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(40, 33))
    cache = ig.make_cache("infinigen", model, capacity=0.7, eviction=eviction, **EXACT)
    sets = []
    layer = cache.layers[2]
    view = layer.view

    def spy(k, v, fetch=None):
        got = view(k, v, fetch)
        if k.shape[2] == 1:
            K, m = got.keys, got.mask  # mask None: every slot is real
            sets.append((K.clone(), torch.ones(K.shape[0], K.shape[1], 1, K.shape[2], dtype=torch.bool) if m is None else m.clone()))
        return got

    layer.view = spy
    step_logits(model, cache, ids, mask, steps=5)
    assert layer.slots.evicted > 0 and len(sets) == 5
    for K, m in sets:
        new, rest = K[:, :, :1], K[:, :, 1:]
        same = (rest - new).abs().amax(-1) < 1e-6  # (B, G, m)
        assert not (same & m[:, :, 0, 1:]).any()


def test_device_map_per_layer_devices(tmp_path):
    """A model dispatched by accelerate with a per-module device map (all CPU here; several GPUs in use):
    the cache keeps each layer's state on that layer's device and stays exact."""
    from conftest import save_tiny

    model_dir = save_tiny(tmp_path / "m")
    n = 4
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": "cpu" for i in range(n)}}
    model, _ = ig.load_model(model_dir, device_map=device_map)
    ids, mask = left_padded_batch(lengths=(40, 31))
    ref = step_logits(model, ig.make_cache("full", model), ids, mask, steps=4)
    cache = ig.make_cache("infinigen", model, **EXACT)
    torch.testing.assert_close(step_logits(model, cache, ids, mask, steps=4), ref, atol=1e-4, rtol=1e-4)
    for i, layer in enumerate(cache.layers):
        assert layer.device == model.layers[i].attn.q_proj.weight.device
        assert layer.transfer is cache.transfers.for_device(layer.device)


@pytest.mark.parametrize("eviction", ["counter", "lru", "fifo"])
def test_prompt_larger_than_the_pool(tiny_models, eviction):
    """A prompt that overflows the pool: fifo keeps its most recent tokens; lru/counter (no fetch statistics
    yet) keep those the prompt's last query scores highest by the layer's own partial keys, the last token
    always among them."""
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(40, 33))
    cache = ig.make_cache("infinigen", model, capacity=0.5, eviction=eviction)
    seen = {}
    for layer in cache.layers[1:]:
        keep = layer.prefill_keep

        def spy(k, n, query, layer=layer, keep=keep):
            seen[layer.layer_idx] = out = keep(k, n, query)
            return out

        layer.prefill_keep = spy
    ig.generate(model, ids, mask, cache=cache, max_new_tokens=1)  # the prompt only
    for layer in cache.layers[1:]:
        assert layer.slots.evicted == 20 and layer.k.length == 20
        first = layer.slots.pos.valid()[..., 0]  # (B, G, 20) positions the 40-token prompt left in the pool
        if eviction == "fifo":
            assert layer.layer_idx not in seen and (first == torch.arange(20, 40)).all()
        else:
            assert (first == seen[layer.layer_idx]).all()
            assert (first[..., -1] == 39).all() and (first.diff(dim=-1) > 0).all()
            assert not (first == torch.arange(20, 40)).all()  # chosen by score, not simply the most recent
            assert (first[1] >= 7).all()  # the second prompt's 7 left-padding positions are never kept
