"""The host pool's capacity and eviction: once a pool has a capacity, a slot no longer means a position. Per
(sequence, KV head) `Slots` records the logical position each slot holds and how often / when it was last
fetched, and names the slot to overwrite when a new token arrives at a full pool: `fifo` (oldest position), `lru`
(least recently fetched) or `counter` (fewest fetches, the paper's default), ties to the oldest.
"""

from __future__ import annotations

import torch

from ..rows import RowBuffer


POLICIES = ("fifo", "lru", "counter")


class Slots:
    """Position and fetch statistics of every slot of one layer's pool, on the compute device: pos, hits
    and last fetch step, each (B, G, S)."""

    def __init__(self, batch: int, heads: int, device, policy: str):
        if policy not in POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.pos = RowBuffer(batch, heads, 1, torch.int64, device)
        self.hits = RowBuffer(batch, heads, 1, torch.int64, device)
        self.last = RowBuffer(batch, heads, 1, torch.int64, device)
        self.step = 0
        self.evicted = 0  # entries evicted so far per (sequence, head)

    def append(self, start: int, T: int, pos: torch.Tensor | None = None) -> None:
        """T new tokens at logical positions start..start+T-1 (or pos (B, G, T)), in new slots at the end."""
        B, G = self.pos.batch, self.pos.heads
        if pos is None:
            pos = torch.arange(start, start + T, device=self.pos.device).view(1, 1, T, 1).expand(B, G, T, 1)
        else:
            pos = pos.unsqueeze(-1).to(self.pos.device)
        self.pos.append(pos)
        self.hits.append(torch.zeros_like(pos))
        self.last.append(torch.full_like(pos, -1))

    def record(self, idx: torch.Tensor, real: torch.Tensor | None) -> None:
        """The prefetch of this step fetched slots idx (B, G, m), those where real (B, G, m) is True (None:
        all of them)."""
        self.step += 1
        hits, last = self.hits.valid()[..., 0], self.last.valid()[..., 0]  # (B, G, S) views
        if real is None:
            hits.scatter_add_(-1, idx, torch.ones_like(idx))
            last.scatter_(-1, idx, self.step)
            return
        hits.scatter_add_(-1, idx, real.long())
        last.scatter_(-1, idx, torch.where(real, self.step, last.gather(-1, idx)))

    def victim(self) -> torch.Tensor:
        """(B, G): the slot to overwrite by the policy, ties broken towards the oldest position."""
        pos = self.pos.valid()[..., 0]
        if self.policy == "fifo":
            key = pos
        else:
            stat = self.hits.valid()[..., 0] if self.policy == "counter" else self.last.valid()[..., 0]
            key = stat * (1 << 32) + pos  # positions < 2^32
        return key.argmin(-1)

    def replace(self, slot: torch.Tensor, position: int) -> None:
        """A new token at `position` now lives in slot (B, G)."""
        for buf, value in ((self.pos, position), (self.hits, 0), (self.last, -1)):
            buf.valid()[..., 0].scatter_(-1, slot.unsqueeze(-1), value)
        self.evicted += 1

    def reset(self) -> None:
        for buf in (self.pos, self.hits, self.last):
            buf.reset()
        self.step = self.evicted = 0
