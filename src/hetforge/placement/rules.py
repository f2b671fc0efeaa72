"""Strategy ``rules``: the heterogeneous-routing dispatch rules (seed 002), one reason per node.

Each call node gets a category and a device-kind preference list:

=================  ===========================================================  ==================
category           which ops                                                    preference
=================  ===========================================================  ==================
control            sampling (argmax/topk/sort/multinomial), KV-cache and index   cpu
                   bookkeeping (index/scatter/gather/embedding), creation ops,
                   shape logic, and any op producing an integer/bool tensor
view               views/getitem: alias their input                             their input's device
quantized-linear   int8/int4 weight linear with ≥ ``large_params`` weights      npu, gpu, cpu
matmul             float matmuls (precision-sensitive or beyond the NPU)        gpu, npu, cpu
attention          attention and softmax                                         gpu, cpu
activation         an elementwise op fed by an NPU node: stays on the NPU if     npu, gpu, cpu
                   it can run there, else is split off
memory             norms, elementwise, reductions, copies: stay with the data   input's device
=================  ===========================================================  ==================

Then *stay or move*: a non-control node whose data sits on device ``s`` stays there, although the rule
prefers ``t``, when ``s`` can run it and the modeled copy of its inputs to ``t``
(``hetforge.cost.transfer_cost``) is non-zero and at least the time (energy, for ``objective=energy``)
running on ``t`` saves. On unified memory the copy is zero, so the rule's device is used as written;
``greedy`` is the strategy that follows the cost model op by op. Devices that cannot run the op or
have no memory left are skipped with a rejection; if the first device of the preference that exists on
the SoC is skipped, the node is a fallback.
"""

from __future__ import annotations

import torch

from hetforge.cost import cost_group
from hetforge.ops.registry import lookup
from hetforge.placement import Placement, register_strategy
from hetforge.placement.greedy import input_transfer
from hetforge.placement.loop import Decision, Placing

SAMPLING = {"aten.argmax.default", "aten.topk.default", "aten.sort.default", "aten.argsort.default",
            "aten.multinomial.default", "aten.cumsum.default", "aten.nonzero.default"}
CONTROL_GROUPS = {"gather", "scatter", "creation", "control"}
MATMUL_GROUPS = {"matmul", "linear_act", "gated_mlp", "fused_matmul"}
ATTENTION_GROUPS = {"attention", "softmax"}
ACTIVATION_GROUPS = {"transcendental", "elementwise"}
PREFERENCE = {"control": ("cpu",), "quantized-linear": ("npu", "gpu", "cpu"), "matmul": ("gpu", "npu", "cpu"),
              "attention": ("gpu", "cpu"), "activation": ("npu", "gpu", "cpu")}
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _out_is_float(node: torch.fx.Node) -> bool:
    v = node.meta.get("val")
    vals = v if isinstance(v, (list, tuple)) else (v,)
    ts = [x for x in vals if isinstance(x, torch.Tensor)]
    return bool(ts) and all(t.dtype in _FLOAT for t in ts)


def _weight_params(node: torch.fx.Node) -> int:
    return sum(int(a.meta["val"].numel()) for a in node.all_input_nodes
               if a.op == "get_attr" and isinstance(a.meta.get("val"), torch.Tensor))


def categorize(node: torch.fx.Node, op: str, large_params: int, data_kind: str | None) -> tuple[str, str]:
    """(category, why) of a call node; ``data_kind`` is the device kind its main input sits on."""
    info = lookup(op)
    group = cost_group(op, info)
    if info is not None and info.is_view or group == "view":
        return "view", "a view aliases its input's storage: it stays with it"
    if op in SAMPLING:
        return "control", "sampling / sequential selection is control work: CPU"
    if group in CONTROL_GROUPS or (info is not None and info.op_class == "control"):
        return "control", f"{group} op (index, KV-cache, embedding-gather or shape bookkeeping) is control work: CPU"
    if not _out_is_float(node):
        return "control", "produces an integer/bool tensor (mask or index logic) — control work: CPU"
    wdt = (info.attrs.get("weight_dtype") if info is not None else None) or ""
    if wdt in ("int8", "int4") and group in MATMUL_GROUPS | {"matmul"}:
        n = _weight_params(node)
        if n >= large_params:
            return "quantized-linear", f"{wdt} linear with {n / 1e6:.1f} M weights: NPU first (most efficient per watt)"
        return "matmul", f"{wdt} linear but small ({n} weights < {large_params}): treated as a matmul"
    if group in MATMUL_GROUPS or "matmul" in group or "linear" in op or "mlp" in op:
        return "matmul", "float matmul (precision-sensitive / beyond NPU capacity): GPU first"
    if group in ATTENTION_GROUPS or "attention" in op or "softmax" in op:
        return "attention", "attention / softmax parallelize well: GPU first"
    if group in ACTIVATION_GROUPS and data_kind == "npu":
        return "activation", "activation after an NPU op: stays on the NPU if it can run it, else split off"
    return "memory", "memory-bound op (norm, elementwise, reduction, copy): stays where its data is"


@register_strategy("rules")
def rules(gm: torch.fx.GraphModule, soc, objective: str | None = "latency", strict: bool = False,
          pin: dict[str, str] | None = None, large_params: int = 1_000_000, **_: object) -> Placement:
    """Dispatch rules with stay-or-move; see module docstring."""
    st = Placing.start(gm, soc, objective, pin)
    nc, obj, soc = st.nc, st.obj, st.soc
    cpu = soc.devices[0].name
    kind_dev: dict[str, str] = {}
    for d in soc.devices:
        kind_dev.setdefault(d.kind, d.name)
    counts: dict[str, int] = {}
    assignment = st.assignment

    def data_device(n: torch.fx.Node) -> str:
        """Where the node's data is: a view's base; otherwise, of the devices holding its inputs, the one
        where running it (plus copying the other inputs there) is cheapest by the objective."""
        ins = nc.inputs(n)
        if not ins:
            return cpu
        info = lookup(nc.ops[n.name])
        if info is not None and info.is_view:
            return assignment.get(ins[0].name, cpu)
        cands = sorted({assignment.get(a.name, cpu) for a in ins}, key=soc.device_names.index)
        if len(cands) == 1:
            return cands[0]
        runnable = [d for d in cands if nc.can_run[n.name][d]] or cands
        return min(runnable, key=lambda d: nc.score(nc.cost[n.name][d], *input_transfer(nc, n, d, assignment), obj))

    def decide(st: Placing, n: torch.fx.Node) -> Decision:
        src = data_device(n)
        cat, why_cat = categorize(n, nc.ops[n.name], large_params, soc.device(src).kind)
        counts[cat] = counts.get(cat, 0) + 1
        if cat in ("view", "memory"):
            prefs = [src] + [d.name for d in soc.devices if d.name != src]
        else:
            prefs = [kind_dev[k] for k in PREFERENCE[cat] if k in kind_dev]
            prefs += [d.name for d in soc.devices if d.name not in prefs] if cat != "control" else []

        def settle(chosen: str) -> tuple[str, str]:
            reason = f"rule {cat}: {why_cat}"
            if chosen != prefs[0]:
                reason += f"; {prefs[0]} rejected, fell back to {chosen}"
            if cat not in ("control", "view") and chosen != src and st.usable(n.name, src) is None:
                t_in, e_in = input_transfer(nc, n, chosen, assignment)
                energy = obj == "energy"
                copy = e_in if energy else t_in
                here, there = (nc.cost[n.name][d].energy_j if energy else nc.cost[n.name][d].time_s
                               for d in (src, chosen))
                unit = "J" if energy else "s"
                if copy > 0 and copy >= here - there:
                    return src, (f"stays on {src}: moving to {chosen} ({cat} rule) would save {here - there:.3g} "
                                 f"{unit} but the copy costs {copy:.3g} {unit} (modeled)")
                if copy > 0:
                    reason += f"; moved from {src}: saves {here - there:.3g} {unit}, copy {copy:.3g} {unit} (modeled)"
            return chosen, reason

        return Decision(prefs, settle)

    return st.run(decide).finish("rules", strict, extra={"categories": counts, "large_params": large_params})
