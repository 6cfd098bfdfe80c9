"""Offline skewing: per (layer, KV head) an orthogonal A from the SVD of post-RoPE queries, the partial
channel set P, and (for models without RoPE) the partial query weights; saved with the model's fingerprint.

Since A is orthogonal, (Q A)(K A)^T = Q K^T: outputs never change. A concentrates the magnitude of Q A
and K A in a few columns, so those columns alone predict the attention scores. This module is the file
format and the arithmetic; offline.py runs a model to calibrate it.
"""

from __future__ import annotations

import hashlib
import weakref
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...config import cache_dir
from ...model.arch import Arch, get_arch
from ...model.ops import dense


FORMAT_VERSION = 1



class CalibrationError(ValueError):
    """A calibration file that cannot be used with this model (another model, unreadable, bad shape)."""



@dataclass
class Calibration:
    skew: torch.Tensor  # (L, G, d, d) orthogonal A per (layer, KV head)
    channels: torch.Tensor  # (L, G, p) int64: partial channel set P per (layer, KV head)
    meta: dict = field(default_factory=dict)
    pq_weight: torch.Tensor | None = None  # (L, H*p, D): partial query weights (no-RoPE models)
    pq_bias: torch.Tensor | None = None  # (L, H*p)

    @property
    def skew_partial(self) -> torch.Tensor:
        """A restricted to P: (L, G, d, p)."""
        L, G, d, _ = self.skew.shape
        idx = self.channels.unsqueeze(2).expand(L, G, d, self.channels.shape[-1])
        return torch.gather(self.skew, 3, idx)

    @property
    def unskewed(self) -> bool:
        """A is the identity for every (layer, KV head): the partial channels are raw q/k channels."""
        d = self.skew.shape[-1]
        return bool(torch.equal(self.skew, torch.eye(d, dtype=self.skew.dtype).expand_as(self.skew)))

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"skew": self.skew.contiguous(), "channels": self.channels.contiguous()}
        if self.pq_weight is not None:
            tensors["pq_weight"] = self.pq_weight.contiguous()
            tensors["pq_bias"] = self.pq_bias.contiguous()
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"infinigen": json.dumps(self.meta)})
        os.replace(tmp, path)  # atomic: a crash never leaves half a file in the cache
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        path = Path(path)
        if not path.is_file():
            raise CalibrationError(f"calibration file not found: {path}")
        try:
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                meta = json.loads((f.metadata() or {}).get("infinigen", "{}"))
            t = load_file(str(path))
        except Exception as e:  # corrupted or not a safetensors file
            raise CalibrationError(f"cannot read calibration file {path}: {e}") from None
        if "skew" not in t or "channels" not in t or "fingerprint" not in meta:
            raise CalibrationError(f"{path} is not an infinigen-kv calibration file")
        return cls(t["skew"], t["channels"], meta, t.get("pq_weight"), t.get("pq_bias"))

    def check(self, model, partial_ratio: float | None = None) -> None:
        """Refuse a calibration made for another model (or another partial ratio)."""
        fp = fingerprint(model)
        if self.meta.get("fingerprint") != fp:
            raise CalibrationError(
                f"calibration was made for another model (fingerprint {str(self.meta.get('fingerprint'))[:12]}, "
                f"this model is {fp[:12]}): run `infinigen calibrate` for this model"
            )
        if partial_ratio is not None and not math.isclose(self.meta.get("partial_ratio", -1), partial_ratio):
            raise CalibrationError(
                f"calibration has partial_ratio {self.meta.get('partial_ratio')}, asked for {partial_ratio}"
            )


# ---------------------------------------------------------------------------------------------------
# Fingerprint and cache location
_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its fingerprint, made once


def fingerprint(model) -> str:
    """Architecture, shapes and the checkpoint: its digest as stored (model.checkpoint: a GGUF's or safetensors'
    bytes), so that every form its weights are held in (int4, int5, int8, bfloat16 rows, float32) shares one
    calibration; a model built in memory (no checkpoint): a strided sample of every weight's values in bf16 (the same
    in float32 and bfloat16; every weight, as the calibration's text and queries depend on them all)."""
    cached = _FINGERPRINTS.get(model)
    if cached is not None:
        return cached
    arch = get_arch(model)
    h = hashlib.sha256()
    facts = [arch.model_type, arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.hidden_size]
    h.update(json.dumps(facts).encode())
    if model.checkpoint is not None:
        h.update(model.checkpoint.encode())
    else:
        for name, p in model.named_parameters():
            w = dense(p.detach(), torch.float32).reshape(-1)[::61].to("cpu", torch.bfloat16)
            h.update(name.encode() + w.view(torch.int16).numpy().tobytes())
    fp = _FINGERPRINTS[model] = h.hexdigest()
    return fp



def resolve_skew(skew: str, arch: Arch) -> str:
    """"auto": "svd" for models without RoPE (the paper's OPT setting), "none" for RoPE models, where the
    SVD skew predicted attention worse than the raw channels on our measurements (docs/BENCHMARKS.md)."""
    if skew == "auto":
        return "none" if arch.rope else "svd"
    return skew



BUILTIN_TEXT = Path(__file__).resolve().parents[2] / "data" / "calibration.txt"  # ~6.7 KB the project wrote: prose,
# code, dialogue, tables and numbers (~2,000 tokens): what every model with a tokenizer calibrates on by default


def default_path(model, config, tokenizer=None) -> Path:
    """Where the calibration of (model, config) is cached: one file per checkpoint (fingerprint) and calibration
    setting. Its text: the file named, else the package's own (BUILTIN_TEXT) where a tokenizer reads it (one given,
    or the checkpoint's), else text the model generates."""
    skew = resolve_skew(config.skew, get_arch(model))
    text = "generated"
    if config.calibration_text:
        text = "file-" + hashlib.sha256(Path(config.calibration_text).read_bytes()).hexdigest()[:8]
    elif tokenizer is not None or model.source is not None:
        text = "builtin-" + hashlib.sha256(BUILTIN_TEXT.read_bytes()).hexdigest()[:8]
    name = f"{fingerprint(model)[:16]}-r{config.partial_ratio:g}-{skew}-{config.channel_rule}-{text}.safetensors"
    return cache_dir() / "calibration" / name



def skew_layer(q: torch.Tensor, k: torch.Tensor, group: int, p: int, rule: str, skew: str = "svd"):
    """A and P for one layer. q (H, N, d), k (G, N, d) -> A (G, d, d), P (G, p).

    skew "svd": A = right singular vectors of the group's stacked queries, ordered by query x key
    singular values (the paper). skew "none": A = identity (partial channels of the raw q/k).
    rule "q": P = the columns with the largest summed |Q A| (the paper's code); "qk": largest
    mean|Q A| x mean|K A| (the channels that carry the q.k products).
    """
    G, N, d = k.shape
    A_all, q_mean, k_mean = [], [], []
    for g in range(G):
        qg = q[g * group : (g + 1) * group].reshape(-1, d)  # (r*N, d): the group's query rows
        if skew == "svd":
            _, s, vh = torch.linalg.svd(qg, full_matrices=False)
            A = vh.T  # (d, d) orthogonal
            A = A[:, torch.argsort(s * (k[g] @ A).norm(dim=0), descending=True)]
        else:
            A = torch.eye(d)
        A_all.append(A)
        q_mean.append((qg @ A).abs().mean(0))
        k_mean.append((k[g] @ A).abs().mean(0))
    return torch.stack(A_all), partial_channels(torch.stack(q_mean), torch.stack(k_mean), p, rule)


def partial_channels(q_mean: torch.Tensor, k_mean: torch.Tensor, p: int, rule: str) -> torch.Tensor:
    """P (G, p), sorted: per KV head the p channels of the largest mean |q| (rule "q", the paper's code) or
    mean |q| x mean |k| (rule "qk": the channels that carry the q.k products). q_mean, k_mean: (G, d)."""
    score = q_mean * k_mean if rule == "qk" else q_mean
    return torch.topk(score, p, dim=-1).indices.sort(-1).values



def partial_query_weights(arch: Arch, skew: torch.Tensor, channels: torch.Tensor):
    """For models without RoPE: fold A_P into q_proj once, so the partial query is one small product.
    Returns weight (L, H*p, D) and bias (L, H*p); q_partial = x W^T + b (already pre-scaled like q)."""
    L, G, d, _ = skew.shape
    p = channels.shape[-1]
    r = arch.group
    ws, bs = [], []
    for l, attn in enumerate(arch.attns):
        W = dense(attn.q_proj.weight.detach(), torch.float32).cpu().view(arch.num_heads, d, -1)  # (H, d, D)
        b = attn.q_proj.bias
        b = b.detach().float().cpu().view(arch.num_heads, d) if b is not None else torch.zeros(arch.num_heads, d)
        AP = torch.gather(skew[l], 2, channels[l].unsqueeze(1).expand(G, d, p))  # (G, d, p)
        AP = AP.repeat_interleave(r, dim=0)  # (H, d, p)
        ws.append(torch.einsum("hdp,hdD->hpD", AP, W).reshape(-1, W.shape[-1]) * arch.q_scale)
        bs.append(torch.einsum("hdp,hd->hp", AP, b).reshape(-1) * arch.q_scale)
    return torch.stack(ws), torch.stack(bs)
