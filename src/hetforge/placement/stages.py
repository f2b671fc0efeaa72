"""Decoder-layer placement as contiguous stages: the state space the exact DP, PGSAM and brute force share.

A plan is an *ordered device list* plus a *boundary vector*: ``order = (d0, d1, d2)`` and
``cuts = (c1, c2)`` with ``0 <= c1 <= c2 <= L`` put layers ``[0, c1)`` on ``d0``, ``[c1, c2)`` on ``d1``
and ``[c2, L)`` on ``d2``. Equal cuts leave a stage empty, so one- and two-device plans are in the space.
Contiguity keeps transfers to the stage boundaries (QEIL v2's boundary-vector state).

Objectives (all minimized), computed from a :class:`LayerTable`:

* ``f1`` energy: per-layer energy on its device + transfer energy at every device change + the fixed
  auxiliary stages (embedding, LM head);
* ``f2`` latency, read off the one modeled timeline (:mod:`hetforge.cost.timeline`, the list schedule the
  runtime reports too) of the plan's stage chain (:func:`stage_tasks`): ``bottleneck`` (default) is the
  pipelined period — the load of the most loaded device: its runs, the auxiliary stages it hosts and the
  transfers into it (QEIL v2's bottleneck, with devices rather than stages as the resource);
  ``latency_mode="total"`` is the makespan, the latency of one request;
* ``f3`` = −min over non-empty decoder stages of the stage DASI (time-weighted mean of its layers' DASI),
  so under-utilized stages are penalized (the fixed auxiliary stages are left out: they would pin it).

A plan whose layers' weights exceed a device's capacity is infeasible (``evaluate`` returns None).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from hetforge.cost.timeline import Task, list_schedule
from hetforge.placement.pareto import Archive


@dataclass
class LayerTable:
    """Per-layer, per-device costs: everything the stage search needs, no graph.

    ``xfer_time[l, a, b]`` is the time to move the input of layer ``l`` (``l == L``: the LM head's input)
    from device ``a`` to device ``b``; zero on the diagonal.
    """

    devices: list[str]
    time: np.ndarray  # [L, D] seconds
    energy: np.ndarray  # [L, D] joules
    dasi: np.ndarray  # [L, D] in [0, 1]
    weight_bytes: np.ndarray  # [L]
    capacity: np.ndarray  # [P] bytes of each memory pool available to decoder layers
    xfer_time: np.ndarray  # [L + 1, D, D]
    xfer_energy: np.ndarray  # [L + 1, D, D]
    entry: int | None = None  # device index that produces layer 0's input (embedding stage)
    exit: int | None = None  # device index that consumes the last layer's output (LM head stage)
    aux_time: tuple[float, ...] = ()  # times of the auxiliary stages (enter f2 as stages)
    aux_energy: float = 0.0  # their energy (enters f1)
    aux_dasi: tuple[float, ...] = ()
    pool: np.ndarray | None = None  # [D] memory pool of each device (None: one pool per device)
    resident0: np.ndarray | None = None  # [P] bytes already resident in each pool (aux stages, activations)
    cpq_threshold: np.ndarray | None = None  # [D] CPQ thresholds; None: no memory-pressure penalty
    latency_mode: str = "bottleneck"  # f2: "bottleneck" (slowest stage, pipelined) or "total" (one request)

    def pools(self) -> np.ndarray:
        return self.pool if self.pool is not None else np.arange(self.num_devices)

    def pool_use(self, assign: tuple[int, ...]) -> np.ndarray:
        """Bytes of decoder-layer weights each pool holds under ``assign``."""
        used = np.zeros(len(self.capacity))
        pools = self.pools()
        for li, d in enumerate(assign):
            used[pools[d]] += self.weight_bytes[li]
        return used

    def penalties(self, assign: tuple[int, ...]) -> np.ndarray:
        """QEIL v2's CPQ energy penalty per device (1 where no thresholds are given)."""
        if self.cpq_threshold is None:
            return np.ones(self.num_devices)
        from hetforge.cost import cpq_penalty

        used = self.pool_use(assign)
        r0 = self.resident0 if self.resident0 is not None else np.zeros(len(self.capacity))
        pools = self.pools()
        out = np.ones(self.num_devices)
        for d in range(self.num_devices):
            p = pools[d]
            total = self.capacity[p] + r0[p]
            out[d] = cpq_penalty((used[p] + r0[p]) / total, float(self.cpq_threshold[d])) if total > 0 else 1.0
        return out

    @property
    def num_layers(self) -> int:
        return int(self.time.shape[0])

    @property
    def num_devices(self) -> int:
        return int(self.time.shape[1])


@dataclass(frozen=True)
class StagePlan:
    """An ordered device list (indices into ``LayerTable.devices``) and a sorted boundary vector."""

    order: tuple[int, ...]
    cuts: tuple[int, ...]

    def assignment(self, num_layers: int) -> tuple[int, ...]:
        edges = (0, *self.cuts, num_layers)
        out: list[int] = []
        for j, d in enumerate(self.order):
            out.extend([d] * (edges[j + 1] - edges[j]))
        return tuple(out)


def stages_of(assign: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Maximal runs ``(device, start, end)`` of a layer → device assignment."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for d in itertools.groupby(assign):
        n = sum(1 for _ in d[1])
        runs.append((d[0], start, start + n))
        start += n
    return runs


def overflow(table: LayerTable, assign: tuple[int, ...]) -> float:
    """Bytes by which the most over-full memory pool exceeds its capacity (0 when the plan fits)."""
    return float(max(0.0, np.max(table.pool_use(assign) - table.capacity)))


def evaluate(table: LayerTable, assign: tuple[int, ...]) -> tuple[float, float, float] | None:
    """``(f1 energy, f2 bottleneck latency, f3 -min DASI)`` of a layer assignment, None if it does not fit."""
    if overflow(table, assign) > 0:
        return None
    return objectives(table, assign)


def stage_tasks(table: LayerTable, assign: tuple[int, ...],
                runs: list[tuple[int, int, int]] | None = None) -> list[Task]:
    """The stage plan as a chain of :class:`~hetforge.cost.timeline.Task` s: embedding, then per run its
    incoming boundary transfer (the table folds the receiving device's switch cost into it) and its layers,
    the exit transfer, the LM head. Auxiliary stages run on the ``entry``/``exit`` devices (on lanes of their
    own when the table names none)."""
    devs = table.devices
    pen = table.penalties(assign)
    aux = list(table.aux_time)
    tasks: list[Task] = []

    def add(task: Task) -> None:
        tasks.append(task)

    def after() -> tuple[int, ...]:
        return (len(tasks) - 1,) if tasks else ()

    if aux:
        add(Task("call", devs[table.entry] if table.entry is not None else "embed", "embedding", float(aux[0])))
    prev = table.entry
    for d, s, e in runs if runs is not None else stages_of(assign):
        if prev is not None and prev != d:
            add(Task("transfer", f"{devs[prev]}->{devs[d]}", f"input of layer {s}", float(table.xfer_time[s, prev, d]),
                     float(table.xfer_energy[s, prev, d]), after(), dst=devs[d]))
        add(Task("call", devs[d], f"layers {s}-{e - 1}", float(table.time[s:e, d].sum()),
                 float(table.energy[s:e, d].sum()) * pen[d], after()))
        prev = d
    L = table.num_layers
    if table.exit is not None and prev is not None and prev != table.exit:
        add(Task("transfer", f"{devs[prev]}->{devs[table.exit]}", "input of the LM head",
                 float(table.xfer_time[L, prev, table.exit]), float(table.xfer_energy[L, prev, table.exit]),
                 after(), dst=devs[table.exit]))
    for i, t in enumerate(aux[1:]):
        lane = devs[table.exit] if table.exit is not None and i == 0 else ("head" if i == 0 else f"aux{i + 1}")
        add(Task("call", lane, "LM head" if i == 0 else f"auxiliary stage {i + 1}", float(t), 0.0, after()))
    return tasks


def objectives(table: LayerTable, assign: tuple[int, ...]) -> tuple[float, float, float]:
    """The three objectives, whether or not the plan fits in memory; f2 is read off the list schedule of
    :func:`stage_tasks` (:func:`hetforge.cost.timeline.list_schedule`): its makespan (``total``) or its
    bottleneck, the most loaded device (``bottleneck``)."""
    runs = stages_of(assign)
    tl = list_schedule(stage_tasks(table, assign, runs))
    dasis: list[float] = []  # decoder stages only: the fixed auxiliary stages would pin the minimum
    for d, s, e in runs:
        w = table.time[s:e, d]
        ds = table.dasi[s:e, d]
        dasis.append(float((ds * w).sum() / w.sum()) if w.sum() > 0 else float(ds.mean()))
    f2 = tl.makespan_s if table.latency_mode == "total" else tl.bottleneck_s
    return table.aux_energy + tl.energy_j, f2, -min(dasis)


def all_plans(num_layers: int, num_devices: int):
    """Every (ordered device list, boundary vector) pair: the whole search space."""
    for order in itertools.permutations(range(num_devices)):
        for cuts in itertools.combinations_with_replacement(range(num_layers + 1), num_devices - 1):
            yield StagePlan(order, cuts)


def exhaustive_front(table: LayerTable) -> tuple[Archive, int]:
    """The exact Pareto front by enumerating every distinct assignment; also the count of distinct plans."""
    arch = Archive()
    seen: set[tuple[int, ...]] = set()
    for plan in all_plans(table.num_layers, table.num_devices):
        a = plan.assignment(table.num_layers)
        if a in seen:
            continue
        seen.add(a)
        f = evaluate(table, a)
        if f is not None:
            arch.offer(a, f, plan)
    return arch, len(seen)
