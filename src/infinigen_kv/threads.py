"""How many threads a CPU decode step runs on: every core on an idle machine, fewer on a busy one.

A decode step is hundreds of short parallel regions (the kernels and PyTorch's own ops run on PyTorch's intra-op
team, `at::parallel_for`). Each region ends at a barrier, so it is as slow as its slowest thread: when another
process keeps the cores busy, one descheduled thread stalls the whole team for a scheduler time slice, many times
a step (measured: 0.06x the idle speed beside a PyTorch process, where one thread keeps 0.5x; docs/BENCHMARKS.md,
"Busy machine"). No count is right for both cases, so the decode loop measures: `Tuner` times the steps under
each candidate count (all threads, half, one), keeps the fastest, and tries again after a while (sooner when
the step time moves), so a competitor that starts or stops is followed within seconds. The kernels give the
same bits with any thread count (each output is computed by one thread in a fixed order); PyTorch's own ops
(matmuls, the quantized baseline) may differ in the last bit, so for bit-for-bit repeatable runs fix the count.

`set_threads(n)` (`--threads N`) fixes the count and turns the tuning off.
"""

from __future__ import annotations

import statistics

import torch


class Tuner:
    """Picks the thread count of decode steps by timing them (one per process: the count is process-wide).

    Call `step(seconds, device)` after every decode step. A probe runs `probe` timed steps under each candidate (after one
    untimed step that lets the thread team resize); the fastest is kept for `epoch` steps, doubled each time the
    same count wins again (up to `max_epoch`); a step more than `drift` x off the winner's time starts a new probe
    at once.
    """

    def __init__(self, probe: int = 3, epoch: int = 32, max_epoch: int = 512, drift: float = 1.6):
        self.probe, self.min_epoch, self.max_epoch, self.drift = probe, epoch, max_epoch, drift
        self.fixed = None  # a count set by set_threads: no tuning
        self.most = None  # the largest count, taken at the first step (torch's default: the cores)
        self.enabled = True
        self._reset()

    def _reset(self) -> None:
        self.candidates = []
        self.queue = []  # (count, untimed) of the probe in progress
        self.times = {}  # count -> step times of the probe
        self.best = None
        self.best_s = None
        self.epoch = self.min_epoch
        self.left = 0  # steps before the next probe

    def step(self, took: float, device: torch.device | None = None) -> None:
        """After a decode step that took `took` seconds: choose the count of the next one."""
        if self.fixed is not None or not self.enabled or (device is not None and torch.device(device).type != "cpu"):
            return
        if self.most is None:
            self.most = torch.get_num_threads()
            self.candidates = sorted({self.most, max(1, self.most // 2), 1}, reverse=True)
        if len(self.candidates) < 2:
            return  # one core
        if self.queue:
            count, untimed = self.queue.pop(0)
            if not untimed:
                self.times.setdefault(count, []).append(took)
            if self.queue:
                torch.set_num_threads(self.queue[0][0])
            else:
                self._choose()
            return
        if self.best_s is not None and not (self.best_s / self.drift < took < self.best_s * self.drift):
            self.left = 0  # the machine changed (a competitor came or went): measure again now
        self.left -= 1
        if self.left <= 0:
            self._start_probe()

    def _start_probe(self) -> None:
        self.times = {}
        self.queue = [(c, i == 0) for c in self.candidates for i in range(self.probe + 1)]
        torch.set_num_threads(self.queue[0][0])

    def _choose(self) -> None:
        med = {c: statistics.median(t) for c, t in self.times.items() if t}
        best = min(med, key=med.get)
        if best != self.most and med[best] > 0.9 * med.get(self.most, float("inf")):
            best = self.most  # all cores unless fewer are clearly (10%) faster: noise must not cost an idle machine
        self.epoch = min(self.epoch * 2, self.max_epoch) if best == self.best else self.min_epoch
        self.best, self.best_s, self.left = best, med[best], self.epoch
        torch.set_num_threads(best)

    @property
    def threads(self) -> int:
        return self.fixed if self.fixed is not None else torch.get_num_threads()


TUNER = Tuner()


def set_threads(n: int | None) -> None:
    """Fix the thread count of everything (prefill, decode, calibration) to n and stop tuning; None: tune."""
    if n is None:
        TUNER.fixed = None
        return
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    TUNER.fixed = n
    TUNER._reset()


def decode_step(took: float, device: torch.device | None = None) -> None:
    """Called by the decode loops after each step, with its seconds (generation.generate, the server's engine)."""
    TUNER.step(took, device)
