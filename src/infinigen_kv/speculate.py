"""Speculation: approximate attention scores from partial queries/keys, then threshold + budget selection.

Pure tensor code, no state. Shapes: B sequences, H query heads, G KV heads, r = H / G, n past tokens,
p partial channels, d head size.
"""

from __future__ import annotations

import torch

from .config import budget_caps


def approx_scores(q_partial: torch.Tensor, k_partial: torch.Tensor, scale: float) -> torch.Tensor:
    """Approximate attention logits of each past token for each query head, in float32 on every device (alpha
    and the budgets were tuned on float32 scores; bf16 ones tie).

    q_partial (B, G, r, p): the skewed partial queries of the r query heads sharing a KV head.
    k_partial (B, G, n, p): the partial key cache (float32, or bfloat16 / the model's dtype). Returns (B, G, r, n).
    """
    s = torch.matmul(q_partial.float(), k_partial.float().transpose(-1, -2))  # (B, G, r, n)
    return s * scale if scale != 1.0 else s


def relative(scores: torch.Tensor, keep: torch.Tensor | None, combine: str = "max") -> torch.Tensor:
    """scores (B, G, r, n) -> (B, G, n): each head's logits relative to its own maximum (0 at the max,
    -inf where keep (B, 1, n) is False), the r heads of a group combined by "max" or "mean"."""
    if keep is not None:
        scores = scores.masked_fill(~keep.unsqueeze(2), float("-inf"))
    rel = scores - scores.amax(dim=-1, keepdim=True)  # (B, G, r, n), each head's max at 0
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


def counted(count: torch.Tensor, m: int) -> torch.Tensor:
    """(B, G, m) bool: the first count (B, G) slots of each row."""
    return torch.arange(m, device=count.device) < count.unsqueeze(-1)


def select(
    scores: torch.Tensor,
    keep: torch.Tensor | None,
    alpha: float,
    budget: float,
    max_num_kv: int | None = None,
    combine: str = "max",
    floor: int = 0,
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
    rest hold real pool positions, masked; a transfer may leave them out once the count is on the host).
    """
    n = scores.shape[-1]
    k = fetch_cap(n, budget, max_num_kv, floor)
    rel = relative(scores, keep, combine)  # (B, G, n)
    count = (rel > -alpha).sum(-1)  # (B, G)
    if keep is not None:  # per sequence: budget x its valid (unpadded) length
        count = torch.minimum(count, row_caps(keep, budget, max_num_kv, floor))
    idx = rel.topk(min(k, n), dim=-1, sorted=True).indices  # (B, G, k), best first
    return idx, count.clamp_(min=1, max=idx.shape[-1])
