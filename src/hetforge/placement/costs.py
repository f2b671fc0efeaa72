"""What every strategy needs from the graph and the cost model: per-node costs, support, tensor sizes.

``NodeCosts.build(gm, soc)`` costs every ``call_function`` node on every device once (``hetforge.cost
.estimate``, modeled) and records which devices may run it. A device may run a node when its profile
``supports`` the op (which also consults the op registry's device kinds). Edges carry the bytes of the
producer's output, so a strategy can charge ``hetforge.cost.transfer_cost`` over the SoC's link when an
edge crosses devices. Weights (``get_attr``) are resident on every device that uses them and never
move per inference; their bytes count toward that device's memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hetforge.cost import OpCost, estimate, transfer_cost
from hetforge.errors import UsageError
from hetforge.frontend import op_name
from hetforge.hardware import SocProfile
from hetforge.ops.registry import lookup
from hetforge.placement import OBJECTIVES


def tensor_bytes(val) -> int:
    """Bytes of a fake/meta tensor (or a tuple of them) from ``node.meta['val']``."""
    if isinstance(val, torch.Tensor):
        return int(val.numel()) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(tensor_bytes(v) for v in val)
    return 0


@dataclass
class NodeCosts:
    """Per-node modeled costs on every device, support, and the data edges of the graph."""

    soc: SocProfile
    nodes: list[torch.fx.Node]  # call_function nodes in graph order
    ops: dict[str, str]  # node name -> op name
    cost: dict[str, dict[str, OpCost]]  # node -> device -> cost
    can_run: dict[str, dict[str, bool]]
    out_bytes: dict[str, int]  # node (any kind) -> bytes of its output
    weights: dict[str, dict[str, int]] = field(default_factory=dict)  # call node -> get_attr name -> bytes
    index: dict[str, torch.fx.Node] = field(default_factory=dict)  # call node name -> node

    @classmethod
    def build(cls, gm: torch.fx.GraphModule, soc: SocProfile) -> NodeCosts:
        nodes, ops, cost, can_run, out_bytes, weights = [], {}, {}, {}, {}, {}
        for n in gm.graph.nodes:
            out_bytes[n.name] = tensor_bytes(n.meta.get("val"))
            if n.op != "call_function":
                continue
            nodes.append(n)
            ops[n.name] = op_name(n)
            cost[n.name] = {d.name: estimate(n, d) for d in soc.devices}
            can_run[n.name] = {d.name: d.supports(ops[n.name]) for d in soc.devices}
            weights[n.name] = {a.name: out_bytes.get(a.name) or tensor_bytes(a.meta.get("val"))
                               for a in n.all_input_nodes if a.op == "get_attr"}
        return cls(soc, nodes, ops, cost, can_run, out_bytes, weights, {n.name: n for n in nodes})

    def why_not(self, node: str, device: str) -> str | None:
        """None if ``device`` may run ``node``, else the reason."""
        if self.can_run[node][device]:
            return None
        op = self.ops[node]
        dev = self.soc.device(device)
        if op in dev.unsupported_ops:
            return f"{op} is in the {device} profile's unsupported ops"
        gaps = dev.quant_gaps(op)
        if gaps:
            return f"{op} needs {' and '.join(gaps)}; the {device} profile lists {', '.join(sorted(dev.dtypes))}"
        info = lookup(op)
        kinds = ",".join(sorted(info.devices)) if info is not None else "?"
        return f"op registry: {op} runs on {kinds} only, not on a {dev.kind}"

    def transfer(self, nbytes: float, src: str, dst: str) -> tuple[float, float]:
        """Modeled (seconds, joules) to move ``nbytes`` from ``src`` to ``dst`` (0 on one device / unified)."""
        if src == dst or nbytes == 0:
            return 0.0, 0.0
        return transfer_cost(nbytes, self.soc.link(src, dst))

    def inputs(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """Activation inputs (not weights) of a node."""
        return [a for a in node.all_input_nodes if a.op != "get_attr"]

    def score(self, c: OpCost, t_extra: float, e_extra: float, objective: str) -> float:
        """The number a strategy minimizes for one node: time, energy, or energy-delay product."""
        t, e = c.time_s + t_extra, c.energy_j + e_extra
        return {"latency": t, "energy": e}.get(objective, t * e)


def check_objective(objective: str | None) -> str:
    obj = objective or "balanced"
    if obj not in OBJECTIVES:
        raise UsageError(f"unknown objective '{objective}'; valid objectives: {', '.join(OBJECTIVES)}")
    return obj


def resolve_soc(soc) -> SocProfile:
    """Accept a SocProfile or a profile name/path."""
    if isinstance(soc, SocProfile):
        return soc
    from hetforge.hardware import load_soc

    return load_soc(str(soc))
