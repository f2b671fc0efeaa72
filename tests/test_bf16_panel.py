"""The native AVX512-BF16 panel GEMM (``hf_gemm_bf16_panel``: a short prompt's bf16 products on a CPU with
AVX512-BF16 and no AMX): numerics against a float64 product rounded once to bf16 for both weight layouts and tails,
its epilogue against ATen's bf16 ops, the rule that sends BF16_PANEL_ROWS_MIN..MAX bf16 rows to it, and the executor's
use of it (a bf16 prefill within bf16 rounding of the bf16 eager model). On a CPU without AVX512-BF16 the kernel must
refuse with a clear error and the rule must never pick it; these tests check that there instead. Its speed is
measured by ``bench/bf16_rows.py --kernel panel``, not here."""

from __future__ import annotations

import pytest
import torch
from epilogue_ref import ACTS, bf16_operands, bf16_prefill, check_bf16_epilogue, check_rounded_once
from hypothesis import given, settings
from hypothesis import strategies as st

from hetforge.kernels import native, onednn
from hetforge.verify import verify

HERE = native.bf16_panel_available()  # this build has the AVX512-BF16 path


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 150), k2=st.integers(1, 300), n=st.integers(1, 110), weight_t=st.booleans(),
       with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_bf16_panel_gemm_is_the_product_rounded_once_for_both_layouts_and_any_tail(m, k2, n, weight_t, with_bias,
                                                                                    seed):
    w, x, b = bf16_operands(m, 2 * k2, n, weight_t, with_bias, seed)
    packed = native.pack_bf16_panels(w, weight_t)
    assert packed.numel() == -(-n // 48) * k2 * 96
    if not HERE:
        with pytest.raises(ValueError, match="no AVX512-BF16"):
            native.gemm_bf16_panel(x, packed, b, n)
        return
    check_rounded_once(native.gemm_bf16_panel(x, packed, b, n), x, w, b, weight_t)


def test_bf16_panel_gemm_keeps_leading_dimensions_and_refuses_odd_k_and_mismatched_packings():
    w = torch.randn(70, 48).to(torch.bfloat16)
    x = torch.randn(2, 9, 48).to(torch.bfloat16)
    packed = native.pack_bf16_panels(w)
    with pytest.raises(ValueError, match="packed for"):
        native.gemm_bf16_panel(x, packed, None, 100)  # 3 panels where the packing holds 2
    odd = torch.randn(70, 47).to(torch.bfloat16)
    with pytest.raises(ValueError, match="K even"):
        native.gemm_bf16_panel(torch.randn(3, 47).to(torch.bfloat16), native.pack_bf16_panels(odd), None, 70)
    if HERE:
        y = native.gemm_bf16_panel(x, packed, None, 70)
        assert y.shape == (2, 9, 70)
        assert torch.equal(y.view(18, 70), native.gemm_bf16_panel(x.view(18, 48), packed, None, 70))


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), k2=st.integers(1, 50), n=st.integers(1, 70), act=st.sampled_from(ACTS),
       with_mul=st.booleans(), with_res=st.booleans(), seed=st.integers(0, 2**16))
def test_bf16_panel_epilogue_matches_atens_bf16_ops_after_the_product(m, k2, n, act, with_mul, with_res, seed):
    """act → × mul → + res in the kernel's store equals ATen's in-place bf16 ops on the plain product: bit for bit
    without an activation, within one bf16 step with one (the kernel's own exp/tanh); gelu (erf), which the store
    does not have, runs as ATen's op after it."""
    if not HERE:
        return  # the kernel refuses here (the first test checks that): nothing of its store to compare
    k = 2 * k2
    check_bf16_epilogue(native.pack_bf16_panels, native.gemm_bf16_panel, m, k, n, act, with_mul, with_res, seed)


def test_a_prompts_bf16_products_take_the_panel_kernel_by_rule_only_where_it_runs_and_amx_does_not(monkeypatch):
    monkeypatch.delenv("HETFORGE_GEMM", raising=False)
    lo, hi = native.BF16_PANEL_ROWS_MIN, native.BF16_PANEL_ROWS_MAX
    assert 2 <= lo <= hi
    before = len(onednn.measured_choices())
    usable = HERE and not native.amx_bf16_available()
    for rows in (lo, hi):
        assert (onednn.pick(rows, 96, 112, torch.bfloat16) == "bf16panel") == usable
    if usable:
        assert len(onednn.measured_choices()) == before  # a rule: nothing timed
        assert onednn.decided(lo, 96, 112, torch.bfloat16) is True  # answered by the rule, not "not measured yet"
        assert onednn.pick(hi, 95, 112, torch.bfloat16) != "bf16panel"  # odd K
        assert onednn.pick(hi + 1, 96, 112, torch.bfloat16) != "bf16panel"
        assert onednn.pick(lo - 1, 96, 112, torch.bfloat16) != "bf16panel"
        assert onednn.pick(hi, 96, 112, torch.float32) != "bf16panel"
    monkeypatch.setenv("HETFORGE_GEMM", "onednn")  # where oneDNN has no bf16 kernels, ATen runs it
    assert onednn.pick(lo, 96, 112, torch.bfloat16) == ("onednn" if onednn.dtype_ok(torch.bfloat16) else "aten")


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_executor_runs_a_short_bf16_prompt_within_bf16_rounding_of_eager(name, monkeypatch):
    """An 8-token bf16 prefill: where the rule picks the panel kernel, its multi-row products run there (activation,
    gated MLP product and residual add in its store), within bf16 rounding of the bf16 eager model, results that
    survive the next call; elsewhere none do."""
    monkeypatch.delenv("HETFORGE_GEMM", raising=False)
    module, exe, inputs = bf16_prefill(name, 8)
    uses = onednn.bf16_panel_rows(8, 64, torch.bfloat16)
    assert (exe.stats.bf16_panel_gemm > 0) == uses
    rep = verify(module, exe, inputs, kl_threshold=1e-3)
    assert rep.passed and rep.top1_agree >= 0.9, rep
    first = exe(*inputs).clone()
    exe(*inputs)
    torch.testing.assert_close(exe(*inputs), first, rtol=0, atol=0)
