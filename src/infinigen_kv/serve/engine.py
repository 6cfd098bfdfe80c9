"""The generation engine behind the server: a bounded queue of jobs and one worker thread that batches them
continuously (batching.py): a job's prefill runs in chunks between decode steps, then its row joins the
running batch; a row leaves at the step it ends or its client goes (job.cancelled). Each job streams its
text to its own asyncio queue. Admission is memory-aware: a job starts only if the batch with it fits
`max_pool_bytes`.

The prefix store (runtime/prefix.py) keeps the blocks of past prompts in the same memory budget: a job's prefill
restores the longest stored prefix of its prompt and computes only the rest; the store gives back memory (least
recently used blocks first) whenever the running requests need it, and may keep a disk tier besides.

Shutdown is two steps: `drain()` stops admitting (new jobs: ShuttingDown, a 503) while the queue and the
running batch go on; `abort()` ends whatever is left with an error event at the next step.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

import torch

from ..config import DEFAULT_METHOD
from ..methods.registry import make_cache
from ..methods.registry import method as method_traits
from ..runtime import threads
from ..runtime.batching import Prefill, RunningBatch
from ..runtime.prefix import PrefixStore, cache_namespace
from .jobs import SHUTDOWN_MESSAGE, Job, QueueFull, ShuttingDown, TooLarge  # noqa: F401 (the server's names)
from .memory import available_memory, release_memory
from .metrics import Metrics
from .output import Logprobs, Row, TextStream

log = logging.getLogger(__name__)


POOL_SHARE = 0.5  # the default --max-pool-bytes: this share of the memory free when the server starts
BATCHING = ("continuous", "static")


class Engine:
    """`Engine(model, tokenizer, method, options)`: jobs in, streamed events out.

    Each loop of the worker: start the prefill of the next waiting job if it fits (`_admit`), run one chunk
    of the prefill in progress (a finished one joins the running batch), then one decode step of the batch,
    retiring the rows that ended or whose client left. `batching="static"` is the old policy, for
    comparison: a batch is formed only when none is running, and runs until its last row ends.

    Memory: a job costs the cache bytes of its row in the batch it joins: rows x (the batch's longest
    prompt + its longest remaining output) entries, every row padded to the longest. A job is admitted only
    if the batch with it fits `max_pool_bytes`; one that could never fit alone is refused at submit
    (TooLarge, a 400)."""

    def __init__(self, model, tokenizer, method: str = DEFAULT_METHOD, options: dict | None = None,
                 max_batch: int = 8, queue_size: int = 64, batching: str = "continuous", prefill_chunk: int = 256,
                 max_pool_bytes: int | None = None, prefix_cache_bytes: int | None = None,
                 prefix_cache_dir: str | None = None, prefix_cache_disk_bytes: int | None = None, start: bool = True):
        if batching not in BATCHING:
            raise ValueError(f"batching must be one of {', '.join(BATCHING)}, got {batching!r}")
        if (options or {}).get("capacity") is not None or (options or {}).get("capacity_bytes") is not None:
            raise ValueError("the server bounds the pool with --max-pool-bytes; --capacity is for generate and bench")
        if not method_traits(method).batches:  # (an installed method declares it; the built-in ones all batch)
            raise ValueError(f"the server runs methods that batch continuously; {method} does not (batches=False)")
        self.model, self.tokenizer, self.method = model, tokenizer, method
        self.options = {**(options or {}), "tokenizer": tokenizer}
        self.max_batch, self.queue_size, self.batching, self.prefill_chunk = max_batch, queue_size, batching, prefill_chunk
        self.device = next(model.parameters()).device
        self.context = model.config.max_positions or None
        eos = model.config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
        self.tokenizer_lock = threading.Lock()  # fast tokenizers are not safe to share across threads
        self.logprobs = Logprobs(tokenizer, self.tokenizer_lock)
        self.pending: collections.deque[Job] = collections.deque()
        self.cv = threading.Condition()
        self.admitting = True  # False once draining: submit() refuses
        self.stopping = False  # True once aborted: the running batch ends at its next step
        self.metrics = Metrics(self)
        # what the worker shows the rest (read without a lock: ints and floats, replaced whole)
        self.running = 0  # rows decoding + the job in prefill
        self.pool_bytes = 0  # bytes of the running batch's cache and the prefill's
        self.last = {"decode_tokens_per_s": 0.0, "fetched_fraction": 0.0}  # snapshots (_snapshot)
        probe = make_cache(method, model, **self.options)  # calibrates now (or loads), not on the first request
        Prefill(model, probe, [min(self.eos) if self.eos else 0] * 2).step()  # buffers to measure
        self.sequence_bytes = probe.sequence_bytes  # the cost model (admits)
        if max_pool_bytes is None:
            on_device = self.device.type == "cuda" and not method_traits(method).pool_on_host  # else: host memory
            free = torch.cuda.mem_get_info(self.device)[0] if on_device else available_memory()
            max_pool_bytes = int(POOL_SHARE * free)
        self.max_pool_bytes = max_pool_bytes
        self.prefix, self.prefix_note = self._prefix_store(probe, prefix_cache_bytes, prefix_cache_dir,
                                                           prefix_cache_disk_bytes)
        self.batch, self.rows = RunningBatch(model), []  # the worker's state, whole before the worker runs
        self.prefill: tuple[Job, Prefill] | None = None
        self.forming = False  # static batching: a batch is being formed (no decode step until it is)
        self.thread = threading.Thread(target=self._work, name="infinigen-engine", daemon=True)
        if start:  # (else the caller runs _work on its own thread: on_one_thread)
            self.thread.start()

    @classmethod
    def on_one_thread(cls, load, *args, **kwargs) -> "Engine":
        """An engine made and run on one thread (threads.on_own_thread: every tensor operation of the server there):
        load() -> (model, tokenizer), then the engine (its calibration and probe) and its worker loop; the Engine's
        arguments follow."""
        def build() -> "Engine":
            engine = cls(*load(), *args, start=False, **kwargs)
            engine.thread = threading.current_thread()
            return engine

        return threads.on_own_thread(build, lambda engine: engine._work(), "infinigen-engine")

    def _prefix_store(self, probe, memory_bytes, disk_dir, disk_bytes) -> tuple[PrefixStore | None, str | None]:
        """The prefix store (on by default in memory: its limit the pool's, which it gives back on demand) and, when
        there is none, why (the responses' usage says it)."""
        if memory_bytes == 0 and not disk_dir:
            return None, "off (--prefix-cache-bytes 0)"
        ns = cache_namespace(self.model, probe, self.prefill_chunk)
        if ns is None:  # (the server refuses pools with a capacity: --max-pool-bytes bounds them)
            return None, f"unsupported by {self.method}: the entries it keeps depend on the whole prompt"
        self.prefix_limit = self.max_pool_bytes if memory_bytes is None else min(memory_bytes, self.max_pool_bytes)
        return PrefixStore(ns, self.prefix_limit, disk_dir, disk_bytes, block=self.prefill_chunk), None

    # --- API of the event loop side ----------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        with self.tokenizer_lock:
            return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self.tokenizer.decode(ids)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        with self.tokenizer_lock:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def cost(self, rows: int, tokens: int) -> int:
        """Cache bytes of `rows` sequences padded to `tokens` tokens each."""
        return rows * self.sequence_bytes(tokens)

    def submit(self, job: Job) -> Job:
        if job.n > self.max_batch:
            raise TooLarge(f"n={job.n} choices is over this server's --max-batch of {self.max_batch}")
        need = self.cost(job.n, len(job.prompt_ids) + job.max_tokens)
        if need > self.max_pool_bytes:
            raise TooLarge(f"the prompt ({len(job.prompt_ids)} tokens) and max_tokens ({job.max_tokens}) need "
                           f"{need / 2**20:.1f} MiB of KV cache, over this server's --max-pool-bytes of "
                           f"{self.max_pool_bytes / 2**20:.1f} MiB")
        job.loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
        job.submitted = time.perf_counter()
        with self.cv:
            if not self.admitting or self.stopping:
                raise ShuttingDown(SHUTDOWN_MESSAGE)
            if len(self.pending) >= self.queue_size:
                raise QueueFull(f"queue full ({self.queue_size} requests waiting)")
            self.pending.append(job)
            self.cv.notify()
        return job

    @property
    def waiting(self) -> int:
        return len(self.pending)

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
        self._window = [time.perf_counter(), 0]  # decode tokens/s: start of the window, tokens in it
        while True:
            with self.cv:
                while not (self.pending or self.rows or self.prefill or self.stopping):
                    self.cv.wait()
                if self.stopping:
                    break
                if self.prefill is None:
                    self.prefill = self._admit()
                self.running = len(self.rows) + (self.prefill is not None)
            if self.prefill is not None:
                self._prefill_step()
            elif self.forming:
                self.forming = False  # static: nothing more to admit, the batch decodes to its end
            if self.rows and not self.forming:
                self._decode_step()
            self._publish()
        for row in self.rows:
            row.job.emit("error", SHUTDOWN_MESSAGE)
        if self.prefill is not None:
            self.prefill[0].emit("error", SHUTDOWN_MESSAGE)
        self.rows, self.prefill, self.running = [], None, 0

    def _admit(self) -> tuple[Job, Prefill] | None:
        """The next waiting job as a prefill, if the policy and memory allow it now (under the lock)."""
        while self.pending and self.pending[0].cancelled:
            self.pending.popleft()
        if not self.pending or len(self.rows) + self.pending[0].n > self.max_batch:
            return None
        if self.batching == "static":
            if self.rows and not self.forming:
                return None  # a batch runs: the next one forms when it is over
            self.forming = True
        job = self.pending[0]
        need = self._batch_cost(job)
        if need > self.max_pool_bytes:
            return None  # waits for rows to leave (it fits alone: submit checked)
        self.pending.popleft()
        try:
            self._fit_prefix(need)
            if not self.rows:  # after idle time: the thread count's look at the machine's load starts now, not at the
                threads.watch(self.model.backend)  # last step (other work in between would count against the next steps)
            cache = make_cache(self.method, self.model, **self.options)
            p = Prefill(self.model, cache, job.prompt_ids, self.prefill_chunk, job.prompt_logprobs, self.prefix,
                        reserve=len(job.prompt_ids) + job.max_tokens)
            job.cached_tokens = p.cached
            self.metrics.prefill_cached_tokens.inc(p.cached)
            return job, p
        except Exception as e:
            self._fail([job], e)
            return None

    def _prefill_step(self) -> None:
        job, p = self.prefill
        if job.cancelled:
            self.prefill = None
            return
        t0, start = time.perf_counter(), p.done
        try:
            done = p.step()
            release_memory()  # a chunk's activations (tens of MB, larger as the prompt goes on)
            self.metrics.prefill_tokens.inc(p.done - start)
        except Exception as e:
            self.prefill = None
            self._fail([job], e)
            return
        if done:
            self.prefill = None
            if job.echo or job.prompt_logprobs is not None:
                entries = self.logprobs.prompt_entries(job, p.prompt_logprobs) if job.prompt_logprobs is not None else None
                for i in range(job.n):
                    job.emit("prompt", None, entries, i)
            if job.max_tokens == 0:  # the prompt only (scoring)
                for i in range(job.n):
                    job.emit("done", "length", None, i)
                self.metrics.prefill_seconds.inc(time.perf_counter() - t0)
                return
            try:  # n choices: n rows, each from a copy of the prefilled cache (the last from the cache itself)
                for i in range(job.n):
                    cache = p.cache.fork() if i < job.n - 1 else None
                    self.batch.join(p, job.sampling(i), job.max_tokens, cache)
                    self.rows.append(Row(job, TextStream(self.tokenizer, job.stop), i))
            except Exception as e:  # e.g. a seed torch refuses: the job's rows (the last ones) leave again
                self.rows = [r for r in self.rows if r.job is not job]
                self._fail([job], e)
                try:
                    self.batch.retain(list(range(len(self.rows))))
                except Exception as e2:  # the batch's cache moved and cannot go back: no row can go on
                    self._fail_batch(e2)
                return
            release_memory()  # what the join freed
        self.metrics.prefill_seconds.inc(time.perf_counter() - t0)

    def _decode_step(self) -> None:
        rows, now = self.rows, time.perf_counter()
        top = max((r.job.logprobs for r in rows if r.job.logprobs is not None), default=None)
        try:
            ids, lps = self.batch.sample(top)
            if lps is not None:  # (chosen (B,), top values (B, k), top ids (B, k)) -> lists, once a step
                lps = [x.tolist() for x in lps]
            live = [b for b, t in enumerate(ids.tolist()) if self._token(rows[b], t, lps, b, now)]
            if not live:
                self._snapshot()  # the batch's cache (and its statistics) goes with its last row
            order = self.batch.retain(live)
            if len(live) < len(rows):
                release_memory()
                self._fit_prefix()
            self.rows = [rows[b] for b in order]
            if self.rows:
                threads.decode(self.model.backend)  # (after a prompt chunk, which ran on every core)
                self.batch.forward(ids[order])
                threads.decode_step(self.model.backend)  # on CPU: the next steps' thread count, from the machine's load
                self._window[1] += len(live)
        except Exception as e:
            self._fail_batch(e)
        m = self.metrics
        m.decode_seconds.inc(time.perf_counter() - now)
        m.decode_steps.inc()
        m.decode_rows.inc(len(rows))

    def _token(self, row: Row, t: int, lps, b: int, now: float) -> bool:
        """Hand row's new token t to its job; False once the row is done (ended or cancelled)."""
        job = row.job
        if job.cancelled:
            return False
        if not row.last:
            if row.index == 0:
                self.metrics.ttft.observe(now - job.submitted)
        else:
            self.metrics.itl.observe(now - row.last)
        row.last = now
        if t in self.eos and not job.ignore_eos:
            return row.finish("stop", self.tokenizer_lock)
        job.completion_tokens += 1
        row.tokens += 1
        with self.tokenizer_lock:
            delta, stopped = row.stream.push(t)
            if job.logprobs is not None:
                chosen, values, ids = lps[0][b], lps[1][b], lps[2][b]
                row.entries.append(self.logprobs.entry(t, chosen, zip(ids[: job.logprobs], values[: job.logprobs])))
        if delta:
            job.emit("text", delta, row.taken(), row.index)
        if stopped:
            return row.finish("stop", self.tokenizer_lock)
        if row.tokens >= job.max_tokens:
            return row.finish("length", self.tokenizer_lock)
        return True

    def _batch_cost(self, job: Job | None = None) -> int:
        """Cache bytes of the running batch with `job` joined: every row padded to the longest prompt plus the
        longest remaining output."""
        b = self.batch
        prompt, new, n = (len(job.prompt_ids), job.max_tokens, job.n) if job is not None else (0, 0, 0)
        columns = max(b.mask.shape[1] if len(b) else 0, prompt) + max(b.room(), new)
        return self.cost(len(b) + n, columns)

    def _fit_prefix(self, committed: int | None = None) -> None:
        """The prefix store's memory limit: what the running requests (`committed` bytes; default: the batch and
        the job in prefill) leave of the pool's budget, up to its own; over it, least recently used blocks go."""
        if self.prefix is not None:
            if committed is None:
                committed = self._batch_cost(self.prefill[0] if self.prefill is not None else None)
            self.prefix.resize(min(self.prefix_limit, self.max_pool_bytes - committed))

    def _fail(self, jobs: list[Job], e: Exception) -> None:
        log.error("generation failed for %d request(s): %s: %s", len(jobs), type(e).__name__, e,
                  exc_info=log.isEnabledFor(logging.DEBUG))
        for job in jobs:
            if not job.finished:
                job.emit("error", f"generation failed: {type(e).__name__}: {e}")

    def _fail_batch(self, e: Exception) -> None:
        """A decode step (or a join) failed: no row can go on; the server does."""
        self._fail([r.job for r in self.rows], e)
        self.batch, self.rows = RunningBatch(self.model), []

    def _publish(self) -> None:
        """What the metrics read: pool bytes now; decode tokens/s and fetched fraction about once a second."""
        caches = [self.batch.cache] + ([self.prefill[1].cache] if self.prefill else [])
        self.pool_bytes = sum(c.buffer_bytes() for c in caches if c is not None)
        self.running = len(self.rows) + (self.prefill is not None)
        if time.perf_counter() - self._window[0] >= 1.0:
            self._snapshot()

    def _snapshot(self) -> None:
        """Decode tokens/s since the last snapshot, and the running cache's fetched fraction so far."""
        start, tokens = self._window
        now = time.perf_counter()
        stats = self.batch.cache.stats if self.batch.cache is not None else {}
        last = dict(self.last)  # replaced whole: the metrics read it from another thread
        if tokens:
            last["decode_tokens_per_s"] = tokens / (now - start)
        if stats.get("decode_steps"):
            last["fetched_fraction"] = stats["fetched_fraction"]
        self.last, self._window = last, [now, 0]

