"""What InfiniGen's decode steps fetched and read, per layer: the `stats` a cache reports, and the recall
diagnostic (the share of the true attention mass the fetched rows carry).

What the host knows adds up in integers; what only the device knows (real counts, valid lengths) in one
float64 tensor per layer, one add per layer and step: no host sync in the decode loop.
"""

from __future__ import annotations

import weakref

import torch

from .fetch import Fetch, counted


def _accumulate(acc: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """acc + x in place (a fresh float64 copy of x the first time): one op, no host sync."""
    return x.to(torch.float64, copy=True) if acc is None else acc.add_(x)


class Counters:
    """Per layer, over decode steps: past entries fetched and fetchable (padding excluded), rows (sequence x KV
    head) served, steps; rows gathered and KV bytes read over all layers; the recall diagnostic's sums."""

    def __init__(self, layers: int, device):
        self.recall = torch.zeros(layers, device=device)
        self.reset()

    def reset(self) -> None:
        L = len(self.recall)
        self.fetched, self.possible = [0] * L, [0] * L
        self.fetched_t, self.possible_t = [None] * L, [None] * L
        # (a weak reference to the current step's keep, its valid entries over all rows): a step's tensors are not
        # kept past it (in a CUDA graph they live in the graph's memory)
        self.keep_total = (None, None)
        # static steps (fixed shapes; every pool layer fetches at every one): each layer's real slots, added as the
        # mask (B, G, k) they are (one op a layer), and the valid past entries, once a step for all layers
        self.fetched_fixed = [None] * L
        self.possible_fixed = None  # (valid entries of one layer, summed over the static steps)
        self.fixed_steps = [0] * L  # static steps per layer, and in all (possible_fixed's)
        self.fixed_total = 0
        self.rows, self.steps = [0] * L, [0] * L
        self.rows_moved = 0  # padded rows gathered (what the transfer actually moves)
        self.kv_bytes = 0  # KV bytes read by decode steps: partial keys + fetched rows + dense layers
        self.recall.zero_()
        self.recall_heads = self.topk_heads = None  # (L, H) sums, made at the first recorded step
        self.recall_steps = [0] * L

    def count_fetch(self, target, fetch: Fetch) -> None:
        """A fetch of `target` (a pool layer) started: what it may read and what it reads."""
        idx, keep = fetch.idx, fetch.keep
        B, G, m = idx.shape
        n, nxt = target.k.length, target.layer_idx
        self.rows[nxt] += B * G
        self.steps[nxt] += 1
        self.rows_moved += idx.numel()
        row = (target.k.width + target.v.width) * target.k.data.element_size()
        self.kv_bytes += B * G * (n * fetch.scored + (m + 1) * row + fetch.meta)
        if fetch.keys is not None:  # rebuilt keys: their rows' keys are not read (meta counts what is)
            self.kv_bytes -= B * G * fetch.keys.shape[2] * target.k.width * target.k.data.element_size()
        if fetch.fixed and fetch.count is None and keep is not None:
            self.count_fixed(nxt, fetch.real, keep, G)
            return
        got = fetch.count if fetch.count is not None else fetch.real.sum(-1) if fetch.real is not None else None
        if fetch.total is not None:  # the host knows it (CPU): no tensor op
            self.fetched[nxt] += fetch.total
        elif got is None:
            self.fetched[nxt] += B * G * m
        else:
            self.fetched_t[nxt] = _accumulate(self.fetched_t[nxt], got)
        if keep is None:
            self.possible[nxt] += B * G * n
        else:
            if not self._current(keep):  # one sum per step: every layer shares the step's mask
                total = keep.sum() * (G // keep.shape[1])
                self.keep_total = (weakref.ref(keep), int(total) if keep.device.type == "cpu" else total)  # (CPU:
                # no sync)
            if isinstance(self.keep_total[1], int):
                self.possible[nxt] += self.keep_total[1]
            else:
                self.possible_t[nxt] = _accumulate(self.possible_t[nxt], self.keep_total[1])

    def _current(self, keep: torch.Tensor) -> bool:
        """Whether keep is the step's whose valid entries are counted already."""
        return self.keep_total[0] is not None and self.keep_total[0]() is keep

    def count_fixed(self, nxt: int, real: torch.Tensor, keep: torch.Tensor, G: int) -> None:
        """A static step's fetch of layer nxt: real (B, G, k) its real slots, keep (B, 1, n) the step's valid past."""
        self.fetched_fixed[nxt] = _accumulate(self.fetched_fixed[nxt], real)
        if not self._current(keep):  # the step's first layer: its valid entries, for every layer
            self.keep_total = (weakref.ref(keep), None)
            self.possible_fixed = _accumulate(self.possible_fixed, keep.sum() * (G // keep.shape[1]))
            self.fixed_total += 1
        self.fixed_steps[nxt] += 1

    def count_dense(self, layer, window: int | None) -> None:
        """A dense decode step: every past entry it may attend counts as fetched (a local layer's window)."""
        i, rows, past = layer.layer_idx, layer.k.batch * layer.k.heads, layer.seen - 1
        read = min(past, window - 1) if window is not None else past
        self.fetched[i] += rows * read
        self.possible[i] += rows * read
        self.rows[i] += rows
        self.steps[i] += 1
        self.kv_bytes += rows * (read + 1) * (layer.k.width + layer.v.width) * layer.k.data.element_size()

    def record_recall(self, layer, q: torch.Tensor, view, attention_mask, scaling: float) -> None:
        """True attention of q (B, G, r, d) over layer's whole pool; add the mass on the rows its view (the step's
        working set, model/kv.py) fetched."""
        if layer.slots is not None and layer.slots.evicted:
            return  # positions no longer match the slots: the diagnostic measures unevicted pools only
        layer.transfer.flush(layer)
        K = layer.k.valid().to(q.device)  # (B, G, n + 1, d)
        s = torch.matmul(q.float(), K.float().transpose(-1, -2)) * scaling  # (B, G, r, n + 1)
        if attention_mask is not None:
            m = attention_mask[:, :, -1:, :]  # (B, 1, 1, n + 1)
            s = s.masked_fill(~m if m.dtype == torch.bool else m != 0, float("-inf"))
        p = torch.softmax(s, dim=-1)
        sel = view.mask.squeeze(2)[..., 1:] if view.mask is not None else 1.0  # (B, G, m) real slots
        if view.chosen is not None and view.chosen[1] is not None:
            sel = counted(view.chosen[1], view.rows.shape[-1]).to(p.dtype)
        B, G, r, n1 = p.shape
        m = view.rows.shape[-1]
        sel = torch.as_tensor(sel, dtype=p.dtype, device=p.device).expand(B, G, m)
        got = torch.gather(p, 3, view.rows.unsqueeze(2).expand(-1, -1, r, -1))  # (B, G, r, m)
        mass = (got * sel.unsqueeze(2)).sum(-1) + p[..., -1]  # (B, G, r), + the new token, always attended
        # against each head's true top-k, k = the row's real fetched rows: the share of those k that were fetched
        chosen = torch.zeros(B, G, n1, dtype=torch.bool, device=p.device)
        chosen.scatter_(2, view.rows, sel > 0)  # (B, G, n + 1): the past positions fetched
        k = sel.sum(-1, keepdim=True).unsqueeze(2)  # (B, G, 1, 1)
        top = p[..., :-1].topk(min(m, n1 - 1), dim=-1).indices  # (B, G, r, m), best first
        hit = chosen.unsqueeze(2).expand(-1, -1, r, -1).gather(3, top)  # (B, G, r, m)
        within = torch.arange(top.shape[-1], device=p.device) < k  # (B, G, 1, m)
        topk = (hit & within).sum(-1) / k.squeeze(-1).clamp(min=1)  # (B, G, r)
        i = layer.layer_idx
        self.recall[i] += mass.mean().to(self.recall.device)
        if self.recall_heads is None:  # (L, H): per query head, as the model numbers them (KV group-major)
            self.recall_heads = torch.zeros(len(self.recall), G * r, dtype=torch.float64)
            self.topk_heads = torch.zeros_like(self.recall_heads)
        self.recall_heads[i] += mass.mean(0).flatten().double().cpu()
        self.topk_heads[i] += topk.mean(0).flatten().double().cpu()
        self.recall_steps[i] += 1

    # A CUDA graph replays a step's device work, not its Python: the host counts of the step it captured are taken
    # once (snapshot around its warm-up), and added after every replay (model/static.py).
    HOST = ("fetched", "possible", "rows", "steps", "recall_steps", "fixed_steps")  # per layer
    TOTALS = ("rows_moved", "kv_bytes", "fixed_total")

    def snapshot(self) -> tuple:
        """The counters as they are: host values, and copies of the device accumulators."""
        host = {k: list(getattr(self, k)) for k in self.HOST} | {k: getattr(self, k) for k in self.TOTALS}
        tensors = (self.fetched_t, self.possible_t, self.fetched_fixed, [self.possible_fixed])
        return host, [[None if t is None else t.clone() for t in ts] for ts in tensors]

    def restore(self, snap: tuple) -> None:
        """Back to `snap`; device accumulators in place (a captured graph adds to these very tensors)."""
        host, device = snap
        for k, v in host.items():
            setattr(self, k, list(v) if isinstance(v, list) else v)
        for now, then in zip((self.fetched_t, self.possible_t, self.fetched_fixed, [self.possible_fixed]), device):
            for t, was in zip(now, then):
                if t is not None:
                    t.copy_(was) if was is not None else t.zero_()
        self.keep_total = (None, None)

    def add_host(self, before: tuple, after: tuple) -> None:
        """The host counts one step added (after - before), added again (a replayed step's)."""
        for k in self.HOST:
            setattr(self, k, [x + b - a for x, a, b in zip(getattr(self, k), before[0][k], after[0][k])])
        for k in self.TOTALS:
            setattr(self, k, getattr(self, k) + after[0][k] - before[0][k])

    def totals(self) -> tuple[list, list]:
        """Per layer, past entries fetched and fetchable so far (host counts and device accumulators, read: a sync;
        the accumulators stay, as a captured graph adds to them)."""
        def summed(t):
            return float(t.sum()) if t is not None else 0.0

        fixed = float(self.possible_fixed) / self.fixed_total if self.possible_fixed is not None else 0.0
        fetched = [n + summed(t) + summed(f) for n, t, f in zip(self.fetched, self.fetched_t, self.fetched_fixed)]
        possible = [n + summed(t) + fixed * s for n, t, s in zip(self.possible, self.possible_t, self.fixed_steps)]
        return fetched, possible

    def fold(self) -> None:
        """Per-row accumulators into the host counters (a sync: between steps, when the batch changes, a report)."""
        self.fetched, self.possible = self.totals()
        L = len(self.fetched)
        self.fetched_t, self.possible_t, self.fetched_fixed = [None] * L, [None] * L, [None] * L
        self.possible_fixed, self.fixed_steps, self.fixed_total = None, [0] * L, 0
        self.keep_total = (None, None)

    def report(self, layers, transfers, track_recall: bool) -> dict:
        """fetched fraction per layer and overall (share of the past entries fetched over the decode steps; the
        overall figure is the mean over layers), fetched tokens per (sequence, KV head) and step, bytes moved."""
        fetched, possible = self.totals()
        frac = [f / p if p else 0.0 for f, p in zip(fetched, possible)]
        tokens = [f / r if r else 0.0 for f, r in zip(fetched, self.rows)]
        active = [i for i, s in enumerate(self.steps) if s > 0]
        first = layers[0]
        row_bytes = (first.k.width + first.v.width) * first.k.data.element_size() if first.is_initialized else 0
        # bytes moved: what the CUDA transfers copied to the device (they trim each fetch to its real rows), else
        # the rows gathered
        moved = [t.bytes_moved for t in transfers if t.bytes_moved is not None]
        return {
            "fetched_fraction": sum(frac[i] for i in active) / len(active) if active else 0.0,
            "fetched_fraction_per_layer": frac,
            "tokens_per_step": tokens,
            "bytes_moved": sum(moved) if moved else self.rows_moved * row_bytes,
            "decode_steps": max(self.steps) if self.steps else 0,
            "kv_bytes_per_step": self.kv_bytes // max(max(self.steps), 1),
            "pool_bytes": sum(l.nbytes for l in layers),
            **(self.recall_report() if track_recall else {}),
        }

    def recall_report(self) -> dict:
        """The recall diagnostic over the recorded steps: per layer, the share of the true attention mass on the
        fetched rows (recall_per_layer); per layer and query head, that share (recall_per_head) and the share of
        the head's true top-k it fetched, k = its row's fetched count (topk_recall_per_head); None where a layer
        recorded no step (a dense layer)."""
        steps = self.recall_steps
        per_layer = [r / n if n else None for r, n in zip(self.recall.cpu().tolist(), steps)]
        heads = {"recall_per_head": self.recall_heads, "topk_recall_per_head": self.topk_heads}
        return {"recall_per_layer": per_layer,
                **{name: [None if t is None or not n else (t[i] / n).tolist() for i, n in enumerate(steps)]
                   for name, t in heads.items()}}
