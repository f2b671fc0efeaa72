"""Call lists (``hf_run_calls``, :class:`native.CallList`, :mod:`hetforge.executor.calllist`) and ``hf_ewise``:
kernels run from one list give the bits of calling them one by one; a failing kernel raises its own error and stops
the list; the C table agrees with the Python signatures; the code pass merges runs of literal native calls and keeps
everything else where it was."""

from __future__ import annotations

import ast
import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetforge.executor.calllist import batch_native_calls
from hetforge.kernels import native

BF = torch.bfloat16


def _lib():
    lib = native.library()
    assert lib is not None, f"the native kernels did not build here: {native.status().reason}"
    return lib


def test_the_c_call_table_lists_every_kernel_with_the_argument_kinds_of_its_python_signature():
    lib = _lib()
    table = native.call_table(lib)
    names = [lib.hf_call_name(i).decode() for i in range(lib.hf_call_count())]
    assert sorted(table) == sorted(names)  # none left out for disagreeing kinds
    assert {"hf_gemv_nk", "hf_gemv_q8a", "hf_rms_norm", "hf_decode_attention", "hf_ewise", "hf_copy"} <= set(table)
    assert lib.hf_call_name(len(names)) is None and lib.hf_call_sig(-1) is None


def test_a_call_list_gives_the_bits_of_calling_its_kernels_one_by_one():
    lib = _lib()
    g = torch.Generator().manual_seed(3)
    d, n = 96, 160
    x, wn = torch.randn(d, generator=g), torch.rand(d, generator=g) + 0.5
    w, b = torch.randn(n, d, generator=g) / d**0.5, torch.randn(n, generator=g)
    res = torch.randn(n, generator=g)
    mine = [torch.empty(d), torch.empty(n), torch.empty(n), torch.empty(n)]
    ref = [torch.empty(d), torch.empty(n), torch.empty(n), torch.empty(n)]

    def calls(o):
        return [("hf_rms_norm", [x.data_ptr(), wn.data_ptr(), o[0].data_ptr(), 1, d, 1e-5, native.NT], None),
                ("hf_gemv_nk", [w.data_ptr(), o[0].data_ptr(), b.data_ptr(), o[1].data_ptr(), n, d, native.NT], None),
                ("hf_ewise", [o[1].data_ptr(), res.data_ptr(), o[2].data_ptr(), n, 0, 0], None),
                ("hf_copy", [o[3].data_ptr(), o[2].data_ptr(), n * 4], None)]

    native.CallList(calls(mine)).run(2)
    for name, args, _ in calls(ref):
        getattr(lib, name)(*(2 if a is native.NT else a for a in args))
    for a, r in zip(mine, ref, strict=True):
        assert torch.equal(a, r)
    assert torch.equal(mine[3], torch.add(mine[1], res))


def test_a_failing_kernel_raises_its_own_error_and_no_later_call_of_the_list_runs():
    _lib()
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(8, 16, generator=g), torch.randn(64, 16, generator=g)
    y, dst = torch.empty(64, 8), torch.zeros(8)
    src = torch.ones(8)
    calls = [("hf_copy", [dst.data_ptr(), src.data_ptr(), 4], None),  # runs: the first value only
             ("hf_gemm_few", [w.data_ptr(), x.data_ptr(), None, y.data_ptr(), 64, 8, 16, 0, native.NT],
              native.check_few_rc),  # 64 rows: refused (-2)
             ("hf_copy", [dst.data_ptr(), src.data_ptr(), 32], None)]
    with pytest.raises(ValueError, match="hf_gemm_few: row count outside 1..32"):
        native.CallList(calls).run(2)
    assert dst.tolist() == [1.0] + [0.0] * 7


def test_a_call_list_refuses_an_unknown_kernel_and_a_wrong_argument_count():
    _lib()
    with pytest.raises(ValueError, match="not a kernel hf_run_calls runs"):
        native.CallList([("hf_pool_config", [0, 0], None)])
    with pytest.raises(ValueError, match="takes 3 arguments, got 2"):
        native.CallList([("hf_copy", [0, 0], None)])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), op=st.sampled_from([0, 1]), bf16=st.booleans(), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-3, 1.0, 3e4]))
def test_ewise_is_atens_add_or_mul_bit_for_bit(n, op, bf16, seed, scale):
    lib = _lib()
    g = torch.Generator().manual_seed(seed)
    dt = BF if bf16 else torch.float32
    a, b = (torch.randn(n, generator=g) * scale).to(dt), (torch.randn(n, generator=g) * scale).to(dt)
    y = torch.empty(n, dtype=dt)
    assert lib.hf_ewise(a.data_ptr(), b.data_ptr(), y.data_ptr(), n, op, int(bf16)) == 0
    assert torch.equal(y, torch.add(a, b) if op == 0 else torch.mul(a, b))
    assert lib.hf_ewise(a.data_ptr(), b.data_ptr(), y.data_ptr(), n, 7, int(bf16)) == -2


def _globals(lib):
    return {"_nk1": lib.hf_copy, "_nk2": lib.hf_ewise, "_f3": torch.get_num_threads, "_f4": torch.add,
            "_b5": torch.zeros(4), "_b6": torch.zeros(4)}


def test_the_code_pass_makes_each_run_of_literal_native_calls_one_list_and_keeps_bindings_and_barriers():
    """Before: two calls and bindings, an ATen call, one lone call, then a call reading a register's pointer.
    Expected: the first run as one list with its bindings after it; the ATen line, the lone call and the per-call
    pointer read as they were."""
    lib = _lib()
    g = _globals(lib)
    p5, p6 = g["_b5"].data_ptr(), g["_b6"].data_ptr()
    before = [f"_nk1({p5}, {p6}, 16); r5 = _b5",
              "r7 = r5 = None",
              f"_nk2({p5}, {p6}, {p6}, 4, 0, 0); r6 = _b6",
              "r8, r9 = _b5, _b6",
              "r10 = _f4(r6, r6)",
              f"_nk1({p5}, {p6}, 16)",
              "r11 = _b5",
              f"_nk1(r10.data_ptr(), {p6}, 16)"]
    after, lists, calls = batch_native_calls(before, g)
    assert (lists, calls) == (1, 2)
    head = ast.parse(after[0]).body
    assert ast.unparse(head[0]) == "_cl6.run(_f3())" and isinstance(g["_cl6"], native.CallList)
    assert [ast.unparse(s) for s in head[1:]] == ["r5 = _b5", "r7 = r5 = None", "r6 = _b6", "r8, r9 = (_b5, _b6)"]
    assert after[1:] == ["r10 = _f4(r6, r6)", f"_nk1({p5}, {p6}, 16); r11 = _b5", f"_nk1(r10.data_ptr(), {p6}, 16)"]
    assert [n for n, _, _ in g["_cl6"].calls] == ["hf_copy", "hf_ewise"]


def test_the_code_pass_leaves_code_without_the_thread_count_function_or_a_run_as_it_was():
    lib = _lib()
    g = _globals(lib)
    lines = [f"_nk1({g['_b5'].data_ptr()}, {g['_b6'].data_ptr()}, 16)", "r1 = _f4(r2, r2)"]
    assert batch_native_calls(lines, g) == (lines, 0, 0)
    del g["_f3"]
    assert batch_native_calls(lines * 2, g) == (lines * 2, 0, 0)


def test_opening_a_build_for_some_kernels_requires_only_those_and_binds_the_ones_present():
    """bench/kernel_ab.py loads another revision's build, which may lack later kernels (this change's call list)."""
    from pathlib import Path

    _lib()
    path = Path(native.status().path)
    lib, why = native._open(path, need=("hf_gemv_nk", "hf_no_such_kernel"))
    assert lib is None and "hf_no_such_kernel" in why
    lib, why = native._open(path, need=("hf_gemv_nk",))
    assert lib is not None and why == ""
    assert lib.hf_gemv_nk.argtypes == native.SIGNATURES["hf_gemv_nk"]
    assert lib.hf_run_calls.restype is ctypes.c_int64  # present, so bound too
