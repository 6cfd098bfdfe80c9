"""What one forward computes once for all layers and passes down as a value (gpt-fast's mask and freqs_cis, vLLM's
per-step metadata): the `Step` (positions, each layer kind's mask and RoPE, the backend, a static step's column, a
memo for what a cache derives once a step), and the mask of a layer kind (`window_mask`). `Transformer.step_inputs` builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Step:
    """What one forward computes once for all layers (built by `Transformer.step_inputs`, passed down)."""

    positions: torch.Tensor  # (B, T) int64
    mask: torch.Tensor | None  # (B, S) the padded past and this chunk as the caller gave it (None: nothing padded)
    masks: dict  # window (None: global) -> its layers' mask (B, 1, T, S) bool, or None (nothing masked but causality)
    ropes: dict  # RoPE key -> (cos, sin) (B, T, d) in the compute dtype; empty without RoPE
    rope_types: tuple  # each layer's RoPE key
    windows: tuple  # each layer's window
    backend: object  # the model's backend (model/backend.py): what runs each operation
    column: torch.Tensor | None = None  # a static step's device column (1,) (model/static.py)
    memo: dict = field(default_factory=dict)  # what a cache derives once for all layers of this step

    def rope(self, layer: int):
        return self.ropes.get(self.rope_types[layer])

    def to(self, device) -> "Step":
        """The same step on another device (layers placed across GPUs); the memo is shared."""
        def moved(t):
            return t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t
        return Step(moved(self.positions), moved(self.mask), {w: moved(m) for w, m in self.masks.items()},
                    {k: tuple(moved(t) for t in r) for k, r in self.ropes.items()}, self.rope_types, self.windows,
                    self.backend.on(torch.device(device).type), moved(self.column), self.memo)

    def layer_mask(self, layer: int):
        return self.masks[self.windows[layer]]


def window_mask(mask: torch.Tensor | None, B: int, T: int, past: int, window: int | None,
                device) -> torch.Tensor | None:
    """A layer kind's attention mask (B, 1, T, S) bool over S = past + T keys (True: attend): causal, inside the
    window, not padded; None where causality alone says it (no padding, nothing past the window; a prompt without
    a past then attends causally)."""
    S = past + T
    pad = None if mask is None else mask[:, None, None, :S].bool()
    if T == 1:  # a decode query sees every past key but those padded and those out of its window
        if window is None or S <= window:
            return pad
        inside = (torch.arange(S, device=device) > S - 1 - window).view(1, 1, 1, S)
        return inside.expand(B, 1, 1, S) if pad is None else pad & inside
    if pad is None and past == 0 and (window is None or T <= window):
        return None
    # query t (position past + t) sees key j <= past + t, and j > past + t - window: one (T, S) bool made in place
    # (comparisons of index grids would make two more: ~45 MB a layer kind for a 512-token chunk over 30k keys)
    m = torch.ones(T, S, dtype=torch.bool, device=device).tril_(past)
    if window is not None:
        m.triu_(past - window + 1)
    m = m.view(1, 1, T, S).expand(B, 1, T, S)
    return m if pad is None else m & pad
