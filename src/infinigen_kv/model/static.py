"""A decode step with static shapes: what one CUDA graph a step replays. Its inputs live in device buffers
(`StaticInputs`: the tokens, their positions, the valid columns over the cache's capacity and the column this step's
rows go to): the host refills the tokens before each step, and the step itself marks its column valid and, at its
end, advances the positions and the column. Every layer writes its new row at that column and attends over its
whole buffers under the valid mask. Two steps then run the same ops on the same buffers with the same shapes
(tests/test_static.py checks it on CPU, op by op); the host's own bookkeeping (lengths) follows after each step
(`cache.advanced`). Caches that decode so declare `static` (model/kv.StepCache).

On CUDA the step is captured once as a CUDA graph (after a warm-up on a side stream) and replayed at every step:
one launch a step where eager mode launches hundreds of kernels. On by default; the model's backend built with
`cuda_graph=False` (`load_model(..., cuda_graph=False)`, the CLI's `--no-cuda-graph`) keeps the eager step, the
reference.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .arch import get_arch
from .kv import StepCache


class StaticError(ValueError):
    """A model or cache a static step does not serve, or a step past the capacity."""


def graphs_on(model, device, cuda_graph: bool | None = None) -> bool:
    """Whether decode steps on `device` replay a CUDA graph: on CUDA unless turned off (cuda_graph=False; None: the
    model's backend says)."""
    if torch.device(device).type != "cuda":
        return False
    return cuda_graph if cuda_graph is not None else model.backend.cuda_graph


def serves(model, cache) -> bool:
    """Whether static steps serve this model and cache (one of ours that declares `static`, no sliding window)."""
    return isinstance(cache, StepCache) and cache.static and all(w is None for w in get_arch(model).windows)


@dataclass(frozen=True)
class StaticInputs:
    ids: torch.Tensor  # (B,) int64: this step's tokens
    positions: torch.Tensor  # (B, 1) int64: their positions
    valid: torch.Tensor  # (B, capacity) bool: the columns holding real tokens, this step's included
    column: torch.Tensor  # (1,) int64: the column this step's rows are written to


class StaticDecoder:
    """Decode steps of `cache` (prefilled, `reserve`d for the run) with static shapes. mask (B, n): the prompt's
    attention mask (None: nothing padded); positions (B, 1): the first decode step's positions."""

    @torch.inference_mode()
    def __init__(self, model, cache, mask: torch.Tensor | None, positions: torch.Tensor, graph: bool = False):
        arch = get_arch(model)
        if not cache.static:
            raise StaticError(f"{type(cache).__name__} does not decode in static steps")
        if any(w is not None for w in arch.windows):
            raise StaticError("a static step serves models without sliding windows")
        self.model, self.cache = model, cache
        self.n = cache.get_seq_length()  # the column of the next step's rows
        self.capacity = cache.static_capacity()
        B, dev = positions.shape[0], positions.device
        valid = torch.zeros(B, self.capacity, dtype=torch.bool, device=dev)
        valid[:, : self.n] = True if mask is None else mask.bool()
        self.inputs = StaticInputs(torch.zeros(B, dtype=torch.long, device=dev), positions.clone(), valid,
                                   torch.tensor([self.n], device=dev))
        self.graph = graph  # replay a CUDA graph (captured at the first step)
        self._captured = None  # (CUDAGraph, its logits buffer, the cache's bookkeeping before and after one step)

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """The next logits (B, V) after ids (B,)."""
        self.refill(ids)
        logits = self._replay() if self.graph else self.forward()
        self.advance()
        return logits

    def _replay(self) -> torch.Tensor:
        """The captured step, replayed: its logits buffer (B, V), overwritten by the next replay."""
        if self._captured is None:
            try:
                self._captured = self._capture()
            except Exception as e:  # a step that cannot be captured still decodes, eagerly
                warnings.warn(f"infinigen: CUDA graph capture failed ({type(e).__name__}: {str(e)[:200]}); decoding "
                              "eagerly (--no-cuda-graph, or load_model(..., cuda_graph=False), skips the attempt)", stacklevel=3)
                self.graph = False
                return self.forward()
        graph, logits, before, after = self._captured
        graph.replay()
        self.cache.replayed(before, after)  # the host counts the replay's Python would have added
        return logits

    def _capture(self):
        """Warm up on a side stream (lazy allocations, library handles), then capture one step. Both write this
        step's rows at its column, as the replay that follows does again: the same values, the same place. The
        cache's counts go back to where they were (the replay counts the step: on the device, and on the host
        through `replayed`)."""
        s = self.inputs
        before, where = self.cache.bookkeeping(), (s.positions.clone(), s.column.clone())
        try:
            side = torch.cuda.Stream(s.ids.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.forward()
            torch.cuda.current_stream().wait_stream(side)
            after = self.cache.bookkeeping()
        finally:  # the warm-up advanced the step's positions and column: the replay advances them
            s.positions.copy_(where[0])
            s.column.copy_(where[1])
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self.forward()
        finally:
            self.cache.restore_bookkeeping(before)
        return graph, logits, before, after

    @torch.inference_mode()
    def refill(self, ids: torch.Tensor) -> None:
        """This step's tokens into their buffer, in place (outside a graph: its replay reads them there)."""
        if self.n >= self.capacity:
            raise StaticError(f"the cache holds {self.capacity} tokens: reserve more for the run")
        self.inputs.ids.copy_(ids)

    # --- rows changing in place between steps (a running batch: model/static.py serves its bucket of rows) -----

    @torch.inference_mode()
    def set_row(self, row: int, mask: torch.Tensor, position: int) -> None:
        """Sequence `row` is a new one (placed in the cache): mask (n,) its valid columns, position its next."""
        s = self.inputs
        s.valid[row].zero_()
        s.valid[row, : mask.shape[0]] = mask.bool()
        s.positions[row] = position

    @torch.inference_mode()
    def move_rows(self, dst: list[int], src: list[int]) -> None:
        """Sequences src moved to the places dst (as the cache's rows: Rebatch.move_rows)."""
        s = self.inputs
        s.valid[dst] = s.valid[src]
        s.positions[dst] = s.positions[src]

    @torch.inference_mode()
    def clear_rows(self, rows: list[int]) -> None:
        """Sequences `rows` hold no one (padding of the batch up to its bucket): nothing valid but each step's own
        row (no attention over nothing)."""
        self.inputs.valid[rows] = False
        self.inputs.positions[rows] = 0

    @torch.inference_mode()
    def advance(self) -> None:
        """After a step: the host's lengths follow the rows it wrote (the device's advanced in the step)."""
        self.cache.advanced(1)
        self.n += 1

    @torch.inference_mode()
    def forward(self) -> torch.Tensor:
        """The step itself over the inputs as they are (what a CUDA graph captures): logits (B, V). It marks its
        column valid and, once done, advances its positions and column itself (on the device: a replay does too)."""
        s = self.inputs
        s.valid.index_fill_(1, s.column, True)
        logits = self.model.decode(self.cache, s.ids, s.positions, s.valid, s.column)
        s.positions.add_(1)
        s.column.add_(1)
        return logits
