"""Adaptive thread count for decode steps: no collapse when another process takes a core.

A decode step is ~100 short parallel kernels (native GEMVs, norms, attention; oneDNN/ATen for the rest). The
native ones run on their own pool, where no call waits for a descheduled thread (``hetforge.kernels.native``);
the ATen/oneDNN ones end at OpenMP barriers, and when another busy process shares the cores one thread of the
team is often descheduled for a whole time slice (milliseconds) and every barrier waits for it. Even without
barriers, two threads on a shared core can lose to one. The tuner measures the steps it runs (wall time) and
keeps, per thread count (the requested count and 1), a moving average of the count in use; every
``explore_every`` steps — or at once when a step takes ``spike``× that average — one step runs with the other
count (its time replaces that count's stale average), and the faster count is kept; a probe that loses doubles
the interval to the next (up to 8×). The tuner lives on the engine: a request's prefill runs with the count
its decode steps last found faster. Off with ``HETFORGE_ADAPT_THREADS=0``; torch's thread count is restored
when the request ends.
"""

from __future__ import annotations

import os

import torch


class ThreadTuner:
    """Pick the thread count of each decode step from measured step times."""

    def __init__(self, threads: int | None = None, explore_every: int = 16, alpha: float = 0.3,
                 spike: float = 3.0):
        self.base = torch.get_num_threads()
        self.max = max(1, threads or self.base)
        self.enabled = self.max > 1 and os.environ.get("HETFORGE_ADAPT_THREADS", "1") != "0"
        self.explore_every, self.alpha, self.spike = explore_every, alpha, spike
        self.cur = self.max
        self.avg: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        self.since_probe = 0
        self.interval = explore_every
        self.probing: int | None = None
        self.switches = 0

    def other(self, n: int) -> int:
        return 1 if n == self.max else self.max

    def before(self) -> int:
        """Set and return the thread count for the next step."""
        if not self.enabled:
            return self.base
        n = self.cur
        if self.probing is None and (self.since_probe >= self.interval or self.other(n) not in self.avg
                                     and self.since_probe >= 1):
            self.probing = self.other(n)
            n = self.probing
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def before_prefill(self) -> int:
        """Set the thread count for a prefill: the count decode steps found faster (the requested one at first)."""
        n = self.cur if self.enabled else self.base
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def after(self, n: int, seconds: float) -> None:
        """Record one step of ``n`` threads that took ``seconds`` (measured)."""
        self.counts[n] = self.counts.get(n, 0) + 1
        if not self.enabled:
            return
        prev = self.avg.get(n)
        if self.probing is not None and n == self.probing:
            self.avg[n] = seconds  # the other count's average is stale by now: a probe replaces it
            self.probing, self.since_probe = None, 0
            best = min(self.avg, key=self.avg.get)
            if best != self.cur:
                self.cur, self.switches, self.interval = best, self.switches + 1, self.explore_every
            else:
                self.interval = min(2 * self.interval, 8 * self.explore_every)
            return
        self.avg[n] = seconds if prev is None else (1 - self.alpha) * prev + self.alpha * seconds
        self.since_probe += 1
        if prev is not None and seconds > self.spike * prev:
            self.since_probe = self.interval  # a sudden slowdown: try the other count next step

    def restore(self) -> None:
        if torch.get_num_threads() != self.base:
            torch.set_num_threads(self.base)

    def summary(self) -> dict:
        return {"adaptive": self.enabled, "threads_requested": self.max, "steps_by_threads": dict(self.counts),
                "mean_step_s_by_threads": {k: round(v, 6) for k, v in self.avg.items()}, "switches": self.switches}
