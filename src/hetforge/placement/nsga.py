"""NSGA-II baseline (pymoo) over the same stage-plan space and objectives as PGSAM.

Encoding: ``x[0]`` is the index of the device order among all permutations, ``x[1:]`` the boundary
vector (sorted when decoded); integer variables through pymoo's rounding repair. A plan that does not
fit in memory gets one inequality constraint (excess bytes > 0). Every feasible evaluation is offered
to an archive, so NSGA-II is credited with the best front it ever saw, not only its last population.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from hetforge.placement.pareto import Archive
from hetforge.placement.stages import LayerTable, StagePlan, evaluate, overflow


@dataclass
class NsgaResult:
    archive: Archive
    evaluations: int
    seconds: float


def nsga2_search(table: LayerTable, evaluations: int, pop_size: int = 20, seed: int = 0) -> NsgaResult:
    """Run pymoo's NSGA-II for exactly ``evaluations`` objective evaluations (rounded up to a generation)."""
    from pymoo.algorithms.moo.nsga2 import NSGA2
    from pymoo.core.problem import ElementwiseProblem
    from pymoo.operators.crossover.sbx import SBX
    from pymoo.operators.mutation.pm import PM
    from pymoo.operators.repair.rounding import RoundingRepair
    from pymoo.operators.sampling.rnd import IntegerRandomSampling
    from pymoo.optimize import minimize

    L, D = table.num_layers, table.num_devices
    orders = list(itertools.permutations(range(D)))
    arch = Archive()
    calls = [0]

    class StageProblem(ElementwiseProblem):
        def __init__(self):
            xu = np.array([len(orders) - 1] + [L] * (D - 1))
            super().__init__(n_var=D, n_obj=3, n_ieq_constr=1, xl=np.zeros(D), xu=xu, vtype=int)

        def _evaluate(self, x, out, *args, **kwargs):
            calls[0] += 1
            x = np.round(x).astype(int)
            plan = StagePlan(orders[int(x[0])], tuple(sorted(int(c) for c in x[1:])))
            a = plan.assignment(L)
            f = evaluate(table, a)
            if f is None:
                out["F"] = [1e30, 1e30, 1e30]
                out["G"] = [overflow(table, a)]
            else:
                arch.offer(a, f, plan)
                out["F"] = list(f)
                out["G"] = [-1.0]

    algo = NSGA2(
        pop_size=pop_size,
        sampling=IntegerRandomSampling(),
        crossover=SBX(prob=0.9, eta=15, vtype=float, repair=RoundingRepair()),
        mutation=PM(eta=20, vtype=float, repair=RoundingRepair()),
        eliminate_duplicates=True,
    )
    t0 = time.perf_counter()
    minimize(StageProblem(), algo, ("n_eval", evaluations), seed=seed, verbose=False)
    return NsgaResult(arch, calls[0], time.perf_counter() - t0)
