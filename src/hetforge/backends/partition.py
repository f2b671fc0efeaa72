"""The unit a backend compiles: one device's consecutive run of nodes as its own GraphModule.

:class:`Partition` and :class:`PartitionedGraph` are made by :mod:`hetforge.hetero` (from a lowered
program, :func:`hetforge.hetero.program.partition_program`) and compiled by a :class:`~hetforge.backends.base.Backend`;
they live here, below both, so the backends do not import the orchestration layer above them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx


@dataclass
class Partition:
    """One device's consecutive run of nodes, as its own GraphModule."""

    index: int
    device: str
    nodes: list[str]  # original node names, in order
    gm: fx.GraphModule  # placeholders = ``inputs`` in order; returns tuple(``outputs``)
    inputs: list[str]  # original value names read (graph inputs or earlier partitions' outputs)
    outputs: list[str]  # original value names produced here and read later
    weights: list[str]  # get_attr targets read
    # a step program's binding (runtime.executors.StepBinding), for a backend that takes one (Backend.binds_steps):
    # its outputs in memory the next call overwrites, and input position → the tensor every call passes there
    reuse_outputs: bool = False
    pinned: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"p{self.index}:{self.device}"

    def input_metas(self) -> list[torch.Tensor | object]:
        """The ``meta['val']`` (fake tensors) of the partition's placeholders."""
        return [n.meta.get("val") for n in self.gm.graph.nodes if n.op == "placeholder"]

    def compute_nodes(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "call_function"]

    def weight_bytes(self) -> int:
        total = 0
        for target in self.weights:
            t = fetch_attr(self.gm, target)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
        return total


@dataclass
class PartitionedGraph:
    """The partitions in execution order, and how to wire graph inputs and outputs through them."""

    partitions: list[Partition]
    graph_inputs: list[str]  # placeholder names, in the graph's order
    output_args: object  # the output node's args[0] with nodes replaced by their names
    out_spec: object | None  # pytree spec of the original GraphModule's output, if any
    source: fx.GraphModule | None  # the graph cut (None when rebuilt from a Program)
    fixups: list[str] = field(default_factory=list)

    @property
    def switches(self) -> int:
        """Device switches: partition boundaries where the device changes (consecutive partitions differ)."""
        return max(0, len(self.partitions) - 1)

    def devices(self) -> list[str]:
        return list(dict.fromkeys(p.device for p in self.partitions))

    def producer(self) -> dict[str, int]:
        """Value name → index of the partition producing it (graph inputs are absent)."""
        return {o: p.index for p in self.partitions for o in p.outputs}


def fetch_attr(gm: fx.GraphModule, target: str):
    """The attribute a ``get_attr`` target names (dotted path) on ``gm``."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
