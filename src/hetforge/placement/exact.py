"""The exact Pareto front of contiguous stage plans: a multi-objective dynamic program over layers.

A stage plan (:mod:`.stages`) is a sequence of at most ``D`` runs ``(device, start, end)`` covering layers
``0..L`` with every device used at most once. The DP walks over the layers: a *state* is
``(s, used, last)`` — layers ``[0, s)`` placed, the set of devices used, the device of the last run — and
a *label* at a state is the partial cost of one way to get there. A transition appends one whole run
``(d, s, e)`` with ``d`` not yet used. Every objective composes monotonically along a plan:

* f1 energy adds up (runs, boundary transfers, the exit transfer; the auxiliary stages are a constant);
* f2 (:func:`hetforge.placement.stages.objectives`, read off the list schedule of the stage chain) is the
  sum of every stage and transfer (``total``, the makespan) or the largest device load (``bottleneck``):
  a device's load is its run + the transfer into it, plus the auxiliary stage(s) and the exit transfer
  when it hosts the embedding or the LM head. A run's device is used once, so its load is final when the
  run is appended (the label keeps the max of those); the loads of the aux hosts stay open until the plan
  ends and are label components of their own;
* f3 = −min stage DASI is the max of −DASI over runs;

so a label that is no worse than another at the same state in every component stays no worse after any
common completion, and the other one can be dropped without losing a front point. Two things the
objectives do not see also decide a completion and therefore join the label as components:

* the bytes each memory pool holds so far (a pool's capacity is a constraint; usage only grows), when
  there is more than one pool;
* the CPQ energy penalty (:func:`hetforge.cost.cpq_penalty`), a function of the *final* pool usage: when
  it can differ between plans (more than one pool and some pool could pass its threshold), the raw energy
  of each such device is kept as its own component (the penalty is monotone in usage, so lower raw
  energy and lower usage stay no worse).

The surviving complete plans are re-evaluated with :func:`hetforge.placement.stages.evaluate` (the same
function PGSAM and brute force use) and filtered once more, so the returned archive holds exactly the
non-dominated feasible plans. Work grows with the plan count; :data:`EXACT_PLAN_BUDGET` is the count up
to which :func:`hetforge.placement.stage_search.search_front` uses this instead of PGSAM (80 layers × 3
devices is 18,963 plans, 32 × 4 is 119,416, 48 × 4 is 416,000 — see ``docs/bench/placement.md`` for
measured solve times).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from hetforge.placement.pareto import Archive
from hetforge.placement.stages import LayerTable, StagePlan, evaluate

EXACT_PLAN_BUDGET = 150_000  # plans; 80 × 3 (18,963) and 32 × 4 (119,416) fit


def count_plans(num_layers: int, num_devices: int) -> int:
    """Distinct contiguous plans: sequences of k ≤ D non-empty runs on distinct devices covering L layers."""
    if num_layers <= 0:
        return 1
    return sum(math.perm(num_devices, k) * math.comb(num_layers - 1, k - 1)
               for k in range(1, min(num_devices, num_layers) + 1))


@dataclass
class ExactResult:
    """The exact front, the number of distinct plans, how many labels the DP kept, and its solve time."""

    archive: Archive
    plans: int
    labels: int
    seconds: float


def _weakly_non_dominated(v: np.ndarray) -> np.ndarray:
    """Indices of rows no other kept row is ≤ in every component (one of several equal rows is kept)."""
    order = np.lexsort(v.T[::-1])  # lexicographic: a row can only be weakly dominated by one sorted before it
    kept: list[int] = []
    kv = np.empty(v.shape)
    for i in order:
        row = v[i]
        n = len(kept)
        if n and np.any(np.all(kv[:n] <= row, axis=1)):
            continue
        kv[n] = row
        kept.append(int(i))
    return np.array(kept, dtype=int)


def exact_front(table: LayerTable) -> ExactResult:
    """The whole non-dominated front of feasible contiguous plans of ``table`` (see module docstring)."""
    t0 = time.perf_counter()
    L, D = table.num_layers, table.num_devices
    plans = count_plans(L, D)
    pools = table.pools()
    P = len(table.capacity)
    # usage is summed layer by layer in layer order, as LayerTable.pool_use does, so a plan that fills a pool
    # exactly is judged feasible here exactly when evaluate() judges it so (a cumsum difference can be an ulp off)
    total_w = 0.0
    for w in table.weight_bytes:
        total_w += float(w)
    # run sums S[s, e, d] over layers [s, e) (cumulated from each start, so an inf layer stays inf)
    def run_sums(x: np.ndarray) -> np.ndarray:
        out = np.zeros((L + 1, L + 1) + x.shape[1:])
        for s in range(L):
            out[s, s + 1:] = np.cumsum(x[s:], axis=0)
        return out

    rt, re_, rw = run_sums(table.time), run_sums(table.energy), run_sums(table.dasi * table.time)
    rd = run_sums(table.dasi)
    # CPQ: penalty fixed per device unless pool usage can vary (several pools) and some pool can pass θ
    pen_fixed = np.ones(D)
    var_dev: list[int] = []
    if table.cpq_threshold is not None:
        r0 = table.resident0 if table.resident0 is not None else np.zeros(P)
        from hetforge.cost import cpq_penalty

        for d in range(D):
            p = pools[d]
            tot = table.capacity[p] + r0[p]
            if tot <= 0:
                continue
            if P == 1:
                pen_fixed[d] = cpq_penalty((total_w + r0[p]) / tot, float(table.cpq_threshold[d]))
            elif cpq_penalty((min(total_w, table.capacity[p]) + r0[p]) / tot, float(table.cpq_threshold[d])) > 1.0:
                var_dev.append(d)
    if P == 1 and total_w > table.capacity[0]:
        return ExactResult(Archive(), plans, 0, time.perf_counter() - t0)
    use_pools = list(range(P)) if P > 1 else []
    bottleneck = table.latency_mode != "total"
    aux_t = [float(x) for x in table.aux_time]
    # bottleneck: the load of the devices hosting the auxiliary stages (entry, exit) is open until the plan
    # ends, so each is a label component; every other device's load is final when its run is appended
    hosts = sorted({x for x in (table.entry, table.exit) if x is not None}) if bottleneck else []
    # label layout: [energy (fixed part), raw energy of each var device, f2, f3, usage of each pool,
    #                load of each aux host]
    nv = len(var_dev)
    i_f2, i_f3 = 1 + nv, 2 + nv
    i_host = {d: 3 + nv + len(use_pools) + j for j, d in enumerate(hosts)}
    k = 3 + nv + len(use_pools) + len(hosts)
    start = np.zeros((1, k))
    if bottleneck:  # aux stages without a device are lanes of their own (see stages.stage_tasks)
        own = [t for i, t in enumerate(aux_t)
               if not (i == 0 and table.entry is not None) and not (i == 1 and table.exit is not None)]
        start[0, i_f2] = max(own, default=0.0)
        if aux_t and table.entry is not None:
            start[0, i_host[table.entry]] += aux_t[0]
        if len(aux_t) > 1 and table.exit is not None:
            start[0, i_host[table.exit]] += aux_t[1]
    else:
        start[0, i_f2] = float(sum(aux_t))
    start[0, i_f3] = -np.inf
    # states: (s, used mask, last) -> list of (values [n, k], parents [n]) chunks; nodes: (parent, d, s, e)
    nodes: list[tuple[int, int, int, int]] = []
    pending: dict[tuple[int, int, int], list[tuple[np.ndarray, np.ndarray]]] = {(0, 0, -1): [(start, np.array([-1]))]}
    finals: list[tuple[np.ndarray, np.ndarray]] = []
    labels = 0
    for s in range(L):
        for key in sorted(kk for kk in pending if kk[0] == s):
            chunks = pending.pop(key)
            vals = np.vstack([c[0] for c in chunks])
            par = np.concatenate([c[1] for c in chunks])
            keep = _weakly_non_dominated(vals)
            vals, par = vals[keep], par[keep]
            labels += len(vals)
            ids = np.arange(len(nodes), len(nodes) + len(vals))
            _, used, last = key
            if key == (0, 0, -1):
                ids = np.array([-1])
            else:
                # par holds encoded (parent id, d, s0, e) rows; materialize survivors as nodes
                for row in par:
                    nodes.append(tuple(int(x) for x in row))
            prev = last if last >= 0 else table.entry
            for d in range(D):
                if used >> d & 1:
                    continue
                es = np.arange(s + 1, L + 1)
                t_run = rt[s, es, d].copy()
                e_xfer = 0.0
                if prev is not None and prev != d:
                    t_run += table.xfer_time[s, prev, d]
                    e_xfer = float(table.xfer_energy[s, prev, d])
                raw = re_[s, es, d]
                w = rt[s, es, d]
                with np.errstate(invalid="ignore", divide="ignore"):
                    dasi = np.where(w > 0, rw[s, es, d] / np.where(w > 0, w, 1.0), rd[s, es, d] / (es - s))
                # exit transfer after the last layer: its own stage and its energy
                ex_t = np.zeros(len(es))
                ex_e = np.zeros(len(es))
                if table.exit is not None and table.exit != d:
                    ex_t[-1] = table.xfer_time[L, d, table.exit]
                    ex_e[-1] = table.xfer_energy[L, d, table.exit]
                n, m = len(vals), len(es)
                new = np.repeat(vals[:, None, :], m, axis=1)  # [n, m, k]
                new[:, :, 0] += e_xfer + ex_e[None, :]
                if d in var_dev:
                    new[:, :, 1 + var_dev.index(d)] += raw[None, :]
                else:
                    new[:, :, 0] += pen_fixed[d] * raw[None, :]
                if bottleneck:
                    if d in i_host:
                        new[:, :, i_host[d]] += t_run[None, :]
                    else:
                        new[:, :, i_f2] = np.maximum(new[:, :, i_f2], t_run[None, :])
                    if table.exit is not None and table.exit != d:
                        new[:, :, i_host[table.exit]] += ex_t[None, :]
                else:
                    new[:, :, i_f2] += t_run[None, :] + ex_t[None, :]
                new[:, :, i_f3] = np.maximum(new[:, :, i_f3], -dasi[None, :])
                ok = np.ones((n, m), dtype=bool)
                if use_pools:
                    j = 3 + nv + use_pools.index(pools[d])
                    acc = vals[:, j].copy()
                    for ei in range(m):  # layer by layer, in the order pool_use adds them (see total_w)
                        acc += table.weight_bytes[s + ei]
                        new[:, ei, j] = acc
                    ok &= new[:, :, j] <= table.capacity[pools[d]]
                dead_end = (used | (1 << d)) == (1 << D) - 1  # no device left for the layers after e
                enc = np.empty((n, m, 4), dtype=np.int64)
                enc[:, :, 0], enc[:, :, 1], enc[:, :, 2], enc[:, :, 3] = ids[:, None], d, s, es[None, :]
                for ei in ([m - 1] if dead_end else range(m)):
                    e = int(es[ei])
                    sel = ok[:, ei]
                    if not sel.all():
                        if not sel.any():
                            continue
                        chunk = (new[sel, ei], enc[sel, ei])
                    else:
                        chunk = (new[:, ei], enc[:, ei])
                    if e == L:
                        if hosts:  # the plan is complete: the aux hosts' loads are final
                            v = chunk[0].copy()
                            v[:, i_f2] = np.maximum(v[:, i_f2], v[:, list(i_host.values())].max(axis=1))
                            chunk = (v, chunk[1])
                        finals.append(chunk)
                    else:
                        pending.setdefault((e, used | (1 << d), d), []).append(chunk)
    arch = Archive()
    if not finals:
        return ExactResult(arch, plans, labels, time.perf_counter() - t0)
    vals = np.vstack([c[0] for c in finals])
    enc = np.vstack([c[1] for c in finals])
    if nv == 0:  # the components are the objectives (+ usage, which no longer matters): filter first
        keep = _weakly_non_dominated(vals[:, [0, i_f2, i_f3]])
        enc = enc[keep]
    for row in enc:
        runs = [(int(row[1]), int(row[2]), int(row[3]))]
        p = int(row[0])
        while p >= 0:
            pp, d, s0, e0 = nodes[p]
            runs.append((d, s0, e0))
            p = pp
        runs.reverse()
        assign = tuple(d for d, s0, e0 in runs for _ in range(s0, e0))
        f = evaluate(table, assign)
        if f is not None:
            order = tuple(d for d, _, _ in runs)
            rest = tuple(x for x in range(D) if x not in order)
            cuts = tuple(e0 for _, _, e0 in runs[:-1]) + (L,) * (D - len(runs))
            arch.offer(assign, f, StagePlan(order + rest, cuts))
    labels += len(vals)
    return ExactResult(arch, plans, labels, time.perf_counter() - t0)
