"""Backend benchmarks: memory plan vs lower bound, device switches, heuristic vs exact, prefill latency.

Usage: python bench/backend.py [--sections memory switches dags latency kernels] [--models gpt2 llama-110m]
                               [--seq 128] [--rounds 7] [--seeds 300] [--threads 1] [--out JSON] [--md PAGE]
       python bench/backend.py --from-json --out docs/bench/backend.json --md docs/bench/backend.md

* memory   — per device: naive bytes, planned arena, lower bound (exact figures from the plan), passes on/off.
* switches — test-npu-gaps + "support" placement: switches in graph (FX) order, scheduled, exact minimum.
* dags     — random DAGs of 10..40 instructions over 2-3 devices: scheduled vs exact minimum switches.
* latency  — prefill [1, seq] fp32: eager HF module vs the captured graph vs the executor (arena / fast),
             interleaved round by round in one process (measured wall time).
* kernels  — writing into an arena slice vs letting the op allocate, per op (measured).
Every printed figure is measured (wall time) or exact (counts, bytes from the plan); nothing is modeled.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _pages import end_meta, meta_lines, page_from_json, run_meta, write_result

from hetforge.compile import compile_graph
from hetforge.frontend import capture
from hetforge.models.zoo import example_inputs, load_model
from hetforge.schedule import SearchTooLarge, count_switches, dependencies, exact_min_switches, schedule_graph

_CACHE: dict[tuple[str, int], Any] = {}
SECTIONS = ("memory", "switches", "dags", "latency", "kernels")
KERNEL_REPS = 20  # calls per kernel sample: thread CPU time has ~ms granularity on some kernels


def captured(name: str, seq: int):
    if (name, seq) not in _CACHE:
        loaded = load_model(name)
        inputs = example_inputs(loaded, seq=seq)
        module = loaded.logits_module()
        _CACHE[(name, seq)] = (module, inputs, capture(module, inputs, name=name))
    return _CACHE[(name, seq)]


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def bench_memory(models: list[str], seq: int) -> list[dict]:
    rows = []
    print("\n### Memory plan (exact bytes from the plan; soc host, strategy support)\n")
    print("| model | passes | buffers | naive MiB | planned MiB | lower bound MiB | planned ÷ bound | algorithm | "
          "plan s (measured) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in models:
        _, inputs, cg = captured(name, seq)
        for passes in (False, True):
            res = compile_graph(cg.gm, soc="host", example_inputs=inputs, passes=passes, build=False, name=name)
            dp = res.memory.devices["cpu"]
            ratio = dp.arena_bytes / dp.lower_bound_bytes if dp.lower_bound_bytes else 1.0
            rows.append({"model": name, "passes": passes, "buffers": dp.buffers, "naive_bytes": dp.naive_bytes,
                         "planned_bytes": dp.arena_bytes, "lower_bound_bytes": dp.lower_bound_bytes, "ratio": ratio,
                         "algorithm": dp.algorithm, "candidates": dp.candidates,
                         "seconds": res.seconds["memory"]})
            print(f"| {name} | {'on' if passes else 'off'} | {dp.buffers} | {mib(dp.naive_bytes)} | "
                  f"{mib(dp.arena_bytes)} | {mib(dp.lower_bound_bytes)} | {ratio:.3f} | {dp.algorithm} | "
                  f"{res.seconds['memory']:.3f} |")
    return rows


def bench_switches(models: list[str], seq: int) -> list[dict]:
    rows = []
    print("\n### Device switches on test-npu-gaps (counts; strategy support)\n")
    print("| model | passes | instructions | transfers | FX order | scheduled | reduction | exact minimum | "
          "schedule s (measured) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in models:
        _, inputs, cg = captured(name, seq)
        for passes in (False, True):
            res = compile_graph(cg.gm, soc="test-npu-gaps", example_inputs=inputs, passes=passes, build=False,
                                name=name)
            s = res.scheduled
            p = res.lowered.program
            try:
                exact: int | None = exact_min_switches({i.id: i.device for i in p.instrs}, dependencies(p),
                                                       max_states=200_000)[0]
            except SearchTooLarge:
                exact = None
            red = 1 - s.scheduled_switches / s.naive_switches if s.naive_switches else 0.0
            rows.append({"model": name, "passes": passes, "instructions": len(p.instrs),
                         "transfers": len(p.transfers()), "naive": s.naive_switches,
                         "scheduled": s.scheduled_switches, "reduction": red, "exact": exact,
                         "seconds": res.seconds["schedule"]})
            print(f"| {name} | {'on' if passes else 'off'} | {len(p.instrs)} | {len(p.transfers())} | "
                  f"{s.naive_switches} | {s.scheduled_switches} | {red:.0%} | "
                  f"{exact if exact is not None else 'n/a'} | {res.seconds['schedule']:.3f} |")
    return rows


def random_dag(seed: int) -> tuple[dict[int, str], dict[int, set[int]]]:
    rng = random.Random(seed)
    n = rng.randint(10, 40)
    names = "abc"[: rng.choice([2, 3])]
    p_edge = rng.choice([0.05, 0.1, 0.2, 0.3])
    dev = {i: rng.choice(names) for i in range(n)}
    preds = {i: {j for j in range(i) if rng.random() < p_edge} for i in range(n)}
    return dev, preds


def bench_dags(seeds: int) -> dict:
    print(f"\n### Random DAGs, 10-40 instructions, 2-3 devices, {seeds} seeds (counts)\n")
    print("| scheduler | total switches | exact total | ratio | seeds at optimum | seeds within 10% | worst gap |")
    print("|---|---|---|---|---|---|---|")
    out = {}
    exact = []
    dags = [random_dag(s) for s in range(seeds)]
    for dev, preds in dags:
        exact.append(exact_min_switches(dev, preds)[0])
    fx = [count_switches([dev[n] for n in sorted(dev)]) for dev, _ in dags]
    variants = {"graph order": None, "greedy lookahead 2": {"beam": 0, "lookahead": 2},
                "beam 4": {"beam": 4}, "beam 8 (default)": {"beam": 8}}
    for label, kw in variants.items():
        if kw is None:
            got = fx
        else:
            got = [count_switches([dev[n] for n in schedule_graph(dev, preds, **kw)]) for dev, preds in dags]
        tot, ex = sum(got), sum(exact)
        at = sum(1 for g, e in zip(got, exact, strict=True) if g == e)
        within = sum(1 for g, e in zip(got, exact, strict=True) if g <= 1.1 * e)
        worst = max(g - e for g, e in zip(got, exact, strict=True))
        out[label] = {"total": tot, "exact_total": ex, "ratio": tot / ex, "at_optimum": at, "within_10pct": within,
                      "worst_gap": worst}
        print(f"| {label} | {tot} | {ex} | {tot / ex:.3f} | {at}/{seeds} | {within}/{seeds} | {worst} |")
    return out


def _time(fn, inputs) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of one call. With one torch thread all kernels run on
    the calling thread, so CPU time is what the call itself cost, whatever else shares the machine."""
    c0, t0 = time.thread_time(), time.perf_counter()
    fn(*inputs)
    return time.perf_counter() - t0, time.thread_time() - c0


def bench_latency(models: list[str], seq: int, rounds: int) -> list[dict]:
    rows = []
    print(f"\n### Prefill latency [1, {seq}] fp32, {torch.get_num_threads()} thread(s), {rounds} interleaved rounds "
          "(measured wall time and thread CPU time)\n")
    print("| model | variant | wall median ms | wall min ms | wall paired ratio | CPU median ms | CPU min ms | "
          "CPU paired ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name in models:
        module, inputs, cg = captured(name, seq)
        variants = {"eager (HF module)": module, "captured graph (fx)": cg.gm}
        for passes in (True, False):
            for mode in ("arena", "fast"):
                res = compile_graph(cg.gm, soc="host", example_inputs=inputs, passes=passes, mode=mode, name=name)
                variants[f"executor {mode}, passes {'on' if passes else 'off'}"] = res.executable.run_flat
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
        with torch.no_grad():
            for fn in variants.values():  # warm-up
                fn(*inputs)
            for r in range(rounds):
                keys = list(variants)
                if r % 2:
                    keys.reverse()  # alternate who goes first
                for k in keys:
                    times[k].append(_time(variants[k], inputs))
        eager = times["eager (HF module)"]
        for k, ts in times.items():
            row: dict[str, Any] = {"model": name, "variant": k, "samples_wall_cpu": ts}
            cells = []
            for j, label in ((0, "wall"), (1, "cpu")):
                xs = [t[j] for t in ts]
                paired = statistics.median(t[j] / e[j] for t, e in zip(ts, eager, strict=True))
                row.update({f"{label}_median_s": statistics.median(xs), f"{label}_min_s": min(xs),
                            f"{label}_paired_ratio": paired})
                cells += [f"{statistics.median(xs) * 1e3:.1f}", f"{min(xs) * 1e3:.1f}", f"{paired:.3f}"]
            rows.append(row)
            print(f"| {name} | {k} | " + " | ".join(cells) + " |")
    return rows


def bench_kernels(seq: int, rounds: int) -> list[dict]:
    """The same op three ways: functional (allocates), out= into a preallocated slice, functional + copy."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq, 768, generator=g)
    w = torch.randn(768 * 4, 768, generator=g)
    b = torch.randn(768 * 4, generator=g)
    wt = w.t()
    out = torch.empty(1, seq, 768 * 4)
    out2d = out.view(-1, 768 * 4)
    x2d = x.view(-1, 768)
    lnw, lnb = torch.ones(768), torch.zeros(768)
    ln_out = torch.empty(1, seq, 768)
    q = torch.randn(1, 12, seq, 64, generator=g)
    sd_out = torch.empty(1, 12, seq, 64)
    aten = torch.ops.aten
    cases = {
        "linear 768→3072: functional": lambda: aten.linear.default(x, w, b),
        "linear 768→3072: aten.linear.out": lambda: aten.linear.out(x, w, b, out=out),
        "linear 768→3072: addmm.out on 2-D views (executor)": lambda: aten.addmm.out(b, x2d, wt, out=out2d),
        "gelu: functional": lambda: aten.gelu.default(out),
        "gelu: gelu.out": lambda: aten.gelu.out(out, out=out),
        "layer_norm: functional": lambda: aten.layer_norm.default(x, [768], lnw, lnb, 1e-5),
        "layer_norm: functional + copy (no out=)": lambda: ln_out.copy_(aten.layer_norm.default(x, [768], lnw, lnb)),
        "sdpa: functional": lambda: aten.scaled_dot_product_attention.default(q, q, q, is_causal=True),
        "sdpa: functional + copy (no out=)": lambda: sd_out.copy_(
            aten.scaled_dot_product_attention.default(q, q, q, is_causal=True)),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    reps = KERNEL_REPS
    with torch.no_grad():
        for fn in cases.values():
            fn()
        for _ in range(rounds * 3):
            for k, fn in cases.items():
                c0 = time.thread_time()
                for _ in range(reps):
                    fn()
                times[k].append((time.thread_time() - c0) / reps)
    print(f"\n### Writing into a slice vs allocating, [1, {seq}, 768] fp32 (measured thread CPU time per call, "
          f"{rounds * 3} samples of {reps} calls, interleaved)\n")
    print("| op, way | median µs | min µs |")
    print("|---|---|---|")
    rows = []
    for k, ts in times.items():
        med = statistics.median(ts)
        rows.append({"case": k, "cpu_median_s": med, "cpu_min_s": min(ts)})
        print(f"| {k} | {med * 1e6:.0f} | {min(ts) * 1e6:.0f} |")
    return rows


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _render_memory(rows: list[dict]) -> list[str]:
    worst = max(r["ratio"] for r in rows)
    lines = ["## Memory plan (target: planned arena ≤ 1.05 × lower bound)", "",
             "soc `host`, strategy `support`, one CPU arena. \"naive\" = every intermediate its own allocation; "
             "\"lower bound\" = max over the schedule of the bytes live at once (64-byte aligned sizes). Bytes are "
             "**exact** (read from the plan); plan time is **measured**.", "",
             "| model | passes | buffers | naive MiB | planned MiB | lower bound MiB | planned ÷ bound | "
             "algorithm kept | plan s (measured) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {'on' if r['passes'] else 'off'} | {r['buffers']} | {mib(r['naive_bytes'])} | "
                     f"{mib(r['planned_bytes'])} | {mib(r['lower_bound_bytes'])} | {r['ratio']:.3f} | "
                     f"{r['algorithm']} | {r['seconds']:.3f} |")
    lines += ["", f"**{'Met' if worst <= 1.05 else 'Not met'}**: the largest planned ÷ bound ratio is {worst:.3f}"
              + (" — every plan reaches the lower bound exactly" if worst == 1.0 else "")
              + ". Every plan passed the independent overlap verifier (`verify_plan`, run by the planner). The "
              "logits are a graph output and live outside the arena, as do weights and inputs.", ""]
    return lines


def _render_switches(rows: list[dict]) -> list[str]:
    lines = ["## Device switches on `test-npu-gaps` (target: ≥ 60% fewer than FX order on llama-110m)", "",
             "Strategy `support` (each op on the NPU unless the profile lacks it: embedding, indexing, masks, rotary "
             "slice/cat/neg, softmax go to the CPU). \"FX order\" = switches in the lowered graph order; \"exact "
             "minimum\" = `exact_min_switches` over all valid orders of the same program. Counts are **exact**; "
             "schedule time is **measured**.", "",
             "| model | passes | instructions | transfers | FX order | scheduled | reduction | exact minimum | "
             "schedule s (measured) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {'on' if r['passes'] else 'off'} | {r['instructions']} | {r['transfers']} | "
                     f"{r['naive']} | {r['scheduled']} | {_pct(r['reduction'])} | "
                     f"{r['exact'] if r['exact'] is not None else 'n/a'} | {r['seconds']:.3f} |")
    llama = [r for r in rows if r["model"] == "llama-110m"]
    at_min = all(r["exact"] is not None and r["scheduled"] == r["exact"] for r in rows)
    if llama:
        met = all(r["reduction"] >= 0.6 for r in llama)
        red = ", ".join(f"{_pct(r['reduction'])} with passes {'on' if r['passes'] else 'off'}" for r in llama)
        lines += ["", f"**{'Met' if met else 'Not met'} on llama-110m** ({red})."
                  + (" The scheduler reaches the proven minimum in every row, so the switches left are forced by the "
                     "placement (the ops the NPU profile lacks run on the CPU), not by the order: without the passes, "
                     "each decoder layer goes NPU (q/k projections) → CPU (rotary slice/neg/cat) → NPU (attention). "
                     "The reduction is counted against the graph-order count, which the passes already lower, so a "
                     "low percentage with the passes on can sit at the same proven minimum."
                     if at_min else " The scheduler is above the exact minimum in at least one row.")]
    return lines + [""]


def _render_dags(d: dict, seeds: int) -> list[str]:
    lines = ["## Heuristic vs exact on random DAGs (target: within 10% of the exact minimum)", "",
             f"{seeds} seeded DAGs, 10–40 instructions, 2–3 devices, edge probability 0.05–0.3 (counts, **exact**).",
             "", "| scheduler | total switches | exact total | ratio | seeds at optimum | seeds within 10% | "
             "worst gap |",
             "|---|---|---|---|---|---|---|"]
    for label, o in d.items():
        lines.append(f"| {label} | {o['total']} | {o['exact_total']} | {o['ratio']:.3f} | {o['at_optimum']}/{seeds} | "
                     f"{o['within_10pct']}/{seeds} | {o['worst_gap']} |")
    default = d.get("beam 8 (default)")
    if default:
        met = default["within_10pct"] == seeds
        lines += ["", f"**{'Met' if met else 'Not met'}**: the default scheduler (beam width 8 over segment sequences) "
                  f"is at the exact minimum on {default['at_optimum']} of {seeds} seeds and within 10% on "
                  f"{default['within_10pct']} (total {default['ratio']:.3f}× the exact total)."]
    greedy = d.get("greedy lookahead 2")
    if greedy:
        lines.append(f"The plain greedy device choice is {100 * (greedy['ratio'] - 1):.0f}% above the optimum in total "
                     f"(within 10% on {greedy['within_10pct']} of {seeds} seeds).")
    return lines + [""]


def _render_latency(rows: list[dict], rounds: int, threads: int, seq: int) -> list[str]:
    lines = [f"## Prefill latency (target: executor ≤ eager, seq {seq}, fp32)", "",
             f"All variants run in one process and are interleaved round by round (the order reverses every other "
             f"round), {rounds} rounds after a warm-up, {threads} torch thread(s). Wall time is **measured** and "
             "noisy on this shared machine; the **thread CPU time** of each call is the robust figure when there is "
             "one torch thread (every kernel then runs on the calling thread). \"Paired ratio\" = median over rounds "
             "of (variant ÷ eager in the same round).", "",
             "| model | variant | wall median ms | wall min ms | wall paired ratio | CPU median ms | CPU min ms | "
             "CPU paired ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['variant']} | {r['wall_median_s'] * 1e3:.1f} | "
                     f"{r['wall_min_s'] * 1e3:.1f} | {r['wall_paired_ratio']:.3f} | {r['cpu_median_s'] * 1e3:.1f} | "
                     f"{r['cpu_min_s'] * 1e3:.1f} | {r['cpu_paired_ratio']:.3f} |")
    default = [r for r in rows if r["variant"] == "executor arena, passes on"]
    execs = [r for r in rows if r["variant"].startswith("executor")]
    above = [r for r in execs if r["cpu_paired_ratio"] > 1]
    if default:
        met = all(r["cpu_paired_ratio"] <= 1 and (threads > 1 or r["wall_paired_ratio"] <= 1) for r in default)
        key = "cpu" if threads == 1 else "wall"
        figs = "; ".join(f"{r['model']} CPU {r['cpu_paired_ratio']:.3f}×, wall {r['wall_paired_ratio']:.3f}×"
                         for r in default)
        lines += ["", f"**Default configuration** (`compile_model`'s defaults: passes on, mode `arena`), paired "
                  f"ratios to eager: {figs} — **{'met' if met else 'not met'}** on the "
                  f"{'CPU-time' if key == 'cpu' else 'wall-time'} figure"
                  + ("." if threads == 1 else " (with more than one thread, CPU time of the calling thread "
                     "undercounts).")]
        lines.append(("Executor rows above eager in CPU time: " + "; ".join(
            f"{r['model']} {r['variant']} ({r['cpu_paired_ratio']:.3f}×)" for r in above) + ".") if above
            else "No executor row is above eager in CPU time.")
    lines += ["Eager and the captured graph run ATen's kernels. The executor runs the multi-row products on "
              "oneDNN's prepacked kernels where a choice measured when the executor is built picks them "
              "(docs/arch/backend.md), "
              "and it saves Python work: it drops the shape assertions, runs no module code, and binds views that "
              "change nothing instead of calling them. It spends a little on copies into the arena for ops without "
              "an `out=` kernel.", ""]
    return lines


def _render_kernels(rows: list[dict], seq: int, samples: int, reps: int) -> list[str]:
    lines = ["### Writing into an arena slice vs letting the op allocate", "",
             f"`[1, {seq}, 768]` fp32 inputs. Thread CPU time per call, {samples} samples of {reps} calls, cases "
             "interleaved (**measured**).", "", "| op, way | median µs | min µs |", "|---|---|---|"]
    med = {}
    for r in rows:
        med[r["case"]] = r["cpu_median_s"]
        lines.append(f"| {r['case']} | {r['cpu_median_s'] * 1e6:.0f} | {r['cpu_min_s'] * 1e6:.0f} |")

    def rel(a: str, b: str) -> str:
        x = med[a] / med[b] - 1
        return f"{100 * abs(x):.0f}% {'slower' if x > 0 else 'faster'}"

    notes = []
    if {"gelu: gelu.out", "gelu: functional"} <= med.keys():
        notes.append(f"gelu through `out=` is {rel('gelu: gelu.out', 'gelu: functional')} than the functional call "
                     "(which allocates)")
    lin = "linear 768→3072: addmm.out on 2-D views (executor)"
    if {lin, "linear 768→3072: functional"} <= med.keys():
        notes.append(f"the GEMM through `addmm.out` is {rel(lin, 'linear 768→3072: functional')}")
    ln = "layer_norm: functional + copy (no out=)"
    if {ln, "layer_norm: functional"} <= med.keys():
        d = med[ln] - med["layer_norm: functional"]
        notes.append(f"copying a layer norm's result into the slice costs {d * 1e6:+.0f} µs per call "
                     f"({rel(ln, 'layer_norm: functional')})")
    sd = "sdpa: functional + copy (no out=)"
    if {sd, "sdpa: functional"} <= med.keys():
        notes.append(f"for attention the copy makes it {rel(sd, 'sdpa: functional')}")
    if notes:
        lines += ["", "Medians: " + "; ".join(notes) + "."]
    lines += ["The cost is in ops that have no `out=` kernel (`layer_norm`, `sdpa`, hetforge's fused custom ops, "
              "`arange`, `__and__`). Mode `arena` copies their result into the slice; mode `fast` skips the copy and "
              "leaves those results outside the plan, where the executor counts them as `unplanned`.", ""]
    return lines


def render(res: dict) -> str:
    """The page of one run's JSON (tables and the verdicts under them, all computed from it)."""
    m = res["meta"]
    lines = ["# Backend benchmarks: memory plan, device switches, exact vs heuristic, prefill latency", "",
             *meta_lines(m), "",
             f"Models: seeded random weights, fp32, input `[1, {res['seq']}]`. Labels: counts and bytes are **exact** "
             "(read from the program and the plan); times are **measured**. Nothing on this page is modeled.", ""]
    if "memory" in res:
        lines += _render_memory(res["memory"])
    if "switches" in res:
        lines += _render_switches(res["switches"])
    if "dags" in res:
        lines += _render_dags(res["dags"], res["seeds"])
    if "latency" in res:
        lines += _render_latency(res["latency"], res["rounds"], m["threads"], res["seq"])
    if "kernels" in res:
        lines += _render_kernels(res["kernels"], res["seq"], res["kernel_samples"], res["kernel_calls_per_sample"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama-110m"])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="raw JSON of the run")
    ap.add_argument("--md", type=Path, default=None, help="the page generated from the JSON")
    ap.add_argument("--from-json", action="store_true", help="only regenerate --md from --out")
    args = ap.parse_args(argv)
    if args.from_json:
        if args.out is None or not args.out.is_file():
            ap.error(f"--from-json reads --out, and {args.out or 'no --out'} is not a file")
        page_from_json(args.out, args.md, render)
        return 0
    if args.rounds < 1 or args.seeds < 1:
        ap.error("--rounds and --seeds must be >= 1")
    torch.set_num_threads(args.threads)
    meta = run_meta("bench/backend.py", argv)
    results: dict[str, Any] = {"seq": args.seq, "rounds": args.rounds, "seeds": args.seeds,
                               "kernel_samples": args.rounds * 3, "kernel_calls_per_sample": KERNEL_REPS}
    if "memory" in args.sections:
        results["memory"] = bench_memory(args.models, args.seq)
    if "switches" in args.sections:
        results["switches"] = bench_switches(args.models, args.seq)
    if "dags" in args.sections:
        results["dags"] = bench_dags(args.seeds)
    if "latency" in args.sections:
        results["latency"] = bench_latency(args.models, args.seq, args.rounds)
    if "kernels" in args.sections:
        results["kernels"] = bench_kernels(args.seq, args.rounds)
    results["meta"] = end_meta(meta)
    write_result(results, args.out, args.md, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
