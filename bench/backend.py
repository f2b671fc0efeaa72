"""Backend benchmarks: memory plan vs lower bound, device switches, heuristic vs exact, prefill latency.

Usage: python bench/backend.py [--sections memory switches dags latency kernels] [--models gpt2 llama-110m]
                               [--seq 128] [--rounds 7] [--seeds 300] [--threads 1] [--json FILE]

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
import json
import platform
import random
import statistics
import time
from typing import Any

import torch

from hetforge.compile import compile_graph
from hetforge.frontend import capture
from hetforge.models.zoo import example_inputs, load_model
from hetforge.schedule import SearchTooLarge, count_switches, dependencies, exact_min_switches, schedule_graph

_CACHE: dict[tuple[str, int], Any] = {}


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
    reps = 20  # calls per sample: thread CPU time has ~ms granularity on some kernels
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", nargs="+", default=["memory", "switches", "dags", "latency", "kernels"])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama-110m"])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write all results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s), "
          f"torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M')}")
    results: dict[str, Any] = {"machine": platform.machine(), "threads": torch.get_num_threads(), "seq": args.seq}
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
