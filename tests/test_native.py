"""The native C kernels (kernels/native.py): a real build with the host's compiler, results equal to ATen's,
clear reasons when they cannot be used, and the executor's use of them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hetforge.kernels import native

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="no C compiler on this host: the native kernels cannot be built")

# without the library there is no native kernel to test; decode then runs ATen's ops, which the runtime tests cover
NEEDS_NATIVE = pytest.mark.skipif(native.library() is None, reason="the native C kernels are not built on this host "
                                  "(no C compiler or OpenMP), so decode runs ATen's ops instead")


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """An empty loader state and a private cache folder (the module keeps one loaded library per process)."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("HETFORGE_CACHE", str(tmp_path))
    return tmp_path


@needs_cc
def test_builds_with_the_host_compiler_into_the_cache(fresh_state):
    st_ = native.status()
    assert st_.available, st_.reason
    assert st_.path.startswith(str(fresh_state)) and st_.path.endswith(".so")
    mtime = (fresh_state / "kernels").stat().st_mtime_ns
    native._state.clear()
    again = native.status()  # a second load reuses the built file
    assert again.path == st_.path and (fresh_state / "kernels").stat().st_mtime_ns == mtime


def test_disabled_by_environment(fresh_state, monkeypatch):
    monkeypatch.setenv("HETFORGE_NATIVE", "0")
    assert native.library() is None
    assert native.status().reason == "disabled by HETFORGE_NATIVE=0"
    assert not native.fits(torch.randn(4, 4))


def test_a_failing_compiler_leaves_no_file_and_says_why(fresh_state, monkeypatch):
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
    assert native.library() is None
    assert native.status().reason.startswith("could not build the native kernels")
    assert not list((fresh_state / "kernels").glob("*.so"))


@needs_cc
@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 70), n=st.integers(1, 70), weight_t=st.booleans(), bias=st.booleans(),
       threads=st.integers(1, 4))
def test_gemv_equals_linear(k, n, weight_t, bias, threads):
    g = torch.Generator().manual_seed(k * 1000 + n)
    x = torch.randn(1, k, generator=g)
    w = torch.randn((k, n) if weight_t else (n, k), generator=g)
    b = torch.randn(n, generator=g) if bias else None
    assert native.fits(w, b, weight_t)
    ref = (x @ w if weight_t else F.linear(x, w)) + (b if bias else 0)
    out = torch.full((1, n), float("nan"))
    native.gemv(x, w, b, out, weight_t, threads=threads)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_cc
def test_split_k_scratch_with_fewer_slots_than_threads_and_a_wide_row():
    x, w = torch.randn(1, 64), torch.randn(64, 50257)  # gpt2's vocabulary as N
    out = torch.empty(1, 50257)
    native.gemv(x, w, None, out, True, threads=4, scratch=torch.empty(2, 50257))
    torch.testing.assert_close(out, x @ w, rtol=1e-4, atol=1e-4)


def test_fits_refuses_what_the_kernel_cannot_read():
    w = torch.randn(8, 4)
    assert not native.fits(w.t(), None)  # not contiguous
    assert not native.fits(w.double(), None, dtype=torch.float64)
    assert not native.fits(w, torch.randn(3))  # bias length != N
    assert not native.fits(w, None, dtype=torch.float16)


def test_a_strided_operand_is_read_through_a_contiguous_copy_not_misread():
    t, keep = torch.randn(4, 6), {}
    assert native.contiguous_ptr(t, keep, 1) == t.data_ptr() and not keep
    p = native.contiguous_ptr(t.t(), keep, 1)
    assert p == keep[1].data_ptr() and keep[1].is_contiguous() and torch.equal(keep[1], t.t())
    with pytest.raises(ValueError, match="float32 on the CPU"):
        native.contiguous_ptr(t.double(), keep, 2)


@needs_cc
@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("weight_t", [False, True])
def test_linear_act_kernel_matches_aten_including_nan(act, weight_t):
    from hetforge.ops.fused import apply_act

    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(1, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    x[0, 0] = float("nan") if act == "relu" else x[0, 0]  # one NaN input: every output is NaN, as in ATen
    wk = w.t().contiguous() if weight_t else w
    y, part = torch.empty(24), torch.empty(2, 24)
    native.library().hf_linear_act(wk.data_ptr(), x.data_ptr(), b.data_ptr(), y.data_ptr(), 24, 40, int(weight_t),
                                   native.ACT_CODES[act], 2, part.data_ptr(), 2)
    torch.testing.assert_close(y, apply_act(F.linear(x, w, b), act)[0], rtol=1e-5, atol=1e-5, equal_nan=True)
    if act == "relu":
        assert y.isnan().all()


@needs_cc
def test_rotary_with_a_cos_that_is_not_one_row_keeps_the_aten_path():
    from hetforge.ops import fused

    x, cos, sin = torch.randn(1, 1, 1, 4), torch.randn(4, 1), torch.randn(4, 1)  # broadcasts to [1, 1, 4, 4]
    assert not native.row_op_fits(x, cos, sin)
    assert fused.rotary.reference(x, cos, sin).shape == (1, 1, 4, 4)


@needs_cc
def test_read_stream_reads_everything():
    x = torch.arange(1003, dtype=torch.float32)  # not a multiple of 4 streams x threads
    for threads in (1, 2, 3):
        assert native.library().hf_read_stream(x.data_ptr(), x.numel(), threads) == pytest.approx(float(x.sum()))


def test_fma_peak_is_a_rate_where_the_build_has_fma_and_none_elsewhere():
    """``native.fma_peak``: GFLOP/s of register-only FMAs where the library was built for a CPU with AVX-512F or
    AVX2 + FMA, None without the library or without those instructions; two runs of the probe each give a rate."""
    from hetforge import cpuinfo

    lib = native.library()
    got = native.fma_peak(1, seconds=0.005, repeats=2)
    flags = set(cpuinfo.flag_text(cpuinfo.fields()).split())
    has_fma = "-march=native" in native.status().flags and ("avx512f" in flags or {"avx2", "fma"} <= flags)
    if lib is None or not has_fma:
        assert got is None
        return
    assert got is not None and 0 < got < float("inf")
    assert lib.hf_fma_peak(1, 10) > 0  # a short run times something too


def test_an_unwritable_cache_is_a_reason_not_a_crash(fresh_state, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("HETFORGE_CACHE", str(blocker))  # kernels/ would have to be made inside a file
    assert native.library() is None
    assert "cannot write the kernel cache" in native.status().reason


@needs_cc
def test_gemv_refuses_a_row_that_does_not_fit_the_weight():
    with pytest.raises(ValueError, match="do not fit"):
        native.gemv(torch.randn(1, 5), torch.randn(8, 4), None, torch.empty(1, 8), False)


@needs_cc
@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 70), n=st.integers(1, 70), bias=st.booleans(), threads=st.integers(1, 4),
       act=st.sampled_from(["none", "relu", "silu", "gelu", "gelu_tanh"]))
def test_int8_gemv_equals_weight_int8pack_mm(k, n, bias, threads, act):
    from hetforge.ops.quant import _act

    g = torch.Generator().manual_seed(k * 100 + n)
    x = torch.randn(1, k, generator=g)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s, b = torch.rand(n, generator=g) / 50, (torch.randn(n, generator=g) if bias else None)
    assert native.q8_fits(x, q, s, b, act)
    want = torch.ops.aten._weight_int8pack_mm(x, q, s)
    want = _act(want + b if bias else want, act)
    y = torch.empty(1, n)
    native.library().hf_gemv_q8(q.data_ptr(), s.data_ptr(), x.data_ptr(), None if b is None else b.data_ptr(),
                                y.data_ptr(), n, k, native.ACT_CODES[act], threads)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_int8_fits_refuses_what_the_kernel_cannot_read():
    x, q, s = torch.randn(1, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)
    assert not native.q8_fits(x, q.to(torch.uint8), s, None, "none")  # not int8
    assert not native.q8_fits(torch.randn(2, 8), q, s, None, "none")  # two rows
    assert not native.q8_fits(x, q, torch.ones(3), None, "none")  # scales of the wrong length
    assert not native.q8_fits(x, q, s, None, "tanh")  # not an activation the kernel knows


def _first_path() -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    return native.library_path(cc, native.FLAG_SETS[0])


def _foreign_library(path) -> None:
    """A real shared library with none of hetforge's symbols."""
    import subprocess

    src = path.with_name("foreign.c")
    src.write_text("int not_hetforge(void) { return 42; }\n")
    subprocess.run([shutil.which("cc") or shutil.which("gcc"), "-shared", "-fPIC", str(src), "-o", str(path)],
                   check=True)
    src.unlink()


@needs_cc
@pytest.mark.parametrize("damage", ["empty", "garbage", "truncated", "foreign"])
def test_a_damaged_cached_library_is_rebuilt_and_used(fresh_state, monkeypatch, damage):
    monkeypatch.delenv("CC", raising=False)
    path = _first_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(b"\x7fELF" + bytes(range(256)) * 8)
    elif damage == "truncated":  # a real build elsewhere (never loaded here), cut in half
        whole = path.with_name("whole.so")
        assert native._build(shutil.which("cc") or shutil.which("gcc"), native.FLAG_SETS[0], whole) is None
        data = whole.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        whole.unlink()
    else:
        _foreign_library(path)
    before = path.stat().st_ino
    st_ = native.status()
    assert st_.available, st_.reason
    assert st_.path == str(path) and st_.rebuilt.startswith("rebuilt") and "could not be used" in st_.rebuilt
    assert path.stat().st_ino != before  # a new file took its place
    assert native.library().hf_read_stream is not None
    native._state.clear()
    again = native.status()  # the next load uses the rebuilt file as it is
    assert again.available and again.rebuilt == ""


@NEEDS_NATIVE
@pytest.mark.parametrize("h, hkv, s, d, written", [(12, 12, 256, 64, 131), (8, 2, 37, 16, 37), (4, 4, 9, 48, 1),
                                                   (6, 3, 64, 32, 20), (4, 2, 70, 128, 50), (2, 1, 45, 80, 44),
                                                   (2, 2, 40, 20, 25), (3, 3, 300, 256, 299)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_equals_sdpa_over_the_written_positions(h, hkv, s, d, written, threads):
    """One new row against a cache whose first ``written`` positions are visible (the rest hidden by -inf, as a
    decode step's cache mask does; plus two hidden positions among the visible ones): equal to SDPA over the
    visible rows plus the new one. Hidden cache rows hold NaN: the kernel must not read them into the result."""
    g = torch.Generator().manual_seed(s + written)
    q = torch.randn(1, h, 1, d, generator=g)
    k, v = torch.randn(1, hkv, 1, d, generator=g), torch.randn(1, hkv, 1, d, generator=g)
    kc, vc = torch.randn(1, hkv, s, d, generator=g), torch.randn(1, hkv, s, d, generator=g)
    mask = torch.zeros(1, s)
    mask[0, written:] = float("-inf")
    hidden = [p for p in (written // 2, written - 1) if written > 2]
    mask[0, hidden] = float("-inf")
    visible = (mask[0] == 0).nonzero().flatten()
    want = F.scaled_dot_product_attention(
        q, torch.cat([kc[:, :, visible], k], 2).repeat_interleave(h // hkv, 1),
        torch.cat([vc[:, :, visible], v], 2).repeat_interleave(h // hkv, 1), scale=d ** -0.5)
    kc[:, :, mask[0] != 0], vc[:, :, mask[0] != 0] = float("nan"), float("nan")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.decode_attention(q, k, v, kc, vc, mask, torch.zeros(1, 1), d ** -0.5)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@NEEDS_NATIVE
@pytest.mark.parametrize("h, hkv, d", [(16, 2, 64), (12, 4, 128), (10, 2, 80), (6, 2, 20), (14, 2, 16), (8, 8, 64)])
def test_decode_attention_has_the_same_bits_per_head_and_per_group_of_query_heads(h, hkv, d):
    """Query heads that share a K/V head run as groups of up to four (one task reads each K/V row once) where there
    are at least as many groups as threads, else one task per head: the two give the same bits (the same sums in the
    same order), so the result does not depend on the thread count. Groups of 1-4 heads, head widths through every
    path of the weighted sum, a cache with hidden positions in the middle."""
    g = torch.Generator().manual_seed(h * 100 + d)
    s = 70
    q = torch.randn(1, h, 1, d, generator=g)
    k, v = torch.randn(1, hkv, 1, d, generator=g), torch.randn(1, hkv, 1, d, generator=g)
    kc, vc = torch.randn(1, hkv, s, d, generator=g), torch.randn(1, hkv, s, d, generator=g)
    mask = torch.zeros(1, s)
    mask[0, 50:] = float("-inf")
    mask[0, [3, 17, 18]] = float("-inf")
    groups = hkv * -(-(h // hkv) // 4)
    old = torch.get_num_threads()
    got = {}
    try:
        for threads in (1, groups + 1):  # per group, then per head (fewer groups than threads)
            torch.set_num_threads(threads)
            got[threads] = native.decode_attention(q, k, v, kc, vc, mask, torch.zeros(1, 1), d ** -0.5)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(got[1], got[groups + 1])
    want = F.scaled_dot_product_attention(
        q, torch.cat([kc, k], 2).repeat_interleave(h // hkv, 1), torch.cat([vc, v], 2).repeat_interleave(h // hkv, 1),
        attn_mask=torch.cat([mask, torch.zeros(1, 1)], 1), scale=d ** -0.5)
    torch.testing.assert_close(got[1], want, rtol=1e-5, atol=1e-6)


@NEEDS_NATIVE
@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.integers(1, 70), min_size=1, max_size=native.MULTI_MAX), k=st.integers(1, 90),
       bias=st.lists(st.booleans(), min_size=native.MULTI_MAX, max_size=native.MULTI_MAX), threads=st.integers(1, 3))
def test_gemv_multi_is_bit_equal_to_one_gemv_per_weight(rows, k, bias, threads):
    """Several products of one row in one pool call: each result bit-equal to its own hf_gemv_nk call (same
    summation per row), and equal to F.linear to rounding; row counts below and beyond multiples of four."""
    g = torch.Generator().manual_seed(k * 131 + sum(rows))
    x = torch.randn(k, generator=g)
    ws = [torch.randn(n, k, generator=g) for n in rows]
    bs = [torch.randn(n, generator=g) if b else None for n, b in zip(rows, bias, strict=False)]
    outs = native.gemv_multi(x, ws, bs, [torch.full((n,), float("nan")) for n in rows], threads=threads)
    for w, b, o in zip(ws, bs, outs, strict=True):
        one = native.gemv(x, w, b, torch.empty(w.shape[0]), False, threads=threads)
        assert torch.equal(o, one)
        torch.testing.assert_close(o, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@NEEDS_NATIVE
def test_gemv_multi_refuses_what_it_cannot_run():
    x, w = torch.randn(8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="1..4 products"):
        native.MultiArgs([w.data_ptr()] * 5, [None] * 5, [0] * 5, [4] * 5)
    with pytest.raises(ValueError, match="do not fit"):
        native.gemv_multi(x, [w, torch.randn(4, 9)], [None, None], [torch.empty(4), torch.empty(4)])
    with pytest.raises(ValueError, match="do not fit"):
        native.gemv_multi(x, [w], [None], [torch.empty(5)])
    with pytest.raises(ValueError, match="do not fit"):  # the kernel writes 4-byte floats
        native.gemv_multi(x, [w], [None], [torch.empty(4, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="contiguous float32"):  # a float64 row would be read as 2k floats
        native.gemv_multi(x.double(), [w], [None], [torch.empty(4)])


@NEEDS_NATIVE
@settings(max_examples=25, deadline=None)
@given(k=st.integers(1, 80), n=st.integers(1, 80), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       threads=st.integers(1, 3))
def test_native_transpose_writes_exactly_the_transposed_weight(k, n, dtype, threads):
    w = torch.randn(k, n).to(dtype)
    out = torch.full((n, k), float("nan"), dtype=dtype)
    with_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert native.transpose_into(w, out)
    finally:
        torch.set_num_threads(with_threads)
    assert torch.equal(out, w.t())


@NEEDS_NATIVE
@pytest.mark.parametrize("k,n", [(768, 2304), (64, 136), (100, 200), (33, 264), (32, 8)])
def test_native_transpose_of_whole_register_blocks_and_their_edges_is_exact(k, n):
    """Shapes where the 8 x 8 register blocks (AVX2) move whole tiles, with partial tiles and bands beside them."""
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(k, n).to(dtype)
        out = torch.full((n, k), float("nan"), dtype=dtype)
        assert native.transpose_into(w, out)
        assert torch.equal(out, w.t())


@NEEDS_NATIVE
def test_native_transpose_refuses_what_it_cannot_read_and_writes_nothing():
    w = torch.randn(8, 4)
    for src, dst in [(w.t(), torch.zeros(8, 4)),  # a strided source
                     (w, torch.zeros(8, 4)),  # the wrong output shape
                     (w.double(), torch.zeros(4, 8, dtype=torch.float64)),  # a dtype it has no kernel for
                     (w, torch.zeros(4, 8, dtype=torch.bfloat16))]:  # mixed dtypes
        before = dst.clone()
        assert not native.transpose_into(src, dst)
        assert torch.equal(dst, before)
    with native.disabled():
        assert not native.transpose_into(w, torch.zeros(4, 8))


@needs_cc
def test_vectorized_tanh_gelu_of_a_split_k_product_matches_aten_over_the_whole_range():
    """The ``[K, N]`` product's reduce computes the tanh GELU 16 columns at a time with AVX-512, 8 with AVX2 (an exp
    polynomial, not libm's tanhf): over values from -12 to 12, tiny ones, huge ones (the cube overflows) and NaN it
    equals ATen's ``gelu(approximate='tanh')`` to a few ulp; the 4097th column (past the last full block) takes the
    scalar path."""
    vals = torch.cat([torch.linspace(-12, 12, 3001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 1e13,
                                                                   -1e13, 3e38, float("nan")])])
    vals = torch.cat([vals, torch.linspace(-3, 3, 4097 - vals.numel())])
    n = vals.numel()
    w = vals.view(1, n).contiguous()  # K = 1, W [K, N]: y_j = 1.0 · w_j exactly, then the activation
    x, y, part = torch.ones(1), torch.empty(n), torch.empty(2, n)
    native.library().hf_linear_act(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), n, 1, 1,
                                   native.ACT_CODES["gelu_tanh"], 2, part.data_ptr(), 2)
    v, nan = vals.double(), vals.isnan()
    exact = 0.5 * v * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (v + 0.044715 * v**3)))
    ok = (y.double() - exact).abs() <= 4e-7 * v.abs() + 1e-37  # a few ulp of |v| / 2
    assert bool(ok[~nan].all()) and bool(y[nan].isnan().all()), (vals[~ok & ~nan], y[~ok & ~nan])
    # ATen's own 1 + tanh(u) is off by up to an ulp of 1 where tanh(u) nears -1: equal to that much
    aten = F.gelu(vals, approximate="tanh").double()
    assert bool(((y.double() - aten).abs() <= 4e-7 * v.abs() + 1e-37)[~nan].all())


def test_the_prefetch_distance_is_the_calibration_pages_choice_for_the_kind_of_cpu():
    """bench/prefetch.py chose no prefetch on AMD Zen 4 (family 25 with AVX-512), none for the fp32 streams alone on
    AMD Zen 5 (family 26) and native.c's 2048 bytes on an Intel Xeon; other CPUs keep native.c's default (no -D
    flag)."""
    zen4 = {"vendor_id": "AuthenticAMD", "cpu family": "25", "flags": "fpu sse avx2 avx512f avx512_bf16"}
    assert native.host_defines(zen4) == ["-DHF_PF_BYTES=0"]
    assert native.host_defines({**zen4, "flags": "fpu sse avx2"}) == []  # Zen 3: same family, no AVX-512
    assert native.host_defines({**zen4, "cpu family": "26"}) == ["-DHF_PF_BYTES_F32=0"]  # Zen 5: fp32 streams only
    assert native.host_defines({**zen4, "cpu family": "26", "flags": "avx2"}) == []
    assert native.host_defines({"vendor_id": "GenuineIntel", "cpu family": "6", "flags": "avx512f"}) == []
    assert native.host_defines({}) == []  # no /proc/cpuinfo
    assert all(native.host_defines() == flags[len(flags) - len(native.host_defines()):] for flags in native.FLAG_SETS)
