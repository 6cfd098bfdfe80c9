"""What the server hands the engine: a `Job` (one request: its prompt, knobs and event queue) and the ways a job
is refused."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..runtime.sampling import SamplingParams


class QueueFull(Exception):
    """More jobs waiting than the queue holds (the server answers 503)."""


class ShuttingDown(QueueFull):
    """The server is draining: it takes no new jobs (503)."""


class TooLarge(ValueError):
    """A job whose cache could never fit the pool limit, even alone (400)."""


SHUTDOWN_MESSAGE = "the server is shutting down"


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int  # per choice; 0: the prompt only (echo with prompt logprobs)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # choice i draws with seed + i
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: no logprobs; k: each token's logprob and its k most likely alternatives
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None
    ignore_eos: bool = False  # an EOS token ends nothing: the choice runs to max_tokens (or a stop sequence)
    n: int = 1  # choices: one prefill, n rows decoding from copies of its cache
    echo: bool = False  # a "prompt" event first (the client echoes the prompt)
    prompt_logprobs: int | None = None  # k: the prompt tokens' logprobs too, in the "prompt" event
    loop: asyncio.AbstractEventLoop | None = None
    # per choice: ("prompt", None, logprobs) if asked, ("text", delta, logprobs) ..., then ("done",
    # finish_reason, logprobs); or ("error", message, None) for the whole job. Events are (kind, value,
    # logprobs, choice index); logprobs: the entries of the tokens behind that event (a list of dicts), or None
    events: asyncio.Queue | None = None
    completion_tokens: int = 0  # over all choices
    cancelled: bool = False
    finished: bool = False  # every choice's "done", or an "error", went out
    ended: int = 0  # choices done
    submitted: float = 0.0  # perf_counter() at submit (time to first token)
    cached_tokens: int = 0  # prompt tokens restored from the prefix store instead of prefilled

    def sampling(self, choice: int = 0) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                              min_p=self.min_p, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
                              seed=None if self.seed is None else (self.seed + choice + 2**63) % 2**64 - 2**63)

    def emit(self, kind: str, value: str | None, logprobs: list | None = None, index: int = 0) -> None:
        self.ended += kind == "done"
        self.finished |= kind == "error" or self.ended >= self.n
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value, logprobs, index))
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening any more
            self.cancelled = True
