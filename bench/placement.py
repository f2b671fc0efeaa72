"""Placement quality (issue 7, part 3). Every energy/latency figure here is MODELED (hetforge.cost); solve
times are measured on this machine.

1. Search quality on ≤ 12 layers × 3 devices: PGSAM's front against the exhaustive front (hypervolume ratio)
   and against pymoo's NSGA-II given the same number of objective evaluations (hypervolume of everything
   NSGA-II evaluated, so it is credited with the best front it ever saw). Tables: the real per-layer tables of
   gpt2 and llama-110m on every 3-device SoC profile, and seeded random heterogeneous tables (seeds 100+,
   disjoint from the seeds the defaults were tuned on, 0-5), with and without memory limits.
2. PGSAM solve time for 32 layers (the Llama-3.1-8B-shaped graph's table on each 3-device SoC), measured.
3. Modeled energy and latency of rules, greedy, pgsam and all-on-one-device baselines on every shipped SoC
   for gpt2, llama-110m and the Llama-3.1-8B-shaped graph (prefill of --seq tokens).
4. Device switches on the 8B-shaped graph: FX (graph) order vs the backend's scheduled order.

Graphs go through the middle-end passes first (as `hetforge compile` does); the 8B-shaped graph lives on the
meta device, where constant folding cannot run, so it gets the other five passes.

    python bench/placement.py [--seq 16] [--out results.json] [--md tables.md] [--skip-8b]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np
import torch

from hetforge.errors import HetforgeError
from hetforge.hardware import list_socs, load_soc
from hetforge.placement import get_strategy
from hetforge.placement.costs import NodeCosts
from hetforge.placement.layer_costs import build_table
from hetforge.placement.layers import group_stages
from hetforge.placement.nsga import nsga2_search
from hetforge.placement.pareto import bounds, hypervolume
from hetforge.placement.pgsam_search import pgsam_search
from hetforge.placement.stages import LayerTable, exhaustive_front, random_table

SHAPED = "llama-3.1-8b-shape"


def graph_of(model: str, seq: int) -> torch.fx.GraphModule:
    from hetforge.passes import PASS_NAMES, optimize

    if model == SHAPED:
        from hetforge.models.shapes import capture_shaped

        cg = capture_shaped(SHAPED, seq=seq)
        return optimize(cg.gm, passes=[p for p in PASS_NAMES if p != "constant_fold"]).gm
    from hetforge.frontend import capture
    from hetforge.models.zoo import example_inputs, load_model

    lm = load_model(model)
    inputs = example_inputs(lm, seq=seq)
    return optimize(capture(lm.logits_module(), inputs, name=model).gm, inputs).gm


def quality_case(name: str, table: LayerTable, seed: int) -> dict:
    t0 = time.perf_counter()
    exact, space = exhaustive_front(table)
    t_ex = time.perf_counter() - t0
    res = pgsam_search(table, seed=seed)
    ns = nsga2_search(table, res.evaluations, seed=seed)
    if len(exact) == 0:
        return {"case": name, "feasible": False}
    lo, hi = bounds(exact.points(), *(a.points() for a in (res.archive, ns.archive) if len(a)))
    hx = hypervolume(exact.points(), lo, hi)
    hp = hypervolume(res.archive.points(), lo, hi) if len(res.archive) else 0.0
    hn = hypervolume(ns.archive.points(), lo, hi) if len(ns.archive) else 0.0
    return {"case": name, "feasible": True, "layers": table.num_layers, "devices": table.num_devices,
            "distinct_plans": space, "exact_front": len(exact), "pgsam_front": len(res.archive),
            "nsga_front": len(ns.archive), "evaluations": res.evaluations, "nsga_evaluations": ns.evaluations,
            "hv_ratio_pgsam": hp / hx if hx else 1.0, "hv_ratio_nsga": hn / hx if hx else 1.0,
            "momentum_accepts": res.momentum_accepts, "pgsam_s": res.seconds, "nsga_s": ns.seconds,
            "exhaustive_s": t_ex}


def tables_for(gm: torch.fx.GraphModule, soc_name: str) -> LayerTable:
    nc = NodeCosts.build(gm, load_soc(soc_name))
    return build_table(nc, group_stages(gm))[0]


STRATS = [("rules", "rules", {}), ("greedy-lat", "greedy", {"objective": "latency"}),
          ("greedy-energy", "greedy", {"objective": "energy"}), ("pgsam-energy", "pgsam", {"objective": "energy"}),
          ("pgsam-balanced", "pgsam", {"objective": "balanced"}),
          ("pgsam-latency", "pgsam", {"objective": "latency", "latency_mode": "total"}),
          ("pgsam-energy aux=cost", "pgsam", {"objective": "energy", "aux": "cost"}),
          ("pgsam-latency aux=cost", "pgsam", {"objective": "latency", "latency_mode": "total", "aux": "cost"})]


def strategy_rows(model: str, gm: torch.fx.GraphModule, socs: list[str]) -> list[dict]:
    rows = []
    for s in socs:
        soc = load_soc(s)
        plans = STRATS + [(f"all-{d.name}", "single", {"device": d.name}) for d in soc.devices]
        for label, strat, kw in plans:
            t0 = time.perf_counter()
            try:
                pl = get_strategy(strat)(gm, soc, **kw)
            except HetforgeError as e:
                rows.append({"model": model, "soc": s, "plan": label, "error": str(e).splitlines()[0][:200]})
                continue
            c = pl.extra["cost"]
            rows.append({"model": model, "soc": s, "plan": label, "time_s": c["time_s"], "energy_j": c["energy_j"],
                         "transfers": c["transfers"], "fallbacks": len(pl.extra["fallbacks"]),
                         "counts": pl.counts(), "layer_plan": pl.extra.get("plan"),
                         "solve_s": time.perf_counter() - t0})
    return rows


def switch_rows(gm: torch.fx.GraphModule, socs: list[str]) -> list[dict]:
    from hetforge.lower import lower
    from hetforge.schedule import schedule

    rows = []
    for s in socs:
        soc = load_soc(s)
        for label, strat, kw in [("support", "support", {}), ("rules", "rules", {}),
                                 ("greedy-lat", "greedy", {"objective": "latency"}),
                                 ("pgsam-balanced", "pgsam", {"objective": "balanced"})]:
            try:
                pl = get_strategy(strat)(gm, soc, **kw)
                sr = schedule(lower(gm, pl, soc).program)
            except HetforgeError as e:
                rows.append({"soc": s, "plan": label, "error": str(e).splitlines()[0][:200]})
                continue
            rows.append({"soc": s, "plan": label, "fx_order": sr.naive_switches, "scheduled": sr.scheduled_switches})
    return rows


def _cell(r: dict) -> str:
    if "error" in r:
        return "does not fit" if "memory" in r["error"] else "error"
    return f"{r['energy_j'] * 1e3:.1f} / {r['time_s'] * 1e3:.2f}"


def markdown(res: dict) -> str:
    out = []
    q = [c for c in res["quality"] if c.get("feasible")]
    out.append("### 1. Search quality (≤ 12 layers × 3 devices; hypervolume ratio to the exhaustive front)\n")
    out.append("| case | plans | exact front | PGSAM front | evals | HV PGSAM/exact | HV NSGA-II/exact "
               "| PGSAM ≥ NSGA-II |")
    out.append("|---|---|---|---|---|---|---|---|")
    for c in q:
        ok = "yes" if c["hv_ratio_pgsam"] >= c["hv_ratio_nsga"] - 1e-12 else "**no**"
        out.append(f"| {c['case']} | {c['distinct_plans']} | {c['exact_front']} | {c['pgsam_front']} | "
                   f"{c['evaluations']} | {c['hv_ratio_pgsam']:.4f} | {c['hv_ratio_nsga']:.4f} | {ok} |")
    s = res["quality_summary"]
    out.append(f"\n{s['cases']} cases: PGSAM/exact min {s['min_pgsam']:.4f}, mean {s['mean_pgsam']:.4f}; "
               f"NSGA-II/exact min {s['min_nsga']:.4f}, mean {s['mean_nsga']:.4f}; PGSAM ≥ NSGA-II in "
               f"{s['pgsam_ge_nsga']}/{s['cases']}; PGSAM ≥ 0.99 in {s['pgsam_ge_099']}/{s['cases']}.\n")
    out.append("### 2. PGSAM solve time, 32 layers (measured, median of 3)\n")
    out.append("| table | seconds | evaluations | front size |")
    out.append("|---|---|---|---|")
    for r in res["solve32"]:
        out.append(f"| {r['case']} | {r['seconds']:.3f} | {r['evaluations']} | {r['front']} |")
    out.append("")
    by_model: dict[str, list[dict]] = {}
    for r in res["strategies"]:
        by_model.setdefault(r["model"], []).append(r)
    for model, rows in by_model.items():
        labels = [lb for lb, _, _ in STRATS] + ["all-cpu", "all-gpu", "all-npu"]
        out.append(f"### 3. {model}: modeled energy (mJ) / latency (ms), prefill of {res['seq']} tokens\n")
        out.append("| SoC | " + " | ".join(labels) + " |")
        out.append("|---" * (len(labels) + 1) + "|")
        for soc in dict.fromkeys(r["soc"] for r in rows):
            cells = []
            for lb in labels:
                r = next((x for x in rows if x["soc"] == soc and x["plan"] == lb), None)
                cells.append(_cell(r) if r else "–")
            out.append(f"| {soc} | " + " | ".join(cells) + " |")
        out.append("")
    if res.get("switches"):
        out.append("### 4. Device switches on the Llama-3.1-8B-shaped graph (FX order → scheduled)\n")
        out.append("| SoC | plan | FX order | scheduled |")
        out.append("|---|---|---|---|")
        for r in res["switches"]:
            if "error" in r:
                out.append(f"| {r['soc']} | {r['plan']} | {r['error'][:60]} | |")
            else:
                out.append(f"| {r['soc']} | {r['plan']} | {r['fx_order']} | {r['scheduled']} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--random-cases", type=int, default=10)
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t_all = time.perf_counter()
    socs = list_socs()
    tri = [s for s in socs if len(load_soc(s).devices) == 3]
    res: dict = {"seq": args.seq, "host": platform.processor() or platform.machine(), "python": sys.version.split()[0],
                 "torch": torch.__version__, "quality": [], "solve32": [], "strategies": [], "switches": []}
    graphs = {m: graph_of(m, args.seq) for m in ("gpt2", "llama-110m")}
    print(f"graphs ready {time.perf_counter() - t_all:.1f}s", flush=True)
    for m, gm in graphs.items():
        for s in tri:
            res["quality"].append(quality_case(f"{m} on {s}", tables_for(gm, s), seed=0))
    for i in range(args.random_cases):
        for cap in (1.0, 0.5):
            res["quality"].append(quality_case(f"random seed {100 + i}, capacity {cap:g}",
                                               random_table(12, 3, seed=100 + i, capacity_frac=cap), seed=100 + i))
    print(f"quality done {time.perf_counter() - t_all:.1f}s", flush=True)
    q = [c for c in res["quality"] if c.get("feasible")]
    res["quality_summary"] = {
        "cases": len(q), "min_pgsam": min(c["hv_ratio_pgsam"] for c in q),
        "mean_pgsam": float(np.mean([c["hv_ratio_pgsam"] for c in q])),
        "min_nsga": min(c["hv_ratio_nsga"] for c in q), "mean_nsga": float(np.mean([c["hv_ratio_nsga"] for c in q])),
        "pgsam_ge_nsga": sum(c["hv_ratio_pgsam"] >= c["hv_ratio_nsga"] - 1e-12 for c in q),
        "pgsam_ge_099": sum(c["hv_ratio_pgsam"] >= 0.99 for c in q)}
    if not args.skip_8b:
        graphs[SHAPED] = graph_of(SHAPED, args.seq)
        print(f"8B-shaped graph ready {time.perf_counter() - t_all:.1f}s", flush=True)
        for s in tri:
            table = tables_for(graphs[SHAPED], s)
            runs = [pgsam_search(table, seed=k) for k in range(3)]
            res["solve32"].append({"case": f"{SHAPED} on {s}", "seconds": statistics.median(r.seconds for r in runs),
                                   "evaluations": runs[0].evaluations, "front": len(runs[0].archive)})
    runs = [pgsam_search(random_table(32, 3, seed=k), seed=k) for k in range(3)]
    res["solve32"].append({"case": "random 32 × 3", "seconds": statistics.median(r.seconds for r in runs),
                           "evaluations": runs[0].evaluations, "front": len(runs[0].archive)})
    for m, gm in graphs.items():
        res["strategies"] += strategy_rows(m, gm, socs)
        print(f"strategies {m} done {time.perf_counter() - t_all:.1f}s", flush=True)
    if SHAPED in graphs:
        res["switches"] = switch_rows(graphs[SHAPED], ["jetson-agx-orin", "intel-core-ultra-155h", "test-npu-gaps"])
    res["seconds"] = time.perf_counter() - t_all
    md = markdown(res)
    print(md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    print(f"total {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
