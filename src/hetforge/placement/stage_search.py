"""Pick the search for contiguous stage plans: the exact front where it fits, PGSAM beyond.

``search="auto"`` (the default of strategy ``stages``) solves a table exactly (:mod:`.exact`) when its
plan count is at most ``min(budget, EXACT_PLAN_BUDGET)`` and runs PGSAM (:mod:`.pgsam_search`) otherwise,
capped at ``budget`` evaluations when one is given. ``"exact"`` and ``"pgsam"`` force one of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetforge.errors import UsageError
from hetforge.placement.exact import EXACT_PLAN_BUDGET, count_plans, exact_front
from hetforge.placement.pareto import Archive
from hetforge.placement.pgsam_search import pgsam_search
from hetforge.placement.stages import LayerTable

SEARCHES = ("auto", "exact", "pgsam")


@dataclass
class FrontResult:
    """The front and how it was found (``method``: exact or pgsam; ``stats``: what the search reports)."""

    archive: Archive
    method: str
    plans: int
    stats: dict = field(default_factory=dict)


def search_front(table: LayerTable, search: str = "auto", budget: int | None = None, seed: int = 0,
                 **pgsam_opts: object) -> FrontResult:
    """The Pareto front of ``table`` by the chosen search (see module docstring)."""
    if search not in SEARCHES:
        raise UsageError(f"unknown search '{search}'; valid: {', '.join(SEARCHES)}")
    L, D = table.num_layers, table.num_devices
    plans = count_plans(L, D)
    if budget is not None and budget < D:
        raise UsageError(f"search budget {budget} is too small for any plan: this model has {plans:,} possible stage "
                         f"plans ({L} layers × {D} devices); PGSAM needs at least {D} evaluations (the one-device "
                         f"plans), the exact front {plans:,}")
    limit = EXACT_PLAN_BUDGET if budget is None else min(budget, EXACT_PLAN_BUDGET)
    if search == "exact" and budget is not None and plans > budget:
        raise UsageError(f"exact search needs all {plans:,} stage plans ({L} layers × {D} devices) but the "
                         f"search budget is {budget:,}; raise the budget or use search=pgsam")
    if search == "exact" or (search == "auto" and plans <= limit):
        r = exact_front(table)
        return FrontResult(r.archive, "exact", plans, {"labels": r.labels, "seconds": r.seconds})
    r = pgsam_search(table, seed=seed, max_evaluations=budget, **pgsam_opts)  # type: ignore[arg-type]
    return FrontResult(r.archive, "pgsam", plans, {"evaluations": r.evaluations, "accepted": r.accepted,
                                                   "momentum_accepts": r.momentum_accepts, "seconds": r.seconds,
                                                   "seed": seed, "trajectory_steps": len(r.trajectory)})
