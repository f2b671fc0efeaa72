"""The modeled timeline of one partitioned run: a list schedule, not a sum.

Each partition call is placed on its device's lane at the earliest time when (a) the device is free and
(b) every input it reads is ready on that device: produced by an earlier partition and, when it crossed
devices, transferred (the transfer starts when its producer ends and takes the cost model's link time).
Devices therefore overlap wherever the partition DAG allows it. A *device switch* — a partition whose
program-order predecessor ran on another device — costs what the SoC profile says it costs to hand work to
that device (the receiving device's ``switch_overhead_us``: dispatch + synchronisation,
:func:`hetforge.cost.transfer.switch_cost_s`), charged on its lane before the call.

Modeled latency of a run = the makespan of this schedule (the end of the last partition or of the final
transfer back to the host). Modeled energy = the partitions' modeled energy + the transfers' link energy
(active energy only; idle power is not charged). Both are *modeled*: the durations come from the cost
model (``RunReport`` calls/transfers carry them), never from host timings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hetforge.backends.partition import PartitionedGraph
from hetforge.cost.transfer import switch_cost_s


@dataclass
class Span:
    """One item on the modeled timeline (seconds from the run's start)."""

    kind: str  # "call" | "transfer" | "switch"
    lane: str  # a device name, or "src->dst" for transfers
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
        return {"makespan_s": self.makespan_s, "energy_j": self.energy_j, "switches": self.switches,
                "switch_s": self.switch_s, "serial_s": self.serial_s, "by_device": self.by_device(),
                "figure": "modeled"}


def schedule_run(pg: PartitionedGraph, report, soc) -> Timeline:
    """List-schedule the calls and transfers of ``report`` (a :class:`~hetforge.hetero.runner.RunReport` of
    ``pg``) on ``soc``'s devices; every duration is the cost model's."""
    host = soc.devices[0].name
    producer = pg.producer()
    xfer = {}  # (value, dst) → TransferRecord
    for t in report.transfers:
        xfer.setdefault((t.value, t.dst), t)
    free: dict[str, float] = {}
    done: dict[str, float] = {}  # value → time it is ready on its producer's device
    ready: dict[tuple[str, str], float] = {}  # (value, device) → time it is ready there
    spans: list[Span] = []
    prev_dev: str | None = None
    switches, switch_total = 0, 0.0
    calls = {c.partition: c for c in report.calls}

    def arrive(value: str, dev: str) -> float:
        key = (value, dev)
        if key in ready:
            return ready[key]
        src_dev = pg.partitions[producer[value]].device if value in producer else host
        t0 = done.get(value, 0.0)
        rec = xfer.get(key)
        if rec is not None and src_dev != dev:
            spans.append(Span("transfer", f"{src_dev}->{dev}", f"{value} ({rec.nbytes} B, {rec.mode})", t0,
                              rec.modeled_s, rec.modeled_j, {"nbytes": rec.nbytes, "mode": rec.mode,
                                                             "src": src_dev, "dst": dev}))
            t0 += rec.modeled_s
        ready[key] = t0
        return t0

    for part in pg.partitions:
        call = calls.get(part.index)
        if call is None:
            continue
        dev = part.device
        start = max([free.get(dev, 0.0)] + [arrive(v, dev) for v in part.inputs])
        if prev_dev is not None and prev_dev != dev:
            sw = switch_cost_s(soc, prev_dev, dev)
            spans.append(Span("switch", dev, f"switch {prev_dev}->{dev}", start, sw))
            start += sw
            switches += 1
            switch_total += sw
        prev_dev = dev
        spans.append(Span("call", dev, f"p{part.index} ({len(part.nodes)} nodes)", start, call.modeled_s,
                          call.modeled_j, {"partition": part.index, "backend": call.backend}))
        end = start + call.modeled_s
        free[dev] = end
        for o in part.outputs:
            done[o] = end
            ready[(o, dev)] = end
    end = max([s.end_s for s in spans] + [0.0])
    for t in report.transfers:  # outputs brought back to the host after the last call
        if t.dst == host and (t.value, host) not in ready:
            arrive(t.value, host)
    makespan = max([s.end_s for s in spans] + [end])
    energy = sum(s.energy_j for s in spans)
    serial = sum(s.dur_s for s in spans)
    return Timeline(spans, makespan, energy, switches, switch_total, serial)
