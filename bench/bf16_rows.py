"""Which kernel runs a bf16 product of several rows: a native kernel (AMX, or AVX512-BF16) or oneDNN's packed GEMM.

A prompt's bf16 products (a few to a few hundred rows) read every weight from memory once. oneDNN's packed bf16
GEMM reads them below the rate the one-row GEMVs reach; ``hf_gemm_amx_bf16`` streams a weight packed once into AMX
tiles as the GEMVs stream theirs (four prefetched streams) into AMX accumulators. This page times both on a
**calibration** set of weight shapes no evaluated model has, each product over a pool of distinct weights of at
least ``--gb`` GB (every weight read from memory, as in a prefill), interleaved in ``--rounds`` rounds.

``--kernel panel`` times ``hf_gemm_bf16_panel`` (vdpbf16ps on a weight packed once into 48-column panels; for
CPUs with AVX512-BF16 and no AMX) the same way, for its own page.

The rule in the code (``native.AMX_ROWS_MAX``, ``native.BF16_PANEL_ROWS_MAX``): the largest row count R such that
the native kernel was faster on every shape at every measured count from the smallest to R; the page shows it next
to the value in the code. The panel kernel's rule starts at ``native.BF16_PANEL_ROWS_MIN`` (the prefill programs'
smallest row count), so its page is measured from there: ``--rows 8,16,24,...``.

    python bench/bf16_rows.py [--kernel amx|panel] [--rows 2,4,8,16,32,64,128,256,512] [--rounds 5] [--threads 2] \\
        [--gb 0.5] --out docs/bench/bf16_rows.json --md docs/bench/bf16_rows.md
    python bench/bf16_rows.py --from-json --out docs/bench/bf16_rows.json --md docs/bench/bf16_rows.md
    python bench/bf16_rows.py --kernel panel --rows 8,16,24,32,48,64 --rounds 9 \\
        --out docs/bench/bf16_panel_rows.json --md docs/bench/bf16_panel_rows.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _pages import add_page_args, end_meta, faster_through, from_json_done, int_list, meta_lines, run_meta, write_result

from hetforge.kernels import native, onednn

SHAPES = [(4096, 1024), (1024, 4096), (2816, 1024)]  # (N, K) of [N, K] weights: calibration widths


JSON_NAME = {"amx": "bf16_rows.json", "panel": "bf16_panel_rows.json"}  # the page's JSON in docs/bench, per --kernel
KERNELS = {  # --kernel: (pack, product, name on the page, its constant in the code)
    "amx": (native.pack_amx_bf16, native.gemm_amx_bf16, "hf_gemm_amx_bf16", "AMX_ROWS_MAX"),
    "panel": (native.pack_bf16_panels, native.gemm_bf16_panel, "hf_gemm_bf16_panel", "BF16_PANEL_ROWS_MAX"),
}


def measure(rows: list[int], rounds: int, gb: float, kernel: str = "amx") -> list[dict]:
    pack, gemm = KERNELS[kernel][:2]
    out = []
    lp = torch.ops.mkldnn._linear_pointwise.default
    for n, k in SHAPES:
        count = max(2, int(gb * 1e9 / (n * k * 2)))
        g = torch.Generator().manual_seed(n + k)
        pool = [(torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16) for _ in range(count)]
        amx = [pack(w) for w in pool]  # one packing serves every row count
        bias = torch.zeros(n, dtype=torch.bfloat16)
        for r in rows:
            x = torch.randn(r, k, generator=g).to(torch.bfloat16)
            packed = [onednn.pack(w, False, r, "onednn") for w in pool]

            def nat(x=x, amx=amx, bias=bias, n=n) -> None:
                for w in amx:
                    gemm(x, w, bias, n)

            def dnn(x=x, packed=packed, bias=bias) -> None:
                for p in packed:
                    lp(x, p, bias, "none", [], "")

            nat(), dnn()
            times: dict[str, list[float]] = {"native": [], "onednn": []}
            for _ in range(rounds):
                for name, f in (("native", nat), ("onednn", dnn)):
                    t0 = time.perf_counter()
                    f()
                    times[name].append((time.perf_counter() - t0) / count)
            ratio = statistics.median(a / b for a, b in zip(times["native"], times["onednn"], strict=True))
            row = {"n": n, "k": k, "rows": r, "pool": count, "native_us": 1e6 * statistics.median(times["native"]),
                   "onednn_us": 1e6 * statistics.median(times["onednn"]), "native_over_onednn": ratio,
                   "native_gbs": n * k * 2 / min(times["native"]) / 1e9,
                   "onednn_gbs": n * k * 2 / min(times["onednn"]) / 1e9}
            out.append(row)
            print(f"  [{r}, {k}] x [{k}, {n}]: native {row['native_gbs']:.1f} GB/s, oneDNN {row['onednn_gbs']:.1f} "
                  f"GB/s ({ratio:.2f})", file=sys.stderr, flush=True)
            del packed
    return out


def threshold(rows: list[dict]) -> int | None:
    """The largest R with the native kernel faster on every shape at every measured count from the smallest to R."""
    counts = {x["rows"] for x in rows}
    return faster_through({r: [x["native_over_onednn"] for x in rows if x["rows"] == r] for r in counts})


def render(res: dict) -> str:
    rows = res["rows"]
    counts = sorted({r["rows"] for r in rows})
    kernel = res.get("kernel", "amx")
    _, _, fn, const = KERNELS[kernel]
    title = {"amx": "native AMX kernel", "panel": "native AVX512-BF16 panel kernel"}[kernel]
    lines = [f"# bf16 products of several rows: {title} vs oneDNN (measured)", "",
             f"Generated by `bench/bf16_rows.py` from `{JSON_NAME[kernel]}` (never edited by hand). "
             + " ".join(meta_lines(res["meta"])), "",
             f"Each product over a pool of distinct bf16 weights (≥ {res['gb']} GB: every weight read from memory, as "
             f"in a prefill); `{fn}` against oneDNN's `_linear_pointwise` on a weight packed for that row "
             "count; weight shapes: a calibration set no evaluated model has. Cells: native time ÷ oneDNN time, median "
             "over interleaved rounds (below 1: native faster); in brackets the weight read rate of the best pass, "
             "native / oneDNN GB/s.", "",
             "| weight [N, K] | " + " | ".join(f"{r} rows" for r in counts) + " |", "|---|" + "---|" * len(counts)]
    for n, k in sorted({(r["n"], r["k"]) for r in rows}):
        cells = {r["rows"]: r for r in rows if (r["n"], r["k"]) == (n, k)}
        lines.append(f"| [{n}, {k}] | " + " | ".join(
            f"{c['native_over_onednn']:.2f} ({c['native_gbs']:.0f} / {c['onednn_gbs']:.0f})" if (c := cells.get(r))
            else "—" for r in counts) + " |")
    got = threshold(rows)
    lines += ["", f"Native faster on every shape from {counts[0]} to **{got if got is not None else 'no'}** rows; "
              f"`native.{const}` in the code this ran: {res['in_code']}"
              + (f" (from `native.BF16_PANEL_ROWS_MIN` = {res['in_code_min']})" if "in_code_min" in res else "")
              + ".", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", choices=sorted(KERNELS), default="amx")
    ap.add_argument("--rows", default="2,4,8,16,32,64,128,256,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gb", type=float, default=0.5, help="weight pool per shape, GB (well above the LLC)")
    add_page_args(ap)
    a = ap.parse_args(argv)
    if from_json_done(ap, a, render):
        return 0
    rows = int_list(ap, a.rows, "--rows")
    if not rows or rows[0] < 1 or a.rounds < 1 or a.threads < 1 or a.gb <= 0:
        ap.error("--rows >= 1; --rounds, --threads >= 1; --gb > 0")
    runs = native.amx_bf16_available() if a.kernel == "amx" else native.bf16_panel_available()
    if not runs or not onednn.available():
        raise SystemExit(f"error: this host runs no {KERNELS[a.kernel][2]} (no "
                         f"{'AMX' if a.kernel == 'amx' else 'AVX512-BF16'}, or no native library) or has no oneDNN: "
                         "nothing to compare")
    torch.set_num_threads(a.threads)
    meta = run_meta("bench/bf16_rows.py", argv)
    res = {"gb": a.gb, "kernel": a.kernel, "rows": measure(rows, a.rounds, a.gb, a.kernel),
           "in_code": getattr(native, KERNELS[a.kernel][3]), "meta": end_meta(meta)}
    if a.kernel == "panel":
        res["in_code_min"] = native.BF16_PANEL_ROWS_MIN
    write_result(res, a.out, a.md, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
