"""Strategy ``greedy``: each node, in graph order, to the device with the lowest modeled cost.

Cost of node ``n`` on device ``d`` = the cost model's time (``objective=latency``), energy (``energy``)
or energy·delay (``balanced``) of ``n`` on ``d`` plus the transfers of its inputs from the devices their
producers were given (``hetforge.cost.transfer_cost`` over the SoC link; zero on unified memory).
Devices that cannot run the op, or whose memory pool cannot take its weights, are skipped and listed as
rejections; a skipped device that would have been cheaper makes the node a *fallback* (an error
under ``strict=True``). Pins (``pin={node: device}``) override the choice.
"""

from __future__ import annotations

import torch

from hetforge.placement import Placement, Rejection, register_strategy
from hetforge.placement.costs import NodeCosts, check_objective, resolve_soc
from hetforge.placement.plan import Memory, check_pins, finish, no_device_error


def input_transfer(nc: NodeCosts, node: torch.fx.Node, device: str, assignment: dict[str, str]) -> tuple[float, float]:
    """Modeled (s, J) to bring ``node``'s activation inputs to ``device`` from where they were placed."""
    cpu = nc.soc.devices[0].name
    t = e = 0.0
    for a in nc.inputs(node):
        dt, de = nc.transfer(nc.out_bytes.get(a.name, 0), assignment.get(a.name, cpu), device)
        t, e = t + dt, e + de
    return t, e


@register_strategy("greedy")
def greedy(gm: torch.fx.GraphModule, soc, objective: str | None = "latency", strict: bool = False,
           pin: dict[str, str] | None = None, **_: object) -> Placement:
    """Lowest modeled cost per node (transfers counted); see module docstring."""
    soc = resolve_soc(soc)
    obj = check_objective(objective)
    nc = NodeCosts.build(gm, soc)
    pin = check_pins(nc, pin)
    mem = Memory(nc)
    assignment: dict[str, str] = {}
    reasons: dict[str, str] = {}
    rejections: list[Rejection] = []
    fallbacks: list[str] = []
    for n in nc.nodes:
        op = nc.ops[n.name]
        if n.name in pin:
            assignment[n.name] = pin[n.name]
            reasons[n.name] = f"pinned to {pin[n.name]} by the user"
            mem.add(n.name, pin[n.name])
            continue
        scored = []
        for d in soc.devices:
            t, e = input_transfer(nc, n, d.name, assignment)
            scored.append((nc.score(nc.cost[n.name][d.name], t, e, obj), d.name, t))
        scored.sort()
        chosen = None
        for s, d, t in scored:
            why = nc.why_not(n.name, d)
            if why is None:
                ok, why = mem.fits(n.name, d)
                why = None if ok else why
            if why is None:
                chosen = (s, d, t)
                break
            rejections.append(Rejection(n.name, op, d, why))
        if chosen is None:
            raise no_device_error(nc, n.name, rejections, mem)
        s, d, t = chosen
        if scored[0][1] != d:
            fallbacks.append(n.name)
        assignment[n.name] = d
        mem.add(n.name, d)
        unit = {"latency": "s", "energy": "J"}.get(obj, "J·s")
        alts = ", ".join(f"{dd} {ss:.3g}" for ss, dd, _ in scored if dd != d)
        reasons[n.name] = (f"greedy {obj}: {d} has the lowest modeled cost {s:.3g} {unit}"
                           + (f" incl. {t:.3g} s of input transfer" if t else "")
                           + (f" (others: {alts})" if alts else ""))
    return finish(gm, nc, "greedy", assignment, reasons, rejections, fallbacks, obj, strict)
