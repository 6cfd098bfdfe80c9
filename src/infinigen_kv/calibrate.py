"""Offline skewing: per (layer, KV head) an orthogonal A from the SVD of post-RoPE queries, the partial
channel set P, and (for models without RoPE) the partial query weights; saved with the model's fingerprint.

Since A is orthogonal, (Q A)(K A)^T = Q K^T: outputs never change. A concentrates the magnitude of Q A
and K A in a few columns, so those columns alone predict the attention scores.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .adapters import Arch, get_arch
from .config import InfiniGenConfig

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


def fingerprint(model) -> str:
    """Architecture, shapes and a hash of the q/k projection weights (a strided sample of each, in bf16
    so that the same checkpoint loaded in float32 or bfloat16 gets the same fingerprint)."""
    cached = getattr(model, "_infinigen_fingerprint", None)
    if cached is not None:
        return cached
    arch = get_arch(model)
    h = hashlib.sha256()
    facts = [arch.model_type, arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.hidden_size]
    h.update(json.dumps(facts).encode())
    for attn in arch.attns:
        for proj in (attn.q_proj, attn.k_proj):
            w = proj.weight.detach().reshape(-1)[::61].to("cpu", torch.bfloat16)
            h.update(w.view(torch.int16).numpy().tobytes())
    fp = h.hexdigest()
    try:
        model._infinigen_fingerprint = fp
    except Exception:
        pass
    return fp


def cache_dir() -> Path:
    """User cache directory (INFINIGEN_CACHE_DIR, else $XDG_CACHE_HOME/infinigen_kv, else ~/.cache/infinigen_kv)."""
    root = os.environ.get("INFINIGEN_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "infinigen_kv"


def resolve_skew(skew: str, arch: Arch) -> str:
    """"auto": "svd" for models without RoPE (the paper's OPT setting), "none" for RoPE models, where the
    SVD skew predicted attention worse than the raw channels on our measurements (docs/BENCHMARKS.md)."""
    if skew == "auto":
        return "none" if arch.rope else "svd"
    return skew


def default_path(model, config) -> Path:
    """Where the calibration of (model, config) is cached: one file per model and calibration setting."""
    skew = resolve_skew(config.skew, get_arch(model))
    text = "generated"
    if config.calibration_text:
        text = "file-" + hashlib.sha256(Path(config.calibration_text).read_bytes()).hexdigest()[:8]
    name = f"{fingerprint(model)[:16]}-r{config.partial_ratio:g}-{skew}-{config.channel_rule}-{text}.safetensors"
    return cache_dir() / "calibration" / name


# ---------------------------------------------------------------------------------------------------
# Calibration text


ROWS = 8  # independent samples, so the text covers more than one topic


TICK_SECONDS = 10.0  # a progress line at most this often where no bar is drawn


class Ticker:
    """Progress of a calibration stage where no bar is drawn (stderr not a terminal: a log, a CI run, the demo):
    a line at most every TICK_SECONDS. On a terminal tqdm draws its bar instead."""

    def __init__(self, stage: str, total: int):
        self.stage, self.total, self.every = stage, total, TICK_SECONDS
        self.on = not sys.stderr.isatty()
        self.t0 = self.last = time.perf_counter()

    def __call__(self, done: int, *_) -> None:  # also an on_step callback of generate (returns None: go on)
        now = time.perf_counter()
        if self.on and now - self.last >= self.every:
            self.last = now
            print(f"infinigen: calibration: {self.stage} {done}/{self.total} ({now - self.t0:.0f} s)",
                  file=sys.stderr, flush=True)


@torch.inference_mode()
def generated_text_ids(model, tokens: int = 4096, seed: int = 0) -> torch.Tensor:
    """Calibration text the model writes itself: no download, no tokenizer, works for any model.
    ROWS sampled continuations of the BOS token (temperature 0.8, top-p 0.95). Returns (ROWS, T) ids."""
    from .baselines.full import FullCache
    from .generation import generate

    device = next(model.parameters()).device
    length = max(16, tokens // ROWS)
    bos = getattr(model.config, "bos_token_id", None)
    ids = torch.full((ROWS, 1), bos if isinstance(bos, int) else 0, dtype=torch.long, device=device)
    tick = Ticker("writing its text, tokens", length - 1)
    out = generate(
        model, ids, cache=FullCache(model), max_new_tokens=length - 1,
        temperature=0.8, top_p=0.95, seed=seed, stop_at_eos=False, progress="calibration text",
        on_step=lambda i, *_: tick(i + 1),
    )
    return torch.cat([ids, out.tokens], dim=1)


def text_file_ids(path: str, tokenizer, tokens: int = 4096, row: int = 512) -> torch.Tensor:
    """Token ids of a text file, cut into rows of `row` tokens: (S, row)."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0][:tokens]
    if ids.numel() < row:
        raise CalibrationError(f"{path}: only {ids.numel()} tokens, calibration needs at least {row}")
    return ids[: ids.numel() // row * row].view(-1, row)


# ---------------------------------------------------------------------------------------------------
# The calibration itself


@torch.inference_mode()
def collect_qk(model, arch: Arch, ids: torch.Tensor, batch: int = 4):
    """Post-RoPE queries and keys of every layer over ids (S, T): lists of (H, S*T, d) and (G, S*T, d)."""
    device = next(model.parameters()).device
    qs = [[] for _ in range(arch.num_layers)]
    ks = [[] for _ in range(arch.num_layers)]

    def hook(module, args, kwargs):
        x, rope, l = kwargs["hidden_states"], kwargs.get("position_embeddings"), module.layer_idx
        q = arch.query(l, x, rope) / arch.q_scale  # undo OPT's pre-scaling: A does not depend on it
        qs[l].append(q.transpose(0, 1).flatten(1, 2).float().cpu())  # (H, B*T, d)
        ks[l].append(arch.key(l, x, rope).transpose(0, 1).flatten(1, 2).float().cpu())

    handles = [a.register_forward_pre_hook(hook, with_kwargs=True) for a in arch.attns]
    tick = Ticker("queries and keys, rows", ids.shape[0])
    try:
        for i in tqdm(range(0, ids.shape[0], batch), desc="calibration pass", leave=False, disable=None):
            chunk = ids[i : i + batch].to(device)
            model(input_ids=chunk, use_cache=False, logits_to_keep=1)
            tick(i + chunk.shape[0])
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(q, 1) for q in qs], [torch.cat(k, 1) for k in ks]


def skew_layer(q: torch.Tensor, k: torch.Tensor, group: int, p: int, rule: str, skew: str = "svd"):
    """A and P for one layer. q (H, N, d), k (G, N, d) -> A (G, d, d), P (G, p).

    skew "svd": A = right singular vectors of the group's stacked queries, ordered by query x key
    singular values (the paper). skew "none": A = identity (partial channels of the raw q/k).
    rule "q": P = the columns with the largest summed |Q A| (the paper's code); "qk": largest
    mean|Q A| x mean|K A| (the channels that carry the q.k products).
    """
    G, N, d = k.shape
    A_all, P_all = [], []
    for g in range(G):
        qg = q[g * group : (g + 1) * group].reshape(-1, d)  # (r*N, d): the group's query rows
        if skew == "svd":
            _, s, vh = torch.linalg.svd(qg, full_matrices=False)
            A = vh.T  # (d, d) orthogonal
            A = A[:, torch.argsort(s * (k[g] @ A).norm(dim=0), descending=True)]
        else:
            A = torch.eye(d)
        score = (qg @ A).abs().mean(0)
        if rule == "qk":
            score = score * (k[g] @ A).abs().mean(0)
        A_all.append(A)
        P_all.append(torch.topk(score, p).indices.sort().values)
    return torch.stack(A_all), torch.stack(P_all)


def partial_query_weights(arch: Arch, skew: torch.Tensor, channels: torch.Tensor):
    """For models without RoPE: fold A_P into q_proj once, so the partial query is one small product.
    Returns weight (L, H*p, D) and bias (L, H*p); q_partial = x W^T + b (already pre-scaled like q)."""
    L, G, d, _ = skew.shape
    p = channels.shape[-1]
    r = arch.group
    ws, bs = [], []
    for l, attn in enumerate(arch.attns):
        W = attn.q_proj.weight.detach().float().cpu().view(arch.num_heads, d, -1)  # (H, d, D)
        b = attn.q_proj.bias
        b = b.detach().float().cpu().view(arch.num_heads, d) if b is not None else torch.zeros(arch.num_heads, d)
        AP = torch.gather(skew[l], 2, channels[l].unsqueeze(1).expand(G, d, p))  # (G, d, p)
        AP = AP.repeat_interleave(r, dim=0)  # (H, d, p)
        ws.append(torch.einsum("hdp,hdD->hpD", AP, W).reshape(-1, W.shape[-1]) * arch.q_scale)
        bs.append(torch.einsum("hdp,hd->hp", AP, b).reshape(-1) * arch.q_scale)
    return torch.stack(ws), torch.stack(bs)


def rope_channels(channels: torch.Tensor, d: int) -> torch.Tensor:
    """The query channels an unskewed RoPE partial query needs: per (layer, KV head) the partial channels P and
    their rotate-half partners (c +- d/2), padded by repeating one: (L, G, c) int64 with c <= 2p."""
    half = d // 2
    need = [[sorted(set(P.tolist()) | {(ch + half) % d for ch in P.tolist()}) for P in layer] for layer in channels]
    c = max(len(s) for layer in need for s in layer)
    return torch.tensor([[s + s[:1] * (c - len(s)) for s in layer] for layer in need], dtype=torch.long)


def calibrate(
    model,
    tokenizer=None,
    text_file: str | None = None,
    partial_ratio: float = InfiniGenConfig.partial_ratio,
    channel_rule: str = "qk",
    skew: str = "auto",
    tokens: int = 4096,
    seed: int = 0,
    recall: bool = False,
) -> Calibration:
    """Calibrate `model` on a text file (needs a tokenizer) or on text the model generates itself; with
    `recall`, also measure each layer's speculation recall on that text (for layer_budget "recall")."""
    t0 = time.perf_counter()
    arch = get_arch(model)
    ids, source = calibration_ids(model, tokenizer, text_file, tokens, seed)
    skew = resolve_skew(skew, arch)
    qs, ks = collect_qk(model, arch, ids)
    p = math.ceil(partial_ratio * arch.head_dim)
    mats, channels = [], []
    tick = Ticker("skewing, layers", arch.num_layers)
    for l in tqdm(range(arch.num_layers), desc="skewing", leave=False, disable=None):
        A, P = skew_layer(qs[l], ks[l], arch.group, p, channel_rule, skew)
        tick(l + 1)
        mats.append(A)
        channels.append(P)
    mats, channels = torch.stack(mats), torch.stack(channels)
    meta = {
        "fingerprint": fingerprint(model),
        "version": FORMAT_VERSION,
        "model_type": arch.model_type,
        "partial_ratio": partial_ratio,
        "channel_rule": channel_rule,
        "skew": skew,
        "text": source,
        "tokens": int(ids.numel()),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    pq_w = pq_b = None
    if not arch.rope:
        pq_w, pq_b = partial_query_weights(arch, mats, channels)
    cal = Calibration(mats, channels, meta, pq_w, pq_b)
    if recall:
        cal.meta["recall"] = measure_recall(model, cal, ids)
        cal.meta["seconds"] = round(time.perf_counter() - t0, 2)
    return cal


def calibration_ids(model, tokenizer, text_file: str | None, tokens: int = 4096, seed: int = 0):
    """The calibration text: (rows, T) ids of `text_file` (needs the tokenizer) or of text the model writes,
    and its name for the file's metadata."""
    if text_file is None:
        return generated_text_ids(model, tokens, seed), "generated"
    if tokenizer is None:
        raise CalibrationError("calibrating on a text file needs the model's tokenizer")
    return text_file_ids(text_file, tokenizer, tokens), f"file:{Path(text_file).name}"


RECALL_BUDGET, RECALL_STEPS = 0.1, 16  # the setting each layer's recall is measured at


@torch.inference_mode()
def measure_recall(model, cal: Calibration, ids: torch.Tensor, steps: int = RECALL_STEPS) -> list:
    """Per layer: the share of its true attention mass on the entries InfiniGen fetches at budget 0.1 (other
    knobs at their defaults), over `steps` greedy decode steps after the calibration text joined into one row
    (its rows are short; joined, the budget binds as at long context). None for a layer attended densely
    (layer 0, local layers). Where it is low, the partial channels predict that layer's attention worst."""
    from .cache import InfiniGenCache
    from .generation import generate

    config = InfiniGenConfig(partial_ratio=cal.meta["partial_ratio"], budget=RECALL_BUDGET, min_budget=0)
    cache = InfiniGenCache(model, config, calibration=cal)
    cache.track_recall = True
    row = ids.reshape(1, -1).to(next(model.parameters()).device)
    generate(model, row, cache=cache, max_new_tokens=steps, stop_at_eos=False)
    got = cache.stats["recall_per_layer"]
    return [None if layer.dense else round(float(got[i]), 4) for i, layer in enumerate(cache.layers)]


def ensure_recall(model, cal: Calibration, config, tokenizer=None) -> list:
    """The calibration's per-layer recall (measure_recall), measured now on the calibration text if it has
    none yet (a calibration made without it) and kept in its metadata."""
    if cal.meta.get("recall") is None:
        ids, _ = calibration_ids(model, tokenizer, config.calibration_text)
        cal.meta["recall"] = measure_recall(model, cal, ids)
    return cal.meta["recall"]


def load_or_calibrate(model, config, tokenizer=None) -> Calibration:
    """The calibration named by config.calibration, else the per-model cached one, else a new one (cached).
    With layer_budget "recall" it carries each layer's recall (a cached one without it is measured once and
    saved; a named file without it is refused: `infinigen calibrate` writes it)."""
    recall = config.layer_budget == "recall"
    if config.calibration:
        cal = Calibration.load(config.calibration)
        cal.check(model, config.partial_ratio)
        if recall and cal.meta.get("recall") is None:
            raise CalibrationError(f"calibration file {config.calibration} has no per-layer recall, which "
                                   "layer_budget 'recall' needs: make it again with `infinigen calibrate`")
        return cal
    path = default_path(model, config)
    if config.calibration_text and tokenizer is None and (recall or not path.is_file()):
        tokenizer = tokenizer_for(model)  # only to read the text
    if path.is_file():
        try:
            cal = Calibration.load(path)
            cal.check(model, config.partial_ratio)
            if recall and cal.meta.get("recall") is None:
                ensure_recall(model, cal, config, tokenizer)
                cal.save(path)
            return cal
        except CalibrationError:
            pass  # stale or damaged cache entry: calibrate again and overwrite it
    print("infinigen: calibrating the model (once; cached for later runs) ...", file=sys.stderr, flush=True)
    cal = calibrate(model, tokenizer, config.calibration_text, config.partial_ratio, config.channel_rule,
                    config.skew, recall=recall)
    cal.save(path)
    print(f"infinigen: calibrated in {cal.meta['seconds']:.0f} s ({path})", file=sys.stderr, flush=True)
    return cal


def tokenizer_for(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.config._name_or_path)
