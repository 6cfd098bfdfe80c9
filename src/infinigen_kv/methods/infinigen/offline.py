"""Calibrating a model, offline: the text (a file, or text the model writes itself with the full cache), its
post-RoPE queries and keys, the skewing per layer (calibration.py), optionally each layer's recall (recall.py);
and `load_or_calibrate`, which a cache calls: the named file, the per-model cached one, or a new one.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...config import InfiniGenConfig
from ...model.arch import Arch, get_arch
from ...model.kv import KVView, StepCache
from ...runtime.generation import generate
from ..full import FullCache
from .calibration import (Calibration, CalibrationError, FORMAT_VERSION, default_path, fingerprint,
                          partial_query_weights, resolve_skew, skew_layer)
from .recall import measure_recall


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
class _Recorder(StepCache):
    """A cache that stores nothing and notes each layer's post-RoPE queries and keys from its attention input (each
    chunk attends over itself): calibration's pass over its text."""

    class Layer:
        def view(self, k, v, fetch=None) -> KVView:
            return KVView(k, v)

    def __init__(self, arch: Arch):
        self.arch, self.layers = arch, [self.Layer() for _ in range(arch.num_layers)]
        self.qs, self.ks = [[] for _ in self.layers], [[] for _ in self.layers]

    def get_seq_length(self) -> int:
        return 0

    def before_attention(self, l: int, x: torch.Tensor, step) -> list:
        arch, rope = self.arch, step.rope(l)
        q = arch.query(l, x, rope) / arch.q_scale  # undo OPT's pre-scaling: A does not depend on it
        self.qs[l].append(q.transpose(0, 1).flatten(1, 2).float().cpu())  # (H, B*T, d)
        self.ks[l].append(arch.key(l, x, rope).transpose(0, 1).flatten(1, 2).float().cpu())
        return []


@torch.inference_mode()
def collect_qk(model, arch: Arch, ids: torch.Tensor, batch: int = 4):
    """Post-RoPE queries and keys of every layer over ids (S, T): lists of (H, S*T, d) and (G, S*T, d)."""
    device = next(model.parameters()).device
    rec = _Recorder(arch)
    tick = Ticker("queries and keys, rows", ids.shape[0])
    for i in tqdm(range(0, ids.shape[0], batch), desc="calibration pass", leave=False, disable=None):
        chunk = ids[i : i + batch].to(device)
        model(input_ids=chunk, past_key_values=rec, logits_to_keep=1)
        tick(i + chunk.shape[0])
    qs, ks = rec.qs, rec.ks
    for parts in (qs, ks):  # each layer's parts joined and dropped in turn: never two copies of them all
        for l in range(arch.num_layers):
            parts[l] = torch.cat(parts[l], 1)
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
    """Calibrate `model` on a text file (needs a tokenizer) or on text the model generates itself; with
    `recall`, also measure each layer's speculation recall on that text (for layer_budget "recall"; it runs
    cache_cls, InfiniGenCache: `ig.calibrate` passes it)."""
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
        qs[l] = ks[l] = None  # (every layer's float32 queries: ~0.4 GB over the 0.5B's 4,096 tokens)
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
        cal.meta["recall"] = measure_recall(model, cal, ids, cache_cls)
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
    path = default_path(model, config)
    if config.calibration_text and tokenizer is None and (recall or not path.is_file()):
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
    print("infinigen: calibrating the model (once; cached for later runs) ...", file=sys.stderr, flush=True)
    cal = calibrate(model, tokenizer, config.calibration_text, config.partial_ratio, config.channel_rule,
                    config.skew, recall=recall, cache_cls=cache_cls)
    cal.save(path)
    print(f"infinigen: calibrated in {cal.meta['seconds']:.0f} s ({path})", file=sys.stderr, flush=True)
    return cal



def ensure_recall(model, cal: Calibration, config, tokenizer=None, cache_cls=None) -> list:
    """The calibration's per-layer recall (measure_recall), measured now on the calibration text if it has
    none yet (a calibration made without it) and kept in its metadata."""
    if cal.meta.get("recall") is None:
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
