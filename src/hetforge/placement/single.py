"""Strategy ``single``: everything on one device (the all-on-one-device baseline).

``device=NAME`` (default: the first device, the CPU). A node that device cannot run is split off to the
fastest device that can (a rejection and a fallback; ``strict=True`` refuses the plan instead).
"""

from __future__ import annotations

import torch

from hetforge.errors import UsageError
from hetforge.placement import Placement, register_strategy
from hetforge.placement.costs import check_objective, resolve_soc
from hetforge.placement.loop import Decision, Placing


@register_strategy("single")
def single(gm: torch.fx.GraphModule, soc, objective: str | None = "latency", strict: bool = False,
           device: str | None = None, pin: dict[str, str] | None = None, **_: object) -> Placement:
    """All nodes on ``device``; unsupported ones split off to their fastest capable device."""
    soc = resolve_soc(soc)
    check_objective(objective)
    target = device or soc.devices[0].name
    if target not in soc.device_names:
        raise UsageError(f"SoC '{soc.name}' has no device '{target}'; devices: {', '.join(soc.device_names)}")
    st = Placing.start(gm, soc, objective, pin)
    nc = st.nc

    def reason(d: str) -> str:
        if d != target:
            return f"all-on-{target} baseline, but {target} cannot take it: split off to {d}"
        return f"all-on-{target} baseline"

    def decide(st: Placing, n: torch.fx.Node) -> Decision:
        return Decision([target] + sorted((d.name for d in soc.devices if d.name != target),
                                          key=lambda d: nc.cost[n.name][d].time_s), reason)

    return st.run(decide).finish("single", strict, {"device": target})
