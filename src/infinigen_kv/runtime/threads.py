"""How many threads a CPU decode step runs on: every core on an idle machine, the cores left on a busy one.

A decode step is hundreds of short parallel regions (the kernels and PyTorch's own ops run on PyTorch's intra-op
team, `at::parallel_for`). Each region ends at a barrier, so it is as slow as its slowest thread: when another
process keeps the cores busy, one descheduled thread stalls the whole team for a scheduler time slice, many times
a step. Measured (docs/BENCHMARKS.md, "Beside other work"): beside a PyTorch process multiplying matrices on both
cores of a 2-core machine, two threads decode at 0.013x their idle speed and one thread at 0.53x.

So the decode loops (and a prefill, before it starts and between its chunks) look at the machine every
`INTERVAL` seconds: `Load` reads how many cores other processes
kept busy on this process's CPUs since the last look (Linux `/proc/stat`, minus this process's own CPU time),
and `Tuner` runs the next steps on the cores left, at least one, at most the count the process started with. A
look costs a few microseconds and never runs a slow trial step; a competitor that comes or goes is followed
within half a second. Without `/proc/stat` (macOS, Windows) the count stays PyTorch's default.

The thread policy is the model's backend's (model/backend.py: `threads`, from `--threads N` or
`load_model(threads=N)`): None follows the load as above; a count fixes every step to it. The calls below take the
backend they run for. Only decode steps follow the load: their kernels give the same bits with any thread count
(each output is computed by one thread in a fixed order). A prompt's chunks always run on the count the process
started with (`prefill_chunk`), because the BLAS sums a long row (the MLP's down projection, 1,536 inputs on the
default model) in another order on one thread than on two: a prompt read on fewer threads beside other work had
other K/V bits, and a speculating decode other choices. So a busy machine changes the speed, never the answer
(tests/test_default_model.py generates beside busy processes at 2k and at a speculating length).
"""

from __future__ import annotations

import os
import queue
import threading
import time

import torch

INTERVAL = 0.5  # seconds between looks at the machine's load
FIRST_LOOK = 0.1  # seconds of a first look before a prefill, when there is no recent one

# /proc/stat columns after the cpu name: user nice system idle iowait irq softirq steal (guest time is in user)
_IDLE = (3, 4)
_COUNTED = 8


class Load:
    """Samples of (wall seconds, busy CPU seconds of this process's CPUs, this process's CPU seconds)."""

    def __init__(self):
        try:
            self.cpus = {f"cpu{c}" for c in os.sched_getaffinity(0)}
            self.tick = os.sysconf("SC_CLK_TCK")
        except (AttributeError, ValueError, OSError):
            self.cpus = None

    @property
    def cores(self) -> int:
        return len(self.cpus) if self.cpus else (os.cpu_count() or 1)

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def sample(self) -> tuple[float, float, float] | None:
        if not self.cpus:
            return None
        try:
            with open("/proc/stat") as f:
                busy = 0
                for line in f:
                    name, _, rest = line.partition(" ")
                    if name in self.cpus:
                        v = [int(x) for x in rest.split()[:_COUNTED]]
                        busy += sum(v) - sum(v[i] for i in _IDLE)
        except (OSError, ValueError):
            self.cpus = None
            return None
        t = os.times()
        return self.now(), busy / self.tick, t.user + t.system


class Tuner:
    """Sets the thread count of decode steps from the load of other processes (one per process: the count is
    process-wide). Call `step(backend)` after every decode step; `watch(backend)` before a prefill starts the first
    look early, so the first decode step already runs on the right count."""

    def __init__(self, load: Load | None = None, interval: float = INTERVAL):
        self.load = load if load is not None else Load()
        self.interval = interval
        self.enabled = True
        self.count = None  # the decode steps' count, last chosen
        self.most = None  # the count the process started with (PyTorch's default: the cores), the ceiling
        self.others = 0.0  # cores other processes kept busy over the last interval
        self._last = None

    def watch(self, backend) -> None:
        if self._active(backend):
            self._last = self.load.sample()

    def _active(self, backend) -> bool:
        """Whether the count follows the load for work on `backend` (a CPU's, without a fixed count); a fixed count
        is set here."""
        if backend.device_type != "cpu":
            return False
        if backend.threads is not None:
            if torch.get_num_threads() != backend.threads:
                torch.set_num_threads(backend.threads)
            return False
        if not self.enabled:
            return False
        if self.most is None:
            self.most = torch.get_num_threads()
        return True

    def step(self, backend) -> None:
        """After a decode step (or a prefill chunk): every `interval` seconds, choose the count of the next ones."""
        if not self._active(backend):
            return
        if self._last is None:
            self._last = self.load.sample()
            return
        if self.load.now() - self._last[0] < self.interval:
            return  # (a sample reads /proc/stat: ~0.2 ms, once an interval, not every step)
        self._choose()

    def before_prefill(self, backend) -> None:
        """Before a prefill: choose the count its decode steps will run on, from the last look if it is recent, else
        from a look of `FIRST_LOOK` seconds taken here (the process idle meanwhile: what it sees is the others' load).
        The prompt's chunks themselves run on every core (prefill_chunk), slower beside other work, the same bits."""
        if not self._active(backend):
            return
        if self._last is None or self.load.now() - self._last[0] > 4 * self.interval:
            self._last = self.load.sample()
            if self._last is None:
                return
            time.sleep(FIRST_LOOK)
        self._choose()

    def _choose(self) -> None:
        """The cores other processes kept busy since the last look -> the count of what runs next."""
        now = self.load.sample()
        if now is None:
            return
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        if t1 - t0 < FIRST_LOOK / 2:
            return  # too short a window to tell (a look just taken): the count stays
        self._last = now
        self.others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)
        n = max(1, min(self.most, self.load.cores - round(self.others)))
        self.count = n
        if n != torch.get_num_threads():
            torch.set_num_threads(n)

    def prefill_chunk(self, backend) -> None:
        """Before a prompt chunk: every core the process started with (the BLAS's bits follow the count)."""
        if self._active(backend) and torch.get_num_threads() != self.most:
            torch.set_num_threads(self.most)

    def decode(self, backend) -> None:
        """Before decode steps that follow a prompt: the count the load left them."""
        if self._active(backend) and self.count is not None and torch.get_num_threads() != self.count:
            torch.set_num_threads(self.count)



TUNER = Tuner()


def watch(backend) -> None:
    """Called before other work whose decode steps follow (the server's engine): the first look spans it."""
    TUNER.watch(backend)


def before_prefill(backend) -> None:
    """Called before a prefill (generation.generate): the count it runs on, from the machine's load now."""
    TUNER.before_prefill(backend)


def prefill_chunk(backend) -> None:
    """Called before each chunk of a prompt (generation.prefill, the server's Prefill): the process's whole count."""
    TUNER.prefill_chunk(backend)


def decode(backend) -> None:
    """Called after a prompt, before its decode steps: the count the load leaves them."""
    TUNER.decode(backend)


def decode_step(backend) -> None:
    """Called by the decode loops after each step and by a prefill after each chunk (generation, the server's
    engine)."""
    TUNER.step(backend)


def on_own_thread(build, run, name: str):
    """build() on a new (daemon) thread, its result returned here (its exception raised here), then run(result) on
    that thread. A server's tensor work all on one thread: each thread that runs PyTorch's parallel ops keeps an
    OpenMP team of its own, and once the teams hold more threads than there are cores, libgomp stops spinning
    between parallel regions and sleeps at every one (a decode step has hundreds): the server's decode steps ran
    ~1.4x slower after the main thread had loaded the model (docs/BENCHMARKS.md, "The server runs the decode
    step")."""
    made = queue.Queue()

    def thread() -> None:
        try:
            result = build()
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            made.put(e)
            return
        made.put(result)
        run(result)

    threading.Thread(target=thread, name=name, daemon=True).start()
    result = made.get()
    if isinstance(result, BaseException):
        raise result
    return result
