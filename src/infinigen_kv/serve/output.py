"""What the server sends of a job's tokens: text released incrementally (stop sequences held back, never half a
UTF-8 character) and logprob entries in the API's form (with each token's own bytes), per row of the running batch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .jobs import Job


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


class Logprobs:
    """Logprob entries of one tokenizer (chat API form; the completions form is derived from it). `lock`: the
    tokenizer's, shared with the engine's detokenization (fast tokenizers are not thread-safe)."""

    def __init__(self, tokenizer, lock):
        self.tokenizer, self.lock = tokenizer, lock
        self._unbyte = _byte_level_alphabet(tokenizer)  # piece character -> byte, for byte-level BPE

    def prompt_entries(self, job, lps) -> list[dict]:
        """The prompt tokens' logprob entries: the first has none (nothing precedes it)."""
        chosen, values, ids = lps  # (n - 1,), (n - 1, k), (n - 1, k) lists
        k = job.prompt_logprobs
        with self.lock:
            first = self.tokenizer.decode([job.prompt_ids[0]])
            out = [{"token": first, "logprob": None, "bytes": self.bytes(job.prompt_ids[0], first),
                    "top_logprobs": None}]
            for i, t in enumerate(job.prompt_ids[1:]):
                out.append(self.entry(t, chosen[i], zip(ids[i][:k], values[i][:k])))
        return out

    def entry(self, token: int, logprob: float, alternatives) -> dict:
        """One token's logprob entry, in the chat API's form (the completions form is derived from it)."""
        def one(t: int, lp: float) -> dict:
            text = self.tokenizer.decode([t])
            return {"token": text, "logprob": lp, "bytes": self.bytes(t, text)}

        return {**one(token, logprob), "top_logprobs": [one(t, lp) for t, lp in alternatives]}

    def bytes(self, token: int, text: str) -> list[int]:
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


@dataclass
class Row:
    """A job's choice in the running batch: its detokenizer and the logprob entries not yet sent."""
    job: Job
    stream: TextStream
    index: int = 0  # the choice
    entries: list = field(default_factory=list)
    last: float = 0.0  # when its last token came (inter-token latency)
    tokens: int = 0  # generated

    def taken(self) -> list | None:
        """The logprob entries to send with the row's next event."""
        if self.job.logprobs is None:
            return None
        out, self.entries = self.entries, []
        return out

    def finish(self, reason: str, lock) -> bool:
        """Send the text held back and the end (`lock`: the tokenizer's); False: the row leaves the batch."""
        with lock:
            rest = self.stream.flush()
        if rest:
            self.job.emit("text", rest, self.taken(), self.index)
        self.job.emit("done", reason, self.taken(), self.index)
        return False
