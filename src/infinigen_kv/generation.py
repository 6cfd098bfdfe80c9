"""The decode loop: prefill once, then one token per step through whatever cache is given.

`model.generate(..., past_key_values=cache)` works with every cache here too; this loop exists so that
prefill and decode are timed separately and nothing but the model and the cache runs per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # (B, steps) generated ids; after a sequence's EOS: pad/EOS ids
    lengths: list[int]  # generated tokens per sequence, up to and including its EOS
    prefill_s: float
    decode_s: float
    decode_steps: int  # forward passes after prefill

    @property
    def decode_tokens_per_s(self) -> float:
        """Batch x decode steps / decode seconds (every sequence of the batch computes each step)."""
        return self.tokens.shape[0] * self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # only at the prefill/decode boundaries, for the timings


NUCLEUS_TOPK = 1024


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, generators: list) -> torch.Tensor:
    """Next ids (B,) from logits (B, V); temperature and top_p (B,) per row: greedy where temperature is 0,
    else nucleus sampling. One generator draws for the whole batch, or one per row (reproducible rows
    whatever else shares the batch)."""
    greedy = logits.argmax(-1)
    if not generators:
        return greedy
    hot = temperature > 0
    probs = torch.softmax(logits.float() / torch.where(hot, temperature, 1.0)[:, None], dim=-1)  # (B, V)
    if bool((top_p < 1.0).any()):
        # The nucleus usually lies in the top NUCLEUS_TOPK ids (a top-k is ~10x cheaper than sorting a 262k
        # vocabulary); where one would reach past them (their mass <= top_p), sort everything.
        sorted_p, order = probs.topk(min(NUCLEUS_TOPK, probs.shape[-1]), dim=-1)
        if sorted_p.shape[-1] < probs.shape[-1] and bool((sorted_p.sum(-1) <= top_p).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p[:, None]  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    if len(generators) == 1:
        drawn = torch.multinomial(probs, 1, generator=generators[0]).squeeze(-1)
    else:
        drawn = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])
    return torch.where(hot, drawn, greedy)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int):
    """(logprob of each chosen id (B,), the k largest logprobs (B, k), their ids (B, k)) of logits (B, V)."""
    full = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
    return (full.gather(-1, ids[:, None]).squeeze(-1), *full.topk(k, dim=-1))


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
            max_new_tokens: int = 0) -> torch.Tensor:
    """The prompt input_ids (B, n) (left-padded, with attention_mask (B, n)) into `cache`, sized for
    max_new_tokens more: the last position's logits (B, V)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if hasattr(cache, "reserve"):  # our caches: buffers sized for the whole run, none grows inside decode
        cache.reserve(input_ids.shape[1] + max_new_tokens)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)  # (B, n): left padding aware
    return model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
        past_key_values=cache, use_cache=True, logits_to_keep=1,
    ).logits[:, -1]


@torch.inference_mode()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    cache=None,
    max_new_tokens: int = 64,
    temperature: float | list[float] = 0.0,
    top_p: float | list[float] = 1.0,
    seed: int | list[int | None] | None = None,
    eos_token_id: int | list[int] | None = None,
    stop_at_eos: bool = True,
    progress: str | None = None,
    on_step=None,
    logprobs: int | None = None,
    prefilled: torch.Tensor | None = None,
) -> GenerationResult:
    """Generate up to max_new_tokens for input_ids (B, n) (left-padded, with attention_mask (B, n)).

    temperature, top_p and seed are one value for the batch or one per sequence (a list): a list of seeds
    gives each sequence its own generator. on_step(step, ids (B,), logprobs) is called after each new token
    (streaming); it returns True to stop. logprobs is None unless `logprobs` = k is given: then it is
    (logprob of each chosen id (B,), the k largest logprobs (B, k), their ids (B, k)), of the model's own
    distribution (before temperature and top-p, as OpenAI-style servers report them). Stops early once
    every sequence has produced an EOS (when stop_at_eos). prefilled: the prefill's last logits (B, V) when
    `cache` already holds input_ids (a `fork` of a cache prefilled by `prefill`): decoding starts from them.
    """
    device = input_ids.device
    B, n = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    # Preallocated mask for the whole run: each step uses a longer view, nothing is concatenated.
    mask = torch.ones(B, n + max_new_tokens, dtype=attention_mask.dtype, device=device)
    mask[:, :n] = attention_mask
    positions = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)  # (B, n): left padding aware
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=device).expand(B)  # (B,)
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=device).expand(B)  # (B,)
    generators = []
    if bool((temperature > 0).any()):
        for s in seed if isinstance(seed, (list, tuple)) else [seed]:
            generators.append(torch.Generator(device=device).manual_seed(s if s is not None else torch.seed()))
    if eos_token_id is None:
        eos_token_id = getattr(model.generation_config, "eos_token_id", None) or model.config.eos_token_id
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []), device=device)
    pad = int(eos[0]) if eos.numel() else 0

    out = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
    # a bar only when asked for and on a terminal (disable=None: tqdm's own TTY check)
    bar = tqdm(total=max_new_tokens, desc=progress, leave=False, disable=True if progress is None else None)
    _sync(device)
    t0 = time.perf_counter()
    if prefilled is None:
        logits = prefill(model, input_ids, attention_mask, cache, max_new_tokens)
    else:
        logits = prefilled
    next_pos = positions[:, -1:] + 1  # (B, 1)
    _sync(device)
    t1 = time.perf_counter()
    steps = 0
    for i in range(max_new_tokens):
        ids = sample(logits, temperature, top_p, generators)
        ids = torch.where(done, pad, ids)
        out[:, i] = ids
        if eos.numel():
            hit = torch.isin(ids, eos) & ~done
            lengths = torch.where(hit, i + 1, lengths)
            done |= hit
        bar.update(1)
        lp = token_logprobs(logits, ids, logprobs) if logprobs is not None else None
        stop = on_step is not None and on_step(i, ids, lp)
        if stop or i == max_new_tokens - 1 or (stop_at_eos and eos.numel() and bool(done.all())):
            out = out[:, : i + 1]
            break
        logits = model(
            input_ids=ids[:, None], attention_mask=mask[:, : n + i + 1], position_ids=next_pos + i,
            past_key_values=cache, use_cache=True,
        ).logits[:, -1]
        steps += 1
    _sync(device)
    t2 = time.perf_counter()
    bar.close()
    return GenerationResult(out, lengths.tolist(), t1 - t0, t2 - t1, steps)
