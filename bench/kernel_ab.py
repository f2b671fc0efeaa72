"""The native kernels built from a git revision's ``native.c`` against the working tree's, side by side (measured).

Why: a kernel's speed can move with an edit that does not touch it. In session 35 a second caller of the panel
GEMM's inner block made GCC keep that block out of line, and every panel product ran 5-9% slower with the same
bits, so no test saw it. This script builds both sources with the project's own flags
(``native.FLAG_SETS[0]``), loads both libraries into one process and runs the same calls on each, interleaved in
``--rounds`` rounds (the order flips every round):

- the panel GEMM (``hf_gemm_panel``) at ``--rows`` rows over a pool of calibration weights (1024/4096-wide, no zoo
  model has them) of at least 3 last-level caches, each library on weights packed by its own ``hf_pack_panels``;
- the one-row products ``hf_gemv_nk`` and ``hf_gemv_kn`` over pools of the same size;
- the w8 products with int8 activation blocks (``hf_gemm_q8a`` at ``--rows`` rows, ``hf_gemv_q8a`` for one row) over
  a pool of the same calibration weights quantized per channel to int8, of at least 3 last-level caches;
- the prefill attention (``hf_prefill_attention``, causal: ``is_causal`` and the same pattern as a bool mask) on two
  calibration head layouts at 16, 128 and 512 rows, and in bf16 (``is_causal``, its bf16-product path: AMX or
  AVX512-BF16 where the CPU has them);
- the decode attention (``hf_decode_attention``, fp32, and ``hf_decode_attention_bf16``) of one new row on the same
  layouts, over caches of 256 and 1024 positions with the first three quarters written (the rest hidden by the
  mask, as in a decode step), each call on the next cache of a pool of at least 3 last-level caches: in a decode
  step a layer's cache comes from memory, since the weights streamed through every cache level after it was read.

Per case: the median over rounds of the per-round time ratio working tree ÷ base (below 1: the working tree is
faster) and whether both builds gave the same bits. ``--max-ratio R`` makes the exit status 1 when a case's median
ratio is above R (a guard before committing a change to native.c; the host is shared and noisy, so rerun a case
that fails by a little). Nothing is written unless ``--json`` names a file.

    python bench/kernel_ab.py [--base HEAD] [--rows 16,128] [--rounds 7] [--threads 2] [--max-ratio 1.03] \\
        [--groups panel,gemv,w8,attention,decode] [--json ab.json]
"""

from __future__ import annotations

import argparse
import ctypes
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _pages import int_list, run_meta

from hetforge.errors import UsageError
from hetforge.files import check_output, write_json
from hetforge.kernels import native
from hetforge.quant.schemes import quantize_int8

PANEL_SHAPES = [(3072, 1024), (1024, 1024), (4096, 1024), (1024, 4096)]  # (N, K): calibration widths
GEMV_SHAPES = [("nk", 4096, 1024), ("kn", 1024, 4096)]  # (layout, N, K)
ATTENTION = [(32, 8, 64), (16, 4, 128)]  # (query heads, kv heads, head dim): calibration layouts
ATTENTION_ROWS = (16, 128, 512)
DECODE_CACHES = (256, 1024)  # positions of the decode attention's cache (the first 3/4 written)
GROUPS = ("panel", "gemv", "w8", "attention", "decode")  # --groups: the kernels timed
POOL_LLCS = 3


def base_source(rev: str) -> str | None:
    """``native.c`` as committed at ``rev``, or None where git has no such file there (an unknown revision)."""
    rel = native.SOURCE.relative_to(native.SOURCE.parents[3]).as_posix()
    got = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=native.SOURCE.parent, capture_output=True, text=True)
    return got.stdout if got.returncode == 0 else None


def _panel_width(source: str) -> int | None:
    m = re.search(r"#define HF_PNB (\d+)", source)
    return int(m.group(1)) if m else None


KERNELS = ("hf_pack_panels", "hf_gemm_panel", "hf_gemv_nk", "hf_gemv_kn", "hf_gemm_q8a", "hf_gemv_q8a",
           "hf_prefill_attention", "hf_decode_attention", "hf_decode_attention_bf16")  # what it times


def build(source: str, folder: Path, name: str) -> ctypes.CDLL:
    """``source`` built with the project's flags into ``folder`` and loaded, with the library's signatures set."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("error: no C compiler (cc/gcc) here: nothing measured")
    src = folder / f"{name}.c"
    src.write_text(source)
    out = folder / f"{name}.so"
    err = native._build(cc, native.FLAG_SETS[0], out, source=src)
    if err:
        raise SystemExit(f"error: building {name}'s native.c failed: {err}")
    # loaded with the library's signatures, as the project loads its own; an older revision may lack later kernels
    lib, why = native._open(out, need=KERNELS)
    if lib is None:
        raise SystemExit(f"error: {name}'s native library does not load: {why}")
    return lib


def pool_count(nbytes_each: int) -> int:
    return max(2, -(-POOL_LLCS * native.llc_bytes() // nbytes_each))


def panel_cases(libs: dict[str, ctypes.CDLL], rows_list: list[int], threads: int) -> list[dict]:
    """One case per row count: every pool weight's product, on each library's own packed copy."""
    g = torch.Generator().manual_seed(1)
    layer = sum(n * k * 4 for n, k in PANEL_SHAPES)
    ws = [(torch.randn(n, k, generator=g) * 0.02, n, k) for _ in range(pool_count(layer)) for n, k in PANEL_SHAPES]
    packs = {}
    for name, lib in libs.items():
        ps = []
        for w, n, k in ws:
            p = torch.empty(-(-n // native.PANEL_NB) * native.PANEL_NB * k)
            lib.hf_pack_panels(w.data_ptr(), p.data_ptr(), n, k, 0, threads)
            ps.append(p)
        packs[name] = ps
    cases = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=g) for k in {k for _, _, k in ws}}
        outs = {name: [torch.empty(rows, n) for _, n, _ in ws] for name in libs}

        def call(name: str, xs=xs, outs=outs, rows=rows) -> None:
            lib = libs[name]
            for (_, n, k), p, y in zip(ws, packs[name], outs[name], strict=True):
                lib.hf_gemm_panel(xs[k].data_ptr(), p.data_ptr(), None, y.data_ptr(), rows, n, k, threads, 0,
                                  None, None)

        cases.append({"case": f"panel GEMM, {rows} rows", "call": call, "outs": outs})
    return cases


def gemv_cases(libs: dict[str, ctypes.CDLL], threads: int) -> list[dict]:
    cases = []
    g = torch.Generator().manual_seed(2)
    for layout, n, k in GEMV_SHAPES:
        pool = [torch.randn(*((n, k) if layout == "nk" else (k, n)), generator=g) for _ in range(pool_count(n * k * 4))]
        x = torch.randn(k, generator=g)
        outs = {name: [torch.empty(n)] for name in libs}
        part = {name: torch.empty(native.split_k_slots(), n) for name in libs}

        def call(name: str, layout=layout, n=n, k=k, pool=pool, x=x, outs=outs, part=part) -> None:
            lib, y = libs[name], outs[name][0]
            for w in pool:
                if layout == "nk":
                    lib.hf_gemv_nk(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), n, k, threads)
                else:
                    lib.hf_gemv_kn(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), n, k, threads,
                                   part[name].data_ptr(), part[name].shape[0])

        cases.append({"case": f"one-row {layout} [{n}, {k}]" if layout == "nk" else f"one-row split-K [{k}, {n}]",
                      "call": call, "outs": outs})
    return cases


def w8_cases(libs: dict[str, ctypes.CDLL], rows_list: list[int], threads: int) -> list[dict]:
    """One case per row count (one row: ``hf_gemv_q8a``, more: ``hf_gemm_q8a``) over a pool of int8 weights."""
    g = torch.Generator().manual_seed(5)
    layer = sum(n * k for n, k in PANEL_SHAPES)
    ws = [(*quantize_int8(torch.randn(n, k, generator=g) * 0.02), n, k) for _ in range(pool_count(layer))
          for n, k in PANEL_SHAPES]
    cases = []
    for rows in sorted({1, *rows_list}):
        xs = {k: torch.randn(rows, k, generator=g) for k in {k for *_, k in ws}}
        outs = {name: [torch.empty(rows, n) for *_, n, _ in ws] for name in libs}

        def call(name: str, xs=xs, outs=outs, rows=rows) -> None:
            lib = libs[name]
            for (q, s, n, k), y in zip(ws, outs[name], strict=True):
                if rows == 1:
                    rc = lib.hf_gemv_q8a(q.data_ptr(), s.data_ptr(), xs[k].data_ptr(), None, y.data_ptr(), n, k, 0,
                                         threads)
                else:
                    rc = lib.hf_gemm_q8a(q.data_ptr(), s.data_ptr(), xs[k].data_ptr(), None, y.data_ptr(), rows, n,
                                         k, 0, threads)
                if rc:
                    raise SystemExit(f"error: the w8 product returned {rc} in the {name} build")

        what = "one-row w8 GEMV (hf_gemv_q8a)" if rows == 1 else f"w8 GEMM (hf_gemm_q8a), {rows} rows"
        cases.append({"case": what, "call": call, "outs": outs})
    return cases


def _qkv_views(qkv: torch.Tensor, h: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as a program hands them over: transposed views ``[1, heads, rows, d]`` of one fused projection."""
    rows = qkv.shape[1]
    q = qkv[..., : h * d].view(1, rows, h, d).transpose(1, 2)
    k = qkv[..., h * d: (h + hkv) * d].view(1, rows, hkv, d).transpose(1, 2)
    return q, k, qkv[..., (h + hkv) * d:].view(1, rows, hkv, d).transpose(1, 2)


def attention_cases(libs: dict[str, ctypes.CDLL], threads: int) -> list[dict]:
    """Causal attention on each calibration layout and row count, once with ``is_causal`` and once with the causal
    pattern as a bool mask (as GPT-2's graphs pass it)."""
    cases = []
    g = torch.Generator().manual_seed(3)
    for h, hkv, d in ATTENTION:
        for rows in ATTENTION_ROWS:
            for masked in (False, True):
                q, k, v = _qkv_views(torch.randn(1, rows, (h + 2 * hkv) * d, generator=g), h, hkv, d)
                mask = torch.ones(rows, rows, dtype=torch.bool).tril().view(1, 1, rows, rows) if masked else None
                q, k, v, mask, dims, strides, kind = native._prefill_attention_args(q, k, v, mask, not masked)
                outs = {name: [torch.empty(1, h, rows, d)] for name in libs}

                def call(name: str, q=q, k=k, v=v, mask=mask, dims=dims, strides=strides, kind=kind, outs=outs,
                         d=d) -> None:
                    rc = libs[name].hf_prefill_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                         None if mask is None else mask.data_ptr(),
                                                         outs[name][0].data_ptr(), dims, strides, kind,
                                                         int(mask is None), d ** -0.5, threads, 0)
                    if rc:
                        raise SystemExit(f"error: hf_prefill_attention returned {rc} in the {name} build")

                how = "bool causal mask" if masked else "is_causal"
                cases.append({"case": f"prefill attention {h}/{hkv}x{d}, {rows} rows, {how}", "call": call,
                              "outs": outs})
            cases.append(_bf16_attention_case(libs, threads, g, h, hkv, d, rows))
    return cases


def _bf16_attention_case(libs: dict[str, ctypes.CDLL], threads: int, g: torch.Generator, h: int, hkv: int, d: int,
                         rows: int) -> dict:
    """The same layout in bf16, ``is_causal``, its bf16-product path allowed (AMX tiles or AVX512-BF16 dot products
    where the CPU has them, else the widened FMAs: the case name says which)."""
    q, k, v = _qkv_views(torch.randn(1, rows, (h + 2 * hkv) * d, generator=g).to(torch.bfloat16), h, hkv, d)
    q, k, v, _, dims, strides, kind = native._prefill_attention_args(q, k, v, None, True)
    outs = {name: [torch.empty(1, h, rows, d, dtype=torch.bfloat16)] for name in libs}

    def call(name: str) -> None:
        rc = libs[name].hf_prefill_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), None, outs[name][0].data_ptr(),
                                             dims, strides, kind, 1, d ** -0.5, threads, 2)
        if rc:
            raise SystemExit(f"error: hf_prefill_attention (bf16) returned {rc} in the {name} build")

    path = native.prefill_attention_bf16_products()
    return {"case": f"prefill attention bf16 ({path}) {h}/{hkv}x{d}, {rows} rows, is_causal", "call": call,
            "outs": outs}


def decode_cases(libs: dict[str, ctypes.CDLL], threads: int) -> list[dict]:
    """One new row's attention per layout, cache length and dtype, over a pool of caches read from memory."""
    cases = []
    g = torch.Generator().manual_seed(4)
    for dtype, fn in ((torch.float32, "hf_decode_attention"), (torch.bfloat16, "hf_decode_attention_bf16")):
        for h, hkv, d in ATTENTION:
            for s in DECODE_CACHES:
                size = 2 * hkv * s * d * dtype.itemsize
                pool = [(torch.randn(1, hkv, s, d, generator=g).to(dtype), torch.randn(1, hkv, s, d, generator=g)
                         .to(dtype)) for _ in range(pool_count(size))]
                q = torch.randn(1, h, 1, d, generator=g).to(dtype)
                k, v = (torch.randn(1, hkv, 1, d, generator=g).to(dtype) for _ in range(2))
                mask = torch.zeros(s, dtype=dtype)
                mask[3 * s // 4:] = float("-inf")
                scratch = torch.empty(h, s + 1 + (2 * d if dtype == torch.bfloat16 else 0))
                outs = {name: [torch.empty(1, h, 1, d, dtype=dtype)] for name in libs}

                def call(name: str, fn=fn, pool=pool, q=q, k=k, v=v, mask=mask, scratch=scratch, outs=outs, h=h,
                         hkv=hkv, s=s, d=d) -> None:
                    f, out = getattr(libs[name], fn), outs[name][0]
                    for kc, vc in pool:
                        f(q.data_ptr(), k.data_ptr(), v.data_ptr(), kc.data_ptr(), vc.data_ptr(), mask.data_ptr(),
                          None, out.data_ptr(), scratch.data_ptr(), h, hkv, s, d, d ** -0.5, threads)

                kind = "fp32" if dtype == torch.float32 else "bf16"
                cases.append({"case": f"decode attention {kind} {h}/{hkv}x{d}, cache {s}", "call": call,
                              "outs": outs})
    return cases


def run_case(case: dict, names: list[str], rounds: int) -> dict:
    call: Callable[[str], None] = case["call"]
    for name in names:  # warm-up: first touch of outputs and packed copies
        call(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            call(name)
            times[name].append(time.perf_counter() - t0)
    base, new = names
    ratio = statistics.median(t / b for t, b in zip(times[new], times[base], strict=True))
    same = all(torch.equal(a, b) for a, b in zip(case["outs"][base], case["outs"][new], strict=True))
    return {"case": case["case"], "median_s": {n: statistics.median(t) for n, t in times.items()},
            "ratio": ratio, "same_bits": same}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="HEAD", help="the git revision whose native.c is the base (default HEAD)")
    ap.add_argument("--rows", default="16,128", help="row counts of the panel and w8 GEMM cases")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-ratio", type=float, default=None,
                    help="exit 1 when a case's median ratio working tree ÷ base is above this")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--groups", default=",".join(GROUPS),
                    help=f"which kernels to time, comma-separated from {', '.join(GROUPS)} (default: all)")
    args = ap.parse_args(argv)
    rows = int_list(ap, args.rows, "--rows")
    if args.rounds < 1 or args.threads < 1 or any(r < 1 for r in rows):
        ap.error("--rounds, --threads and every --rows value must be at least 1")
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    if not groups or any(g not in GROUPS for g in groups):
        ap.error(f"--groups {args.groups!r}: allowed a comma-separated list of {', '.join(GROUPS)}")
    if args.json is not None:  # refused before minutes of building and timing, not after
        try:
            check_output(args.json, "--json", (".json",))
        except UsageError as e:
            ap.error(str(e))
    base = base_source(args.base)
    if base is None:
        ap.error(f"--base {args.base!r}: git has no native.c at that revision (a commit, branch or tag is allowed)")
    if _panel_width(base) != _panel_width(native.SOURCE.read_text()):
        raise SystemExit("error: the base's panel width (HF_PNB) differs from the working tree's: the two builds "
                         "pack weights differently, and this script packs one layout's size for both")
    if not native.panel_available():
        raise SystemExit("error: the native library has no vector path here (AVX-512, or AVX2 with FMA): its "
                         "kernels are not the ones this compares")
    torch.set_num_threads(args.threads)
    names = [f"base ({args.base})", "working tree"]
    with tempfile.TemporaryDirectory(prefix="hf-kernel-ab-") as td:
        libs = {names[0]: build(base, Path(td), "base"),
                names[1]: build(native.SOURCE.read_text(), Path(td), "tree")}
        results = []
        make = {"panel": lambda: panel_cases(libs, rows, args.threads), "gemv": lambda: gemv_cases(libs, args.threads),
                "w8": lambda: w8_cases(libs, rows, args.threads),
                "attention": lambda: attention_cases(libs, args.threads),
                "decode": lambda: decode_cases(libs, args.threads)}
        for group in groups:
            for case in make[group]():
                got = run_case(case, names, args.rounds)
                results.append(got)
                print(f"{got['case']:<40} working tree ÷ base {got['ratio']:.3f}"
                      f"{'' if got['same_bits'] else '  DIFFERENT BITS'}", flush=True)
    doc = {"meta": run_meta("bench/kernel_ab.py", argv), "base": args.base, "rounds": args.rounds,
           "results": results}
    if args.json:
        write_json(args.json, doc, "--json", indent=1)  # atomically: no half-written file
    over = [r["case"] for r in results if args.max_ratio is not None and r["ratio"] > args.max_ratio]
    if over:
        print(f"slower than --max-ratio {args.max_ratio}: {'; '.join(over)}", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
