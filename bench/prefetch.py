"""How far ahead the one-row products prefetch their weight streams (``HF_PF_BYTES`` in native.c), chosen here.

The native one-row kernels read each weight as four streams per thread. The hardware prefetchers stop at 4 KiB
pages and, with four streams per core, do not run far enough ahead to keep DRAM busy; a software prefetch a
fixed distance ahead of every stream does. This page measures that distance: the native library is built once
per ``--distances`` value (``-DHF_PF_BYTES=N``, the project's own compiler flags; 0 = no prefetch) and every
build runs the same products, interleaved in ``--rounds`` rounds, each over a pool of distinct weights of at
least ``--gb`` GB (every read from memory, as a decode step's).

The shapes are a **calibration** set no evaluated model has (1024- and 4096-wide, the families of
``bench/panel_gemm.py``): fp32 ``[N, K]`` (``hf_gemv_nk``) and ``[K, N]`` (``hf_gemv_kn``, split-K) products and
the bf16 ones (``hf_gemv_bf16``). Per build and shape: the best pass over the pool (GB/s = pool bytes ÷ time),
and the median over rounds of the per-round ratio to the build without prefetch. The distance in native.c is the
one with the best geometric mean of those ratios; where the fp32 and bf16 rows disagree run after run, the fp32
streams take their own (``HF_PF_BYTES_F32``, per CPU family in ``native.host_defines``).

    python bench/prefetch.py [--distances 0,1024,2048,4096] [--rounds 3] [--threads 2] [--gb 1.0] \\
        --out docs/bench/prefetch.json --md docs/bench/prefetch.md
    python bench/prefetch.py --from-json --out docs/bench/prefetch.json --md docs/bench/prefetch.md
"""

from __future__ import annotations

import argparse
import ctypes
import math
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _pages import add_page_args, end_meta, from_json_done, int_list, meta_lines, ratio_means, run_meta, write_result

from hetforge.kernels import native

SHAPES = [  # (kind, N, K, dtype): calibration widths, no zoo model has them
    ("nk", 4096, 1024, "float32"), ("nk", 1024, 4096, "float32"),
    ("kn", 4096, 1024, "float32"), ("kn", 1024, 4096, "float32"),
    ("nk", 4096, 1024, "bfloat16"), ("kn", 4096, 1024, "bfloat16"),
]


def _in_code(macro: str = "HF_PF_BYTES") -> int:
    """The distance the project's build uses on this host for ``macro`` (``HF_PF_BYTES``: every stream;
    ``HF_PF_BYTES_F32``: the fp32 ones, else ``HF_PF_BYTES``'s): a ``-D`` of its flags (``native.host_defines``),
    else native.c's default."""
    for flag in native.FLAG_SETS[0]:
        if flag.startswith(f"-D{macro}="):
            return int(flag.split("=", 1)[1])
    if macro != "HF_PF_BYTES":
        return _in_code()
    m = re.search(r"#define HF_PF_BYTES (\d+)", native.SOURCE.read_text())
    return int(m.group(1)) if m else -1


def _builds(distances: list[int], folder: Path) -> dict[int, ctypes.CDLL]:
    """One native library per distance, built with the flags the project's own build uses."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("error: no C compiler (cc/gcc) here: nothing measured")
    libs = {}
    for d in distances:
        out = folder / f"native_pf{d}.so"
        flags = [f for f in native.FLAG_SETS[0] if not f.startswith(("-DHF_PF_BYTES=", "-DHF_PF_BYTES_F32="))]
        err = native._build(cc, [*flags, f"-DHF_PF_BYTES={d}"], out)
        if err:
            raise SystemExit(f"error: building the native library with HF_PF_BYTES={d} failed: {err}")
        lib = ctypes.CDLL(str(out))
        for name, args in native.SIGNATURES.items():
            if hasattr(lib, name):
                getattr(lib, name).argtypes = args
        libs[d] = lib
    return libs


def _call(lib, kind: str, dt: torch.dtype, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, part: torch.Tensor,
          n: int, k: int, threads: int) -> None:
    kn = kind == "kn"
    pp, slots = (part.data_ptr(), part.shape[0]) if kn else (None, 0)
    if dt == torch.bfloat16:
        lib.hf_gemv_bf16(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), n, k, int(kn), 0, threads, pp, slots)
    elif kn:
        lib.hf_gemv_kn(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), n, k, threads, pp, slots)
    else:
        lib.hf_gemv_nk(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), n, k, threads)


def measure(libs: dict[int, ctypes.CDLL], rounds: int, threads: int, gb: float) -> list[dict]:
    rows = []
    for kind, n, k, dts in SHAPES:
        dt = getattr(torch, dts)
        esz = torch.empty(0, dtype=dt).element_size()
        count = max(4, math.ceil(gb * 1e9 / (n * k * esz)))
        g = torch.Generator().manual_seed(n + k)
        pool = [(torch.randn(n, k, generator=g) if kind == "nk" else torch.randn(k, n, generator=g)).to(dt)
                for _ in range(count)]
        x, y = torch.randn(k, generator=g).to(dt), torch.empty(n, dtype=dt)
        part = torch.empty((native.split_k_slots(), n), dtype=torch.float32)
        times: dict[str, list[float]] = {str(d): [] for d in libs}  # keyed as the JSON keeps them
        for lib in libs.values():  # warm-up pass
            for w in pool:
                _call(lib, kind, dt, w, x, y, part, n, k, threads)
        for _ in range(rounds):
            for d, lib in libs.items():
                t0 = time.perf_counter()
                for w in pool:
                    _call(lib, kind, dt, w, x, y, part, n, k, threads)
                times[str(d)].append(time.perf_counter() - t0)
        row = {"kind": kind, "n": n, "k": k, "dtype": dts, "pool_bytes": count * n * k * esz, "times_s": times,
               "ratio_to_none": {d: statistics.median(t[i] / times["0"][i] for i in range(rounds))
                                 for d, t in times.items()}}
        rows.append(row)
        print(f"  {kind} [{n}, {k}] {dts}: " + ", ".join(
            f"{d} B {row['pool_bytes'] / min(t) / 1e9:.1f} GB/s" for d, t in times.items()), file=sys.stderr,
            flush=True)
        del pool
    return rows


def render(res: dict) -> str:
    m = res["meta"]
    rows = res["rows"]
    ds = list(rows[0]["ratio_to_none"])  # distances in bytes, as strings (JSON keys)
    lines = ["# Weight-stream prefetch distance of the one-row products (measured)", "",
             "Generated by `bench/prefetch.py` from `prefetch.json` (never edited by hand). " + " ".join(meta_lines(m)),
             "", "One native library per prefetch distance (`-DHF_PF_BYTES`, bytes ahead of each of a thread's four "
             "weight streams; 0 = none), the same products interleaved over pools of distinct weights (every read "
             f"from memory, ≥ {res['gb']} GB per shape). Shapes: a calibration set no evaluated model has. Cells: "
             "GB/s of the best pass over the pool, and (in brackets) the median over rounds of the per-round time "
             "ratio to the build without prefetch (below 1: faster).", "",
             "| product | weight | dtype | " + " | ".join(f"{d} B" for d in ds) + " |",
             "|---|---|---|" + "---|" * len(ds)]
    for r in rows:
        shape = f"[{r['n']}, {r['k']}]" if r["kind"] == "nk" else f"[{r['k']}, {r['n']}]"
        name = {"nk": "`[N, K]`", "kn": "`[K, N]` split-K"}[r["kind"]]
        lines.append(f"| {name} | {shape} | {r['dtype']} | " + " | ".join(
            f"{r['pool_bytes'] / min(r['times_s'][d]) / 1e9:.1f} ({r['ratio_to_none'][d]:.3f})" for d in ds) + " |")
    gm = ratio_means(rows)
    best = min(ds, key=lambda d: gm[d])
    lines += ["", "Geometric mean of the ratios: " + ", ".join(f"{d} B {gm[d]:.3f}" for d in ds)
              + f". Best: **{best} bytes**; `HF_PF_BYTES` in the code this ran: {res['in_code']}.", ""]
    per = {dt: ratio_means(rows, dt) for dt in dict.fromkeys(r["dtype"] for r in rows)}
    lines += ["By dtype (the fp32 streams have their own distance, `HF_PF_BYTES_F32`): " + "; ".join(
        f"{dt} " + ", ".join(f"{d} B {g:.3f}" for d, g in gms.items()) + f" (best {min(gms, key=gms.get)} B)"
        for dt, gms in per.items()) + f". In the code this ran: fp32 {res.get('in_code_fp32', res['in_code'])} B, "
        f"the others {res['in_code']} B.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--distances", default="0,1024,2048,4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gb", type=float, default=1.0, help="pool size per shape, GB (well above the LLC share)")
    add_page_args(ap)
    a = ap.parse_args(argv)
    if from_json_done(ap, a, render):
        return 0
    ds = int_list(ap, a.distances, "--distances")
    if not ds or ds[0] != 0 or any(d < 0 for d in ds) or a.rounds < 1 or a.threads < 1 or a.gb <= 0:
        ap.error("--distances must include 0 (the baseline) and be >= 0; --rounds, --threads >= 1; --gb > 0")
    torch.set_num_threads(a.threads)
    meta = run_meta("bench/prefetch.py", argv)
    with tempfile.TemporaryDirectory(prefix="hetforge-prefetch-") as tmp:
        libs = _builds(ds, Path(tmp))
        rows = measure(libs, a.rounds, a.threads, a.gb)
    res = {"gb": a.gb, "in_code": _in_code(), "in_code_fp32": _in_code("HF_PF_BYTES_F32"), "rows": rows,
           "meta": end_meta(meta)}
    write_result(res, a.out, a.md, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
