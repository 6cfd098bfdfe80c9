"""`full`: the whole cache on the compute device, preallocated and grown in chunks (no per-step copy of
the cache, unlike transformers' DynamicCache which concatenates every step). Grouped-query attention
runs on the KV heads without repeating them (transformers' sdpa packs the r query heads in decode).
This is the reference every ratio is quoted against."""

from __future__ import annotations

import torch

from ..model.arch import UnsupportedModelError
from ..model.arch import get_arch
from ..config import check_kv_dtype
from ..model.kv import KVView, kv_storage, row_width, to_rows
from .base import LogicalLayer, Rebatch, read_stats
from .rows import RowBuffer


class FullLayer(LogicalLayer):
    def __init__(self, reserved: int = 0, window: int | None = None, kv_dtype: str = "auto"):
        super().__init__()
        self.reserved = reserved  # rows the buffers are made with (FullCache.reserve)
        self.kv_dtype = kv_dtype  # the rows' storage (config.KV_DTYPES)
        self.window = window  # sliding window (None: global): the layer keeps and reads only its last rows
        self.k = self.v = None
        self.bytes_read = 0  # KV bytes read by decode steps
        self.steps = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, G, _, d = key_states.shape
        dtype = kv_storage(self.kv_dtype, key_states.dtype, key_states.device)
        self.k = RowBuffer(B, G, row_width(d, dtype), dtype, key_states.device)
        self.v = RowBuffer(B, G, row_width(value_states.shape[-1], dtype), dtype, value_states.device)
        for buf in (self.k, self.v):
            buf.reserve(self.reserved, room=False)
        self.is_initialized = True

    @torch.no_grad()  # an inference cache: stored K/V never carry gradients
    def view(self, key_states, value_states, fetch=None, at: torch.Tensor | None = None) -> KVView:
        """at (1,) on the device: a static decode step (model/static.py) writes its row at that column and attends
        over the whole buffers, its mask marking what is valid: the same ops on the same buffers every step."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if at is not None:
            self.k.data.index_copy_(2, at, to_rows(key_states, self.k.dtype))  # (B, G, capacity, w) <- (B, G, 1, w)
            self.v.data.index_copy_(2, at, to_rows(value_states, self.v.dtype))
            return KVView(self.k.data, self.v.data)
        first = self.k.length == 0
        k, v = self.slide(key_states, value_states)
        self.k.append(k)
        self.v.append(v)
        if first:  # a prompt attends over itself (a window layer kept only its end)
            return KVView(*self.as_stored(key_states, value_states))
        if key_states.shape[2] == 1:
            self.steps += 1
            n = self.k.length
            rows = n if self.window is None else min(n, self.window)
            self.bytes_read += self.k.valid().numel() // n * rows * self.k.data.element_size() * 2
        # (B, G, n, d) views of the preallocated buffers; on CPU a decode query reads them in place (the kernel)
        return KVView(self.k.valid(), self.v.valid(), offset=self.offset, buffers=(self.k.data, self.v.data))

    def get_seq_length(self) -> int:
        return self.offset + self.k.length if self.is_initialized else 0

    def row_buffers(self) -> list:
        return [self.k, self.v]

    def reset(self) -> None:
        self.offset = 0
        if self.is_initialized:
            self.k.reset()
            self.v.reset()

    @property
    def nbytes(self) -> int:
        return (self.k.nbytes + self.v.nbytes) if self.is_initialized else 0


class FullCache(Rebatch):
    """The efficient full cache. `FullCache(model)`; works with `model.generate(past_key_values=...)`."""

    method = "full"
    static = True  # decodes in static steps (model/static.py): whole buffers, rows written at a device column

    def __init__(self, model=None, kv_dtype: str = "auto", **_):
        check_kv_dtype(kv_dtype)
        self.kv_dtype = kv_dtype
        n = model.config.n_layers if model is not None else 0
        if model is not None:
            try:
                windows = get_arch(model).windows  # the attention function of every method (the CPU kernel in decode)
            except UnsupportedModelError:
                windows = [None] * n  # any other model: transformers' own attention
            super().__init__(layers=[FullLayer(window=w, kv_dtype=kv_dtype) for w in windows])
        else:
            super().__init__(layer_class_to_replicate=FullLayer)

    def reserve(self, tokens: int) -> None:
        """Make the buffers for `tokens` tokens per sequence (prompt + new tokens): no copy inside decode."""
        for layer in self.layers:
            layer.reserved = max(layer.reserved, int(tokens))

    @torch.inference_mode()  # the buffers were made under it (a prefill)
    def static_capacity(self) -> int:
        """Columns every layer's buffers hold (a static step attends over all of them), rows past the valid ones
        zeroed."""
        for layer in self.layers:
            layer.k.zero_past_valid()
            layer.v.zero_past_valid()
        return self.layers[0].k.capacity

    def advanced(self, tokens: int = 1) -> None:
        """Static steps wrote `tokens` rows into every layer at the device column: the host's lengths follow."""
        for layer in self.layers:
            layer.k.length += tokens
            layer.v.length += tokens
            layer.steps += tokens
            k = layer.k
            layer.bytes_read += tokens * k.batch * k.heads * (k.width + layer.v.width) * k.length * k.data.element_size()

    @property
    def stats(self) -> dict:
        return read_stats(self.layers)
