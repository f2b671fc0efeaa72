"""Whole-graph cost: every ``call_function`` node of an FX graph costed on every device of an SoC.

Totals are plain sums over nodes on one device (no overlap, no transfers): the single-device program time.
CPQ uses ``resident = parameter bytes of the graph + the op's own bytes`` on each device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from hetforge.cost.model import OpCost, estimate
from hetforge.hardware.profile import SocProfile


@dataclass
class NodeCost:
    """One graph node's predicted cost on each device (``supported[d]`` False: the device cannot run it)."""

    node: str
    op: str
    costs: dict[str, OpCost]
    supported: dict[str, bool]
    layer: str = "(graph)"

    def to_dict(self) -> dict:
        return {"node": self.node, "op": self.op, "layer": self.layer, "supported": self.supported,
                "costs": {d: c.to_dict() for d, c in self.costs.items()}}


@dataclass
class GraphCost:
    soc: str
    nodes: list[NodeCost]
    param_bytes: float
    unknown_ops: list[str] = field(default_factory=list)

    def total_time(self, device: str) -> float:
        return sum(n.costs[device].time_s for n in self.nodes)

    def total_energy(self, device: str) -> float:
        return sum(n.costs[device].energy_j for n in self.nodes)

    def total_flops(self) -> float:
        return sum(next(iter(n.costs.values())).flops for n in self.nodes)


def param_bytes(gm: torch.fx.GraphModule) -> float:
    """Bytes of every parameter and buffer the graph reads through ``get_attr``."""
    total = 0.0
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            v = gm
            for part in str(n.target).split("."):
                v = getattr(v, part, None)
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


_LAYER = re.compile(r"^(.*?\.(?:layers|layer|h|blocks|block)\.\d+)(?:\.|$)")


def layer_of(node: torch.fx.Node) -> str:
    """The model layer a node comes from (``layers.3``, ``h.0``, ``embed_tokens``…) from ``nn_module_stack``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "(graph)"
    path = list(stack.values())[-1][0]
    path = re.sub(r"^(model\.)+", "", str(path))
    m = _LAYER.match(path)
    if m:
        return m.group(1)
    return path or "(model)"


def analyze(gm: torch.fx.GraphModule, soc: SocProfile, temp_c: float | None = None) -> GraphCost:
    """Cost every ``call_function`` node of ``gm`` on every device of ``soc``."""
    from hetforge.frontend import op_name

    pbytes = param_bytes(gm)
    unknown: set[str] = set()
    nodes = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        costs = {}
        for d in soc.devices:
            c = estimate(n, d, temp_c)
            if c.bytes or c.flops:
                c = estimate(n, d, temp_c, resident_bytes=pbytes + c.bytes)
            costs[d.name] = c
            if not c.known:
                unknown.add(c.op)
        name = op_name(n)
        nodes.append(NodeCost(n.name, name, costs, {d.name: d.supports(name) for d in soc.devices}, layer_of(n)))
    return GraphCost(soc.name, nodes, pbytes, sorted(unknown))
