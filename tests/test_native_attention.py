"""The native prefill attention (``hf_prefill_attention``): equal to ``F.scaled_dot_product_attention`` within
2e-6 (max abs error; fp32 rounding of a different summation order and a ~1 ulp exp) for causal, bool (causal +
padding, fully masked rows), float masks, grouped-query heads, odd lengths and strided q/k/v; chosen by lowering
for a compiled prefill program, whose logits match eager within KL ≤ 1e-8; refused for what it cannot read."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ir_common import captured, check_native_prefill_kernel

from hetforge.compile import compile_graph
from hetforge.kernels import native
from hetforge.verify import verify

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no C compiler/OpenMP here: the native kernels are not built and SDPA runs "
                                       "(covered by the other tests)")

TOL = 2e-6  # max abs error against SDPA on unit-normal q/k/v (measured up to ~1e-6)


def _qkv(b: int, h: int, hkv: int, ell: int, s: int, d: int, seed: int = 0):
    """q as a transposed view of a fused projection output ([b, l, (h + 2·hkv)·d]: not contiguous), k/v too."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, ell, (h + 2 * hkv) * d, generator=g)
    q = x[..., : h * d].view(b, ell, h, d).transpose(1, 2)
    kv = torch.randn(b, s, 2 * hkv * d, generator=g)
    k = kv[..., : hkv * d].view(b, s, hkv, d).transpose(1, 2)
    v = kv[..., hkv * d:].view(b, s, hkv, d).transpose(1, 2)
    return q, k, v


def _check(q, k, v, mask=None, causal=False, scale=0.125):
    assert native.prefill_attention_fits(q, k, v, mask, causal)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    got = native.prefill_attention(q, k, v, mask, scale, causal)
    assert got.is_contiguous() and got.shape == ref.shape
    err = (got - ref).abs().max().item()
    assert err <= TOL, err
    return got, ref


@pytest.mark.parametrize("ell", [1, 17, 130, 513])
@pytest.mark.parametrize("gqa", [False, True])
def test_causal_equals_sdpa(ell, gqa):
    q, k, v = _qkv(1, 4, 2 if gqa else 4, ell, ell, 64)
    assert ell == 1 or not q.is_contiguous()  # a transposed view of the fused projection
    _check(q, k, v, causal=True)
    _check(q, k, v)  # no mask at all


@pytest.mark.parametrize("ell", [1, 17, 130, 513])
def test_bool_mask_causal_and_padding_equals_sdpa(ell):
    b = 2
    q, k, v = _qkv(b, 4, 2, ell, ell, 32, seed=1)
    mask = torch.ones(ell, ell, dtype=torch.bool).tril().expand(b, 1, ell, ell).clone()
    mask[1, :, :, : min(5, ell)] = False  # left padding of the second sequence: its first rows see no key
    got, _ = _check(q, k, v, mask)
    assert got[1, :, : min(5, ell)].abs().max().item() == 0.0  # a row with no attendable key gives zeros, as SDPA


def test_bool_mask_blocks_far_from_the_diagonal_and_broadcast_dims():
    ell = 200
    q, k, v = _qkv(1, 3, 3, ell, ell, 48, seed=2)
    mask = torch.zeros(ell, ell, dtype=torch.bool)
    mask[:, 150:170] = True  # only one band of keys: most key blocks are skipped, one is partly visible
    mask[7, 3] = True
    _check(q, k, v, mask)  # 2-D mask: broadcast over batch and heads
    _check(q, k, v, mask[None])  # 3-D
    _check(q, k, v, mask.t().contiguous().t())  # strided mask


@pytest.mark.parametrize("ell,s", [(17, 17), (130, 130), (5, 70)])
def test_float_mask_equals_sdpa(ell, s):
    g = torch.Generator().manual_seed(3)
    q, k, v = _qkv(2, 6, 3, ell, s, 64, seed=3)
    mask = torch.randn(2, 1, ell, s, generator=g)
    mask[:, :, :, s // 2:] = float("-inf")  # whole key blocks hidden by -inf are skipped
    mask[0, 0, 0, :] = float("-inf")  # a row with no attendable key
    _check(q, k, v, mask)


def test_odd_head_width_and_rectangular_causal():
    q, k, v = _qkv(1, 2, 1, 9, 33, 24, seed=4)  # head width 24: the plain-C product path
    _check(q, k, v, causal=True)
    q, k, v = _qkv(1, 2, 2, 40, 40, 64, seed=5)
    _check(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)


@pytest.mark.parametrize("ell,gqa,masked", [(40, False, False), (96, True, False), (70, False, True)])
def test_bf16_is_the_fp32_kernel_on_the_widened_inputs_rounded_once(ell, gqa, masked, monkeypatch):
    """On the FMA path (AMX off) bf16 q/k/v (strided views) are widened exactly into the fp32 scratch and the fp32
    result is rounded once: bit for bit the fp32 kernel on q/k/v.float(), rounded to bf16 — and within bf16
    rounding of SDPA in bf16."""
    monkeypatch.setenv(native.AMX_ATTENTION_ENV, "0")
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(1, 4, 2 if gqa else 4, ell, ell, 32))
    mask = torch.ones(ell, ell, dtype=torch.bool).tril() if masked else None
    causal = not masked
    assert native.prefill_attention_fits(q, k, v, mask, causal)
    got = native.prefill_attention(q, k, v, mask, 0.125, causal)
    assert got.dtype == torch.bfloat16 and got.is_contiguous()
    wide = native.prefill_attention(q.float(), k.float(), v.float(), mask, 0.125, causal)
    assert torch.equal(got, wide.to(torch.bfloat16))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=0.125, enable_gqa=gqa)
    assert (got.float() - ref.float()).abs().max().item() <= 2 ** -6  # a few bf16 ulps of values below ~2


@settings(max_examples=40, deadline=None)
@given(h_per=st.sampled_from([1, 2, 3]), hkv=st.integers(1, 3), ell=st.integers(1, 150), extra=st.integers(0, 40),
       d=st.sampled_from([16, 32, 64, 96, 128]), dv=st.sampled_from([16, 48, 64, 128]), causal=st.booleans(),
       seed=st.integers(0, 2**16))
def test_bf16_attention_without_a_mask_is_within_bf16_rounding_of_float64(h_per, hkv, ell, extra, d, dv, causal,
                                                                          seed):
    """bf16 attention with no mask (the AMX tile path where the CPU has it and d % 32 == dv % 16 == 0, else the
    FMA path) on strided q/k/v of any head layout, row count and key count: within a few bf16 steps of float64
    SDPA on the same bf16 inputs, every output written (the output is poisoned first)."""
    g = torch.Generator().manual_seed(seed)
    h, s = h_per * hkv, ell + (0 if causal else extra)
    x = torch.randn(1, ell, h * d + 7, generator=g).to(torch.bfloat16)  # + 7: odd row strides
    q = x[..., 7:].view(1, ell, h, d).transpose(1, 2)
    kv = torch.randn(1, s, hkv * (d + dv) + 3, generator=g).to(torch.bfloat16)
    k = kv[..., 3:3 + hkv * d].view(1, s, hkv, d).transpose(1, 2)
    v = kv[..., 3 + hkv * d:].view(1, s, hkv, dv).transpose(1, 2)
    assert native.prefill_attention_fits(q, k, v, None, causal)
    q_, k_, v_, _, dims, strides, kind = native._prefill_attention_args(q, k, v, None, causal)
    y = torch.full((1, h, ell, dv), float("nan"), dtype=torch.bfloat16)
    native._prefill_attention_call(q_, k_, v_, None, y.data_ptr(), dims, strides, kind, d ** -0.5, causal)
    kk, vv = (t.double().repeat_interleave(h_per, 1) for t in (k, v))
    ref = F.scaled_dot_product_attention(q.double(), kk, vv, is_causal=causal, scale=d ** -0.5)
    assert not torch.isnan(y).any()
    err = (y.double() - ref).abs() / (ref.abs() + 1)
    assert err.max().item() <= 2 ** -6, err.max().item()  # bf16 p and output: a few 2^-8 steps


def test_bf16_takes_an_additive_mask_in_bf16_only():
    """An additive mask in q's dtype (how Hugging Face builds it for a bf16 model): widened exactly, the same
    result as the equivalent bool mask; an fp32 mask with bf16 q/k/v is refused (SDPA refuses it too)."""
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(1, 2, 2, 40, 40, 16))
    keep = torch.ones(40, 40, dtype=torch.bool).tril()
    additive = torch.zeros(40, 40, dtype=torch.bfloat16).masked_fill(~keep, float("-inf"))
    assert not native.prefill_attention_fits(q, k, v, additive.float(), False)
    assert native.prefill_attention_fits(q, k, v, additive, False)
    got = native.prefill_attention(q, k, v, additive, 0.25, False)
    assert torch.equal(got, native.prefill_attention(q, k, v, keep, 0.25, False))
    assert not native.prefill_attention_fits(q, k.float(), v, None, True)  # one dtype for q/k/v


def test_fits_refuses_what_it_cannot_read():
    q, k, v = _qkv(1, 2, 2, 4, 4, 8)
    m = torch.ones(4, 4, dtype=torch.bool)
    assert not native.prefill_attention_fits(q.double(), k.double(), v.double(), None, False)
    assert not native.prefill_attention_fits(q, k, v, m, True)  # mask with is_causal: SDPA refuses it too
    assert not native.prefill_attention_fits(q, k, v, m.half(), False)
    assert not native.prefill_attention_fits(q, k, v, torch.ones(3, 4, dtype=torch.bool), False)
    assert not native.prefill_attention_fits(q[:, :, :, :0], k[:, :, :, :0], v, None, False)
    wide = torch.zeros(1, 1, 2, native.PREFILL_ATTENTION_DMAX + 1)
    assert not native.prefill_attention_fits(wide, wide, wide, None, False)
    with pytest.raises(ValueError, match="cannot run"):
        native.prefill_attention_into(q.double(), k, v, None, 0, 1.0, False)


def test_hetforge_attention_op_runs_it_and_leaves_autograd_to_sdpa():
    q, k, v = _qkv(1, 2, 2, 16, 16, 8)
    got = torch.ops.hetforge.attention(q, k, v, None, 0.5, True)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5),
                               rtol=0, atol=TOL)
    qg = q.detach().clone().requires_grad_()
    assert not native.prefill_attention_fits(qg, k, v, None, True)  # a pointer-reading kernel records no graph


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_compiled_prefill_runs_it_and_matches_eager(name):
    check_native_prefill_kernel(name, "hetforge.attention.default", "native:hf_prefill_attention", "SDPA")


def test_cost_model_prices_it_as_one_native_roofline_under_its_own_key():
    import dataclasses

    from hetforge.cost import cost_mode, estimate_instr

    module, inputs, cg = captured("gpt2-tiny")
    res = compile_graph(cg.gm, soc="host", example_inputs=inputs, name="gpt2-tiny")
    prog, planned = res.program, res.memory.offsets
    ins = next(i for i in prog.instrs if i.op == "hetforge.attention.default")
    assert cost_mode(ins, planned, res.executable.kernels[ins.id]) == "native"
    d = res.soc.device(ins.device)
    key = "native:hetforge.attention.default"
    slow = dataclasses.replace(d, efficiency={**d.efficiency, key: 0.01}, overhead_s={**d.overhead_s, key: 1e-3})
    assert estimate_instr(ins, prog, slow, planned).time_s > estimate_instr(ins, prog, d, planned).time_s + 9e-4


def test_compiled_bf16_prefill_runs_it_and_stays_within_bf16_rounding_of_eager():
    """A bf16 model's compiled prefill records the native kernel for its attention and its logits stay as close to
    the bf16 eager model's as bf16 rounding allows (KL ≤ 1e-3, same top-1 on most positions)."""
    import copy
    import dataclasses

    from hetforge.frontend import capture
    from hetforge.models.zoo import example_inputs, load_model

    base = load_model("llama-tiny")
    loaded = dataclasses.replace(base, model=copy.deepcopy(base.model).to(torch.bfloat16).eval())
    inputs = example_inputs(loaded, seq=24)
    module = loaded.logits_module()
    res = compile_graph(capture(module, inputs, name="llama-tiny-bf16").gm, soc="host", example_inputs=inputs)
    att = [i for i in res.program.instrs if i.op == "hetforge.attention.default"]
    assert att and {res.executable.kernels[i.id] for i in att} == {"native:hf_prefill_attention"}
    rep = verify(module, res.executable, inputs, kl_threshold=1e-3)
    assert rep.passed and rep.top1_agree >= 0.9, rep


@pytest.mark.parametrize("seq", [24, 160])
def test_bf16_prefill_attention_follows_the_sdpa_rule_and_the_forcing_switch(seq, monkeypatch):
    """bf16 attention of at least ``sdpa_min_rows()``'s count of query rows (none: no count) is lowered to the
    general path, whose op runs ATen's SDPA (the native kernel is not called), fewer rows to the native kernel;
    ``HETFORGE_PREFILL_ATTENTION`` forces either; every way stays within bf16 rounding of the bf16 eager model."""
    import copy
    import dataclasses

    from hetforge.frontend import capture
    from hetforge.models.zoo import example_inputs, load_model

    base = load_model("llama-tiny")
    loaded = dataclasses.replace(base, model=copy.deepcopy(base.model).to(torch.bfloat16).eval())
    inputs = example_inputs(loaded, seq=seq)
    module = loaded.logits_module()
    gm = capture(module, inputs, name="llama-tiny-bf16").gm
    start = native.sdpa_min_rows().get("bfloat16")
    many = start is not None and seq >= start
    for forced in ("", "native", "sdpa"):
        if forced:
            monkeypatch.setenv("HETFORGE_PREFILL_ATTENTION", forced)
        res = compile_graph(gm, soc="host", example_inputs=inputs)
        att = [i for i in res.program.instrs if i.op == "hetforge.attention.default"]
        on_native = {res.executable.kernels[i.id] == "native:hf_prefill_attention" for i in att}
        sdpa = forced == "sdpa" or (many and not forced)
        assert att and on_native == {not sdpa}
        if sdpa:  # the op's own body takes SDPA too: the native kernel is never entered
            monkeypatch.setattr(native, "prefill_attention_into",
                                lambda *a, **k: (_ for _ in ()).throw(AssertionError("native kernel ran")))
        rep = verify(module, res.executable, inputs, kl_threshold=1e-3)
        assert rep.passed and rep.top1_agree >= 0.9, rep
        monkeypatch.undo()


def test_instruction_call_keeps_one_layout_and_checks_any_other_again():
    """``PrefillAttention`` (what a program calls) gives SDPA's result for a strided layout, then a contiguous one,
    then one whose last dim is not dense (copied, so never kept), then the first again; a layout it cannot run
    raises rather than reusing the kept dims."""
    call = native.PrefillAttention(0.125, True)
    q, k, v = _qkv(1, 4, 2, 24, 24, 16)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    wide = torch.randn(1, 4, 24, 32)[..., ::2]  # last dim stride 2
    wide.copy_(q)
    for qq, kk, vv in ((q, k, v), (q.contiguous(), k.contiguous(), v.contiguous()), (wide, k, v), (q, k, v)):
        out = torch.full(ref.shape, float("nan"))
        call(qq, kk, vv, None, out.data_ptr())
        assert (out - ref).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="cannot run"):
        call(q.double(), k, v, None, 0)


def test_output_strides_write_heads_last_rows_that_a_transpose_makes_dense():
    """With output strides of a ``[b, l, h, dv]`` buffer, the kernel writes SDPA's result there: the buffer is
    ``SDPA(q, k, v).transpose(1, 2)``, dense (what a program then reshapes without a copy)."""
    q, k, v = _qkv(2, 4, 2, 20, 20, 16)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    slab = torch.full((2, 20, 4, 16), float("nan"))
    call = native.PrefillAttention(0.125, True, tuple(slab.transpose(1, 2).stride()[:3]))
    call(q, k, v, None, slab.data_ptr())
    assert (slab - ref.transpose(1, 2)).abs().max().item() <= TOL


def test_runtime_prefill_writes_attention_heads_last_and_binds_the_merge_with_the_same_bits(monkeypatch):
    """In the runtime's prefill program (gpt2-tiny, 24 tokens) each attention result that is only transposed and
    reshaped is written in ``[b, l, h, dv]`` order: the transpose and the reshape that merges the heads are bound
    when the executable is built (no per-call view, no copy), and the logits and K/V rows are bit for bit those of
    the same program with a dense ``[b, h, l, dv]`` result. llama-tiny's attention runs its grouped-query heads
    folded into rows ([b, kv heads, group × l, dv]), which no row stride turns into ``[b, l, h, dv]``: it keeps
    the dense result."""
    from hetforge.executor import runtime
    from hetforge.models.zoo import load_model
    from hetforge.runtime import Engine

    monkeypatch.setenv("HETFORGE_COMPILE_CACHE", "0")

    def prefill(name: str) -> tuple[str, list[torch.Tensor]]:
        prog, _ = Engine(load_model(name)).programs.prefill(24)
        src = "".join(c.executable.source for c in prog.placed.exe.compiled if c.executable is not None)
        ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(0))
        return src, [t.clone() for t in prog.run(ids, torch.tensor([23]))]

    src, out = prefill("gpt2-tiny")
    with monkeypatch.context() as m:
        m.setattr(runtime._Codegen, "heads_last", lambda self, o: None)
        dense_src, dense_out = prefill("gpt2-tiny")
    layers = dense_src.count("_pa")
    assert layers >= 2 and src.count("_hl") == layers and "_hl" not in dense_src
    # the merge reshape and the view after it: per call (a copy, then a view) with a dense result, bound here; the
    # last layer's attention has the selected row only (passes/rowprune.py), where the merge is a view either way
    assert src.count("= _sv") - dense_src.count("= _sv") >= 2 * (layers - 1)
    for a, b in zip(out, dense_out, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    folded, _ = prefill("llama-tiny")
    assert folded.count("_pa") >= 2 and "_hl" not in folded


@pytest.mark.parametrize("ell,s", [(1, 1), (1, 40), (4, 16), (8, 8), (2, 32)])
@pytest.mark.parametrize("gqa", [False, True])
def test_few_rows_and_keys_equal_sdpa_for_every_mask_kind_and_bf16(ell, s, gqa):
    """At most PA_SMALL (64) query-key pairs per head (a one-token forward's attention has one of each) run on the
    kernel's path without packing, straight from the strided views: equal to SDPA causal (rectangular), with no
    mask, a bool mask with a row that sees no key (zeros), a float mask with a -inf row; bf16 is the widened fp32
    inputs' result rounded once."""
    q, k, v = _qkv(2, 4, 2 if gqa else 4, ell, s, 32, seed=ell * 100 + s)
    _check(q, k, v, causal=True)
    _check(q, k, v)
    mask = torch.ones(2, 1, ell, s, dtype=torch.bool)
    mask[1, :, 0, :] = False
    got, _ = _check(q, k, v, mask)
    assert got[1, :, 0].abs().max().item() == 0.0
    fmask = torch.randn(2, 1, ell, s, generator=torch.Generator().manual_seed(1))
    fmask[0, :, -1, :] = float("-inf")
    _check(q, k, v, fmask)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    got = native.prefill_attention(qb, kb, vb, None, 0.125, True)
    assert torch.equal(got, native.prefill_attention(qb.float(), kb.float(), vb.float(), None, 0.125,
                                                     True).to(torch.bfloat16))


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_forward_writes_attention_into_the_slice_of_its_copying_transpose_with_the_same_bits(name, monkeypatch):
    """In a forward program (no cache) the capture records the transpose that merges the heads as a copy into
    dense storage of its own (``.contiguous()`` after it). Its buffer is live from the attention on (so it shares
    no byte with the attention's operands), the attention writes its rows there in ``[b, l, h, dv]`` order and
    the copy goes: one functional copy fewer per layer, the logits bit for bit those of the program that copies."""
    from hetforge.executor import runtime
    from hetforge.ir.liveness import attention_writes, copying_heads_transpose
    from hetforge.ir.program import iter_regs

    module, inputs, cg = captured(name)
    res = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name)
    p, plan = res.program, res.memory
    by_id = {i.id: i for i in p.instrs}
    copies = [i for i in p.instrs if copying_heads_transpose(i, p)]
    assert len(copies) >= 2
    for t in copies:
        att = by_id[attention_writes(t, p, by_id)]
        out = plan.buffers[t.outputs[0]]
        assert out.start == p.instrs.index(att)
        for r in iter_regs((att.args, att.kwargs)):
            b = plan.buffers.get(p.root(r))
            if b is not None:  # a planned operand: no byte in common
                o0, o1 = plan.offsets[out.value], plan.offsets[b.value]
                assert o0 + out.size <= o1 or o1 + b.size <= o0
    with monkeypatch.context() as m:
        m.setattr(runtime._Codegen, "heads_last", lambda self, o: None)
        dense = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name)
    assert res.executable.source.count("_hl") == len(copies) and "_hl" not in dense.executable.source
    assert dense.executable.stats.functional_copy - res.executable.stats.functional_copy == len(copies)
    assert res.executable.stats.heads_last_copies == len(copies) and dense.executable.stats.heads_last_copies == 0
    with torch.no_grad():
        got, ref = res.executable(*inputs), dense.executable(*inputs)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(ref), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bf16_without_a_mask_runs_bf16_products_where_the_cpu_has_them(monkeypatch):
    """Where the CPU has AMX or AVX512-BF16, a bf16 attention without a mask multiplies in bf16 (p rounded to bf16
    before p·v): not the widened FMA path's bits, and as close to float64 SDPA as it; the switch turns it off."""
    path = native.prefill_attention_bf16_products()
    expected = "amx" if native.amx_bf16_available() else "avx512-bf16" if native.bf16_panel_available() \
        else "fp32-fma"
    assert path == expected
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 4, 96, 64).bfloat16() for _ in range(3))
    got = native.prefill_attention(q, k, v, None, 0.125, True)
    monkeypatch.setenv(native.AMX_ATTENTION_ENV, "0")
    fma = native.prefill_attention(q, k, v, None, 0.125, True)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    for out in (got, fma):
        assert (out.double() - ref).abs().max().item() <= 2 ** -6
    assert torch.equal(got, fma) == (path == "fp32-fma")


def _on_1_2_3_threads(q, k, v, mask, causal: bool, ref: torch.Tensor, tol: float) -> dict[int, torch.Tensor]:
    """The kernel's output on 1, 2 and 3 threads, each into a NaN-filled buffer of q's dtype (a row a schedule skipped
    stays NaN), each within ``tol`` of ``ref``; the thread count restored after."""
    before = torch.get_num_threads()
    outs = {}
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs[t] = torch.full(ref.shape, float("nan"), dtype=q.dtype)
            native.prefill_attention_into(q, k, v, mask, outs[t].data_ptr(), 0.125, causal)
            assert (outs[t].float() - ref).abs().max().item() <= tol
    finally:
        torch.set_num_threads(before)
    return outs


@pytest.mark.parametrize("hkv", [3, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_head_units_and_the_two_pass_schedule_give_the_same_bits(hkv, masked):
    """1 thread and threads that divide the kv heads run one unit per kv head (native.c pa_unit); the others the
    transposition region, then the tasks (hkv 4 on 3 threads, hkv 3 on 2). Every thread count gives the same bits,
    within the SDPA tolerance."""
    q, k, v = _qkv(2, 2 * hkv, hkv, 150, 150, 64, seed=hkv)
    mask = torch.ones(150, 150, dtype=torch.bool).tril().view(1, 1, 150, 150) if masked else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked, scale=0.125,
                                         enable_gqa=True)
    outs = _on_1_2_3_threads(q, k, v, mask, not masked, ref, TOL)
    assert torch.equal(outs[1], outs[2]) and torch.equal(outs[1], outs[3])


@pytest.mark.parametrize("hkv", [3, 4])
def test_bf16_product_path_gives_the_same_bits_on_head_units_and_on_two_passes(hkv):
    """The bf16 path without a mask (AMX tiles or AVX512-BF16 products where the CPU has them, native.c pam_unit):
    the same bits on 1, 2 and 3 threads, every row written, within bf16 rounding of fp32 SDPA."""
    q, k, v = (t.bfloat16() for t in _qkv(2, 2 * hkv, hkv, 150, 150, 64, seed=10 + hkv))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.125,
                                         enable_gqa=True)
    outs = _on_1_2_3_threads(q, k, v, None, True, ref, 3e-2)  # bf16 p and output roundings
    assert torch.equal(outs[1], outs[2]) and torch.equal(outs[1], outs[3])


@settings(max_examples=60, deadline=None)
@given(ell=st.integers(1, 150), extra=st.integers(0, 70), flip=st.one_of(st.none(), st.tuples(st.integers(0, 10**6),
                                                                                           st.integers(0, 10**6))))
def test_mask_is_causal_finds_exactly_the_causal_pattern(ell, extra, flip):
    """``hf_mask_is_causal`` (which lets a bool causal mask shared by every head run as is_causal) says yes exactly
    when the mask is ``j <= i``: any one entry flipped, above or below the diagonal, in the vector part or the tail
    of a row, makes it say no; a mask with rows padded to a wider stride is read by its stride."""
    s = ell + extra
    mask = torch.ones(ell, s, dtype=torch.bool).tril()
    if flip is not None:
        i, j = flip[0] % ell, flip[1] % s
        mask[i, j] = not mask[i, j]
    want = bool(torch.equal(mask, torch.ones(ell, s, dtype=torch.bool).tril()))
    assert native.mask_is_causal(mask) == want
    wide = torch.zeros(ell, s + 13, dtype=torch.bool)
    wide[:, :s] = mask
    wide[:, s:] = True  # past the mask's columns: not read
    assert native.mask_is_causal(wide[:, :s]) == want


@pytest.mark.parametrize("ell,s", [(17, 17), (130, 130), (513, 513), (40, 100)])
def test_bool_causal_mask_shared_by_the_heads_gives_the_bits_of_is_causal(ell, s):
    """A bool mask of the causal pattern shared by every head (2-D, 4-D broadcast, a batch dim expanded) runs as
    is_causal: the same bits; with one entry of the diagonal hidden it is a mask again, equal to SDPA and not to
    the is_causal result."""
    q, k, v = _qkv(2, 4, 2, ell, s, 64, seed=20 + ell)
    causal = native.prefill_attention(q, k, v, None, 0.125, True)
    tri = torch.ones(ell, s, dtype=torch.bool).tril()
    for mask in (tri, tri.view(1, 1, ell, s), tri.expand(2, 1, ell, s)):
        got, _ = _check(q, k, v, mask)
        assert torch.equal(got, causal)
    off = tri.clone()
    off[ell - 1, ell - 1] = False  # the last row's own key hidden: not the causal pattern
    got, _ = _check(q, k, v, off)
    assert not torch.equal(got, causal)
