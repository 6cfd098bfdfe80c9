"""InfiniGenCache: a transformers Cache whose layers keep every K/V in a host pool and hand attention only
the rows that layer l's speculation chose for layer l+1 (plus the new token).

Per decode step and layer l (l >= 1), in order:
  1. layer l-1's attention pre-hook calls `before_attention(l-1, x)`: the selection strategy
     (selection.py; InfiniGen's speculation by default) scores the partial query of layer l against layer
     l's partial key cache, selects tokens, and their prefetch starts;
  2. layer l's `update(k, v)` fetches the chosen rows, then appends the new token to the pool and the
     partial key cache, and returns the working set [new token, fetched rows] (B, G, m + 1, d);
  3. the registered attention function attends over it with the working-set mask.
Layer 0 has no previous layer and attends over all of its (device-resident) cache.
The cache reports the logical length, so transformers builds masks and positions as usual.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from .adapters import get_arch
from .attention import install
from .calibrate import Calibration, ensure_recall, load_or_calibrate, rope_channels
from .config import ConfigError, InfiniGenConfig
from .layer import LogicalLayer, Rebatch
from .pool import RowBuffer, Slots
from . import kernels
from .selection import Speculate
from .speculate import approx_scores, counted, layer_budgets, layer_scales, relative
from .transfer import Fetch, make_transfer


class InfiniGenLayer(LogicalLayer):
    dense_kernel = True  # a dense decode step (layer 0) attends in place with the CPU kernel (attention.py)

    def __init__(self, cache: "InfiniGenCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        # A dense layer attends over all of its cache, which lives on the device (InfiniGen's layer 0: it has
        # no previous layer to speculate from); every other layer lives in the pool.
        self.dense = cache.selection.dense(cache, layer_idx)
        # A dense layer with a sliding window (Gemma's local layers) keeps only the window (LogicalLayer.slide),
        # not the whole context: on a GPU it stays on the device at the window's size.
        self.window = cache.arch.windows[layer_idx] if self.dense else None
        self.pending = None  # Fetch of this step, set by the previous layer's selection
        self.working = False  # the last update returned a fetched working set (not the whole layer)
        self.work_mask = None  # (B, G, 1, m + 1) mask of that working set; None: attend all of it
        self.selection = None  # (B, G, m) indices of the last fetch (for the recall diagnostic)
        self.fused = None  # (idx, count, new slot) when attention reads the chosen rows in place (CPU kernel)
        self.seen = 0  # tokens seen (the logical length); the pool holds fewer once it has evicted
        self.slots = None  # positions and fetch statistics of the pool's slots, when it has a capacity
        self.max_rows = None  # rows per (sequence, head) a byte-limited pool may hold
        self.new_slot = None  # where the last token went: an int (appended) or (B, G) (overwrote a victim)
        self.prefill_query = None  # (x, rope, keep) of a prompt's last position, when a prefill may overflow
        self.mirror = None  # (k, v) RowBuffers on the device of a prompt being prefilled in chunks (CudaTransfer)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, G, _, d = key_states.shape
        dev, dtype = key_states.device, key_states.dtype
        on_gpu = dev.type == "cuda"
        pool_dev = dev if (self.dense or not on_gpu) else torch.device("cpu")
        pin = pool_dev.type == "cpu" and on_gpu
        c = self.cache.config
        calibrated = self.cache.selection.calibrated and not self.dense  # a dense layer is never scored
        if calibrated and (c.capacity is not None or c.capacity_bytes is not None):
            self.slots = Slots(B, G, dev, c.eviction)
            if c.capacity_bytes is not None:
                row = G * (d + value_states.shape[-1]) * key_states.element_size()  # one token, all KV heads
                self.max_rows = max(1, c.capacity_bytes // row)
        self.k = RowBuffer(B, G, d, dtype, pool_dev, pin=pin, max_rows=self.max_rows)
        self.v = RowBuffer(B, G, value_states.shape[-1], dtype, pool_dev, pin=pin, max_rows=self.max_rows)
        self.skew_p = self.partial = self.key_channels = None
        if calibrated:
            self.skew_p = self.cache.skew_partial[self.layer_idx].to(dev, dtype)  # (G, d, p)
            if self.cache.calibration.unskewed:  # A_P selects raw channels: a gather, not a product
                self.key_channels = self.cache.calibration.channels[self.layer_idx].to(dev)  # (G, p)
            self.partial = RowBuffer(B, G, self.skew_p.shape[-1], self.cache.partial_dtype(dtype, dev), dev,
                                     max_rows=self.max_rows)
            if self.cache.pq_rows is not None and (dev.type != "cpu" or kernels.cpu() is None):
                self.cache._pq_rows_on(self.layer_idx, dev)  # its partial query's q_proj rows, made now, not in decode
        self.device = dev  # this layer's compute device (layers may sit on different GPUs: device_map)
        self.transfer = self.cache.transfer_for(dev)
        reserved = self.cache.reserved
        if reserved:  # the whole run's rows now: no pool grows (or re-pins) inside decode
            rows = self.limit(reserved) or self.rows_for(reserved)
            for buf in (self.k, self.v, self.partial):
                if buf is not None:
                    buf.reserve(rows, room=False)
        self.is_initialized = True
        self.prepare_transfer()

    def prepare_transfer(self) -> None:
        """The transfer's events and staging for this layer's decode steps, sized for the run (cache.reserve) or
        its pool's capacity: made at its prefill, a fork, a join or a retain, not inside decode (CudaTransfer)."""
        if not hasattr(self.transfer, "init_layer"):
            return
        selection, reserved = self.cache.selection, self.cache.reserved
        tokens = reserved if reserved > self.seen else self.k.capacity
        rows = 0 if self.dense else selection.max_fetch(self.cache, self.layer_idx, tokens)
        self.transfer.init_layer(self, self.k.batch, self.k.heads, rows, not selection.whole)

    @torch.no_grad()  # an inference cache: stored K/V never carry gradients
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        transfer = self.transfer
        past, T = self.seen, key_states.shape[2]
        pending, self.pending = self.pending, None
        self.fused = None
        if pending is not None:
            pending = transfer.ready(self, pending)  # the prefetch of this layer is complete
        if self.slots is not None and self.slots.evicted and (pending is None or T > 1):
            raise NotImplementedError("a pool that has evicted entries serves one decode token per step: "
                                      "make a new cache per prompt")
        if pending is None or T > 1:  # prefill, or a dense decode step
            self.store(key_states, value_states)
            self.seen += T
            self.work_mask, self.working = None, False
            if past == 0:
                self.kv_offset = 0
                return key_states, value_states  # prefill: attend over the prompt itself
            self.kv_offset = self.offset
            if T == 1:
                self.cache._count_dense(self.layer_idx)
            return transfer.dense(self)
        # A decode step over the rows chosen one layer ahead: fetch them from the pool as the last step left
        # it, then store the new token (on a full pool it may overwrite one of the chosen: read in place
        # only when it is appended).
        got = transfer.fetch(self, pending, key_states, value_states,
                             in_place=self.cache.selection.in_place and not self.evicts_next())
        self.store(key_states, value_states)
        self.seen += 1
        self.selection, self.working = pending.idx, True
        if got is None:  # the CPU kernel reads [new token, chosen rows] where they lie in the pool
            self.fused, self.work_mask = (pending.idx, pending.count, self.new_slot), None
            return self.k.data, self.v.data
        K, V, self.work_mask = got
        return K, V

    def limit(self, seen: int) -> int | None:
        """Entries the pool may hold per (sequence, KV head) after `seen` tokens (None: no limit)."""
        if self.slots is None:
            return None
        c = self.cache.config
        limits = [self.max_rows] if self.max_rows is not None else []
        if c.capacity is not None:
            limits.append(max(1, int(c.capacity * seen)))
        return min(limits)

    def evicts_next(self) -> bool:
        """Whether one more token makes the pool overwrite an entry."""
        limit = self.limit(self.seen + 1)
        return limit is not None and self.k.length + 1 > limit

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new rows k, v (B, G, T, d) into the pool and their skewed channels into the partial key
        cache; a full pool overwrites the slot its eviction policy names (one per new token), and a
        prefill larger than the pool keeps its most recent tokens."""
        transfer, past, T = self.transfer, self.seen, k.shape[2]
        limit = self.limit(past + T)
        if limit is not None and T == 1 and self.k.length + 1 > limit:
            slot = self.slots.victim()  # (B, G)
            transfer.write(self, k, v, slot)
            self.partial.put(slot, self.partial_keys(k))
            self.slots.replace(slot, past)
            self.new_slot = slot
            return
        k, v = self.slide(k, v)
        pos = None
        if limit is not None and self.k.length + T > limit:  # only a first prefill gets here (see update)
            drop = self.k.length + T - limit
            if self.slots.policy == "fifo" or self.prefill_query is None:
                k, v, past, T = k[:, :, drop:], v[:, :, drop:], past + drop, T - drop  # the most recent
            else:
                pos = self.prefill_keep(k, T - drop)  # (B, G, kept) positions within the prompt, in order
                k, v = (t.gather(2, pos.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1])) for t in (k, v))
                pos, T = pos + past, T - drop
            self.slots.evicted += drop
        self.prefill_query = None
        transfer.write(self, k, v)
        if self.partial is not None:
            self.partial.append(self.partial_keys(k))  # (B, G, T, p)
        if self.slots is not None:
            self.slots.append(past, T, pos)
        self.new_slot = self.k.length - 1

    def partial_keys(self, k: torch.Tensor) -> torch.Tensor:
        """Skewed partial channels k A_P of keys k (B, G, T, d): (B, G, T, p)."""
        if self.key_channels is not None:
            B, G, T, _ = k.shape
            return k.gather(-1, self.key_channels.view(1, G, 1, -1).expand(B, G, T, -1))
        return torch.matmul(k, self.skew_p)

    def prefill_keep(self, k: torch.Tensor, n: int) -> torch.Tensor:
        """The n prompt tokens a pool too small for its prompt keeps under lru/counter, which have no
        fetch statistics yet: those the prompt's last query attends most by the speculation's own partial
        scores (the tokens the first decode steps will fetch; attention sinks among them). k (B, G, T, d)
        -> positions (B, G, n), ascending."""
        x, rope, keep = self.prefill_query
        q = self.cache.partial_query(self.layer_idx, x, rope)  # (B, G, r, p)
        kp = self.partial_keys(k).to(self.partial.dtype)  # as the partial key cache would store them
        scores = approx_scores(q, kp, self.cache.arch.score_scale)  # (B, G, r, T)
        rel = relative(scores, keep, self.cache.config.gqa_combine)  # (B, G, T), padding at -inf
        rel[..., -1] = float("inf")  # the last token is always kept (it is the next step's neighbour)
        return rel.topk(n, dim=-1, sorted=False).indices.sort(dim=-1).values

    def get_seq_length(self) -> int:
        return self.seen if self.is_initialized else 0

    def row_buffers(self) -> list:
        if self.slots is not None:  # slots are not positions once a pool may evict
            raise NotImplementedError("continuous batching needs a pool without a capacity (capacity, capacity_bytes)")
        return [b for b in (self.k, self.v, self.partial) if b is not None]

    def join(self, other, at_self: int, at_other: int, room: int) -> None:
        super().join(other, at_self, at_other, room)
        self.seen += at_self
        self._clear_step()
        self.prepare_transfer()  # staging for the new batch size

    def retain(self, rows, trim: int, room: int) -> None:
        super().retain(rows, trim, room)
        self.seen -= trim
        self._clear_step()
        self.prepare_transfer()

    def _clear_step(self) -> None:
        """Forget the last step's selection and working set (sized for the batch it ran with)."""
        self.pending = self.work_mask = self.selection = self.prefill_query = self.fused = self.mirror = None
        self.working = False

    def reset(self) -> None:
        self.seen = self.offset = self.kv_offset = 0
        if self.slots is not None:
            self.slots.reset()
        if self.is_initialized:
            for buf in (self.k, self.v, self.partial):
                if buf is not None:
                    buf.reset()
        self._clear_step()

    @property
    def nbytes(self) -> int:
        return (self.k.nbytes + self.v.nbytes) if self.is_initialized else 0


def refuse_offloaded_layers(model) -> None:
    """A device_map that leaves layers on "cpu" / "disk" beside GPU ones (accelerate loads their weights only
    when the layer runs) cannot serve speculation, which runs layer l+1's q_proj inside layer l: refused."""
    placed = getattr(model, "hf_device_map", None) or {}
    offloaded = sorted(k for k, v in placed.items() if v in ("cpu", "disk"))
    if offloaded and any(v not in ("cpu", "disk") for v in placed.values()):
        raise ConfigError(f"device_map offloads {', '.join(offloaded[:3])}{' ...' if len(offloaded) > 3 else ''} "
                          "to cpu/disk: InfiniGen computes layer l+1's partial query inside layer l, before "
                          "accelerate would load its weights; give the GPUs every layer (or run all on the CPU)")


def _accumulate(acc: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """acc + x in place (a fresh float64 copy of x the first time): one op, no host sync."""
    return x.to(torch.float64, copy=True) if acc is None else acc.add_(x)


class InfiniGenCache(Rebatch, Cache):
    """`InfiniGenCache(model, config)`: calibrates on first use (or loads the cached calibration) and
    installs the speculation hooks and the attention function on the model (once per model). `selection`
    decides what each decode step fetches (default: InfiniGen's speculation; `FetchAll` for offload)."""

    method = "infinigen"

    def __init__(self, model, config: InfiniGenConfig | None = None, calibration: Calibration | None = None,
                 tokenizer=None, selection=None, **overrides):
        self.config = config or InfiniGenConfig(**overrides)
        self.selection = selection if selection is not None else Speculate()
        self.arch = get_arch(model)
        refuse_offloaded_layers(model)
        if not self.selection.calibrated:
            calibration = None
        elif calibration is None:
            calibration = load_or_calibrate(model, self.config, tokenizer)
        else:
            calibration.check(model, self.config.partial_ratio)
        self.calibration = calibration
        # layer_budget "recall": each speculated layer's share of the budget, from the calibration's recall
        self.budget_scale = None
        if calibration is not None and self.config.layer_budget == "recall":
            self.budget_scale = layer_scales(ensure_recall(model, calibration, self.config, tokenizer))
        self._budgets = layer_budgets(self.config.budget, self.budget_scale)
        self.skew_partial = calibration.skew_partial if calibration is not None else None  # (L, G, d, p)
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.pq_weight = self.pq_bias = None
        if calibration is not None and calibration.pq_weight is not None:  # per layer, on its layer's device
            devs = [a.q_proj.weight.device for a in self.arch.attns]
            self.pq_weight = [w.to(dv, dtype) for w, dv in zip(calibration.pq_weight, devs)]
            self.pq_bias = [b.to(dv, dtype) for b, dv in zip(calibration.pq_bias, devs)]
        # RoPE models with raw (unskewed) channels: the CPU kernel computes the partial query from the q_proj
        # rows of P and their RoPE partners only, per layer (G, c) and P (G, p) (not with a QK-norm: it needs
        # the whole head)
        self.pq_rows = self.pq_channels = None
        self._pq_rows_memo = {}  # layer -> its q_proj rows and channel maps on its device (_pq_rows_on)
        self._channels_all = None  # (P (L, G, p), rotate-half sign (L, G, p)) on the device (_step_rope_channels)
        self._rope_channels_memo = (None, None, None)  # (cos, cos at P, signed sin at P) of the current step
        if calibration is not None and self.arch.rope and calibration.unskewed and not self.arch.qk_norm:
            self.pq_rows = list(rope_channels(calibration.channels, self.arch.head_dim))
            self.pq_channels = [c.contiguous() for c in calibration.channels]
        install(model)
        # a pool with a capacity: a prompt larger than it keeps what its last query would fetch
        self.limited = self.selection.calibrated and (self.config.capacity is not None
                                                      or self.config.capacity_bytes is not None)
        self.reserved = 0  # rows every buffer reserves when it is made (reserve())
        self._rope_memo = (None, None, None)  # (cos tensor, cos, sin) of the current step (_step_rope)
        self._transfers = {}
        self.transfer = self.transfer_for(device)  # the first device's (one per device with device_map)
        L = self.arch.num_layers
        super().__init__(layers=[InfiniGenLayer(self, i) for i in range(L)])
        # Per layer, over decode steps: past entries fetched and fetchable (padding excluded), rows
        # (sequence x KV head) served, steps. What the host knows adds up in integers, what only the
        # device knows in one tensor per layer (one add per layer and step, no host sync in the loop).
        self._fetched = [0] * L
        self._possible = [0] * L
        self._fetched_t = [None] * L
        self._possible_t = [None] * L
        self._keep_total = (None, None)  # (keep, its valid entries over all rows) of the current step
        self._rows = [0] * L
        self._steps = [0] * L
        self._rows_moved = 0  # padded rows gathered (what the transfer actually moves)
        self._kv_bytes = 0  # KV bytes read by decode steps: partial keys + fetched rows + dense layers
        # Diagnostic (off by default, costs a full attention per layer): share of the true attention
        # mass that the fetched entries carry, per layer.
        self.track_recall = False
        self._recall = torch.zeros(L, device=device)
        self._recall_steps = [0] * L

    def reserve(self, tokens: int) -> None:
        """Size every buffer for `tokens` tokens per sequence (prompt + new tokens) when it is made, so that no
        pool grows inside decode (a pinned pool's growth re-allocates and re-pins every layer at one step).
        `ig.generate` calls it before the prefill; beyond it, buffers still grow in chunks."""
        self.reserved = max(self.reserved, int(tokens))

    def budget_of(self, layer: int) -> float:
        """Layer `layer`'s budget: the config's, or its share under layer_budget "recall"."""
        return self.config.budget if self._budgets is None else self._budgets[layer]

    def set_budget(self, budget: float) -> None:
        """A new budget (the cap of each decode step's fetch)."""
        self.config = dataclasses.replace(self.config, budget=budget)
        self._budgets = layer_budgets(budget, self.budget_scale)  # (the step memo keys its caps by budget)

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
        for obj in (self.calibration, self.skew_partial, self.pq_weight, self.pq_bias, self.pq_rows,
                    self.pq_channels, self._pq_rows_memo):
            if obj is not None:
                memo[id(obj)] = obj
        for device, transfer in self._transfers.items():
            memo[id(transfer)] = make_transfer(device)
        return memo

    def partial_dtype(self, dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """Storage of the partial key cache for a model computing in `dtype` on `device` (config.partial_dtype):
        "auto" stores bfloat16 where the CPU kernel scores it (half the bytes, scores still in float32), and
        float32 elsewhere, where the scores are computed in PyTorch in float32 (no conversion per step)."""
        if self.config.partial_dtype == "model":
            return dtype
        if dtype == torch.float32 and device.type == "cpu" and kernels.cpu() is not None:
            return torch.bfloat16
        return torch.float32

    def transfer_for(self, device: torch.device):
        """The transfer engine of a compute device (one side stream per GPU)."""
        device = torch.device(device)
        if device not in self._transfers:
            self._transfers[device] = make_transfer(device)
        return self._transfers[device]

    # --- speculation, called from the pre-hook of layer l's attention ---------------------------------

    def partial_query(self, layer: int, x: torch.Tensor, rope) -> torch.Tensor:
        """Skewed partial query of `layer` from x (B, 1, D): (B, G, r, p)."""
        a = self.arch
        B = x.shape[0]
        kern = kernels.cpu() if x.device.type == "cpu" and x.dtype == torch.float32 else None
        if self.pq_weight is not None:  # no RoPE: A_P folded into the partial query weights
            if kern is not None:
                q = kern.linear(x.reshape(B, -1), self.pq_weight[layer], self.pq_bias[layer])
            else:
                q = F.linear(x, self.pq_weight[layer], self.pq_bias[layer])  # (B, 1, H*p)
            return q.view(B, a.num_kv_heads, a.group, -1)
        if self.pq_rows is not None and rope is not None:  # raw channels: only their q_proj rows
            cos, sin = self._step_rope(rope, B)
            if kern is None:
                return self._partial_query_rows(layer, x.reshape(B, -1), cos, sin)
            proj = a.attns[layer].q_proj
            w16 = getattr(proj, "weight_bf16", None)  # the weight decode steps use (--dtype bf16-weights)
            x = x.contiguous()
            return kern.partial_query(x.reshape(B, -1), w16 if w16 is not None else proj.weight, proj.bias,
                                      self.pq_rows[layer], self.pq_channels[layer], cos, sin, a.group)
        q = a.query(layer, x, rope).view(B, a.num_kv_heads, a.group, a.head_dim)  # (B, G, r, d)
        return torch.matmul(q, self.layers[layer].skew_p.unsqueeze(0))  # (B, G, r, p)

    def _partial_query_rows(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The CPU kernel's partial_query in PyTorch (a GPU; a CPU without the kernels): x (B, D) times only the
        q_proj rows of the partial channels P and their rotate-half partners S (a copy of those rows made once per
        layer, on its device), then RoPE of P in float32, from cos and the signed sin of every layer's P gathered
        once a step (_step_rope_channels): (B, G, r, p). Five small ops a layer (a GPU step is host-bound)."""
        W, b, both = self._pq_rows_on(layer, x.device)
        a = self.arch
        B, (G, p2) = x.shape[0], both.shape
        y = F.linear(x.to(W.dtype), W, b).float().view(B, G, a.group, -1)  # (B, G, r, c)
        if a.q_scale != 1.0:
            y = y * a.q_scale
        y = y.gather(-1, both.view(1, G, 1, p2).expand(B, G, a.group, p2))  # (B, G, r, 2p): [P, partners of P]
        cos_p, ssin_p = self._step_rope_channels(cos, sin, x.device)
        p = p2 // 2
        return torch.addcmul(y[..., :p] * cos_p[:, layer], y[..., p:], ssin_p[:, layer])

    def _pq_rows_on(self, layer: int, device) -> tuple:
        """(W (H c, D), bias or None, both (G, 2p)) of `layer` on `device`: the q_proj rows h d + S[g] of every query
        head h of group g, and where P[g, t] and then its rotate-half partner (t +- d/2) sit in S[g]."""
        memo = self._pq_rows_memo.get(layer)
        if memo is not None and memo[0].device == torch.device(device):
            return memo
        a = self.arch
        S, P = self.pq_rows[layer], self.pq_channels[layer]  # (G, c), (G, p)
        G, c = S.shape
        d, half = a.head_dim, a.head_dim // 2
        heads = torch.arange(G * a.group).view(G, a.group, 1)
        rows = (heads * d + S.view(G, 1, c)).reshape(-1)  # (H c,)
        proj = a.attns[layer].q_proj
        W = proj.weight.detach()[rows.to(proj.weight.device)].to(device)
        b = proj.bias.detach()[rows.to(proj.bias.device)].to(device) if proj.bias is not None else None
        where = [{ch: i for i, ch in enumerate(S[g].tolist())} for g in range(G)]
        both = torch.tensor([[where[g][ch] for ch in P[g].tolist()] + [where[g][(ch + half) % d] for ch in P[g].tolist()]
                             for g in range(G)])
        memo = (W, b, both.to(device))
        self._pq_rows_memo[layer] = memo
        return memo

    def _step_rope_channels(self, cos: torch.Tensor, sin: torch.Tensor, device):
        """cos and the rotate-half-signed sin (B, L, G, 1, p) at every layer's partial channels P, of a decode step's
        cos, sin (B, d): gathered once a step for all layers (memoized on the step's cos tensor)."""
        memo = self._rope_channels_memo
        if memo[0] is cos:
            return memo[1], memo[2]
        if self._channels_all is None or self._channels_all[0].device != torch.device(device):
            P = torch.stack([c for c in self.pq_channels])  # (L, G, p)
            sign = torch.where(P < self.arch.head_dim // 2, -1.0, 1.0)  # rotate-half: -x[c + d/2] below d/2
            self._channels_all = (P.to(device), sign.to(device))
        P, sign = self._channels_all
        L, G, p = P.shape
        B = cos.shape[0]
        cos_p = cos.index_select(1, P.view(-1)).view(B, L, G, 1, p)
        ssin_p = (sin.index_select(1, P.view(-1)).view(B, L, G, p) * sign).view(B, L, G, 1, p)
        self._rope_channels_memo = (cos, cos_p, ssin_p)
        return cos_p, ssin_p

    def _step_rope(self, rope, B: int):
        """cos, sin (B, d) float32 of a decode step's position from rope (B or 1, 1, d): every layer of a
        step shares the tuple, so converted once (the memo holds the tensor, so its identity is safe)."""
        if self._rope_memo[0] is not rope[0] or self._rope_memo[1].shape[0] != B:
            cos, sin = (t[:, -1].expand(B, -1).float().contiguous() for t in rope)
            self._rope_memo = (rope[0], cos, sin)
        return self._rope_memo[1], self._rope_memo[2]

    @torch.no_grad()
    def before_attention(self, layer_idx: int, x: torch.Tensor, rope, attention_mask) -> None:
        """Called from layer l's attention pre-hook with its input x (B, T, D): the selection strategy chooses
        and prefetches what the next layer(s) fetch."""
        self.selection.before_attention(self, layer_idx, x, rope, attention_mask)

    def prefetch(self, target: InfiniGenLayer, fetch: Fetch, keep, partial_row: int) -> None:
        """Account for `fetch` (target's chosen slots; partial_row bytes of partial key per scored slot) and
        start it."""
        idx, real, count = fetch.idx, fetch.real, fetch.count
        B, G, m = idx.shape
        n = target.k.length
        nxt = target.layer_idx
        got = count if count is not None else real.sum(-1) if real is not None else None  # (B, G)
        if got is None:
            self._fetched[nxt] += B * G * m
        else:
            self._fetched_t[nxt] = _accumulate(self._fetched_t[nxt], got)
        if keep is None:
            self._possible[nxt] += B * G * n
        else:
            if self._keep_total[0] is not keep:  # one sum per step: every layer shares the step's mask
                self._keep_total = (keep, keep.sum() * (G // keep.shape[1]))
            self._possible_t[nxt] = _accumulate(self._possible_t[nxt], self._keep_total[1])
        self._rows[nxt] += B * G
        self._steps[nxt] += 1
        self._rows_moved += idx.numel()
        if target.slots is not None:
            target.slots.record(idx, fetch.real_mask())
        row = (target.k.width + target.v.width) * target.k.data.element_size()
        self._kv_bytes += B * G * (n * partial_row + (m + 1) * row)
        target.transfer.prefetch(target, fetch)

    def _count_dense(self, layer_idx: int) -> None:
        """A dense decode step: every past entry it may attend counts as fetched (a local layer's window)."""
        layer = self.layers[layer_idx]
        rows = layer.k.batch * layer.k.heads
        past = layer.seen - 1
        window = self.arch.windows[layer_idx]
        read = min(past, window - 1) if window is not None else past
        self._fetched[layer_idx] += rows * read
        self._possible[layer_idx] += rows * read
        self._rows[layer_idx] += rows
        self._steps[layer_idx] += 1
        self._kv_bytes += rows * (read + 1) * (layer.k.width + layer.v.width) * layer.k.data.element_size()

    def record_recall(self, layer_idx: int, q: torch.Tensor, attention_mask, scaling: float) -> None:
        """True attention of q (B, G, r, d) over the whole pool; add the mass on the fetched rows."""
        layer = self.layers[layer_idx]
        if layer.slots is not None and layer.slots.evicted:
            return  # positions no longer match the slots: the diagnostic measures unevicted pools only
        layer.transfer.flush(layer)
        K = layer.k.valid().to(q.device)  # (B, G, n + 1, d)
        s = torch.matmul(q.float(), K.float().transpose(-1, -2)) * scaling  # (B, G, r, n + 1)
        if attention_mask is not None:
            m = attention_mask[:, :, -1:, :]  # (B, 1, 1, n + 1)
            s = s.masked_fill(~m if m.dtype == torch.bool else m != 0, float("-inf"))
        p = torch.softmax(s, dim=-1)
        sel = layer.work_mask.squeeze(2)[..., 1:] if layer.work_mask is not None else 1.0  # (B, G, m) real slots
        if layer.fused is not None and layer.fused[1] is not None:
            sel = counted(layer.fused[1], layer.selection.shape[-1]).to(p.dtype)
        got = torch.gather(p, 3, layer.selection.unsqueeze(2).expand(-1, -1, p.shape[2], -1))  # (B, G, r, m)
        mass = (got * sel.unsqueeze(2)).sum(-1) + p[..., -1]  # + the new token, always attended
        self._recall[layer_idx] += mass.mean().to(self._recall.device)
        self._recall_steps[layer_idx] += 1

    # --- reporting -------------------------------------------------------------------------------------

    @property
    def stats(self) -> dict:
        """fetched fraction per layer and overall (share of the past entries fetched over the decode
        steps; the overall figure is the mean over layers), fetched tokens per (sequence, KV head) and
        step, bytes moved from the pool."""
        fetched = [n + (float(t.sum()) if t is not None else 0) for n, t in zip(self._fetched, self._fetched_t)]
        possible = [n + (float(t) if t is not None else 0) for n, t in zip(self._possible, self._possible_t)]
        frac = [f / p if p else 0.0 for f, p in zip(fetched, possible)]
        tokens = [f / r if r else 0.0 for f, r in zip(fetched, self._rows)]
        active = [i for i, s in enumerate(self._steps) if s > 0]
        layer = self.layers[0]
        row_bytes = 0
        if layer.is_initialized:
            row_bytes = (layer.k.width + layer.v.width) * layer.k.data.element_size()
        return {
            "fetched_fraction": sum(frac[i] for i in active) / len(active) if active else 0.0,
            "fetched_fraction_per_layer": frac,
            "tokens_per_step": tokens,
            "bytes_moved": self._bytes_moved(row_bytes),
            "decode_steps": max(self._steps) if self._steps else 0,
            "kv_bytes_per_step": self._kv_bytes // max(max(self._steps), 1),
            "pool_bytes": sum(l.nbytes for l in self.layers),
            **({"recall_per_layer": [r / max(n, 1) for r, n in zip(self._recall.cpu().tolist(), self._recall_steps)]}
               if self.track_recall else {}),
        }

    def _bytes_moved(self, row_bytes: int) -> int:
        """Bytes the decode fetches moved from the pool: what the CUDA transfers copied to the device (they trim
        each fetch to its real rows), else the rows gathered."""
        moved = [t.bytes_moved for t in self._transfers.values() if hasattr(t, "bytes_moved")]
        return sum(moved) if moved else self._rows_moved * row_bytes

    def settle(self) -> None:
        for layer in self.layers:
            if layer.is_initialized:
                layer.transfer.flush(layer)

    def rebatched(self) -> None:
        """Per-row accumulators fold into the host counters (a sync, between steps), memos start over."""
        for counts, tensors in ((self._fetched, self._fetched_t), (self._possible, self._possible_t)):
            for i, t in enumerate(tensors):
                if t is not None:
                    counts[i] += float(t.sum())
                    tensors[i] = None
        self._keep_total = (None, None)
        self._rope_memo = (None, None, None)
        self._rope_channels_memo = (None, None, None)
        self.selection.reset()

    def reset(self):
        for transfer in self._transfers.values():
            transfer.reset()  # nothing in flight touches a pool from here on
        super().reset()
        self._fetched = [0] * len(self.layers)
        self._possible = [0] * len(self.layers)
        self._fetched_t = [None] * len(self.layers)
        self._possible_t = [None] * len(self.layers)
        self._keep_total = (None, None)
        self._rope_memo = (None, None, None)
        self._rope_channels_memo = (None, None, None)
        self._rows = [0] * len(self.layers)
        self._steps = [0] * len(self.layers)
        self._rows_moved = 0
        self.selection.reset()
