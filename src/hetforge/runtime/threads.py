"""Adaptive thread count for decode steps: no collapse when another process takes a core.

A decode step is ~100 short parallel kernels (native GEMVs, norms, attention; oneDNN/ATen for the rest). The
native ones run on their own pool, where no call waits for a descheduled thread (``hetforge.kernels.native``);
the ATen/oneDNN ones end at OpenMP barriers, and when another busy process shares the cores one thread of the
team is often descheduled for a whole time slice (milliseconds) and every barrier waits for it. Even without
barriers, two threads on a shared core can lose to one. The tuner measures the steps it runs (wall time) and
keeps, per thread count (the requested count and 1), a window of recent step times; every ``explore_every``
steps — or at once after two steps in a row took ``spike``× the window's median (the window then restarts from
them) — it *probes*: up to ``probe_steps`` steps run with the other count, the first of them discarded (a switch
moves threads between cores and re-warms caches, so one step after it is not representative), and the median of
the rest (four by default: with two, one fast step of two threads under a pinned load decided the probe) is
compared with the median of the count in use. The other count is kept when it is faster by more than ``margin``,
and a switch is confirmed by another probe a few steps later (a switch made on a noisy probe must not stick); a
probe that loses doubles the interval to the next (up to 8× on the requested count, whose slowdowns the spike rule
catches; 4× on one thread, where only a probe sees the core come free) and ends early, as lost, once a counted
step is clearly slower. Medians, not a moving average, so that one descheduled step neither triggers a switch nor
blocks one; each request's first decode step is left out, and the spike rule waits for a few steps. The tuner
lives on the engine: a request's prefill runs with the count its decode steps last found faster (or on the cores
other tasks leave free: below). Off with ``HETFORGE_ADAPT_THREADS=0``; torch's thread count is restored when the
request ends.

Probes run whatever else the machine is running. An earlier version postponed a probe of the requested count from
one thread while ``/proc/loadavg`` showed another runnable task on the core it needs, to save the few slow steps of a
losing probe. Once the native pool took a descheduled helper's chunks over, two threads beat one under a busy
neighbour, and the postponement held the tuner on one thread for as long as the load lasted: the probe that would
have undone a noisy switch never ran (docs/arch/runtime.md, "Adaptive decode threads", has the figures). A losing
probe costs a few steps and backs off; a missed switch costs every step.

A prefill is different: its multi-row kernels (and oneDNN's) run on torch's OpenMP team, and every parallel region
ends at a barrier that waits for a descheduled thread, so under a busy neighbour two threads ran a prefill no faster
than one and sometimes much slower (docs/arch/runtime.md). A prefill is one call per request, too few to probe. So
with ``others`` (the engine passes :func:`others_running`: runnable tasks outside this process), a prefill runs on one
thread per core the other tasks leave free, where that is fewer than the count the decode steps chose (on two
cores with one busy neighbour: one thread).
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch


class ThreadTuner:
    """Pick the thread count of each decode step from measured step times."""

    def __init__(self, threads: int | None = None, explore_every: int = 16, probe_steps: int = 5,
                 spike: float = 1.3, margin: float = 0.03, window: int = 8,
                 others: Callable[[], int | None] | None = None):
        self.base = torch.get_num_threads()
        self.max = max(1, threads or self.base)
        self.enabled = self.max > 1 and os.environ.get("HETFORGE_ADAPT_THREADS", "1") != "0"
        self.explore_every, self.probe_steps = explore_every, max(2, probe_steps)
        self.spike, self.margin = spike, margin
        self.cur = self.max
        self.recent: dict[int, deque[float]] = {}
        self.window = window
        self.counts: dict[int, int] = {}
        self.since_probe = 0
        self.interval = explore_every
        self.first_probe = min(4, explore_every)  # steps of the requested count before the first probe
        self.confirm_after = min(4, explore_every)  # steps after a switch before the probe that confirms it
        self.skip_next = False
        self.probing: int | None = None
        self.probe_times: list[float] = []
        self.slow_run = 0
        self.switches = 0
        self.probes = 0
        self.others = others
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.prefills_reduced = 0  # prefills run on fewer threads because other tasks held cores (before_prefill)
        self.prefill_reason = ""  # why the last prefill ran on its count (before_prefill)

    def other(self, n: int) -> int:
        return 1 if n == self.max else self.max

    def _median(self, n: int) -> float | None:
        r = self.recent.get(n)
        return statistics.median(r) if r else None

    def before(self) -> int:
        """Set and return the thread count for the next step."""
        if not self.enabled:
            return self.base
        n = self.cur
        due = self.since_probe >= (self.interval if self.probes else self.first_probe)
        if self.probing is None and due:
            self.probing, self.probe_times = self.other(n), []
            self.probes += 1
        if self.probing is not None:
            n = self.probing
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def before_prefill(self) -> int:
        """Set the thread count for a prefill: the count decode steps found faster (the requested one at first), or
        the cores other runnable tasks leave free where that is fewer (at least one; see the module docstring). The
        request's first decode step is then left out of the statistics (it runs after the prefill evicted the
        weights from the caches, and after a compilation its first calls allocate)."""
        self.skip_next = True
        n = self.cur if self.enabled else self.base
        self.prefill_reason = ("fixed" if not self.enabled
                               else "the count the decode steps found faster" if self.probes else "requested")
        if self.enabled and n > 1 and self.others is not None:
            busy = self.others()
            if busy is not None and busy + n > self.cores:  # only the cores the other tasks leave free
                n, self.prefills_reduced = max(1, min(n, self.cores - busy)), self.prefills_reduced + 1
                self.prefill_reason = (f"{busy} other running task{'s' if busy > 1 else ''} on {self.cores} "
                                       f"core{'s' if self.cores > 1 else ''}")
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def _record(self, n: int, seconds: float) -> None:
        self.recent.setdefault(n, deque(maxlen=self.window)).append(seconds)

    def after(self, n: int, seconds: float) -> None:
        """Record one step of ``n`` threads that took ``seconds`` (measured)."""
        self.counts[n] = self.counts.get(n, 0) + 1
        if not self.enabled:
            return
        if self.skip_next:
            self.skip_next = False
            return
        if self.probing is not None and n == self.probing:
            self.probe_times.append(seconds)
            counted = self.probe_times[1:]  # the step right after a switch is not representative
            ref = self._median(self.cur)
            lost = bool(counted) and ref is not None and counted[-1] > (1 + 5 * self.margin) * ref
            if len(self.probe_times) < self.probe_steps and not lost:
                return
            self.probing, self.since_probe, self.slow_run = None, 0, 0
            est = statistics.median(counted)
            # a probe cut short by a clearly slower step lost, whatever the median of its few steps says: under a
            # pinned load 2-thread steps are sometimes fast, sometimes slow, and the median of one fast and one
            # slow step could beat the count in use
            if not lost and (ref is None or est < (1 - self.margin) * ref):
                self.recent[n] = deque(counted, maxlen=self.window)  # the window starts from the probe's steps
                # confirm soon: a switch made on a noisy probe must not stick for a whole interval
                self.cur, self.switches, self.interval = n, self.switches + 1, self.confirm_after
            else:
                cap = 8 if self.cur == self.max else 4  # a slowdown of the requested count is caught as a spike
                self.interval = min(2 * self.interval, cap * self.explore_every)
            return
        ref = self._median(n)
        self._record(n, seconds)
        self.since_probe += 1
        settled = ref is not None and len(self.recent[n]) > 4  # no spike rule on a window of a few steps
        self.slow_run = self.slow_run + 1 if settled and seconds > self.spike * ref else 0
        if self.slow_run >= 2:  # a sustained slowdown (another process took a core): probe the other count now,
            # against the slow steps (the window's older steps describe a machine that is gone)
            self.recent[n] = deque(list(self.recent[n])[-self.slow_run:], maxlen=self.window)
            self.since_probe, self.interval = self.interval, self.explore_every

    def restore(self) -> None:
        if torch.get_num_threads() != self.base:
            torch.set_num_threads(self.base)

    def summary(self) -> dict:
        return {"adaptive": self.enabled, "threads_requested": self.max, "steps_by_threads": dict(self.counts),
                "median_step_s_by_threads": {k: round(statistics.median(v), 6) for k, v in self.recent.items() if v},
                "probes": self.probes, "switches": self.switches,
                "prefills_reduced": self.prefills_reduced}


def others_running(samples: int = 3) -> int | None:
    """Runnable tasks on this machine outside this process: ``/proc/loadavg``'s running count (which counts the
    reader) less this process's threads in state R just before or just after it (``/proc/self/task/*/stat``:
    OpenMP's workers spin a while after each region, and our pool's helpers after each job, and those are no
    neighbour); the least of up to ``samples`` readings, so a task that runs for a moment (a daemon's tick) does not
    read as a busy neighbour, while a busy one shows in every reading. A running count of one (the reader alone)
    answers 0 at once, so an idle machine costs one read of ``/proc/loadavg``. None where either file cannot be read
    (not Linux), and where this process may run on only some of the machine's CPUs (a cpuset, as a container often
    has): the count is machine-wide, so tasks on CPUs we cannot use would read as neighbours."""
    if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < (os.cpu_count() or 0):
        return None
    least: int | None = None
    try:
        for _ in range(max(1, samples)):
            if _machine_running() <= 1:
                return 0
            # our threads just before and just after the count: one that ran at either moment may be in it (OpenMP's
            # workers go from spinning to sleeping within microseconds), and none of ours is a neighbour
            own = _own_running()
            running = _machine_running()
            n = max(0, running - max(own, _own_running(), 1))
            least = n if least is None else min(least, n)
            if least == 0:
                return 0
    except (OSError, ValueError, IndexError):
        return None
    return least


def _machine_running() -> int:
    """The machine's running tasks now (``/proc/loadavg``'s fourth field, running/total; the reader among them)."""
    return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])


def _own_running() -> int:
    """This process's threads in state R now (``/proc/self/task/*/stat``)."""
    own = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            own += (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):  # a thread that ended meanwhile
            continue
    return own
