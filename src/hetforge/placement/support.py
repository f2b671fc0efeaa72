"""The simplest strategy, "support": each node on the first device in a preference order that can run it.

Default preference: accelerators first (``npu``, then ``gpu``, then ``cpu`` kinds; SoC order within a
kind). A device can run a node when its profile supports the op (registry device kinds and the
profile's ``unsupported_ops``). ``getitem`` follows its producer. Placeholders, weights and the output
stay on the first (host) device. Every node that could not go to a preferred device is recorded as a
rejection with the reason.
"""

from __future__ import annotations

import operator

import torch

from hetforge.errors import UsageError
from hetforge.frontend import op_name
from hetforge.placement import Placement, Rejection, register_strategy

KIND_ORDER = {"npu": 0, "gpu": 1, "cpu": 2}


def preference(soc, prefer: list[str] | str | None = None) -> list[str]:
    """Device names in preference order (``prefer`` may be a list or a comma-separated string)."""
    names = soc.device_names
    if prefer:
        order = [p.strip() for p in prefer.split(",")] if isinstance(prefer, str) else list(prefer)
        bad = [p for p in order if p not in names]
        if bad:
            raise UsageError(f"unknown device(s) {', '.join(bad)} in preference; devices: {', '.join(names)}")
        return order + [n for n in names if n not in order]
    return sorted(names, key=lambda n: (KIND_ORDER.get(soc.device(n).kind, 3), names.index(n)))


@register_strategy("support")
def support(gm: torch.fx.GraphModule, soc, prefer: list[str] | str | None = None, **_: object) -> Placement:
    """Place every call on the first device (in preference order) whose profile supports its op."""
    if isinstance(soc, str):
        from hetforge.hardware import load_soc

        soc = load_soc(soc)
    order = preference(soc, prefer)
    host = soc.device_names[0]
    assignment: dict[str, str] = {}
    reasons: dict[str, str] = {}
    rejections: list[Rejection] = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            assignment[n.name] = host
            reasons[n.name] = f"{n.op} lives on the host device"
            continue
        name = op_name(n)
        if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) and n.args[0].name in assignment:
            assignment[n.name] = assignment[n.args[0].name]
            reasons[n.name] = "getitem follows its producer"
            continue
        for d in order:
            if soc.device(d).supports(name):
                assignment[n.name] = d
                reasons[n.name] = f"first supporting device in preference order {order}"
                break
            rejections.append(Rejection(n.name, name, d, f"{d} does not support {name}"))
        else:
            assignment[n.name] = host
            reasons[n.name] = f"no device supports {name}; host fallback"
    return Placement("support", assignment, reasons, rejections, extra={"preference": order})
