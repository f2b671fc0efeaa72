"""Liveness analysis and memory planning: one activation arena per device, offsets by linear scan.

**Buffers.** Every value that owns storage (``alias_of is None``) of kind ``temp`` is a buffer in the
arena of its device. Views, in-place results, ``split`` pieces and zero-copy transfers own nothing:
they live in their root's bytes. Graph inputs, weights and graph outputs (allocated fresh per call so
the caller may keep them) are outside the arena, and so is anything a later KV cache will hold.

**Lifetimes.** Over the final instruction order, a buffer is live on the closed interval
[position of its producer, last position at which it or any alias of it is read or written]. Aliases
therefore extend their root's lifetime, which is what keeps a view's bytes valid while the view is
read (tests check aliases' uses are covered).

**Packing.** Two algorithms, keep the smaller arena: (1) greedy by size, best fit — largest buffer
first, placed in the smallest gap between already-placed buffers whose lifetimes overlap it;
(2) first fit in time order (classic linear scan) — buffers by start time, lowest offset that does not
collide with a buffer still live. Offsets are 64-byte aligned.

**Correctness.** Both algorithms only place a buffer at an offset range disjoint from every already
placed buffer whose lifetime intersects its own (they check exactly that set), so any two buffers
with overlapping lifetimes get disjoint byte ranges. :func:`verify_plan` re-checks this independently
of how the plan was made (a sweep over time with the set of live buffers), plus alignment and bounds.

**Figures.** Per device: naive bytes (every buffer its own allocation), planned arena bytes, and the
lower bound max over time of the live bytes (no packing can beat it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

# Lifetimes and the plan check are facts about the IR (hetforge.ir.liveness); re-exported here.
from hetforge.ir.liveness import ALIGN, Buffer, PlanError, align, lifetimes, verify_plan  # noqa: F401
from hetforge.ir.program import OUTPUT, TEMP, Program, Reg


@dataclass
class DevicePlan:
    device: str
    arena_bytes: int
    naive_bytes: int
    lower_bound_bytes: int
    buffers: int
    algorithm: str
    candidates: dict[str, int] = field(default_factory=dict)  # algorithm → arena bytes


@dataclass
class MemoryPlan:
    """Offsets per buffer (value id → byte offset in its device's arena) and the figures per device."""

    offsets: dict[int, int]
    buffers: dict[int, Buffer]
    devices: dict[str, DevicePlan]
    seconds: float = 0.0

    @property
    def naive_bytes(self) -> int:
        return sum(d.naive_bytes for d in self.devices.values())

    @property
    def planned_bytes(self) -> int:
        return sum(d.arena_bytes for d in self.devices.values())

    @property
    def lower_bound_bytes(self) -> int:
        return sum(d.lower_bound_bytes for d in self.devices.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "naive_bytes": self.naive_bytes, "planned_bytes": self.planned_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
            "per_device": {d: {"naive_bytes": p.naive_bytes, "planned_bytes": p.arena_bytes,
                               "lower_bound_bytes": p.lower_bound_bytes, "buffers": p.buffers,
                               "algorithm": p.algorithm, "candidates": p.candidates}
                           for d, p in self.devices.items()},
        }


def lower_bound(bufs: list[Buffer]) -> int:
    """Maximum over positions of the bytes live at that position."""
    events: dict[int, int] = {}
    for b in bufs:
        events[b.start] = events.get(b.start, 0) + b.size
        events[b.end + 1] = events.get(b.end + 1, 0) - b.size
    live = best = 0
    for t in sorted(events):
        live += events[t]
        best = max(best, live)
    return best


def _fit(placed: list[tuple[int, int]], size: int, best_fit: bool) -> int:
    """Lowest (first fit) or tightest (best fit) aligned offset whose [off, off+size) misses every range."""
    placed = sorted(placed)
    cur = 0
    best: tuple[int, int] | None = None  # (gap size, offset)
    for off, sz in placed:
        if off - cur >= size:
            if not best_fit:
                return cur
            if best is None or off - cur < best[0]:
                best = (off - cur, cur)
        cur = max(cur, align(off + sz))
    if best is not None:
        return best[1]
    return cur


def greedy_by_size(bufs: list[Buffer]) -> dict[int, int]:
    """Largest first; each into the tightest gap among placed buffers it overlaps in time."""
    offsets: dict[int, int] = {}
    placed: list[Buffer] = []
    for b in sorted(bufs, key=lambda b: (-b.size, b.start, b.value)):
        ranges = [(offsets[o.value], o.size) for o in placed if o.overlaps_in_time(b)]
        offsets[b.value] = _fit(ranges, b.size, best_fit=True)
        placed.append(b)
    return offsets


def first_fit_linear_scan(bufs: list[Buffer]) -> dict[int, int]:
    """Buffers in order of first definition; each at the lowest offset free of still-live buffers."""
    offsets: dict[int, int] = {}
    active: list[Buffer] = []
    for b in sorted(bufs, key=lambda b: (b.start, -b.size, b.value)):
        active = [a for a in active if a.end >= b.start]
        offsets[b.value] = _fit([(offsets[a.value], a.size) for a in active], b.size, best_fit=False)
        active.append(b)
    return offsets


ALGORITHMS = {"greedy-by-size": greedy_by_size, "first-fit": first_fit_linear_scan}


def arena_size(bufs: list[Buffer], offsets: dict[int, int]) -> int:
    return max((offsets[b.value] + b.size for b in bufs), default=0)


def plan_memory(p: Program, algorithms: tuple[str, ...] = ("greedy-by-size", "first-fit"),
                verify: bool = True) -> MemoryPlan:
    """Plan ``p`` (already in its final order): per device, run each algorithm and keep the smallest."""
    t0 = time.perf_counter()
    bufs = lifetimes(p)
    offsets: dict[int, int] = {}
    devices: dict[str, DevicePlan] = {}
    for d in p.devices:
        mine = [b for b in bufs.values() if b.device == d]
        cands: dict[str, tuple[int, dict[int, int]]] = {}
        for name in algorithms:
            offs = ALGORITHMS[name](mine)
            cands[name] = (arena_size(mine, offs), offs)
        best = min(cands, key=lambda k: (cands[k][0], list(cands).index(k)))
        offsets.update(cands[best][1])
        devices[d] = DevicePlan(d, cands[best][0], sum(b.size for b in mine), lower_bound(mine), len(mine), best,
                                {k: v[0] for k, v in cands.items()})
    plan = MemoryPlan(offsets, bufs, devices, time.perf_counter() - t0)
    if verify:
        verify_plan(bufs, offsets, {d: dp.arena_bytes for d, dp in devices.items()})
    return plan


def with_output_slices(p: Program, plan: MemoryPlan) -> MemoryPlan:
    """``plan`` plus a range past each arena's end for every graph output's storage root that is not in the arena:
    for a program whose caller takes its outputs before calling it again (a decode step), which then needs no fresh
    tensor per output and per call. The added ranges overlap nothing (past the end, each its own), so the plan stays
    valid; its figures (naive, lower bound) stay those of the temporaries."""
    offsets = dict(plan.offsets)
    devices = {d: replace(dp) for d, dp in plan.devices.items()}
    for o in p.outputs:
        if not isinstance(o, Reg):
            continue
        rt = p.root(o.id)
        v = p.values[rt]
        if rt in offsets or v.producer is None or v.nbytes == 0 or v.kind not in (TEMP, OUTPUT):
            continue
        dp = devices.setdefault(v.device, DevicePlan(v.device, 0, 0, 0, 0, "outputs"))
        offsets[rt] = align(dp.arena_bytes)
        dp.arena_bytes = offsets[rt] + align(v.nbytes)
    return replace(plan, offsets=offsets, devices=devices)
