"""Continuous (iteration-level) batching: sequences decode together through one running cache; each joins
between two decode steps once its own prefill (chunked, in a cache of its own) is done, and leaves at the
step it ends. Rows are left-padded to a common length; the attention mask marks the padding, and columns
that are padding in every row are trimmed when a row leaves and they are a quarter of the batch's.

    batch = RunningBatch(model)
    p = Prefill(model, make_cache("infinigen", model), ids, chunk=512)
    while not p.step(): ...                        # interleave with batch steps
    batch.join(p, SamplingParams(temperature=0.0), max_tokens=64)
    ids, lp = batch.sample()                      # (B,) next ids, from the last logits
    order = batch.retain([0, 2])                  # rows that go on (the others ended), in their new order
    batch.forward(ids[order])                     # their next logits

The caches implement `join` and `retain` (layer.Rebatch); a sequence's tokens do not depend on what else
shares its batch (tests/test_batching.py).
"""

from __future__ import annotations

from functools import partial

import torch

from ..model import static
from ..model.kv import StepCache
from .prefix import WINDOW
from . import threads
from .sampling import Sampler, SamplingParams, token_logprobs


class Prefill:
    """One prompt (a list of ids) run into a cache of its own, `chunk` tokens per step(). logprobs = k: also
    each prompt token's logprob given the ones before it, and the k most likely alternatives (scoring, echo).

    prefix: a PrefixStore (prefix.py) whose namespace is this model's and this cache's (`prefix.cache_namespace`).
    The longest stored prefix of the prompt is restored into the cache instead of computed (`cached` tokens; not
    when the prompt's logprobs are asked: they need its logits), and each whole block the prefill computes is
    offered to the store. The chunks are then the store's blocks, from position 0: a prompt computes the same
    arithmetic with or without a stored prefix (a chunk boundary elsewhere changes the last bits).

    reserve: the tokens the cache will hold in all (the prompt and the most it may generate), sized now."""

    def __init__(self, model, cache, ids: list[int], chunk: int = 512, logprobs: int | None = None, prefix=None,
                 reserve: int = 0):
        self.model, self.cache, self.chunk, self.k = model, cache, chunk, logprobs
        self.device = next(model.parameters()).device
        self.ids = torch.tensor([ids], dtype=torch.long)  # (1, n)
        self.done = 0  # prompt tokens in the cache
        self.cached = 0  # of those, restored from the prefix store
        self.logits = None  # (1, V) after the last chunk
        self.prompt_logprobs = ([], [], []) if logprobs is not None else None  # tokens 1..n-1: chosen, top, ids
        if isinstance(cache, StepCache):  # buffers sized once, not grown chunk by chunk: the prompt, or `reserve` tokens
            cache.reserve(max(len(ids), reserve))  # in all (its decode steps too: joining a batch then moves nothing)
        self.prefix, self.keys, self.ends = prefix, [], set()
        if prefix is not None:
            self.chunk, self.keys = prefix.block, prefix.keys(ids)
            windowed = partial(cache.window_blocks, block=prefix.block)
            self.ends = prefix.window_ends(len(ids), windowed)  # blocks whose window layers' rows are offered too
            _, payloads = prefix.lookup(ids, 0 if logprobs is not None else len(ids) - 1, self.keys, windowed)
            if payloads:
                try:
                    self.done = self.cached = cache.restore_prefix(model, payloads, prefix.block)
                except ValueError as e:  # a block of another layout under this namespace: computed instead
                    prefix.unusable(str(e))

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    @torch.inference_mode()
    def step(self) -> bool:
        """Run the next chunk; True once the whole prompt is in."""
        threads.prefill_chunk(self.model.backend)  # every core: a prompt's bits must not follow the load
        end = min(self.done + self.chunk, self.length)
        if self.k is not None:
            keep = 0  # every position's logits
        else:  # the last chunk's last position; none before it (the LM head is ~30 ms a chunk on 2 cores)
            keep = 1 if end == self.length else torch.empty(0, dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=self.ids[:, self.done : end].to(self.device),
            attention_mask=torch.ones(1, end, dtype=torch.long, device=self.device),
            position_ids=torch.arange(self.done, end, device=self.device)[None],
            past_key_values=self.cache, use_cache=True, logits_to_keep=keep,
        )
        if self.k is not None:  # position t predicts token t + 1 of the prompt
            nxt = self.ids[0, self.done + 1 : end + 1].to(self.device)  # (T or T - 1,)
            got = token_logprobs(out.logits[0, : nxt.shape[0]], nxt, self.k)
            for acc, x in zip(self.prompt_logprobs, got):
                acc.extend(x.tolist())
        self.done = end
        if self.prefix is not None and end % self.chunk == 0:  # a whole block: offered to the store
            b = end // self.chunk - 1
            self.prefix.put(self.keys[b], lambda: self.cache.prefix_block(b * self.chunk, end))
            if b in self.ends:
                self.prefix.put(self.keys[b] + WINDOW, lambda: self.cache.prefix_block(b * self.chunk, end, True))
        if end == self.length:
            self.logits = out.logits[:, -1]
        return end == self.length


def prefill_prefix(model, input_ids: torch.Tensor, cache, max_new_tokens: int, prefix,
                   progress=None) -> tuple[torch.Tensor, int]:
    """A batch of one prompt input_ids (1, n) into `cache` through the prefix store `prefix`: its longest stored
    prefix restored, the rest prefilled in the store's blocks, each whole block offered to it (Prefill);
    progress(tokens in the cache) after each block, as a plain prefill reports. Returns the last logits (1, V) and
    the tokens restored."""
    if input_ids.shape[0] != 1:
        raise ValueError("a prefix store serves one prompt at a time: generate each prompt in its own call, or serve")
    prefix.check(model, cache)
    p = Prefill(model, cache, input_ids[0].tolist(), prefix=prefix, reserve=input_ids.shape[1] + max_new_tokens)
    done = False
    while not done:
        done = p.step()
        if progress is not None:
            progress(p.done)
    return p.logits, p.cached


def bucket(rows: int) -> int:
    """The rows a static step runs for a batch of `rows`: 1, 2, 4, 8, then multiples of 8 (a batch padded up to
    its bucket keeps its CUDA graph while rows join and leave within it)."""
    return 1 << (rows - 1).bit_length() if rows <= 8 else -(-rows // 8) * 8


class RunningBatch:
    """The rows decoding together: their cache, attention mask (B, N), next positions (B, 1), next-token
    logits (B, V), sampler (each row's knobs, generator and penalty counts), and the tokens each may still
    produce (sizes the cache's room).

    Where graphs are on (static.graphs_on: CUDA), rows that have decoded STABLE steps together go on in static
    steps (one CUDA graph a step) over their bucket of rows, the cache padded with unused rows up to it; a row
    then joins into an unused place and leaves by the last row moving into its place, in place (the graph
    stays), as long as the batch fits its bucket and the cache's columns; otherwise the cache goes back to the
    batch's rows and eager steps, until the rows stay again."""

    STABLE = 2  # eager steps before static ones: capturing a graph costs about two steps

    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = None
        self.mask = self.pos = self.logits = None
        self.padded = False  # some row has padding columns (else decode steps pass no mask, as generate does)
        self.static: static.StaticDecoder | None | bool = None  # the rows' static steps (False: not for them)
        self.stable = 0  # steps decoded since the cache last changed shape
        self.sampler = Sampler(self.device, model.config.vocab_size)
        self.remaining: list[int] = []

    def __len__(self) -> int:
        return len(self.remaining)

    def room(self) -> int:
        return max(self.remaining, default=0)

    @torch.inference_mode()
    def join(self, p: Prefill, params: SamplingParams, max_tokens: int, cache=None) -> None:
        """Add a finished prefill as the last row; cache: a fork of p's to decode from instead of p's own
        (several rows from one prefill: n choices)."""
        n = p.length
        row = dict(mask=torch.ones(1, n, dtype=torch.long, device=self.device),
                   pos=torch.full((1, 1), n, dtype=torch.long, device=self.device), logits=p.logits)
        cache = cache if cache is not None else p.cache
        in_place = self._fits(n, max(self.room(), max_tokens))
        if not in_place:
            self._eager()
        self.sampler.add(params, p.ids[0])  # first: a seed torch refuses leaves the batch as it was
        self.remaining.append(max_tokens)
        try:
            if in_place:  # into the first unused row of the static steps' bucket
                self._settled()
                self.cache.place(len(self) - 1, cache)
                self.static.set_row(len(self) - 1, torch.nn.functional.pad(row["mask"][0], (self.mask.shape[1] - n, 0)),
                                    n)
            elif self.cache is None:  # the first row: its cache becomes the batch's, sized for the whole run
                cache.retain([0], 0, self.room())
            else:
                self.cache.join(cache, self.room())
        except Exception:
            self.remaining.pop()
            self.sampler.retain(list(range(len(self.remaining))))
            raise
        if self.cache is None:
            self.cache = cache
            for k, v in row.items():
                setattr(self, k, v)
            return
        N = max(self.mask.shape[1], n)
        self.padded = self.padded or self.mask.shape[1] != n
        pad = lambda m: torch.nn.functional.pad(m, (N - m.shape[1], 0))  # left padding: zeros
        self.mask = torch.cat([pad(self.mask), pad(row["mask"])])
        for k in ("pos", "logits"):
            setattr(self, k, torch.cat([getattr(self, k), row[k]]))

    @torch.inference_mode()
    def sample(self, logprobs: int | None = None):
        """Next ids (B,) from the current logits, and (chosen, top values, top ids) logprobs if asked."""
        ids = self.sampler(self.logits)
        self.sampler.observe(ids)
        return ids, (token_logprobs(self.logits, ids, logprobs) if logprobs is not None else None)

    @torch.inference_mode()
    def retain(self, rows: list[int]) -> list[int]:
        """Keep only `rows`; returns them in their new order: a kept row among the first len(rows) keeps its
        place, and the places of those that left are taken by the kept rows after them (a copy of those
        rows in the cache, not of the batch). Columns that are padding in every kept row go once they are a
        quarter of the batch's (dropping them copies every row; not in static steps, whose buffers stay)."""
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
        in_place = self.static and bucket(k) == bucket(len(self))
        trim = 0 if in_place else int(mask.any(0).long().argmax())  # leading all-padding columns
        if 4 * trim < mask.shape[1]:
            trim = 0
        self.remaining = [self.remaining[i] for i in order]
        self.sampler.retain(order)
        if in_place:  # the rows after the kept ones move into the places of those that left
            moved = [(i, r) for i, r in enumerate(order) if r != i]
            self._settled()
            self.cache.move_rows([i for i, _ in moved], [r for _, r in moved])
            self.static.move_rows([i for i, _ in moved], [r for _, r in moved])
            self.static.clear_rows(list(range(k, self.static.inputs.ids.shape[0])))
        else:
            self.static, self.stable = None, 0
            self.cache.retain(order, trim, self.room())  # (padding rows of a bucket left behind too)
        self.mask = mask[:, trim:]
        self.padded = not bool(self.mask.all())  # (a host read between steps, as the trim's)
        self.pos, self.logits = self.pos[index], self.logits[index]
        return order

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> None:
        """Feed each row's new token ids (B,): the next logits (through static steps once the rows are STABLE)."""
        fixed = self._static()
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self), 1)], dim=1)
        ids = ids.view(-1).to(self.device)
        if fixed:  # the bucket's rows: those unused decode a token 0 nobody reads
            rows = fixed.inputs.ids.shape[0]
            padded = torch.nn.functional.pad(ids, (0, rows - len(self)))
            self.logits = fixed.step(padded)[: len(self)]  # (a graph's buffer: read before the next step)
        else:
            self.logits = self.model.decode(self.cache, ids, self.pos, self.mask if self.padded else None)
        self.stable += 1
        self.pos = self.pos + 1
        self.remaining = [r - 1 for r in self.remaining]

    def _static(self):
        """The rows' static decoder where graphs are on (static.graphs_on: CUDA, unless turned off), the model and
        cache serve static steps, the rows have decoded STABLE steps together and their tokens fit the cache's
        buffers; else None (eager steps). Made over the batch's bucket of rows (the cache padded with copies of
        its last row, unused)."""
        if self.static is not None or self.stable < self.STABLE:
            return self.static
        self.static = False
        if not (static.graphs_on(self.model, self.device) and static.serves(self.model, self.cache)):
            return False
        B, rows = len(self), bucket(len(self))
        if rows > B:
            self.cache.retain(list(range(B)) + [B - 1] * (rows - B), 0, self.room())
        mask = torch.nn.functional.pad(self.mask, (0, 0, 0, rows - B))  # unused rows: nothing valid
        pos = torch.nn.functional.pad(self.pos, (0, 0, 0, rows - B))
        try:
            fixed = static.StaticDecoder(self.model, self.cache, mask if (self.padded or rows > B) else None, pos,
                                         graph=self.device.type == "cuda")
        except (static.StaticError, ValueError):  # (buffers of different capacities)
            fixed = None
        if fixed is None or fixed.n + self.room() > fixed.capacity:
            self.cache.retain(list(range(B)), 0, self.room())
            return False
        self.static = fixed
        return fixed

    def _fits(self, n: int, room: int) -> bool:
        """Whether a prompt of n tokens joins the static steps' bucket in place, with room for `room` more."""
        fixed = self.static
        if not fixed:
            return False
        return len(self) < fixed.inputs.ids.shape[0] and n <= fixed.n and fixed.n + room <= fixed.capacity

    def _eager(self) -> None:
        """Back to eager steps over the batch's own rows (the bucket's unused ones dropped)."""
        if self.static and len(self) < self.static.inputs.ids.shape[0]:
            self.cache.retain(list(range(len(self))), 0, self.room())
        self.static, self.stable = None, 0

    def _settled(self) -> None:
        """The device done with the cache's buffers before the host writes them (a pinned pool: host memory)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
