"""bench/_perf.py's sorting of perf samples and prefill_gemm's page sections built from it and from its per-op profile
(no perf run here)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import _ops  # noqa: E402
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


def _ops_row(doc: dict) -> dict:
    """The first row with a constructed per-op record: bound 100 ms, a 130 ms profiled call of 100 GFLOP of GEMM
    ops in 110 ms, 12 ms of attention, 6 ms of other ops (2 ms between instructions)."""
    row = doc["rows"][0]
    row["bound_ms"]["fp32"] = 100.0
    row["ops"] = {"total_ms": 130.0, "calls": 3, "ops": [
        {"op": "hetforge.gated_mlp.default", "calls": 12, "ms": 60.0, "gflop": 50.0},
        {"op": "aten.linear.default", "calls": 49, "ms": 50.0, "gflop": 50.0},
        {"op": "hetforge.attention.default", "calls": 12, "ms": 12.0, "gflop": 0.0},
        {"op": "hetforge.rms_norm.default", "calls": 25, "ms": 6.0, "gflop": 0.0}]}
    return row


def test_op_split_adds_gemm_ops_attention_and_the_rest_up_to_the_profiled_call():
    doc = copy.deepcopy(_doc())
    sp = _ops.op_split(_ops_row(doc), 1000.0)
    assert sp["gemm_ms"] == pytest.approx(110.0)
    assert sp["gemm_gflops"] == pytest.approx(100.0 / 0.110)  # 909 GFLOP/s
    assert sp["gemm_of_peak"] == pytest.approx(100.0 / 0.110 / 1000.0)
    assert sp["attention_ms"] == pytest.approx(12.0)
    assert sp["rest_ms"] == pytest.approx(8.0)  # 6 ms of norms and 2 ms between instructions
    parts = sp["gemm_over_bound"] + sp["attention_over_bound"] + sp["rest_over_bound"]
    assert parts == pytest.approx(sp["total_over_bound"]) and sp["total_over_bound"] == pytest.approx(1.3)


def _hot(row: dict) -> dict:
    """The constructed record's GEMM ops hot: gated 60 ms in the program (again 62) and 50 hot; linear 50 (again 48)
    and 40 hot."""
    for a in row["ops"]["ops"]:
        if a["op"] == "hetforge.gated_mlp.default":
            a["again_ms"], a["hot_ms"] = 62.0, 50.0
        elif a["op"] == "aten.linear.default":
            a["again_ms"], a["hot_ms"] = 48.0, 40.0
    row["ops"]["hot_calls"], row["ops"]["hot_again"] = 2, 3
    return row


def test_op_split_splits_the_gemm_ops_into_their_hot_time_and_the_programs_share():
    doc = copy.deepcopy(_doc())
    sp = _ops.op_split(_hot(_ops_row(doc)), 1000.0)
    assert sp["hot_ms"] == pytest.approx(90.0)
    assert sp["hot_over_bound"] == pytest.approx(0.9)
    assert sp["hot_of_peak"] == pytest.approx(100.0 / 0.090 / 1000.0)  # 100 GFLOP hot in 90 ms
    assert sp["program_over_hot"] == pytest.approx(110.0 / 90.0)  # their own runs in those calls: 62 + 48
    assert "hot_ms" not in _ops.op_split(_ops_row(copy.deepcopy(_doc())), 1000.0)  # a record without them


def test_prefill_gemm_page_shows_the_gemm_ops_hot_next_to_their_time_in_the_program():
    doc = copy.deepcopy(_doc())
    for r in doc["rows"][1:]:
        r.pop("ops", None)  # the constructed row alone (the hot columns show where every row has them)
    row = _hot(_ops_row(doc))
    peak = doc["peak"]["fp32"]["gflops"]
    lines = prefill_gemm.render(doc).splitlines()
    split = next(ln for ln in lines if ln.startswith(f"| {row['model']} | {row['seq']} | 130.0 |"))
    assert split.endswith(f"| 1.300 | 0.900 | {100.0 / 0.090 / peak:.1%} | 1.222 |")
    gated = next(ln for ln in lines if "`hetforge.gated_mlp.default`" in ln and ln.startswith(f"| {row['model']} "))
    assert gated.endswith(f"| 50.00 | {1000.0 / peak:.1%} | 1.240 |")  # 50 GFLOP hot in 50 ms; 62 / 50
    assert any("3 more times right after its own run" in ln for ln in lines)


def test_op_split_is_none_without_a_record_or_a_bound():
    doc = copy.deepcopy(_doc())
    row = doc["rows"][0]
    row.pop("ops", None)
    assert _ops.op_split(row, 1000.0) is None
    row = _ops_row(doc)
    row.pop("bound_ms")
    assert _ops.op_split(row, 1000.0) is None


def test_prefill_gemm_page_shows_each_gemm_op_kind_at_its_rate_inside_the_program():
    doc = copy.deepcopy(_doc())
    row = _ops_row(doc)
    peak = doc["peak"]["fp32"]["gflops"]
    lines = prefill_gemm.render(doc).splitlines()
    split = next(ln for ln in lines if ln.startswith(f"| {row['model']} | {row['seq']} | 130.0 |"))
    assert split.endswith("| 1.100 | 0.120 | 0.080 | 1.300 |")
    gated = next(ln for ln in lines if "`hetforge.gated_mlp.default`" in ln and ln.startswith(f"| {row['model']} "))
    assert f"| 60.00 | 50.00 | 833 | {833.33 / peak:.1%} |" in gated  # 50 GFLOP in 60 ms
    assert not any("`hetforge.rms_norm.default`" in ln for ln in lines)  # not a GEMM op: not in the by-kind table


def test_op_profile_sums_a_real_program_by_op_with_the_bounds_gemm_flops(tmp_path):
    from hetforge.compile import compile_graph
    from hetforge.frontend import capture
    from hetforge.ir.kernel_choice import ONEDNN_OPS
    from hetforge.models.zoo import example_inputs, load_model

    loaded = load_model("llama-tiny")
    module = loaded.logits_module()
    inputs = example_inputs(loaded, seq=16)
    exe = compile_graph(capture(module, inputs, name="llama-tiny").gm, soc="host", example_inputs=inputs,
                        name="llama-tiny").executable
    rec = prefill_gemm.op_profile(exe, inputs, calls=2)
    assert sum(a["calls"] for a in rec["ops"]) == len(exe.program.instrs)
    gemm = sum(a["gflop"] for a in rec["ops"] if a["op"] in ONEDNN_OPS)
    assert gemm == pytest.approx(prefill_gemm.gemm_flops(exe.program) / 1e9, abs=1e-5)  # rounded to 1 kFLOP per op
    assert gemm > 0 and any(a["op"] == _ops.ATTENTION_OP for a in rec["ops"])
    assert 0 < sum(a["ms"] for a in rec["ops"]) <= rec["total_ms"] + 1e-2
    hot = [a for a in rec["ops"] if "hot_ms" in a]  # every GEMM op timed hot, nothing else
    assert {a["op"] for a in hot} == {a["op"] for a in rec["ops"] if a["op"] in ONEDNN_OPS}
    assert all(a["hot_ms"] > 0 and a["again_ms"] > 0 for a in hot)


def test_summary_why_we_lose_quotes_the_gemm_ops_rate_and_attention_from_the_per_op_record():
    import summary

    doc = copy.deepcopy(_doc())
    for r in doc["rows"][1:]:
        r.pop("ops", None)  # the constructed row alone
    _ops_row(doc)
    text = summary.why_we_lose(summary.load("peers.json"), summary.load("kforge.json"),
                               summary.J("prefill_gemm.json", doc))
    rate = f"{100 * (100.0 / 0.110) / doc['peak']['fp32']['gflops']:.1f}%"  # 100 GFLOP in 110 ms
    assert f"the GEMM ops ran at {rate} of the peak inside the\n  program" in text
    assert "1.10× of the bound by themselves" in text and "took 0.12× of the bound" in text
    assert "Each product run again" not in text  # a record without the hot times


def test_summary_why_we_lose_splits_the_gemm_ops_into_the_kernels_hot_and_the_programs_share():
    import summary

    doc = copy.deepcopy(_doc())
    for r in doc["rows"][1:]:
        r.pop("ops", None)
    _hot(_ops_row(doc))
    text = summary.why_we_lose(summary.load("peers.json"), summary.load("kforge.json"),
                               summary.J("prefill_gemm.json", doc))
    assert "took\n  0.90× of the bound all together" in text  # 90 ms hot against a 100 ms bound
    assert "the same calls took 1.22× of their hot time" in text  # (62 + 48) / 90


def test_the_bound_takes_the_best_peak_of_the_whole_run_for_every_row(monkeypatch):
    """reprobe_peak keeps each measurement and raises the peak to the best; apply_bound sets bound and ratio from the
    peak as it stands (the bench applies it to every row again at the end). The measurement is replaced here by
    fixed figures: what is tested is the bookkeeping."""
    from hetforge.hardware import calibrate

    got = iter([520e9, 510e9])
    monkeypatch.setattr(calibrate, "_gemm", lambda dtype, n, budget: next(got))
    peaks = {"fp32": {"gflops": 500.0, "by_n": {512: 480.0, 1024: 500.0, 2048: 490.0}}}
    row = {"gemm_gflop": 52.0, "best_ms": {"hetforge-auto": 115.0}}
    prefill_gemm.apply_bound(row, peaks)
    assert row["bound_ms"] == {"fp32": 104.0} and row["over_bound_best"] == {"fp32": pytest.approx(1.106, abs=1e-3)}
    prefill_gemm.reprobe_peak(peaks)
    prefill_gemm.reprobe_peak(peaks)
    assert peaks["fp32"]["reprobes"] == [520.0, 510.0] and peaks["fp32"]["gflops"] == 520.0
    prefill_gemm.apply_bound(row, peaks)
    assert row["bound_ms"] == {"fp32": 100.0} and row["over_bound_best"] == {"fp32": 1.15}
    doc = copy.deepcopy(_doc())
    doc["peak"]["fp32"] = peaks["fp32"]
    assert "fp32 520.0 GFLOP/s (by n: 512: 480.0, 1024: 500.0, 2048: 490.0; n = 1024 again after each model and " \
           "length: 520, 510)" in prefill_gemm.render(doc)


def test_the_page_divides_by_the_peak_measured_next_to_a_shape_in_its_own_column():
    doc = copy.deepcopy(_doc())
    for r in doc["rows"][1:]:
        r.pop("local_peak_fp32", None)
    row = doc["rows"][0]
    row["gemm_gflop"], row["local_peak_fp32"] = 50.0, 500.0  # local bound 100 ms
    row["best_ms"]["hetforge-auto"] = 112.0
    lines = prefill_gemm.render(doc).splitlines()
    head = next(ln for ln in lines if ln.startswith("| model | seq | threads |"))
    assert "| choice ÷ bound | choice ÷ bound at the peak measured next to it | KL ATen |" in head
    line = next(ln for ln in lines if ln.startswith(f"| {row['model']} | {row['seq']} | {row['threads']} |"))
    assert f"| {row['over_bound_best']['fp32']} | 1.120 |" in line
    other = next(ln for ln in lines if ln.startswith(f"| {doc['rows'][1]['model']} | {doc['rows'][1]['seq']} |"))
    assert other.count("|") == line.count("|") and "| — |" in other  # a row without the measurement: a dash


def test_the_sampled_categories_come_in_the_same_order_whatever_the_hash_seed(tmp_path):
    """Categories with equal largest shares are ordered by name: the page must render the same bytes in any process
    (a set's order of strings moves with PYTHONHASHSEED, and the page test regenerates it in another process)."""
    import os
    import subprocess

    doc = copy.deepcopy(_doc())
    tied = ("Python", "OS kernel", "ATen / torch dispatch", "other native code", "attention (native)")
    for r in doc["rows"]:
        r["perf"] = {"shares": {"GEMM: oneDNN JIT code": 0.9, **dict.fromkeys(tied, 0.02)}, "samples": 100,
                     "calls": 3, "ms_per_call": 70.0, "seconds": 4.0, "freq": 999}
    src = tmp_path / "pg.json"
    src.write_text(json.dumps(doc))
    code = ("import json, sys; sys.path.insert(0, 'bench'); import prefill_gemm; "
            f"print(prefill_gemm._render_perf(json.loads(open({str(src)!r}).read()))[5])")
    heads = {subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in range(6)}
    assert len(heads) == 1
    assert "| ATen / torch dispatch | OS kernel | Python | attention (native) | other native code |" in heads.pop()
