"""A one-time stage's progress on stderr (a conversion, a calibration): tqdm's bar on a terminal; elsewhere (a log,
a CI run, the demo) a line at most every `every` seconds with what is done, the time so far and the time left."""

from __future__ import annotations

import sys
import time


EVERY = 5.0  # seconds between two lines off a terminal


class Progress:
    def __init__(self, stage: str, total: float, unit: str = "", scale: float = 1.0):
        """stage: what runs ("converting model.gguf"); total: its work in `unit`s, shown divided by `scale`."""
        self.stage, self.total, self.unit, self.every, self.scale = stage, total, unit, EVERY, scale
        self.t0 = self.last = time.perf_counter()
        self.done = 0.0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total / scale, desc=f"infinigen: {stage}", unit=unit, leave=False, file=sys.stderr)

    def __call__(self, done: float, *_, note: str = "") -> None:
        """The work done so far (absolute), and what else to say of it ("120/291 tensors"); also an on_step callback
        (returns None: go on)."""
        if self.bar is not None:
            self.bar.update(done / self.scale - self.bar.n)
            if note:
                self.bar.set_postfix_str(note, refresh=False)
        now = time.perf_counter()
        self.done = done
        if self.bar is None and now - self.last >= self.every and 0 < done < self.total:
            self.last = now
            spent = now - self.t0
            left = spent * (self.total - done) / done
            print(f"infinigen: {self.stage}: {note + ', ' if note else ''}{done / self.scale:.0f}/"
                  f"{self.total / self.scale:.0f}{self.unit} ({spent:.0f} s, ~{left:.0f} s left)", file=sys.stderr,
                  flush=True)

    def close(self) -> float:
        """Ends the bar; the seconds the stage took."""
        if self.bar is not None:
            self.bar.close()
        return time.perf_counter() - self.t0
