"""Run partitions on their devices' backends, in order, with real, timed and counted transfers.

``build(pg, soc, bindings)`` compiles every partition on the backend its device is bound to (after checking
that every needed backend is available, so a missing one is named before any work is done) and attaches the
cost model's prediction for that partition on the SoC device (modeled). ``HeteroExecutable.run(inputs)``
then, for each partition in order (one backend call per partition):

1. brings each input value to the partition's device: a value produced on another device is *transferred*
   once per (value, destination) — a zero-copy hand-off when both backends address the same memory and the
   SoC link is unified, a real copy otherwise (``clone`` on the host stands in for the DMA/staging copy a
   non-unified link implies; ``.to()`` across memories is the real copy);
2. calls the backend (measured) and records the call.

Graph inputs start on the SoC's first device (the CPU); graph outputs are brought back to it and copied out of
any backend buffer that the next call would overwrite. Every figure in the :class:`RunReport` is labelled
measured (this host) or modeled (the SoC's cost model).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hetforge.backends.base import BackendUnavailable, CompiledPartition
from hetforge.backends.mapping import Binding
from hetforge.backends.partition import Partition, PartitionedGraph
from hetforge.errors import UsageError
from hetforge.trace import MEASURED, MODELED, Trace


@dataclass
class CallRecord:
    """One backend call: a partition run on its device."""

    partition: int
    device: str
    backend: str
    nodes: int
    start_s: float  # measured, from the start of the run
    measured_s: float
    modeled_s: float
    modeled_j: float


@dataclass
class TransferRecord:
    """One value moved between devices (or handed over zero-copy)."""

    value: str
    src: str
    dst: str
    nbytes: int
    mode: str  # "copy" | "zero-copy"
    start_s: float
    measured_s: float
    modeled_s: float
    modeled_j: float


@dataclass
class RunReport:
    """What one run did. ``wall_s`` and ``*_measured_s`` are measured here; ``*_modeled_*`` come from the cost model."""

    wall_s: float
    calls: list[CallRecord] = field(default_factory=list)
    transfers: list[TransferRecord] = field(default_factory=list)
    output_copies: int = 0
    pg: Any = field(default=None, repr=False)  # the PartitionedGraph and SoC that ran: for the modeled timeline
    soc: Any = field(default=None, repr=False)
    _timeline: Any = field(default=None, repr=False)

    def timeline(self):
        """The modeled list schedule of this run (:mod:`hetforge.hetero.timeline`), made on first use."""
        if self._timeline is None:
            from hetforge.hetero.timeline import schedule_run

            self._timeline = schedule_run(self.pg, self, self.soc)
        return self._timeline

    @property
    def switches(self) -> int:
        return sum(1 for a, b in zip(self.calls, self.calls[1:], strict=False) if a.device != b.device)

    def summary(self) -> dict[str, Any]:
        copies = [t for t in self.transfers if t.mode == "copy"]
        by_device: dict[str, dict[str, float]] = {}
        for c in self.calls:
            d = by_device.setdefault(c.device, {"calls": 0, "measured_s": 0.0, "modeled_s": 0.0, "modeled_j": 0.0})
            d["calls"] += 1
            d["measured_s"] += c.measured_s
            d["modeled_s"] += c.modeled_s
            d["modeled_j"] += c.modeled_j
        return {
            "wall_measured_s": self.wall_s,
            "calls": len(self.calls),
            "switches": self.switches,
            "transfers": len(self.transfers),
            "transfer_copies": len(copies),
            "transfer_zero_copy": len(self.transfers) - len(copies),
            "transfer_bytes_copied": sum(t.nbytes for t in copies),
            "transfer_measured_s": sum(t.measured_s for t in self.transfers),
            "calls_measured_s": sum(c.measured_s for c in self.calls),
            "overhead_measured_s": self.wall_s - sum(c.measured_s for c in self.calls)
            - sum(t.measured_s for t in self.transfers),
            "modeled_s": self.timeline().makespan_s,  # list-scheduled: devices overlap where the DAG allows
            "modeled_serial_s": sum(c.modeled_s for c in self.calls) + sum(t.modeled_s for t in self.transfers),
            "modeled_switch_s": self.timeline().switch_s,
            "modeled_bottleneck_s": self.timeline().bottleneck_s,  # the most loaded device (pipelined period)
            "modeled_j": sum(c.modeled_j for c in self.calls) + sum(t.modeled_j for t in self.transfers),
            "by_device": by_device,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "calls": [asdict(c) for c in self.calls],
                "transfers": [asdict(t) for t in self.transfers], "output_copies": self.output_copies}


@dataclass
class PartitionCost:
    """Cost-model prediction for one call of a partition on its SoC device (modeled)."""

    time_s: float
    energy_j: float
    unknown_ops: list[str]


def partition_cost(part: Partition, device) -> PartitionCost:
    """Sum of the cost model's per-op predictions over the partition's nodes on ``device`` (modeled)."""
    from hetforge.cost import estimate

    t = e = 0.0
    unknown: list[str] = []
    for n in part.compute_nodes():
        c = estimate(n, device)
        t += c.time_s
        e += c.energy_j
        if not c.known:
            unknown.append(c.op)
    return PartitionCost(t, e, sorted(set(unknown)))


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _sync(*memories: str) -> None:
    if any(m.startswith("cuda") for m in memories):
        torch.cuda.synchronize()


class HeteroExecutable:
    """Compiled partitions bound to backends; call :meth:`run` with the graph's inputs."""

    def __init__(self, pg: PartitionedGraph, soc, bindings: dict[str, Binding], compiled: list[CompiledPartition],
                 costs: list[PartitionCost]):
        self.pg = pg
        self.soc = soc
        self.bindings = bindings
        self.compiled = compiled
        self.costs = costs
        self.host = soc.devices[0].name
        self._direct: Any = None  # run()'s plan for one host partition reading graph inputs only (made on first run)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self.run(inputs)[0]

    def _move(self, value: Any, name: str, src: str, dst: str, start: float) -> tuple[Any, TransferRecord | None]:
        if not isinstance(value, torch.Tensor) or src == dst:
            return value, None
        sb, db = self.bindings[src].backend, self.bindings[dst].backend
        link = self.soc.link(src, dst)
        _sync(sb.memory, db.memory)
        t0 = time.perf_counter()
        if sb.memory != db.memory:
            out, mode = db.to_memory(value), "copy"
        elif link.unified:
            out, mode = value, "zero-copy"
        else:
            out, mode = value.clone(memory_format=torch.contiguous_format), "copy"
        _sync(sb.memory, db.memory)
        dt = time.perf_counter() - t0
        from hetforge.cost import transfer_cost

        nbytes = _nbytes(value)
        ms, mj = transfer_cost(nbytes, link)
        return out, TransferRecord(name, src, dst, nbytes, mode, t0 - start, dt, ms, mj)

    def run(self, inputs: tuple[Any, ...] | list[Any], trace: Trace | None = None,
            copy_aliased: bool = True) -> tuple[Any, RunReport]:
        """Run all partitions once; return (outputs, report). An output a backend keeps in memory its next call
        overwrites (``outputs_alias``) is returned as a copy, unless ``copy_aliased`` is False (a caller that takes
        the outputs before the next call: a decode step)."""
        pg = self.pg
        if len(inputs) != len(pg.graph_inputs):
            raise ValueError(f"expected {len(pg.graph_inputs)} inputs ({', '.join(pg.graph_inputs)}), "
                             f"got {len(inputs)}")
        if self._direct is None:
            self._direct = self._direct_plan() or False
        if self._direct:
            return self._run_direct(inputs, trace, copy_aliased)
        start = time.perf_counter()
        report = RunReport(0.0, pg=pg, soc=self.soc)
        where: dict[str, str] = {}  # value → device it was produced on
        values: dict[str, Any] = {}
        for name, x in zip(pg.graph_inputs, inputs, strict=True):
            values[name] = x
            where[name] = self.host
        moved: dict[tuple[str, str], Any] = {}
        for part, comp, cost in zip(pg.partitions, self.compiled, self.costs, strict=True):
            args = []
            for name in part.inputs:
                key = (name, part.device)
                if key not in moved:
                    v, rec = self._move(values[name], name, where[name], part.device, start)
                    moved[key] = v
                    if rec is not None:
                        report.transfers.append(rec)
                args.append(moved[key])
            t0 = time.perf_counter()
            outs, measured = comp.run(args)
            report.calls.append(CallRecord(part.index, part.device, comp.backend, len(part.nodes), t0 - start,
                                           measured, cost.time_s, cost.energy_j))
            for name, o in zip(part.outputs, outs, strict=True):
                values[name] = o
                where[name] = part.device
                moved[(name, part.device)] = o
        producer = pg.producer()
        aliasing = {p.index for p, c in zip(pg.partitions, self.compiled, strict=True)
                    if copy_aliased and getattr(c, "outputs_alias", False)}
        final: dict[str, Any] = {}
        for name in pytree.tree_leaves(pg.output_args):
            if not isinstance(name, str) or name in final:
                continue
            v, rec = self._move(values[name], name, where[name], self.host, start)
            if rec is not None:
                report.transfers.append(rec)
            if isinstance(v, torch.Tensor) and rec is None and producer.get(name) in aliasing:
                v = v.clone()
                report.output_copies += 1
            final[name] = v
        out = pytree.tree_map(lambda a: final.get(a, a) if isinstance(a, str) else a, pg.output_args)
        return self._finish(out, report, start, trace)

    def _finish(self, out: Any, report: RunReport, start: float, trace: Trace | None) -> tuple[Any, RunReport]:
        """Both paths' end: the outputs in the graph's structure, the report's wall time, the trace."""
        if self.pg.out_spec is not None:
            out = pytree.tree_unflatten(list(out), self.pg.out_spec)
        elif isinstance(out, (list, tuple)) and len(out) == 1:
            out = out[0]  # no output spec recorded: one output comes back bare, as the executor does
        report.wall_s = time.perf_counter() - start
        if trace is not None:
            record_trace(trace, report)
        return out, report

    def _direct_plan(self) -> tuple | None:
        """For a program that is one partition on the host reading only graph inputs (a host-only decode step):
        the positions of its arguments among the graph inputs, and per output leaf where it comes from. Nothing
        moves in such a run, so :meth:`_run_direct` skips the per-value bookkeeping of the general path (a decode
        step of llama-110m passes 26 values). None for any other program."""
        pg = self.pg
        if len(pg.partitions) != 1 or pg.partitions[0].device != self.host:
            return None
        part = pg.partitions[0]
        at = {name: i for i, name in enumerate(pg.graph_inputs)}
        if any(n not in at for n in part.inputs):
            return None
        made = {n: k for k, n in enumerate(part.outputs)}
        leaves, spec = pytree.tree_flatten(pg.output_args)
        picks = []
        for a in leaves:
            if not isinstance(a, str):
                picks.append(("const", a))
            elif a in made:
                picks.append(("out", made[a]))
            elif a in at:
                picks.append(("in", at[a]))
            else:
                return None
        return [at[n] for n in part.inputs], picks, spec

    def _run_direct(self, inputs: tuple[Any, ...] | list[Any], trace: Trace | None,
                    copy_aliased: bool) -> tuple[Any, RunReport]:
        """:meth:`run` for a :meth:`_direct_plan` program: the same outputs and report (one call, no transfers)."""
        pg, comp, cost = self.pg, self.compiled[0], self.costs[0]
        part = pg.partitions[0]
        order, picks, spec = self._direct
        start = time.perf_counter()
        report = RunReport(0.0, pg=pg, soc=self.soc)
        t0 = time.perf_counter()
        outs, measured = comp.run([inputs[j] for j in order])
        report.calls.append(CallRecord(part.index, part.device, comp.backend, len(part.nodes), t0 - start,
                                       measured, cost.time_s, cost.energy_j))
        copy = copy_aliased and getattr(comp, "outputs_alias", False)
        copies: dict[int, Any] = {}
        vals = []
        for kind, k in picks:
            if kind == "in":
                vals.append(inputs[k])
            elif kind == "const":
                vals.append(k)
            elif copy and isinstance(outs[k], torch.Tensor):  # one copy per output, as the general path's
                if k not in copies:
                    copies[k] = outs[k].clone()
                    report.output_copies += 1
                vals.append(copies[k])
            else:
                vals.append(outs[k])
        return self._finish(pytree.tree_unflatten(vals, spec), report, start, trace)


def record_trace(trace: Trace, report: RunReport, offset_s: float = 0.0, modeled_offset_s: float | None = None,
                 label: str = "") -> float:
    """Add one run to ``trace``: measured lanes (this host) at their real times, and the modeled lanes from the
    run's list schedule (one lane per device, switches, transfers as flows between device lanes). Returns the
    modeled end time (to lay the next run after it)."""
    mproc, cproc = "measured (this host)", f"modeled ({report.soc.name} cost model)"
    cursor = offset_s if modeled_offset_s is None else modeled_offset_s
    prefix = f"{label} " if label else ""
    for c in report.calls:
        trace.span(mproc, f"{c.device} [{c.backend}]", f"{prefix}p{c.partition}", offset_s + c.start_s, c.measured_s,
                   MEASURED, "call", device=c.device, backend=c.backend)
    prev = None
    for c in sorted(report.calls, key=lambda c: c.start_s):
        if prev is not None and prev != c.device:
            trace.instant(mproc, "switches", f"switch {prev}->{c.device}", offset_s + c.start_s, MEASURED)
        prev = c.device
    for t in report.transfers:
        trace.span(mproc, "transfers", f"{t.value} {t.src}->{t.dst} ({t.mode}, {t.nbytes} B)", offset_s + t.start_s,
                   t.measured_s, MEASURED, "transfer", nbytes=t.nbytes, mode=t.mode)
    tl = report.timeline()
    for s in tl.spans:
        if s.kind == "transfer":
            trace.flow(cproc, s.args["src"], s.args["dst"], s.name, cursor + s.start_s, cursor + s.end_s,
                       len(trace.events), MODELED, nbytes=s.args["nbytes"], energy_j=s.energy_j)
        elif s.kind == "switch":
            trace.instant(cproc, "switches", s.name, cursor + s.start_s, MODELED)
            trace.span(cproc, s.lane, s.name, cursor + s.start_s, s.dur_s, MODELED, "switch")
        else:
            trace.span(cproc, s.lane, f"{prefix}{s.name}", cursor + s.start_s, s.dur_s, MODELED, "call",
                       energy_j=s.energy_j)
    return cursor + tl.makespan_s


@dataclass
class BuildReport:
    """Per-partition compile results (measured seconds) and modeled cost."""

    partitions: list[dict[str, Any]]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"partitions": self.partitions, "compile_measured_s": self.seconds}


def build(pg: PartitionedGraph, soc, bindings: dict[str, Binding],
          costs_given: list[PartitionCost] | None = None) -> tuple[HeteroExecutable, BuildReport]:
    """Compile every partition on its device's backend; name a missing backend before compiling anything.
    ``costs_given``: the partitions' modeled costs when already known (a compile-cache entry keeps them)."""
    for dev in pg.devices():
        if dev not in bindings:
            raise UsageError(f"partition device '{dev}' is not a device of SoC '{soc.name}' "
                             f"({', '.join(soc.device_names)})")
        try:
            bindings[dev].backend.check_available()
        except BackendUnavailable as e:
            n = sum(1 for p in pg.partitions if p.device == dev)
            raise BackendUnavailable(f"{n} partition(s) run on device '{dev}', bound to backend "
                                     f"'{bindings[dev].spec}': {e}") from None
    t0 = time.perf_counter()
    compiled = [bindings[part.device].backend.compile(part) for part in pg.partitions]
    return assemble(pg, soc, bindings, compiled, costs_given, t0)


def assemble(pg: PartitionedGraph, soc, bindings: dict[str, Binding], compiled: list[CompiledPartition],
             costs_given: list[PartitionCost] | None, t0: float) -> tuple[HeteroExecutable, BuildReport]:
    """The executable and its build report from partitions compiled already (by :func:`build`, or rebuilt by
    the compile cache); ``t0``: when compiling started (perf_counter)."""
    costs, rows = [], []
    if costs_given is not None and len(costs_given) != len(pg.partitions):
        costs_given = None
    for part, comp in zip(pg.partitions, compiled, strict=True):
        cost = costs_given[len(costs)] if costs_given else partition_cost(part, soc.device(part.device))
        costs.append(cost)
        rows.append({"partition": part.index, "device": part.device, "backend": comp.backend,
                     "target": comp.report.target, "nodes": len(part.nodes), "inputs": len(part.inputs),
                     "outputs": len(part.outputs), "compile_measured_s": comp.report.seconds,
                     "modeled_s": cost.time_s, "modeled_j": cost.energy_j, "notes": comp.report.notes})
    return HeteroExecutable(pg, soc, bindings, compiled, costs), BuildReport(rows, time.perf_counter() - t0)
