"""Continuous (iteration-level) batching: sequences decode together through one running cache; each joins
between two decode steps once its own prefill (chunked, in a cache of its own) is done, and leaves at the
step it ends. Rows are left-padded to a common length; the attention mask marks the padding, and columns
that are padding in every row are trimmed when a row leaves and they are a quarter of the batch's.

    batch = RunningBatch(model)
    p = Prefill(model, make_cache("infinigen", model), ids, chunk=512)
    while not p.step(): ...                        # interleave with batch steps
    batch.join(p, temperature=0.0, top_p=1.0, seed=None, max_tokens=64)
    ids, lp = batch.sample()                      # (B,) next ids, from the last logits
    order = batch.retain([0, 2])                  # rows that go on (the others ended), in their new order
    batch.forward(ids[order])                     # their next logits

The caches implement `join` and `retain` (layer.Rebatch); a sequence's tokens do not depend on what else
shares its batch (tests/test_batching.py).
"""

from __future__ import annotations

import torch

from .generation import sample, token_logprobs


class Prefill:
    """One prompt (a list of ids) run into a cache of its own, `chunk` tokens per step()."""

    def __init__(self, model, cache, ids: list[int], chunk: int = 512):
        self.model, self.cache, self.chunk = model, cache, chunk
        self.device = next(model.parameters()).device
        self.ids = torch.tensor([ids], dtype=torch.long)  # (1, n)
        self.done = 0  # prompt tokens in the cache
        self.logits = None  # (1, V) after the last chunk
        if hasattr(cache, "reserve"):
            cache.reserve(len(ids))  # buffers sized for the prompt, not grown chunk by chunk

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    @torch.inference_mode()
    def step(self) -> bool:
        """Run the next chunk; True once the whole prompt is in."""
        end = min(self.done + self.chunk, self.length)
        out = self.model(
            input_ids=self.ids[:, self.done : end].to(self.device),
            attention_mask=torch.ones(1, end, dtype=torch.long, device=self.device),
            position_ids=torch.arange(self.done, end, device=self.device)[None],
            past_key_values=self.cache, use_cache=True, logits_to_keep=1,
        )
        self.done = end
        if end == self.length:
            self.logits = out.logits[:, -1]
        return end == self.length


class RunningBatch:
    """The rows decoding together: their cache, attention mask (B, N), next positions (B, 1), next-token
    logits (B, V), sampling knobs (B,) and generators, and the tokens each may still produce (sizes the
    cache's room)."""

    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = None
        self.mask = self.pos = self.logits = self.temperature = self.top_p = None
        self.generators: list[torch.Generator] = []
        self.remaining: list[int] = []

    def __len__(self) -> int:
        return len(self.remaining)

    def room(self) -> int:
        return max(self.remaining, default=0)

    @torch.inference_mode()
    def join(self, p: Prefill, temperature: float, top_p: float, seed: int | None, max_tokens: int) -> None:
        """Add a finished prefill as the last row."""
        gen = torch.Generator(device=self.device).manual_seed(seed if seed is not None else torch.seed())
        n = p.length
        row = dict(mask=torch.ones(1, n, dtype=torch.long, device=self.device),
                   pos=torch.full((1, 1), n, dtype=torch.long, device=self.device), logits=p.logits,
                   temperature=torch.tensor([temperature], dtype=torch.float32, device=self.device),
                   top_p=torch.tensor([top_p], dtype=torch.float32, device=self.device))
        self.remaining.append(max_tokens)
        self.generators.append(gen)
        if self.cache is None:  # the first row: its cache becomes the batch's, sized for the whole run
            self.cache = p.cache
            self.cache.retain([0], 0, self.room())
            for k, v in row.items():
                setattr(self, k, v)
            return
        self.cache.join(p.cache, self.room())
        N = max(self.mask.shape[1], n)
        pad = lambda m: torch.nn.functional.pad(m, (N - m.shape[1], 0))  # left padding: zeros
        self.mask = torch.cat([pad(self.mask), pad(row["mask"])])
        for k in ("pos", "logits", "temperature", "top_p"):
            setattr(self, k, torch.cat([getattr(self, k), row[k]]))

    @torch.inference_mode()
    def sample(self, logprobs: int | None = None):
        """Next ids (B,) from the current logits, and (chosen, top values, top ids) logprobs if asked."""
        hot = bool((self.temperature > 0).any())
        ids = sample(self.logits, self.temperature, self.top_p, self.generators if hot else [])
        return ids, (token_logprobs(self.logits, ids, logprobs) if logprobs is not None else None)

    @torch.inference_mode()
    def retain(self, rows: list[int]) -> list[int]:
        """Keep only `rows`; returns them in their new order: a kept row among the first len(rows) keeps its
        place, and the places of those that left are taken by the kept rows after them (a copy of those
        rows in the cache, not of the batch). Columns that are padding in every kept row go once they are a
        quarter of the batch's (dropping them copies every row)."""
        k, keep = len(rows), set(rows)
        if k == len(self):
            return list(range(k))
        if not rows:
            self.__init__(self.model)
            return []
        movers = iter(r for r in sorted(rows) if r >= k)
        order = [i if i in keep else next(movers) for i in range(k)]
        index = torch.tensor(order, device=self.device)
        mask = self.mask[index]
        trim = int(mask.any(0).long().argmax())  # leading all-padding columns
        if 4 * trim < mask.shape[1]:
            trim = 0
        self.remaining = [self.remaining[i] for i in order]
        self.generators = [self.generators[i] for i in order]
        self.cache.retain(order, trim, self.room())
        self.mask = mask[:, trim:]
        self.pos, self.logits = self.pos[index], self.logits[index]
        self.temperature, self.top_p = self.temperature[index], self.top_p[index]
        return order

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> None:
        """Feed each row's new token ids (B,): the next logits."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self), 1)], dim=1)
        self.logits = self.model(
            input_ids=ids.view(-1, 1).to(self.device), attention_mask=self.mask, position_ids=self.pos,
            past_key_values=self.cache, use_cache=True,
        ).logits[:, -1]
        self.pos = self.pos + 1
        self.remaining = [r - 1 for r in self.remaining]
