"""Strategy ``single``: everything on one device (the all-on-one-device baseline).

``device=NAME`` (default: the first device, the CPU). A node that device cannot run is split off to the
fastest device that can (a rejection and a fallback; ``strict=True`` refuses the plan instead).
"""

from __future__ import annotations

import torch

from hetforge.errors import UsageError
from hetforge.placement import Placement, Rejection, register_strategy
from hetforge.placement.costs import NodeCosts, check_objective, resolve_soc
from hetforge.placement.plan import Memory, check_pins, finish, no_device_error


@register_strategy("single")
def single(gm: torch.fx.GraphModule, soc, objective: str | None = "latency", strict: bool = False,
           device: str | None = None, pin: dict[str, str] | None = None, **_: object) -> Placement:
    """All nodes on ``device``; unsupported ones split off to their fastest capable device."""
    soc = resolve_soc(soc)
    obj = check_objective(objective)
    target = device or soc.devices[0].name
    if target not in soc.device_names:
        raise UsageError(f"SoC '{soc.name}' has no device '{target}'; devices: {', '.join(soc.device_names)}")
    nc = NodeCosts.build(gm, soc)
    pin = check_pins(nc, pin)
    mem = Memory(nc)
    assignment: dict[str, str] = {}
    reasons: dict[str, str] = {}
    rejections: list[Rejection] = []
    fallbacks: list[str] = []
    for n in nc.nodes:
        if n.name in pin:
            assignment[n.name], reasons[n.name] = pin[n.name], f"pinned to {pin[n.name]} by the user"
            mem.add(n.name, pin[n.name])
            continue
        order = [target] + sorted((d.name for d in soc.devices if d.name != target),
                                  key=lambda d: nc.cost[n.name][d].time_s)
        for d in order:
            why = nc.why_not(n.name, d)
            if why is None:
                ok, why = mem.fits(n.name, d)
                why = None if ok else why
            if why is None:
                break
            rejections.append(Rejection(n.name, nc.ops[n.name], d, why))
        else:
            raise no_device_error(nc, n.name, rejections, mem)
        if d != target:
            fallbacks.append(n.name)
            reasons[n.name] = f"all-on-{target} baseline, but {target} cannot take it: split off to {d}"
        else:
            reasons[n.name] = f"all-on-{target} baseline"
        assignment[n.name] = d
        mem.add(n.name, d)
    return finish(gm, nc, "single", assignment, reasons, rejections, fallbacks, obj, strict, {"device": target})
