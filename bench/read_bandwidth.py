"""Why β_read is measured the way it is (docs/arch/hardware-cost.md#read-bandwidth): cache-hot vs cold one-row
products, and how the statistic over a pool of distinct buffers moves the figure.

In one process, 1 thread by default, the calling thread's CPU time (``--clock thread``) or wall time, all
**measured**:

* **hot vs cold**: the native one-row product of GPT-2's MLP weight (``[768, 3072]``, 9.4 MB, ``hf_gemv_kn``)
  with one weight reused every call (served from the last-level cache) and with a pool of distinct copies
  totalling ≥ 8× the last-level cache (from DRAM, as ``hetforge calibrate`` times it), interleaved in rounds;
* **per-buffer spread and statistics**: the pool β_read reads (8 MiB buffers, ≥ 8× the LLC) read ``--passes``
  times with ``hf_read_stream``; per buffer the best read; the bandwidth by three statistics: the best single
  call (what calibration took before), per buffer the best averaged over the pool (β_read), and the median call;
* **one-row products vs β_read** (wall clock, at each of ``--product-threads``): every native fp32 one-row kernel
  a decode step runs, on decode-shaped weights, each over its own pool of distinct copies (≥ 8× the LLC, cold),
  interleaved in ``--rounds`` rounds with β_read's own pool; per copy the best call, bandwidth = bytes ÷ Σ best
  times (β_read's statistic), and its ratio to β_read at the same thread count.

    python bench/read_bandwidth.py [--threads 1] [--clock thread] [--rounds 10] [--passes 10] \\
        [--product-threads 1 2] --out docs/bench/read_bandwidth.json --md docs/bench/read_bandwidth.md
    python bench/read_bandwidth.py --from-json --out docs/bench/read_bandwidth.json --md docs/bench/read_bandwidth.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from _pages import page_from_json, write_result

from hetforge.hardware.bandwidth import BUFFER_BYTES, FACTOR, pool_size
from hetforge.hardware.host import cpu_count, cpu_name
from hetforge.kernels import native
from hetforge.kernels.native import llc_bytes

CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}


def hot_cold(rounds: int, clock) -> dict:
    """Times (s) of the ``[768, 3072]`` one-row product, hot and cold, ``rounds`` interleaved rounds of 20 calls."""
    lib, nt = native.library(), torch.get_num_threads()
    k, n = 768, 3072
    x, y, part = torch.randn(k), torch.empty(n), torch.empty(max(2, nt), n)
    hot = torch.randn(k, n)
    pool = [torch.randn(k, n) for _ in range(pool_size(k * n * 4))]

    def call(w: torch.Tensor) -> float:
        t0 = clock()
        lib.hf_gemv_kn(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), n, k, nt, part.data_ptr(), part.shape[0])
        return clock() - t0

    for w in pool:
        call(w)
    out: dict[str, list[float]] = {"hot": [], "cold": []}
    i = 0
    for _ in range(rounds):
        out["hot"] += [call(hot) for _ in range(20)]
        for _ in range(20):
            out["cold"].append(call(pool[i % len(pool)]))
            i += 1
    return {"weight_bytes": k * n * 4, "pool_copies": len(pool), "times_s": out}


def spread(passes: int, clock) -> dict:
    """Per-buffer read times (s) of β_read's pool over ``passes`` passes (after one warm-up pass)."""
    lib, nt = native.library(), torch.get_num_threads()
    count, n = pool_size(), BUFFER_BYTES // 4
    bufs = [torch.ones(n) for _ in range(count)]
    for b in bufs:
        lib.hf_read_stream(b.data_ptr(), n, nt)
    times = [[0.0] * count for _ in range(passes)]
    for p in range(passes):
        for i, b in enumerate(bufs):
            t0 = clock()
            lib.hf_read_stream(b.data_ptr(), n, nt)
            times[p][i] = clock() - t0
    return {"buffer_bytes": n * 4, "buffers": count, "times_s": times}


# The one-row products of a decode step (kernel listing of the compiled gpt2 / llama-110m decode programs):
# (kernel, weight shapes, where decode runs it). hf_gemv_kn / hf_linear_act take [K, N] weights (GPT-2's Conv1D).
PRODUCTS = [
    ("hf_gemv_nk", [(32000, 768)], "llama-110m LM head"),
    ("hf_gemv_nk", [(768, 768)], "llama-110m attention projections"),
    ("hf_gemv_kn", [(768, 2304)], "gpt2 attention c_attn"),
    ("hf_linear_act", [(768, 3072)], "gpt2 MLP c_fc + tanh-GELU"),
    ("hf_gated_mlp", [(2048, 768), (2048, 768), (768, 2048)], "llama-110m MLP (gate, up, down)"),
]


def _product_call(lib, kernel: str, ws: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, h: torch.Tensor,
                  part: torch.Tensor):
    """A function of the thread count that runs ``kernel`` once on weights ``ws`` (decode's arguments; pointers
    taken once, as the executor bakes them into its generated code)."""
    w, xp, yp, hp = ws[0].data_ptr(), x.data_ptr(), y.data_ptr(), h.data_ptr()
    pp, slots = part.data_ptr(), part.shape[0]
    if kernel == "hf_gemv_nk":
        n, k = ws[0].shape
        fn = lib.hf_gemv_nk
        return lambda t: fn(w, xp, None, yp, n, k, t)
    if kernel == "hf_gemv_kn":
        k, n = ws[0].shape
        fn = lib.hf_gemv_kn
        return lambda t: fn(w, xp, None, yp, n, k, t, pp, slots)
    if kernel == "hf_linear_act":
        k, n = ws[0].shape
        fn, act = lib.hf_linear_act, native.ACT_CODES["gelu_tanh"]
        return lambda t: fn(w, xp, None, yp, n, k, 1, act, t, pp, slots)
    f, d = ws[0].shape
    fn, silu, wu, wd = lib.hf_gated_mlp, native.ACT_CODES["silu"], ws[1].data_ptr(), ws[2].data_ptr()
    return lambda t: fn(xp, w, wu, wd, hp, yp, f, d, silu, t)


def products(rounds: int, threads: list[int], cases_spec: list = PRODUCTS, factor: int = FACTOR,
             beta_buffers: int | None = None) -> dict:
    """Wall times (s) of each one-row product and of β_read's pool, ``rounds`` interleaved rounds at each thread
    count in ``threads``: ``best_s[case][str(t)][copy]`` (per copy its best call) and ``round_total_s[case][str(t)]
    [round]``. Each pool totals at least
    ``factor`` last-level caches (at least 2 copies); ``beta_buffers`` overrides β_read's pool size (tests)."""
    lib = native.library()
    llc = llc_bytes()
    x, y, h = torch.randn(4096), torch.empty(32768), torch.empty(4096)
    part = torch.empty(native.split_k_slots(), 4096)
    cases = []
    for kernel, shapes, use in cases_spec:
        nbytes = sum(a * b * 4 for a, b in shapes)
        copies = max(2, -(-factor * llc // nbytes))
        pool = [[torch.empty(s).uniform_(-0.05, 0.05) for s in shapes] for _ in range(copies)]
        calls = [_product_call(lib, kernel, ws, x, y, h, part) for ws in pool]
        cases.append({"kernel": kernel, "shapes": shapes, "use": use, "bytes": nbytes, "copies": copies,
                      "calls": calls, "pool": pool})  # the calls hold raw pointers: the pool must outlive them
    n = BUFFER_BYTES // 4
    bufs = [torch.ones(n) for _ in range(pool_size() if beta_buffers is None else beta_buffers)]
    read = lib.hf_read_stream
    beta_calls = [(lambda t, p=b.data_ptr(): read(p, n, t)) for b in bufs]
    every = [("beta_read", beta_calls)] + [(str(i), c["calls"]) for i, c in enumerate(cases)]
    times: dict[str, dict[str, list[list[float]]]] = {k: {str(t): [] for t in threads} for k, _ in every}
    for t in threads:  # warm-up: first touch, helper threads started
        for _, calls in every:
            for call in calls:
                call(t)
    for _ in range(rounds):
        for t in threads:
            for key, calls in every:
                row = []
                for call in calls:
                    t0 = time.perf_counter()
                    call(t)
                    row.append(time.perf_counter() - t0)
                times[key][str(t)].append(row)
    # kept: per copy its best call (what the statistic uses) and per round the pool's total (the spread of rounds)
    best = {k: {t: [min(col) for col in zip(*rows, strict=True)] for t, rows in per_t.items()}
            for k, per_t in times.items()}
    totals = {k: {t: [sum(r) for r in rows] for t, rows in per_t.items()} for k, per_t in times.items()}
    return {"threads": threads, "rounds": rounds, "beta_buffer_bytes": n * 4, "beta_buffers": len(bufs),
            "cases": [{k: v for k, v in c.items() if k not in ("calls", "pool")} for c in cases],
            "best_s": best, "round_total_s": totals}


def _pooled_GBps(nbytes: int, best: list[float]) -> float:
    """Bytes of the pool ÷ Σ over copies of each copy's best time (β_read's statistic)."""
    return nbytes * len(best) / sum(best) / 1e9


def product_summary(pr: dict) -> dict:
    """Per thread count: β_read (GB/s) and each product's GB/s and ratio to it."""
    out: dict = {}
    for t in map(str, pr["threads"]):
        beta = _pooled_GBps(pr["beta_buffer_bytes"], pr["best_s"]["beta_read"][t])
        rows = []
        for i, c in enumerate(pr["cases"]):
            gbps = _pooled_GBps(c["bytes"], pr["best_s"][str(i)][t])
            rows.append({"kernel": c["kernel"], "GBps": gbps, "ratio_to_beta_read": gbps / beta})
        out[t] = {"beta_read_GBps": beta, "products": rows}
    return out


def summary(res: dict) -> dict:
    hc, sp = res["hot_cold"], res["spread"]
    wb = hc["weight_bytes"]
    hot, cold = hc["times_s"]["hot"], hc["times_s"]["cold"]
    per_buf = [min(col) for col in zip(*sp["times_s"], strict=True)]
    calls = [t for row in sp["times_s"] for t in row]
    b = sp["buffer_bytes"]
    return {
        "hot_median_s": statistics.median(hot), "cold_median_s": statistics.median(cold),
        "hot_min_s": min(hot), "cold_min_s": min(cold),
        "cold_over_hot_median": statistics.median(cold) / statistics.median(hot),
        "hot_GBps_median": wb / statistics.median(hot) / 1e9, "cold_GBps_median": wb / statistics.median(cold) / 1e9,
        "per_buffer_best_GBps": {"min": b / max(per_buf) / 1e9, "median": b / statistics.median(per_buf) / 1e9,
                                 "max": b / min(per_buf) / 1e9},
        "beta_best_single_call_GBps": b / min(calls) / 1e9,
        "beta_read_GBps": b / statistics.mean(per_buf) / 1e9,
        "beta_median_call_GBps": b / statistics.median(calls) / 1e9,
        **({"products": product_summary(res["products"])} if "products" in res else {}),
    }


def product_lines(res: dict) -> list[str]:
    """The page's section on the one-row products (none for a JSON from before it was measured)."""
    if "products" not in res:
        return []
    pr, ps = res["products"], product_summary(res["products"])
    ts = [str(t) for t in pr["threads"]]
    head = "| kernel | weight (decode use) | MB | copies | " + " | ".join(
        f"{t} thread{'s' if t != '1' else ''}: GB/s | ÷ β_read" for t in ts) + " |"
    lines = [
        "## One-row products vs β_read (cold, per thread count)",
        "",
        "Every native fp32 one-row kernel that the compiled `gpt2` / `llama-110m` decode programs run, on a "
        "decode-shaped weight, each over its own pool of distinct copies (≥ 8× the cache, so every read comes "
        f"from DRAM), {pr['rounds']} interleaved rounds together with β_read's pool "
        f"({pr['beta_buffers']} × {pr['beta_buffer_bytes'] / 2**20:.0f} MiB, `hf_read_stream`) at each thread "
        "count; wall clock around each call (a ctypes call: a few µs included). Per copy its best call; "
        "bandwidth = bytes ÷ Σ best times — β_read's statistic, so the ratio compares like with like. **Measured.**",
        "",
        head,
        "|---|---|---|---|" + "---|---|" * len(ts),
        "| `hf_read_stream` (β_read) | 8 MiB buffers | "
        f"{pr['beta_buffer_bytes'] / 1e6:.1f} | {pr['beta_buffers']} | "
        + " | ".join(f"**{ps[t]['beta_read_GBps']:.1f}** | 1.00" for t in ts) + " |",
    ]
    for i, c in enumerate(pr["cases"]):
        shapes = " + ".join(f"[{a}, {b}]" for a, b in c["shapes"])
        cells = [ps[t]["products"][i] for t in ts]
        lines.append(f"| `{c['kernel']}` | {shapes} ({c['use']}) | {c['bytes'] / 1e6:.1f} | {c['copies']} | "
                     + " | ".join(f"{r['GBps']:.1f} | {r['ratio_to_beta_read']:.2f}" for r in cells) + " |")
    lines += ["", "A ratio above 1.00 would mean the product reads memory faster than the probe that defines the "
              "decode bound, i.e. the bound would be too low.", ""]
    return lines


def page(res: dict, src: Path) -> str:
    s = summary(res)
    hc, sp = res["hot_cold"], res["spread"]
    pb = s["per_buffer_best_GBps"]
    return "\n".join([
        "# Read bandwidth: cache-hot vs cold, and the statistic over a pool of buffers",
        "",
        f"Generated by `bench/read_bandwidth.py --md` from `{src.name}` (do not edit by hand). The definition these "
        "numbers motivate is stated once in [arch/hardware-cost.md](../arch/hardware-cost.md#read-bandwidth).",
        "",
        f"- Command: `{res['command']}`",
        f"- Machine: {res['machine']}; torch {res['torch']}, {res['threads']} thread(s), {res['clock']} clock; "
        f"last-level cache {res['llc_bytes'] / 2**20:.0f} MiB (sysfs). All times **measured**.",
        f"- Load average {', '.join(f'{x:.2f}' for x in res['load_average_before'])} before and "
        f"{', '.join(f'{x:.2f}' for x in res['load_average_at_end'])} at the end (2 cores shared with other jobs: "
        "the figures move with the load; the comparisons are within one interleaved run).",
        "",
        "## Hot vs cold one-row product",
        "",
        f"GPT-2's MLP weight, `[768, 3072]` fp32 ({hc['weight_bytes'] / 1e6:.1f} MB), native `hf_gemv_kn`, "
        f"{res['rounds']} interleaved rounds of 20 calls each: one weight reused (hot: it stays in the last-level "
        f"cache) vs {hc['pool_copies']} distinct copies in turn (cold: ≥ 8× the cache, every read from DRAM — how "
        "`hetforge calibrate` times it).",
        "",
        "| weight | median (µs) | min (µs) | GB/s at the median |",
        "|---|---|---|---|",
        f"| hot (one buffer) | {s['hot_median_s'] * 1e6:.1f} | {s['hot_min_s'] * 1e6:.1f} | "
        f"{s['hot_GBps_median']:.1f} |",
        f"| cold (pool) | {s['cold_median_s'] * 1e6:.1f} | {s['cold_min_s'] * 1e6:.1f} | "
        f"{s['cold_GBps_median']:.1f} |",
        "",
        f"Cold ÷ hot (medians): **{s['cold_over_hot_median']:.2f}×**. A calibration that reused one buffer would be "
        "off by this factor, not by 10–15%; `hetforge calibrate` already timed one-row products cold (pools of "
        "≥ 8× the cache), so cache residency is not what made the model under-predict decode.",
        "",
        "## Per-buffer spread and the statistic",
        "",
        f"{sp['buffers']} distinct buffers of {sp['buffer_bytes'] / 2**20:.0f} MiB (≥ 8× the cache), each read "
        f"{res['passes']} times in turn with `hf_read_stream` (four streams per thread).",
        "",
        "| statistic | GB/s |",
        "|---|---|",
        f"| per buffer, its best read: slowest buffer / median buffer / fastest buffer | {pb['min']:.1f} / "
        f"{pb['median']:.1f} / {pb['max']:.1f} |",
        f"| best single call over the pool (what calibration took before) | {s['beta_best_single_call_GBps']:.1f} |",
        f"| **β_read**: per buffer the best read, averaged over the pool | **{s['beta_read_GBps']:.1f}** |",
        f"| median call | {s['beta_median_call_GBps']:.1f} |",
        "",
        "The best single call is the fastest buffer at its best moment: "
        f"{s['beta_best_single_call_GBps'] / s['beta_read_GBps']:.2f}× β_read here. A decode step reads every "
        "weight once, wherever it lies, and `bench/costmodel.py` sums the "
        "best of 10 runs per instruction over the program: β_read is the same statistic.",
        "",
        *product_lines(res),
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="thread")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--product-threads", type=int, nargs="+", default=[1, 2],
                    help="thread counts of the one-row products section (wall clock)")
    ap.add_argument("--out", type=Path, default=Path("bench/out/read_bandwidth.json"))
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--from-json", action="store_true", help="only regenerate --md from --out")
    a = ap.parse_args(argv)
    if a.from_json:
        if a.md is None:
            ap.error("--from-json needs --md")
        if not a.out.is_file():
            ap.error(f"--from-json reads --out, and {a.out} is not a file")
        page_from_json(a.out, a.md, lambda r: page(r, a.out))
        return 0
    if a.threads < 1 or a.rounds < 1 or a.passes < 1 or min(a.product_threads) < 1:
        ap.error("--threads, --rounds, --passes and --product-threads must be >= 1")
    if a.clock == "thread" and a.threads != 1:
        ap.error("--clock thread needs --threads 1")
    if native.library() is None:
        print("error: the native kernels are not built here (hetforge.kernels.native); nothing measured",
              file=sys.stderr)
        return 1
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    clock = CLOCKS[a.clock]
    load = list(os.getloadavg())
    res = {"machine": f"{cpu_name()}, {cpu_count()} cores, {platform.system()}", "torch": torch.__version__,
           "threads": a.threads, "clock": a.clock, "rounds": a.rounds, "passes": a.passes, "llc_bytes": llc_bytes(),
           "load_average_before": load,
           "command": "python bench/read_bandwidth.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    res["hot_cold"] = hot_cold(a.rounds, clock)
    res["spread"] = spread(a.passes, clock)
    res["products"] = products(a.rounds, a.product_threads)
    res["load_average_at_end"] = list(os.getloadavg())
    res["summary"] = summary(res)
    write_result(res, a.out, a.md, lambda r: page(r, a.out))
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
