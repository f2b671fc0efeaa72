"""The modeled timeline of one partitioned run: a list schedule, not a sum.

Each partition call is placed on its device's lane at the earliest time when (a) the device is free and
(b) every input it reads is ready on that device: produced by an earlier partition and, when it crossed
devices, transferred (the transfer starts when its producer ends and takes the cost model's link time).
Devices therefore overlap wherever the partition DAG allows it. A *device switch* — a partition whose
program-order predecessor ran on another device — costs what the SoC profile says it costs to hand work to
that device (the receiving device's ``switch_overhead_us``: dispatch + synchronisation,
:func:`hetforge.cost.transfer.switch_cost_s`), charged on its lane before the call.

The schedule itself is :func:`hetforge.cost.timeline.list_schedule` — the same one the stage-plan search
of placement minimizes — so a run's reported latency, its trace and PGSAM's objective come from one model.

Modeled latency of a run = the makespan of this schedule (the end of the last partition or of the final
transfer back to the host). Modeled energy = the partitions' modeled energy + the transfers' link energy
(active energy only; idle power is not charged). Both are *modeled*: the durations come from the cost
model (``RunReport`` calls/transfers carry them), never from host timings.
"""

from __future__ import annotations

from hetforge.backends.partition import PartitionedGraph
from hetforge.cost.timeline import Span, Task, Timeline, list_schedule
from hetforge.cost.transfer import switch_cost_s

__all__ = ["Span", "Timeline", "schedule_run"]


def schedule_run(pg: PartitionedGraph, report, soc) -> Timeline:
    """List-schedule the calls and transfers of ``report`` (a :class:`~hetforge.hetero.runner.RunReport` of
    ``pg``) on ``soc``'s devices; every duration is the cost model's."""
    host = soc.devices[0].name
    producer = pg.producer()
    xfer = {}  # (value, dst) → TransferRecord
    for t in report.transfers:
        xfer.setdefault((t.value, t.dst), t)
    tasks: list[Task] = []
    made: dict[str, int] = {}  # value → index of the call task that produced it
    ready: dict[tuple[str, str], tuple[int, ...]] = {}  # (value, device) → tasks after which it is there
    prev_dev: str | None = None
    calls = {c.partition: c for c in report.calls}

    def arrive(value: str, dev: str) -> tuple[int, ...]:
        key = (value, dev)
        if key in ready:
            return ready[key]
        src_dev = pg.partitions[producer[value]].device if value in producer else host
        deps = (made[value],) if value in made else ()
        rec = xfer.get(key)
        if rec is not None and src_dev != dev:
            tasks.append(Task("transfer", f"{src_dev}->{dev}", f"{value} ({rec.nbytes} B, {rec.mode})",
                              rec.modeled_s, rec.modeled_j, deps, dst=dev,
                              args={"nbytes": rec.nbytes, "mode": rec.mode, "src": src_dev, "dst": dev}))
            deps = (len(tasks) - 1,)
        ready[key] = deps
        return deps

    for part in pg.partitions:
        call = calls.get(part.index)
        if call is None:
            continue
        dev = part.device
        deps = tuple(i for v in part.inputs for i in arrive(v, dev))
        if prev_dev is not None and prev_dev != dev:
            tasks.append(Task("switch", dev, f"switch {prev_dev}->{dev}", switch_cost_s(soc, prev_dev, dev),
                              deps=deps))
            deps = (len(tasks) - 1,)
        prev_dev = dev
        tasks.append(Task("call", dev, f"p{part.index} ({len(part.nodes)} nodes)", call.modeled_s, call.modeled_j,
                          deps, args={"partition": part.index, "backend": call.backend}))
        for o in part.outputs:
            made[o] = len(tasks) - 1
            ready[(o, dev)] = (len(tasks) - 1,)
    for t in report.transfers:  # outputs brought back to the host after the last call
        if t.dst == host and (t.value, host) not in ready:
            arrive(t.value, host)
    return list_schedule(tasks)
