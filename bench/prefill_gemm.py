"""Prefill with ATen's GEMMs vs the packed GEMMs (oneDNN's, MKL's: hetforge.executor.onednn), interleaved, + fidelity.

For each model and prompt length: one static capture, compiled by ``hetforge.compile.compile_graph`` once per
``HETFORGE_GEMM`` policy (``aten``, ``onednn``, ``mkl`` where this torch has MKL's packed sgemm, and ``auto``,
the measured choice), plus eager; then rounds of one call each,
interleaved, best and median per system (measured, wall clock), and KL(eager ‖ hetforge) of the last-position
logits. Writes docs/bench/prefill_gemm.json and generates docs/bench/prefill_gemm.md from it.

The GEMM compute bound (issue 24): the FLOPs of the program's products (``aten.linear``/``addmm``/``mm`` and the
fused ``hetforge::linear_act``/``gated_mlp``, each instruction's registered FLOP formula) ÷ the peak that
``hetforge calibrate`` measures — the fastest kernel on the host (ATen, oneDNN or MKL packed) on square n×n×n
products, best over n — measured here in the same process at the bench's thread count, at the start and again at
n = 1024 after each model and length (the bound takes the best of them all, so the peak samples the whole stretch
of the host's speed that the prefills' best calls come from; a second column divides by the better of the
measurements just before and after each shape's rounds); a prefill below 1.0× of it would mean the peak is wrong. It
leaves out attention, norms and elementwise ops, so it is a lower bound. The FMA units' ceiling
(``native.fma_peak``: register-only fused multiply-adds on every thread at once) is probed at the start, after each
measurement of the peaks and at the end (best of the probes), to show how close that GEMM peak sits to the
hardware; probing next to the peak's own measurements keeps a swing in the host's speed from putting the peak above
the ceiling.

Where the time goes (``--perf SECONDS``, on by default where Linux ``perf`` may sample this process: bench/_perf.py):
the measured-choice program is called in a loop for that long while ``perf record`` samples its threads, and the
samples are sorted into GEMM code (oneDNN's JIT products, the native product kernels) and everything else (X
packing, attention, norms, OpenMP waits, Python, ATen, oneDNN's driver code). With g the GEMM code's share and r the
prefill ÷ bound, two figures follow (derived, assuming the best call had the sampled window's shares): the GEMM
code's own rate, 1/(g·r) of the bound's peak, and the ratio left if every GEMM ran at that peak with the rest
unchanged, 1 + (1 − g)·r: the part of the distance to the bound that no GEMM kernel can remove.

Per op (always): the measured-choice program is also called through ``Executable.profile`` (a clock read around
every instruction), best of three calls by total; its instructions' times are summed by op. The GEMM ops' FLOPs
(the bound's own formulas) ÷ their summed time is their rate inside the program, each call's dispatch and its
threads' fork and join included; the profiled call ÷ bound splits into GEMM ops, attention and the rest. Then
two more profiled calls run each GEMM op's call again right after itself (``Executable.profile``'s ``again``): its
best repeat is the same call hot, as the kernel timed alone, which splits the GEMM ops' share into the kernels' own
rate on these shapes and what running inside the program adds.

    .venv/bin/python bench/prefill_gemm.py [--models gpt2,llama-110m] [--seqs 128,512] [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _ops import op_split

DOCS = Path(__file__).resolve().parent.parent / "docs" / "bench"


def kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    p = torch.log_softmax(ref.double().reshape(-1, ref.shape[-1]), -1)
    q = torch.log_softmax(got.double().reshape(-1, got.shape[-1]), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


PEAK_SIZES = (512, 1024, 2048)


def gemm_flops(program) -> float:
    """FLOPs of the program's products (registered formulas; the cost model's own)."""
    return sum(instr_gflop(ins, program) for ins in program.instrs) * 1e9


def instr_gflop(ins, program) -> float:
    """GFLOP of one instruction if it is one of the bound's products (``kernel_choice.ONEDNN_OPS``: linear, addmm, mm,
    linear_act, gated_mlp; the registered formula, the cost model's own), else 0."""
    from hetforge.cost.instr import op_call_from_instr
    from hetforge.ir.kernel_choice import ONEDNN_OPS
    from hetforge.ops import lookup

    if ins.op not in ONEDNN_OPS:
        return 0.0
    return float(lookup(ins.op).flops(op_call_from_instr(ins, program))) / 1e9


OP_PROFILE_CALLS = 3  # profiled calls per shape (the one with the least total is kept)
HOT_CALLS, HOT_AGAIN = 2, 3  # profiled calls with each product run this many more times right after itself


def op_profile(exe, inputs: tuple, calls: int = OP_PROFILE_CALLS) -> dict:
    """Per-op time of one profiled call of ``exe`` (measured, the best of ``calls`` by total): each op's calls,
    summed ms, and for the GEMM ops their FLOPs (registered formulas, as :func:`gemm_flops`). Then the GEMM ops
    hot: :data:`HOT_CALLS` profiled calls in which each product runs :data:`HOT_AGAIN` more times right after its
    own run (``Executable.profile``'s ``again``), per instruction the least over those calls of its own run
    (``again_ms``: the program's call) and of the best repeat (``hot_ms``: the same call with its inputs and weights
    in cache, as a kernel timed alone; a grouped call's picking of its part, never repeated, at its own time)."""
    from hetforge.ir.kernel_choice import ONEDNN_OPS

    best = None
    for i in range(calls):
        rep = exe.profile(*inputs, warmup=1 if i == 0 else 0, repeat=1)
        if best is None or rep.total_seconds < best.total_seconds:
            best = rep
    by_op: dict[str, dict] = {}
    for t, ins in zip(best.times, exe.program.instrs, strict=True):
        a = by_op.setdefault(t.op, {"op": t.op, "calls": 0, "ms": 0.0, "gflop": 0.0})
        a["calls"] += 1
        a["ms"] += t.seconds * 1e3
        a["gflop"] += instr_gflop(ins, exe.program)
    gemm = [k for k, ins in enumerate(exe.program.instrs) if ins.op in ONEDNN_OPS]
    own, hot = dict.fromkeys(gemm, float("inf")), dict.fromkeys(gemm, float("inf"))
    for _ in range(HOT_CALLS):
        rep = exe.profile(*inputs, warmup=0, repeat=1, again=HOT_AGAIN, again_ops=ONEDNN_OPS)
        for k in gemm:
            t = rep.times[k]
            own[k] = min(own[k], t.seconds)
            hot[k] = min(hot[k], t.seconds if t.hot_seconds is None else t.hot_seconds)
    for k in gemm:
        a = by_op[exe.program.instrs[k].op]
        a["again_ms"] = a.get("again_ms", 0.0) + own[k] * 1e3
        a["hot_ms"] = a.get("hot_ms", 0.0) + hot[k] * 1e3
    ops = sorted(by_op.values(), key=lambda a: -a["ms"])
    for a in ops:
        for f in ("ms", "again_ms", "hot_ms"):
            if f in a:
                a[f] = round(a[f], 3)
        a["gflop"] = round(a["gflop"], 6)
    return {"total_ms": round(best.total_seconds * 1e3, 2), "calls": calls, "hot_calls": HOT_CALLS,
            "hot_again": HOT_AGAIN, "ops": ops}


def peak_flops(dtype: str, between: Callable[[], object] = lambda: None) -> dict:
    """``hetforge calibrate``'s GEMM peak for ``dtype``: best 2·n³/t over its kernels and n (measured); ``between``
    runs after each n (the FMA ceiling's probe, so that it samples the host's speed where the peak does)."""
    from hetforge.hardware.calibrate import _gemm

    by_n = {}
    for n in PEAK_SIZES:
        by_n[n] = _gemm(dtype, n, 2.0)
        between()
    return {"gflops": round(max(by_n.values()) / 1e9, 1), "by_n": {n: round(v / 1e9, 1) for n, v in by_n.items()}}


REPROBE_N, REPROBE_S = 1024, 0.5  # the peak measured again at this n, for about this long per kernel, after each shape


def reprobe_peak(peaks: dict) -> None:
    """Measure each dtype's peak again at :data:`REPROBE_N` (measured) and keep it in ``reprobes``; the peak becomes
    the best of every measurement so far. Why: the host's speed moves over a run of minutes, and a peak taken only
    at the start would set the bound from one moment while the prefills' best calls come from others."""
    from hetforge.hardware.calibrate import _gemm

    for dt, v in peaks.items():
        v.setdefault("reprobes", []).append(round(_gemm(dt, REPROBE_N, REPROBE_S) / 1e9, 1))
        v["gflops"] = max(v["gflops"], *v["reprobes"])


def apply_bound(row: dict, peaks: dict) -> None:
    """A row's GEMM bound (ms) and prefill ÷ bound from its GEMM GFLOP and the peaks as they stand."""
    row["bound_ms"] = {dt: round(row["gemm_gflop" if dt == "fp32" else "gemm_gflop_bf16"] / peaks[dt]["gflops"] * 1e3,
                                 2) for dt in peaks if dt == "fp32" or "gemm_gflop_bf16" in row}
    row["over_bound_best"] = {dt: round(row["best_ms"]["hetforge-auto" if dt == "fp32" else "hetforge-bf16"]
                                        / row["bound_ms"][dt], 3) for dt in row["bound_ms"]}


def run(models: list[str], seqs: list[int], rounds: int, threads: int, bf16: bool, perf_s: float = 0.0) -> dict:
    from hetforge.compile import compile_graph
    from hetforge.frontend import capture
    from hetforge.kernels import native, onednn
    from hetforge.models.zoo import example_inputs, load_model

    torch.set_num_threads(threads)
    fma_probes: list[float] = []

    def fma_probe() -> None:
        got = native.fma_peak(threads)
        if got is not None:
            fma_probes.append(got)

    fma_probe()
    peaks = {"fp32": peak_flops("fp32", fma_probe), **({"bf16": peak_flops("bf16", fma_probe)} if bf16 else {})}
    before = peaks["fp32"]["gflops"]  # the last fp32 peak measured before the next shape's rounds
    rows = []
    for name in models:
        loaded = load_model(name)
        module = loaded.logits_module()
        for seq in seqs:
            inputs = example_inputs(loaded, seq=seq)
            cg = capture(module, inputs, name=f"{name}-{seq}")
            exes = {}
            for pol in ("aten", "onednn", *(("mkl",) if onednn.mkl_available() else ()), "auto"):
                os.environ["HETFORGE_GEMM"] = pol
                t0 = time.perf_counter()
                res = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=f"{name}-{seq}-{pol}")
                exes[pol] = (res.executable, time.perf_counter() - t0)
            os.environ.pop("HETFORGE_GEMM", None)
            fns = {"eager": (module, inputs), **{f"hetforge-{pol}": (e[0], inputs) for pol, e in exes.items()}}
            if bf16:  # the same weights in bfloat16, compiled the same way; KL against fp32 eager
                lb = load_model(name, dtype=torch.bfloat16)
                mb = lb.logits_module()
                cgb = capture(mb, inputs, name=f"{name}-{seq}-bf16")
                fns["eager-bf16"] = (mb, inputs)
                resb = compile_graph(cgb.gm, soc="host", example_inputs=inputs, name=f"{name}-{seq}-bf16")
                fns["hetforge-bf16"] = (resb.executable, inputs)
                gflop_bf16 = gemm_flops(resb.program) / 1e9
            with torch.no_grad():
                ref = module(*inputs)
                kls = {k: kl(ref, fns[k][0](*inputs)) for k in fns if k != "eager"}
                times: dict[str, list[float]] = {k: [] for k in fns}
                for _ in range(rounds):
                    for k, (f, args) in fns.items():
                        t0 = time.perf_counter()
                        f(*args)
                        times[k].append(time.perf_counter() - t0)
            flops = 2 * sum(p.numel() for n, p in module.named_parameters() if p.dim() == 2 and "wte" not in n
                            and "embed" not in n) * seq
            row = {"model": name, "seq": seq, "threads": threads,
                   "onednn_gemms": exes["auto"][0].stats.onednn_gemm, "mkl_gemms": exes["auto"][0].stats.mkl_gemm,
                   "compile_s": {k: round(v[1], 3) for k, v in exes.items()},
                   "kl_vs_eager": kls,
                   "best_ms": {k: round(min(v) * 1e3, 2) for k, v in times.items()},
                   "median_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()},
                   "approx_linear_gflop": round(flops / 1e9, 3)}
            row["ratio_auto_over_aten_best"] = round(row["best_ms"]["hetforge-auto"] /
                                                     row["best_ms"]["hetforge-aten"], 3)
            row["gemm_gflop"] = round(gemm_flops(exes["auto"][0].program) / 1e9, 3)
            if bf16:
                row["gemm_gflop_bf16"] = round(gflop_bf16, 3)
            reprobe_peak(peaks)
            fma_probe()
            after = peaks["fp32"]["reprobes"][-1]
            row["local_peak_fp32"] = max(before, after)  # the better of the peaks measured just before and after
            before = after
            row["ops"] = op_profile(exes["auto"][0], inputs)
            if perf_s > 0:
                from _perf import perf_shares

                with torch.no_grad():
                    row["perf"] = perf_shares(lambda e=exes["auto"][0], x=inputs: e(*x), perf_s)
            rows.append(row)
            print(json.dumps(row))
    for row in rows:  # the bound from the best peak of the whole run (reprobe_peak)
        apply_bound(row, peaks)
    fma_probe()
    fma = None if not fma_probes else {
        "gflops": round(max(fma_probes), 1), "probes": [round(v, 1) for v in fma_probes], "threads": threads}
    return {"rows": rows, "choices": onednn.measured_choices(), "peak": peaks, "fma": fma,
            "mkl_margin": onednn.margin_record() if onednn.mkl_available() else None}


def render(doc: dict) -> str:
    h = doc["host"]
    auto = "hetforge-auto"
    kinds = [k for k in ("hetforge-aten", "hetforge-onednn", "hetforge-mkl", "hetforge-auto")
             if any(k in r["best_ms"] for r in doc["rows"])]
    names = {"hetforge-aten": "ATen", "hetforge-onednn": "oneDNN", "hetforge-mkl": "MKL packed",
             "hetforge-auto": "measured choice"}
    local = int(any("local_peak_fp32" in r for r in doc["rows"]))  # a column for the peak measured next to a shape
    words = shlex.split(doc.get("command", ""))
    src = Path(words[words.index("--out") + 1]).name if "--out" in words[:-1] else "prefill_gemm.json"
    out = ["# Prefill GEMMs: ATen vs packed GEMMs (oneDNN, MKL) (measured)", "",
           f"Generated by `bench/prefill_gemm.py` from `{src}`. Host: {h['cpu']}, "
           f"{h['cores']} cores; ISA: {', '.join(h['isa']) or 'none recorded'}. {doc['note']}"
           + (f" Load average (1, 5, 15 min) at the start {doc['loadavg']['start']}, "
              f"at the end {doc['loadavg']['end']}." if "loadavg" in doc else ""), "",
           "Columns `hetforge …`: the same capture compiled with `HETFORGE_GEMM` forcing one kernel for every "
           "multi-row product, and the measured choice (`auto`, the default), whose products on oneDNN / MKL are "
           "counted in `packed GEMMs`.", "",
           "| model | seq | threads | packed GEMMs (oneDNN / MKL) | eager best ms | "
           + " | ".join(f"hetforge {names[k]} best ms" for k in kinds)
           + " | choice/ATen | GEMM GFLOP | GEMM bound ms | choice ÷ bound"
           + (" | choice ÷ bound at the peak measured next to it" if local else "") + " | KL ATen | KL choice |",
           "|" + "---|" * (11 + len(kinds) + local)]
    for r in doc["rows"]:
        b = r["best_ms"]
        bound = (f"{r['gemm_gflop']} | {r['bound_ms']['fp32']} | {r['over_bound_best']['fp32']}" if "bound_ms" in r
                 else "— | — | —")
        if local:
            bound += (f" | {b[auto] / (r['gemm_gflop'] / r['local_peak_fp32'] * 1e3):.3f}" if "local_peak_fp32" in r
                      else " | —")
        ratio = r["ratio_auto_over_aten_best"]
        out.append(f"| {r['model']} | {r['seq']} | {r['threads']} | {r['onednn_gemms']} / {r.get('mkl_gemms', 0)} | "
                   f"{b['eager']} | " + " | ".join(str(b.get(k, "—")) for k in kinds) + f" | {ratio} | {bound} | "
                   f"{r['kl_vs_eager']['hetforge-aten']:.2e} | {r['kl_vs_eager'][auto]:.2e} |")
    pk = doc.get("peak")
    reprobed = bool(pk) and any(v.get("reprobes") for v in pk.values())
    if pk:
        out += ["", "GEMM compute bound (measured in the same run, the peak `hetforge calibrate` uses: the fastest "
                "kernel, ATen or a packed one, on square n×n×n products, best over n"
                + (" and over the measurements repeated during the run" if reprobed else "") + "): "
                + "; ".join(f"{dt} {v['gflops']} GFLOP/s (by n: "
                            + ", ".join(f"{n}: {g}" for n, g in v["by_n"].items())
                            + (f"; n = {REPROBE_N} again after each model and length: "
                               + ", ".join(f"{g:g}" for g in v["reprobes"]) if v.get("reprobes") else "")
                            + ")" for dt, v in pk.items())
                + ". Bound = the program's GEMM FLOPs ÷ that peak (attention, norms and elementwise ops left out, so "
                "a lower bound); the issue's target is a prefill within 1.15× of it."
                + (" `choice ÷ bound at the peak measured next to it` divides by the better of the two peak "
                   "measurements just before and just after that shape's rounds instead (for a host whose speed "
                   "moves during the run; the target's column is `choice ÷ bound`)." if local else "")]
    fma = doc.get("fma")
    if pk and fma and "fp32" in pk:
        share = pk["fp32"]["gflops"] / fma["gflops"]
        when = (f"before and after everything else: {fma['before']} and {fma['after']} GFLOP/s" if "probes" not in fma
                else f"at the start, after each {'measurement' if reprobed else 'n'} of the peaks and at the end: "
                + ", ".join(f"{v:g}" for v in fma["probes"]) + " GFLOP/s")
        out += ["", f"FMA ceiling (measured in the same run, {when}): {fma['threads']} threads at once running "
                "independent fused multiply-adds on registers only (`native.fma_peak`), no loads. "
                + (f"The fp32 bound's peak is {share:.1%} of the best probe, {fma['gflops']} GFLOP/s. A prefill within "
                   f"1.15× of the bound therefore runs its GEMM FLOPs, with everything else included, at ≥ "
                   f"{share / 1.15:.1%} of what the FMA units can do with nothing but FMAs." if share <= 1 else
                   f"The fp32 bound's peak came out above the best probe ({share:.1%} of {fma['gflops']} GFLOP/s): "
                   "the host's speed moved between the measurements (a GEMM cannot outrun the FMA units), so this "
                   "run gives no ceiling to compare with.")]
    out += _render_perf(doc)
    out += _render_ops(doc)
    bf = [r for r in doc["rows"] if "hetforge-bf16" in r["best_ms"]]
    if bf:
        out += ["", "bf16 (same weights cast to bfloat16; KL against fp32 eager):", "",
                "| model | seq | eager bf16 best ms | hetforge bf16 best ms | hetforge fp32 best ms | KL eager bf16 "
                "| KL hetforge bf16 | hetforge bf16/fp32 | bf16 GEMM bound ms | bf16 ÷ bound |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in bf:
            b, k = r["best_ms"], r["kl_vs_eager"]
            bb = r.get("bound_ms", {}).get("bf16")
            out.append(f"| {r['model']} | {r['seq']} | {b['eager-bf16']} | {b['hetforge-bf16']} | "
                       f"{b[auto]} | {k['eager-bf16']:.2e} | {k['hetforge-bf16']:.2e} | "
                       f"{b['hetforge-bf16'] / b[auto]:.3f} | {bb if bb is not None else '—'} | "
                       f"{r['over_bound_best']['bf16'] if bb is not None else '—'} |")
    ch = doc.get("choices") or []
    if ch:
        mm = doc.get("mkl_margin")
        rule = ("above 1 + `onednn.MKL_MARGIN` against MKL, since session 29" if mm is None else
                f"above 1 + this host's margin against MKL, `onednn.mkl_margin()`: {mm['margin']:g} here, from MKL ÷ "
                f"oneDNN {mm['mkl_over_onednn']:.2f} on its calibration sequence at {mm['threads']} threads")
        out += ["", "The measured kernel choices (median per-round ratio of the other side's time ÷ oneDNN's over "
                f"interleaved rounds; above 1 ({rule}): "
                "oneDNN runs; the other side is MKL's packed sgemm for fp32 where this torch has it, else ATen's "
                "`linear`; for a gated MLP's gate and up products, activation `gated:…`, it is the native gated "
                "panel kernel, `panel-gated`, timed against oneDNN's two calls, and `runs` names the side that "
                "runs them; for the residual add after a product on oneDNN, activation `residual:bias|none`, it is "
                "the product alone then ATen's add, `aten-add`, timed against oneDNN's `add` post-op, and `runs` "
                "names who adds):", "",
                "| rows | K | N | dtype | threads | activation | other side | ratio | runs |",
                "|---|---|---|---|---|---|---|---|---|"]
        for c in ch:
            ratio = c.get("ratio")
            kernel = c.get("kernel") or ("onednn" if c["onednn"] else "aten")
            out.append(f"| {c['rows']} | {c['k']} | {c['n']} | {c['dtype']} | {c['threads']} | {c.get('act', '—')} | "
                       f"{c.get('aten_side', 'aten')} | {'—' if ratio is None else f'{ratio:.2f}'} | {kernel} |")
    out += ["", "All times measured (wall clock, best of the interleaved rounds; medians in the JSON). KL is "
            "KL(eager ‖ hetforge) over the vocabulary, mean over positions."]
    return "\n".join(out) + "\n"


def _render_perf(doc: dict) -> list[str]:
    """The page's section on where the measured-choice program's time goes (rows with a ``perf`` record)."""
    from _perf import GEMM_CATEGORIES, derived

    rows = [r for r in doc["rows"] if "perf" in r]
    if not rows:
        return []
    errors = sorted({r["perf"]["error"] for r in rows if "error" in r["perf"]})
    rows = [r for r in rows if "shares" in r["perf"]]
    out = ["", "## Where the time goes (measured: perf sampling; two columns derived)", ""]
    if errors:
        out += ["Not sampled: " + "; ".join(errors) + "."]
    if not rows:
        return out
    cats = list(GEMM_CATEGORIES) + sorted({c for r in rows for c in r["perf"]["shares"]} - set(GEMM_CATEGORIES),
                                          key=lambda c: (-max(r["perf"]["shares"].get(c, 0.0) for r in rows), c))
    p0 = rows[0]["perf"]
    out += [f"The measured-choice program called in a loop for {p0['seconds']:g} s while `perf record -F {p0['freq']}` "
            "sampled this process's threads (bench/_perf.py); each cell is the share of the samples. The OpenMP "
            "runtime's samples are threads spinning at a barrier or between parallel regions (time without work). "
            "`GEMM code` = the first two columns. `GEMM code's rate` = 1/(g·r) of the bound's peak and `ratio with "
            "GEMMs at the peak` = 1 + (1 − g)·r, with g the GEMM code's share and r the prefill ÷ bound above: "
            "derived, assuming the best call had the sampled window's shares.", "",
            "| model | seq | ms per call while sampled | samples | " + " | ".join(cats)
            + " | GEMM code | GEMM code's rate (of the peak) | ratio with GEMMs at the peak |",
            "|" + "---|" * (7 + len(cats))]
    for r in rows:
        p, ratio = r["perf"], r.get("over_bound_best", {}).get("fp32")
        g, rate, floor = derived(p, ratio or 0.0)
        cols = f"{rate:.1%} | {floor:.3f}" if ratio and g > 0 else "— | —"
        out.append(f"| {r['model']} | {r['seq']} | {p['ms_per_call']} | {p['samples']} | "
                   + " | ".join(f"{p['shares'].get(c, 0.0):.1%}" for c in cats) + f" | {g:.1%} | {cols} |")
    return out


def _render_ops(doc: dict) -> list[str]:
    """The page's per-op section (rows with an ``ops`` record)."""
    peak = doc.get("peak", {}).get("fp32", {}).get("gflops")
    rows = [(r, op_split(r, peak)) for r in doc["rows"] if peak]
    rows = [(r, sp) for r, sp in rows if sp]
    if not rows:
        return []
    out = ["", "## Per op in the program (measured: each instruction timed)", "",
           f"The measured-choice program called through `Executable.profile` (a clock read around every "
           f"instruction), the best of {rows[0][0]['ops']['calls']} calls by total; the instructions' times summed "
           "by op. `GEMM ops` are the bound's products (linear, addmm, mm, linear_act, gated_mlp); their rate is "
           "their FLOPs (the bound's formulas) ÷ their summed time, each call's dispatch and its threads' fork and "
           "join included: the rate inside the program, not of a kernel alone. `Everything else` is the other ops "
           "and the code between instructions, so the three `÷ bound` columns add up to the profiled call ÷ bound "
           "(a profiled call reads the clock twice per instruction, so it can run a little longer than the best "
           "call above). Attention's products are not in the bound."]
    hot = all("hot_ms" in sp for _, sp in rows)
    if hot:
        rec = rows[0][0]["ops"]
        out += ["", f"`hot` (measured): {rec['hot_calls']} more profiled calls in which every GEMM op's call runs "
                f"{rec['hot_again']} more times right after its own run; per instruction the least over those calls "
                "of its own run and of its best repeat (the same call with its inputs and weights now in cache, as a "
                "kernel timed alone would run; a grouped call's picking of its part, which is never repeated, at "
                "its own time). `GEMM ops hot ÷ bound` is what the products' kernels take on these shapes by "
                "themselves; `program ÷ hot` is their own runs in those calls ÷ their hot runs (what running inside "
                "the program adds: inputs and weights from memory or the other core's cache, dispatch, fork and "
                "join)."]
    out += ["", "| model | seq | profiled call ms | GEMM ops ms | GEMM ops GFLOP/s | of the peak | attention ms "
            "| everything else ms | GEMM ops ÷ bound | attention ÷ bound | everything else ÷ bound "
            "| profiled call ÷ bound |" + (" GEMM ops hot ÷ bound | GEMM ops hot, of the peak | program ÷ hot |"
                                            if hot else ""),
            "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if hot else "")]
    for r, sp in rows:
        out.append(f"| {r['model']} | {r['seq']} | {sp['total_ms']} | {sp['gemm_ms']:.2f} | {sp['gemm_gflops']:.0f} | "
                   f"{sp['gemm_of_peak']:.1%} | {sp['attention_ms']:.2f} | {sp['rest_ms']:.2f} | "
                   f"{sp['gemm_over_bound']:.3f} | {sp['attention_over_bound']:.3f} | {sp['rest_over_bound']:.3f} | "
                   f"{sp['total_over_bound']:.3f} |"
                   + (f" {sp['hot_over_bound']:.3f} | {sp['hot_of_peak']:.1%} | {sp['program_over_hot']:.3f} |"
                      if hot else ""))
    out += ["", "The GEMM ops by kind:", "", "| model | seq | op | calls | ms | GFLOP | GFLOP/s | of the peak |"
            + (" hot ms | hot, of the peak | program ÷ hot |" if hot else ""),
            "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if hot else "")]
    for r, _ in rows:
        for a in r["ops"]["ops"]:
            if a["gflop"] > 0 and a["ms"] > 0:
                rate = a["gflop"] / a["ms"] * 1e3
                out.append(f"| {r['model']} | {r['seq']} | `{a['op']}` | {a['calls']} | {a['ms']:.2f} | "
                           f"{a['gflop']:.2f} | {rate:.0f} | {rate / peak:.1%} |"
                           + (f" {a['hot_ms']:.2f} | {a['gflop'] / a['hot_ms'] * 1e3 / peak:.1%} | "
                              f"{a['again_ms'] / a['hot_ms']:.3f} |" if hot else ""))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,llama-110m")
    ap.add_argument("--seqs", default="128,512")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="add bf16 rows (eager and hetforge), KL against fp32 eager")
    ap.add_argument("--perf", type=float, default=4.0,
                    help="seconds of perf sampling per model and length (0: none; skipped with a note where perf "
                         "cannot sample)")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=str(DOCS / "prefill_gemm.json"))
    ap.add_argument("--from-json", default="", help="regenerate the page from this JSON, measuring nothing")
    a = ap.parse_args()
    if a.from_json:
        doc = json.loads(Path(a.from_json).read_text())
        Path(a.from_json).with_suffix(".md").write_text(render(doc))
        return
    load_start = [round(x, 2) for x in os.getloadavg()]
    if a.perf < 0:
        ap.error(f"--perf takes seconds of sampling, 0 or more (got {a.perf:g})")
    doc = run(a.models.split(","), [int(s) for s in a.seqs.split(",")], a.rounds, a.threads, a.bf16, a.perf)
    from hetforge.hardware.isa import host_record

    doc["host"] = host_record()
    doc["note"] = a.note
    doc["command"] = "python bench/prefill_gemm.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    doc["loadavg"] = {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    Path(a.out).with_suffix(".md").write_text(render(doc))


if __name__ == "__main__":
    main()
