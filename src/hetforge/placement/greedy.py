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

from hetforge.placement import Placement, register_strategy
from hetforge.placement.costs import NodeCosts
from hetforge.placement.loop import Decision, Placing


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
    st = Placing.start(gm, soc, objective, pin)
    obj, nc = st.obj, st.nc
    unit = {"latency": "s", "energy": "J"}.get(obj, "J·s")

    def decide(st: Placing, n: torch.fx.Node) -> Decision:
        scored = []
        for d in nc.soc.devices:
            t, e = input_transfer(nc, n, d.name, st.assignment)
            scored.append((nc.score(nc.cost[n.name][d.name], t, e, obj), d.name, t))
        scored.sort()

        def reason(d: str) -> str:
            s, t = next((s, t) for s, dd, t in scored if dd == d)
            alts = ", ".join(f"{dd} {ss:.3g}" for ss, dd, _ in scored if dd != d)
            return (f"greedy {obj}: {d} has the lowest modeled cost {s:.3g} {unit}"
                    + (f" incl. {t:.3g} s of input transfer" if t else "")
                    + (f" (others: {alts})" if alts else ""))

        return Decision([d for _, d, _ in scored], reason)

    return st.run(decide).finish("greedy", strict)
