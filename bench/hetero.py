"""Heterogeneous execution on this host: what device switches and transfers really cost (measured).

For each model and sequence length, one process builds these plans and then times them interleaved
(round-robin, so machine drift hits all alike), reporting median and min wall time per plan:

* ``all torch-cpu``      — every node on the CPU, hetforge executor (1 backend call);
* ``alternate t|t``      — layers alternate cpu / gpu, both run by torch-cpu (L+1 calls, L switches), 155H links
  (real copies), and the same on apple-m2-max (``, unified``: zero-copy hand-offs);
* ``all openvino``       — every node on OpenVINO's CPU plugin at f32 (1 call);
* ``alternate ov|ov``    — layers alternate between two OpenVINO-run devices (L+1 compiled models);
* ``stages t|ov``        — layers 0..L/2-1 on torch-cpu, L/2..L-1 + head on OpenVINO (2 calls, 1 switch; the
  logits come back over the link);
* ``alternate t|ov``     — layers alternate torch-cpu / OpenVINO (L+1 calls, L switches), 155H links (real copies);
* ``alternate t|ov, unified`` — the same on apple-m2-max, whose links are unified: hand-offs are zero-copy,
  so the difference to the row above is the copies alone;
* ``op-level gaps``      — ``support`` placement on ``test-npu-gaps`` (an NPU without slice/cat/neg/softmax)
  with the NPU run on torch-cpu, in graph order vs scheduled order: many small partitions and what the
  switch-minimizing scheduler saves.

The "gpu"/"npu" device of each plan is bound to a real backend on this host (OpenVINO CPU plugin or torch-cpu) as
an emulated device, so its partitions run for real; modeled figures (the SoC's cost model) are printed apart.

Usage: python bench/hetero.py [--models gpt2 llama-110m] [--seqs 128 1] [--rounds 7] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hetforge.backends.mapping import resolve
from hetforge.frontend import capture
from hetforge.hardware import load_soc
from hetforge.hetero.layouts import layer_assignment
from hetforge.hetero.pipeline import partitions_from_placement
from hetforge.hetero.runner import HeteroExecutable, RunReport, build
from hetforge.hetero.session import kl_threshold
from hetforge.models.zoo import example_inputs, load_model
from hetforge.verify import compare_logits

OV = "emulated:openvino:CPU"


@dataclass
class Plan:
    name: str
    soc: str
    layout: str | None
    overrides: dict[str, str]
    strategy: tuple[str, dict] | None = None
    scheduled: bool = True
    exe: HeteroExecutable | None = None
    compile_s: float = 0.0
    reports: list[RunReport] = field(default_factory=list)
    kl: float = 0.0
    kl_ok: bool = False
    sched_switches: tuple[int, int] = (0, 0)


def plans(with_gaps: bool) -> list[Plan]:
    soc = "intel-core-ultra-155h"
    out = [
        Plan("all torch-cpu", soc, "all:cpu", {}),
        Plan("alternate t|t", soc, "alternate:cpu,gpu", {"gpu": "emulated:torch-cpu"}),
        Plan("alternate t|t, unified", "apple-m2-max", "alternate:cpu,gpu", {"gpu": "emulated:torch-cpu"}),
        Plan("all openvino", soc, "all:cpu", {"cpu": "openvino:CPU"}),
        Plan("alternate ov|ov", soc, "alternate:cpu,gpu", {"cpu": "openvino:CPU", "gpu": OV}),
        Plan("stages t|ov", soc, "stages:cpu,gpu", {"gpu": OV}),
        Plan("alternate t|ov", soc, "alternate:cpu,gpu", {"gpu": OV}),
        Plan("alternate t|ov, unified", "apple-m2-max", "alternate:cpu,gpu", {"gpu": OV}),
    ]
    if with_gaps:
        for sched in (False, True):
            out.append(Plan(f"op-level gaps, {'scheduled' if sched else 'graph order'}", "test-npu-gaps", None,
                            {"npu": "emulated:torch-cpu"}, ("support", {"prefer": "npu"}), sched))
    return out


def prepare(plan: Plan, cg, inputs, eager_ref) -> None:
    from hetforge.placement import get_strategy

    soc = load_soc(plan.soc)
    if plan.layout is not None:
        assignment = layer_assignment(cg.gm, plan.layout, soc.device_names)
    else:
        name, opts = plan.strategy
        assignment = get_strategy(name)(cg.gm, soc, **opts).assignment
    pp = partitions_from_placement(cg.gm, assignment, soc, scheduled=plan.scheduled)
    plan.sched_switches = (pp.naive_switches, pp.scheduled_switches)
    bindings = resolve(soc, plan.overrides)
    t0 = time.perf_counter()
    plan.exe, _ = build(pp.partitions, soc, bindings)
    plan.compile_s = time.perf_counter() - t0
    out, _ = plan.exe.run(inputs)  # warm-up (first OpenVINO inference allocates)
    fid = compare_logits(eager_ref, out, kl_threshold=kl_threshold(bindings, pp.partitions.devices()))
    plan.kl, plan.kl_ok = fid.kl_max, fid.passed


def row(plan: Plan) -> dict:
    walls = [r.wall_s for r in plan.reports]
    med = sorted(plan.reports, key=lambda r: r.wall_s)[len(plan.reports) // 2]
    s = med.summary()
    return {
        "plan": plan.name, "soc": plan.soc, "median_ms": 1e3 * statistics.median(walls), "min_ms": 1e3 * min(walls),
        "calls": s["calls"], "switches": s["switches"], "transfers": s["transfers"], "copies": s["transfer_copies"],
        "zero_copy": s["transfer_zero_copy"], "copied_kib": s["transfer_bytes_copied"] / 1024,
        "transfer_ms": 1e3 * statistics.median(sum(t.measured_s for t in r.transfers) for r in plan.reports),
        "calls_ms": 1e3 * statistics.median(sum(c.measured_s for c in r.calls) for r in plan.reports),
        "modeled_ms": 1e3 * s["modeled_s"], "modeled_mj": 1e3 * s["modeled_j"], "compile_s": plan.compile_s,
        "kl_max": plan.kl, "kl_ok": plan.kl_ok, "naive_switches": plan.sched_switches[0],
        "scheduled_switches": plan.sched_switches[1],
    }


def bench_model(name: str, seq: int, rounds: int, with_gaps: bool) -> list[dict]:
    loaded = load_model(name)
    inputs = example_inputs(loaded, seq=seq)
    cg = capture(loaded.logits_module(), inputs, name=name)
    with torch.no_grad():
        ref = loaded.logits_module()(*inputs)
    todo = plans(with_gaps)
    for p in todo:
        print(f"[{name} seq {seq}] building {p.name} ...", file=sys.stderr, flush=True)
        prepare(p, cg, inputs, ref)
    for _ in range(rounds):
        for p in todo:
            p.reports.append(p.exe.run(inputs)[1])
    return [{"model": name, "seq": seq, **row(p)} for p in todo]


def per_switch(rows: list[dict]) -> list[dict]:
    """Measured cost of one switch: (alternating plan − the same backend(s) in one call) / extra switches.

    Same work, same backends, only the number of partitions differs: torch-cpu ↔ torch-cpu (155H links: real
    copies; M2 Max links: zero-copy) against all torch-cpu, and OpenVINO ↔ OpenVINO against all OpenVINO.
    """
    by = {r["plan"]: r for r in rows}
    out = []
    for alt, base in (("alternate t|t", "all torch-cpu"), ("alternate t|t, unified", "all torch-cpu"),
                      ("alternate ov|ov", "all openvino")):
        a, b = by[alt], by[base]
        extra = a["switches"] - b["switches"]
        out.append({"pair": f"{alt} vs {base}", "extra_switches": extra,
                    "ms_per_switch_median": (a["median_ms"] - b["median_ms"]) / extra,
                    "ms_per_switch_min": (a["min_ms"] - b["min_ms"]) / extra,
                    "transfer_ms_per_switch": a["transfer_ms"] / extra})
    return out


def write_atomic(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama-110m"])
    ap.add_argument("--seqs", nargs="+", type=int, default=[128, 1])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-gaps", action="store_true", help="skip the op-level-gaps plans")
    ap.add_argument("--out", type=Path, default=None, help="also write all rows as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows, switch = [], []
    for name in args.models:
        for seq in args.seqs:
            got = bench_model(name, seq, args.rounds, not args.no_gaps)
            rows += got
            switch += [{"model": name, "seq": seq, **x} for x in per_switch(got)]
    import openvino

    machine = (f"{platform.machine()} {os.cpu_count()} cores visible, {torch.get_num_threads()} threads, torch "
               f"{torch.__version__}, OpenVINO {openvino.__version__}, load average {os.getloadavg()[0]:.1f}; "
               f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"machine: {machine}\n")
    print("| model | seq | plan | latency ms median / min (measured) | calls | switches | transfers (copy/zero) | "
          "KiB copied | transfer ms (measured) | calls ms (measured) | modeled ms / mJ (SoC) | KL max |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['seq']} | {r['plan']} | {r['median_ms']:.1f} / {r['min_ms']:.1f} | {r['calls']} | "
              f"{r['switches']} | {r['transfers']} ({r['copies']}/{r['zero_copy']}) | {r['copied_kib']:.0f} | "
              f"{r['transfer_ms']:.3f} | {r['calls_ms']:.1f} | {r['modeled_ms']:.3f} / {r['modeled_mj']:.2f} | "
              f"{r['kl_max']:.1e}{'' if r['kl_ok'] else ' FAIL'} |")
    print("\n| model | seq | comparison (same work) | extra switches | ms per switch, median | ms per switch, min | "
          "of which transfers ms |")
    print("|---|---|---|---|---|---|---|")
    for s in switch:
        print(f"| {s['model']} | {s['seq']} | {s['pair']} | {s['extra_switches']} | {s['ms_per_switch_median']:.2f} | "
              f"{s['ms_per_switch_min']:.2f} | {s['transfer_ms_per_switch']:.3f} |")
    if args.out is not None:
        write_atomic(args.out, {"machine": machine, "rows": rows, "per_switch": switch})


if __name__ == "__main__":
    main()
