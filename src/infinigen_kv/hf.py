"""Our caches for a transformers model's own `generate()` (the `[hf]` extra): the drop-in way in for code that already
holds a transformers model.

    cache = ig.hf.cache("infinigen", hf_model, budget=0.1)
    out = hf_model.generate(**enc, past_key_values=cache, max_new_tokens=64)

The first call makes our model of `hf_model` (model/weights.from_hf) and points the transformers model's weights at
ours (q/k/v and gate/up become views of our merged matrices; every other weight is one tensor of both): the weights
stay one copy. It also gives the transformers model a forward of its own that runs ours whenever the cache passed is
one of ours (speculation runs inside our layer loop; transformers' attention cannot host it) and transformers' own
forward otherwise. Everything else of `generate` (its sampling, stopping, streamers) is transformers'.
"""

from __future__ import annotations

import weakref

import torch

from .methods.registry import make_cache
from .model.kv import StepCache
from .model.weights import from_hf, target

_OURS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # transformers model -> our model of it


def cache(name: str, hf_model, **options):
    """A fresh cache of method `name` for `hf_model` (a transformers *ForCausalLM of a supported architecture),
    to pass to its generate() as past_key_values."""
    c = make_cache(name, ours(hf_model), **options)
    c.__class__ = _answering(type(c))
    return c


class TransformersFacts:
    """What transformers' generate() asks of a cache passed to it (across its 5.x releases): not compilable, not
    croppable (no assisted decoding), no linear-attention layers."""

    is_compileable = False
    is_croppable = False

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_sliding(self) -> list[bool]:
        return [getattr(layer, "window", None) is not None for layer in self.layers]

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


_CLASSES: dict = {}


def _answering(cls) -> type:
    """cls with TransformersFacts (one subclass per cache class)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls, TransformersFacts), {"__module__": cls.__module__})
    return _CLASSES[cls]


def ours(hf_model):
    """Our model of `hf_model`, made once, sharing its weights; the transformers model's forward runs it with our
    caches."""
    model = _OURS.get(hf_model)
    if model is None:
        model = _OURS[hf_model] = from_hf(hf_model)
        _share(hf_model, model)
        _route(hf_model, model)
    return model


@torch.no_grad()
def _share(hf_model, model) -> None:
    """Each transformers weight made a view of ours (its rows of a merged matrix, or the same tensor)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, p in hf_model.named_parameters():
        where = target(model.args, name)
        if where is None or where[0] not in params:
            continue
        mine, start = params[where[0]], where[1]
        view = mine[start : start + p.shape[0]] if p.dim() and mine.shape != p.shape else mine
        if view.shape == p.shape and view.dtype == p.dtype:
            p.data = view


def _route(hf_model, model) -> None:
    """hf_model.forward: ours where past_key_values is one of our caches (positions from the mask where transformers
    passes none), transformers' own otherwise. Its signature names what generate() looks for (position_ids,
    logits_to_keep), so generate passes them."""
    from dataclasses import fields

    from transformers.modeling_outputs import CausalLMOutputWithPast

    own = hf_model.forward
    # the cache's name in transformers' calls and outputs: "past_key_values", "cache" from 5.24 on
    name = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"

    def forward(input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        cache = past_key_values if past_key_values is not None else kwargs.get("cache")
        if not isinstance(cache, StepCache) or input_ids is None:
            if past_key_values is not None:
                kwargs["past_key_values"] = past_key_values
            return own(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       inputs_embeds=inputs_embeds, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        T = input_ids.shape[1]
        if attention_mask is not None and attention_mask.dim() == 4:  # a mask generate() built: its last query's
            row = attention_mask[:, 0, -1]  # row is the padding (B, S)
            attention_mask = (row if row.dtype == torch.bool else row == 0).long()
        if position_ids is None and attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=cache, logits_to_keep=logits_to_keep).logits
        return CausalLMOutputWithPast(logits=logits, **{name: cache})

    hf_model.forward = forward
