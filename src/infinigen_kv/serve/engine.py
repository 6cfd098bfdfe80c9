"""The generation engine behind the server: a bounded queue of jobs and one worker thread that runs them in
batches. Requests that arrive while a batch runs join the next one (ragged prompts left-padded); each job
streams its text to its own asyncio queue; a cancelled job (client gone) stops counting at the next step
and the batch ends early once no job in it is live.

Shutdown is two steps: `drain()` stops admitting (new jobs: ShuttingDown, a 503) while the queue and the
running batch go on; `abort()` ends whatever is left with an error event at the next step.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from ..baselines import make_cache
from ..generation import generate

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More jobs waiting than the queue holds (the server answers 503)."""


class ShuttingDown(QueueFull):
    """The server is draining: it takes no new jobs (503)."""


SHUTDOWN_MESSAGE = "the server is shutting down"


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: no logprobs; k: each token's logprob and its k most likely alternatives
    loop: asyncio.AbstractEventLoop | None = None
    # ("text", delta, logprobs) ..., then ("done", finish_reason, logprobs) or ("error", message, None);
    # logprobs: the entries of the tokens behind that event (a list of dicts), or None
    events: asyncio.Queue | None = None
    completion_tokens: int = 0
    cancelled: bool = False
    started: bool = False  # some text went out: the job cannot be run again from the start
    finished: bool = False  # its "done" or "error" went out

    def emit(self, kind: str, value: str, logprobs: list | None = None) -> None:
        self.started |= kind == "text"
        self.finished |= kind in ("done", "error")
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value, logprobs))
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening any more
            self.cancelled = True


def _byte_level_alphabet(tokenizer) -> dict[str, int] | None:
    """GPT-2's byte <-> printable character map, inverted, if the tokenizer is byte-level BPE; else None."""
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except Exception:  # a slow tokenizer: no backend to ask
        return None
    if decoder.get("type") != "ByteLevel":
        return None
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: b for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in chars.items()}


class TextStream:
    """Incremental detokenization of one job with stop sequences: text is released only when no stop
    sequence can still begin inside it, and never with half a UTF-8 character."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop, self.ids, self.sent = tokenizer, stop, [], 0
        self.text = ""

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; returns (text to send now, whether a stop sequence was hit)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.text = text[: min(hits)]
            return self._release(len(self.text)), True
        self.text = text
        safe = len(text) - (1 if text.endswith("\ufffd") else 0)
        hold = max((k for s in self.stop for k in range(1, len(s)) if text[:safe].endswith(s[:k])), default=0)
        return self._release(safe - hold), False

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : upto], upto
        return delta


class Engine:
    def __init__(self, model, tokenizer, method: str = "infinigen", options: dict | None = None,
                 max_batch: int = 8, queue_size: int = 64):
        self.model, self.tokenizer, self.method = model, tokenizer, method
        self.options = {**(options or {}), "tokenizer": tokenizer}
        self.max_batch, self.queue_size = max_batch, queue_size
        self.device = next(model.parameters()).device
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        eos = getattr(model.generation_config, "eos_token_id", None) or model.config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (min(self.eos) if self.eos else 0)
        self._unbyte = _byte_level_alphabet(tokenizer)  # piece character -> byte, for byte-level BPE
        self.tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to share across threads
        self.pending: collections.deque[Job] = collections.deque()
        self.running = 0
        self.cv = threading.Condition()
        self.admitting = True  # False once draining: submit() refuses
        self.stopping = False  # True once aborted: the running batch ends at its next step
        self.last = {"decode_tokens_per_s": 0.0, "fetched_fraction": 0.0, "pool_bytes": 0}
        make_cache(method, model, **self.options)  # calibrates now (or loads), not on the first request
        self.thread = threading.Thread(target=self._work, name="infinigen-engine", daemon=True)
        self.thread.start()

    # --- API of the event loop side ----------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        with self.tokenizer_lock:
            return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def chat_ids(self, messages: list[dict]) -> list[int]:
        with self.tokenizer_lock:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def submit(self, job: Job) -> Job:
        job.loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
        with self.cv:
            if not self.admitting or self.stopping:
                raise ShuttingDown(SHUTDOWN_MESSAGE)
            if len(self.pending) >= self.queue_size:
                raise QueueFull(f"queue full ({self.queue_size} requests waiting)")
            self.pending.append(job)
            self.cv.notify()
        return job

    @property
    def queue_depth(self) -> int:
        return len(self.pending) + self.running

    @property
    def idle(self) -> bool:
        with self.cv:  # the worker moves jobs from pending to running under this lock
            return not self.pending and not self.running

    def drain(self) -> None:
        """Stop admitting jobs; the waiting ones and the running batch go on."""
        with self.cv:
            self.admitting = False

    def abort(self) -> None:
        """Stop taking jobs and end the waiting ones now and the running ones at their next step, each with
        an error event (the stream gets its error and [DONE]). Does not wait."""
        with self.cv:
            self.admitting, self.stopping = False, True
            waiting, self.pending = list(self.pending), collections.deque()
            self.cv.notify_all()
        for job in waiting:
            job.emit("error", SHUTDOWN_MESSAGE)

    def close(self, timeout: float = 30.0) -> None:
        """abort(), then join the worker."""
        self.abort()
        self.thread.join(timeout)

    # --- worker thread -----------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self.cv:
                while not self.pending and not self.stopping:
                    self.cv.wait()
                if self.stopping:
                    return
                batch = []
                while self.pending and len(batch) < self.max_batch:
                    job = self.pending.popleft()
                    if not job.cancelled:
                        batch.append(job)
                self.running = len(batch)
            try:
                self._run_isolated(batch)
            finally:
                self.running = 0

    def _run_isolated(self, batch: list[Job]) -> None:
        """Run a batch; if it fails, run again alone each job that has not sent anything yet, so that one
        bad request fails only itself, never its batch-mates (nor the server)."""
        try:
            if batch:
                self._run(batch)
            return
        except Exception as e:
            log.exception("generation failed for a batch of %d", len(batch))
            error = f"generation failed: {type(e).__name__}: {e}"
        for job in batch:
            if job.finished:
                continue
            if len(batch) > 1 and not job.started and not job.cancelled:
                self._run_isolated([job])
            else:
                job.emit("error", error)

    def _entry(self, token: int, logprob: float, alternatives) -> dict:
        """One token's logprob entry, in the chat API's form (the completions form is derived from it)."""
        def one(t: int, lp: float) -> dict:
            text = self.tokenizer.decode([t])
            return {"token": text, "logprob": lp, "bytes": self._bytes(t, text)}

        return {**one(token, logprob), "top_logprobs": [one(t, lp) for t, lp in alternatives]}

    def _bytes(self, token: int, text: str) -> list[int]:
        """A token's own bytes: its text may be half a UTF-8 character (decoded as U+FFFD), which is what
        the API's `bytes` field is for. Byte-level BPE pieces and <0xNN> byte-fallback pieces map back to
        bytes exactly; other pieces are whole characters."""
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str):
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return [int(piece[3:5], 16)]
            if self._unbyte is not None and all(c in self._unbyte for c in piece):
                return [self._unbyte[c] for c in piece]
        return list(text.encode("utf-8"))

    def _run(self, batch: list[Job]) -> None:
        n = max(len(j.prompt_ids) for j in batch)
        ids = torch.full((len(batch), n), self.pad, dtype=torch.long)  # left-padded (B, n)
        mask = torch.zeros(len(batch), n, dtype=torch.long)
        for b, j in enumerate(batch):
            ids[b, n - len(j.prompt_ids):] = torch.tensor(j.prompt_ids)
            mask[b, n - len(j.prompt_ids):] = 1
        streams = [TextStream(self.tokenizer, j.stop) for j in batch]
        entries: list[list[dict]] = [[] for _ in batch]  # logprob entries of tokens not yet sent, per job
        live = [True] * len(batch)
        top = max((j.logprobs for j in batch if j.logprobs is not None), default=None)

        def taken(b: int) -> list | None:  # the entries to send with the next event of job b
            if batch[b].logprobs is None:
                return None
            out, entries[b] = entries[b], []
            return out

        def finish(b: int, reason: str) -> None:
            with self.tokenizer_lock:
                rest = streams[b].flush()
            if rest:
                batch[b].emit("text", rest, taken(b))
            batch[b].emit("done", reason, taken(b))
            live[b] = False

        def on_step(step: int, new: torch.Tensor, logprobs) -> bool:
            if logprobs is not None:  # (chosen (B,), top values (B, k), top ids (B, k)) -> lists, once a step
                logprobs = [x.tolist() for x in logprobs]
            for b, t in enumerate(new.tolist()):
                job = batch[b]
                if not live[b]:
                    continue
                if job.cancelled or self.stopping:
                    live[b] = False
                    if self.stopping:
                        job.emit("error", SHUTDOWN_MESSAGE)
                    continue
                if t in self.eos:
                    finish(b, "stop")
                    continue
                job.completion_tokens += 1
                with self.tokenizer_lock:
                    delta, stopped = streams[b].push(t)
                    if job.logprobs is not None:
                        chosen, values, ids = logprobs[0][b], logprobs[1][b], logprobs[2][b]
                        entries[b].append(self._entry(t, chosen, zip(ids[: job.logprobs], values[: job.logprobs])))
                if delta:
                    job.emit("text", delta, taken(b))
                if stopped:
                    finish(b, "stop")
                elif job.completion_tokens >= job.max_tokens:
                    finish(b, "length")
            return not any(live)

        cache = make_cache(self.method, self.model, **self.options)
        t0 = time.perf_counter()
        r = generate(self.model, ids.to(self.device), mask.to(self.device), cache=cache,
                     max_new_tokens=max(j.max_tokens for j in batch), temperature=[j.temperature for j in batch],
                     top_p=[j.top_p for j in batch], seed=[j.seed for j in batch], stop_at_eos=False, on_step=on_step,
                     logprobs=top)
        for b in range(len(batch)):  # rows the loop ended before they finished (cannot happen; be safe)
            if live[b]:
                finish(b, "length")
        stats = getattr(cache, "stats", {})
        self.last = {"decode_tokens_per_s": r.decode_tokens_per_s, "batch": len(batch),
                     "fetched_fraction": stats.get("fetched_fraction", 1.0),
                     "pool_bytes": stats.get("pool_bytes", 0), "seconds": time.perf_counter() - t0}
