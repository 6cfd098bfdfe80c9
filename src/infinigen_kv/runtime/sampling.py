"""The next-token sampler every method and loop shares (ig.generate, the server's running batch): per-row knobs,
so a row's tokens do not depend on what else shares its batch.

Per row, in the order vLLM applies them: logit_bias is added; repetition_penalty divides positive logits (and
multiplies negative ones) of every token in the prompt or the output so far; frequency_penalty x (times the
token was generated) and presence_penalty x (generated at all) are subtracted. Greedy rows (temperature 0) take
the argmax of that; the others divide by temperature, keep the top_k most likely tokens, the smallest set
reaching top_p and those within min_p x the most likely one's probability, and draw with their own generator
(or one for the batch). Logprobs reported to clients are the model's own (before all of this), as OpenAI-style
servers report them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

NUCLEUS_TOPK = 1024


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus: the smallest set of tokens reaching this probability
    top_k: int = 0  # the k most likely tokens only; 0: all
    min_p: float = 0.0  # tokens at least min_p x the most likely one's probability only
    presence_penalty: float = 0.0  # subtracted from a token's logit once it was generated ([-2, 2])
    frequency_penalty: float = 0.0  # subtracted per time the token was generated ([-2, 2])
    repetition_penalty: float = 1.0  # > 1: tokens of the prompt or the output so far are less likely
    logit_bias: dict | None = None  # token id -> added to its logit ([-100, 100])
    seed: int | None = None  # this row's generator (None: a random seed)

    def __post_init__(self):
        checks = [(self.temperature >= 0, "temperature must be >= 0"), (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
                  (self.top_k >= 0, "top_k must be >= 0"), (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
                  (self.repetition_penalty > 0, "repetition_penalty must be > 0")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def plain(self) -> bool:
        """Nothing but temperature and top_p (and the seed): the logits need no processing."""
        return not (self.penalized or self.logit_bias or self.top_k or self.min_p)


_KNOBS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class Sampler:
    """The sampling state of a batch's rows: their knobs (B,), generators, and, where a row has penalties, the
    counts (B, V) of the tokens it generated and the tokens of its prompt and output (repetition_penalty)."""

    def __init__(self, device, vocab: int):
        self.device, self.vocab = torch.device(device), vocab
        self.params: list[SamplingParams] = []
        self.generators: list[torch.Generator | None] = []  # per row (None: greedy)
        self.shared = None  # one generator drawing for the whole batch (ig.generate with one seed)
        self.knobs = {k: torch.empty(0, device=self.device) for k in _KNOBS}  # (B,) each
        self.counts = None  # (B, V) int32: times each token was generated (rows with penalties only matter)
        self.seen = None  # (B, V) bool: tokens of the prompt or the output so far
        self.bias = None  # (B, V) float32: logit_bias of every row (zeros where none)

    def __len__(self) -> int:
        return len(self.params)

    @classmethod
    def for_batch(cls, device, vocab: int, params: list[SamplingParams], prompts: list | None = None,
                  shared_seed: int | None = None, shared: bool = False) -> "Sampler":
        """A sampler of len(params) rows; prompts: each row's prompt ids (a list or a 1-D tensor without padding),
        needed by repetition_penalty; shared: one generator (seeded with shared_seed, or at random) draws for the
        whole batch instead of one per row."""
        s = cls(device, vocab)
        for i, p in enumerate(params):
            s.add(p, prompts[i] if prompts is not None else None)
        if shared and any(p.temperature > 0 for p in params):
            s.shared = _generator(s.device, shared_seed)
        return s

    def add(self, p: SamplingParams, prompt=None) -> None:
        """A new last row with knobs p; prompt: its prompt ids (for repetition_penalty)."""
        B, dev = len(self), self.device
        self.params.append(p)
        self.generators.append(_generator(dev, p.seed) if p.temperature > 0 else None)
        for k in _KNOBS:
            self.knobs[k] = torch.cat([self.knobs[k], torch.tensor([float(getattr(p, k))], device=dev)])
        if p.penalized and self.counts is None:
            self.counts = torch.zeros(B, self.vocab, dtype=torch.int32, device=dev)
            self.seen = torch.zeros(B, self.vocab, dtype=torch.bool, device=dev)
        if self.counts is not None:
            seen = torch.zeros(1, self.vocab, dtype=torch.bool, device=dev)
            if p.repetition_penalty != 1.0 and prompt is not None and len(prompt):
                seen[0, torch.as_tensor(prompt, device=dev).long()] = True
            self.counts = torch.cat([self.counts, self.counts.new_zeros(1, self.vocab)])
            self.seen = torch.cat([self.seen, seen])
        if p.logit_bias and self.bias is None:
            self.bias = torch.zeros(B, self.vocab, device=dev)
        if self.bias is not None:
            row = torch.zeros(1, self.vocab, device=dev)
            for t, v in (p.logit_bias or {}).items():
                row[0, int(t)] = float(v)
            self.bias = torch.cat([self.bias, row])

    def retain(self, index: list[int]) -> None:
        """Keep rows `index`, in that order."""
        idx = torch.tensor(index, dtype=torch.long, device=self.device)
        self.params = [self.params[i] for i in index]
        self.generators = [self.generators[i] for i in index]
        self.knobs = {k: v[idx] for k, v in self.knobs.items()}
        for name in ("counts", "seen", "bias"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[idx] if index else None)

    def observe(self, ids: torch.Tensor) -> None:
        """The tokens ids (B,) each row just produced (the penalties' counts)."""
        if self.counts is not None:
            rows = torch.arange(len(self), device=self.device)
            self.counts[rows, ids] += 1
            self.seen[rows, ids] = True

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (B, V) after logit_bias and the penalties (float32; the input itself when nothing applies)."""
        if self.bias is None and self.counts is None:
            return logits
        x = logits.float()
        if self.bias is not None:
            x = x + self.bias
        if self.counts is not None:
            rep = self.knobs["repetition_penalty"][:, None]  # (B, 1)
            penal = torch.where(x > 0, x / rep, x * rep)
            x = torch.where(self.seen, penal, x)
            c = self.counts.float()
            x = x - self.knobs["frequency_penalty"][:, None] * c - self.knobs["presence_penalty"][:, None] * (c > 0)
        return x

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Next ids (B,) from logits (B, V)."""
        x = self.process(logits)
        greedy = x.argmax(-1)
        temperature = self.knobs["temperature"]
        if not any(p.temperature > 0 for p in self.params):  # known on the host: no sync to find out
            return greedy
        hot = temperature > 0
        probs = torch.softmax(x.float() / torch.where(hot, temperature, 1.0)[:, None], dim=-1)  # (B, V)
        probs = _truncate(probs, self.knobs["top_k"], self.knobs["top_p"], self.knobs["min_p"])
        if self.shared is not None:
            drawn = torch.multinomial(probs, 1, generator=self.shared).squeeze(-1)
        else:  # each hot row from its own generator: its draws do not depend on its batch-mates
            drawn = greedy.clone()
            for b, g in enumerate(self.generators):
                if g is not None:
                    drawn[b] = torch.multinomial(probs[b], 1, generator=g)[0]
        return torch.where(hot, drawn, greedy)


def _generator(device, seed: int | None) -> torch.Generator:
    """A generator seeded with `seed`, or at random (without reseeding torch's global one)."""
    seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator(device=device).manual_seed(seed)


def _truncate(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """probs (B, V) with the tokens outside each row's top_k, top_p nucleus and min_p set to 0."""
    if bool((min_p > 0).any()):  # (the most likely token stays: min_p's reference is in every top_k and nucleus)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    k_on, p_on = bool((top_k > 0).any()), bool((top_p < 1.0).any())
    if not (k_on or p_on):
        return probs
    V = probs.shape[-1]
    # The kept tokens usually lie in the top NUCLEUS_TOPK (a top-k is ~10x cheaper than sorting a 262k
    # vocabulary); where a row's nucleus would reach past them (their mass <= top_p), sort everything.
    width = min(V, max(NUCLEUS_TOPK, int(top_k.max())))
    sorted_p, order = probs.topk(width, dim=-1)
    if width < V and p_on and bool(((sorted_p.sum(-1) <= top_p) & (top_p < 1.0)).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(sorted_p.shape[-1], device=probs.device)
    drop = (rank[None] >= top_k[:, None]) & (top_k[:, None] > 0)  # outside the top k
    drop |= sorted_p.cumsum(-1) - sorted_p > top_p[:, None]  # past the smallest prefix reaching top_p
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))


def params_list(B: int, seed=None, **knobs) -> list[SamplingParams]:
    """One SamplingParams per row from knobs that are one value for the batch or a list of B values; a list of
    seeds gives each row its own; one seed (or None) is the batch's one generator's."""
    names = {f.name for f in fields(SamplingParams)}
    unknown = set(knobs) - names
    if unknown:
        raise TypeError(f"unknown sampling knob(s): {', '.join(sorted(unknown))}")
    rows = []
    for b in range(B):
        row = {k: (v[b] if isinstance(v, (list, tuple)) else v) for k, v in knobs.items() if v is not None}
        rows.append(SamplingParams(**row, seed=seed[b] if isinstance(seed, (list, tuple)) else None))
    return rows


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int):
    """(logprob of each chosen id (B,), the k largest logprobs (B, k), their ids (B, k)) of logits (B, V)."""
    full = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
    return (full.gather(-1, ids[:, None]).squeeze(-1), *full.topk(k, dim=-1))
