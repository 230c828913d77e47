"""The compute's thread count follows what its steps measure (``sandbox/threads.py``)."""

from __future__ import annotations

import itertools

from quanthunt.sandbox.threads import ThreadTuner


def run(
    tuner: ThreadTuner, step_s: dict[int, float], steps: int, *, rows: int = 8, start: float = 0.0
) -> tuple[list[int], float]:
    """Drive ``tuner`` for ``steps`` steps whose duration depends only on the threads used."""
    used, now = [], start
    for _ in range(steps):
        threads = tuner.threads(now)
        used.append(threads)
        now += step_s[threads]
        tuner.record(threads, rows, step_s[threads], now)
    return used, now


def test_a_quiet_machine_keeps_every_core_and_tries_one_thread_ever_less_often() -> None:
    tuner = ThreadTuner(2)
    used, _ = run(tuner, {2: 0.05, 1: 0.09}, 4000)  # 200 s of steps
    assert tuner.current == 2 and tuner.switches == 0
    trials = [i for i, t in enumerate(used) if t == 1]
    gaps = [b - a for a, b in itertools.pairwise(trials)]
    assert 4 <= len(trials) <= 10  # after 2, 4, 8, 16, 32, 64, 64... seconds
    assert all(later >= earlier - 1 for earlier, later in itertools.pairwise(gaps))  # backing off, then steady


def test_a_busy_machine_moves_to_one_thread_and_back_when_it_calms() -> None:
    tuner = ThreadTuner(2)
    run(tuner, {2: 0.05, 1: 0.09}, 100)
    used, now = run(tuner, {2: 1.0, 1: 0.09}, 100, start=5.0)  # the cores are taken
    assert tuner.current == 1 and used.count(2) <= 15  # measured: 12 steps (12 s) to notice
    used, _ = run(tuner, {2: 0.05, 1: 0.09}, 2000, start=now)  # quiet again
    assert tuner.current == 2 and tuner.switches == 2
    assert used.count(2) > 0.95 * len(used)


def test_one_core_never_tries_anything_else() -> None:
    tuner = ThreadTuner(1)
    used, _ = run(tuner, {1: 0.05}, 500)
    assert set(used) == {1}


def test_a_trial_at_another_batch_size_decides_nothing() -> None:
    tuner = ThreadTuner(2)
    for i in range(5):
        tuner.record(2, 32, 0.2, float(i))
    assert tuner.threads(10.0) == 1
    tuner.record(1, 2, 0.01, 10.01)  # much faster, but only because it ran 2 rows, not 32
    assert tuner.current == 2 and tuner.switches == 0
