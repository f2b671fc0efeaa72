"""The native AMX bf16 GEMM (a short prompt's bf16 products): numerics against an fp32 product rounded once to bf16
for both weight layouts and tails in every dimension, the rule that sends 2..AMX_ROWS_MAX bf16 rows to it, and the
executor's use of it (a bf16 prefill within bf16 rounding of the bf16 eager model). Its speed is measured by
bench/bf16_rows.py, not here."""

from __future__ import annotations

import pytest
import torch
from epilogue_ref import ACTS, bf16_operands, bf16_prefill, check_bf16_epilogue, check_rounded_once
from hypothesis import given, settings
from hypothesis import strategies as st

from hetforge.kernels import native, onednn
from hetforge.verify import verify

# Why skipped: on a CPU without AMX-BF16 (or an OS that refuses the tile data) lowering never picks this kernel, so
# there is nothing of it a user could run; that host's bf16 products run on oneDNN, tested in test_onednn.py and
# test_native_bf16.py, which run everywhere.
pytestmark = pytest.mark.skipif(not native.amx_bf16_available(), reason="no AMX-BF16 on this CPU/OS: lowering never uses the AMX kernel here; bf16 products run on oneDNN (test_onednn.py, test_native_bf16.py)")  # noqa: E501


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 100), n=st.integers(1, 90), weight_t=st.booleans(),
       with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_amx_gemm_is_the_fp32_product_rounded_once_for_both_layouts_and_any_tail(m, k, n, weight_t, with_bias, seed):
    w, x, b = bf16_operands(m, k, n, weight_t, with_bias, seed)
    packed = native.pack_amx_bf16(w, weight_t)
    assert packed.numel() == -(-n // 16) * -(-k // 32) * 512
    check_rounded_once(native.gemm_amx_bf16(x, packed, b, n), x, w, b, weight_t)


def test_amx_gemm_keeps_the_leading_dimensions_and_refuses_a_mismatched_packing():
    w = torch.randn(70, 48).to(torch.bfloat16)
    x = torch.randn(2, 9, 48).to(torch.bfloat16)
    packed = native.pack_amx_bf16(w)
    y = native.gemm_amx_bf16(x, packed, None, 70)
    assert y.shape == (2, 9, 70) and torch.equal(y.view(18, 70), native.gemm_amx_bf16(x.view(18, 48), packed, None, 70))
    with pytest.raises(ValueError, match="packed for"):
        native.gemm_amx_bf16(x, packed, None, 90)  # 6 column blocks where the packing holds 5


def test_a_prompts_bf16_products_take_the_amx_kernel_by_rule(monkeypatch):
    monkeypatch.delenv("HETFORGE_GEMM", raising=False)
    hi = native.AMX_ROWS_MAX
    before = len(onednn.measured_choices())
    for rows in (2, hi):
        assert onednn.pick(rows, 96, 112, torch.bfloat16) == "amx"
    assert len(onednn.measured_choices()) == before  # a rule: nothing timed
    assert onednn.pick(hi, 96, 112, torch.float32) != "amx"
    monkeypatch.setenv("HETFORGE_GEMM", "onednn")
    assert onednn.pick(2, 96, 112, torch.bfloat16) == "onednn"


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_executor_runs_a_short_bf16_prompts_linears_on_amx_within_bf16_rounding_of_eager(name, monkeypatch):
    """A 12-token bf16 prefill: its multi-row products on the AMX kernel (activation, gated MLP product and
    residual add in place after it), within bf16 rounding of the bf16 eager model, results that survive the next
    call."""
    monkeypatch.delenv("HETFORGE_GEMM", raising=False)
    module, exe, inputs = bf16_prefill(name, 12)
    assert exe.stats.amx_gemm > 0
    rep = verify(module, exe, inputs, kl_threshold=1e-3)
    assert rep.passed and rep.top1_agree >= 0.9, rep
    first = exe(*inputs).clone()
    exe(*inputs)
    torch.testing.assert_close(exe(*inputs), first, rtol=0, atol=0)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 100), n=st.integers(1, 70), act=st.sampled_from(ACTS),
       with_mul=st.booleans(), with_res=st.booleans(),
    seed=st.integers(0, 2**16))
def test_amx_epilogue_matches_atens_bf16_ops_after_the_product(m, k, n, act, with_mul, with_res, seed):
    """act → × mul → + res in the kernel's store equals ATen's in-place bf16 ops on the plain product: bit for bit
    without an activation, within one bf16 step with one (the kernel's own exp/tanh); gelu (erf), which the store
    does not have, runs as ATen's op after it."""
    check_bf16_epilogue(native.pack_amx_bf16, native.gemm_amx_bf16, m, k, n, act, with_mul, with_res, seed)
