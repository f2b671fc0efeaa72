"""What the placement benchmark (and tests/test_pgsam.py) compares searches with; not part of the package.

* :func:`random_table`: seeded heterogeneous layer tables (no hardware meaning).
* :func:`nsga2_search`: pymoo's NSGA-II on an integer vector (pymoo is a dev extra).
* :func:`hypervolume`, :func:`bounds`: pymoo's exact hypervolume on normalized points.
* :func:`front_quality`: a found front against the exact one — share of exact points found, the found
  points the exact front dominates and by how much (per objective), and the hypervolume ratio.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from hetforge.placement.pareto import Archive, dominates
from hetforge.placement.stages import LayerTable, StagePlan, evaluate, overflow


def random_table(num_layers: int, num_devices: int = 3, seed: int = 0, capacity_frac: float = 1.0) -> LayerTable:
    """A seeded heterogeneous table for tests and search-quality benches (no hardware meaning)."""
    rng = np.random.default_rng(seed)
    speed = rng.uniform(0.5, 4.0, num_devices)
    power = rng.uniform(2.0, 30.0, num_devices)
    work = rng.uniform(0.5, 2.0, num_layers)
    time_ = np.outer(work, 1.0 / speed) * rng.uniform(0.8, 1.25, (num_layers, num_devices)) * 1e-3
    energy = time_ * power * rng.uniform(0.7, 1.3, (num_layers, num_devices))
    dasi = np.clip(rng.uniform(0.05, 1.0, (num_layers, num_devices)), 0, 1)
    wb = rng.uniform(1.0, 2.0, num_layers) * 1e6
    cap = np.full(num_devices, wb.sum() * capacity_frac)
    xt = rng.uniform(0.05, 0.3, (num_layers + 1, num_devices, num_devices)) * 1e-3
    xe = xt * 5.0
    for i in range(num_devices):
        xt[:, i, i] = 0.0
        xe[:, i, i] = 0.0
    return LayerTable([f"dev{i}" for i in range(num_devices)], time_, energy, dasi, wb, cap, xt, xe, entry=0, exit=0)


@dataclass
class NsgaResult:
    archive: Archive
    evaluations: int
    seconds: float


def decode(x: np.ndarray, num_layers: int, num_devices: int) -> StagePlan:
    """Integer vector → plan: ``x[:D]`` rank keys (device order = stable argsort), ``x[D:]`` the cuts (sorted)."""
    x = np.round(np.asarray(x)).astype(int)
    order = tuple(int(i) for i in np.argsort(x[:num_devices], kind="stable"))
    cuts = tuple(sorted(min(max(int(c), 0), num_layers) for c in x[num_devices:]))
    return StagePlan(order, cuts)


def nsga2_search(table: LayerTable, evaluations: int, pop_size: int = 40, seed: int = 0) -> NsgaResult:
    """pymoo's NSGA-II credited with at most ``evaluations`` objective evaluations.

    Encoding: an integer vector of ``D`` rank keys (the device order is their stable argsort, so every
    vector is a valid permutation and crossover mixes positions) and ``D − 1`` cut positions in ``[0, L]``.
    Operators: pymoo's recipe for integer variables — integer random sampling, SBX and polynomial
    mutation on the integer lattice (``eta = 3``, rounding repair) — with duplicate elimination. A plan
    that does not fit gets one inequality constraint (its overflow). Every feasible evaluation up to the
    budget is offered to an archive, so NSGA-II is credited with the best front it ever saw.
    """
    from pymoo.algorithms.moo.nsga2 import NSGA2
    from pymoo.core.problem import ElementwiseProblem
    from pymoo.operators.crossover.sbx import SBX
    from pymoo.operators.mutation.pm import PM
    from pymoo.operators.repair.rounding import RoundingRepair
    from pymoo.operators.sampling.rnd import IntegerRandomSampling
    from pymoo.optimize import minimize

    L, D = table.num_layers, table.num_devices
    arch = Archive()
    calls = [0]

    class StageProblem(ElementwiseProblem):
        def __init__(self):
            xu = np.array([D - 1] * D + [L] * (D - 1))
            super().__init__(n_var=2 * D - 1, n_obj=3, n_ieq_constr=1, xl=np.zeros(2 * D - 1), xu=xu, vtype=int)

        def _evaluate(self, x, out, *args, **kwargs):
            calls[0] += 1
            plan = decode(x, L, D)
            a = plan.assignment(L)
            f = evaluate(table, a)
            if f is None:
                out["F"] = [1e30, 1e30, 1e30]
                out["G"] = [overflow(table, a)]
            else:
                if calls[0] <= evaluations:
                    arch.offer(a, f, plan)
                out["F"] = list(f)
                out["G"] = [-1.0]

    algo = NSGA2(
        pop_size=pop_size,
        sampling=IntegerRandomSampling(),
        crossover=SBX(prob=1.0, eta=3.0, vtype=float, repair=RoundingRepair()),
        mutation=PM(prob=1.0, eta=3.0, vtype=float, repair=RoundingRepair()),
        eliminate_duplicates=True,
    )
    t0 = time.perf_counter()
    minimize(StageProblem(), algo, ("n_eval", evaluations), seed=seed, verbose=False)
    return NsgaResult(arch, min(calls[0], evaluations), time.perf_counter() - t0)


def bounds(*fronts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Common ideal (min) and nadir (max) over the given fronts."""
    allp = np.vstack([f for f in fronts if len(f)])
    return allp.min(axis=0), allp.max(axis=0)


def hypervolume(points: np.ndarray, lo: np.ndarray, hi: np.ndarray, ref: float = 1.1) -> float:
    """Hypervolume of ``points`` normalized by ``lo``/``hi`` against the reference point ``ref``·1."""
    from pymoo.indicators.hv import HV

    if len(points) == 0:
        return 0.0
    span = np.where(hi - lo > 0, hi - lo, 1.0)
    norm = (np.asarray(points, dtype=float) - lo) / span
    return float(HV(ref_point=np.full(norm.shape[1], ref))(norm))


def front_quality(found: np.ndarray, exact: np.ndarray, rtol: float = 1e-9) -> dict:
    """A found front against the exact one (both ``[n, 3]`` arrays of minimized objectives).

    ``found_share``: exact points found (to ``rtol``); ``dominated``: found points some exact point
    dominates; ``worst_gap``: per objective, the largest relative excess ``(f − g)/|g|`` of a dominated
    found point over the exact point dominating it that is closest (smallest largest excess);
    ``hv_ratio``: hypervolume found/exact on the exact front's ideal–nadir box.
    """
    found = np.asarray(found, dtype=float).reshape(-1, exact.shape[1])
    hit = sum(bool(np.any(np.all(np.isclose(found, q, rtol=rtol, atol=0), axis=1))) for q in exact)
    gaps = np.zeros(exact.shape[1])
    dominated = 0
    for p in found:
        doms = [q for q in exact if dominates(q, p) and not np.allclose(q, p, rtol=rtol, atol=0)]
        if not doms:
            continue
        dominated += 1
        rel = [np.maximum(p - q, 0) / np.where(np.abs(q) > 0, np.abs(q), 1.0) for q in doms]
        best = min(rel, key=lambda r: float(r.max()))
        gaps = np.maximum(gaps, best)
    lo, hi = bounds(exact)
    hx = hypervolume(exact, lo, hi)
    return {"found_share": hit / len(exact), "found": hit, "exact": len(exact), "front": len(found),
            "dominated": dominated, "worst_gap": [float(g) for g in gaps],
            "hv_ratio": hypervolume(found, lo, hi) / hx if hx else 1.0}
