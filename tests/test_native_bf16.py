"""The native bf16 one-row kernels (``--precision bf16`` decode): numerics against ATen's bf16 ops, every compiled
dot-product path (AVX512-BF16 ``vdpbf16ps``, AVX-512 shift + FMA, portable C) giving the same bits, odd shapes,
the kernels a compiled bf16 decode program records, and generation against the oneDNN/ATen bf16 programs.

Tolerance: a native bf16 result is an fp32 sum rounded once to bf16, as ATen's/oneDNN's are, but summed in its
own order, so an element may land on the neighbouring bf16 value: results must agree within one bf16 step
(``2**-7`` relative to the element, or to the row's scale for a sum that cancels) and nearly all elements must be
bit-equal. Row ops whose every step rounds as ATen's chain does (rotary) must be bit-equal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_native import needs_cc

from hetforge.kernels import native
from hetforge.ops import fused

# Without a C compiler hetforge builds no native kernels and bf16 runs on oneDNN/ATen: nothing here to test.
pytestmark = needs_cc

BF = torch.bfloat16
STEP = 2.0**-7  # one bf16 step, relative (8 significant bits)


@pytest.fixture(autouse=True)
def _best_path():
    yield
    native.bf16_path(None)


def _close(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | float, equal_frac: float = 0.97) -> None:
    """``got`` within one bf16 step of ``ref`` (relative to the element or to ``scale``), and mostly bit-equal."""
    assert got.dtype == ref.dtype == BF and got.shape == ref.shape
    g, r = got.float(), ref.float()
    tol = STEP * torch.maximum(r.abs(), torch.as_tensor(scale, dtype=torch.float32) * 2.0**-4) + 1e-30
    assert bool(((g - r).abs() <= tol).all()), f"max diff {(g - r).abs().max().item():.3g}"
    assert (got == ref).float().mean().item() >= equal_frac


def _paths() -> list[str]:
    best = native.bf16_path(None)
    return list(native.BF16_PATHS[: native.BF16_PATHS.index(best) + 1])


def _lin(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(BF)
    x = torch.randn(k, generator=g).to(BF)
    b = torch.randn(n, generator=g).to(BF)
    return w, x, b


SHAPES = [(1, 1), (3, 5), (5, 33), (37, 101), (64, 768), (770, 768), (2048, 64), (257, 3072)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_aten_bf16_linear_on_both_layouts(n, k, bias):
    w, x, b = _lin(n, k)
    b = b if bias else None
    ref = F.linear(x.unsqueeze(0), w, b)[0]
    scale = (w.float().abs() @ x.float().abs()) + (b.float().abs() if bias else 0)
    got = native.gemv_bf16(x, w, b)
    _close(got, ref, scale)
    got_t = native.gemv_bf16(x, w.t().contiguous(), b, weight_t=True)  # [K, N]: split-K
    _close(got_t, ref, scale)


@pytest.mark.parametrize("n,k", SHAPES)
def test_every_dot_path_gives_the_same_bits(n, k):
    w, x, b = _lin(n, k, seed=1)
    outs = {}
    for p in _paths():
        native.bf16_path(p)
        outs[p] = (native.gemv_bf16(x, w, b, act="silu"), native.gated_mlp_bf16(x, w, w.flip(0).contiguous(), None))
    first = outs["portable"]
    for p, got in outs.items():
        assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1]), p


def test_the_host_has_its_best_path_and_forcing_is_clamped():
    best = native.bf16_path(None)
    assert best in native.BF16_PATHS
    assert native.bf16_path("portable") == best  # forcing a lower path still reports the best compiled


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_result_does_not_depend_on_threads(threads):
    w, x, b = _lin(1000, 300, seed=2)
    one = native.gemv_bf16(x, w, b, threads=1)
    assert torch.equal(native.gemv_bf16(x, w, b, threads=threads), one)
    wt = w.t().contiguous()
    assert torch.equal(native.gemv_bf16(x, wt, b, weight_t=True, threads=threads),
                       native.gemv_bf16(x, wt, b, weight_t=True, threads=1))


@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("weight_t", [False, True])
def test_linear_act_rounds_like_atens_chain(act, weight_t):
    w, x, b = _lin(300, 200, seed=3)
    ref = fused.apply_act(F.linear(x.unsqueeze(0), w, b), act)[0]  # bf16 linear, then the bf16 activation
    got = native.gemv_bf16(x, w.t().contiguous() if weight_t else w, b, weight_t=weight_t, act=act)
    _close(got, ref, (w.float().abs() @ x.float().abs()) + b.float().abs())


def test_nan_and_inf_come_through():
    w, x, b = _lin(40, 64, seed=4)
    x[3] = float("nan")
    assert native.gemv_bf16(x, w, b).isnan().all()
    w2, x2, _ = _lin(8, 16, seed=4)
    x2[0], w2[:, 0] = float("inf"), 1.0
    assert native.gemv_bf16(x2, w2).isposinf().all()


@pytest.mark.parametrize("f,d", [(7, 5), (2048, 768), (513, 96)])
def test_gated_mlp_matches_aten(f, d):
    g = torch.Generator().manual_seed(5)
    wg, wu = ((torch.randn(f, d, generator=g) / d**0.5).to(BF) for _ in range(2))
    wd = (torch.randn(d, f, generator=g) / f**0.5).to(BF)
    x = torch.randn(d, generator=g).to(BF)
    h_ref = F.silu(F.linear(x, wg)) * F.linear(x, wu)
    h = native.gated_mlp_bf16(x, wg, wu, None)
    _close(h, h_ref, (wg.float().abs() @ x.float().abs()) * (wu.float().abs() @ x.float().abs()))
    y = native.gated_mlp_bf16(x, wg, wu, wd)
    _close(y, F.linear(h, wd), wd.float().abs() @ h.float().abs())  # the down projection of the same h


def test_rotary_is_bit_equal_to_the_aten_chain():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 12, 1, 64, generator=g).to(BF)
    cos, sin = torch.randn(1, 1, 1, 64, generator=g).to(BF), torch.randn(1, 1, 1, 64, generator=g).to(BF)
    ref = torch.ops.hetforge.rotary(x, cos, sin)  # bf16: the ATen chain (the fp32 kernel refuses bf16)
    assert torch.equal(native.rotary_bf16(x, cos, sin), ref)


def test_norms_match_aten():
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 768, generator=g) * 3).to(BF)
    w, b = torch.randn(768, generator=g).to(BF), torch.randn(768, generator=g).to(BF)
    ref = torch.ops.hetforge.rms_norm(x, w, 1e-6)
    _close(native.rms_norm_bf16(x, w, 1e-6), ref, ref.float().abs(), equal_frac=0.95)
    ref = F.layer_norm(x, (768,), w, b, 1e-5)
    _close(native.layer_norm_bf16(x, w, b, 1e-5), ref, w.float().abs() * 4 + b.float().abs(), equal_frac=0.95)


@pytest.mark.parametrize("h,hkv,s,d", [(12, 12, 37, 64), (8, 2, 5, 16), (4, 2, 90, 128), (2, 1, 33, 80),
                                         (2, 2, 20, 24), (2, 2, 150, 256)])
def test_decode_attention_matches_aten_and_reads_no_hidden_row(h, hkv, s, d):
    """Against ATen's chain over a cache whose second half is not written yet (-inf in the mask); the hidden rows
    then hold NaN, and the kernel must give the same result: it does not read them. Head widths take every path of
    the weighted sum (128, 64 and 16 columns in registers, and the generic loop for 24)."""
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, h, 1, d, generator=g).to(BF)
    k, v = (torch.randn(1, hkv, 1, d, generator=g).to(BF) for _ in range(2))
    kc, vc = (torch.randn(1, hkv, s, d, generator=g).to(BF) for _ in range(2))
    mask = torch.zeros(1, s).to(BF)
    mask[0, s // 2:] = float("-inf")  # positions not written yet
    ref = torch.ops.hetforge.kv_attention(q, k, v, kc, vc, mask, None, d**-0.5)
    kc[:, :, s // 2:], vc[:, :, s // 2:] = float("nan"), float("nan")
    got = native.decode_attention_bf16(q, k, v, kc, vc, mask, None, d**-0.5)
    # ATen rounds scores, probabilities and the partial sums to bf16 on the way: a few steps apart at most
    torch.testing.assert_close(got.float(), ref.float(), rtol=4 * STEP, atol=4 * STEP)


@pytest.mark.parametrize("h,hkv,d", [(16, 2, 64), (12, 4, 128), (10, 2, 80), (6, 2, 24), (14, 2, 16)])
def test_decode_attention_has_the_same_bits_per_head_and_per_group_of_query_heads(h, hkv, d):
    """As the fp32 kernel (tests/test_native.py): groups of up to four query heads of one K/V head as one task (with
    one thread) and one task per head (more threads than groups) give the same bits."""
    g = torch.Generator().manual_seed(h * 10 + d)
    s = 60
    q = torch.randn(1, h, 1, d, generator=g).to(BF)
    k, v = (torch.randn(1, hkv, 1, d, generator=g).to(BF) for _ in range(2))
    kc, vc = (torch.randn(1, hkv, s, d, generator=g).to(BF) for _ in range(2))
    mask = torch.zeros(1, s).to(BF)
    mask[0, 40:] = float("-inf")
    mask[0, [2, 11]] = float("-inf")
    groups = hkv * -(-(h // hkv) // 4)
    old = torch.get_num_threads()
    got = {}
    try:
        for threads in (1, groups + 1):
            torch.set_num_threads(threads)
            got[threads] = native.decode_attention_bf16(q, k, v, kc, vc, mask, None, d**-0.5)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(got[1], got[groups + 1])
    ref = torch.ops.hetforge.kv_attention(q, k, v, kc, vc, mask, None, d**-0.5)
    torch.testing.assert_close(got[1].float(), ref.float(), rtol=4 * STEP, atol=4 * STEP)


def test_a_bf16_operand_read_at_run_time_is_checked_for_its_dtype():
    keep: dict = {}
    t = torch.zeros(4, dtype=BF)
    assert native.contiguous_ptr(t, keep, 1, BF) == t.data_ptr()
    with pytest.raises(ValueError, match="bfloat16"):
        native.contiguous_ptr(torch.zeros(4), keep, 1, BF)
    with pytest.raises(ValueError, match="float32"):
        native.contiguous_ptr(t, keep, 1)


def _decode_program(name: str, length: int = 24):
    from hetforge.compile import compile_graph
    from hetforge.frontend import capture
    from hetforge.models.zoo import load_model
    from hetforge.runtime.kvcache import KVCache
    from hetforge.runtime.static_kv import DecodeModule, model_dims

    model = load_model(name, dtype=BF).model.eval()
    layers, kvh, hd = model_dims(model)
    cache = KVCache(layers, kvh, length, hd, BF)
    g = torch.Generator().manual_seed(9)
    for buf in cache.buffers:
        buf.copy_(torch.randn(buf.shape, generator=g))
    inputs = (torch.tensor([[7]]), torch.full((1, 1), length // 2, dtype=torch.long), *cache.buffers)
    cg = capture(DecodeModule(model), inputs, name=f"{name}-bf16-decode", stack_traces=False)
    return model, cg, inputs, compile_graph


@pytest.mark.parametrize("name,want", [
    ("llama-tiny", {"native:hf_gemv_bf16", "native:hf_gated_mlp_bf16", "native:hf_decode_attention_bf16",
                    "native:hf_rms_norm_bf16", "native:hf_rotary_bf16"}),
    ("gpt2-tiny", {"native:hf_gemv_bf16", "native:hf_decode_attention_bf16", "native:hf_layer_norm_bf16"}),
])
def test_a_compiled_bf16_decode_program_runs_the_native_kernels(name, want):
    from hetforge.cost.instr import estimate_program
    from hetforge.hardware import load_soc
    from hetforge.ir.kernel_choice import resolved_kernels
    from hetforge.runtime.static_kv import DecodeModule

    model, cg, inputs, compile_graph = _decode_program(name)
    res = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=f"{name}-bf16")
    exe = res.executable
    kernels = resolved_kernels(exe.program)
    assert want <= set(kernels.values())
    assert "onednn" not in kernels.values()  # one row: the native kernels, not measured against oneDNN
    with torch.no_grad():
        got = exe(*inputs)
        ref = DecodeModule(model)(*inputs)
    with native.disabled("the oneDNN/ATen bf16 program"):
        other = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=f"{name}-bf16-aten").executable
        assert not any(k.endswith("_bf16") for k in resolved_kernels(other.program).values())
        with torch.no_grad():
            base = other(*inputs)
    logits, ref_logits, base_logits = got[0].float(), ref[0].float(), base[0].float()
    # native vs eager bf16 within what the oneDNN/ATen program itself differs from eager, with one step of slack
    spread = (base_logits - ref_logits).abs().max().item() + STEP * ref_logits.abs().max().item()
    assert (logits - ref_logits).abs().max().item() <= 2 * spread
    assert logits.argmax() == ref_logits.argmax()
    # the cost model prices every instruction, the bf16 products at bf16 bytes (half the fp32 weight bytes)
    costs = estimate_program(exe.program, load_soc("host"), exe.plan.offsets)
    assert all(c.time_s >= 0 for c in costs)
    gemv_bytes = sum(c.bytes for c, ins in zip(costs, exe.program.instrs, strict=True)
                     if kernels[ins.id] == "native:hf_gemv_bf16")
    weight_bytes = sum(t.numel() * 2 for t in model.parameters() if t.dim() == 2 and t.shape[0] * t.shape[1] > 0)
    assert 0 < gemv_bytes <= 1.1 * weight_bytes


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_bf16_generation_gives_the_tokens_of_the_onednn_aten_program(name):
    """Greedy tokens equal those of the same bf16 engine on oneDNN/ATen (both round every product to bf16 once;
    the seeded tiny models have no near-ties in their top logits over these steps, checked below)."""
    from hetforge.models.zoo import load_model
    from hetforge.runtime import Engine, SamplingParams

    loaded = load_model(name, dtype=BF)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = [5, 17, 3, 99, 42, 8]
    got = Engine(loaded).generate(prompt, params).tokens
    with native.disabled("the oneDNN/ATen bf16 engine"):
        ref = Engine(loaded).generate(prompt, params).tokens
    assert got == ref


def test_prefill_rotary_over_positions_is_bit_equal_to_the_aten_chain():
    g = torch.Generator().manual_seed(10)
    x = torch.randn(1, 7, 3, 32, generator=g).to(BF).transpose(1, 2)  # [1, 3, 7, 32]: a transposed projection
    cos, sin = torch.randn(1, 1, 7, 32, generator=g).to(BF), torch.randn(1, 1, 7, 32, generator=g).to(BF)
    ref = torch.ops.hetforge.rotary(x, cos, sin)
    y = torch.empty(ref.shape, dtype=BF)
    native.rotary_positions(x, cos.data_ptr(), sin.data_ptr(), y.data_ptr(), 32, BF)
    assert torch.equal(y, ref)
    with pytest.raises(ValueError, match="bfloat16"):
        native.rotary_positions(x.float(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), 32, BF)


def test_a_compiled_bf16_prefill_uses_the_bf16_rotary_and_norm():
    from hetforge.compile import compile_graph
    from hetforge.frontend import capture
    from hetforge.ir.kernel_choice import resolved_kernels
    from hetforge.models.zoo import example_inputs, load_model

    loaded = load_model("llama-tiny", dtype=BF)
    module = loaded.logits_module().eval()
    inputs = example_inputs(loaded, 16)
    cg = capture(module, inputs, name="llama-tiny-bf16-prefill", stack_traces=False)
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, name="llama-tiny-bf16-prefill").executable
    kernels = set(resolved_kernels(exe.program).values())
    assert {"native:hf_rotary_pos_bf16", "native:hf_rms_norm_bf16"} <= kernels
    with torch.no_grad():
        got, ref = exe(*inputs).float(), module(*inputs).float()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
    assert (got - ref).abs().max().item() <= 8 * STEP * ref.abs().max().item()


def test_prefill_sized_norms_split_over_threads_give_the_same_bits():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(200, 768, generator=g).to(BF)  # large enough for the OpenMP split
    w, b = torch.randn(768, generator=g).to(BF), torch.randn(768, generator=g).to(BF)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.rms_norm_bf16(x, w, 1e-6), native.layer_norm_bf16(x, w, b, 1e-5)
        torch.set_num_threads(2)
        two = native.rms_norm_bf16(x, w, 1e-6), native.layer_norm_bf16(x, w, b, 1e-5)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    _close(two[0], torch.ops.hetforge.rms_norm(x, w, 1e-6), 1.0, equal_frac=0.95)
