"""How many threads the sandbox's compute uses, chosen by measuring its own decode steps.

Every core is the right answer on a quiet machine and the wrong one on a busy machine: torch's
OpenMP threads wait for each other at the end of every operation (a step is ~400 of them),
spinning while they wait, so when another process holds one of the cores each operation
waits for the scheduler to give the descheduled thread its turn. Measured on 2 cores
(SmolLM2-135M, fp32 weights through MKL, before they were packed for oneDNN; tok/s at batch
1 / 8):

| | 2 threads | 1 thread |
|---|---|---|
| quiet machine | 32 / 105 | 19 / 58 |
| beside three busy processes | 0.9 / 6.1 | 19 / 57 |

OpenMP's passive waiting (``OMP_WAIT_POLICY=PASSIVE``) softens the busy case but costs a
quarter of the quiet one (21 / 85), and the machine's state changes while a sandbox runs (the
test suite starts and stops stages beside it). So the engine runs at one setting, now and then
times a single step at the other, and switches when that step was clearly faster than its
recent steps of a similar batch; a trial that loses waits twice as long before the next one.
"""

from __future__ import annotations

import statistics
from collections import deque


class ThreadTuner:
    """Chooses between every core and one thread from measured step times (see module).

    Usage: ``threads = tuner.threads(now)``, run a step with them, then
    ``tuner.record(threads, rows, seconds, now)``.
    """

    def __init__(self, cores: int, *, first_trial_s: float = 2.0, longest_wait_s: float = 64.0, margin: float = 0.15) -> None:
        self.current = max(cores, 1)
        self._other = 1 if self.current > 1 else None
        self._first_trial_s = first_trial_s
        self._longest_wait_s = longest_wait_s
        self._margin = margin
        self._wait_s = first_trial_s
        self._next_trial: float | None = None
        self._trial: int | None = None
        self._recent: deque[tuple[int, float]] = deque(maxlen=16)
        self.switches = 0

    def threads(self, now: float) -> int:
        """Threads for the next step: the current choice, or the other one as a trial."""
        due = self._next_trial is not None and now >= self._next_trial
        if self._other is not None and due and len(self._recent) >= 3:
            self._trial = self._other
            return self._other
        return self.current

    def record(self, threads: int, rows: int, seconds: float, now: float) -> None:
        """What a step with ``threads`` threads and ``rows`` rows took."""
        if self._next_trial is None:
            self._next_trial = now + self._wait_s
        if threads != self._trial:
            if threads == self.current:
                self._recent.append((rows, seconds))
            return
        self._trial = None
        similar = [s for r, s in self._recent if abs(r - rows) <= max(1, rows // 4)]
        if similar and seconds < (1 - self._margin) * statistics.median(similar):
            assert self._other is not None
            self.current, self._other = threads, self.current
            self._recent.clear()
            self._wait_s = self._first_trial_s
            self.switches += 1
        elif similar:
            self._wait_s = min(self._wait_s * 2, self._longest_wait_s)
        self._next_trial = now + self._wait_s
