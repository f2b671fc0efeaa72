"""Short-prompt products from memory: the native panel GEMM against the packed GEMMs torch ships, by row count.

Why this page: a prompt of a few dozen tokens still reads every weight from memory once, so how a kernel overlaps
that read with its arithmetic decides its speed; :func:`hetforge.kernels.onednn.pick` times kernels on one weight
reused call after call (served from cache), which cannot see it. Here every kernel runs over a pool of distinct
weights totalling at least ``--factor`` last-level caches, so each product reads its weight from memory, as a
prefill program does.

The weight shapes are a **calibration** set, not any model hetforge is evaluated on (no zoo model has them):
two families of one layer's four fp32 products (``[N, K]`` weights, each with a bias): ``d1024`` (1024→3072,
1024→1024, 1024→4096, 4096→1024) and ``d2048`` (2048→6144, 2048→2048, 2048→5632, 5632→2048). The longest run of
row counts at which the panel GEMM is the fastest kernel in both families (up to ``FEW_MAX`` rows the few-row
kernel included) is what lowering sends to it (:data:`hetforge.kernels.native.PANEL_MIN` .. ``PANEL_MAX``;
docs/arch/runtime.md says which run and host set the current range).

Kernels (all measured, wall clock, ``--threads`` threads): ATen's ``linear`` (the weight as stored), oneDNN's
packed linear, MKL's packed sgemm (where this torch has it), the native panel GEMM (``hf_gemm_panel``), and up to
:data:`hetforge.kernels.native.FEW_MAX` rows the native few-row kernel (``hf_gemm_few``). ``--rounds``
interleaved rounds; in each, every kernel runs one pass over the pool (after a warm-up pass); per row count the
median pass time per kernel, and the median over rounds of the per-round ratio panel ÷ the fastest other kernel
of that round.

    python bench/panel_gemm.py [--rows 2,4,8,12,16,24,32,48,64,96,128] [--rounds 5] [--threads 2] [--factor 3] \\
        --out docs/bench/panel_gemm.json --md docs/bench/panel_gemm.md
    python bench/panel_gemm.py --from-json --out docs/bench/panel_gemm.json --md docs/bench/panel_gemm.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from _pages import add_page_args, end_meta, from_json_done, meta_lines, run_meta, write_result

from hetforge.kernels import native, onednn
from hetforge.kernels.native import llc_bytes

FAMILIES = {  # (K, N) of one layer's products; no zoo model has these widths
    "d1024": [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)],
    "d2048": [(2048, 6144), (2048, 2048), (2048, 5632), (5632, 2048)],
}
ROWS = [2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128]


def _kernels(rows: int, pool: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, list]:
    """Per kernel, one closure per pool weight running ``x·Wᵀ + b`` for ``rows`` rows (packing done here)."""
    xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w, _ in pool}}
    out: dict[str, list] = {"aten": [(lambda w=w, b=b: F.linear(xs[w.shape[1]], w, b)) for w, b in pool]}
    if onednn.available():
        pk = [onednn.packed_weight(w, False, rows) for w, _ in pool]
        lp = torch.ops.mkldnn._linear_pointwise.default
        out["onednn"] = [(lambda w=w, b=b, p=p: lp(xs[w.shape[1]], p, b, "none", [], ""))
                         for (w, b), p in zip(pool, pk, strict=True)]
    if onednn.mkl_available():
        pk = [onednn.packed_weight(w, False, rows, "mkl") for w, _ in pool]
        out["mkl"] = [(lambda w=w, b=b, p=p: onednn.mkl_linear(xs[w.shape[1]], p, w, b, rows))
                      for (w, b), p in zip(pool, pk, strict=True)]
    pk = [onednn.packed_weight(w, False, rows, "panel") for w, _ in pool]
    out["panel"] = [(lambda w=w, b=b, p=p: native.gemm_panel(xs[w.shape[1]], p, b, w.shape[0]))
                    for (w, b), p in zip(pool, pk, strict=True)]
    if rows <= native.FEW_MAX:
        lib, nt = native.library(), torch.get_num_threads()
        ys = {n: torch.empty(rows, n) for n in {w.shape[0] for w, _ in pool}}

        def few(w: torch.Tensor, b: torch.Tensor) -> None:
            n, k = w.shape
            native.check_few_rc(lib.hf_gemm_few(w.data_ptr(), xs[k].data_ptr(), b.data_ptr(), ys[n].data_ptr(),
                                                rows, n, k, 0, nt))
        out["few"] = [(lambda w=w, b=b: few(w, b)) for w, b in pool]
    return out


def measure_family(shapes: list[tuple[int, int]], rows_list: list[int], rounds: int, factor: int) -> dict:
    layer_bytes = sum(k * n * 4 for k, n in shapes)
    layers = max(2, -(-factor * llc_bytes() // layer_bytes))
    g = torch.Generator().manual_seed(0)
    pool = [(torch.randn(n, k, generator=g) * 0.02, torch.randn(n, generator=g) * 0.02)
            for _ in range(layers) for k, n in shapes]
    flops_per_row = sum(2 * k * n for k, n in shapes) * layers
    res: dict = {"shapes": shapes, "layers": layers, "pool_bytes": layer_bytes * layers, "rows": {}}
    for rows in rows_list:
        ks = _kernels(rows, pool)
        times: dict[str, list[float]] = {name: [] for name in ks}
        for calls in ks.values():  # warm-up pass: first touch of packed copies and outputs
            for c in calls:
                c()
        for _ in range(rounds):
            for name, calls in ks.items():
                t0 = time.perf_counter()
                for c in calls:
                    c()
                times[name].append(time.perf_counter() - t0)
        others = [n for n in times if n != "panel"]
        ratios = [times["panel"][i] / min(times[n][i] for n in others) for i in range(rounds)]
        res["rows"][str(rows)] = {"times_s": times, "flops": flops_per_row * rows,
                                  "panel_ratio_median": statistics.median(ratios)}
        del ks
        print(f"  rows {rows}: " + ", ".join(f"{n} {statistics.median(t) * 1e3:.1f} ms" for n, t in times.items())
              + f"; panel / best other {statistics.median(ratios):.3f}", file=sys.stderr, flush=True)
    return res


def panel_range(res: dict) -> tuple[int, int] | None:
    """The longest run of consecutive measured row counts at which the panel GEMM was the fastest kernel (median
    per-round ratio ≤ 1; up to :data:`native.FEW_MAX` rows the few-row kernel is among the others) in every
    family, as (first, last); None when there is none."""
    rows = sorted({int(r) for f in res["families"].values() for r in f["rows"]})
    runs: list[list[int]] = [[]]
    for r in rows:
        if all(f["rows"][str(r)]["panel_ratio_median"] <= 1.0 for f in res["families"].values()
               if str(r) in f["rows"]):
            runs[-1].append(r)
        elif runs[-1]:
            runs.append([])
    best = max(runs, key=len)
    return (best[0], best[-1]) if best else None


def render(res: dict) -> str:
    m = res["meta"]
    lines = ["# Short-prompt products from memory: the native panel GEMM against torch's packed GEMMs (measured)", "",
             "Generated by `bench/panel_gemm.py` from `panel_gemm.json` (never edited by hand). "
             + " ".join(meta_lines(m)), "",
             "Every kernel runs over a pool of distinct weights of at least "
             f"{res['factor']} last-level caches ({res['llc_bytes'] / 2**20:.0f} MiB here), so each product reads "
             "its weight from memory. Shapes: a calibration set no zoo model has (the script's docstring). Cells: "
             "median pass time over the pool in ms (GFLOP/s); the last column is the median over rounds of "
             "the per-round ratio panel ÷ the fastest other kernel of that round (below 1: the panel GEMM was "
             "faster).", ""]
    for fam, f in res["families"].items():
        names = list(next(iter(f["rows"].values()))["times_s"])
        names += [n for r in f["rows"].values() for n in r["times_s"] if n not in names]
        lines += [f"## {fam}: {', '.join(f'{k}→{n}' for k, n in f['shapes'])} × {f['layers']} layers "
                  f"({f['pool_bytes'] / 2**20:.0f} MiB)", "",
                  "| rows | " + " | ".join(names) + " | panel ÷ fastest other |",
                  "|---" * (len(names) + 2) + "|"]
        for r, row in f["rows"].items():
            cells = []
            for n in names:
                t = row["times_s"].get(n)
                cells.append("—" if t is None else
                             f"{statistics.median(t) * 1e3:.1f} ({row['flops'] / statistics.median(t) / 1e9:.0f})")
            lines.append(f"| {r} | " + " | ".join(cells) + f" | {row['panel_ratio_median']:.3f} |")
        lines.append("")
    rng = panel_range(res)
    code = f"{res['panel_min_in_code']}..{res['panel_max_in_code']}"
    lines += ["Longest run of measured row counts at which the panel GEMM was the fastest kernel (up to "
              f"{res['few_max']} rows the few-row kernel included) in every family: "
              + (f"**{rng[0]}..{rng[1]}**" if rng else "**none**")
              + f" (`hetforge.kernels.native.PANEL_MIN..PANEL_MAX`, the row counts lowering sends to it, were {code} "
              "in the code this ran).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--factor", type=int, default=3, help="pool size in last-level caches")
    ap.add_argument("--families", default=",".join(FAMILIES))
    add_page_args(ap)
    a = ap.parse_args(argv)
    if from_json_done(ap, a, render):
        return 0
    try:
        rows = [int(r) for r in a.rows.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--rows takes comma-separated integers, got {a.rows!r}")
    fams = [f.strip() for f in a.families.split(",") if f.strip()]
    if not rows or min(rows) < 2 or a.rounds < 1 or a.threads < 1 or a.factor < 1:
        ap.error("--rows must be >= 2, --rounds, --threads and --factor >= 1")
    if unknown := [f for f in fams if f not in FAMILIES]:
        ap.error(f"unknown --families {', '.join(unknown)}; allowed: {', '.join(FAMILIES)}")
    if native.library() is None or not native.panel_available():
        print("error: the native panel GEMM is not vectorized here (needs the native library built with AVX-512); "
              "nothing measured", file=sys.stderr)
        return 1
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    meta = run_meta("bench/panel_gemm.py", argv)
    res = {"factor": a.factor, "llc_bytes": llc_bytes(), "few_max": native.FEW_MAX,
           "panel_min_in_code": native.PANEL_MIN, "panel_max_in_code": native.PANEL_MAX, "families": {}}
    for fam in fams:
        print(f"{fam}:", file=sys.stderr, flush=True)
        res["families"][fam] = measure_family(FAMILIES[fam], rows, a.rounds, a.factor)
    res["meta"] = end_meta(meta)
    write_result(res, a.out, a.md, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
