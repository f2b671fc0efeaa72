"""Which kernel runs a prefill's attention, per dtype and row count: the native one or ATen's SDPA (measured).

``hetforge::attention`` of many query rows runs on the native kernel (``hf_prefill_attention``: fp32 flash-style
FMAs, bf16 rows widened; for bf16 without a mask, AMX tile products where the CPU has them) or on ATen's
``scaled_dot_product_attention`` (on this CPU its flash kernel, whose bf16 products use the CPU's bf16
instructions). This page times both on a **calibration** set of head layouts no
evaluated model has (the zoo's gpt2 / llama-110m use 12 heads of 64), causal, q/k/v the transposed views of one
fused projection output (as a program hands them over), each call right after that projection's GEMM (as in a
program; the GEMM alone is timed in the same rounds and taken off), the native kernel writing its dense output,
SDPA's result copied into one (what the program's ``functional-copy`` does), interleaved in ``--rounds`` rounds.

Per dtype, the smallest row count from which SDPA was faster on every shape at that count and at every larger
count measured is the rule's threshold (``native.sdpa_min_rows()``; none: the native kernel everywhere); the page
shows it next to the value in the code.

    python bench/prefill_attention.py [--rows 16,32,64,128,256,512,1024] [--rounds 7] [--threads 2] \\
        --out docs/bench/prefill_attention.json --md docs/bench/prefill_attention.md
    python bench/prefill_attention.py --from-json --out docs/bench/prefill_attention.json \\
        --md docs/bench/prefill_attention.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from _pages import add_page_args, end_meta, from_json_done, int_list, meta_lines, run_meta, write_result

from hetforge.kernels import native

SHAPES = [(16, 4, 128), (8, 8, 96), (32, 8, 64)]  # (query heads, kv heads, head dim): calibration layouts
DTYPES = ("float32", "bfloat16")


def _inputs(t: int, h: int, hkv: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The fused projection's GEMM (input, weight, output) and q/k/v as views of its output."""
    g = torch.Generator().manual_seed(t)
    width = h * d
    x = torch.randn(t, width, generator=g).to(dtype)
    w = (torch.randn(width, (h + 2 * hkv) * d, generator=g) * width ** -0.5).to(dtype)
    proj = torch.mm(x, w)
    q, k, v = proj.view(1, t, -1).split([h * d, hkv * d, hkv * d], dim=-1)
    return (x, w, proj, q.view(1, t, h, d).transpose(1, 2), k.view(1, t, hkv, d).transpose(1, 2),
            v.view(1, t, hkv, d).transpose(1, 2))


def measure(rows: list[int], rounds: int, dtypes: tuple[str, ...] = DTYPES) -> list[dict]:
    out = []
    for dts in dtypes:
        dt = getattr(torch, dts)
        for h, hkv, d in SHAPES:
            for t in rows:
                x, w, proj, q, k, v = _inputs(t, h, hkv, d, dt)
                y = torch.empty(1, h, t, d, dtype=dt)
                scale = d ** -0.5

                def gemm(x=x, w=w, proj=proj) -> None:  # the projection that runs before it in a program
                    torch.mm(x, w, out=proj)

                def nat(q=q, k=k, v=v, y=y, scale=scale) -> None:
                    gemm()
                    native.prefill_attention_into(q, k, v, None, y.data_ptr(), scale, True)

                def sdpa(q=q, k=k, v=v, y=y, scale=scale, gqa=h != hkv) -> None:
                    gemm()
                    y.copy_(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa))

                for f in (nat, sdpa, gemm, nat, sdpa, gemm):
                    f()
                times: dict[str, list[float]] = {"native": [], "sdpa": [], "gemm": []}
                for _ in range(rounds):
                    for name, f in (("native", nat), ("sdpa", sdpa), ("gemm", gemm)):
                        reps = max(1, int(2e-3 / max(times[name][-1] if times[name] else 1e-3, 1e-6)))
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            f()
                        times[name].append((time.perf_counter() - t0) / reps)
                att = {k_: [p - g_ for p, g_ in zip(times[k_], times["gemm"], strict=True)]
                       for k_ in ("native", "sdpa")}
                ratio = statistics.median(s / max(n, 1e-9) for s, n in zip(att["sdpa"], att["native"], strict=True))
                row = {"dtype": dts, "heads": h, "kv_heads": hkv, "head_dim": d, "rows": t,
                       "native_us": 1e6 * statistics.median(att["native"]),
                       "sdpa_us": 1e6 * statistics.median(att["sdpa"]),
                       "gemm_us": 1e6 * statistics.median(times["gemm"]), "sdpa_over_native": ratio}
                out.append(row)
                print(f"  {dts} {h}/{hkv}x{d} T={t}: native {row['native_us']:.0f} us, sdpa {row['sdpa_us']:.0f} us "
                      f"({ratio:.2f})", file=sys.stderr, flush=True)
    return out


def threshold(rows: list[dict], dts: str) -> int | None:
    """The smallest row count from which SDPA was faster on every shape at it and at every larger count."""
    counts = sorted({r["rows"] for r in rows if r["dtype"] == dts})
    wins = {t: all(r["sdpa_over_native"] < 1.0 for r in rows if r["dtype"] == dts and r["rows"] == t) for t in counts}
    best = None
    for t in reversed(counts):
        if not wins[t]:
            break
        best = t
    return best


def render(res: dict) -> str:
    rows = res["rows"]
    counts = sorted({r["rows"] for r in rows})
    lines = ["# Prefill attention: the native kernel or ATen's SDPA (measured)", "",
             "Generated by `bench/prefill_attention.py` from `prefill_attention.json` (never edited by hand). "
             + " ".join(meta_lines(res["meta"])), "",
             "Causal attention, q/k/v the transposed views of one fused projection output, each call right after that "
             "projection's GEMM (timed alone in the same rounds and taken off); the native kernel writes "
             "its dense output, SDPA's result is copied into one (the program's `functional-copy`). Head layouts: a "
             "calibration set no evaluated model has. Cells: SDPA time ÷ native time, median over interleaved "
             "rounds (below 1: SDPA faster); native µs in brackets.", "",
             "| dtype | heads / kv heads × dim | " + " | ".join(f"{t} rows" for t in counts) + " |",
             "|---|---|" + "---|" * len(counts)]
    for dts in DTYPES:
        for h, hkv, d in {(r["heads"], r["kv_heads"], r["head_dim"]) for r in rows if r["dtype"] == dts}:
            cells = {r["rows"]: r for r in rows if r["dtype"] == dts and (r["heads"], r["kv_heads"], r["head_dim"])
                     == (h, hkv, d)}
            lines.append(f"| {dts} | {h} / {hkv} × {d} | " + " | ".join(
                f"{cells[t]['sdpa_over_native']:.2f} ({cells[t]['native_us']:.0f})" if t in cells else "—"
                for t in counts) + " |")
    lines.append("")
    if "attention_simd" in res:
        path = {True: "avx512", False: "plain"}.get(res["attention_simd"], res["attention_simd"])  # older pages: a bool
        lines.append("The native kernel's path in this build: " + {
            "avx512": "AVX-512 (the rule in the code: `native.SDPA_MIN_ROWS`).",
            "avx2": "AVX2 with FMA, no AVX-512 (the rule in the code: `native.SDPA_MIN_ROWS_AVX2`).",
            "plain": "plain C loops and expf (the rule in the code: `native.SDPA_MIN_ROWS_PLAIN`)."}[path])
        lines.append("")
    for dts in (x for x in DTYPES if any(r["dtype"] == x for r in rows)):
        got = threshold(rows, dts)
        lines.append(f"- {dts}: SDPA faster on every shape from **{got if got is not None else 'no'}** rows on "
                     f"(to the largest count measured); in the code this ran: "
                     f"{res['in_code'].get(dts) if res['in_code'].get(dts) is not None else 'native everywhere'}.")
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="16,32,64,128,256,512,1024")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="of " + ", ".join(DTYPES) + " (a CPU that emulates "
                    "bf16 in software has no bf16 rule to calibrate)")
    add_page_args(ap)
    a = ap.parse_args(argv)
    if from_json_done(ap, a, render):
        return 0
    rows = int_list(ap, a.rows, "--rows")
    dtypes = tuple(x.strip() for x in a.dtypes.split(",") if x.strip())
    if not dtypes or any(x not in DTYPES for x in dtypes):
        ap.error(f"--dtypes takes a comma-separated list of {', '.join(DTYPES)}; got {a.dtypes!r}")
    if not rows or rows[0] < 2 or a.rounds < 1 or a.threads < 1:
        ap.error("--rows must be >= 2; --rounds, --threads >= 1")
    if native.library() is None:
        raise SystemExit("error: the native library is not built here (" + native.status().reason + "): nothing "
                         "to compare")
    torch.set_num_threads(a.threads)
    meta = run_meta("bench/prefill_attention.py", argv)
    res = {"rows": measure(rows, a.rounds, dtypes),  # the rule of this build's attention code, and which code
           "in_code": dict(native.sdpa_min_rows()), "attention_simd": native.prefill_attention_simd(),
           "meta": end_meta(meta)}
    write_result(res, a.out, a.md, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
