"""The skewed partial query of layer l+1 from layer l's attention input: the speculation's query side.

Three ways, by what the calibration kept: a model without RoPE folds A_P into the weights (`weight`, one
small linear); a RoPE model with raw (unskewed) channels multiplies x by only the q_proj rows of the partial
channels P and their rotate-half partners, then rotates P (the CPU kernel's `partial_query`, or the same in
PyTorch); otherwise the whole query times A_P.
"""

from __future__ import annotations

import hashlib
import weakref

import torch
import torch.nn.functional as F

from ...model import int8_rows, int8_tiles, ops
from ...model.ops import dense, tiled
from .calibration import partial_query_weights


def rope_channels(channels: torch.Tensor, d: int) -> torch.Tensor:
    """The query channels an unskewed RoPE partial query needs: per (layer, KV head) the partial channels P and
    their rotate-half partners (c +- d/2), padded by repeating one: (L, G, c) int64 with c <= 2p."""
    half = d // 2
    need = [[sorted(set(P.tolist()) | {(ch + half) % d for ch in P.tolist()}) for P in layer] for layer in channels]
    c = max(len(s) for layer in need for s in layer)
    return torch.tensor([[s + s[:1] * (c - len(s)) for s in layer] for layer in need], dtype=torch.long)


def _times(q: torch.Tensor, scale: float) -> torch.Tensor:
    return q * scale if scale != 1.0 else q


_GATHERED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # attention module -> its gathered q rows
_FOLDED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # first attention module -> {calibration: folds}


def folded(arch, calibration) -> tuple:
    """A_P folded into this model's own q_proj (partial_query_weights: (L, H p, D), (L, H p)), once per model and
    calibration. Not the calibration's stored fold: that was made from the model it calibrated, which may hold the same
    checkpoint at another precision (the calibration's fingerprint is the same in float32 and bfloat16)."""
    memo = _FOLDED.setdefault(arch.attns[0], {})
    key = hashlib.sha1(b"".join(t.cpu().numpy().tobytes() for t in (calibration.skew, calibration.channels)))
    key = key.hexdigest()
    if key not in memo:
        memo[key] = partial_query_weights(arch, calibration.skew, calibration.channels)
    return memo[key]

class PartialQuery:
    """Layer l+1's skewed partial query (B, G, r, p) from layer l's input x (B, 1, D), for every layer of one
    calibrated model; shared by a cache and its forks (what it memoizes is keyed by identity or device)."""

    def __init__(self, arch, calibration, dtype: torch.dtype):
        self.arch, self.dtype = arch, dtype  # dtype: the model's compute dtype
        self.weight = self.bias = None
        if calibration.pq_weight is not None:  # no RoPE: A_P folded in, per layer on its layer's device
            devs = [a.q_proj.weight.device for a in arch.attns]
            weight, bias = folded(arch, calibration)
            self.weight = [w.to(dv, dtype) for w, dv in zip(weight, devs)]
            self.bias = [b.to(dv, dtype) for b, dv in zip(bias, devs)]
        # RoPE models with raw (unskewed) channels: only the q_proj rows of P and their RoPE partners, per layer
        # (G, c) and P (G, p) (not with a QK-norm: it needs the whole head)
        self.rows = self.channels = None
        if arch.rope and calibration.unskewed and not arch.qk_norm:
            self.rows = list(rope_channels(calibration.channels, arch.head_dim))
            self.channels = [c.contiguous() for c in calibration.channels]
        self._rows_memo = {}  # layer -> its q_proj rows of P and their partners on its device (rows_on)
        self._gathered = {}  # layer -> the kernel's contiguous copy of its q_proj rows (gathered)
        self._bytes = {}  # layer -> weight_bytes
        self._channels_all = None  # (P (L, G, p), rotate-half sign (L, G, p)) on the device (_step_rope_channels)

    def __call__(self, layer: int, x: torch.Tensor, rope, skew_p: torch.Tensor | None, memo: dict, backend,
                 scale: float = 1.0) -> torch.Tensor:
        """Skewed partial query of `layer` from x (B, 1, D), times `scale` (the scores' scale, folded in where the
        path allows: no op of its own): (B, G, r, p); skew_p (G, d, p): the layer's A_P; memo: the step's
        (step.Step.memo), where what every layer of a step shares is made once; backend: the layer's."""
        a = self.arch
        B = x.shape[0]
        kern = backend.ops if x.dtype == torch.float32 and x.is_cpu else None
        if self.weight is not None:  # no RoPE: A_P folded into the partial query weights
            if kern is not None:
                q = kern.linear(x.reshape(B, -1), self.weight[layer], self.bias[layer])
            else:
                q = F.linear(x, self.weight[layer], self.bias[layer])  # (B, 1, H*p)
            return _times(q.view(B, a.num_kv_heads, a.group, -1), scale)
        if self.rows is not None and rope is not None:  # raw channels: only their q_proj rows
            kind = a.rope_types[layer] if a.rope_types is not None else None  # layers of one RoPE share it
            cos, sin = self._step_rope(rope, B, memo, kind)
            if kern is None:
                return self._partial_query_rows(layer, x.reshape(B, -1), cos, sin, memo, kind, scale)
            proj = a.attns[layer].q_proj
            x = x.contiguous()
            return _times(kern.partial_query(x.reshape(B, -1), self.gathered(layer), proj.bias, self.rows[layer],
                                             self.channels[layer], cos, sin, a.group, a.head_dim), scale)
        q = a.query(layer, x, rope, backend).view(B, a.num_kv_heads, a.group, a.head_dim)  # (B, G, r, d)
        return _times(torch.matmul(q, skew_p.unsqueeze(0)), scale)  # (B, G, r, p)

    @staticmethod
    def of_query(q: torch.Tensor, skew_p: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """The skewed partial query of a layer's own query q (B, H, 1, d), RoPE (and OPT's pre-scaling) applied, times
        `scale`: q A_P, (B, G, r, p) (skew_p (G, d, p); for raw channels A_P picks them). One small matmul."""
        B, H, _, d = q.shape
        G = skew_p.shape[0]
        return _times(torch.matmul(q.reshape(B, G, H // G, d).to(skew_p.dtype), skew_p.unsqueeze(0)), scale)

    def _partial_query_rows(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, memo: dict,
                            kind, scale: float) -> torch.Tensor:
        """The CPU kernel's partial_query in PyTorch (a GPU; a CPU without the kernels), times `scale`: x (B, D) times
        only the q_proj rows of the partial channels P and then of their rotate-half partners (a copy of those rows
        made once per layer, on its device: rows_on), then RoPE of P in float32 from cos and the signed sin of every
        layer's P, gathered and scaled once a step (_step_rope_channels): (B, G, r, p). Three ops a layer."""
        W, b = self.rows_on(layer, x.device)
        a = self.arch
        B = x.shape[0]
        y = F.linear(x.to(W.dtype), W, b).float().view(B, a.num_kv_heads, a.group, -1)  # (B, G, r, 2p): [P, partners]
        cos_p, ssin_p = self._step_rope_channels(cos, sin, x.device, memo, kind, scale * a.q_scale)
        p = y.shape[-1] // 2
        return torch.addcmul(y[..., :p] * cos_p[:, layer], y[..., p:], ssin_p[:, layer])

    def weight_bytes(self, layer: int) -> int:
        """Bytes of weight the CPU partial query of `layer` reads a decode step: the folded weights, the q_proj rows of
        its channels as gathered holds them (int4 rows as int8 rows; counted from the shapes: the copy is made on
        the layer's first partial query, not here), or the whole q_proj."""
        if layer not in self._bytes:
            self._bytes[layer] = self._weight_bytes(layer)
        return self._bytes[layer]

    def _weight_bytes(self, layer: int) -> int:
        if self.weight is not None:
            return self.weight[layer].numel() * self.weight[layer].element_size()
        w = self.arch.attns[layer].q_proj.weight
        if self.rows is None:
            return w.numel() * w.element_size()
        row = int8_rows.kv_width(self.arch.hidden_size) if tiled(w) else w.shape[1] * w.element_size()
        return len(self.q_rows(layer)) * row

    def q_rows(self, layer: int) -> torch.Tensor:
        """(H c,) the q_proj rows the partial query of `layer` needs: h d + S[g] for every query head h of group g."""
        S, a = self.rows[layer], self.arch
        G, c = S.shape
        heads = torch.arange(G * a.group).view(G, a.group, 1)
        return (heads * a.head_dim + S.view(G, 1, c)).reshape(-1)

    def gathered(self, layer: int) -> torch.Tensor:
        """The CPU kernel's q_proj rows of `layer` (q_rows) copied once into one contiguous matrix (H c, D) of the
        weight as held (bfloat16 with --dtype bf16-weights; int8 tiles, int5 and int4 as int8 rows): read at the
        bandwidth, where the
        same rows scattered through q_proj ran at about half (docs/BENCHMARKS.md). Kept per attention module
        (_GATHERED), so every cache of the model shares it (12.6 MB for the default model, 5% of its weights)."""
        W = self._gathered.get(layer)
        if W is None:
            attn = self.arch.attns[layer]
            w = attn.q_proj.weight.detach()
            memo = _GATHERED.setdefault(attn, {})
            key = (w.dtype, self.rows[layer].numpy().tobytes())
            if key not in memo:
                if w.dtype == int8_tiles.DTYPE:  # int8 tiles: their rows' bytes as they are
                    rows = int8_tiles.rows_at(w, self.q_rows(layer)).contiguous()
                elif tiled(w):  # int4 or int5 tiles: as int8 rows of their values, which the kernel reads
                    rows = int8_rows.pack_kv(dense(w, torch.float32)[self.q_rows(layer)])
                else:
                    rows = w[self.q_rows(layer)].contiguous()
                memo[key] = rows
            W = self._gathered[layer] = memo[key]
        return W

    def rows_on(self, layer: int, device) -> tuple:
        """(W (H 2p, D), bias or None) of `layer` on `device`: per query head h of group g, the q_proj rows h d + P[g]
        and then h d + (P[g] +- d/2), their rotate-half partners (a channel whose partner is in P too is read twice:
        the linear's output is then the rotation's two operands as they lie, with no gather after it)."""
        memo = self._rows_memo.get(layer)
        if memo is not None and memo[0].device == torch.device(device):
            return memo
        a = self.arch
        P = self.channels[layer]  # (G, p)
        G = P.shape[0]
        both = torch.cat([P, (P + a.head_dim // 2) % a.head_dim], dim=1)  # (G, 2p)
        heads = torch.arange(G * a.group).view(G, a.group, 1)
        rows = (heads * a.head_dim + both.view(G, 1, -1)).reshape(-1)  # (H 2p,)
        proj = a.attns[layer].q_proj
        W = ops.rows(proj.weight.detach(), rows, self.dtype).to(device)  # (bfloat16 or quantized weights: in float32)
        b = proj.bias.detach()[rows.to(proj.bias.device)].to(device, self.dtype) if proj.bias is not None else None
        memo = self._rows_memo[layer] = (W, b)
        return memo

    def channels_on(self, device) -> tuple:
        """(P (L, G, p), its rotate-half sign (L, G, p)) of every layer on `device`: copied there once (at a prefill:
        a copy from the host in a decode step would wait for the device)."""
        if self._channels_all is None or self._channels_all[0].device != torch.device(device):
            P = torch.stack([c for c in self.channels])  # (L, G, p)
            sign = torch.where(P < self.arch.head_dim // 2, -1.0, 1.0)  # rotate-half: -x[c + d/2] below d/2
            self._channels_all = (P.to(device), sign.to(device))
        return self._channels_all

    def _step_rope_channels(self, cos: torch.Tensor, sin: torch.Tensor, device, memo: dict, kind, scale: float):
        """cos and the rotate-half-signed sin (B, L, G, 1, p) at every layer's partial channels P, times `scale`, of a
        decode step's cos, sin (B, d) of RoPE `kind`: gathered once a step for all layers (in the step's memo)."""
        key = ("rope at P", kind, cos.shape[0], torch.device(device), scale)
        if key in memo:
            return memo[key]
        P, sign = self.channels_on(device)
        L, G, p = P.shape
        B = cos.shape[0]
        cos_p = cos.index_select(1, P.view(-1)).view(B, L, G, 1, p)
        ssin_p = (sin.index_select(1, P.view(-1)).view(B, L, G, p) * sign).view(B, L, G, 1, p)
        if scale != 1.0:
            cos_p, ssin_p = cos_p * scale, ssin_p * scale
        memo[key] = cos_p, ssin_p
        return cos_p, ssin_p

    @staticmethod
    def _step_rope(rope, B: int, memo: dict, kind):
        """cos, sin (B, d) float32 of a decode step's position from rope (B or 1, 1, d) of RoPE `kind`: the same for
        every layer of that kind in a step, so converted once (in the step's memo)."""
        key = ("rope", kind, B, rope[0].device)
        if key not in memo:
            memo[key] = tuple(t[:, -1].expand(B, -1).float().contiguous() for t in rope)
        return memo[key]
