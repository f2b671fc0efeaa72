"""From a placed graph to scheduled partitions: ``lower`` → ``schedule`` → :func:`partition_program`.

This is the path ``hetforge compile`` takes (so hand-made placements in tests and benchmarks run exactly what a
plan file would); ``scheduled=False`` keeps the graph's own order, to measure what scheduling saves.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from hetforge.backends.partition import PartitionedGraph
from hetforge.hetero.program import partition_program


@dataclass
class PlacedPartitions:
    """Partitions plus the figures of the steps that made them."""

    partitions: PartitionedGraph
    program: object  # the (scheduled) hetforge.ir.Program
    naive_switches: int
    scheduled_switches: int
    lowered_transfers: int


def partitions_from_placement(gm: fx.GraphModule, assignment: dict[str, str], soc, scheduled: bool = True,
                              name: str = "model") -> PlacedPartitions:
    """Lower ``gm`` under ``assignment`` for ``soc``, schedule it (unless ``scheduled=False``), and partition."""
    from hetforge.lower import lower
    from hetforge.schedule import schedule

    low = lower(gm, assignment, soc, name=name)
    prog = low.program
    res = schedule(prog)
    if scheduled:
        prog = res.program
    return PlacedPartitions(partition_program(prog), prog, res.naive_switches, res.scheduled_switches,
                            low.report.transfers)
