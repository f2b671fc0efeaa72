"""The adaptive decode thread count (runtime/threads.py): it probes, keeps the faster count, restores torch's."""

from collections.abc import Callable
from typing import Any

import torch

from hetforge.runtime.threads import ThreadTuner


def _drive(tuner: ThreadTuner, step_s, steps: int) -> list[int]:
    """Run ``steps`` steps; ``step_s`` maps a count to its step time, or is a function (count, previous count)."""
    used: list[int] = []
    for _ in range(steps):
        n = tuner.before()
        assert torch.get_num_threads() == n
        t = step_s(n, used[-1] if used else n) if callable(step_s) else step_s[n]
        tuner.after(n, t)
        used.append(n)
    return used


def _uneven(one: float, two: Callable[[int], float]) -> Callable[[int, int], float]:
    """Step times: ``one`` for a one-thread step, ``two(i)`` for the i-th two-thread step (1, 2, ...)."""
    k = {"i": 0}

    def step(n: int, prev: int) -> float:
        if n == 1:
            return one
        k["i"] += 1
        return two(k["i"])
    return step


def test_keeps_the_requested_count_when_it_is_faster():
    old = torch.get_num_threads()
    t = ThreadTuner(threads=2, explore_every=8)
    used = _drive(t, {1: 0.010, 2: 0.006}, 40)
    t.restore()
    assert torch.get_num_threads() == old
    assert used.count(2) > 30 and 1 in used  # probed one thread, stayed on two
    assert t.summary()["switches"] == 0


def test_drops_to_one_thread_when_two_collapse_and_comes_back_when_they_recover():
    t = ThreadTuner(threads=2, explore_every=8)
    used = _drive(t, {1: 0.010, 2: 0.250}, 30)  # another process took a core: two threads wait at barriers
    # a losing probe of two threads ends after its second step (the first is discarded), and probes back off
    assert used[-10:].count(1) >= 8 and t.cur == 1 and t.interval > 8
    used = _drive(t, {1: 0.010, 2: 0.004}, 80)  # the core is free again: a later probe finds two faster
    t.restore()
    assert used[-10:].count(2) >= 8 and t.cur == 2


def test_a_sustained_slowdown_triggers_a_probe_at_once():
    t = ThreadTuner(threads=2, explore_every=16)
    _drive(t, {1: 0.010, 2: 0.006}, 40)  # two threads faster: probes back off
    assert t.cur == 2 and t.interval > 16
    used = _drive(t, {1: 0.010, 2: 0.030}, 8)  # another process took a core
    assert t.cur == 1 and used[-2:] == [1, 1]  # two slow steps, a probe, then one thread: within 8 steps


def test_one_slow_step_after_a_switch_neither_blocks_a_switch_nor_causes_one():
    t = ThreadTuner(threads=2, explore_every=8)
    # the first step with a new count is 6x slower (threads migrate, caches re-warm); after that one is faster
    used = _drive(t, lambda n, prev: (0.060 if n != prev else 0.010) if n == 1 else 0.020, 30)
    assert t.cur == 1 and used[-5:] == [1] * 5
    t2 = ThreadTuner(threads=2, explore_every=8)
    _drive(t2, lambda n, prev: 0.030 if n == 2 and len(t2.recent.get(2, ())) == 5 else {1: 0.010, 2: 0.006}[n], 30)
    assert t2.cur == 2 and t2.switches == 0  # one outlier step of the count in use: no switch


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv("HETFORGE_ADAPT_THREADS", "0")
    t = ThreadTuner(threads=2)
    base = torch.get_num_threads()
    assert _drive(t, {base: 0.01, 1: 0.01, 2: 0.01}, 5) == [base] * 5


def test_engine_keeps_its_tuner_across_requests_and_restores_torch_threads():
    from hetforge.models.zoo import load_model
    from hetforge.runtime import Engine, SamplingParams

    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        eng = Engine(load_model("gpt2-tiny"), executor="auto")
        g1 = eng.stream([1, 2, 3], SamplingParams(max_new_tokens=6, ignore_eos=True))
        list(g1)
        assert torch.get_num_threads() == 2
        g2 = eng.stream([1, 2, 3], SamplingParams(max_new_tokens=6, ignore_eos=True))
        list(g2)
        assert g1.tuner is g2.tuner and sum(g2.tuner.counts.values()) == 10  # 5 decode steps per request
        assert set(g2.tuner.counts) <= {1, 2}
    finally:
        torch.set_num_threads(old)


def test_a_switch_on_a_noisy_probe_is_undone_within_a_few_steps():
    """Two threads are faster, but the first steps after a compile are slow and a probe of one thread wins by
    chance: the confirming probe a few steps later switches back (before: stuck for a whole interval)."""
    t = ThreadTuner(threads=2, explore_every=16)
    slow_start = iter([0.030, 0.030, 0.030, 0.030, 0.030])  # two threads' first steps (cold caches, allocations)
    used = _drive(t, lambda n, prev: next(slow_start, 0.004) if n == 2 else 0.008, 40)
    assert t.switches == 2 and t.cur == 2  # one wrong switch, undone
    # back on two threads once the wrong probe's steps and the few steps before the confirming probe are run
    assert used.index(2, used.index(1)) - used.index(1) <= t.probe_steps + t.confirm_after
    # after that, one thread runs only in probes that lose at their first counted step (two steps each)
    tail = "".join(map(str, used[-20:]))
    assert t.cur == 2 and all(len(run) <= 2 for run in tail.split("2") if run) and tail.count("1") <= 4


def test_the_first_decode_step_of_a_request_is_not_measured():
    t = ThreadTuner(threads=2, explore_every=16)
    t.before_prefill()
    n = t.before()
    t.after(n, 1.0)  # the first step after a prefill: slow, left out
    assert not t.recent and t.counts == {n: 1}
    t.after(t.before(), 0.01)
    assert list(t.recent[2]) == [0.01]


def test_a_probe_cut_short_by_a_clearly_slower_step_is_lost_even_if_one_step_was_fast():
    """Under a pinned load a 2-thread step is fast when its helper gets the core and slow otherwise. A probe of two
    threads whose counted steps are one fast and then one clearly slower step ends early as lost, and does not
    switch (before, the median of those two steps, 11 ms, beat one thread's 14.5 ms and it switched back)."""
    t = ThreadTuner(threads=2, explore_every=8)

    def step(n, prev):
        if n == 1:
            return 0.0145
        if t.probing == 2:  # a probe of two threads: discarded step, then one lucky step, then a slow one
            return (0.020, 0.005, 0.017)[min(len(t.probe_times), 2)]
        return 0.020  # two threads in use, before the first switch
    used = _drive(t, step, 60)
    assert t.cur == 1 and t.switches == 1  # to one thread, and never back on a lucky step
    assert used[-10:].count(1) >= 7


def test_a_probe_weighs_four_steps_so_one_fast_step_in_four_does_not_flip_it():
    t = ThreadTuner(threads=2, explore_every=8)
    # one lucky 2-thread step in four, within the early-exit margin
    _drive(t, _uneven(0.0145, lambda i: 0.009 if i % 4 == 0 else 0.016), 120)
    assert t.cur == 1 and t.switches == 1


def test_after_a_spike_under_a_busy_neighbour_it_returns_to_two_threads():
    """A busy neighbour makes two-thread steps uneven (a run of slow ones now and then) but faster than one thread
    over all: a run of slow steps may send the tuner to one thread, and the probe that confirms the switch brings it
    back. (An earlier version skipped probes of two threads while another task was runnable and stayed on one.)"""
    t = ThreadTuner(threads=2, explore_every=8)
    step = _uneven(0.0140, lambda i: 0.0250 if i % 20 in (10, 11, 12) else 0.0100)  # three slow steps in twenty
    for _ in range(60):  # until a run of slow steps has sent it to one thread
        _drive(t, step, 1)
        if t.cur == 1:
            break
    assert t.cur == 1
    used = _drive(t, step, 100)
    t.restore()
    assert t.switches >= 2 and used.count(2) > 50  # switched back, and most later steps ran on two threads


def test_a_prefill_runs_on_one_thread_while_other_tasks_hold_the_cores():
    busy = {"n": 1}
    t = ThreadTuner(threads=2, explore_every=8, others=lambda: busy["n"])
    t.cores = 2
    assert t.before_prefill() == 1 and torch.get_num_threads() == 1  # one neighbour, two cores: one thread
    busy["n"] = 0
    assert t.before_prefill() == 2  # the core is free again: the count the decode steps chose
    t.cores = 4
    busy["n"] = 2
    assert t.before_prefill() == 2  # a neighbour on each of two other cores still leaves two free
    t.restore()
    assert t.summary()["prefills_reduced"] == 1


def test_a_prefill_takes_the_cores_the_neighbours_leave_free():
    """Eight threads requested on eight cores: one busy neighbour leaves seven for the prefill (not one), seven
    leave one, and more than eight still leave it one thread."""
    busy = {"n": 1}
    t = ThreadTuner(threads=8, explore_every=8, others=lambda: busy["n"])
    t.cores = 8
    assert t.before_prefill() == 7
    busy["n"] = 7
    assert t.before_prefill() == 1
    busy["n"] = 12
    assert t.before_prefill() == 1
    t.restore()
    assert t.summary()["prefills_reduced"] == 3


def test_a_fixed_count_prefill_ignores_the_neighbours(monkeypatch):
    monkeypatch.setenv("HETFORGE_ADAPT_THREADS", "0")
    old = torch.get_num_threads()
    t = ThreadTuner(threads=2, others=lambda: 5)
    assert t.before_prefill() == old
    t.restore()


def test_others_running_counts_another_process_but_not_this_ones_threads():
    import statistics
    import subprocess
    import sys
    import threading
    import time

    from hetforge.runtime.threads import others_running

    if others_running() is None:
        # no count to compare: others_running answers None by design in two places only, and one must hold here
        # (without Linux's /proc/loadavg and /proc/self/task; on a cpuset narrower than the machine, a container,
        # where the machine-wide count would include other tenants' CPUs: its own test below)
        import os
        from pathlib import Path

        narrow = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < (os.cpu_count() or 0)
        assert narrow or not (Path("/proc/loadavg").is_file() and Path("/proc/self/task").is_dir())
        return

    def reads() -> float:
        got = [others_running() for _ in range(15)]
        assert all(g is not None for g in got)
        time.sleep(0.01)
        return statistics.median(got)

    def beside(start: Callable[[], Any], end: Callable[[Any], Any]) -> float:
        """``reads()`` while what ``start`` began runs (ended by ``end`` whatever happens)."""
        handle = start()
        try:
            time.sleep(0.3)
            return reads()
        finally:
            end(handle)

    idle = reads()
    with_neighbour = beside(lambda: subprocess.Popen([sys.executable, "-c", "while True: pass"]),
                            lambda p: (p.kill(), p.wait()))
    a = torch.randn(800, 800)
    stop = threading.Event()

    def work() -> None:  # a thread of this process, busy in ATen (the GIL released)
        while not stop.is_set():
            a @ a

    def own_thread() -> threading.Thread:
        th = threading.Thread(target=work)
        th.start()
        return th
    with_own_thread = beside(own_thread, lambda th: (stop.set(), th.join()))
    assert with_neighbour >= idle + 1 and with_own_thread <= idle


def test_others_running_gives_no_reading_on_a_subset_of_the_cpus(monkeypatch):
    """On a cpuset (a container's CPUs, or taskset) the machine-wide running count would count tasks on CPUs this
    process cannot use as neighbours: no reading, so a prefill keeps the decode steps' count."""

    from hetforge.runtime import threads

    # a process allowed CPU 0 of a machine of 8 (os.sched_getaffinity is set here too: absent off Linux)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 8)
    assert threads.others_running() is None


def test_others_running_takes_the_least_of_its_readings(monkeypatch):
    """A task that runs for a moment shows in one reading, a busy neighbour in every one; a reading of the reader
    alone ends the sampling at 0."""
    import os

    from hetforge.runtime import threads

    if hasattr(os, "sched_getaffinity"):
        monkeypatch.setattr(threads.os, "cpu_count", lambda: len(os.sched_getaffinity(0)))
    monkeypatch.setattr(threads, "_own_running", lambda: 1)
    for counts, want in (([3, 2, 2], 1), ([3, 1, 3], 0), ([2, 2, 2], 1), ([4, 4, 3], 2)):
        seq = iter([c for c in counts for _ in (0, 1)])  # a reading reads the count twice: the idle check, the count
        monkeypatch.setattr(threads, "_machine_running", lambda seq=seq: next(seq))
        assert threads.others_running() == want, counts


def test_the_prefill_says_why_it_runs_on_its_count(monkeypatch):
    busy = {"n": 0}
    t = ThreadTuner(threads=2, explore_every=4, others=lambda: busy["n"])
    t.cores = 2
    t.before_prefill()
    assert t.prefill_reason == "requested"
    _drive(t, {1: 0.010, 2: 0.006}, 12)  # a probe has run
    t.before_prefill()
    assert t.prefill_reason == "the count the decode steps found faster"
    busy["n"] = 1
    assert t.before_prefill() == 1 and t.prefill_reason == "1 other running task on 2 cores"
    t.restore()
    monkeypatch.setenv("HETFORGE_ADAPT_THREADS", "0")
    f = ThreadTuner(threads=2, others=lambda: 1)
    f.before_prefill()
    assert f.prefill_reason == "fixed"
    f.restore()
