"""Gather a report's data from the real pipeline objects: one JSON-ready dict per section.

Nothing here re-derives a figure: every number comes from the stage result that produced it — the pass
results (:class:`~hetforge.passes.common.PassResult`), the placement and :func:`~hetforge.placement.explain.
explain_node` over the cost model's :class:`~hetforge.placement.costs.NodeCosts`, the stage search's front
(:mod:`hetforge.placement.stage_search`), the memory plan (:class:`~hetforge.memplan.MemoryPlan`), the modeled
list schedule of a real partitioned run (:mod:`hetforge.hetero.timeline`) and, for a generation, the runtime's
ledger. Each figure carries ``measured`` (timed on this host) or ``modeled`` (the SoC's cost model).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hetforge.frontend import op_name


def _num(x: Any) -> Any:
    """JSON-safe float: inf/nan become None (the page shows a dash)."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    return x


def _node_table(gm: torch.fx.GraphModule | None) -> dict[str, tuple[str, list[str]]]:
    """node name → (op, input node names) for every node of ``gm``."""
    out: dict[str, tuple[str, list[str]]] = {}
    if gm is None:
        return out
    for n in gm.graph.nodes:
        op = op_name(n) if n.op == "call_function" else n.op
        out[n.name] = (op, [a.name for a in n.all_input_nodes])
    return out


def passes_section(optimized: Any, before_gm: torch.fx.GraphModule | None, after_gm: torch.fx.GraphModule,
                   quant: Any = None) -> dict[str, Any]:
    """Per pass: node counts, rewrites and near-misses (with their lists), and every rewrite's subgraph before
    (the matched nodes, from the captured graph when they were in it) and after (the node that replaced them)."""
    if optimized is None:
        return {"enabled": False, "passes": [], "rewrites": []}
    before, after = _node_table(before_gm), _node_table(after_gm)
    unknown = "(made by an earlier pass)" if before_gm is not None else "(the runtime keeps no graph before passes)"
    passes, rewrites = [], []
    for p in optimized.passes:
        d = p.to_dict(full=True)
        passes.append({"name": d["name"], "nodes_before": d["nodes_before"], "nodes_after": d["nodes_after"],
                       "rewrites": d["rewrites"], "near_misses": d["near_misses"], "seconds": d["seconds"],
                       "near_miss_list": d["near_miss_list"],
                       "rewrite_kinds": _kinds(d["rewrite_list"])})
        for r in p.rewrites:
            if r.new_node is None and len(r.matched) < 2:
                continue  # a plain removal (dead code, a no-op): nothing to draw
            rewrites.append({
                "pass": p.name, "kind": r.kind, "detail": r.detail,
                "before": [[m, *before.get(m, (unknown, []))] for m in r.matched],
                "after": [r.new_node, *after.get(r.new_node, ("(replaced by a later pass)", []))]
                if r.new_node else None,
            })
    chosen = _pick_rewrite(rewrites)
    out = {"enabled": True, "passes": passes, "rewrites": rewrites, "chosen": chosen,
           "nodes_before": optimized.nodes_before, "nodes_after": optimized.nodes_after,
           "fused": dict(optimized.fused), "seconds": optimized.seconds, "figure": "measured seconds"}
    if quant is not None:
        out["quantize"] = quant.report.to_dict()["summary"]
    return out


def _kinds(rewrite_list: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rewrite_list:
        out[r["kind"]] = out.get(r["kind"], 0) + 1
    return out


def _pick_rewrite(rewrites: list[dict]) -> int | None:
    """The rewrite shown first: the fusion that replaced the most nodes by one (the first such), else the rewrite
    that matched most nodes."""
    if not rewrites:
        return None
    fused = [i for i, r in enumerate(rewrites) if r["after"]] or list(range(len(rewrites)))
    return max(fused, key=lambda i: (len(rewrites[i]["before"]), -i))


def placement_section(gm: torch.fx.GraphModule, soc: Any, placement: Any) -> tuple[dict[str, Any], Any]:
    """Every call node with its device, the deciding rule or objective, and its modeled cost on each device
    (:func:`~hetforge.placement.explain.explain_node`); also returns the NodeCosts for the roofline."""
    from hetforge.placement.costs import NodeCosts
    from hetforge.placement.explain import explain_node

    nc = NodeCosts.build(gm, soc)
    devices = [d.name for d in soc.devices]
    nodes = []
    for n in nc.nodes:
        ex = explain_node(gm, nc, placement, n.name)
        nodes.append({
            "name": ex["node"], "op": ex["op"], "stage": ex["stage"], "device": ex["device"],
            "reason": ex["reason"], "flops": ex["flops"], "bytes": ex["bytes"], "output_bytes": ex["output_bytes"],
            "rejections": ex["rejections"],
            # per device, in ``devices`` order: [supported, why_not, time, energy, dasi, bound, in_s, out_s,
            # total_time, total_energy]
            "costs": [[r["supported"], r["why_not"], _num(r["time_s"]), _num(r["energy_j"]), _num(r["dasi"]),
                       r["bound"], _num(r["transfer_in_s"]), _num(r["transfer_out_s"]), _num(r["total_time_s"]),
                       _num(r["total_energy_j"])] for r in ex["devices"]],
        })
    cost = placement.extra.get("cost") if placement.extra else None
    counts: dict[str, int] = {}
    for n in nodes:
        counts[n["device"]] = counts.get(n["device"], 0) + 1
    return {"strategy": placement.strategy, "objective": placement.objective, "devices": devices,
            "nodes": nodes, "counts": counts, "plan_cost": cost, "fallbacks": placement.extra.get("fallbacks", []),
            "figure": "modeled"}, nc


def pareto_section(gm: torch.fx.GraphModule, nc: Any, placement: Any, objective: str | None) -> dict[str, Any]:
    """The stage plans' Pareto front (energy, latency, −min DASI; modeled) with the chosen point, and the
    one-device plans as baselines. A ``stages``/``pgsam`` placement brings its own front; for other strategies
    PGSAM is run on the same layer table so the page can show where the search would land."""
    from hetforge.placement.costs import check_objective
    from hetforge.placement.layer_costs import build_table
    from hetforge.placement.layers import group_stages
    from hetforge.placement.pgsam import describe
    from hetforge.placement.pgsam_search import pick
    from hetforge.placement.stage_search import search_front
    from hetforge.placement.stages import evaluate, objectives

    groups = group_stages(gm)
    if groups.num_layers == 0:
        return {"available": False, "why": "no node belongs to a decoder layer, so there are no stage plans"}
    obj = check_objective(objective)
    table, aux = build_table(nc, groups, "power", obj)
    devs = table.devices
    if placement.extra.get("front"):
        front = placement.extra["front"]
        source = f"the {placement.strategy} placement's own front ({placement.extra['search']['method']} search)"
        search = placement.extra["search"]
    else:
        res = search_front(table, "pgsam", seed=0)
        chosen, _ = pick(res.archive, obj)
        items = sorted(res.archive.items.items(), key=lambda kv: kv[1][0])
        front = [{"plan": describe(k, devs), "energy_j": v[0][0], "latency_s": v[0][1], "min_dasi": -v[0][2],
                  "chosen": k == chosen} for k, v in items]
        source = (f"PGSAM run on the same layer table for reference (seed 0; the report's strategy "
                  f"'{placement.strategy}' does not search stage plans; the chosen point is PGSAM's {obj} pick)")
        search = {"method": res.method, "plans": res.plans, **{k: v for k, v in res.stats.items()
                                                               if isinstance(v, (int, float, str))}}
    baselines = []
    for j, d in enumerate(devs):
        assign = (j,) * table.num_layers
        f = evaluate(table, assign)
        g = f if f is not None else objectives(table, assign)
        baselines.append({"plan": f"all layers on {d}", "energy_j": g[0], "latency_s": g[1], "min_dasi": -g[2],
                          "fits": f is not None})
    return {"available": True, "front": front, "baselines": baselines, "source": source, "objective": obj,
            "latency_mode": table.latency_mode, "aux": {"embed": aux.embed, "head": aux.head},
            "search": search, "layers": table.num_layers, "figure": "modeled"}


def roofline_section(nc: Any, soc: Any, placement: Any) -> dict[str, Any]:
    """Each device's roofs (fp32 peak π, bandwidth β) and every op as (AI, FLOP/s attained) on each device,
    from the cost model's per-node costs (modeled)."""
    devices = [{"name": d.name, "kind": d.kind, "peak_flops": d.peak("fp32"), "bandwidth": d.mem_bandwidth,
                "ridge": d.peak("fp32") / d.mem_bandwidth} for d in soc.devices]
    ops = []
    for n in nc.nodes:
        pts = []
        for d in soc.devices:
            c = nc.cost[n.name][d.name]
            ok = c.flops > 0 and c.time_s > 0 and math.isfinite(c.ai) and c.ai > 0
            pts.append([c.ai, c.flops / c.time_s, c.bound, c.time_s] if ok else None)
        ops.append({"name": n.name, "op": nc.ops[n.name], "device": placement.assignment.get(n.name), "pts": pts})
    return {"devices": devices, "ops": ops, "figure": "modeled"}


def memory_section(program: Any, memory: Any) -> dict[str, Any]:
    """Every arena buffer as (start, end, offset, size) over the instruction order, per device; the planned
    arena, the naive total and the lower bound (max live bytes), and the live bytes at every position."""
    devices = {}
    npos = len(program.instrs)
    for d, dp in memory.devices.items():
        bufs = sorted((b for b in memory.buffers.values() if b.device == d), key=lambda b: (b.start, b.value))
        live = [0] * (npos + 1)
        for b in bufs:
            live[b.start] += b.size
            if b.end + 1 <= npos:
                live[b.end + 1] -= b.size
        acc, curve = 0, []
        for v in live[:npos]:
            acc += v
            curve.append(acc)
        devices[d] = {"arena_bytes": dp.arena_bytes, "naive_bytes": dp.naive_bytes,
                      "lower_bound_bytes": dp.lower_bound_bytes, "algorithm": dp.algorithm,
                      "candidates": dp.candidates,
                      "buffers": [[b.value, program.values[b.value].name, b.start, b.end, memory.offsets[b.value],
                                   b.size] for b in bufs],
                      "live_bytes": curve}
    return {"positions": npos, "devices": devices, "figure": "planned (exact, from the memory plan)"}


def schedule_section(program: Any, scheduled: Any, run_report: Any, label: str = "") -> dict[str, Any]:
    """The modeled list schedule (device lanes, switches, transfers) of a real partitioned run, plus the
    scheduler's switch counts and the run's measured host figures."""
    out: dict[str, Any] = {"instructions_by_device": program.count_by_device()}
    if scheduled is not None:
        out["switches_instr"] = {"graph_order": scheduled.naive_switches, "scheduled": scheduled.scheduled_switches}
    if run_report is None:
        out["available"] = False
        return out
    tl = run_report.timeline()
    out.update({
        "available": True, "label": label,
        "spans": [[s.kind, s.lane, s.name, s.start_s, s.dur_s, s.energy_j] for s in tl.spans],
        "modeled": {**tl.to_dict(), "by_device": tl.by_device()},
        "measured": {k: v for k, v in run_report.summary().items() if "measured" in k or k in ("calls", "transfers")},
        "calls_measured": [[c.partition, c.device, c.backend, c.nodes, c.start_s, c.measured_s, c.modeled_s]
                           for c in run_report.calls],
    })
    return out


def compile_sections(res: Any, run_report: Any, before_gm: torch.fx.GraphModule | None = None,
                     run_label: str = "") -> dict[str, Any]:
    """Every compile-side section from one :class:`~hetforge.compile.CompileResult` (and the run report of its
    partitioned program, for the timeline)."""
    out: dict[str, Any] = {}
    out["passes"] = passes_section(res.optimized, before_gm, res.gm, res.extra.get("quantize"))
    out["placement"], nc = placement_section(res.gm, res.soc, res.placement)
    out["pareto"] = pareto_section(res.gm, nc, res.placement, res.placement.objective)
    out["roofline"] = roofline_section(nc, res.soc, res.placement)
    out["memory"] = memory_section(res.program, res.memory)
    out["schedule"] = schedule_section(res.program, res.scheduled, run_report, run_label)
    return out


def soc_summary(soc: Any) -> list[dict[str, Any]]:
    return [{"name": d.name, "kind": d.kind, "tdp_w": d.tdp_w, "peak_fp32": d.peak("fp32"),
             "bandwidth": d.mem_bandwidth, "capacity": d.mem_capacity} for d in soc.devices]
