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
