"""Scheduling: order a program's instructions so same-device work runs together.

Dependencies are data edges (producer → reader) plus ordering edges for mutation: when an
instruction writes a storage in place, every instruction that touched that storage before it (in
the lowered order, which is the graph's own order) must still run before it, and every later one
after it. Any topological order of that DAG computes what the graph computes.

The heuristic (:func:`schedule`) is a priority topological sort. Among ready instructions it takes
one on the previous instruction's device, ties broken toward freeing memory soonest (bytes released
by last uses minus bytes newly allocated), then graph order. When nothing is ready on that device it
must switch, and switches to the device whose *closure* (everything that becomes runnable there
without switching again) is largest, looking ``lookahead`` switches ahead.

Why segments are maximal closures without loss: if a schedule leaves a ready instruction of device
d out of a d-segment, moving it into that segment keeps every dependency satisfied (its predecessors
already ran) and cannot add a segment. So a minimum-switch schedule is a sequence of maximal
closures, and the exact solver (:func:`exact_min_switches`) searches exactly those sequences,
breadth-first over (executed set, last device) states with memoization.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hetforge.ir.program import INPLACE, TEMP, Program, iter_regs

Graph = tuple[dict[int, str], dict[int, set[int]], dict[int, set[int]]]  # device, preds, succs


def dependencies(p: Program) -> dict[int, set[int]]:
    """instruction id → ids it must follow (data dependencies plus in-place ordering)."""
    preds: dict[int, set[int]] = {i.id: set() for i in p.instrs}
    for ins in p.instrs:
        for r in ins.input_regs():
            prod = p.values[r].producer
            if prod is not None and prod != ins.id:
                preds[ins.id].add(prod)
    # in-place ordering, per storage root, in the lowered (graph) order = increasing instruction id
    touchers: dict[int, list[int]] = {}
    mutators: dict[int, set[int]] = {}
    for ins in sorted(p.instrs, key=lambda i: i.id):
        roots = {p.root(r) for r in ins.input_regs()} | {p.root(o) for o in ins.outputs}
        for rt in roots:
            touchers.setdefault(rt, []).append(ins.id)
        for rt in _mutated_roots(p, ins):
            mutators.setdefault(rt, set()).add(ins.id)
    for rt, muts in mutators.items():
        seq = touchers[rt]
        for m in muts:
            for t in seq:
                if t < m:
                    preds[m].add(t)
                elif t > m:
                    preds[t].add(m)
    return preds


def _mutated_roots(p: Program, ins) -> set[int]:
    out: set[int] = set()
    if ins.kind == INPLACE:
        out |= {p.root(o) for o in ins.outputs}
    schema = getattr(ins.target, "_schema", None)
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                val = ins.args[i] if i < len(ins.args) else ins.kwargs.get(a.name)
                out |= {p.root(r) for r in iter_regs(val)}
    return out


def count_switches(devices: list[str]) -> int:
    """Adjacent pairs that run on different devices."""
    return sum(1 for a, b in zip(devices, devices[1:], strict=False) if a != b)


def is_topological(order: list[int], preds: dict[int, set[int]]) -> bool:
    pos = {n: k for k, n in enumerate(order)}
    if sorted(pos) != sorted(preds):
        return False
    return all(pos[q] < pos[n] for n, ps in preds.items() for q in ps)


def _succs(preds: dict[int, set[int]]) -> dict[int, set[int]]:
    succs: dict[int, set[int]] = {n: set() for n in preds}
    for n, ps in preds.items():
        for q in ps:
            succs[q].add(n)
    return succs


def _closure(dev: dict[int, str], succs: dict[int, set[int]], indeg: dict[int, int], ready: set[int],
             d: str) -> tuple[list[int], dict[int, int], set[int]]:
    """Run everything runnable on ``d`` without switching: (ran, new indegrees (changed only), new ready)."""
    changed: dict[int, int] = {}
    ready = set(ready)
    queue = deque(sorted(n for n in ready if dev[n] == d))
    ran: list[int] = []
    while queue:
        n = queue.popleft()
        ready.discard(n)
        ran.append(n)
        for s in succs[n]:
            k = changed.get(s, indeg[s]) - 1
            changed[s] = k
            if k == 0:
                if dev[s] == d:
                    queue.append(s)
                else:
                    ready.add(s)
    return ran, changed, ready


def _best_device(dev, succs, indeg, ready, depth: int) -> tuple[int, str]:
    """(instructions run within ``depth`` segments, first device) — the lookahead's choice."""
    best: tuple[int, str] | None = None
    for d in sorted({dev[n] for n in ready}):
        ran, changed, ready2 = _closure(dev, succs, indeg, ready, d)
        score = len(ran)
        if depth > 1 and ready2:
            indeg2 = dict(indeg)
            indeg2.update(changed)
            score += _best_device(dev, succs, indeg2, ready2, depth - 1)[0]
        if best is None or score > best[0]:
            best = (score, d)
    assert best is not None
    return best


def beam_device_sequence(dev: dict[int, str], preds: dict[int, set[int]], width: int = 8,
                         start: str | None = None) -> list[str]:
    """The device of each segment, chosen by a beam search over maximal-closure sequences.

    Level k holds at most ``width`` states reachable with k segments, ranked by instructions run (more
    first). With an unbounded width this is exactly :func:`exact_min_switches`; bounded, it costs
    O(levels · width · devices) closures.
    """
    succs = _succs(preds)
    indeg0 = {n: len(ps) for n, ps in preds.items()}
    ready0 = {n for n, k in indeg0.items() if k == 0}
    total = len(preds)
    # state: (ran, indeg, ready, sequence)
    beam: list[tuple[int, dict[int, int], set[int], list[str]]] = [(0, indeg0, ready0, [start] if start else [])]
    if start is not None:
        ran, changed, ready = _closure(dev, succs, indeg0, ready0, start)
        ind = dict(indeg0)
        ind.update(changed)
        beam = [(len(ran), ind, ready, [start])]
    while True:
        done = [b for b in beam if b[0] == total]
        if done:
            return done[0][3]
        nxt: dict[frozenset[int], tuple[int, dict[int, int], set[int], list[str]]] = {}
        for ran_n, indeg, ready, seq in beam:
            last = seq[-1] if seq else None
            for d in sorted({dev[n] for n in ready}):
                if d == last:
                    continue
                ran, changed, ready2 = _closure(dev, succs, indeg, ready, d)
                ind = dict(indeg)
                ind.update(changed)
                key = frozenset(ready2) | {-1 - sorted(set(dev.values())).index(d)}
                cand = (ran_n + len(ran), ind, ready2, seq + [d])
                if key not in nxt or nxt[key][0] < cand[0]:
                    nxt[key] = cand
        if not nxt:
            raise ValueError("dependency graph has a cycle")
        beam = sorted(nxt.values(), key=lambda b: (-b[0], b[3]))[:width]


@dataclass
class ScheduleResult:
    """The scheduled program and the device-switch figures before and after."""

    program: Program
    order: list[int]
    naive_switches: int
    scheduled_switches: int
    exact_switches: int | None = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"naive": self.naive_switches, "scheduled": self.scheduled_switches, "exact": self.exact_switches,
                "seconds": self.seconds}


def schedule_graph(dev: dict[int, str], preds: dict[int, set[int]], score: Any = None, lookahead: int = 2,
                   start: str | None = None, beam: int = 8) -> list[int]:
    """Priority topological sort of a DAG given as node → device and node → predecessors.

    ``score(n)`` (higher first) breaks ties among same-device ready nodes; ``score`` may keep state and
    is told of each choice through ``score.taken(n)`` when it has that method. When it must switch, it
    follows the device sequence of :func:`beam_device_sequence` (``beam`` > 0), else the device whose
    closure runs most instructions within ``lookahead`` segments.
    """
    succs = _succs(preds)
    indeg = {n: len(ps) for n, ps in preds.items()}
    ready = {n for n, k in indeg.items() if k == 0}
    plan = beam_device_sequence(dev, preds, beam, start) if beam > 0 and preds else []
    if plan and plan[0] == start:
        plan = plan[1:]
    plan_pos = 0
    order: list[int] = []
    prev = start
    while ready:
        cands = [n for n in ready if dev[n] == prev]
        if not cands:
            prev = None
            while plan_pos < len(plan) and prev is None:
                d = plan[plan_pos]
                plan_pos += 1
                if any(dev[n] == d for n in ready):
                    prev = d
            if prev is None:
                prev = _best_device(dev, succs, indeg, ready, lookahead)[1]
            cands = [n for n in ready if dev[n] == prev]
        n = max(cands, key=(lambda m: (score(m), -m)) if score is not None else (lambda m: -m))
        if score is not None and hasattr(score, "taken"):
            score.taken(n)
        ready.discard(n)
        order.append(n)
        for s in succs[n]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.add(s)
    if len(order) != len(preds):
        raise ValueError("dependency graph has a cycle")
    return order


class _MemoryScore:
    """Bytes freed (last reads of temporary storage) minus bytes allocated, kept up to date as nodes run."""

    def __init__(self, p: Program):
        self.p = p
        self.by_id = p.instr_by_id()
        self.remaining: dict[int, int] = {}  # root → instructions still to read/define it
        self.touch: dict[int, set[int]] = {}
        for ins in p.instrs:
            roots = {p.root(r) for r in ins.input_regs()}
            self.touch[ins.id] = roots
            for rt in roots:
                self.remaining[rt] = self.remaining.get(rt, 0) + 1

    def __call__(self, n: int) -> int:
        ins = self.by_id[n]
        freed = sum(self.p.values[rt].nbytes for rt in self.touch[n]
                    if self.remaining[rt] == 1 and self.p.values[rt].kind == TEMP)
        alloc = sum(self.p.values[o].nbytes for o in ins.outputs if self.p.values[o].alias_of is None)
        return freed - alloc

    def taken(self, n: int) -> None:
        for rt in self.touch[n]:
            self.remaining[rt] -= 1


def schedule(p: Program, lookahead: int = 2, exact_limit: int = 0, beam: int = 8) -> ScheduleResult:
    """Order ``p``'s instructions (device affinity first, then memory); report switches before/after.

    ``exact_limit``: also run the exact solver when the program has at most this many instructions.
    """
    t0 = time.perf_counter()
    preds = dependencies(p)
    dev = {i.id: i.device for i in p.instrs}
    naive = sorted(dev)
    order = schedule_graph(dev, preds, _MemoryScore(p), lookahead=lookahead, beam=beam)
    seconds = time.perf_counter() - t0
    res = ScheduleResult(p.with_order(order), order, count_switches([dev[n] for n in naive]),
                         count_switches([dev[n] for n in order]), seconds=seconds)
    if exact_limit and len(order) <= exact_limit:
        res.exact_switches = exact_min_switches(dev, preds)[0]
    return res


class SearchTooLarge(Exception):
    """The exact solver exceeded its state budget."""


def exact_min_switches(dev: dict[int, str], preds: dict[int, set[int]],
                       max_states: int = 500_000) -> tuple[int, list[int]]:
    """Minimum device switches over all topological orders, and one order achieving it.

    Breadth-first search over states (executed set as a bitmask, last device); each step runs a maximal
    closure on a device other than the last one (see the module docstring for why that loses nothing).
    The first level at which everything has run is optimal: levels are segment counts.
    """
    nodes = sorted(preds)
    if not nodes:
        return 0, []
    idx = {n: k for k, n in enumerate(nodes)}
    pred_mask = [0] * len(nodes)
    for n, ps in preds.items():
        for q in ps:
            pred_mask[idx[n]] |= 1 << idx[q]
    devs = [dev[n] for n in nodes]
    full = (1 << len(nodes)) - 1

    def closure(done: int, d: str) -> tuple[int, list[int]]:
        ran: list[int] = []
        changed = True
        while changed:
            changed = False
            for k in range(len(nodes)):
                if not (done >> k) & 1 and devs[k] == d and (pred_mask[k] & done) == pred_mask[k]:
                    done |= 1 << k
                    ran.append(k)
                    changed = True
        return done, ran

    frontier: dict[tuple[int, str], list[int]] = {}
    for d in sorted(set(devs)):
        m, ran = closure(0, d)
        if ran:
            frontier[(m, d)] = ran
    seen = set(frontier)
    level = 0
    while frontier:
        for (m, _d), path in frontier.items():
            if m == full:
                return level, [nodes[k] for k in path]
        nxt: dict[tuple[int, str], list[int]] = {}
        for (m, d), path in frontier.items():
            for e in sorted(set(devs)):
                if e == d:
                    continue
                m2, ran = closure(m, e)
                if ran and (m2, e) not in seen:
                    seen.add((m2, e))
                    nxt[(m2, e)] = path + ran
                    if len(seen) > max_states:
                        raise SearchTooLarge(f"more than {max_states} states")
        frontier = nxt
        level += 1
    raise ValueError("dependency graph has a cycle")
