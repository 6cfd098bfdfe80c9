"""The two parts InfiniGenCache is assembled from, as Protocols: a selection decides what each decode step fetches
(speculator.Speculate; offload.FetchAll), a transfer moves the chosen rows from the pool to where attention runs
(transfer.DirectTransfer on CPU; cuda_transfer.CudaTransfer on a GPU)."""

from __future__ import annotations

from typing import Iterator, Protocol

import torch

from .fetch import Fetch


class Selection(Protocol):
    calibrated: bool  # needs the offline calibration and a partial key cache per pool layer
    in_place: bool  # on CPU, attention may read the chosen rows where they lie in the pool
    whole: bool  # fetches whole pasts (rows as they lie), not chosen rows
    static: bool  # chooses in static steps (model/static.py): shapes over the pool's capacity

    def dense(self, cache, layer_idx: int) -> bool:
        """Whether layer `layer_idx` stays on the compute device and is attended whole (a DeviceLayer)."""

    def choose(self, cache, layer_idx: int, x: torch.Tensor, step) -> Iterator[tuple[int, Fetch]]:
        """At layer l's decode input x (B, 1, D): the fetches it chooses for later layers, (layer, Fetch) each."""

    def choose_at_query(self, cache, layer_idx: int, q: torch.Tensor, step) -> Fetch | None:
        """At layer l's decode query q (B, H, 1, d), RoPE applied: its own fetch, where it chooses there (None:
        chosen at an earlier layer's input, or not at all)."""

    def reset(self) -> None:
        """Forget what is kept across steps (after a batch change)."""


class Transfer(Protocol):
    host_compute: bool  # attention runs where the pool lies (CPU): a dense step reads it in place
    bytes_moved: int | None  # host -> device bytes of decode fetches (None: nothing crosses)
    static: bool  # serves static steps (model/static.py): write_at, and fixed fetches

    def init_layer(self, layer, B: int, G: int, rows: int, staged: bool = True) -> None:
        """Events and staging for a layer's decode steps (rows: its largest fetch per (sequence, KV head))."""

    def prefetch(self, layer, fetch: Fetch) -> None:
        """Start moving `fetch`'s rows of `layer` (behind the current layer's compute, where it can)."""

    def ready(self, layer, fetch: Fetch) -> Fetch:
        """`fetch` once its rows have arrived."""

    def write(self, layer, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor | None = None) -> None:
        """New rows into the pool: appended, or one decode row over slots slot (B, G) of a full pool."""

    def write_at(self, layer, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor) -> None:
        """A static step's row at the device column `at` (1,)."""

    def fetch(self, layer, fetch: Fetch, k_new: torch.Tensor, v_new: torch.Tensor, in_place: bool):
        """The working set [new token, fetched rows]: K, V and its mask, or None where attention reads it in place."""

    def dense(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """A dense step's keys and values: all the layer holds."""

    def flush(self, layer) -> None:
        """Land what is in flight for `layer`."""

    def reset(self) -> None:
        """Nothing in flight from here on."""
