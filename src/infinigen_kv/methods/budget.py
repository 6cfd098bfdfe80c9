"""How many entries a budget keeps or fetches: the one rule behind InfiniGen's cap and h2o's / streaming's sizes."""

from __future__ import annotations

import math


def budget_caps(valid, budget, floor: int = 0):
    """Entries a sequence with `valid` past tokens keeps/fetches (an int, or a tensor of counts): ceil(budget x
    valid) for a fraction, but at least min(floor, valid); min(budget, valid) for a token count; at least 1."""
    if budget > 1:
        return max(1, min(int(budget), valid)) if isinstance(valid, int) else valid.clamp(max=int(budget), min=1)
    if isinstance(valid, int):
        return max(1, math.ceil(valid * budget), min(floor, valid))
    cap = (valid.double() * budget).ceil_().clamp_(min=1).long()  # float64: the int path's result
    return cap.maximum(valid.clamp(max=floor)) if floor else cap
