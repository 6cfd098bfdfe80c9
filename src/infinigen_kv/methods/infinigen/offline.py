"""Calibrating a model, offline: the text (the package's own, a file, or text the model writes itself where it has
no tokenizer), its post-RoPE queries and keys from a prefill, the skewing per layer (calibration.py), optionally
each layer's recall (recall.py); and `load_or_calibrate`, which a cache calls: the named file, the per-checkpoint
cached one, or a new one.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

from ... import heap
from ...config import InfiniGenConfig
from ...model.arch import Arch, get_arch
from ...model.kv import KVView, StepCache
from ...progress import Progress
from ...runtime.generation import generate
from ..full import FullCache
from .calibration import (BUILTIN_TEXT, Calibration, CalibrationError, FORMAT_VERSION, default_path, fingerprint,
                          partial_channels, partial_query_weights, resolve_skew, skew_layer)
from .recall import measure_recall


# ---------------------------------------------------------------------------------------------------
# Calibration text
ROWS = 8  # independent samples of generated text, so it covers more than one topic


@torch.inference_mode()
def generated_text_ids(model, tokens: int = 4096, seed: int = 0) -> torch.Tensor:
    """Calibration text the model writes itself, for a model without a tokenizer (one built in memory): ROWS sampled
    continuations of the BOS token (temperature 0.8, top-p 0.95). Returns (ROWS, T) ids."""
    device = next(model.parameters()).device
    length = max(16, tokens // ROWS)
    bos = getattr(model.config, "bos_token_id", None)
    ids = torch.full((ROWS, 1), bos if isinstance(bos, int) else 0, dtype=torch.long, device=device)
    bar = Progress("calibrating: writing its text", length - 1, " tokens")
    out = generate(
        model, ids, cache=FullCache(model), max_new_tokens=length - 1,
        temperature=0.8, top_p=0.95, seed=seed, stop_at_eos=False,
        on_step=lambda i, *_: bar(i + 1),
    )
    bar.close()
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
class _Recorder(StepCache):
    """A cache that stores nothing and notes each layer's post-RoPE queries and keys from its attention input (each
    chunk attends over itself): calibration's pass over its text. rows: keep them all (the SVD skew needs them);
    otherwise only each channel's sum of magnitudes (what the partial channels of unskewed q/k are chosen by:
    (H, d) and (G, d) a layer, not ~0.2 GB of rows)."""

    class Layer:
        def view(self, k, v, fetch=None) -> KVView:
            return KVView(k, v)

    def __init__(self, arch: Arch, rows: bool = True):
        self.arch, self.layers, self.rows = arch, [self.Layer() for _ in range(arch.num_layers)], rows
        self.qs, self.ks = [[] for _ in self.layers], [[] for _ in self.layers]
        self.n = 0  # rows seen a layer (B*T summed)

    def get_seq_length(self) -> int:
        return 0

    def before_attention(self, l: int, x: torch.Tensor, step) -> list:
        heap.trim()  # what the last layer freed back to the OS (its activations): a first use peaks as a later one
        arch, rope = self.arch, step.rope(l)
        q = arch.query(l, x, rope, step.backend) / arch.q_scale  # undo OPT's pre-scaling: A does not depend on it
        q = q.transpose(0, 1).flatten(1, 2).float().cpu()  # (H, B*T, d)
        k = arch.key(l, x, rope, step.backend).transpose(0, 1).flatten(1, 2).float().cpu()  # (G, B*T, d)
        if l == 0:
            self.n += q.shape[1]
        if self.rows:
            self.qs[l].append(q)
            self.ks[l].append(k)
        else:
            self.qs[l].append(q.abs().sum(1, dtype=torch.float64))  # (H, d)
            self.ks[l].append(k.abs().sum(1, dtype=torch.float64))  # (G, d)
        return []


@torch.inference_mode()
def collect_qk(model, arch: Arch, ids: torch.Tensor, batch: int = 1, rows: bool = True):
    """Post-RoPE queries and keys of every layer over ids (S, T) from a prefill (rows `batch` at a time): lists of
    (H, S*T, d) and (G, S*T, d); rows False: each channel's mean magnitude instead, lists of (H, d) and (G, d)."""
    device = next(model.parameters()).device
    rec = _Recorder(arch, rows)
    bar = Progress("calibrating: prefill", ids.numel(), " tokens")
    for i in range(0, ids.shape[0], batch):
        chunk = ids[i : i + batch].to(device)
        model(input_ids=chunk, past_key_values=rec, logits_to_keep=1)
        bar((i + chunk.shape[0]) * ids.shape[1])
    bar.close()
    qs, ks = rec.qs, rec.ks
    for parts in (qs, ks):  # each layer's parts joined and dropped in turn: never two copies of them all
        for l in range(arch.num_layers):
            parts[l] = torch.cat(parts[l], 1) if rows else (torch.stack(parts[l]).sum(0) / rec.n).float()
    return qs, ks


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
    cache_cls=None,
) -> Calibration:
    """Calibrate `model` from a prefill of a text file, or of the package's own text (BUILTIN_TEXT; both need a
    tokenizer), or, for a model without one, of text it generates itself; with `recall`, also measure each layer's
    speculation recall on that text (for layer_budget "recall"; it runs cache_cls, InfiniGenCache: `ig.calibrate`
    passes it)."""
    t0 = time.perf_counter()
    arch = get_arch(model)
    ids, source = calibration_ids(model, tokenizer, text_file, tokens, seed)
    skew = resolve_skew(skew, arch)
    qs, ks = collect_qk(model, arch, ids, rows=skew == "svd")
    p = math.ceil(partial_ratio * arch.head_dim)
    mats, channels = [], []
    for l in range(arch.num_layers):
        if skew == "svd":
            A, P = skew_layer(qs[l], ks[l], arch.group, p, channel_rule, skew)
        else:  # unskewed: the channels of the largest mean |q| (x mean |k|)
            A = torch.eye(arch.head_dim).expand(arch.num_kv_heads, -1, -1)
            P = partial_channels(qs[l].view(arch.num_kv_heads, arch.group, -1).mean(1), ks[l], p, channel_rule)
        qs[l] = ks[l] = None  # (every layer's float32 queries: ~0.2 GB over the 0.5B's 2,000 tokens)
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
        cal.meta["recall"] = measure_recall(model, cal, ids, cache_cls)
        cal.meta["seconds"] = round(time.perf_counter() - t0, 2)
    return cal



def calibration_ids(model, tokenizer, text_file: str | None, tokens: int = 4096, seed: int = 0):
    """The calibration text: (rows, T) ids of `text_file`, else of the package's own text (BUILTIN_TEXT), with the
    tokenizer; without one, of text the model writes; and its name for the file's metadata."""
    if text_file is None and tokenizer is not None:
        return text_file_ids(str(BUILTIN_TEXT), tokenizer, tokens), "builtin"
    if text_file is None:
        return generated_text_ids(model, tokens, seed), "generated"
    if tokenizer is None:
        raise CalibrationError("calibrating on a text file needs the model's tokenizer")
    return text_file_ids(text_file, tokenizer, tokens), f"file:{Path(text_file).name}"



def load_or_calibrate(model, config, tokenizer=None, cache_cls=None) -> Calibration:
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
    path = default_path(model, config, tokenizer)
    if tokenizer is None and (recall or not path.is_file()) and (config.calibration_text or model.source):
        tokenizer = tokenizer_for(model)  # only to read the text
    if path.is_file():
        try:
            cal = Calibration.load(path)
            cal.check(model, config.partial_ratio)
            if recall and cal.meta.get("recall") is None:
                ensure_recall(model, cal, config, tokenizer, cache_cls)
                cal.save(path)
            return cal
        except CalibrationError:
            pass  # stale or damaged cache entry: calibrate again and overwrite it
    print("infinigen: calibrating (once for this checkpoint: every weight format shares it) ...", file=sys.stderr,
          flush=True)
    cal = calibrate(model, tokenizer, config.calibration_text, config.partial_ratio, config.channel_rule,
                    config.skew, recall=recall, cache_cls=cache_cls)
    cal.save(path)
    print(f"infinigen: calibrated in {cal.meta['seconds']:.0f} s ({path})", file=sys.stderr, flush=True)
    return cal



def ensure_recall(model, cal: Calibration, config, tokenizer=None, cache_cls=None) -> list:
    """The calibration's per-layer recall (measure_recall), measured now on the calibration text if it has
    none yet (a calibration made without it) and kept in its metadata."""
    if cal.meta.get("recall") is None:
        if tokenizer is None and model.source is not None:
            tokenizer = tokenizer_for(model)
        ids, _ = calibration_ids(model, tokenizer, config.calibration_text)
        cal.meta["recall"] = measure_recall(model, cal, ids, cache_cls)
    return cal.meta["recall"]



def tokenizer_for(model):
    """The tokenizer of the checkpoint `model` was loaded from (a model built in memory has none: pass one)."""
    from ...model.load import load_tokenizer

    if model.source is None:
        raise CalibrationError("calibration_text needs the model's tokenizer: pass tokenizer= (the model was not "
                               "loaded from a checkpoint)")
    return load_tokenizer(Path(model.source))
