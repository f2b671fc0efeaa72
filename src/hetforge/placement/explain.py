"""Explain one node's placement: its modeled cost on every device and what decided it.

For each device of the SoC: whether it can run the op (and why not), the cost model's time, energy,
DASI and bound, the transfer *in* (moving the node's activation inputs from where the placement put
their producers) and *out* (moving its output to the devices its users were given), and the total.
All figures are modeled.
"""

from __future__ import annotations

import torch

from hetforge.errors import UsageError
from hetforge.placement import Placement
from hetforge.placement.costs import NodeCosts
from hetforge.placement.layers import group_stages


def explain_node(gm: torch.fx.GraphModule, nc: NodeCosts, placement: Placement, node: str) -> dict:
    """A JSON-ready explanation of ``node`` under ``placement``."""
    if node not in nc.index:
        names = [n.name for n in nc.nodes]
        near = [n for n in names if node in n or n in node][:8] or names[:8]
        raise UsageError(f"no call_function node '{node}' in the graph; e.g. {', '.join(near)} "
                         f"({len(names)} nodes; `hetforge capture MODEL --dump FILE` lists them all)")
    n = nc.index[node]
    asg = placement.assignment
    cpu = nc.soc.devices[0].name
    rows = []
    for d in nc.soc.devices:
        c = nc.cost[node][d.name]
        t_in = e_in = t_out = e_out = 0.0
        for a in nc.inputs(n):
            t, e = nc.transfer(nc.out_bytes.get(a.name, 0), asg.get(a.name, cpu), d.name)
            t_in, e_in = t_in + t, e_in + e
        for u_dev in sorted({asg.get(u.name, cpu) for u in n.users}):
            t, e = nc.transfer(nc.out_bytes.get(node, 0), d.name, u_dev)
            t_out, e_out = t_out + t, e_out + e
        rows.append({
            "device": d.name, "kind": d.kind, "supported": nc.can_run[node][d.name],
            "why_not": nc.why_not(node, d.name), "time_s": c.time_s, "energy_j": c.energy_j, "dasi": c.dasi,
            "bound": c.bound, "transfer_in_s": t_in, "transfer_in_j": e_in, "transfer_out_s": t_out,
            "transfer_out_j": e_out, "total_time_s": c.time_s + t_in + t_out,
            "total_energy_j": c.energy_j + e_in + e_out, "chosen": asg.get(node) == d.name,
        })
    return {
        "node": node, "op": nc.ops[node], "stage": group_stages(gm).of.get(node), "soc": nc.soc.name,
        "strategy": placement.strategy, "objective": placement.objective, "device": asg.get(node),
        "reason": placement.reasons.get(node, ""),
        "rejections": [{"device": r.device, "why": r.why} for r in placement.rejections if r.node == node],
        "flops": nc.cost[node][cpu].flops, "bytes": nc.cost[node][cpu].bytes, "output_bytes": nc.out_bytes.get(node),
        "devices": rows, "label": "modeled",
    }
