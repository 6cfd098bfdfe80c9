"""InfiniGen's speculation, the one place it lives: at layer l's attention input, layer l+1's partial query
(partial.py) is scored against layer l+1's partial key cache; the tokens within alpha of each head's best, at
most the budget, are the rows layer l+1 fetches (`Speculate.choose` returns them; the cache starts them).

First the tensor functions (no state): approximate scores, relative logits, the caps, the selection, the
per-layer budgets. Shapes: B sequences, H query heads, G KV heads, r = H / G, n past tokens, p partial
channels, d head size.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..budget import budget_caps
from ..keep import keep_source, layer_keep
from . import int8
from .fetch import Fetch
from .partial_scores import partial_scores
from .partial_scores import reference as partial_scores_reference


def approx_scores(q_partial: torch.Tensor, k_partial: torch.Tensor, scale: float,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Approximate attention logits of each past token for each query head, in float32 on every device (alpha
    and the budgets were tuned on float32 scores; bf16 ones tie).

    q_partial (B, G, r, p): the skewed partial queries of the r query heads sharing a KV head.
    k_partial (B, G, n, p): the partial key cache (float32, or bfloat16 / the model's dtype), or its int8 rows
    (B, G, n, p + 4) (int8.py). bias (B G, 1, n) or None: added (-inf where a position may not be attended:
    `keep_bias`), in the product's own op. Returns (B, G, r, n).
    """
    if k_partial.dtype == torch.int8:
        s = int8.scores(q_partial, k_partial, scale)
        return s if bias is None else s + bias.view(s.shape[0], s.shape[1], 1, -1)
    if k_partial.dtype in (torch.bfloat16, torch.float16):  # widened as read (one kernel on a GPU)
        return partial_scores(q_partial.float().contiguous(), k_partial, bias, float(scale))
    return partial_scores_reference(q_partial, k_partial, bias, scale)


def keep_bias(keep: torch.Tensor, G: int) -> torch.Tensor:
    """keep (B, 1, n) bool -> the scores' additive mask (B G, 1, n): 0 where True, -inf where False."""
    B, _, n = keep.shape
    bias = torch.zeros(B, 1, n, device=keep.device).masked_fill_(~keep, float("-inf"))
    return bias.expand(B, G, n).reshape(B * G, 1, n)


def relative(scores: torch.Tensor, keep: torch.Tensor | None, combine: str = "max") -> torch.Tensor:
    """scores (B, G, r, n) -> (B, G, n): each head's logits relative to its own maximum (0 at the max,
    -inf where keep (B, 1, n) is False), the r heads of a group combined by "max" or "mean"."""
    if keep is not None:
        scores = scores.masked_fill(~keep.unsqueeze(2), float("-inf"))
    rel = scores - scores.amax(dim=-1, keepdim=True)  # (B, G, r, n), each head's max at 0
    if rel.shape[2] == 1:  # one head a group (multi-head attention): nothing to combine
        return rel[:, :, 0]
    return rel.amax(dim=2) if combine == "max" else rel.mean(dim=2)


def fetch_cap(n: int, budget: float, max_num_kv: int | None, floor: int = 0) -> int:
    """Most entries a row of n may fetch: the budget's share of n (at least `floor`) or its token count, at most
    max_num_kv, at least 1 (host integers: this sizes a step's fetch without looking at the scores)."""
    cap = budget_caps(n, budget, floor)
    return min(cap, max_num_kv) if max_num_kv else cap


def row_caps(keep: torch.Tensor, budget: float, max_num_kv: int | None, floor: int = 0) -> torch.Tensor:
    """Per-row caps from keep (B, 1 or G, n): the budget of each valid length, in [1, max_num_kv]: (B, 1 or G)."""
    cap = budget_caps(keep.sum(-1), budget, floor)
    return cap.clamp_(max=max_num_kv) if max_num_kv else cap


def saves_bytes(n: int, cap: int, row: int, partial_row: int) -> bool:
    """Whether fetching at most `cap` of n rows (`row` bytes each) after scoring n partial keys (`partial_row`
    bytes each) reads fewer bytes than attending all n rows: if not, a step attends densely (a short past
    under the budget's floor), with no selection cost."""
    return n * partial_row + cap * row < n * row


SCATTERED = 2.0  # a chosen row costs about two of a sequential pass's: a CPU reads scattered rows at ~11 of 22 GB/s
# What speculation costs beyond the partial keys' bytes, as the bytes read in that time (~30 GB/s), from decode steps
# of the 0.5B at 4k on the 2-core EPYC (speculator.speculate's time, cProfile, B1 and B4): a layer's calls and the
# Python around them, ~65 us; each (sequence, KV head) row's scoring and selection in the step (cold partial keys,
# threads woken) beyond its bytes, ~10 us
LAYER_COST = 2.0e6
ROW_COST = 0.3e6
BYTES_PER_NS = 30.0  # the rate at which the costs above are counted as bytes


def head_cost(cache) -> float:
    """A (past token, query head)'s attention arithmetic as the bytes read in its time: the backend's constant for its
    kernel path (backend.head_ns: wall ns at 64 channels, measured once on a quiet machine and kept in the code, so
    that no timing moves what is computed) x the head size / 64 at BYTES_PER_NS; 0 without the kernels. Each query
    head scores and weighs every row it attends (7 a KV head on Qwen2.5), so a row read costs its bytes and r x this:
    on a 2-core Xeon dense attention at 4 x 4k takes ~2x its bytes' time."""
    return cache.backend.head_ns * BYTES_PER_NS * cache.arch.head_dim / 64


def layer_saving(cache, layer_idx: int, rows: int, n: int, row: int, partial_row: int,
                 head: float | None = None) -> float | None:
    """Bytes a decode step saves by speculating layer `layer_idx` over a past of n tokens in `rows` (sequence, KV head)
    rows (`row` K/V bytes a token, `partial_row` partial-key bytes): all of its K/V rows, less the partial keys scored,
    the chosen rows at SCATTERED each, its partial query's weights (speculating from the previous layer's input: at
    its own query there are none), LAYER_COST and ROW_COST a row; and the r query heads' arithmetic (head_cost each)
    over the rows left out, less the partial scores' (partial_ratio / 2 of a row's: p of the 2d channels a head
    multiplies; head: head_cost(cache), where the caller has it); None where its cap leaves none of the past out."""
    c = cache.config
    cap = fetch_cap(n, cache.budget_of(layer_idx), c.max_num_kv, c.min_budget)
    if cap >= n:
        return None
    projected = cache.pq.weight_bytes(layer_idx) if cache.speculate_from == "previous" else 0
    head = head_cost(cache) if head is None else head
    arithmetic = cache.arch.group * head * (n * (1 - c.partial_ratio / 2) - cap)
    return rows * (n * row - n * partial_row - SCATTERED * cap * row - ROW_COST + arithmetic) - projected - LAYER_COST


def speculation_pays(saved: float, total: float, share: float) -> bool:
    """Whether a step should speculate: the bytes it saves (layer_saving's, summed) are at least `share` of the
    step's bytes (weights + all K/V): a margin for what the count leaves out. Below it the selection costs
    what it saves: a short context on a model whose weights are most of the step, or a small model's many layers
    at a few thousand tokens."""
    return saved >= share * total


def layer_scales(recall: list, lo: float = 0.5, hi: float = 3.0) -> list:
    """Per layer, its share of the budget from its speculation recall (None: a dense layer, no share):
    proportional to its misses, 1 - recall, clamped to [lo, hi] and renormalized so the speculated layers'
    mean is 1 (the total fetched stays the uniform budget's)."""
    spec = [i for i, r in enumerate(recall) if r is not None]
    miss = {i: max(1.0 - recall[i], 1e-3) for i in spec}
    mean = sum(miss.values()) / max(len(spec), 1)
    scale = {i: m / mean for i, m in miss.items()}
    for _ in range(50):  # clamp, renormalize: converges in a few rounds
        scale = {i: min(hi, max(lo, v)) for i, v in scale.items()}
        mean = sum(scale.values()) / max(len(spec), 1)
        scale = {i: v / mean for i, v in scale.items()}
    return [scale.get(i) for i in range(len(recall))]


def layer_budgets(budget: float, scales: list | None) -> list | None:
    """Each layer's budget: `budget` x its scale (None: every layer `budget`). A fraction stays <= 1, the
    speculated layers' mean kept at `budget` (what a capped layer cannot take goes to the others; at 1.0 every
    layer fetches everything); a token count is rounded and stays > 1 (a count, not a fraction)."""
    if scales is None:
        return None
    spec = [s for s in scales if s is not None]
    if budget > 1:
        return [budget if s is None else float(max(2, round(budget * s))) for s in scales]
    if budget >= 1.0 or not spec:
        return [budget] * len(scales)
    lo, hi = 1.0, 1.0 / (budget * min(spec))  # mean of min(1, budget x s x c) is budget at c = 1, 1 at hi
    for _ in range(40):  # bisect for the c that keeps the mean at budget
        c = (lo + hi) / 2
        if sum(min(1.0, budget * s * c) for s in spec) / len(spec) < budget:
            lo = c
        else:
            hi = c
    return [budget if s is None else min(1.0, budget * s * hi) for s in scales]


def select(
    scores: torch.Tensor,
    keep: torch.Tensor | None,
    alpha: float,
    budget: float,
    max_num_kv: int | None = None,
    combine: str = "max",
    floor: int = 0,
    caps: torch.Tensor | None = None,
    masked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens to fetch per (sequence, KV head), with no host sync: the step's fetch size is known on the host.

    scores (B, G, r, n): approximate logits per query head. keep (B, 1, n) bool or None: False marks
    positions that may not be attended (left padding, masked tokens); they are never selected.
    Each head's logits are taken relative to its own maximum (a token within alpha of it has a softmax
    weight of at least e^-alpha of the largest), then the r heads of a group are combined:
    "max" keeps a token any head wants, "mean" averages the heads' relative logits. A token is selected
    when the combined value is within alpha of 0; each row is capped at ceil(budget x valid length), at
    least `floor` (and at most `max_num_kv`), keeping the highest, and keeps at least its best token.
    Returns idx (B, G, k), best first, k = the cap of n (fetch_cap: a host integer, as the CPU kernel sizes
    its fetch), and count (B, G) on the device: the first count slots of each row are the selected ones (the
    rest hold real pool positions, masked; a transfer may leave them out once the count is on the host). caps
    (B, G): the rows' caps from keep where the caller has them (row_caps, made once a step), else made here.
    masked: the scores hold -inf where keep is False already (approx_scores' bias).
    """
    n = scores.shape[-1]
    k = fetch_cap(n, budget, max_num_kv, floor)
    rel = relative(scores, None if masked else keep, combine)  # (B, G, n)
    count = (rel > -alpha).sum(-1)  # (B, G)
    if keep is not None:  # per sequence: budget x its valid (unpadded) length
        count = torch.minimum(count, caps if caps is not None else row_caps(keep, budget, max_num_kv, floor))
    idx = rel.topk(min(k, n), dim=-1, sorted=True).indices  # (B, G, k), best first
    return idx, count.clamp_(min=1, max=idx.shape[-1])


def select_fixed(scores: torch.Tensor, floor: torch.Tensor, k: int, combine: str, real: torch.Tensor) -> torch.Tensor:
    """`select` for a static step, in fixed shapes: the k slots of each row best first (idx (B, G, k), returned),
    and which of them are real written into real (B, G, k) bool (in place: the layer's working-set mask) as
    slot value > floor (B, G, k) (`fixed_floor`: the same rows as select's count and caps, in one op).
    scores (B, G, r, n) hold -inf where a position may not be attended."""
    vals, idx = relative(scores, None, combine).topk(k, dim=-1, sorted=True)  # (B, G, k), best first
    torch.gt(vals, floor, out=real)
    return idx


def fixed_floor(caps: torch.Tensor, k: int, alpha: float) -> torch.Tensor:
    """(B, G, k) float: what a static step's slot value must exceed to be real: -inf at slot 0 (each row keeps its
    best), -alpha below the row's cap (within alpha of the best), +inf from the cap on. caps (B, G)."""
    beyond = torch.arange(k, device=caps.device) >= caps.unsqueeze(-1)  # (B, G, k)
    floor = torch.full(beyond.shape, -alpha, device=caps.device).masked_fill_(beyond, float("inf"))
    floor.select(-1, 0).fill_(float("-inf"))
    return floor


class Speculate:
    """InfiniGen's speculation. Layer 0 attends over its whole cache, which stays on the device."""

    calibrated = True  # needs the offline calibration and a partial key cache per layer
    in_place = True  # on CPU, attention may read the chosen rows where they lie in the pool
    whole = False  # fetches chosen rows (by index), not whole pasts
    static = True  # selects in static steps (model/static.py): a fixed number of slots over the pool's capacity

    def __init__(self):
        self._dense_step = False  # this decode step attends densely, no layer speculating (_attends_densely)

    def dense(self, cache, layer_idx: int) -> bool:
        """Layer 0, and a model's local layers unless `local_layers="speculate"`: their window is short (512
        tokens on Gemma 3) and attending all of it measured better (docs/BENCHMARKS.md, "Models: Gemma 3 270M")."""
        return layer_idx == 0 or (cache.arch.local(layer_idx) and cache.config.local_layers == "dense")

    def choose(self, cache, layer_idx: int, x: torch.Tensor, step) -> Iterator[tuple[int, Fetch]]:
        """Called with layer l's decode input x (B, 1, D): the fetches of layer l+1 (and of layer 1 at layer 1),
        (layer, Fetch) each, yielded as chosen: the cache starts each before the next is scored.

        Layer 0's input is the raw embedding, too unlike layer 1's to predict it (measured attention
        recall 0.1-0.4 where later layers get 0.9+): layer 0 speculates nothing and layer 1 speculates
        itself from its own input, just before it runs. Every later layer is chosen one layer ahead.
        """
        if layer_idx == 0:  # layer 0: see above (a static step always selects: its shapes do not follow the past)
            self._dense_step = step.column is None and self._attends_densely(cache)
            return
        if self._dense_step:
            return
        if cache.speculate_from == "own":  # each layer at its own query (choose_at_query)
            return
        targets = ([1] if layer_idx == 1 else []) + ([layer_idx + 1] if layer_idx + 1 < len(cache.layers) else [])
        for nxt in targets:
            fetch = self.speculate(cache, nxt, x, step, layer_idx)
            if fetch is not None:
                yield nxt, fetch

    def choose_at_query(self, cache, layer_idx: int, q: torch.Tensor, step) -> Fetch | None:
        """speculate_from "own": layer l's fetch from its own decode query q (B, H, 1, d), RoPE applied: its skewed
        partial channels are the partial query (no projection of their own), exact where "previous" predicts it
        from layer l-1's input. Layer 0, and a step attending densely, choose nothing."""
        if layer_idx == 0 or self._dense_step or cache.speculate_from != "own":
            return None
        return self.speculate(cache, layer_idx, None, step, layer_idx, query=q)

    @staticmethod
    def _attends_densely(cache) -> bool:
        """Whether this step attends densely with no layer speculating (CPU, pools without a capacity; once a step,
        at layer 0): when no layer's cap leaves out any of its past (a short past under min_budget), or when what
        speculation would save is under `min_saving` of the step's bytes (`speculation_pays`)."""
        c = cache.config
        saved, total, selects = 0.0, float(cache.weight_bytes), False
        head = head_cost(cache)  # once a step
        arithmetic = cache.arch.group * head  # a dense row's query heads, as bytes
        for layer in cache.layers:
            if not layer.is_initialized:
                continue
            B, n = layer.k.batch * layer.k.heads, layer.k.length  # rows of a (sequence, KV head) each
            row = (layer.k.width + layer.v.width) * layer.k.data.element_size()
            total += B * n * (row + arithmetic)
            if layer.dense:
                continue
            if layer.slots is not None or not layer.transfer.host_compute:
                return False
            partial_row = layer.partial.width * layer.partial.data.element_size()
            saving = layer_saving(cache, layer.layer_idx, B, layer.partial.length, row, partial_row, head)
            if saving is not None:
                if not c.min_budget:  # no floor (a budget sweep): each budget as named wherever it leaves rows out
                    return False
                selects = True
                saved += saving
        if not c.min_saving:  # the rule off: speculates wherever a layer's cap leaves rows out
            return not selects
        return not (selects and speculation_pays(saved, total, c.min_saving))

    def speculate(self, cache, nxt: int, x: torch.Tensor | None, step, layer_idx: int,
                  query: torch.Tensor | None = None) -> Fetch | None:
        """Layer nxt's fetch from layer layer_idx's input x (B, 1, D) (step: the forward's step.Step), or from
        layer nxt's own query (B, H, 1, d) where given: its partial query scored against its partial key cache, the
        tokens within alpha of each head's best, at most its budget; None where the layer attends all of its past."""
        target = cache.layers[nxt]
        if not target.is_initialized or target.dense:
            return None
        dev = target.device
        rope = step.rope(nxt)  # layer l+1's own (Gemma 3: per layer type)
        if x is not None and x.device != dev:  # device_map: layer l's input, RoPE and mask go to layer l+1's device
            x = x.to(dev, non_blocking=True)
            rope = tuple(t.to(dev, non_blocking=True) for t in rope) if rope is not None else None
        static = step.column is not None  # a static step: every shape spans the pool's capacity
        n = target.partial.capacity if static else target.partial.length  # slots
        c = cache.config
        budget = cache.budget_of(nxt)
        k = fetch_cap(n, budget, c.max_num_kv, c.min_budget)  # known on the host: the step's fetch size
        partial_row = target.partial.width * target.partial.data.element_size()
        row = (target.k.width + target.v.width) * target.k.data.element_size()
        if not static and target.slots is None and target.transfer.host_compute and not saves_bytes(
                n, k, row, partial_row):
            # the cap leaves nothing to save (a short past under the floor): the layer attends densely, in place
            # (on CUDA a dense pool layer would be copied to the device synchronously: it fetches all it may)
            return None
        kern = target.backend.ops
        scale = 1.0 if kern is not None else cache.arch.score_scale
        if query is not None:  # (B, G, r, p)
            q = cache.pq.of_query(query, target.skew_p, scale)
        else:
            q = cache.partial_query(nxt, x, rope, step.memo, scale)
        B, G = q.shape[:2]
        evicted = target.slots is not None and target.slots.evicted
        keep, caps = self.step_keep(cache, nxt, step, layer_idx, n if static else target.seen, dev, B, G,
                                    not evicted, budget)
        if keep is not None and evicted:
            keep = keep.expand(B, G, -1).gather(-1, target.slots.pos.valid()[..., 0])  # (B, G, slots)
        if kern is not None:  # one pass: scores, relative, combine, count, cap, chosen slots; no host sync
            if keep is not None and caps is None:  # per row: budget x its valid length
                keep = keep.contiguous()
                caps = row_caps(keep, budget, c.max_num_kv, c.min_budget).expand(B, G).contiguous()  # (B, G)
            idx, count, total = kern.speculate(q.float().contiguous(), target.partial.data, n, keep, caps,
                                               cache.arch.score_scale, c.alpha, k, c.gqa_combine == "mean")
            return Fetch(idx, count=count, keep=keep, scored=partial_row, total=total, fixed=static)
        # PyTorch (a GPU): the scale is in q; the mask in the scores' own op (bias, made once a step)
        keys = target.partial.data if static else target.partial.valid()
        bias = None if keep is None or evicted else self.step_bias(step.memo, keep, G)
        scores = approx_scores(q, keys, 1.0, bias)  # (B, G, r, slots)
        if static:  # fixed shapes: which of the k slots are real is written into the layer's working-set mask
            real = target.static_mask(B, G, k)[:, :, 0, 1:]
            idx = select_fixed(scores, self.step_floor(step.memo, cache, caps, k, budget), k, c.gqa_combine, real)
            return Fetch(idx, real=real, keep=keep, scored=partial_row, fixed=True)
        idx, count = select(scores, keep, c.alpha, budget, c.max_num_kv, c.gqa_combine, c.min_budget, caps,
                            masked=bias is not None)
        return Fetch(idx, count=count, keep=keep, scored=partial_row)

    @staticmethod
    def max_fetch(cache, layer_idx: int, tokens: int) -> int:
        """The most rows one decode step of `layer_idx` fetches per (sequence, KV head) up to `tokens` tokens."""
        c = cache.config
        return fetch_cap(tokens, cache.budget_of(layer_idx), c.max_num_kv, c.min_budget)

    def step_keep(self, cache, layer: int, step, at_layer: int, seen: int, dev, B: int, G: int, with_caps: bool,
                  budget: float):
        """keep (B, 1, seen) of `layer` (layer_keep) and, if with_caps, the per-row caps (B, G) of the CPU
        kernel at `budget`: the same for every layer of a decode step with the same window (and budget), so
        computed once per step (kept in the step's memo; at_layer: the layer whose input speculates)."""
        memo = step.memo
        key = ("keep", cache.arch.windows[layer], seen, dev, B, G)
        if key not in memo:
            keep = layer_keep(cache.arch, layer, keep_source(cache.arch, step, at_layer), seen, B, dev)
            column = step.column
            if column is not None:  # a static step's mask spans the capacity: its past ends before its column
                past = torch.arange(seen, device=dev) < column
                keep = past.view(1, 1, seen).expand(B, 1, seen) if keep is None else keep & past
            memo[key] = (None if keep is None else keep.contiguous(), {})
        keep, caps = memo[key]
        if keep is None or not with_caps:
            return keep, None
        if budget not in caps:
            c = cache.config
            caps[budget] = row_caps(keep, budget, c.max_num_kv, c.min_budget).expand(B, G).contiguous()
        return keep, caps[budget]

    @staticmethod
    def step_bias(memo: dict, keep: torch.Tensor, G: int) -> torch.Tensor:
        """The scores' bias from a step's keep (keep_bias): once a step (the step's memo)."""
        key = ("bias", keep.data_ptr(), tuple(keep.shape), G)
        if key not in memo:
            memo[key] = keep_bias(keep, G)
        return memo[key]

    @staticmethod
    def step_floor(memo: dict, cache, caps: torch.Tensor, k: int, budget: float) -> torch.Tensor:
        """A static step's slot floor (fixed_floor) at `budget`: once a step (the step's memo)."""
        key = ("floor", caps.data_ptr(), k)
        if key not in memo:
            memo[key] = fixed_floor(caps, k, cache.config.alpha)
        return memo[key]

    def reset(self) -> None:
        """Nothing kept across steps."""
