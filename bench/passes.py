"""Middle-end benchmark: pass-pipeline time vs capture time, and CPU prefill latency eager / captured / optimized.

Usage: python bench/passes.py [--models gpt2 llama-110m] [--attn sdpa] [--seq 128] [--repeats 3] [--runs 9]
       [--out docs/bench/passes.md]

All figures are measured on this machine with ``torch.set_num_threads(2)``. Capture and the pass pipeline run
``--repeats`` times (median and min). Prefill latency runs the three variants interleaved (rotating order, after
two warm-up calls each) ``--runs`` times and reports median and min, plus the median of the per-round ratios
(paired, robust to load drift on a shared machine). The optimized graph's logits are compared
with eager (KL, max |Δ|) so a speed-up never hides a wrong answer.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hetforge.frontend import capture
from hetforge.models.zoo import example_inputs, load_model
from hetforge.passes import optimize
from hetforge.verify import verify


def _time(fn: Callable, inputs) -> float:
    with torch.no_grad():
        t0 = time.perf_counter()
        fn(*inputs)
        return time.perf_counter() - t0


def bench_model(name: str, attn: str, seq: int, repeats: int, runs: int) -> dict:
    loaded = load_model(name, attn=attn)
    inputs = example_inputs(loaded, seq=seq)
    eager = loaded.logits_module()
    cap_s, opt_s = [], []
    cg = res = None
    for _ in range(repeats):
        cg = capture(eager, inputs, name=name)
        res = optimize(cg.gm, inputs)
        cap_s.append(cg.seconds)
        opt_s.append(res.seconds)
    rep = verify(eager, res.gm, inputs, kl_threshold=1e-8)
    variants = {"eager": eager, "captured": cg.gm, "optimized": res.gm}
    for fn in variants.values():
        for _ in range(2):
            _time(fn, inputs)
    lat: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    for i in range(runs):
        for k in order[i % 3:] + order[:i % 3]:
            lat[k].append(_time(variants[k], inputs))
    return {
        "model": name, "attn": attn, "seq": seq, "nodes": (res.nodes_before, res.nodes_after), "fused": res.fused,
        "capture": (statistics.median(cap_s), min(cap_s)), "passes": (statistics.median(opt_s), min(opt_s)),
        "per_pass": {p.name: p.seconds for p in res.passes},
        "latency": {k: (statistics.median(v), min(v)) for k, v in lat.items()},
        # paired: the median over rounds of (optimized ÷ other) within the same round, robust to load drift
        "paired": {k: statistics.median(o / b for o, b in zip(lat["optimized"], lat[k], strict=True))
                   for k in ("captured", "eager")},
        "kl_mean": rep.kl_mean, "kl_max": rep.kl_max, "max_abs_err": rep.max_abs_err, "top1": rep.top1_agree,
    }


def render(rows: list[dict], cmd: str, load: tuple[float, float]) -> str:
    cpu = platform.processor() or platform.machine()
    lines = [
        "# Middle-end passes: pipeline time and CPU prefill latency",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {cpu}, {os.cpu_count()} CPU cores visible, `torch.set_num_threads(2)`, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Load average (1 min) {load[0]:.1f} at start, "
        f"{load[1]:.1f} at end: the cores were shared with other jobs, so absolute times are noisy; the variants "
        "were interleaved so drift hits all of them alike.",
        "",
        "All figures below are **measured** (wall clock, `time.perf_counter`). Models have seeded random weights.",
        "",
        "## Pass pipeline vs capture (target: passes < 10 % of capture)",
        "",
        "| model | attn | nodes before → after | capture s (median / min) | passes s (median / min) "
        "| passes ÷ capture |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["passes"][0] / r["capture"][0]
        lines.append(f"| {r['model']} | {r['attn']} | {r['nodes'][0]} → {r['nodes'][1]} | {r['capture'][0]:.2f} / "
                     f"{r['capture'][1]:.2f} | {r['passes'][0]:.3f} / {r['passes'][1]:.3f} | {100 * ratio:.1f} % |")
    lines += ["", "Per pass (last repeat, ms, measured):", "",
              "| model | " + " | ".join(rows[0]["per_pass"]) + " |", "|---|" + "---|" * len(rows[0]["per_pass"])]
    for r in rows:
        lines.append(f"| {r['model']} | " + " | ".join(f"{v * 1e3:.1f}" for v in r["per_pass"].values()) + " |")
    lines += ["", "Fused ops in the optimized graph:", "", "| model | " + " | ".join(rows[0]["fused"]) + " |",
              "|---|" + "---|" * len(rows[0]["fused"])]
    for r in rows:
        lines.append(f"| {r['model']} | " + " | ".join(str(v) for v in r["fused"].values()) + " |")
    lines += ["", f"## CPU prefill latency, seq {rows[0]['seq']} (batch 1)", "",
              "| model | eager ms (median / min) | captured ms | optimized ms | optimized vs captured (paired) | "
              "optimized vs eager (paired) | KL mean / max vs eager | max abs err | top-1 |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lat = {k: (v[0] * 1e3, v[1] * 1e3) for k, v in r["latency"].items()}
        e, c, o = lat["eager"], lat["captured"], lat["optimized"]
        lines.append(
            f"| {r['model']} | {e[0]:.1f} / {e[1]:.1f} | {c[0]:.1f} / {c[1]:.1f} | {o[0]:.1f} / {o[1]:.1f} | "
            f"{100 * (r['paired']['captured'] - 1):+.1f} % | {100 * (r['paired']['eager'] - 1):+.1f} % | "
            f"{r['kl_mean']:.1e} / "
            f"{r['kl_max']:.1e} | {r['max_abs_err']:.1e} | {r['top1']:.3f} |")
    lines += ["", "Paired columns: the median over rounds of optimized ÷ captured (or eager) measured in the same",
              "round; negative is faster. KL is KL(eager ‖ optimized) of the softmaxed logits per position.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama-110m"])
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    args = ap.parse_args()
    torch.set_num_threads(2)
    load0 = os.getloadavg()[0]
    rows = [bench_model(m, args.attn, args.seq, args.repeats, args.runs) for m in args.models]
    cmd = "python bench/passes.py " + " ".join(
        f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items() if v is not None)
    text = render(rows, cmd, (load0, os.getloadavg()[0]))
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
