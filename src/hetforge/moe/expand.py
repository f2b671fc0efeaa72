"""Residency, executed: each ``hetforge::moe`` node expanded into placeable expert groups, pinned per group.

:func:`expand_moe` rewrites every ``hetforge::moe`` node of an optimized graph (after the MoE pass) into
``moe_route`` (router + top-k + static slots; control, CPU), then per expert group ``moe_gather`` → ``moe_group``
(a static batched GEMM over that group's stacked weights, its own buffers) → ``moe_scatter`` (weighted combine),
see :mod:`hetforge.ops.moe_groups`. The groups follow a tier plan (:func:`hetforge.moe.choose_tiers`: experts
stored hottest first, group size, a static capacity per group) for calls of the graph's ``T`` tokens; with
``unlimited`` every expert gets ``T`` slots (nothing can be dropped: the result equals the unexpanded op).

:func:`residency_pins` runs the residency model (:func:`hetforge.moe.residency.plan_residency`) for the same
plan and ``T`` and returns, per group node, the SoC device it must run on and the model's reason — placement
pins them, so the NPU partition of the placed program really holds the hot groups' weights.

A block with a shared expert is left whole (its node stays ``hetforge::moe``; reported in ``skipped``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node

from hetforge.errors import UsageError

_ARGS = ("x", "router_w", "w_gate_up", "w_down", "s_gate", "s_up", "s_down", "s_router", "top_k", "norm_topk",
         "act", "transposed", "group_size", "capacity", "order", "layer")


@dataclass
class ExpandedGroup:
    """One expert group of one layer as it stands in the expanded graph."""

    layer: int
    group: int
    node: str  # the moe_group node
    experts: list[int]  # original expert ids
    capacity: int  # static slots per expert
    slots: int  # G·C
    weight_bytes: int
    device: str = ""  # SoC device name (after residency_pins)
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("layer", "group", "node", "experts", "capacity", "slots",
                                             "weight_bytes", "device", "reason")}


@dataclass
class Expansion:
    """What :func:`expand_moe` did: the groups per layer, the tokens per call, blocks left whole."""

    tokens: int
    plan: dict[str, Any]
    groups: list[ExpandedGroup] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens_per_call": self.tokens, "groups": [g.to_dict() for g in self.groups],
                "skipped": self.skipped}


def moe_nodes(gm: GraphModule) -> list[Node]:
    op = torch.ops.hetforge.moe.default
    return [n for n in gm.graph.nodes if n.target is op]


def _args(n: Node) -> dict[str, Any]:
    from hetforge.ops.moe import DEFAULTS

    d = dict(DEFAULTS)
    d.update({k: None for k in _ARGS[:8]})
    d.update(dict(zip(_ARGS, n.args, strict=False)))
    d.update(n.kwargs)
    return d


def graph_tokens(gm: GraphModule) -> int:
    """``T`` of the graph's MoE blocks (rows of the first block's hidden states); 0 without a block."""
    ns = moe_nodes(gm)
    if not ns:
        return 0
    v = ns[0].args[0].meta.get("val")
    if v is None or any(not isinstance(s, int) for s in v.shape):
        raise UsageError("the MoE block's hidden states have no static shape; expert groups need static shapes")
    return int(v.numel() // v.shape[-1])


def unlimited_plan(cal: dict[str, Any] | None, gm: GraphModule, tokens: int, group_size: int) -> dict[str, Any]:
    """A plan with every expert at ``T`` slots (no drop possible): calibrated order when ``cal`` is given."""
    from hetforge.passes.common import const_tensor

    layers = {}
    shares = {int(lay["layer"]): lay["share"] for lay in (cal or {}).get("layers", [])}
    for n in moe_nodes(gm):
        a = _args(n)
        e = const_tensor(gm, a["router_w"]).shape[0]
        g = group_size or e
        if e % g:
            raise UsageError(f"--moe-group-size {group_size} does not divide the {e} experts of layer {a['layer']}")
        sh = shares.get(int(a["layer"]))
        order = sorted(range(e), key=lambda i: (-float(sh[i]), i)) if sh else list(range(e))
        layers[int(a["layer"])] = {"order": order, "capacity": [tokens] * e, "group_size": g,
                                   "group_capacity": [tokens] * (e // g), "hot": [], "hot_capacity": tokens,
                                   "cold_capacity": tokens}
    return {"model": (cal or {}).get("model"), "tokens_per_call": tokens, "share": None, "capacity_factor": None,
            "unlimited": True, "layers": layers}


def expand_moe(gm: GraphModule, plan: dict[str, Any]) -> tuple[GraphModule, Expansion]:
    """Expand every ``hetforge::moe`` node of ``gm`` (in place) into route / per-group gather, group, scatter."""
    from hetforge.passes.common import const_tensor, fake_mode_of, inherit_meta, set_val

    fm = fake_mode_of(gm)
    exp = Expansion(graph_tokens(gm), plan)
    ops = torch.ops.hetforge
    for n in moe_nodes(gm):
        a = _args(n)
        layer = int(a["layer"])
        p = plan["layers"].get(layer)
        if p is None:
            exp.skipped.append(f"{n.name}: layer {layer} has no plan")
            continue
        if a["s_up"] is not None:
            exp.skipped.append(f"{n.name}: shared expert (kept as one hetforge::moe node)")
            continue
        wgu, wd = const_tensor(gm, a["w_gate_up"]), const_tensor(gm, a["w_down"])
        if a["order"]:
            raise UsageError(f"{n.name} already carries a tier order; expand the untiered graph")
        e = wgu.shape[0]
        order, caps, g = list(p["order"]), [int(c) for c in p["capacity"]], int(p["group_size"])
        if sorted(order) != list(range(e)) or len(caps) != e or g < 1 or e % g:
            raise UsageError(f"tier plan of layer {layer} does not fit its {e} experts")
        base, spans, off = [0] * e, [], 0
        for g0 in range(0, e, g):
            c = max(caps[g0:g0 + g])
            for j in range(g0, g0 + g):
                base[j] = off + (j - g0) * c
            spans.append((g0, c, off))
            off += g * c

        def call(target, args, name, at=n):
            with gm.graph.inserting_before(at):
                node = gm.graph.create_node("call_function", target, args, {}, name=name)
            set_val(node, fm)
            inherit_meta(node, at)
            return node

        def attr(name: str, t: torch.Tensor, at=n) -> Node:
            gm.register_buffer(name, t, persistent=False)
            with gm.graph.inserting_before(at):
                node = gm.graph.get_attr(name)
            if fm is not None:
                node.meta["val"] = fm.from_tensor(t, static_shapes=True)
            return node

        x = a["x"]
        table = call(ops.moe_route.default, (x, a["router_w"], int(a["top_k"]), bool(a["norm_topk"]), caps, base,
                                             order, layer), f"moe_l{layer}_route")
        acc = x
        for gi, (g0, c, off) in enumerate(spans):
            ids = order[g0:g0 + g]
            wg = attr(f"_moe_l{layer}_g{gi}_w_gate_up", wgu[ids].contiguous())
            wdn = attr(f"_moe_l{layer}_g{gi}_w_down", wd[ids].contiguous())
            xs = call(ops.moe_gather.default, (x, table, off, g, c), f"moe_l{layer}_g{gi}_gather")
            ys = call(ops.moe_group.default, (xs, wg, wdn, str(a["act"]), bool(a["transposed"])), f"moe_l{layer}_g{gi}")
            acc = call(ops.moe_scatter.default, (acc, ys, table, off, g, c, gi == 0), f"moe_l{layer}_g{gi}_scatter")
            nbytes = (wgu[0].numel() + wd[0].numel()) * wgu.element_size() * g
            exp.groups.append(ExpandedGroup(layer, gi, ys.name, list(ids), c, g * c, nbytes))
        n.replace_all_uses_with(acc)
        gm.graph.erase_node(n)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm, exp


def residency_pins(exp: Expansion, soc, cal: dict[str, Any], d_model: int, d_ff: int, dtype_bytes: int,
                   objective: str = "latency", npu_budget_bytes: float | None = None,
                   force: str | None = None) -> dict[str, str]:
    """Run the residency model for the expansion's plan and ``T``; set each group's device and reason, and
    return the pins (group node → SoC device name). ``force``: ``"host"`` / ``"npu"`` (the baselines)."""
    from hetforge.moe.residency import plan_residency

    if force == "npu" and not any(dev.kind == "npu" for dev in soc.devices):
        raise UsageError(f"--moe-place npu: SoC '{soc.name}' has no NPU")
    choices = plan_residency(soc, cal, exp.plan, d_model, d_ff, exp.tokens, dtype_bytes, npu_budget_bytes,
                             force=force, objective=objective)
    by_key = {(c.layer, c.group): c for c in choices}
    by_kind: dict[str, str] = {}
    for dev in soc.devices:
        by_kind.setdefault(dev.kind, dev.name)
    pins = {}
    for grp in exp.groups:
        c = by_key.get((grp.layer, grp.group))
        if c is None:
            raise UsageError(f"the calibration has no layer {grp.layer}; recalibrate this model")
        grp.device = by_kind[c.device]
        grp.reason = (f"MoE residency (layer {grp.layer}, group {grp.group}, experts {grp.experts}, {grp.slots} "
                      f"static slots, {exp.tokens} tokens per call, objective {objective}; modeled): {c.reason}")
        pins[grp.node] = grp.device
    return pins


def expand_for_soc(gm: GraphModule, cal: dict[str, Any], soc, dims: tuple[int, int, int], share: float = 0.9,
                   group_size: int = 2, capacity_factor: float = 1.25, unlimited: bool = False,
                   objective: str = "latency", npu_budget_bytes: float | None = None, force: str | None = None
                   ) -> tuple[GraphModule, Expansion, dict[str, str]]:
    """Tier plan for the graph's ``T`` (or ``unlimited``), expansion, and residency pins, in one call."""
    from hetforge.moe import choose_tiers

    t = graph_tokens(gm)
    if unlimited:
        plan = unlimited_plan(cal, gm, t, group_size)
    else:
        plan = choose_tiers(cal, t, share=share, group_size=group_size, capacity_factor=capacity_factor)
    gm, exp = expand_moe(gm, plan)
    d, f, nb = dims
    return gm, exp, residency_pins(exp, soc, cal, d, f, nb, objective, npu_budget_bytes, force)
