"""Speculation: approximate attention scores from partial queries/keys, then threshold + budget selection.

Pure tensor code, no state. Shapes: B sequences, H query heads, G KV heads, r = H / G, n past tokens,
p partial channels, d head size.
"""

from __future__ import annotations

import torch


def approx_scores(q_partial: torch.Tensor, k_partial: torch.Tensor, scale: float) -> torch.Tensor:
    """Approximate attention logits of each past token for each query head.

    q_partial (B, G, r, p): the skewed partial queries of the r query heads sharing a KV head.
    k_partial (B, G, n, p): the partial key cache. Returns (B, G, r, n).
    """
    s = torch.matmul(q_partial, k_partial.transpose(-1, -2))  # (B, G, r, n)
    return s * scale if scale != 1.0 else s


def select(
    scores: torch.Tensor,
    keep: torch.Tensor | None,
    alpha: float,
    budget: float,
    max_num_kv: int | None = None,
    combine: str = "max",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens to fetch per (sequence, KV head).

    scores (B, G, r, n): approximate logits per query head. keep (B, 1, n) bool or None: False marks
    positions that may not be attended (left padding, masked tokens); they are never selected.
    Each head's logits are taken relative to its own maximum (a token within alpha of it has a softmax
    weight of at least e^-alpha of the head's largest), then the r heads of a group are combined:
    "max" keeps a token any head wants, "mean" averages the heads' relative logits. A token is selected
    when the combined value is within alpha of 0; each row is capped at ceil(budget x valid length)
    (and `max_num_kv`), keeping the highest.
    Returns idx (B, G, k) int64, best first, and count (B, G): how many of the k slots are real (the
    first count of each row). k = the largest count of the step; slots past a row's count are
    padding (index 0, to be masked by the caller).
    """
    B, G, r, n = scores.shape
    if keep is not None:
        scores = scores.masked_fill(~keep.unsqueeze(2), float("-inf"))
        n_valid = keep.sum(-1, dtype=torch.float32)  # (B, 1)
    else:
        n_valid = torch.full((B, 1), float(n), device=scores.device)
    rel = scores - scores.amax(dim=-1, keepdim=True)  # (B, G, r, n), each head's max at 0
    rel = rel.amax(dim=2) if combine == "max" else rel.mean(dim=2)  # (B, G, n)
    count = (rel > -alpha).sum(-1)  # (B, G); >= 1 for "max" since each head's maximum counts
    cap = torch.ceil(n_valid * budget).clamp_(min=1).long()  # (B, 1)
    if max_num_kv is not None:
        cap = cap.clamp_(max=max_num_kv)
    count = torch.minimum(count, cap).clamp_(min=1)
    k = int(count.max())  # the one host sync of the step: it sizes the transfer
    idx = rel.topk(k, dim=-1, sorted=True).indices  # (B, G, k), best first
    if k > 1:
        pad = torch.arange(k, device=scores.device) >= count.unsqueeze(-1)  # (B, G, k)
        idx.masked_fill_(pad, 0)
    return idx, count
