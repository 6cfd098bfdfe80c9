"""The cache-layer base shared by every cache here, and the decode-read statistics of the dense ones."""

from __future__ import annotations

from transformers.cache_utils import CacheLayerMixin


class LogicalLayer(CacheLayerMixin):
    """A transformers cache layer that reports the logical length (every token seen), whatever it returns to
    attention: transformers sizes positions and masks by it."""

    is_compileable = False
    is_sliding = False
    # The attention function attends over what update() returned with `work_mask` (B, G or 1, 1, m) when
    # `working` is set (None: all of it), and with transformers' own mask otherwise.
    working = False
    work_mask = None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


def read_stats(layers) -> dict:
    """Stats of caches that read every entry (full, quant): layers count `steps` and `bytes_read`."""
    steps = max((l.steps for l in layers), default=0)
    return {
        "fetched_fraction": 1.0,
        "decode_steps": steps,
        "kv_bytes_per_step": sum(l.bytes_read for l in layers) // max(steps, 1),
        "pool_bytes": sum(l.nbytes for l in layers),
    }
