"""Whole-graph cost: every ``call_function`` node of an FX graph costed on every device of an SoC.

Totals are plain sums over nodes on one device (no overlap, no transfers): the single-device program time.
Each device's nodes are costed in graph order with that device's cache context
(:mod:`hetforge.cost.context`: recently touched inputs are cache-hot, fixed costs grow after big streams), as
if the whole graph ran on it, in a steady state (the graph is walked twice; the second pass is reported).
CPQ uses ``resident = parameter bytes of the graph + the op's own bytes`` on each device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from hetforge.cost.context import CacheContext
from hetforge.cost.model import OpCost, estimate, estimate_parts
from hetforge.hardware.profile import SocProfile
from hetforge.ops.registry import lookup


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


def _root(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage ``node``'s value lives in (follows view ops to their input)."""
    from hetforge.frontend import op_name

    seen = 0
    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node) and seen < 10_000:
        info = lookup(op_name(node))
        if info is None or not info.is_view:
            break
        node, seen = node.args[0], seen + 1
    return node


def _nbytes(node: torch.fx.Node) -> float:
    v = node.meta.get("val")
    return float(v.numel() * v.element_size()) if isinstance(v, torch.Tensor) else 0.0


def analyze(gm: torch.fx.GraphModule, soc: SocProfile, temp_c: float | None = None) -> GraphCost:
    """Cost every ``call_function`` node of ``gm`` on every device of ``soc``."""
    from hetforge.frontend import op_name

    pbytes = param_bytes(gm)
    unknown: set[str] = set()
    nodes = []
    ctxs = {d.name: CacheContext(d) for d in soc.devices}
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    roots = {n: {_root(a): a for a in n.all_input_nodes} for n in calls}
    # two passes over the graph with the same contexts; the second (a steady-state run) is kept
    for _ in range(2 if any(c.active for c in ctxs.values()) else 1):
        nodes = []
        for n in calls:
            costs = {}
            for d in soc.devices:
                ctx = ctxs[d.name]
                c = estimate(n, d, temp_c)
                res = pbytes + c.bytes if (c.bytes or c.flops) else None
                hot = sum(_nbytes(a) for r, a in roots[n].items() if ctx.hot(r)) if ctx.active else 0.0
                c = ctx.run_all(estimate_parts(n, d, temp_c, resident_bytes=res, hot_bytes=hot))
                ctx.touch([*roots[n], _root(n)], moved=c.bytes > 0)
                costs[d.name] = c
                if not c.known:
                    unknown.add(c.op)
            name = op_name(n)
            nodes.append(NodeCost(n.name, name, costs, {d.name: d.supports(name) for d in soc.devices},
                                  layer_of(n)))
    return GraphCost(soc.name, nodes, pbytes, sorted(unknown))
