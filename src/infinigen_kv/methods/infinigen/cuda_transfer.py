"""`CudaTransfer`: at layer l's speculation the indices (sized by the host-known cap) and the real counts go
to the host (pinned, async); the main thread goes on without waiting. A worker thread waits for them (an
event), trims the fetch to the largest real count, gathers those rows from the pinned pool into a pinned
staging slot and copies them to the GPU on a side stream, recording an event. Layer l keeps computing
meanwhile. Layer l+1 waits on that event only: no host sync of the compute stream in the decode loop. The
staging slots form one small ring shared by all the layers of a device (at most two fetches are in flight),
sized with every event before decode (`reserve`). A whole-past fetch (offload) copies each (sequence,
head)'s contiguous rows straight from the pinned pool. New rows go device -> contiguous pinned staging
asynchronously and land in the pool on the worker, before that layer's next gather; a prompt prefilled in
chunks is read back from a device mirror, not from the pool (once per prompt, not once per chunk).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ...model.kv import to_rows
from . import mirror
from .fetch import Fetch, Scratch, work_mask
from .gather_rows import gather_rows
from .staging import StagingRing, device_view, record_stream, rows_to, submit_inference, uva_works
from .transfer import DirectTransfer


class CudaTransfer:
    """GPU compute, pinned host pool: async index copy, worker-thread gather, side-stream H2D copy.

    Who touches a layer's pool when: the worker between `prefetch` (in the previous layer's pre-hook) and
    `ready` (in this layer's update), and when it lands staged rows (`flush`); the main thread after
    `ready`, and only after a `flush` of that layer. So the pool needs no lock, only the events below.

    `cuda` is the torch.cuda namespace (Stream, Event, stream, current_stream); the tests run this class on
    CPU with stand-ins for it (same code, same order), `pin` False there.
    """

    host_compute = False  # every row attention reads crosses to the device

    def __init__(self, device, slots: int = 3, cuda=None, pin: bool = True, uva: bool | None = None):
        self.cuda = cuda if cuda is not None else torch.cuda
        self.device, self.pin = torch.device(device), pin
        # uva: the side stream gathers the chosen rows from the pinned pool itself, through a device view of it
        # (zero-copy; no worker, no staging, no host in the loop); else the worker gathers on the host
        if uva is None:  # (uva=False, the backend's cuda_fetch "worker": a GPU or driver without mapped memory)
            uva = not pin or uva_works(self.device)
        self.uva = uva
        self.views = {}  # (layer index, "k" / "v") -> (store pointer, its device view (B * G * capacity, width))
        self.stream = self.cuda.Stream(device=self.device)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infinigen-prefetch")
        self.ring = StagingRing(self.device, self.cuda, slots, pin)
        self.rows = {}  # layer index -> pinned Scratch of its staged decode row (B x G x d: tiny)
        self.events = {}  # layer index -> its events: "selected" (indices on the host), "written" (a decode row)
        self.unflushed = {}  # layer index -> staged rows not yet in its pool: a landing Future, or a decode row
        self.prefill = [Scratch("cpu", pin=pin) for _ in range(2)]  # prompt K/V on their way to the pool
        self.prefill_events = [self.cuda.Event() for _ in range(2)]
        self.prefill_jobs = [None, None]
        self.prefill_next = 0
        self.bytes_moved = 0  # host -> device bytes of decode fetches (the worker adds them)
        # a static step's working sets, one buffer per layer parity (layer j's fetch starts at layer j - 1, after
        # layer j - 2's attention read the same buffer), and each layer's gather event
        self.fixed = [Scratch(self.device), Scratch(self.device)]
        self.fixed_events = {}
        self.arange = None  # 0..n-1 on the device, for the working-set masks (_positions)

    def compute_stream(self):
        """The stream this device's layers compute on (with device_map, not necessarily the current
        device's): every event of a layer is recorded there."""
        return self.cuda.current_stream(self.device)

    def _record(self, event, stream=None):
        event.record(stream if stream is not None else self.compute_stream())
        return event

    def init_layer(self, layer, B: int, G: int, rows: int, staged: bool = True) -> None:
        """Everything a layer's decode steps use, made now (its prefill), not inside decode: its events, its
        decode-row staging and, with rows > 0 (the most a step of it fetches: cache.reserve), the ring's
        slots for fetches of that size (device ones only when fetches are not `staged`: whole pasts)."""
        if layer.layer_idx not in self.events:
            self.events[layer.layer_idx] = {"selected": self.cuda.Event(), "written": self.cuda.Event()}
        if layer.dense:
            return
        kw, vw, dt = layer.k.width, layer.v.width, layer.k.dtype
        row = self.rows.setdefault(layer.layer_idx, Scratch("cpu", pin=self.pin))
        row.get("k", (B, G, 1, kw), dt), row.get("v", (B, G, 1, vw), dt)
        if rows:
            self._positions(rows + 1)
            for host, dev in zip(self.ring.host, self.ring.dev):
                if staged and not self.uva:
                    host.get("idx", (B, G, rows), torch.int64), host.get("count", (B, G), torch.int64)
                for name, w in (("k", kw), ("v", vw)):
                    if staged and not self.uva:
                        host.get(name, (B, G, rows, w), dt)
                    dev.get(name, (B, G, rows, w), dt)  # on the compute stream, before any side-stream use

    @property
    def static(self) -> bool:
        """Static steps (model/static.py) gather on the device through the pool's view (uva), not on the worker."""
        return self.uva

    def prefetch(self, layer, fetch: Fetch) -> None:
        if fetch.fixed:
            self._prefetch_fixed(layer, fetch)
            return
        if self.uva:
            self._prefetch_view(layer, fetch)
            return
        B, G, m = fetch.idx.shape
        slot = self.ring.acquire()
        host = self.ring.host[slot]
        idx_host = count_host = None
        if not fetch.whole:  # the indices (and real counts) to the host, async; a whole past needs none
            idx_host = host.get("idx", (B, G, m), fetch.idx.dtype)
            idx_host.copy_(fetch.idx, non_blocking=True)
            if fetch.count is not None:
                count_host = host.get("count", tuple(fetch.count.shape), fetch.count.dtype)
                count_host.copy_(fetch.count, non_blocking=True)
        selected = self._record(self.events[layer.layer_idx]["selected"])  # after the selection and the copies
        job = submit_inference(self.worker, self._gather_copy, layer, slot, idx_host, count_host, m, selected)
        fetch.rows = (slot, job)  # the fetch carries what is in flight to the layer's view

    def _gather_copy(self, layer, slot: int, idx_host, count_host, m: int, selected):
        """Worker thread: rows idx_host of `layer`'s pool -> pinned slot -> device slot (side stream); only
        the first max(count) of each row (the real ones); a whole past straight from the pool."""
        selected.synchronize()  # the indices are on the host (this thread waits, not the compute stream)
        self.flush(layer)  # the last step's new row is in the pool
        ring = self.ring
        if ring.used[slot]:
            ring.copied[slot].synchronize()  # the slot's previous copy is done before we overwrite it
        if count_host is not None:
            m = max(1, int(count_host.max()))  # a host tensor: no device sync
        B, G = layer.k.batch, layer.k.heads
        dk = ring.dev[slot].get("k", (B, G, m, layer.k.width), layer.k.dtype)
        dv = ring.dev[slot].get("v", (B, G, m, layer.v.width), layer.v.dtype)
        if idx_host is not None:
            host = ring.host[slot]
            idx = idx_host[..., :m]
            sk = layer.k.gather(idx, out=host.get("k", dk.shape, dk.dtype))
            sv = layer.v.gather(idx, out=host.get("v", dv.shape, dv.dtype))
        with self.cuda.stream(self.stream):
            if ring.used[slot]:
                self.stream.wait_event(ring.consumed[slot])  # attention has read the slot's last rows
            if idx_host is not None:
                dk.copy_(sk, non_blocking=True)
                dv.copy_(sv, non_blocking=True)
            else:
                rows_to(layer.k, m, dk)
                rows_to(layer.v, m, dv)
            done = self._record(ring.copied[slot], self.stream)
        for t in (dk, dv):  # written on the side stream, read on the compute stream: the allocator must know
            record_stream(t, self.stream)
        ring.used[slot] = True
        self.bytes_moved += dk.nbytes + dv.nbytes
        return dk, dv, done

    def _prefetch_view(self, layer, fetch: Fetch) -> None:
        """The chosen rows (all cap slots: the counts stay on the device, as the mask) gathered on the side stream
        from the pinned pool's device view into a device slot, once the selection is done: the host only
        enqueues (measured on an H100: ~50 GB/s, against ~5 GB/s for a host gather and copy)."""
        self._land_prompt(layer)  # a prompt the worker is landing is in the pool (the first step only)
        B, G, m = fetch.idx.shape
        slot = self.ring.acquire()
        ring, events = self.ring, self.events[layer.layer_idx]
        dk = ring.dev[slot].get("k", (B, G, m, layer.k.width), layer.k.dtype)  # made by init_layer
        dv = ring.dev[slot].get("v", (B, G, m, layer.v.width), layer.v.dtype)
        selected = self._record(events["selected"])
        with self.cuda.stream(self.stream):
            self.stream.wait_event(selected)
            if ring.used[slot]:
                self.stream.wait_event(ring.consumed[slot])  # attention has read the slot's last rows
            flat = None
            for buf, name, out in ((layer.k, "k", dk), (layer.v, "v", dv)):
                view = self._view(layer, name, buf)
                if fetch.whole:
                    out.copy_(view.view(buf.store.shape)[: buf.batch, :, :m])
                    continue
                if flat is None or buf.capacity != layer.k.capacity:  # V's rows at K's flat index, sizes alike
                    flat = (fetch.idx + buf.row_base(fetch.idx.device)).view(-1)
                torch.index_select(view, 0, flat, out=out.view(-1, buf.width))
            done = self._record(ring.copied[slot], self.stream)
        for t in (dk, dv):
            record_stream(t, self.stream)
        ring.used[slot] = True
        self.bytes_moved += dk.nbytes + dv.nbytes
        fetch.rows = (slot, dk, dv, done)  # the fetch carries what is in flight to the layer's view

    def _prefetch_fixed(self, layer, fetch: Fetch) -> None:
        """A static step's fetch, on the side stream, straight into the working set [new token | m slots] of the
        layer's parity (slot 0 is the new row's: store_row): the chosen slots gathered, one op for K and one for V,
        or a whole past copied as it lies (offload). It waits for the selection (and so for the attention two
        layers back, which read the same buffer) and is joined by the layer's event: within a CUDA graph a fork
        and a join of the capture; from one step to the next the compute stream orders the buffers' use."""
        self._land_prompt(layer)  # a prompt the worker is landing is in the pool (before the first step only)
        B, G, m = fetch.idx.shape
        work = self.fixed[layer.layer_idx % 2]
        wk = work.get("k", (B, G, m + 1, layer.k.width), layer.k.dtype)
        wv = work.get("v", (B, G, m + 1, layer.v.width), layer.v.dtype)
        copied = self.fixed_events.setdefault(layer.layer_idx, self.cuda.Event())
        if fetch.whole:  # every slot real where the step's keep says: the mask, on the compute stream
            layer.static_mask(B, G, m)[:, :, 0, 1:].copy_(fetch.real)
        selected = self._record(self.events[layer.layer_idx]["selected"])
        with self.cuda.stream(self.stream):
            self.stream.wait_event(selected)
            pools = self.device_pool(layer)
            if fetch.whole:
                for pool, ws in zip(pools, (wk, wv)):
                    ws[:, :, 1:].copy_(pool[:, :, :m])
            else:
                gather_rows(*pools, fetch.idx, wk, wv)  # K and V rows, one op (one Triton kernel on a GPU)
            self._record(copied, self.stream)
        self.bytes_moved += (wk.nbytes + wv.nbytes) * m // (m + 1)
        fetch.rows = (None, wk, wv, copied)

    def device_pool(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K, V (B, G, capacity, d) as the GPU addresses them: device views of the pinned stores (a dense
        layer: its device buffers)."""
        if layer.dense:
            return layer.k.data, layer.v.data
        return tuple(self._view(layer, name, buf).view(buf.store.shape)[: buf.batch]
                     for name, buf in (("k", layer.k), ("v", layer.v)))

    def write_at(self, layer, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor) -> None:
        self._land_prompt(layer)
        layer.mirror = None  # decoding: the prompt is in the pool
        DirectTransfer.write_at(self, layer, k, v, at)  # through device_pool

    def _view(self, layer, name: str, buf):
        """A device view (B * G * capacity, width) of a pinned pool buffer's store, made again when the store
        changes (growth, join, retain). On CPU stand-ins, the store itself."""
        key = (layer.layer_idx, name)
        ptr = buf.store.data_ptr()
        memo = self.views.get(key)
        if memo is None or memo[0] != ptr or memo[1].numel() != buf.store.numel():
            view = device_view(buf.store, self.device) if self.pin else buf.store
            memo = self.views[key] = (ptr, view.view(-1, buf.width))
        return memo[1]

    def ready(self, layer, fetch: Fetch) -> Fetch:
        if self.uva:
            self.compute_stream().wait_event(fetch.rows[3])  # the GPU waits on this gather only
            fetch.rows = fetch.rows[:3]
            return fetch
        slot, job = fetch.rows
        dk, dv, done = job.result()  # a CPU-side wait for the worker (normally finished already)
        self.compute_stream().wait_event(done)  # the GPU waits on this copy only
        fetch.trim(dk.shape[2])
        fetch.rows = (slot, dk, dv)
        return fetch

    def fetch(self, layer, fetch: Fetch, k_new, v_new, in_place: bool):
        slot, dk, dv = fetch.rows
        if fetch.fixed and self.uva:  # a static step's working set, slot 0 the new row's (the layer stores it)
            fetch.rows = None
            B, G, m = fetch.idx.shape
            if fetch.count is None:
                return dk, dv, layer.static_mask(B, G, m)  # the speculation wrote which slots are real
            return dk, dv, (self._positions(m + 1) <= fetch.count.unsqueeze(-1)).unsqueeze(2)
        K = torch.cat([to_rows(k_new, dk.dtype), dk], dim=2)  # [new token, fetched rows]: the slot is free once
        V = torch.cat([to_rows(v_new, dv.dtype), dv], dim=2)  # this is done
        if fetch.keys is not None:  # the first slots' keys made by the selection (ShadowKV's rebuilt keys)
            K[:, :, 1 : 1 + fetch.keys.shape[2]] = to_rows(fetch.keys, K.dtype)
        self.ring.release(slot, self.compute_stream())
        fetch.rows = None
        m = dk.shape[2]
        if fetch.count is not None:  # [new token, m slots]: the new token and the first count slots (one op)
            return K, V, (self._positions(m + 1) <= fetch.count.unsqueeze(-1)).unsqueeze(2)
        return K, V, work_mask(fetch.real[..., :m] if fetch.real is not None else None)

    def _positions(self, n: int) -> torch.Tensor:
        """0..n-1 on the device, a slice of one tensor made with the prefill (init_layer), not each step."""
        if self.arange is None or self.arange.numel() < n:
            self.arange = torch.arange(max(n, 2 * (self.arange.numel() if self.arange is not None else 0)),
                                       device=self.device)
        return self.arange[:n]

    def write(self, layer, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor | None = None) -> None:
        """New rows into the pool. Device-resident layers (dense ones: layer 0) append directly. A host pool
        gets them through contiguous pinned staging, asynchronously (a strided pinned destination would make
        the copy blocking and bounce it through pageable memory): a prompt lands on the worker while the GPU
        computes the next layers; a decode row (with its target slots (B, G) when it overwrites evicted
        entries) lands before this layer's next gather."""
        if layer.dense:
            DirectTransfer.write(self, layer, k, v, slot)
            return
        if self.uva and k.shape[2] == 1:
            self._land_prompt(layer)  # the GPU orders its own row writes: no wait for the last one
        else:
            self.flush(layer)  # at most one staged write per layer
        if k.shape[2] > 1:
            if layer.mirror is not None:  # a prompt in chunks: the next chunk reads the past from the device
                for buf, x in zip(layer.mirror, (k, v)):
                    buf.append(x)
            self._write_prompt(layer, k, v)
            return
        layer.mirror = None  # decoding: the prompt is in the pool
        if layer.layer_idx not in self.events:
            self.init_layer(layer, k.shape[0], k.shape[1], 0)
        if self.uva:  # one row per (sequence, head), written by the compute stream through the pool's view
            start = self._claim(layer, 1) if slot is None else None
            rows = None
            for buf, name, x in ((layer.k, "k", k), (layer.v, "v", v)):
                if rows is None or buf.capacity != layer.k.capacity:  # V's rows at K's flat index, sizes alike
                    base = buf.row_base(self.device)  # (B, G, 1)
                    rows = (base + start if slot is None else base + slot.unsqueeze(-1)).view(-1)
                self._view(layer, name, buf).index_copy_(0, rows, to_rows(x, buf.dtype).reshape(-1, buf.width))
            self.unflushed[layer.layer_idx] = self._record(self.events[layer.layer_idx]["written"])
            return
        rows = self.rows[layer.layer_idx]
        k, v = to_rows(k, layer.k.dtype), to_rows(v, layer.v.dtype)  # staged as the pool stores it: the bytes it crosses
        sk = rows.get("k", k.shape, k.dtype)
        sv = rows.get("v", v.shape, v.dtype)
        sk.copy_(k, non_blocking=True)
        sv.copy_(v, non_blocking=True)
        if slot is None:
            target = self._claim(layer, 1)
        else:
            target = rows.get("slot", slot.shape, slot.dtype)
            target.copy_(slot, non_blocking=True)
        self.unflushed[layer.layer_idx] = (self._record(self.events[layer.layer_idx]["written"]), sk, sv, target)

    def _claim(self, layer, T: int) -> int:
        """Rows [start, start + T) of the pool for rows still in flight (sized now, on the main thread)."""
        start = layer.k.length
        if self.uva and start + T > layer.k.capacity:  # a new store: the GPU's writes into the old one first
            self.flush(layer)
        for buf in (layer.k, layer.v):
            buf.reserve(start + T)
            buf.length += T
        return start

    def _write_prompt(self, layer, k, v) -> None:
        """A prompt's K/V (B, G, T, d): one DMA into a pinned staging buffer (two, used in turn by
        successive layers), landed in the pool by the worker."""
        i = self.prefill_next
        self.prefill_next ^= 1
        if self.prefill_jobs[i] is not None:
            self.prefill_jobs[i].result()  # the worker has landed what the buffer held (two layers ago)
        k, v = to_rows(k, layer.k.dtype), to_rows(v, layer.v.dtype)  # int8 rows quantized on the device
        sk = self.prefill[i].get("k", k.shape, k.dtype)
        sv = self.prefill[i].get("v", v.shape, v.dtype)
        sk.copy_(k, non_blocking=True)
        sv.copy_(v, non_blocking=True)
        staged = (self._record(self.prefill_events[i]), sk, sv, self._claim(layer, k.shape[2]))
        job = submit_inference(self.worker, self._land, layer, staged)
        self.prefill_jobs[i] = job
        self.unflushed[layer.layer_idx] = job

    @staticmethod
    def _land(layer, staged) -> None:
        """Staged rows into the pool, once their device -> host copy has completed (this event only)."""
        written, sk, sv, target = staged
        written.synchronize()
        if isinstance(target, int):
            T = sk.shape[2]
            layer.k.data[:, :, target : target + T].copy_(sk)
            layer.v.data[:, :, target : target + T].copy_(sv)
        else:
            layer.k.put(target, sk)
            layer.v.put(target, sv)

    def flush(self, layer) -> None:
        """Whatever this layer has staged is in its pool when this returns (main thread or worker): a prompt the
        worker lands, a staged decode row, or (uva) the rows the GPU wrote through the pool's view."""
        staged = self.unflushed.pop(layer.layer_idx, None)
        if isinstance(staged, Future):
            staged.result()  # on the worker itself it has run already (one worker, FIFO)
        elif isinstance(staged, tuple):
            self._land(layer, staged)
        elif staged is not None:
            staged.synchronize()  # host readers of the pool (rebatch, recall, growth) only: never in a step

    def _land_prompt(self, layer) -> None:
        """A prompt the worker is landing in this layer's pool is there when this returns."""
        if isinstance(self.unflushed.get(layer.layer_idx), Future):
            self.flush(layer)

    def dense(self, layer):
        """A whole layer on the device: dense layers live there; a pooled one only when a prompt comes in chunks (the
        server's prefill): mirror.py."""
        if layer.dense:
            return layer.k.valid(), layer.v.valid()
        if layer.mirror is None:
            self.flush(layer)  # its staged rows in the pool before they are read
        return mirror.past(layer, self.device)

    def reset(self) -> None:
        """Drop what is in flight (a cache reused for a new prompt, or a step abandoned midway)."""
        self.worker.submit(lambda: None).result()  # every job queued so far has run
        self.unflushed.clear()
        self.prefill_jobs = [None, None]
        self.ring.reset()
        self.views.clear()
        self.bytes_moved = 0
