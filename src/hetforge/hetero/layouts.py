"""Hand-made placements by decoder layer (for tests, benchmarks and plans without a placer).

Stages come from :func:`hetforge.placement.layers.group_stages` (``embed``, ``layer.N``, ``head``).

Layouts:

* ``all:DEV`` — every node on one device;
* ``alternate:A,B[,C...]`` — layer i on device i mod k; embedding and head on the first device;
* ``stages:A,B[,C...]`` — the layers cut into k contiguous stages; the embedding on the first device, the head
  on the last (``split:A,B`` is the same with two devices).
"""

from __future__ import annotations

from torch import fx

from hetforge.errors import UsageError
from hetforge.placement.layers import EMBED, HEAD, group_stages

LAYOUTS = ("all", "alternate", "stages", "split")


def parse_layout(spec: str, devices: list[str]) -> tuple[str, list[str]]:
    """``'alternate:cpu,npu'`` → ('alternate', ['cpu', 'npu']), checking device names."""
    kind, _, rest = spec.partition(":")
    if kind not in LAYOUTS:
        raise UsageError(f"unknown layout '{spec}'; valid: all:DEV, alternate:A,B, stages:A,B, split:A,B")
    devs = [d.strip() for d in rest.split(",") if d.strip()]
    if not devs:
        raise UsageError(f"layout '{spec}' names no device; e.g. {kind}:{','.join(devices[:2])}")
    unknown = [d for d in devs if d not in devices]
    if unknown:
        raise UsageError(f"layout '{spec}': unknown device(s) {unknown}; this SoC has {', '.join(devices)}")
    if kind == "all" and len(devs) != 1:
        raise UsageError(f"layout '{spec}': 'all' takes exactly one device")
    return kind, devs


def layer_assignment(gm: fx.GraphModule, spec: str, devices: list[str]) -> dict[str, str]:
    """Node name → device for a layout spec (see module docstring)."""
    kind, devs = parse_layout(spec, devices)
    stages = group_stages(gm)
    n_layers = stages.num_layers
    if kind != "all" and n_layers == 0:
        raise UsageError(f"layout '{spec}' needs decoder layers, but no node names one (nn_module_stack)")
    out: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        stage = stages.of.get(n.name, EMBED)
        if kind == "all":
            dev = devs[0]
        elif stage == EMBED:
            dev = devs[0]
        elif stage == HEAD:
            dev = devs[0] if kind == "alternate" else devs[-1]
        else:
            layer = int(stage.split(".")[1])
            dev = devs[layer % len(devs)] if kind == "alternate" else devs[layer * len(devs) // n_layers]
        out[n.name] = dev
    return out
