"""InfiniGenCache: a transformers Cache whose layers keep every K/V in a host pool and hand attention only
the rows that layer l's speculation chose for layer l+1 (plus the new token).

One decode step, layer l (l >= 1), file by file:
  1. model/attention.py: layer l's attention block calls `before_attention(l, x)` here;
  2. the selection (speculator.py: `Speculate.choose`; offload: `FetchAll`) returns layer l+1's fetch, from
     the partial query (partial.py) scored against layer l+1's partial key cache;
  3. `prefetch` counts it (stats.py) and starts it (transfer.py on CPU, cuda_transfer.py on a GPU);
  4. layer l+1's `view(k, v, fetch)` (layer.py: PoolLayer) fetches the chosen rows, stores the new token in the pool (rows.py;
     pool.py when it has a capacity) and returns the working set [new token, fetched rows] as a KVView
     (model/kv.py: the rows and their mask, or the chosen slots read in place);
  5. model/attention.py attends over that view, passed to it as an argument.
With speculate_from "own", step 2 happens at layer l+1's own query instead (`after_query`, from its attention
block, before its view; the query's skewed channels are the partial query). Layer 0 has no previous layer and
attends over all of its (device-resident) cache. The cache reports the logical length, so transformers builds masks
and positions as usual.
"""

from __future__ import annotations

import dataclasses

import torch

from ...config import InfiniGenConfig, speculation_source
from ...model.arch import get_arch
from ...model.transformer import compute_dtype
from ..base import Rebatch
from ...runtime.prefix_tiers import digest
from ..keep import valid_keys
from .calibration import Calibration
from .cuda_transfer import CudaTransfer
from .contracts import Selection, Transfer
from .evicting_pool import EvictingPoolLayer
from .fetch import Fetch, PrefillQuery
from .layer import DeviceLayer, LayerConfig, PoolLayer, partial_dtype
from .offline import ensure_recall, load_or_calibrate
from .partial import PartialQuery
from .speculator import Speculate, layer_budgets, layer_scales
from .stats import Counters
from .transfer import DirectTransfer


def make_transfer(device: torch.device, backend) -> Transfer:
    """The transfer engine of a compute device: direct on CPU, a side stream and pinned staging on a GPU (the chosen
    rows gathered through a device view of the pinned pool, or by a host worker where the backend's cuda_fetch says
    "worker")."""
    if torch.device(device).type != "cuda":
        return DirectTransfer()
    return CudaTransfer(device, uva=False if backend.cuda_fetch == "worker" else None)


class Transfers:
    """The transfer engine of each compute device (one side stream per GPU), made when first asked."""

    def __init__(self, backend):
        self.backend = backend
        self.by_device: dict[torch.device, Transfer] = {}

    def for_device(self, device) -> Transfer:
        device = torch.device(device)
        if device not in self.by_device:
            self.by_device[device] = make_transfer(device, self.backend)
        return self.by_device[device]


def step_weight_bytes(model) -> int:
    """Bytes of the parameters a decode step reads, as held, each once (tied embeddings as the LM head); an untied
    embedding, of which a step reads one row a token, left out."""
    params = {p.data_ptr(): p for p in model.parameters()}
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    if isinstance(embed, torch.Tensor) and embed is not head:
        params.pop(embed.data_ptr(), None)
    return sum(p.numel() * p.element_size() for p in params.values())


class InfiniGenCache(Rebatch):
    """`InfiniGenCache(model, config)`: calibrates on first use (or loads the cached calibration) and
    installs the speculation hooks and the attention function on the model (once per model). `selection`
    decides what each decode step fetches (default: InfiniGen's speculation; `FetchAll` for offload)."""

    method = "infinigen"

    def __init__(self, model, config: InfiniGenConfig | None = None, calibration: Calibration | None = None,
                 tokenizer=None, selection=None, **overrides):
        self.config = config or InfiniGenConfig(**overrides)
        self.kv_dtype = self.config.kv_dtype
        self.selection: Selection = selection if selection is not None else Speculate()
        self.arch = get_arch(model)
        if not self.selection.calibrated:
            calibration = None
        elif calibration is None:
            calibration = load_or_calibrate(model, self.config, tokenizer, type(self))
        else:
            calibration.check(model, self.config.partial_ratio)
        self.calibration = calibration
        # layer_budget "recall": each speculated layer's share of the budget, from the calibration's recall
        self.budget_scale = None
        if calibration is not None and self.config.layer_budget == "recall":
            self.budget_scale = layer_scales(ensure_recall(model, calibration, self.config, tokenizer, type(self)))
        self._budgets = layer_budgets(self.config.budget, self.budget_scale)
        self.skew_partial = calibration.skew_partial if calibration is not None else None  # (L, G, d, p)
        device, dtype = next(model.parameters()).device, compute_dtype(model)
        self.backend = model.backend  # what runs its layers' operations (model/backend.py)
        self._compute = (dtype, device, self.backend)  # the first layer's: the partial key cache's storage follows
        self.speculate_from = speculation_source(self.config.speculate_from, device.type)  # "previous" or "own"
        self.pq = PartialQuery(self.arch, calibration, dtype) if calibration is not None else None
        # a pool with a capacity: a prompt larger than it keeps what its last query would fetch
        self.limited = self.selection.calibrated and (self.config.capacity is not None
                                                      or self.config.capacity_bytes is not None)
        self.weight_bytes = step_weight_bytes(model)  # what a decode step reads besides the K/V (_attends_densely)
        self.transfers = Transfers(self.backend)
        self.transfer = self.transfers.for_device(device)  # the first device's (one per device with device_map)
        L = self.arch.num_layers
        self.counters = Counters(L, device)
        super().__init__(layers=[self._layer(i) for i in range(L)])
        # Diagnostic (off by default, costs a full attention per layer): share of the true attention
        # mass that the fetched entries carry, per layer.
        self.track_recall = False

    def _layer(self, i: int) -> DeviceLayer:
        """Layer i by its storage: on the device (the selection attends it whole), in the pool, or in a pool with a
        capacity."""
        cal, s = self.calibration, self.selection
        spec = LayerConfig(i, self.config, self.transfers, self.counters, self.arch.windows[i], self.backend,
                           whole=s.whole,
                           in_place=s.in_place, pq=self.pq, score_scale=self.arch.score_scale,
                           skew_p=self.skew_partial[i] if cal is not None else None,
                           key_channels=cal.channels[i] if cal is not None and cal.unskewed else None)
        kind = DeviceLayer if s.dense(self, i) else EvictingPoolLayer if self.limited else PoolLayer
        return kind(spec, self.budget_of(i))

    def reserve(self, tokens: int) -> None:
        """Size every buffer for `tokens` tokens per sequence (prompt + new tokens) when it is made, so that no
        pool grows inside decode (a pinned pool's growth re-allocates and re-pins every layer at one step).
        `ig.generate` calls it before the prefill; beyond it, buffers still grow in chunks."""
        for layer in self.layers:
            layer.reserved = max(layer.reserved, int(tokens))

    def budget_of(self, layer: int) -> float:
        """Layer `layer`'s budget: the config's, or its share under layer_budget "recall"."""
        return self.config.budget if self._budgets is None else self._budgets[layer]

    def set_budget(self, budget: float) -> None:
        """A new budget (the cap of each decode step's fetch)."""
        self.config = dataclasses.replace(self.config, budget=budget)
        self.counters.fold()  # a static step's per-slot accumulators are sized by the old cap
        self._budgets = layer_budgets(budget, self.budget_scale)  # (the step memo keys its caps by budget)
        for i, layer in enumerate(self.layers):
            layer.budget = self.budget_of(i)

    def fork(self, budget: float | None = None):
        twin = super().fork(budget)
        for layer in twin.layers:  # its own transfer engines: their events and staging, made now
            if layer.is_initialized:
                layer.prepare_transfer()
        return twin

    def shared(self) -> dict:
        """A fork shares the model's modules, the calibration and what is derived from it; it gets transfer
        engines of its own (a CUDA one owns its stream, events and staging buffers)."""
        memo = super().shared()
        for obj in (self.calibration, self.skew_partial, self.pq):
            if obj is not None:
                memo[id(obj)] = obj
        for device, transfer in self.transfers.by_device.items():
            memo[id(transfer)] = make_transfer(device, self.backend)
        return memo

    def prefix_facts(self, model) -> dict | None:
        """The partial key cache's storage and the calibration it was skewed with (a stored block holds its rows)."""
        if self.limited:
            return None
        if self.calibration is None:
            return self.kv_facts(model)
        return {"partial_dtype": str(partial_dtype(self.config.partial_dtype, *self._compute)),
                "calibration": digest({"skew": self.skew_partial.contiguous()}), **self.kv_facts(model)}

    # --- one decode step: speculation at layer l's attention pre-hook, then the fetch it starts -------------

    def partial_query(self, layer: int, x: torch.Tensor, rope, memo: dict, scale: float = 1.0) -> torch.Tensor:
        """Skewed partial query of `layer` from x (B, 1, D), times scale: (B, G, r, p) (partial.py)."""
        target = self.layers[layer]
        return self.pq(layer, x, rope, target.skew_p, memo, target.backend, scale)

    @torch.no_grad()
    def before_attention(self, layer_idx: int, x: torch.Tensor, step) -> list:
        """Called by layer l's attention block with its input x (B, T, D): a decode step's selection chooses what
        the next layer(s) fetch, and their prefetch starts; returns them, (layer, Fetch) each, for those layers'
        views. A prefill into a pool with a capacity notes its last query (a prompt larger than the pool keeps
        what that query would fetch: EvictingPoolLayer.prefill_keep), handed to the layer's view."""
        if x.shape[1] != 1:
            rope, attention_mask = step.rope(layer_idx), step.layer_mask(layer_idx)
            if self.limited and not self.layers[layer_idx].dense:
                last = tuple(t[:, -1:] for t in rope) if rope is not None else None
                keep = valid_keys(attention_mask, x.shape[1])  # the layer's own mask: its last query's keys
                query = PrefillQuery(x[:, -1:], last, None if keep is None else keep.unsqueeze(1))
                return [(layer_idx, query)]
            return []
        started = []
        for nxt, fetch in self.selection.choose(self, layer_idx, x, step):
            self.prefetch(self.layers[nxt], fetch)  # started before the next one is scored
            started.append((nxt, fetch))
        return started

    @torch.no_grad()
    def after_query(self, layer_idx: int, q: torch.Tensor, step) -> Fetch | None:
        """Called by layer l with its decode query q (B, H, 1, d), RoPE applied: a selection that chooses a layer's
        rows at its own query (speculate_from "own") does it here; the fetch starts, and is returned for the layer's
        view (None where nothing was chosen here)."""
        fetch = self.selection.choose_at_query(self, layer_idx, q, step)
        if fetch is not None:
            self.prefetch(self.layers[layer_idx], fetch)
        return fetch

    def prefetch(self, target: PoolLayer, fetch: Fetch) -> None:
        """Count `fetch` (target's chosen slots) and start it; target's view is handed it."""
        self.counters.count_fetch(target, fetch)
        if target.slots is not None:
            target.slots.record(fetch.idx, fetch.real_mask())
        target.transfer.prefetch(target, fetch)

    def record_recall(self, layer_idx: int, q: torch.Tensor, view, attention_mask, scaling: float) -> None:
        """The recall diagnostic (track_recall): the true attention mass of q (B, G, r, d) on the rows of the step's
        working set (view, model/kv.py)."""
        self.counters.record_recall(self.layers[layer_idx], q, view, attention_mask, scaling)

    # --- reporting and batch changes ------------------------------------------------------------------------

    @property
    def stats(self) -> dict:
        """fetched fraction per layer and overall, fetched tokens per (sequence, KV head) and step, bytes moved
        from the pool, KV bytes read per step, pool bytes (stats.py)."""
        return self.counters.report(self.layers, list(self.transfers.by_device.values()), self.track_recall)

    def settle(self) -> None:
        for layer in self.layers:
            if layer.is_initialized:
                layer.transfer.flush(layer)

    def rebatched(self) -> None:
        """Per-row accumulators fold into the host counters (a sync, between steps), memos start over."""
        self.counters.fold()
        self.selection.reset()

    # --- static steps (model/static.py) -------------------------------------------------------------------

    @property
    def static(self) -> bool:
        """Static steps serve the selection where it declares them, on transfers that serve them (the direct one;
        the CUDA one gathering through the pool's view), in a pool without a capacity, without the recall
        diagnostic (its true attention reads the valid rows: a shape that follows the past)."""
        return (self.selection.static and not self.limited and not self.track_recall
                and all(t.static for t in self.transfers.by_device.values()))

    @torch.inference_mode()  # the buffers were made under it (a prefill)
    def static_capacity(self) -> int:
        """Columns a static step spans (what is attended or scored whole: a dense layer's K/V, a pool layer's
        partial keys, or with a whole-past selection its pool up to the tokens reserved: a pinned pool rounds its
        capacity up), rows past the valid ones zeroed."""
        capacity = self.static_columns()
        for layer in self.layers:
            layer.mirror = None  # a chunked prompt's device copy goes before a capture: decoding reads the pool
            for buf in layer.buffers():
                buf.zero_past_valid()
        return capacity

    def static_columns(self) -> int:
        """A static step's columns (static_capacity), the same for every layer."""
        whole = {layer.k.capacity if layer.dense else min(layer.k.capacity, layer.reserved or layer.k.capacity)
                 if self.selection.whole else layer.partial.capacity for layer in self.layers}
        if len(whole) != 1 or any(b.capacity < min(whole) for layer in self.layers for b in layer.buffers()):
            raise ValueError(f"layers of different capacities {sorted(whole)}: reserve the run's tokens first")
        return whole.pop()

    def bookkeeping(self):
        return self.counters.snapshot(), {d: t.bytes_moved for d, t in self.transfers.by_device.items()}

    @torch.inference_mode()  # the accumulators were made under it (decode steps)
    def restore_bookkeeping(self, state) -> None:
        self.counters.restore(state[0])
        for d, moved in state[1].items():
            self.transfers.by_device[d].bytes_moved = moved

    def replayed(self, before, after) -> None:
        self.counters.add_host(before[0], after[0])
        for d, t in self.transfers.by_device.items():
            if t.bytes_moved is not None:
                t.bytes_moved += after[1][d] - before[1][d]

    def advanced(self, tokens: int = 1) -> None:
        """Static steps wrote `tokens` rows into every layer at the device column: the host's lengths follow."""
        for layer in self.layers:
            layer.seen += tokens
            for buf in layer.buffers():
                buf.length += tokens
            if layer.dense:  # attended whole: its read counted as the eager step counts it
                self.counters.count_dense(layer, layer.spec.window)

    def reset(self):
        for transfer in self.transfers.by_device.values():
            transfer.reset()  # nothing in flight touches a pool from here on
        super().reset()
        self.counters.reset()
        self.selection.reset()
