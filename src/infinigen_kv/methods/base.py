"""The contract every method here follows: a cache layer (`LogicalLayer`) that reports the logical length and
declares its traits, a cache base (`Rebatch`) for continuous batching and forks, and the decode-read statistics
of the caches that read every entry. The attention function (model/attention.py) reads the traits; shared code
never tests a method's name or probes for an attribute."""

from __future__ import annotations

import copy
import weakref

import torch
from ..model.arch import get_arch
from ..model.transformer import compute_dtype
from ..model.kv import KVView, StepCache, from_rows, kv_storage, to_rows
from .rows import PIN_ROUNDING, release_pinned


class LogicalLayer:
    """A cache layer that reports the logical length (every token seen), whatever it returns to attention: the
    model counts positions and sizes masks by it."""

    is_sliding = False
    # Traits, declared by a method's layer class:
    needs_probs = False  # attention hands the layer its weights: the prefill's scores, each decode step's (H2O)
    _cache = None
    # A layer with a sliding `window` W keeps only what its next queries may attend: between W - 1 and 2W rows
    # (it slides in one copy every ~W steps), the first at position `offset`.
    window = None
    offset = 0

    def __init__(self, **_):
        self.is_initialized = False  # its buffers are made by the first k, v it stores (lazy_initialization)

    def view(self, key_states: torch.Tensor, value_states: torch.Tensor, fetch=None) -> KVView:
        """Store the new k, v (B, G, T, d) and return what attention reads for this forward (model/kv.py): here,
        what `update` returns, read with the model's mask. fetch: what an earlier layer's selection started for
        this one (a decode step of a method that selects)."""
        return KVView(*self.update(key_states, value_states))

    def update(self, key_states, value_states, *args, **kwargs):
        """The keys and values of `view` (a cache layer's plain API: attention inside the model reads the view)."""
        view = self.view(key_states, value_states)
        return view.keys, view.values

    # A layer's link to its cache is weak (the cache owns its layers): a cache nobody holds any more (a finished
    # request, a decoded fork) frees its buffers at once, not at some later garbage collection.
    @property
    def cache(self):
        return self._cache() if self._cache is not None else None

    @cache.setter
    def cache(self, cache) -> None:
        self._cache = weakref.ref(cache)

    def as_stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt's own K, V as the layer stores them (kv_dtype): the prompt attends over the rows its later chunks
        and decode steps read, so a prompt prefilled in chunks attends as one prefilled at once."""
        if self.k.dtype == torch.int8:  # the values the rows hold, in the model's dtype
            return from_rows(to_rows(k, torch.int8), k.dtype), from_rows(to_rows(v, torch.int8), v.dtype)
        return k.to(self.k.dtype), v.to(self.v.dtype)

    # --- continuous batching (Rebatch): columns are positions, left-padded to a common length ------------

    def row_buffers(self) -> list:
        """The layer's RowBuffers, a column per kept token (a position, here; a slot in evicting caches,
        which join and retain their own way)."""
        return []

    def join(self, other: "LogicalLayer", at_self: int, at_other: int, room: int) -> None:
        """Other's sequences after this layer's, each moved right by its `at` columns of padding (a window's
        buffers start at their offsets: the joined ones at the lower of the two)."""
        a, b = self.offset + at_self, other.offset + at_other
        self.offset = min(a, b)
        for x, y in zip(self.row_buffers(), other.row_buffers()):
            x.join(y, a - self.offset, b - self.offset, self.rows_for(room))

    def retain(self, rows: list[int], trim: int, room: int) -> None:
        """Only the sequences `rows`, without the first `trim` columns (padding in every one of them)."""
        for buf in self.row_buffers():
            buf.retain(rows, max(0, trim - self.offset), self.rows_for(room))
        self.offset = max(0, self.offset - trim)

    def slide(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Make a window layer's room for new rows k, v (B, G, T, d) -> the rows to store (slide_plan)."""
        if self.window is None:
            return k, v
        bufs = self.row_buffers()
        skip, drop = slide_plan(self.window, bufs[0].length, k.shape[2])
        if drop:
            for buf in bufs:
                buf.drop_front(drop)
        self.offset += skip + drop
        return (k[:, :, skip:], v[:, :, skip:]) if skip else (k, v)

    def rows_for(self, tokens: int) -> int:
        """Rows this layer holds per (sequence, head) for a sequence of `tokens` tokens (a window: fewer)."""
        return min(tokens, 2 * self.window) if self.window is not None else tokens

    def token_bytes(self) -> int:
        """Bytes one token of one sequence takes in this layer's buffers (pinned ones counted at the most PyTorch's
        pinned allocator rounds a block up: the admission's cost model must not let pinned memory outgrow RAM)."""
        if not self.is_initialized:
            return 0
        return sum(b.heads * b.width * b.data.element_size() * (PIN_ROUNDING if b.pin else 1)
                   for b in self.row_buffers())

    def buffer_bytes(self) -> int:
        """Bytes this layer's buffers hold now (allocated, valid or not)."""
        return sum(b.nbytes for b in self.row_buffers()) if self.is_initialized else 0

    # --- the prefix store (runtime/prefix.py): a block of a sequence's rows out, a stored prefix back in ----

    def capture(self, start: int, end: int) -> list[torch.Tensor]:
        """Views of sequence 0's rows of positions [start, end) in each row buffer: (G, n, width) each; n < end -
        start where a window has already dropped the oldest (its buffers end at `end`)."""
        lo = max(start, self.offset)
        return [b.data[0, :, lo - self.offset : end - self.offset] for b in self.row_buffers()]

    def restore(self, parts: list[list[torch.Tensor]], tokens: int) -> None:
        """Continue an empty layer from a stored prefix of `tokens` tokens: per row buffer, the stored pieces
        (G, n_i, width) of the last sum(n_i) positions before `tokens`, in order (appended one by one: no copy
        of them joined first)."""
        for buf, ps in zip(self.row_buffers(), parts):
            n = sum(t.shape[1] for t in ps)
            buf.reserve(buf.length + n)
            for t in ps:
                buf.append(t[None])
        self.offset = tokens - n


def slide_plan(window: int, length: int, T: int) -> tuple[int, int]:
    """A window layer's room for T new rows beside `length` stored: (new rows to skip, stored rows to drop first).
    A first prefill keeps its last W - 1 rows (all the next query may attend); past 2W rows, the buffers drop all
    but the last W - 1 before the new ones (a chunk of prompt attends over those and itself: stored whole)."""
    keep = window - 1
    if length == 0 and T > keep:
        return T - keep, 0
    if length + T > 2 * window and length > keep:
        return 0, length - keep
    return 0, 0


def window_state(window: int, block: int, blocks: int) -> tuple[int, int]:
    """(offset, rows) of a window layer after a prefill in `blocks` chunks of `block` tokens: what a layer restored
    from a stored prefix must hold to continue exactly as the prefill would have."""
    offset = length = 0
    for _ in range(blocks):
        skip, drop = slide_plan(window, length, block)
        offset, length = offset + skip + drop, length - drop + block - skip
    return offset, length


class Rebatch(StepCache):
    """Continuous batching for a Cache of LogicalLayers: between decode steps, sequences prefilled in a cache
    of their own join a running one (`join`) and finished ones leave it (`retain`). Rows are left-padded to
    a common length (the caller's attention mask marks the padding); `room` is capacity for that many more
    tokens per sequence, allocated now so that no buffer grows inside the decode steps that follow."""

    method = None  # the registry's name of the method (methods/registry.py)
    arch = None  # the model's Arch (model/arch.py), where the method keeps it
    limited = False  # its pool has a capacity: a prompt may overflow it (InfiniGen with capacity)
    kv_dtype = "auto"  # the storage of its K/V rows (config.KV_DTYPES)

    @torch.inference_mode()  # the buffers were made under it (a prefill): only written in place under it
    def join(self, other, room: int = 0) -> None:
        """Append other's sequences (a cache of this method, prefilled, not decoding) after this one's; other
        is left empty."""
        n_self, n_other = self.get_seq_length(), other.get_seq_length()
        n = max(n_self, n_other)
        self.settle()
        other.settle()
        for a, b in zip(self.layers, other.layers):
            a.join(b, n - n_self, n - n_other, room)
            for buf in b.row_buffers():  # other is used up: its memory goes now, not after the whole join
                buf.free()
        self.rebatched()
        release_pinned()

    @torch.inference_mode()
    def retain(self, rows: list[int], trim: int = 0, room: int = 0) -> None:
        """Keep the sequences `rows` (indices into the batch, in their new order), dropping the first `trim`
        columns, which must be padding in every one of them."""
        self.settle()
        for layer in self.layers:
            layer.retain(list(rows), trim, room)
        self.rebatched()
        release_pinned()  # the pinned blocks the smaller batch no longer uses go back to the OS

    # --- a running batch of static steps: rows change in place, the buffers (and a CUDA graph over them) stay --

    @torch.inference_mode()
    def place(self, row: int, other) -> None:
        """Other's only sequence (a cache of this method, prefilled, not longer than this one's past) into sequence
        `row`, left-padded to this cache's length; other is left empty. The buffers stay where they are."""
        n = self.get_seq_length()
        if other.get_seq_length() > n:
            raise ValueError(f"a sequence of {other.get_seq_length()} tokens does not fit a batch of {n}")
        self.settle()
        other.settle()
        for a, b in zip(self.layers, other.layers):
            for x, y in zip(a.row_buffers(), b.row_buffers()):
                x.place(row, y, n)
                y.free()

    @torch.inference_mode()
    def move_rows(self, dst: list[int], src: list[int]) -> None:
        """Sequences src copied into the places dst, in place (rows that left give their places to later ones)."""
        self.settle()
        for layer in self.layers:
            for buf in layer.row_buffers():
                buf.move_rows(dst, src)

    @torch.inference_mode()
    def fork(self, budget: float | None = None):
        """An independent copy of this cache between two forwards, with `budget` if given: prefill a prompt
        once, then decode it under several budgets (the budget acts only in decode). Buffers and state are
        copied; what the cache shares with the model (its modules, the calibration) stays shared."""
        self.settle()
        twin = copy.deepcopy(self, self.shared())
        for layer in twin.layers:  # deepcopy keeps a weak reference as it is: the twin's layers are its own
            if layer.cache is self:
                layer.cache = twin
        if budget is not None:
            twin.set_budget(budget)
        return twin

    def shared(self) -> dict:
        """deepcopy memo of what a fork shares with this cache: id -> the object itself."""
        return {id(self.arch): self.arch} if self.arch is not None else {}

    def set_budget(self, budget: float) -> None:
        raise ValueError(f"{type(self).__name__} has no budget")

    def sequence_bytes(self, tokens: int) -> int:
        """Bytes one sequence of `tokens` tokens takes in this cache (an initialized one: the cost model of
        the server's admission): what each layer keeps of it, a budget's or a window's worth where less."""
        n = self.entries(tokens)
        return sum(layer.token_bytes() * layer.rows_for(n) for layer in self.layers)

    def buffer_bytes(self) -> int:
        """Bytes the cache's buffers hold now."""
        return sum(layer.buffer_bytes() for layer in self.layers)

    def entries(self, tokens: int) -> int:
        """Tokens a sequence of `tokens` keeps (fixed-budget caches keep fewer)."""
        return tokens

    # --- the prefix store (runtime/prefix.py) -----------------------------------------------------------

    def prefix_facts(self, model) -> dict | None:
        """What changes the rows this cache stores, beyond the model and the method (the store's namespace); None:
        it cannot continue from stored blocks (a method whose state after a prefill depends on the whole prompt,
        or a pool with a capacity, which may evict rows of the prefix)."""
        return None if self.limited else self.kv_facts(model)

    def kv_facts(self, model) -> dict:
        """The K/V rows' storage for `model` (the option resolved: "auto" differs by device and model dtype)."""
        storage = kv_storage(self.kv_dtype, compute_dtype(model), next(model.parameters()).device)
        return {"kv_dtype": str(storage).replace("torch.", "")}

    @torch.inference_mode()
    def prefix_block(self, start: int, end: int, windowed: bool = False) -> dict:
        """Sequence 0's rows of positions [start, end) (a batch of one, prefilled in blocks up to `end`) as a
        payload of the store: "layer.buffer" -> (G, n, width) views of the buffers (the store copies them). Those
        of the layers without a window, or with `windowed` those of the window layers: the store keeps them apart,
        as a restore reads a window layer's rows only in a prefix's last blocks (`window_blocks`)."""
        self.settle()
        return {f"{i}.{j}": t for i, layer in enumerate(self.layers) if (layer.window is not None) == windowed
                for j, t in enumerate(layer.capture(start, end))}

    def window_blocks(self, blocks: int, block: int) -> range:
        """The blocks of a stored prefix of `blocks` blocks of `block` tokens whose window layers' rows a restore
        reads (window_state: the last W - 1 to 2W positions); empty where no layer has a window."""
        starts = [window_state(layer.window, block, blocks)[0] for layer in self.layers if layer.window is not None]
        return range(min(starts) // block, blocks) if starts and blocks > 0 else range(0)

    @torch.inference_mode()
    def restore_prefix(self, model, payloads: list[dict], block: int) -> int:
        """Fill this fresh cache (a batch of one) with the stored blocks `payloads` (block 0 first; the window
        layers' rows in those `window_blocks` names): the state a prefill of those tokens in chunks of `block` leaves. Returns the tokens restored. ValueError, before any
        row is written, when a payload does not fit the cache's buffers (a store of another layout)."""
        arch, dtype = get_arch(model), compute_dtype(model)
        tokens, plan = len(payloads) * block, []
        for i, layer in enumerate(self.layers):
            if not layer.is_initialized:  # buffers of the layer's own kind, dtype and device, empty
                device = next(arch.attns[i].parameters()).device
                like = torch.empty(1, arch.num_kv_heads, 0, arch.head_dim, dtype=dtype, device=device)
                layer.lazy_initialization(like, like)
            # a window layer holds only its last rows (window_state); the others every position
            start = 0 if layer.window is None else window_state(layer.window, block, len(payloads))[0]
            rows = []
            for j, buf in enumerate(layer.row_buffers()):
                parts = []
                for b in range(start // block, len(payloads)):
                    t, need = payloads[b].get(f"{i}.{j}"), (b + 1) * block - max(b * block, start)
                    if t is None or t.dim() != 3 or t.shape[1] < need or (t.shape[0], t.shape[2], t.dtype) != (
                            buf.heads, buf.width, buf.dtype):
                        raise ValueError(f"stored block {b} does not fit buffer {i}.{j} of this cache")
                    parts.append(t[:, t.shape[1] - need :])
                rows.append(parts)  # (G, n_i, width) each
            plan.append((layer, rows))
        for layer, rows in plan:
            layer.restore(rows, tokens)
        return tokens

    def settle(self) -> None:
        """Finish whatever is in flight before buffers move (a CUDA prefetch or prompt copy)."""

    def rebatched(self) -> None:
        """Drop what was sized for the old batch (memos, per-row accumulators)."""


def read_stats(layers) -> dict:
    """Stats of caches that read every entry (full, quant): layers count `steps` and `bytes_read`."""
    steps = max((l.steps for l in layers), default=0)
    return {
        "fetched_fraction": 1.0,
        "decode_steps": steps,
        "kv_bytes_per_step": sum(l.bytes_read for l in layers) // max(steps, 1),
        "pool_bytes": sum(l.nbytes for l in layers),
    }


def cache_stats(cache) -> dict:
    """What a cache reports of its decode steps (fetched_fraction, kv_bytes_per_step, ...): {} for a cache not
    made here (transformers' DynamicCache)."""
    return cache.stats if isinstance(cache, Rebatch) else {}
