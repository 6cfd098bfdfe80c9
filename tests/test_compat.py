"""Fails loudly when transformers changes what this package hooks into (see docs/ARCHITECTURE.md)."""

import inspect

import pytest
import torch
import transformers
from packaging.version import Version
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.opt.modeling_opt import OPTAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

import infinigen_kv as ig
from infinigen_kv.model.install import HOOK_KWARGS, NAME
from conftest import left_padded_batch


def test_transformers_in_tested_range():
    v = Version(transformers.__version__)
    assert Version("5.23") <= v < Version("5.24"), f"tested with transformers 5.23.x, found {v}"


@pytest.mark.parametrize("cls", [LlamaAttention, MistralAttention, Qwen2Attention])
def test_rope_attention_forward_keywords(cls):
    params = inspect.signature(cls.forward).parameters
    for name in HOOK_KWARGS:
        assert name in params, f"{cls.__name__}.forward lost the {name!r} keyword the pre-hook reads"


def test_opt_attention_forward_keywords():
    params = inspect.signature(OPTAttention.forward).parameters
    for name in ("hidden_states", "attention_mask", "past_key_values"):
        assert name in params


def test_cache_update_signature_and_layer_api():
    params = list(inspect.signature(Cache.update).parameters)
    assert params[:4] == ["self", "key_states", "value_states", "layer_idx"], params
    abstract = set(CacheLayerMixin.__abstractmethods__)
    assert abstract == {"lazy_initialization", "update", "get_mask_sizes", "get_seq_length", "get_max_length"}, abstract
    assert "get_mask_sizes" in dir(Cache) and "get_seq_length" in dir(Cache)


def test_hook_sees_keywords_at_runtime(tiny_models):
    """The decoder layers call self_attn with keywords: the pre-hook gets them in kwargs, not args."""
    model = tiny_models["llama-gqa"]
    seen = {}

    def grab(module, args, kwargs):
        seen.update({k: v for k, v in kwargs.items()})
        assert args == ()

    h = model.model.layers[1].self_attn.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        model(torch.randint(3, 200, (1, 8)))
    finally:
        h.remove()
    for name in HOOK_KWARGS:
        assert name in seen
    cos, sin = seen["position_embeddings"]
    assert cos.shape == (1, 8, 16)


def test_mask_built_from_logical_length_and_registered_function(tiny_models):
    """Our cache reports the logical length; transformers builds the padding mask through our registered
    mask function (without it, padding would be silently ignored)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(20, 12))
    cache = ig.make_cache("infinigen", model, alpha=1e9, budget=1.0)
    assert model.config._attn_implementation == NAME
    assert NAME in ALL_ATTENTION_FUNCTIONS and NAME in ALL_MASK_ATTENTION_FUNCTIONS
    seen = []
    h = model.model.layers[2].self_attn.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["attention_mask"]), with_kwargs=True)
    try:
        model(ids, attention_mask=mask, past_key_values=cache)
        step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        model(torch.tensor([[5], [6]]), attention_mask=step_mask, past_key_values=cache,
              position_ids=torch.tensor([[20], [12]]))
    finally:
        h.remove()
    assert cache.get_seq_length() == 21
    assert seen[-1].shape == (2, 1, 1, 21) and seen[-1].dtype == torch.bool
    assert not seen[-1][1, 0, 0, :8].any() and seen[-1][1, 0, 0, 8:].all()  # the 8 pad slots are masked
