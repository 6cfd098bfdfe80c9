"""`shadowkv`: ShadowKV (Sun et al., 2024). The prompt's keys before RoPE, all KV heads of a layer side by side
(n, G d), are held at rank `rank` from their SVD (a sequence's coefficients (n, r) and basis (r, G d)); the prompt
is cut into chunks of `chunk` tokens, each with a landmark (the mean of its keys after RoPE); the chunks whose keys
stray most from their landmark (lowest cosine similarity) are outliers, kept exact, as are the prompt's last
`local` tokens and every decoded token. At a decode step a layer's own query scores the landmarks (softmax per
query head, the group's heads combined by their maximum), and the step attends over the top chunks, whose keys are
rebuilt from the low-rank factors and rotated at their positions, and whose values are read from the pool, beside
the exact rows.

Built on InfiniGen's pool and transfers (methods/infinigen/) as quest is: `ShadowKVSelect` chooses at each layer's
own query. Everything a step attends counts in the budget: the cap of a (sequence, KV head) holds the local and
decoded rows, `outliers` of it in outlier chunks (the paper's 384 outlier rows of 2,464 attended at 128k), the rest
in chosen chunks. The factors, landmarks and outliers are made from the pool's rows at a layer's first decode step
after a prompt (its K/V as the prefill stored them); again when a batch changes, and when the exact rows past them
(decoded tokens, a later prompt) pass half the cap. Where `rank` is at least G d the keys are their own factors:
the chosen rows are read where they lie in the pool (the same keys). Exact at budget 1.0: a cap that leaves nothing
out attends the whole past, as full does.

Shapes: B sequences, G KV heads, r query heads each (q_per), d head size, n past tokens, n0 the prompt's, C chunks,
k chosen rows, R the rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import DEFAULT_BUDGET, DEFAULT_MIN_BUDGET, InfiniGenConfig
from ..model.kv import from_rows
from ..model.rope import apply_rope, inv_freq
from .at_query import AtQuery
from .infinigen.cache import InfiniGenCache
from .infinigen.fetch import Fetch

OUTLIERS = 384 / (2048 + 384 + 32)  # the paper's outlier rows among those a step attends (Llama-3-8B at 128k)


@dataclass
class Shadow:
    """A layer's prompt as ShadowKV holds it: rows [0, n0) of the pool, chunks [0, C) of them selectable."""

    n0: int  # the prompt's rows
    C: int  # its chunks, before the local tail [C chunk, n0)
    landmarks: torch.Tensor  # (B, G, C, d) float32
    selectable: torch.Tensor  # (B, G, C) bool: real chunks that are not outliers
    outlier_rows: torch.Tensor  # (B, G, O chunk) int64
    outlier_real: torch.Tensor  # (B, G, O chunk) bool
    positions: torch.Tensor  # (B, n0) int64: each row's RoPE position
    coef: torch.Tensor | None  # (B, n0, R): the rows' low-rank coefficients (None: keys kept exact)
    basis: torch.Tensor | None  # (B, G, R, d)


def row_positions(keep: torch.Tensor | None, new_position: torch.Tensor, n: int) -> torch.Tensor:
    """(B, n) RoPE positions of the past's n rows, whose valid ones (keep (B, n), None: all) precede the new
    token's position (B,) one after another."""
    if keep is None:
        return new_position.view(-1, 1) - n + torch.arange(n, device=new_position.device)
    after = keep.flip(-1).cumsum(-1).flip(-1)  # valid rows at or after each
    return (new_position.view(-1, 1) - after).clamp_(min=0)


def rope_at(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (..., d) float32 of positions (...) for frequencies (d/2,) (rotate-half layout)."""
    f = positions.unsqueeze(-1).float() * freqs
    emb = torch.cat((f, f), dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., d) rotated by the angles of (cos, sin) (..., d) (rotate-half layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def low_rank(flat: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """flat (B, n, D) float32 -> coefficients (B, n, R), basis (B, R, D): flat's projection on its top R right
    singular vectors (the truncated SVD's U S and V^T), from the eigenvectors of the D x D Gram matrix."""
    gram = flat.transpose(1, 2) @ flat  # (B, D, D)
    _, vecs = torch.linalg.eigh(gram.double())  # ascending
    v = vecs[..., -rank:].flip(-1).to(flat.dtype)  # (B, D, R)
    return flat @ v, v.transpose(1, 2)


class ShadowKVSelect(AtQuery):
    def __init__(self, model, chunk: int = 8, rank: int = 160, local: int = 32, outliers: float = OUTLIERS,
                 dense_layers: int = 0):
        if chunk < 1 or rank < 1 or local < 0 or not 0 <= outliers < 1 or dense_layers < 0:
            raise ValueError(f"shadowkv: chunk >= 1, rank >= 1, local >= 0, 0 <= outliers < 1 and dense_layers "
                             f">= 0, got {chunk}, {rank}, {local}, {outliers}, {dense_layers}")
        a = model.args
        self.chunk, self.rank, self.local, self.outliers, self.dense_layers = chunk, rank, local, outliers, dense_layers
        # below the keys' width (G d) the chosen keys are rebuilt into a working set of the step's own; at or
        # above it the factors are the keys: the chosen rows are read where they lie (the CPU kernel), as quest's
        self.rebuilds = rank < a.n_kv_heads * a.head_dim
        self.in_place = not self.rebuilds
        self.freqs = {key: inv_freq(rope, a.head_dim) for key, rope in a.ropes}  # RoPE key -> (d/2,) float32
        self.rope_types = tuple(a.rope_types)
        self.shadows: dict = {}  # layer -> Shadow

    def reset(self) -> None:
        self.shadows = {}  # (rows moved between sequences: made again from the pool)

    def choose_at_query(self, cache, layer_idx: int, q: torch.Tensor, step) -> Fetch | None:
        """Layer l's rows for its decode query q (B, H, 1, d), RoPE applied; None where its cap leaves none of its
        past out (it attends all of it, exact)."""
        past = self.past(cache, layer_idx)
        if past is None:
            return None
        target, n, cap = past
        keep = self.past_keep(step, layer_idx, n)  # (B, n) or None: padding
        shadow = self.shadows.get(layer_idx)
        if (shadow is None or shadow.n0 > n or shadow.landmarks.shape[0] != target.k.batch
                or n - shadow.n0 > max(cap // 2, self.local)):  # (rows past the shadow: a new prompt's, or many
            # decoded ones, which would crowd the cap: the shadow is made again over them)
            shadow = self.shadows[layer_idx] = self._shadow(cache, target, layer_idx, n, cap, keep, step)
        if shadow.C == 0:
            return None
        B, G, ch = target.k.batch, target.k.heads, self.chunk
        dev = shadow.landmarks.device
        tail = torch.arange(shadow.C * ch, n, device=dev).expand(B, G, -1)  # local and decoded rows: exact
        k = max(0, min((cap - tail.shape[-1] - shadow.outlier_rows.shape[-1]) // ch, shadow.C))
        parts, real = [], []
        rebuilt = None
        if k:
            s = q.reshape(B, G, -1, q.shape[-1]).float() @ shadow.landmarks.transpose(-1, -2)  # (B, G, r, C)
            s = (s * cache.arch.score_scale).masked_fill(~shadow.selectable.unsqueeze(2), float("-inf"))
            votes = torch.softmax(s, dim=-1).nan_to_num_(0.0).amax(2)  # (B, G, C)
            votes = votes.masked_fill(~shadow.selectable, -1.0)  # a chunk that cannot be chosen goes last
            top = votes.topk(k, dim=-1, sorted=False).indices  # (B, G, k)
            rows = (top.unsqueeze(-1) * ch + torch.arange(ch, device=dev)).view(B, G, k * ch)
            parts.append(rows)
            real.append(shadow.selectable.gather(-1, top).repeat_interleave(ch, -1))
            if shadow.coef is not None:
                rebuilt = self._rebuild(shadow, rows, layer_idx, target.k.dtype)
        parts += [shadow.outlier_rows, tail]
        real += [shadow.outlier_real, torch.ones_like(tail, dtype=torch.bool)]
        idx, real = torch.cat(parts, -1), torch.cat(real, -1)
        if keep is not None:
            real &= keep.unsqueeze(1).expand(B, G, n).gather(-1, idx)
        meta = shadow.C * shadow.landmarks.shape[-1] * 4  # the landmarks (float32) scored, per (sequence, KV head)
        if rebuilt is not None:  # the basis, and each rebuilt row's coefficients in place of its key row
            R, el = shadow.coef.shape[-1], shadow.coef.element_size()
            meta += R * shadow.landmarks.shape[-1] * el + rebuilt.shape[2] * R * el
        keep = None if keep is None else keep.unsqueeze(1)
        if rebuilt is None:  # the real rows first, counted: read in place
            order = (~real).to(torch.int8).argsort(dim=-1, stable=True)
            return Fetch(idx.gather(-1, order).contiguous(), count=real.sum(-1).clamp_(min=1), keep=keep, meta=meta)
        return Fetch(idx.contiguous(), real=real, keep=keep, keys=rebuilt, meta=meta)

    def _rebuild(self, shadow: Shadow, rows: torch.Tensor, layer_idx: int, storage: torch.dtype) -> torch.Tensor:
        """Keys (B, G, k, d) of rows (B, G, k) of the prompt from their low-rank factors, rotated at their
        positions, in the pool's dtype (float for int8 rows: the working set packs them)."""
        B, G, k = rows.shape
        R = shadow.coef.shape[-1]
        coef = shadow.coef.unsqueeze(1).expand(B, G, -1, R).gather(2, rows.unsqueeze(-1).expand(B, G, k, R))
        keys = coef.float() @ shadow.basis.float()  # (B, G, k, d) before RoPE
        if self.freqs:
            pos = shadow.positions.unsqueeze(1).expand(B, G, -1).gather(-1, rows)
            keys = rotate(keys, *rope_at(self.freqs[self.rope_types[layer_idx]].to(keys.device), pos))
        return keys.to(storage if storage.is_floating_point else torch.float32)

    def _shadow(self, cache, target, layer_idx: int, n: int, cap: int, keep, step) -> Shadow:
        """The layer's n past rows as ShadowKV holds a prompt: landmarks, outliers, low-rank keys."""
        ch = self.chunk
        keys = from_rows(target.k.data[:, :, :n], torch.float32).to(target.device)  # (B, G, n, d) after RoPE
        B, G, _, d = keys.shape
        dev = keys.device
        valid = torch.ones(B, n, dtype=torch.bool, device=dev) if keep is None else keep.to(dev)
        keys = keys * valid.view(B, 1, n, 1)
        C = max(0, (n - self.local) // ch)
        body = keys[:, :, : C * ch].view(B, G, C, ch, d)
        body_valid = valid[:, : C * ch].view(B, 1, C, ch)
        landmarks = body.sum(3) / body_valid.sum(-1, keepdim=True).clamp(min=1)  # (B, G, C, d)
        real = body_valid.any(-1).expand(B, G, C)
        cos = torch.nn.functional.cosine_similarity(landmarks.unsqueeze(3), body, dim=-1)  # (B, G, C, ch)
        spread = cos.masked_fill(~body_valid, float("inf")).amin(-1).masked_fill(~real, float("inf"))
        O = min(C, round(self.outliers * cap / ch))
        out = spread.topk(O, dim=-1, largest=False).indices  # (B, G, O): the chunks farthest from their landmark
        selectable = real.clone()
        selectable.scatter_(-1, out, False)
        outlier_rows = (out.unsqueeze(-1) * ch + torch.arange(ch, device=dev)).view(B, G, O * ch)
        outlier_real = real.gather(-1, out).repeat_interleave(ch, -1)
        positions = row_positions(None if keep is None else valid, step.positions[:, -1].to(dev), n)
        coef = basis = None
        R = self.rank
        if self.rebuilds and R < n:  # below the keys' width (and the rows' count): held at rank R
            pre = keys
            if self.freqs:
                pcos, psin = rope_at(self.freqs[self.rope_types[layer_idx]].to(dev), positions)  # (B, n, d)
                pre = apply_rope(keys, (pcos, -psin))  # RoPE undone: the keys before it
            coef, basis = low_rank(pre.transpose(1, 2).reshape(B, n, G * d), R)  # (B, n, R), (B, R, G d)
            held = target.k.dtype if target.k.dtype.is_floating_point else torch.bfloat16
            coef = coef.to(held)
            basis = basis.view(B, R, G, d).transpose(1, 2).contiguous().to(held)  # (B, G, R, d)
        return Shadow(n, C, landmarks, selectable & real, outlier_rows, outlier_real, positions, coef, basis)


class ShadowKVCache(InfiniGenCache):
    """`ShadowKVCache(model, budget=0.1, chunk=8, rank=160, local=32, outliers=0.156)`: at most max(budget x past,
    min_budget) rows a (sequence, KV head, layer): the local and decoded rows, outlier chunks, and the chunks of the
    highest landmark scores with their keys rebuilt at rank `rank`."""

    method = "shadowkv"

    def __init__(self, model, budget: float = DEFAULT_BUDGET, min_budget: int = DEFAULT_MIN_BUDGET, chunk: int = 8,
                 rank: int = 160, local: int = 32, outliers: float = OUTLIERS, dense_layers: int = 0,
                 kv_dtype: str = "auto", **_):
        config = InfiniGenConfig(budget=budget, min_budget=min_budget, kv_dtype=kv_dtype, min_saving=0.0)
        super().__init__(model, config, selection=ShadowKVSelect(model, chunk, rank, local, outliers, dense_layers))
