"""The hetforge:: fused ops: real custom ops, equal to the unfused chains, with working fake kernels and costs."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import hetforge.ops  # noqa: F401  (registers the fused ops)
from hetforge.ops import lookup, op_call_from_node
from hetforge.ops.fused import ACTIVATIONS, apply_act

ops = torch.ops.hetforge


def _ref_attention(q, k, v, mask=None, scale=1.0, causal=False):
    n = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(n, -3), v.repeat_interleave(n, -3)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return s.softmax(-1) @ v


@pytest.mark.parametrize("hkv", [4, 2, 1])
@pytest.mark.parametrize("mask_kind", ["none", "float", "bool", "causal"])
def test_attention_matches_unfused_chain(hkv, mask_kind):
    g = torch.Generator().manual_seed(hkv)
    q = torch.randn(2, 4, 7, 8, generator=g)
    k, v = torch.randn(2, hkv, 7, 8, generator=g), torch.randn(2, hkv, 7, 8, generator=g)
    mask = None
    if mask_kind == "float":
        mask = torch.randn(2, 1, 7, 7, generator=g)
    elif mask_kind == "bool":
        mask = torch.rand(1, 1, 7, 7, generator=g) > 0.3
        mask[..., 0] = True  # no fully-masked rows
    got = ops.attention(q, k, v, mask, 0.3, mask_kind == "causal")
    want = _ref_attention(q, k, v, mask, 0.3, mask_kind == "causal")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("weight_t", [False, True])
def test_linear_act_matches_linear_then_act(act, weight_t):
    x, w, b = torch.randn(3, 5, 8), torch.randn(6, 8), torch.randn(6)
    want = apply_act(F.linear(x, w, b), act)
    wt = w.t().contiguous() if weight_t else w
    torch.testing.assert_close(ops.linear_act(x, wt, b, act, weight_t), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.linear_act(x, wt, None, act, weight_t), apply_act(F.linear(x, w), act),
                               atol=1e-5, rtol=1e-5)


def test_gpt2_tanh_gelu_chain_equals_gelu_tanh():
    x = torch.randn(1000) * 4
    chain = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    torch.testing.assert_close(apply_act(x, "gelu_tanh"), chain, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("down", [False, True])
def test_gated_mlp_is_swiglu(down):
    x, wg, wu, wd = torch.randn(2, 3, 8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)
    h = F.silu(x @ wg.t()) * (x @ wu.t())
    want = h @ wd.t() if down else h
    torch.testing.assert_close(ops.gated_mlp(x, wg, wu, wd if down else None), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_hugging_face(dtype, no_native):
    """The ATen path is bit-equal to Hugging Face's module (the native one is tested to rounding below)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(768, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(768))
    norm = norm.to(dtype)
    x = torch.randn(2, 37, 768).to(dtype)
    got = ops.rms_norm(x, norm.weight, 1e-5)
    want = norm(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("rows", [1, 37, 200])
def test_native_norms_match_aten_to_rounding(rows, with_native):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    d = 768
    x, w, b = torch.randn(1, rows, d) * 3, torch.randn(d), torch.randn(d)
    norm = LlamaRMSNorm(d, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(w)
    for got, want in [(ops.rms_norm(x, w, 1e-5), norm(x)), (ops.rms_norm(x, None, 1e-6), F.rms_norm(x, (d,), eps=1e-6)),
                      (ops.layer_norm(x, [d], w, b, 1e-5), F.layer_norm(x, [d], w, b, 1e-5)),
                      (ops.layer_norm(x, [d], None, None, 1e-5), F.layer_norm(x, [d], None, None, 1e-5))]:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def test_native_rotary_is_bit_equal_to_the_chain(with_native):
    x = torch.randn(1, 12, 1, 64)  # one decode position for 12 heads
    cos, sin = torch.randn(1, 1, 1, 64), torch.randn(1, 1, 1, 64)
    want = x * cos + torch.cat((-x[..., 32:], x[..., :32]), dim=-1) * sin
    assert torch.equal(ops.rotary(x, cos, sin), want)


@pytest.mark.parametrize("heads, kv_heads", [(12, 12), (8, 2)])
def test_native_decode_attention_matches_the_aten_chain(heads, kv_heads, with_native):
    from hetforge.kernels import native

    g = torch.Generator().manual_seed(heads)
    s, d = 40, 16
    q = torch.randn(1, heads, 1, d, generator=g)
    k, v = torch.randn(1, kv_heads, 1, d, generator=g), torch.randn(1, kv_heads, 1, d, generator=g)
    kc, vc = torch.randn(1, kv_heads, s, d, generator=g), torch.randn(1, kv_heads, s, d, generator=g)
    mask = torch.zeros(1, s)
    mask[0, 25:] = float("-inf")  # positions not written yet
    new_mask = torch.zeros(1, 1)
    args = (q, k, v, kc, vc, mask, new_mask, 0.25)
    assert native.decode_attention_fits(*args[:7])
    got = ops.kv_attention(*args)
    with native.disabled():
        want = ops.kv_attention(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    kk = torch.cat([kc[:, :, :25], k], 2).repeat_interleave(heads // kv_heads, 1)
    vv = torch.cat([vc[:, :, :25], v], 2).repeat_interleave(heads // kv_heads, 1)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, kk, vv, scale=0.25), rtol=1e-5, atol=1e-6)


def test_layer_norm_matches_functional():
    x, w, b = torch.randn(2, 5, 16), torch.randn(16), torch.randn(16)
    torch.testing.assert_close(ops.layer_norm(x, [16], w, b, 1e-5), F.layer_norm(x, [16], w, b, 1e-5))


@pytest.mark.parametrize("op, args", [
    ("attention", lambda: (torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), None, 0.3, True)),
    ("linear_act", lambda: (torch.randn(3, 4), torch.randn(4, 5), torch.randn(5), "silu", True)),
    ("gated_mlp", lambda: (torch.randn(3, 4), torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6))),
    ("rms_norm", lambda: (torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(4), 1e-6)),
    ("layer_norm", lambda: (torch.randn(3, 4), [4], torch.randn(4), None, 1e-5)),
])
def test_custom_op_schema_and_fake_kernel(op, args):
    """torch.library's own checker: schema matches behaviour, the fake kernel matches the real one."""
    torch.library.opcheck(getattr(ops, op).default, args(), test_utils=("test_schema", "test_faketensor"))


def test_fused_ops_export_and_carry_costs():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(32, 16))

        def forward(self, x):
            h = ops.linear_act(x, self.w, None, "gelu", False)
            q = h.view(1, 4, -1, 8)
            return ops.attention(q, q, q, None, 0.35, True)

    ep = torch.export.export(M(), (torch.randn(1, 6, 16),))
    nodes = {n.target: n for n in ep.graph.nodes if n.op == "call_function"}
    la, at = nodes[ops.linear_act.default], nodes[ops.attention.default]
    assert tuple(at.meta["val"].shape) == (1, 4, 6, 8)
    info = lookup(ops.linear_act.default)
    assert info is not None and info.devices == frozenset({"cpu", "gpu", "npu"})
    # 2·M·N·K + gelu 8·M·N, M = 6, N = 32, K = 16
    assert info.flops(op_call_from_node(la)) == 2 * 6 * 32 * 16 + 8 * 6 * 32
    # attention: B·H·S·L·(2D + 2Dv + 5)
    assert lookup(ops.attention.default).flops(op_call_from_node(at)) == 4 * 6 * 6 * (16 + 16 + 5)


def test_fake_kernels_propagate_gqa_and_dtypes():
    with FakeTensorMode():
        out = ops.attention(torch.empty(2, 8, 5, 16), torch.empty(2, 2, 9, 16), torch.empty(2, 2, 9, 4))
        assert tuple(out.shape) == (2, 8, 5, 4)
        y = ops.rms_norm(torch.empty(3, 8, dtype=torch.float16), torch.empty(8), 1e-6)
        assert y.dtype == torch.float32  # weight (fp32) * normed (fp16) promotes, as in Hugging Face


@pytest.mark.parametrize(("hkv", "t"), [(4, 1), (2, 1), (1, 3), (2, 4)])
def test_kv_attention_equals_attention_over_cache_plus_new_rows(hkv, t):
    g = torch.Generator().manual_seed(hkv * 10 + t)
    h, s, d = 4, 7, 8
    q = torch.randn(1, h, t, d, generator=g)
    k, v = torch.randn(1, hkv, t, d, generator=g), torch.randn(1, hkv, t, d, generator=g)
    kc, vc = torch.randn(1, hkv, s, d, generator=g), torch.randn(1, hkv, s, d, generator=g)
    valid = 5  # cache positions >= 5 are empty
    cache_mask = torch.zeros(1, s).masked_fill(torch.arange(s)[None] >= valid, float("-inf"))
    new_mask = torch.full((t, t), float("-inf")).triu(1) if t > 1 else None
    scale = d**-0.5
    got = ops.kv_attention(q, k, v, kc, vc, cache_mask, new_mask, scale)
    keys, vals = torch.cat([kc[:, :, :valid], k], 2), torch.cat([vc[:, :, :valid], v], 2)
    mask = torch.cat([torch.zeros(t, valid), new_mask if new_mask is not None else torch.zeros(t, t)], 1)
    ref = _ref_attention(q, keys, vals, mask, scale)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert kc.shape == (1, hkv, s, d)  # the cache is read, not grown
    with FakeTensorMode():
        fake = ops.kv_attention(torch.empty(1, h, t, d), torch.empty(1, hkv, t, d), torch.empty(1, hkv, t, d),
                                torch.empty(1, hkv, s, d), torch.empty(1, hkv, s, d), torch.empty(1, s))
        assert fake.shape == (1, h, t, d)


def test_rotary_aten_path_returns_the_contiguous_layout_its_fake_kernel_promises():
    """On the ATen path (here: positions in cos that are not one row) the elementwise chain over the transposed
    view of a fused projection would keep x's permuted strides; the op returns what its fake kernel describes —
    a contiguous tensor — with the chain's values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hetforge.ops import fused

    x = torch.randn(1, 6, 2, 8).transpose(1, 2)  # [b, h, l, d] view of a [b, l, h, d] projection
    cos, sin = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    got = fused.rotary.reference(x, cos, sin)
    chain = x * cos + torch.cat((-x[..., 4:], x[..., :4]), dim=-1) * sin
    assert not chain.is_contiguous()  # what the chain alone gives
    with FakeTensorMode() as mode:
        fake = torch.ops.hetforge.rotary(mode.from_tensor(x), mode.from_tensor(cos), mode.from_tensor(sin))
    assert got.stride() == fake.stride() and got.is_contiguous()
    assert torch.equal(got, chain)
