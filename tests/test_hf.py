"""The [hf] adapter: a transformers model's own generate() with our caches (infinigen_kv.hf), its weights one copy."""

import pytest
import torch

from conftest import left_padded_batch, tiny_hf

transformers = pytest.importorskip("transformers")
from infinigen_kv import hf as adapter  # noqa: E402

EXACT = dict(alpha=1e9, budget=1.0)


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2", "gemma3", "opt"])
def test_generate_greedy_equals_transformers_own_cache(kind):
    """Greedy tokens of generate() through our full cache and through InfiniGen at budget 1.0 equal transformers'
    own (DynamicCache) for a left-padded batch."""
    model = tiny_hf(kind)
    ids, mask = left_padded_batch(lengths=(40, 33, 21))
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, **kw)
    full = model.generate(ids, past_key_values=adapter.cache("full", model, kv_dtype="float32"), **kw)
    got = model.generate(ids, past_key_values=adapter.cache("infinigen", model, kv_dtype="float32", **EXACT), **kw)
    assert torch.equal(full, ref) and torch.equal(got, ref)


def test_sampling_is_identical_across_our_caches():
    """transformers' own sampling loop, same seed: identical samples through full and exact InfiniGen."""
    model = tiny_hf("qwen2")
    ids, mask = left_padded_batch(lengths=(40, 33, 20))
    outs = []
    for method in ("full", "infinigen"):
        torch.manual_seed(11)
        cache = adapter.cache(method, model, **(EXACT if method == "infinigen" else {}))
        outs.append(model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=10,
                                   do_sample=True, top_p=0.9, pad_token_id=0))
    assert torch.equal(outs[0], outs[1])


def test_the_weights_stay_one_copy_and_its_own_cache_still_works():
    model = tiny_hf("llama-gqa")
    ours = adapter.ours(model)
    a, q = ours.layers[1].attn, model.model.layers[1].self_attn
    assert q.k_proj.weight.data_ptr() == a.wqkv.weight[a.n_heads * a.head_dim :].data_ptr()
    assert model.model.layers[1].mlp.down_proj.weight.data_ptr() == ours.layers[1].mlp.w2.weight.data_ptr()
    assert adapter.ours(model) is ours  # made once
    ids = torch.randint(3, 200, (1, 9))
    torch.testing.assert_close(model(ids).logits[:, -1], ours(ids, use_cache=False).logits[:, -1])
