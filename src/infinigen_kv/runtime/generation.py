"""The decode loop: prefill once, then one token per step through whatever cache is given.

`model.generate(..., past_key_values=cache)` works with every cache here too; this loop exists so that
prefill and decode are timed separately and nothing but the model and the cache runs per step.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .. import heap
from ..model import static
from ..model.kv import StepCache
from . import threads
from .batching import prefill_prefix
from .sampling import Sampler, params_list, token_logprobs


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # (B, steps) generated ids; after a sequence's EOS: pad/EOS ids
    lengths: list[int]  # generated tokens per sequence, up to and including its EOS
    prefill_s: float
    decode_s: float
    decode_steps: int  # forward passes after prefill
    cached_tokens: int = 0  # prompt tokens restored from a prefix store instead of prefilled

    @property
    def decode_tokens_per_s(self) -> float:
        """Batch x decode steps / decode seconds (every sequence of the batch computes each step)."""
        return self.tokens.shape[0] * self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # only at the prefill/decode boundaries, for the timings


# Columns of one prefill forward of a cache made here (a long prompt's activations: batch x this). On CPU 512: a
# process's peak memory is its prefill's, whose activations (and the weights converted for the BLAS, and what the
# heap keeps of them between layers) grow with the chunk, while the products stay compute-bound from a few hundred
# rows (a 4k prompt on the 0.5B: peak ~100 MiB over the memory before it against 230-260 MiB at 2,048, prefilled
# 1.04-1.10x faster; scripts/dev/prefill_chunk_ab.py). On a GPU 2,048: its memory holds far more, and fewer chunks
# launch fewer kernels.
PREFILL_CHUNK = 512
GPU_PREFILL_CHUNK = 2048


def chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) columns of a prompt of n columns in chunks counted from its end: a left-padded row meets the
    boundaries at the same distances from its last token in any batch as alone (so it is computed alike)."""
    first = n % chunk or chunk
    return [(0, min(first, n))] + [(e - chunk, e) for e in range(first + chunk, n + 1, chunk)]


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
            max_new_tokens: int = 0, progress=None) -> torch.Tensor:
    """The prompt input_ids (B, n) (left-padded, with attention_mask (B, n)) into `cache`, sized for
    max_new_tokens more: the last position's logits (B, V). A cache made here takes a prompt longer than
    PREFILL_CHUNK (on a GPU GPU_PREFILL_CHUNK) in chunks (`chunks`): a prefill's activations (the MLP's, B x chunk x
    intermediate) stay that size whatever the prompt's length; progress(tokens) is called after each chunk."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    n = input_ids.shape[1]
    bounds = [(0, n)]
    if isinstance(cache, StepCache):  # ours: buffers sized for the whole run, none grows inside decode
        cache.reserve(n + max_new_tokens)
        bounds = chunks(n, PREFILL_CHUNK if input_ids.device.type == "cpu" else GPU_PREFILL_CHUNK)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)  # (B, n): left padding aware
    for start, end in bounds:
        threads.prefill_chunk(model.backend)  # every core: a prompt's bits must not follow the load
        logits = model(
            input_ids=input_ids[:, start:end], attention_mask=attention_mask[:, :end],
            position_ids=positions[:, start:end], past_key_values=cache, use_cache=True, logits_to_keep=1,
        ).logits[:, -1]
        if progress is not None:
            progress(end)
        threads.decode_step(model.backend)  # a long prefill follows the machine's load chunk by chunk
        heap.trim()  # what the chunk freed (its activations) back to the OS before the next (heap.py)
    return logits


class PrefillProgress:
    """A long prefill's progress on stderr, `progress(tokens done)` after each chunk: a tqdm bar on a terminal (shown
    once the prefill has taken 2 s), elsewhere (a log, a pipe) a line every ~10 s: tokens done, tokens/s, time left."""

    EVERY_S = 10.0

    def __init__(self, total: int, desc: str):
        self.total, self.desc = total, desc
        self.start = self.last = time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            self.bar = tqdm(total=total, desc=f"{desc}: prefill", unit="tok", leave=False, delay=2, file=sys.stderr)

    def __call__(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
        elif done < self.total and (now := time.perf_counter()) - self.last >= self.EVERY_S:
            rate = max(done, 1) / max(now - self.start, 1e-9)
            print(f"infinigen: {self.desc}: prefill {done}/{self.total} tokens ({now - self.start:.0f} s, "
                  f"{rate:.0f} tokens/s, ~{(self.total - done) / rate:.0f} s left)", file=sys.stderr, flush=True)
            self.last = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _first_logits(model, input_ids, attention_mask, cache, max_new_tokens: int, prefilled, prefix, progress):
    """(the logits (B, V) the first new token is sampled from, prompt tokens restored from a prefix store): given
    (`prefilled`), or from a prefill through the store (batching.prefill_prefix), or from a plain prefill; either
    prefill's progress on stderr when `progress` names the run."""
    if prefilled is not None:
        return prefilled, 0
    shown = PrefillProgress(input_ids.shape[1], progress) if progress is not None else None
    try:
        if prefix is not None:
            return prefill_prefix(model, input_ids, cache, max_new_tokens, prefix, shown)
        return prefill(model, input_ids, attention_mask, cache, max_new_tokens, shown), 0
    finally:
        if shown is not None:
            shown.close()


def _decoder(model, cache, attention_mask, mask, unpadded: bool, positions, max_new_tokens: int, cuda_graph):
    """The run's decode step, (ids (B,), step i) -> the next logits (B, V), from positions (B, 1) of the first: static
    steps (one CUDA graph a step on CUDA) where graphs are on and the model, cache and run allow them (the run's
    tokens fit the cache's buffers), else the eager step over the run's mask (B, n + new)."""
    if max_new_tokens > 1 and static.graphs_on(model, positions.device, cuda_graph) and static.serves(model, cache):
        fixed = static.StaticDecoder(model, cache, None if unpadded else attention_mask, positions,
                                     graph=positions.device.type == "cuda")
        if fixed.n + max_new_tokens - 1 <= fixed.capacity:
            return lambda ids, i: fixed.step(ids)
    n = attention_mask.shape[1]
    return lambda ids, i: model.decode(cache, ids, positions + i, None if unpadded else mask[:, : n + i + 1])


def _run_mask(attention_mask: torch.Tensor, max_new_tokens: int):
    """The run's mask (B, n + new), preallocated (each step uses a longer view, nothing is concatenated), the
    prompt's positions (B, n) (left padding aware), and whether nothing is padded: then decode steps pass no
    mask (one check now; transformers would test an all-ones mask every step, a host sync on a GPU)."""
    B, n = attention_mask.shape
    mask = torch.ones(B, n + max_new_tokens, dtype=attention_mask.dtype, device=attention_mask.device)
    mask[:, :n] = attention_mask
    positions = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)
    return mask, positions, bool(attention_mask.all())


def _sampler(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: list, seed) -> Sampler:
    """The batch's Sampler: one generator for all rows, or one per row for a list of seeds; each row's prompt
    tokens where a repetition penalty needs them."""
    prompts = [row[m.bool()] for row, m in zip(input_ids, attention_mask)] if any(
        p.repetition_penalty != 1.0 for p in params) else None
    per_row = isinstance(seed, (list, tuple))
    return Sampler.for_batch(input_ids.device, model.config.vocab_size, params, prompts,
                             shared_seed=None if per_row else seed, shared=not per_row)


def _stop_ids(model, eos_token_id, ignore_eos: bool, device):
    """(the ids that end a sequence (none with ignore_eos), the id written after a sequence ended)."""
    if eos_token_id is None:
        eos_token_id = model.config.eos_token_id
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []), device=device)
    pad = int(eos[0]) if eos.numel() else 0
    return (eos[:0] if ignore_eos else eos), pad


def _note_eos(ids: torch.Tensor, eos: torch.Tensor, done: torch.Tensor, lengths: torch.Tensor, i: int) -> None:
    """Sequences whose new token ids (B,) at step i is their first EOS: done, their length i + 1 (in place)."""
    if eos.numel():
        hit = torch.isin(ids, eos) & ~done
        lengths.masked_fill_(hit, i + 1)
        done |= hit


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
    top_k: int | list[int] = 0,
    min_p: float | list[float] = 0.0,
    presence_penalty: float | list[float] = 0.0,
    frequency_penalty: float | list[float] = 0.0,
    repetition_penalty: float | list[float] = 1.0,
    logit_bias: dict | list[dict] | None = None,
    ignore_eos: bool = False,
    prefix=None,
    cuda_graph: bool | None = None,
) -> GenerationResult:
    """Generate up to max_new_tokens for input_ids (B, n) (left-padded, with attention_mask (B, n)).

    The sampling knobs (temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty,
    repetition_penalty, logit_bias: sampling.SamplingParams) are one value for the batch or one per sequence (a
    list); a list of seeds gives each sequence its own generator. on_step(step, ids (B,), logprobs) is called
    after each new token (streaming); it returns True to stop. logprobs is None unless `logprobs` = k is given:
    then it is (logprob of each chosen id (B,), the k largest logprobs (B, k), their ids (B, k)), of the model's
    own distribution (before the sampling knobs, as OpenAI-style servers report them). Stops early once every
    sequence has produced an EOS (when stop_at_eos); ignore_eos: an EOS ends nothing (lengths stay
    max_new_tokens). prefilled: the prefill's last logits (B, V) when `cache` already holds input_ids (a `fork`
    of a cache prefilled by `prefill`): decoding starts from them. prefix: a PrefixStore (runtime/prefix.py) for a
    batch of one: the prompt's longest stored prefix is restored, not prefilled (`cached_tokens`; prefill_prefix).
    cuda_graph: on CUDA, one CUDA graph a step where model and cache allow it (model/static.py; None: as the model's
    backend says)."""
    device, B = input_ids.device, input_ids.shape[0]
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    mask, positions, unpadded = _run_mask(attention_mask, max_new_tokens)
    params = params_list(B, seed=seed, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                         presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                         repetition_penalty=repetition_penalty, logit_bias=logit_bias)
    sampler = _sampler(model, input_ids, attention_mask, params, seed)
    eos, pad = _stop_ids(model, eos_token_id, ignore_eos, device)

    out = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
    # a bar only when asked for and on a terminal (disable=None: tqdm's own TTY check)
    bar = tqdm(total=max_new_tokens, desc=progress, leave=False, disable=True if progress is None else None)
    threads.before_prefill(model.backend)  # its thread count from the machine's load now (threads.py)
    _sync(device)
    t0 = time.perf_counter()
    logits, cached = _first_logits(model, input_ids, attention_mask, cache, max_new_tokens, prefilled, prefix, progress)
    decode = _decoder(model, cache, attention_mask, mask, unpadded, positions[:, -1:] + 1, max_new_tokens, cuda_graph)
    threads.decode(model.backend)  # the decode steps on the cores the load leaves (their bits do not follow it)
    _sync(device)
    t1 = time.perf_counter()
    steps = 0
    for i in range(max_new_tokens):
        ids = sampler(logits)
        ids = torch.where(done, pad, ids)
        sampler.observe(ids)
        out[:, i] = ids
        _note_eos(ids, eos, done, lengths, i)
        bar.update(1)
        lp = token_logprobs(logits, ids, logprobs) if logprobs is not None else None
        stop = on_step is not None and on_step(i, ids, lp)
        if stop or i == max_new_tokens - 1 or (stop_at_eos and eos.numel() and bool(done.all())):
            out = out[:, : i + 1]
            break
        logits = decode(ids, i)
        threads.decode_step(model.backend)  # on CPU: the thread count of the next steps, from the machine's load
        steps += 1
    _sync(device)
    t2 = time.perf_counter()
    bar.close()
    return GenerationResult(out, lengths.tolist(), t1 - t0, t2 - t1, steps, cached)
