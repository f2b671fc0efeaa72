"""The one modeled timeline: a list schedule of calls, switches and transfers over device lanes.

Both the run-time report of a partitioned program (:mod:`hetforge.hetero.timeline`) and the stage-plan
search of placement (:func:`hetforge.placement.stages.objectives`, which PGSAM and the exact front
minimize) describe a run as :class:`Task` s and get their latency from :func:`list_schedule`, so the
placement objective, the reported latency and the Perfetto trace are read off the same schedule.

Rules of the schedule (tasks are taken in the given order, each starting as early as it can):

* a ``call`` or ``switch`` task occupies its device lane: it starts when the lane is free and every task
  it depends on has ended;
* a ``transfer`` task (lane ``"src->dst"``) starts when its dependencies end and does not wait for other
  transfers (links are not modeled as contended);
* a task's duration and energy are the cost model's, never a host timing.

Two latencies come out of one schedule:

* ``makespan_s`` — the latency of one run (request): when the last task ends;
* ``bottleneck_s`` — the pipelined period: the largest *load* of a device, i.e. the time its lane is busy
  (calls + switches into it) plus the transfers that deliver data to it (``dst``). When requests or
  micro-batches follow each other, no device can start a new one faster than that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Task:
    """One item to schedule: ``deps`` index earlier tasks of the same list."""

    kind: str  # "call" | "transfer" | "switch"
    lane: str  # a device name, or "src->dst" for transfers
    name: str
    dur_s: float
    energy_j: float = 0.0
    deps: tuple[int, ...] = ()
    dst: str | None = None  # transfers: the receiving device (its load includes the transfer)
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Span:
    """One item on the modeled timeline (seconds from the run's start)."""

    kind: str  # "call" | "transfer" | "switch"
    lane: str
    name: str
    start_s: float
    dur_s: float
    energy_j: float = 0.0
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


@dataclass
class Timeline:
    """The list schedule of one run (modeled)."""

    spans: list[Span]
    makespan_s: float
    energy_j: float
    switches: int
    switch_s: float
    serial_s: float  # the plain sum of every span: what a sum-of-costs model would report
    load_s: dict[str, float] = field(default_factory=dict)  # device → busy + incoming transfers

    @property
    def bottleneck_s(self) -> float:
        """The pipelined period: the most loaded device's load (see the module docstring)."""
        return max(self.load_s.values(), default=0.0)

    def by_device(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for s in self.spans:
            if s.kind == "transfer":
                continue
            d = out.setdefault(s.lane, {"busy_s": 0.0, "energy_j": 0.0, "calls": 0})
            d["busy_s"] += s.dur_s
            d["energy_j"] += s.energy_j
            d["calls"] += 1 if s.kind == "call" else 0
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"makespan_s": self.makespan_s, "bottleneck_s": self.bottleneck_s, "energy_j": self.energy_j,
                "switches": self.switches, "switch_s": self.switch_s, "serial_s": self.serial_s,
                "load_s": dict(self.load_s), "by_device": self.by_device(), "figure": "modeled"}


def list_schedule(tasks: list[Task]) -> Timeline:
    """Schedule ``tasks`` in order (see the module docstring for the rules)."""
    free: dict[str, float] = {}
    ends: list[float] = []
    spans: list[Span] = []
    load: dict[str, float] = {}
    for t in tasks:
        start = max((ends[i] for i in t.deps), default=0.0)
        if t.kind != "transfer":
            start = max(start, free.get(t.lane, 0.0))
            free[t.lane] = start + t.dur_s
            load[t.lane] = load.get(t.lane, 0.0) + t.dur_s
        elif t.dst is not None:
            load[t.dst] = load.get(t.dst, 0.0) + t.dur_s
        ends.append(start + t.dur_s)
        spans.append(Span(t.kind, t.lane, t.name, start, t.dur_s, t.energy_j, t.args))
    switches = [s for s in spans if s.kind == "switch"]
    return Timeline(spans, max(ends, default=0.0), sum(s.energy_j for s in spans), len(switches),
                    sum(s.dur_s for s in switches), sum(s.dur_s for s in spans), load)
