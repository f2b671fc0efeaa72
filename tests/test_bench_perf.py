"""bench/_perf.py's sorting of perf samples and prefill_gemm's page section built from it (no perf run here)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import _perf  # noqa: E402
import prefill_gemm  # noqa: E402

NATIVE = "/root/.cache/hetforge/kernels/hetforge_native_0123.so"  # the native library as perf names its file


@pytest.mark.parametrize("sym, dso, want", [
    ("[unknown]", "/tmp/perf-4242.map", "GEMM: oneDNN JIT code"),
    ("panel_chunk_gated", NATIVE, "GEMM: native kernels"),
    ("panel_pack_group", NATIVE, "GEMM: packing X (native)"),
    ("pa_task", NATIVE, "attention (native)"),
    ("hf_rms_norm._omp_fn.0", NATIVE, "norms, rotary, elementwise (native)"),
    ("hf_run_team._omp_fn.1", NATIVE, "other native code"),
    ("[unknown]", "/x/torch/lib/libgomp.so.1", "OpenMP runtime (waits, fork/join)"),
    ("_PyEval_EvalFrameDefault", "/usr/lib/libpython3.11.so.1.0", "Python"),
    ("PyCFuncPtr_call", "/usr/lib/python3.11/lib-dynload/_ctypes.cpython-311-x86_64-linux-gnu.so", "Python"),
    ("dnnl::impl::cpu::x64::matmul::brgemm_matmul_t<(dnnl::impl::cpu::x64::cpu_isa_t)", "/x/libtorch_cpu.so",
     "oneDNN driver code, primitive setup"),
    ("c10::impl::OperatorEntry::lookup", "/x/libc10.so", "ATen / torch dispatch"),
    ("asm_exc_page_fault", "[kernel.kallsyms]", "OS kernel"),
    ("__memmove_avx512_unaligned_erms", "/usr/lib/x86_64-linux-gnu/libc.so.6", "other (libc, allocator, …)"),
])
def test_perf_samples_are_sorted_by_symbol_and_file(sym, dso, want):
    assert _perf.category(sym, dso) == want


def test_gemm_share_counts_jit_and_native_products_but_not_packing():
    rec = {"shares": {"GEMM: oneDNN JIT code": 0.5, "GEMM: native kernels": 0.3, "GEMM: packing X (native)": 0.1,
                      "attention (native)": 0.1}}
    assert _perf.gemm_share(rec) == pytest.approx(0.8)


def _doc() -> dict:
    return json.loads((ROOT / "docs" / "bench" / "prefill_gemm.json").read_text())


def test_prefill_gemm_page_derives_the_gemm_rate_and_the_ratio_at_the_peak_from_the_shares():
    doc = _doc()
    row = doc["rows"][0]
    row["perf"] = {"shares": {"GEMM: native kernels": 0.8, "attention (native)": 0.2}, "samples": 100, "calls": 3,
                   "ms_per_call": 70.0, "seconds": 4.0, "freq": 999}
    row["over_bound_best"]["fp32"] = 1.25
    line = next(ln for ln in prefill_gemm.render(doc).splitlines()
                if ln.startswith(f"| {row['model']} | {row['seq']} | 70.0 |"))
    # g = 0.8, r = 1.25: the GEMM code ran at 1 / (0.8 * 1.25) = 100% of the peak; with every GEMM at the peak the
    # prefill would be at 1 + 0.2 * 1.25 = 1.25 of the bound
    assert line.endswith("| 80.0% | 100.0% | 1.250 |")


def test_prefill_gemm_page_says_why_a_run_was_not_sampled():
    doc = copy.deepcopy(_doc())
    for r in doc["rows"]:
        r["perf"] = {"error": "perf is not installed (Debian: apt-get install linux-perf)"}
    page = prefill_gemm.render(doc)
    assert "Not sampled: perf is not installed (Debian: apt-get install linux-perf)." in page
    assert "GEMM code's rate" not in page


def test_a_peak_above_the_fma_probes_is_called_a_moved_host_not_a_share_over_100_percent():
    doc = copy.deepcopy(_doc())
    doc["fma"] = {"gflops": doc["peak"]["fp32"]["gflops"] - 10, "probes": [1.0], "threads": 2}
    page = prefill_gemm.render(doc)
    assert "the host's speed moved between the measurements" in page
    assert "of what the FMA units can do" not in page
