"""Prefill kernels: the many-position native rotary (``hf_rotary_pos``, reading a transposed projection output in
place) — bit-equal to the ATen chain, chosen by lowering for prefill, refused for operands it cannot read — and
the prefill programs that use it matching eager within KL ≤ 1e-8."""

import pytest
import torch
from test_ir_common import check_native_prefill_kernel

from hetforge.kernels import native

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no C compiler/OpenMP here: the native kernels are not built and the ATen "
                                       "paths run (covered by the other tests)")


def _chain(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


@pytest.mark.parametrize("per_position", [True, False])
def test_rotary_positions_reads_strided_x_and_equals_the_aten_chain_bitwise(per_position):
    g = torch.Generator().manual_seed(0)
    b, s, h, d = 2, 7, 3, 8
    x = torch.randn(b, s, h * d, generator=g).view(b, s, h, d).transpose(1, 2)  # [b, h, s, d], not contiguous
    assert not x.is_contiguous()
    rows = s if per_position else 1
    cos, sin = torch.randn(1, 1, rows, d, generator=g), torch.randn(1, 1, rows, d, generator=g)
    y = torch.empty(b, h, s, d)
    native.rotary_positions(x, cos.data_ptr(), sin.data_ptr(), y.data_ptr(), d if per_position else 0)
    assert torch.equal(y, _chain(x, cos, sin))


def test_rotary_positions_refuses_what_it_cannot_read():
    y = torch.empty(1, 2, 3, 4)
    c = torch.zeros(4)
    with pytest.raises(ValueError, match="float32"):
        native.rotary_positions(torch.zeros(1, 2, 3, 4, dtype=torch.float64), c.data_ptr(), c.data_ptr(),
                                y.data_ptr(), 0)
    with pytest.raises(ValueError, match="dense last dim"):
        native.rotary_positions(torch.zeros(1, 2, 4, 3).transpose(2, 3), c.data_ptr(), c.data_ptr(), y.data_ptr(), 0)


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny"])
def test_prefill_rotary_runs_natively_and_matches_eager(name):
    check_native_prefill_kernel(name, "hetforge.rotary.default", "native:hf_rotary_pos", "the ATen chain")


@pytest.mark.parametrize("m", [2, 3, 5, 8, 16, 32])
@pytest.mark.parametrize("act", ["none", "silu", "gelu"])
def test_few_row_product_equals_aten_to_rounding(m, act):
    from hetforge.ops.fused import apply_act

    g = torch.Generator().manual_seed(m)
    n, k = 70, 45  # a tail of n % 4 rows and a masked tail of k % 16 lanes
    w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    y = torch.full((m, n), float("nan"))
    native.check_few_rc(native.library().hf_gemm_few(w.data_ptr(), x.data_ptr(), b.data_ptr(), y.data_ptr(), m, n,
                                                     k, native.ACT_CODES[act], 2))
    ref = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(y, ref if act == "none" else apply_act(ref, act), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [2, 3, 5, 8, 16, 32])
@pytest.mark.parametrize("act", ["none", "gelu_tanh"])
def test_few_row_product_of_a_kn_weight_equals_aten_to_rounding(m, act):
    from hetforge.ops.fused import apply_act

    g = torch.Generator().manual_seed(m)
    k, n = 139, 70  # K: 34 rows per quarter and a tail of 3; N: a masked tail of 6 lanes
    w, x, b = torch.randn(k, n, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    y = torch.full((m, n), float("nan"))
    part = torch.full((native.FEW_KN_SLOTS, m * n), float("nan"))  # every part's block is written before it is read
    native.check_few_rc(native.library().hf_gemm_few_kn(w.data_ptr(), x.data_ptr(), b.data_ptr(), y.data_ptr(), m,
                                                        n, k, native.ACT_CODES[act], 2, part.data_ptr(),
                                                        native.FEW_KN_SLOTS))
    ref = torch.addmm(b, x, w)
    torch.testing.assert_close(y, ref if act == "none" else apply_act(ref, act), rtol=1e-5, atol=1e-5)


def test_few_row_product_refuses_more_rows_than_it_takes_and_writes_nothing():
    w, x, y = torch.randn(8, 4), torch.randn(33, 4), torch.zeros(33, 8)
    with pytest.raises(ValueError, match="row count"):
        native.check_few_rc(native.library().hf_gemm_few(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), 33, 8, 4,
                                                         0, 2))
    assert not y.any()


@pytest.mark.parametrize("down", [True, False])
def test_few_row_gated_mlp_equals_the_op_to_rounding(down):
    from hetforge.ops.fused import apply_act

    g = torch.Generator().manual_seed(7)
    m, d, f = 5, 24, 40
    x, wg, wu = torch.randn(m, d, generator=g), torch.randn(f, d, generator=g), torch.randn(f, d, generator=g)
    wd = torch.randn(d, f, generator=g) if down else None
    y, scr = torch.empty(m, d if down else f), torch.empty(2 * m * f)
    native.check_few_rc(native.library().hf_gated_mlp_few(
        x.data_ptr(), wg.data_ptr(), wu.data_ptr(), None if wd is None else wd.data_ptr(), scr.data_ptr(),
        scr[m * f:].data_ptr(), y.data_ptr(), m, f, d, native.ACT_CODES["silu"], 2))
    h = apply_act(x @ wg.t(), "silu") * (x @ wu.t())
    torch.testing.assert_close(y, h @ wd.t() if down else h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("name", "op", "kernel"), [
    ("llama-tiny", "hetforge.gated_mlp.default", "native:hf_gated_mlp_few"),
    ("qwen2-tiny", "aten.linear.default", "native:hf_gemm_few"),  # q/k/v with a bias
    ("gpt2-tiny", "aten.addmm.default", "native:hf_gemm_few_kn"),  # Conv1D: [K, N] weights
    ("gpt2-tiny", "hetforge.linear_act.default", "native:hf_gemm_few_kn"),
])
def test_a_short_prefill_runs_its_fp32_products_on_the_few_row_kernel_and_matches_eager(name, op, kernel):
    # below native.PANEL_MIN rows where the panel GEMM runs (from there it takes them: test_panel_gemm.py)
    rows = native.PANEL_MIN - 1 if native.panel_available() else 8
    check_native_prefill_kernel(name, op, kernel, "oneDNN / ATen", seq=rows)
