"""`offload`: full offload, FlexGen-style. Every layer's whole K/V lives in the host pool (pinned when a GPU
computes) and is brought to the compute device at every decode step, the next layer's while this one
computes: InfiniGen's cache and transfer machinery with the `FetchAll` selection (every valid row, no
calibration or partial keys). On CPU it degenerates to one copy of the whole cache per step (what
offloading costs where there is no device to offload from)."""

from __future__ import annotations

from ..cache import InfiniGenCache
from ..selection import FetchAll


class OffloadCache(InfiniGenCache):
    method = "offload"

    def __init__(self, model, **_):
        super().__init__(model, selection=FetchAll())
