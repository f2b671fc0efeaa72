"""PGSAM: Pareto-guided simulated annealing with momentum over stage plans (QEIL v2).

For each weight vector ``w`` of a simplex-lattice sweep, simulated annealing minimizes the Chebyshev
scalarization ``g(x) = max_i w_i · (f_i(x) − z_i) / s_i`` (``z`` the ideal point seen so far, ``s`` the
range seen so far), which reaches non-convex parts of the front that a weighted sum cannot. Every
feasible plan evaluated is offered to one shared archive of non-dominated solutions: that archive is
the Pareto front.

Acceptance carries momentum: an uphill move ``Δg > 0`` is accepted with probability
``exp(−max(0, Δg − μ·gain) / T)`` where ``gain`` is the normalized *energy* improvement of the previous
accepted step (0 after a rejection) and ``μ = 0.3``. A step that just lowered energy lets the next one
climb a little further, so the search crosses energy barriers between basins. ``SearchResult``
counts the moves accepted only because of momentum.

Moves: shift one boundary by ±1..±3 layers, jump one boundary anywhere, or swap two devices in the
ordered list. A plan that overflows memory may be walked through (its scalarized value pays
2 × overflow / total layer bytes) but never enters the archive, so isolated feasible plans stay
reachable. Starts: every one-device plan and ``random_starts`` random plans. After the sweep,
``polish_rounds`` rounds of Pareto local search offer every ±1 boundary move, ±1 shift of a whole
middle stage and device swap of every archive member. Everything is seeded
(``numpy.random.default_rng(seed)``), so a run is reproducible.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from hetforge.placement.pareto import Archive
from hetforge.placement.stages import LayerTable, StagePlan, objectives, overflow

MOMENTUM = 0.3


def simplex_weights(divisions: int, dims: int = 3) -> list[tuple[float, ...]]:
    """All weight vectors with components k/divisions summing to 1 (Das–Dennis lattice); zeros → 1e-3."""
    out = []

    def rec(prefix: list[int], left: int, k: int) -> None:
        if k == 1:
            out.append((*prefix, left))
            return
        for i in range(left + 1):
            rec([*prefix, i], left - i, k - 1)

    rec([], divisions, dims)
    return [tuple(max(x / divisions, 1e-3) for x in w) for w in out]


@dataclass
class SearchResult:
    """The archive (the front), how many objective evaluations it took, and how momentum was used."""

    archive: Archive
    evaluations: int
    accepted: int
    momentum_accepts: int
    seconds: float
    trajectory: list[tuple[int, ...]]  # the current assignment after every step (for reproducibility checks)


Objs = tuple[float, float, float]


class _BudgetSpent(Exception):
    """Raised when the evaluation budget is used up; the search stops with what it archived."""


class _Evaluator:
    """Objectives and memory overflow of a plan; every call counts as one evaluation."""

    def __init__(self, table: LayerTable, max_calls: int | None = None):
        self.table = table
        self.cache: dict[tuple[int, ...], tuple[Objs, float]] = {}
        self.calls = 0
        self.max_calls = max_calls

    def __call__(self, plan: StagePlan) -> tuple[tuple[int, ...], Objs, float]:
        a = plan.assignment(self.table.num_layers)
        if self.max_calls is not None and self.calls >= self.max_calls:
            raise _BudgetSpent
        self.calls += 1
        if a not in self.cache:
            self.cache[a] = (objectives(self.table, a), overflow(self.table, a))
        f, over = self.cache[a]
        return a, f, over


def _neighbor(plan: StagePlan, num_layers: int, rng: np.random.Generator) -> StagePlan:
    cuts = list(plan.cuts)
    order = list(plan.order)
    r = rng.random()
    if (r < 0.2 or not cuts) and len(order) > 1:
        i, j = rng.choice(len(order), size=2, replace=False)
        order[i], order[j] = order[j], order[i]
    elif cuts:
        k = int(rng.integers(len(cuts)))
        if r < 0.8:
            step = int(rng.integers(1, 4)) * (1 if rng.random() < 0.5 else -1)
            cuts[k] = min(max(cuts[k] + step, 0), num_layers)
        else:
            cuts[k] = int(rng.integers(num_layers + 1))
        cuts.sort()
    return StagePlan(tuple(order), tuple(cuts))


def _polish(arch: Archive, offer, num_layers: int) -> bool:
    """Pareto local search: offer every ±1 boundary move, ±1 stage shift and device swap of every archive member.

    Returns True if the archive changed (so another round may help)."""
    before = set(arch.items)
    for plan in [p for _, p in list(arch.items.values())]:
        cands = []
        for k in range(len(plan.cuts)):
            for step in (-1, 1):
                cuts = list(plan.cuts)
                cuts[k] = min(max(cuts[k] + step, 0), num_layers)
                cands.append(StagePlan(plan.order, tuple(sorted(cuts))))
        for step in (-1, 1):  # move a whole middle stage: every boundary by the same step
            cuts = tuple(min(max(c + step, 0), num_layers) for c in plan.cuts)
            cands.append(StagePlan(plan.order, cuts))
        for i in range(len(plan.order)):
            for j in range(i + 1, len(plan.order)):
                order = list(plan.order)
                order[i], order[j] = order[j], order[i]
                cands.append(StagePlan(tuple(order), plan.cuts))
        for cand in cands:
            offer(cand)
    return set(arch.items) != before


def pgsam_search(
    table: LayerTable,
    divisions: int = 3,
    steps: int = 100,
    t0: float = 0.5,
    t_end: float = 0.005,
    mu: float = MOMENTUM,
    seed: int = 0,
    polish_rounds: int = 2,
    random_starts: int = 30,
    max_evaluations: int | None = None,
) -> SearchResult:
    """Run PGSAM on ``table``: ``steps`` annealing steps per lattice weight vector, then Pareto polishing.

    ``max_evaluations`` caps the objective evaluations (the search stops early with what it archived)."""
    t_start = time.perf_counter()
    rng = np.random.default_rng(seed)
    ev = _Evaluator(table, max_evaluations)
    stats = {"accepted": 0, "momentum": 0}
    arch = Archive()
    trajectory: list[tuple[int, ...]] = []
    try:
        _run(table, ev, arch, trajectory, stats, rng, divisions, steps, t0, t_end, mu, polish_rounds, random_starts)
    except _BudgetSpent:
        pass
    return SearchResult(arch, ev.calls, stats["accepted"], stats["momentum"], time.perf_counter() - t_start,
                        trajectory)


def _run(table: LayerTable, ev: _Evaluator, arch: Archive, trajectory: list, stats: dict[str, int],
         rng: np.random.Generator, divisions: int, steps: int, t0: float, t_end: float, mu: float,
         polish_rounds: int, random_starts: int) -> None:
    """The search proper (seeds, annealing sweep, polishing); counts accepted moves into ``stats``."""
    L, D = table.num_layers, table.num_devices
    lo = np.full(3, np.inf)
    hi = np.full(3, -np.inf)
    total_w = float(table.weight_bytes.sum()) or 1.0

    def offer(plan: StagePlan) -> tuple[Objs, float]:
        a, f, over = ev(plan)
        if over == 0:
            np.minimum(lo, f, out=lo)
            np.maximum(hi, f, out=hi)
            arch.offer(a, f, plan)
        return f, over

    # Seeds: every one-device plan, so the ideal/nadir estimates start from the corners ...
    for d in range(D):
        offer(StagePlan((d, *[x for x in range(D) if x != d]), (L,) * (D - 1)))
    # ... and a few random plans for diversity (and a feasible start when nothing fits on one device).
    for _ in range(random_starts):
        cuts = tuple(sorted(int(c) for c in rng.integers(0, L + 1, D - 1)))
        offer(StagePlan(tuple(int(x) for x in rng.permutation(D)), cuts))
    cooling = (t_end / t0) ** (1.0 / max(steps - 1, 1))
    for w in simplex_weights(divisions):
        wv = np.array(w)

        def g(f: Objs, over: float, wv: np.ndarray = wv) -> float:
            """Chebyshev scalarization; an over-full plan may be walked through but pays for its overflow."""
            if not np.all(np.isfinite(lo)):  # nothing feasible seen yet: only the overflow counts
                return 2.0 * over / total_w
            span = np.where(hi > lo, hi - lo, 1.0)
            return float(np.max(wv * (np.asarray(f) - lo) / span)) + 2.0 * over / total_w

        if arch.items:
            cur_plan = min((p for _, p in arch.items.values()), key=lambda p: g(*ev(p)[1:]))
        else:
            cur_plan = StagePlan(tuple(range(D)), tuple(round(L * (j + 1) / D) for j in range(D - 1)))
        cur_f, cur_over = ev(cur_plan)[1:]
        gain = 0.0
        temp = t0
        for _ in range(steps):
            cand = _neighbor(cur_plan, L, rng)
            f, over = offer(cand)
            u = rng.random()
            dg = g(f, over) - g(cur_f, cur_over)
            if dg <= 0:
                ok = True
            else:
                p_plain = math.exp(-dg / temp)
                ok = u < math.exp(-max(0.0, dg - mu * gain) / temp)
                if ok and u >= p_plain:
                    stats["momentum"] += 1
            if ok:
                stats["accepted"] += 1
                span_e = float(hi[0] - lo[0]) if hi[0] > lo[0] else 1.0
                gain = max((cur_f[0] - f[0]) / span_e, 0.0)
                cur_plan, cur_f, cur_over = cand, f, over
            else:
                gain = 0.0
            trajectory.append(cur_plan.assignment(L))
            temp *= cooling
    for _ in range(polish_rounds):
        if not _polish(arch, offer, L):
            break


def pick(archive: Archive, objective: str) -> tuple[tuple[int, ...], tuple[float, float, float]]:
    """One point of the front: min energy, min bottleneck latency, or the balanced (equal-weight) knee."""
    keys = list(archive.items)
    pts = np.array([archive.items[k][0] for k in keys])
    if objective == "energy":
        i = min(range(len(keys)), key=lambda j: (pts[j, 0], pts[j, 1], pts[j, 2]))
    elif objective == "latency":
        i = min(range(len(keys)), key=lambda j: (pts[j, 1], pts[j, 0], pts[j, 2]))
    else:
        z, span = pts.min(axis=0), np.ptp(pts, axis=0)
        span = np.where(span > 0, span, 1.0)
        norm = (pts - z) / span
        i = min(range(len(keys)), key=lambda j: (float(norm[j, :2].max()), float(norm[j].sum())))
    return keys[i], tuple(pts[i])
