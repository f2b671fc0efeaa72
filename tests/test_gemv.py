"""The threaded split GEMV for one-row linears (ops/gemv.py) and the executor's use of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hetforge.kernels import native
from hetforge.ops import fused, gemv


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["native", "bmm"])
def kernel(request):
    """Each one-row path: the native kernel (skipped where it cannot be built) and the ``bmm`` split."""
    request.getfixturevalue("with_native" if request.param == "native" else "no_native")
    return request.param


def test_chunk_count_follows_threads_and_divisors():
    assert gemv.chunks_for(768, threads=1) is None  # one thread: the plain kernel is faster
    assert gemv.chunks_for(768, threads=2) == 2
    assert gemv.chunks_for(50257, threads=2) == 29  # gpt2's vocabulary: 29 x 1733
    assert gemv.chunks_for(65537, threads=2) is None  # a prime: no split


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 48), m=st.integers(1, 12), c=st.integers(2, 6), weight_t=st.booleans(),
       bias=st.booleans())
def test_split_gemv_equals_linear(k, m, c, weight_t, bias):
    n = m * c
    if weight_t:  # a [K, N] weight is split over K
        k, n = k * c, m
    g = torch.Generator().manual_seed(k * 1000 + n)
    x = torch.randn(1, k, generator=g)
    w = torch.randn((k, n) if weight_t else (n, k), generator=g)
    b = torch.randn(n, generator=g) if bias else None
    ref = (x @ w if weight_t else x @ w.t()) + (b if bias else 0)
    y = gemv.split_gemv(x, gemv.split_weight(w, c, weight_t), weight_t)
    if bias:
        y = y + b
    assert y.shape == (1, n)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    out = torch.full((1, n), float("nan"))
    gemv.split_gemv(x, gemv.split_weight(w, c, weight_t), weight_t, out=out)
    torch.testing.assert_close(out, x @ w if weight_t else x @ w.t(), rtol=1e-5, atol=1e-5)


def test_split_weight_is_a_view_not_a_copy():
    w = torch.randn(12, 8)
    for weight_t in (False, True):
        v = gemv.split_weight(w, 2, weight_t)
        assert v.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()


def test_fused_linear_ops_take_the_one_row_path_only_for_one_row(two_threads, kernel, monkeypatch):
    calls = []
    mod, name = (native, "gemv") if kernel == "native" else (gemv, "split_gemv")
    real = getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    w, b = torch.randn(16, 8), torch.randn(16)
    one, many = torch.randn(1, 1, 8), torch.randn(1, 5, 8)
    for x in (one, many):
        torch.testing.assert_close(fused.linear_act.reference(x, w, b, "gelu"), F.gelu(F.linear(x, w, b)))
    wg, wu, wd = torch.randn(32, 8), torch.randn(32, 8), torch.randn(8, 32)
    ref = F.linear(F.silu(F.linear(one, wg)) * F.linear(one, wu), wd)
    torch.testing.assert_close(fused.gated_mlp.reference(one, wg, wu, wd), ref, rtol=1e-5, atol=1e-5)
    assert len(calls) == 1 + 3  # linear_act on one row, then gate, up, down; never the 5-row input
    assert all(torch.Size(s).numel() == s[-1] for s in calls)


def test_executor_runs_one_row_linears_on_the_one_row_path(two_threads, kernel):
    from hetforge.compile import compile_graph
    from hetforge.frontend import capture

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 24)
            self.w = torch.nn.Parameter(torch.randn(24, 10))  # a [K, N] weight used through addmm
            self.head = torch.nn.Linear(10, 58, bias=False)  # 58 = 2 x 29; the graph output

        def forward(self, x):
            h = torch.addmm(torch.zeros(10), torch.relu(self.a(x)), self.w)
            return self.head(h)

    m = M().eval()
    x = torch.randn(1, 8)
    cg = capture(m, (x,))
    res = compile_graph(cg.gm, soc="host", example_inputs=(x,), passes=False)
    stats = res.executable.stats
    assert (stats.native_gemv, stats.split_gemv) == ((3, 0) if kernel == "native" else (0, 3))
    for _ in range(2):  # pointers baked into the program stay valid across calls
        torch.testing.assert_close(res.executable(x), m(x), rtol=1e-5, atol=1e-5)
    x5 = torch.randn(5, 8)
    cg5 = capture(m, (x5,))
    res5 = compile_graph(cg5.gm, soc="host", example_inputs=(x5,), passes=False)
    assert res5.executable.stats.split_gemv == res5.executable.stats.native_gemv == 0  # several rows: GEMM
    torch.testing.assert_close(res5.executable(x5), m(x5), rtol=1e-5, atol=1e-5)
