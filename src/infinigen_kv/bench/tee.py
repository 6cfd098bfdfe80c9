"""One prefill into several caches: `TeeCache([full, infinigen, h2o, ...])` passes the model's K/V (and each
hook call) to every cache in it, so that methods whose prefill attends over the prompt itself (all here but
quant, which attends over its dequantized entries) share one prefill; each then decodes on its own (or
forks, `Rebatch.fork`). This is how `bench accuracy` compares methods on a prompt at the cost of one
prefill."""

from __future__ import annotations

import dataclasses

import torch

from ..methods.base import LogicalLayer
from ..model.kv import KVView, StepCache


class TeeLayer(LogicalLayer):
    """Layer l of every cache: each stores the update; attention gets the first one's answer (the same K/V: every
    cache keeps the whole prompt, in the same storage, while it prefills, chunk after chunk)."""

    def __init__(self, layers: list):
        super().__init__()
        self.children = layers
        self.needs_probs = any(layer.needs_probs for layer in layers)  # H2O scores the prefill

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing of its own: the caches in it make their buffers."""

    @torch.no_grad()
    def view(self, key_states, value_states, fetch=None) -> KVView:
        if self.is_initialized and key_states.shape[2] == 1:
            raise NotImplementedError("a TeeCache serves a prefill (its chunks); decode with each cache in it")
        self.is_initialized = True
        fetches = fetch if fetch is not None else (None,) * len(self.children)  # each cache's own (before_attention)
        views = [layer.view(key_states, value_states, f) for layer, f in zip(self.children, fetches)]
        # keys from the first cache that holds the whole prompt (a window layer of the full cache keeps only its
        # last rows: attention reads the same keys in reach, but H2O scores every column); the weights to each
        # cache that scores them
        view = min(views, key=lambda v: v.offset)
        return dataclasses.replace(view, scores=self if self.needs_probs else None)

    def add_prefill_scores(self, query, key, attention_mask, scaling, backend) -> None:
        """Each scoring cache's column sums, computed once a kind of layer (H2O at three budgets scores the same
        prompt with the same keys and mask: one scoring, not three)."""
        sums = {}
        for layer in self.children:
            if layer.needs_probs:
                kind = type(layer)
                if kind not in sums:
                    sums[kind] = layer.prefill_column_sums(query, key, attention_mask, scaling, backend)
                layer.add_column_sums(sums[kind])

    def get_seq_length(self) -> int:
        return self.children[0].get_seq_length()


class TeeCache(StepCache):
    """`TeeCache(caches)`: a prefill through it lands in every cache of the list (same model; caches of methods
    that declare `shares_prefill`, all made of methods/base.LogicalLayer)."""

    def __init__(self, caches: list):
        self.caches = caches
        super().__init__(layers=[TeeLayer([c.layers[i] for c in caches]) for i in range(len(caches[0].layers))])

    def reserve(self, tokens: int) -> None:
        for c in self.caches:
            c.reserve(tokens)

    def before_attention(self, layer_idx, x, step) -> list:
        """Every cache's; what each starts for a layer goes to that layer as a tuple, one entry per cache."""
        started = [dict(c.before_attention(layer_idx, x, step)) for c in self.caches]
        return [(i, tuple(s.get(i) for s in started)) for i in sorted(set().union(*started))]
