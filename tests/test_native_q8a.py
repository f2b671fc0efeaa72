"""hf_gemv_q8a: int8 weights × int8 activation blocks of 32 (one row), against a torch reference of the same
quantized arithmetic, on every compiled path (AVX512-VNNI, AVX2, portable C), and the mode that selects it."""

from __future__ import annotations

import pytest
import torch
from test_native import needs_cc

from hetforge.errors import UsageError
from hetforge.kernels import native
from hetforge.ops.quant import _act

# The native kernels are optional: without a C compiler hetforge builds none and runs w8 on ATen's kernels, so a
# user on such a host never reaches hf_gemv_q8a and there is nothing here to test.
pytestmark = needs_cc


def _quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [k] → (x_q int [nb, 32] zero-padded, d [nb]): d = amax/127, x_q = round-half-even(x·(1/d))."""
    k = x.numel()
    nb = (k + 31) // 32
    xb = torch.nn.functional.pad(x.float(), (0, nb * 32 - k)).view(nb, 32)
    d = xb.abs().amax(1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(xb * inv[:, None]).clamp(-127, 127).to(torch.int64), d


def _reference(q, s, x, b, act):
    """The kernel's arithmetic in torch: exact int block sums, then Σ_b d_b·sum_b, × scale (+ bias), act."""
    n, k = q.shape
    xq, d = _quantize_blocks(x)
    nb = d.numel()
    qb = torch.nn.functional.pad(q.to(torch.int64), (0, nb * 32 - k)).view(n, nb, 32)
    isum = (qb * xq[None]).sum(-1)  # exact
    y = (isum.double() * d.double()[None]).sum(-1).float() * s
    return _act(y + b if b is not None else y, act)


def _run(q, s, x, b, act, threads, path=-1):
    lib = native.library()
    y = torch.empty(q.shape[0])
    lib.hf_q8a_path(path)
    try:
        lib.hf_gemv_q8a(q.data_ptr(), s.data_ptr(), x.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
                        q.shape[0], q.shape[1], native.ACT_CODES[act], threads)
    finally:
        lib.hf_q8a_path(-1)
    return y


def test_block_quantization_equals_torch_round_half_even():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, generator=g)
    x[40:64] = 0.0  # a block that is all zero: d = 0, x_q = 0
    x[5] = 0.5 * x[:32].abs().max() / 127 * 2 * 63  # lands near a .5 tie after scaling
    nb = 4
    xq, xd, xd8 = torch.empty(nb * 32, dtype=torch.int8), torch.empty(nb), torch.empty(nb * 8)
    native.library().hf_quantize_q8_blocks(x.data_ptr(), 100, xq.data_ptr(), xd.data_ptr(), xd8.data_ptr())
    want_q, want_d = _quantize_blocks(x)
    assert torch.equal(xq.view(nb, 32).to(torch.int64), want_q)
    assert torch.equal(xd, want_d) and torch.equal(xd8, want_d.repeat_interleave(8))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_block_quantization_gives_a_block_with_nan_or_inf_scale_nan_and_zero_codes(bad):
    """A block holding NaN or ±Inf: scale NaN (so every sum it meets is NaN) and codes 0, the other blocks as
    torch rounds them; the vector paths take the full blocks, the scalar loop the partial last one."""
    g = torch.Generator().manual_seed(3)
    k = 32 * 5 + 9
    x = torch.randn(k, generator=g)
    x[32 + 7] = bad
    x[k - 2] = bad  # the partial last block
    nb = (k + 31) // 32
    xq, xd, xd8 = torch.empty(nb * 32, dtype=torch.int8), torch.empty(nb), torch.empty(nb * 8)
    native.library().hf_quantize_q8_blocks(x.data_ptr(), k, xq.data_ptr(), xd.data_ptr(), xd8.data_ptr())
    want_q, want_d = _quantize_blocks(torch.where(x.isfinite(), x, torch.zeros_like(x)))
    want_q[1] = want_q[nb - 1] = 0
    want_d[1] = want_d[nb - 1] = float("nan")
    assert torch.equal(xq.view(nb, 32).to(torch.int64), want_q)
    assert torch.allclose(xd, want_d, rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(xd8, want_d.repeat_interleave(8), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("k", [1, 15, 16, 17, 31, 32, 33, 48, 64, 97, 200])
@pytest.mark.parametrize("mag", [1.0, 1e30, 1e-36])  # 1e-36: subnormal block scales (1/d finite or Inf)
def test_block_quantization_of_any_length_and_magnitude_equals_torch(k, mag):
    """The vector quantizers (AVX-512: 16 lanes, masked partial blocks; AVX2: 8 lanes, full blocks) round and clamp
    as the scalar loop."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(k, generator=g) * mag
    x[::7] = torch.round(x[::7] / mag * 4) / 4 * mag  # quarter steps: many ties after scaling
    nb = (k + 31) // 32
    xq, xd, xd8 = torch.empty(nb * 32, dtype=torch.int8), torch.empty(nb), torch.empty(nb * 8)
    native.library().hf_quantize_q8_blocks(x.data_ptr(), k, xq.data_ptr(), xd.data_ptr(), xd8.data_ptr())
    want_q, want_d = _quantize_blocks(x)
    want_q.view(-1)[k:] = 0  # zero padding (torch's pad·(1/d) is NaN when 1/d overflows to Inf)
    assert torch.equal(xq.view(nb, 32).to(torch.int64), want_q)
    assert torch.equal(xd, want_d) and torch.equal(xd8, want_d.repeat_interleave(8))


@pytest.mark.parametrize(("n", "k"), [(1, 1), (3, 31), (5, 33), (8, 64), (13, 100), (7, 96), (64, 768), (6, 130)])
@pytest.mark.parametrize("threads", [1, 2])
def test_q8a_equals_the_quantized_reference_on_every_path(n, k, threads):
    g = torch.Generator().manual_seed(n * 1000 + k)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)  # -128 too: the sign trick must hold
    s, x, b = torch.rand(n, generator=g) / 50, torch.randn(k, generator=g), torch.randn(n, generator=g)
    want = _reference(q, s, x, b, "none")
    best = native.library().hf_q8a_path(-1)
    ys = {p: _run(q, s, x, b, "none", threads, p) for p in range(best + 1)}
    torch.testing.assert_close(ys[best], want, rtol=1e-5, atol=1e-5)
    for p, y in ys.items():  # the portable C (0), AVX2 (1) and VNNI (2) paths give the same bits
        assert torch.equal(y, ys[best]), p
    assert torch.equal(_run(q, s, x, b, "none", 1), _run(q, s, x, b, "none", 3))  # any thread count


@pytest.mark.parametrize("act", ["relu", "silu", "gelu", "gelu_tanh"])
def test_q8a_activations_and_no_bias(act):
    g = torch.Generator().manual_seed(7)
    q = torch.randint(-127, 128, (10, 70), dtype=torch.int8, generator=g)
    s, x = torch.rand(10, generator=g) / 50, torch.randn(70, generator=g)
    torch.testing.assert_close(_run(q, s, x, None, act, 2), _reference(q, s, x, None, act), rtol=1e-5, atol=1e-5)


def test_q8a_is_close_to_the_float_activation_kernel():
    """Quantizing x per block of 32 costs about 1/127 of each block's range: ~0.5% relative on random data."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (256, 768), dtype=torch.int8, generator=g)
    s, x = torch.rand(256, generator=g) / 50, torch.randn(768, generator=g)
    want = (q.float() @ x) * s
    rel = float((_run(q, s, x, None, "none", 1) - want).norm() / want.norm())
    assert 1e-4 < rel < 0.02, rel


def test_w8_act_mode_selects_the_kernel_and_refuses_unknown_values(monkeypatch):
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (12, 40), dtype=torch.int8, generator=g)
    s, x = torch.rand(12, generator=g) / 50, torch.randn(1, 40, generator=g)
    monkeypatch.setenv("HETFORGE_W8_ACT", "weight-only")
    assert native.q8_kernel() == "hf_gemv_q8"
    weight_only = torch.ops.hetforge.linear_w8(x, q, s)
    torch.testing.assert_close(weight_only, torch.ops.aten._weight_int8pack_mm(x, q, s), rtol=1e-5, atol=1e-5)
    monkeypatch.delenv("HETFORGE_W8_ACT")  # the default: q8
    assert native.w8_act_mode() == "q8" and native.q8_kernel() == "hf_gemv_q8a"
    assert torch.equal(torch.ops.hetforge.linear_w8(x, q, s)[0], _run(q, s, x[0].contiguous(), None, "none", 1))
    monkeypatch.setenv("HETFORGE_W8_ACT", "int4")
    with pytest.raises(UsageError, match="HETFORGE_W8_ACT"):
        native.w8_act_mode()
