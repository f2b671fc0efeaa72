"""How well does the cost model predict per-node CPU time on this host? (issue 6, part 4)

Measures every ``call_function`` node of ``gpt2`` and ``llama-110m`` (prefill ``--seq`` tokens and a one-token
shape) on the CPU with a small timing ``torch.fx.Interpreter`` (each node timed once per pass, ``--passes``
passes after one warm-up pass, minimum per node by default (``--stat median`` for the median) — measured),
predicts the same nodes with the calibrated ``host`` profile (modeled), and reports:

* per cost-group MAPE (all nodes, and nodes measured > 50 µs),
* the error on the 20 most expensive nodes,
* the whole-program error  (Σ predicted − Σ measured) / Σ measured,

both for the plain roofline (efficiency factors and fixed overheads removed: "before") and with the per-op-group
factors and overheads fitted by calibration ("after"). The calibration is run first (same thread count)
unless ``--profile`` names a file.

    python bench/costmodel.py [--threads 1] [--clock thread|wall] [--seq 128] [--passes 15] [--stat min|median]
                              [--profile FILE] [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from hetforge.cost import analyze
from hetforge.frontend import capture
from hetforge.hardware import load_file, save_spec
from hetforge.hardware.calibrate import CLOCKS, host_spec, measure
from hetforge.hardware.host import cpu_count, cpu_name
from hetforge.hardware.profile import SocProfile
from hetforge.models.zoo import example_inputs, load_model

BIG_S = 50e-6


class TimingInterpreter(torch.fx.Interpreter):
    """Runs the graph node by node and records the time of every ``call_function`` (measured).

    ``clock`` is ``time.perf_counter`` (wall) or ``time.thread_time`` (CPU time of this thread: with one torch
    thread the op runs here, and time lost to other processes on a shared host is not counted).
    """

    def __init__(self, gm: torch.fx.GraphModule, clock=time.perf_counter):
        super().__init__(gm)
        self.clock = clock
        self.times: dict[str, list[float]] = {}

    def run_node(self, n: torch.fx.Node):
        if n.op != "call_function":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        t0 = self.clock()
        out = n.target(*args, **kwargs)
        self.times.setdefault(n.name, []).append(self.clock() - t0)
        return out


def measure_nodes(gm: torch.fx.GraphModule, inputs, passes: int, stat=min,
                  clock=time.perf_counter) -> tuple[dict[str, float], float]:
    """Per-node time (``stat`` over ``passes`` timed passes after one warm-up) and the same statistic of plain runs
    (the plain runs always on the wall clock)."""
    with torch.no_grad():
        TimingInterpreter(gm, clock).run(*inputs)
        ti = TimingInterpreter(gm, clock)
        for _ in range(passes):
            ti.run(*inputs)
        e2e = []
        for _ in range(passes):
            t0 = time.perf_counter()
            gm(*inputs)
            e2e.append(time.perf_counter() - t0)
    return {k: stat(v) for k, v in ti.times.items()}, stat(e2e)


def without_efficiency(soc: SocProfile) -> SocProfile:
    devs = [dataclasses.replace(d, efficiency={}, overhead_s={}) for d in soc.devices]
    return dataclasses.replace(soc, devices=devs)


def ape(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas


def metrics(rows: list[dict], key: str) -> dict:
    """MAPE per cost group, over big nodes, top-20 nodes, and whole-program error for prediction ``key``."""
    out: dict = {}
    groups = sorted({r["group"] for r in rows})
    out["mape_by_group"] = {}
    for g in groups:
        rs = [r for r in rows if r["group"] == g]
        big = [r for r in rs if r["measured_s"] > BIG_S]
        out["mape_by_group"][g] = {
            "nodes": len(rs), "mape_all": statistics.mean(ape(r[key], r["measured_s"]) for r in rs),
            "nodes_gt_50us": len(big),
            "mape_gt_50us": statistics.mean(ape(r[key], r["measured_s"]) for r in big) if big else None,
            "measured_s": sum(r["measured_s"] for r in rs), "predicted_s": sum(r[key] for r in rs)}
    big = [r for r in rows if r["measured_s"] > BIG_S]
    out["mape_gt_50us"] = statistics.mean(ape(r[key], r["measured_s"]) for r in big) if big else None
    out["nodes_gt_50us"] = len(big)
    top = sorted(rows, key=lambda r: -r["measured_s"])[:20]
    out["top20_mape"] = statistics.mean(ape(r[key], r["measured_s"]) for r in top)
    out["top20"] = [{"node": r["node"], "op": r["op"], "measured_s": r["measured_s"], "predicted_s": r[key],
                     "error": (r[key] - r["measured_s"]) / r["measured_s"]} for r in top]
    meas, pred = sum(r["measured_s"] for r in rows), sum(r[key] for r in rows)
    out["program_measured_s"], out["program_predicted_s"] = meas, pred
    out["program_error"] = (pred - meas) / meas
    return out


STATS = {"min": min, "median": statistics.median}


def run_case(model: str, seq: int, soc: SocProfile, plain: SocProfile, passes: int, stat: str, clock: str) -> dict:
    loaded = load_model(model)
    inputs = example_inputs(loaded, seq=seq)
    cg = capture(loaded.logits_module(), inputs, name=model)
    meas, e2e = measure_nodes(cg.gm, inputs, passes, STATS[stat], CLOCKS[clock])
    after, before = analyze(cg.gm, soc), analyze(cg.gm, plain)
    rows = []
    for na, nb in zip(after.nodes, before.nodes, strict=True):
        ca, cb = na.costs["cpu"], nb.costs["cpu"]
        rows.append({"node": na.node, "op": na.op, "group": ca.group, "measured_s": max(meas[na.node], 1e-9),
                     "predicted_s": ca.time_s, "plain_s": cb.time_s, "bound": ca.bound})
    return {"model": model, "seq": seq, "nodes": len(rows), "plain_run_measured_s": e2e,
            "after": metrics(rows, "predicted_s"), "before": metrics(rows, "plain_s"), "unknown_ops": after.unknown_ops}


def fmt_pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def report(res: dict) -> str:
    lines = [f"machine: {res['machine']}; torch threads {res['threads']}; {res['passes']} passes, per-node "
             f"{res['stat']} of {res['clock']} time; load average at end {res['load_average_at_end']}", ""]
    lines.append("| model | shape | nodes | measured Σ nodes (ms) | modeled before (ms) | modeled after (ms) | "
                 "program error before | after | MAPE >50µs before | after | top-20 MAPE before | after |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in res["cases"]:
        b, a = c["before"], c["after"]
        lines.append(f"| {c['model']} | seq {c['seq']} | {c['nodes']} | {a['program_measured_s'] * 1e3:.2f} | "
                     f"{b['program_predicted_s'] * 1e3:.2f} | {a['program_predicted_s'] * 1e3:.2f} | "
                     f"{fmt_pct(b['program_error'])} | {fmt_pct(a['program_error'])} | {fmt_pct(b['mape_gt_50us'])} "
                     f"({b['nodes_gt_50us']} nodes) | {fmt_pct(a['mape_gt_50us'])} | {fmt_pct(b['top20_mape'])} | "
                     f"{fmt_pct(a['top20_mape'])} |")
    lines += ["", "| model | shape | group | nodes | nodes >50µs | measured (ms) | modeled after (ms) | "
              "MAPE all before | after | MAPE >50µs before | after |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["cases"]:
        for g, a in c["after"]["mape_by_group"].items():
            b = c["before"]["mape_by_group"][g]
            lines.append(f"| {c['model']} | seq {c['seq']} | {g} | {a['nodes']} | {a['nodes_gt_50us']} | "
                         f"{a['measured_s'] * 1e3:.3f} | {a['predicted_s'] * 1e3:.3f} | {fmt_pct(b['mape_all'])} | "
                         f"{fmt_pct(a['mape_all'])} | {fmt_pct(b['mape_gt_50us'])} | {fmt_pct(a['mape_gt_50us'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="thread",
                    help="thread: CPU time of the calling thread (needs --threads 1), wall: perf_counter")
    ap.add_argument("--stat", choices=sorted(STATS), default="min",
                    help="per-node statistic over passes (min: the host is shared and load only adds time)")
    ap.add_argument("--models", default="gpt2,llama-110m")
    ap.add_argument("--profile", type=Path, default=None, help="use this host profile instead of calibrating")
    ap.add_argument("--quick-calibration", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench/out/costmodel.json"))
    a = ap.parse_args(argv)
    if a.clock == "thread" and a.threads != 1:
        ap.error("--clock thread needs --threads 1")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.profile is None:
        t0 = time.perf_counter()
        spec = host_spec(measure(quick=a.quick_calibration, threads=a.threads, clock=a.clock), a.quick_calibration)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        prof_path = save_spec(spec, a.out.with_name(a.out.stem + "-host.json"))
        print(f"calibrated in {time.perf_counter() - t0:.1f} s (measured) -> {prof_path}", file=sys.stderr)
    else:
        prof_path = a.profile
    soc = load_file(prof_path)
    plain = without_efficiency(soc)
    cases = []
    for model in a.models.split(","):
        for seq in (a.seq, 1):
            t0 = time.perf_counter()
            cases.append(run_case(model, seq, soc, plain, a.passes, a.stat, a.clock))
            print(f"{model} seq {seq}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    res = {"machine": f"{cpu_name()}, {cpu_count()} cores, {platform.system()}", "threads": a.threads,
           "passes": a.passes, "stat": a.stat, "clock": a.clock, "load_average_at_end": list(os.getloadavg()),
           "profile": str(prof_path), "efficiency": soc.devices[0].efficiency, "overhead_s": soc.devices[0].overhead_s,
           "host": soc.to_dict(), "command": "python bench/costmodel.py " + " ".join(argv or sys.argv[1:]),
           "cases": cases}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(a.out.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(a.out)
    print(report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
