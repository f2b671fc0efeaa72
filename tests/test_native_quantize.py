"""hf_quantize_i8: a model's weights quantized per output channel to int8 in two passes, with the bits of the ATen
reference (quant.schemes.quantize_int8) on both weight layouts, and refused (ATen's path taken) on NaN or ±Inf."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_native import needs_cc

from hetforge.kernels import native
from hetforge.quant.schemes import dequantize_int8, quantize_int8, quantize_weight

# The native kernels are optional: without a C compiler quantize_weight takes ATen's path (the other tests of
# hetforge.quant run it), so there is no second path here to compare.
pytestmark = needs_cc


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 90), transposed=st.booleans(), scale=st.sampled_from([1.0, 0.02, 1e3]),
       seed=st.integers(0, 2**31), threads=st.sampled_from([1, 2]))
def test_native_int8_weights_and_scales_have_atens_bits_on_both_layouts(n, k, transposed, scale, seed, threads):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn((k, n) if transposed else (n, k), generator=g) * scale
    w = w.t() if transposed else w  # a Conv1D weight read as [N, K]: channel j is column j of the stored [K, N]
    # channel 0 gets max |w| = 127, so its scale is 1 and 0.5, 1.5, -2.5 are ties: rounding must go to the even one
    m = min(4, k)
    w[0, :m] = torch.tensor([127.0, 0.5, 1.5, -2.5])[:m]
    torch.set_num_threads(threads)
    got = native.quantize_i8(w)
    assert got is not None
    q, s = quantize_int8(w)
    assert torch.equal(got[0], q) and torch.equal(got[1], s)
    ref = float(torch.linalg.vector_norm(w.double() - dequantize_int8(q, s).double()) / torch.linalg.vector_norm(
        w.double()))
    assert got[2] == pytest.approx(ref, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_weight_holding_nan_or_inf_is_refused_and_quantized_on_atens_path(bad):
    w = torch.randn(8, 32)
    w[3, 5] = bad
    assert native.quantize_i8(w) is None
    qw = quantize_weight(w, "w8")  # ATen's path still quantizes it, as before the native kernel
    q, s = quantize_int8(w)
    assert torch.equal(qw.tensors["qweight"], q)
    assert torch.allclose(qw.tensors["scales"], s, rtol=0, atol=0, equal_nan=True)


def test_other_dtypes_and_strided_weights_take_atens_path():
    assert native.quantize_i8(torch.randn(8, 32, dtype=torch.bfloat16)) is None
    assert native.quantize_i8(torch.randn(8, 64)[:, ::2]) is None  # neither [N, K] nor [K, N] contiguous
    w = torch.randn(8, 64)[:, ::2]
    qw = quantize_weight(w, "w8")
    q, s = quantize_int8(w)
    assert torch.equal(qw.tensors["qweight"], q) and torch.equal(qw.tensors["scales"], s)
