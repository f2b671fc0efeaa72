"""The native one-row products' ``_res`` variants (``hf_gemv_res``, ``hf_gemv_bf16_res``, ``hf_gated_mlp_res``,
``hf_gated_mlp_bf16_res``): the product and the residual add after it as one call, bit for bit the product then
ATen's add — also with the residual being the result's own memory, and, for the kernels that read their input in a
pass before the one that writes (split-K ``[K, N]``, gated MLP), with the result over the input — and the executor
moving a product to its residual add (``ExecStats.native_residual``) with the same logits as the program that adds
separately."""

from __future__ import annotations

import pytest
import torch
from test_native import needs_cc

from hetforge.kernels import native

pytestmark = needs_cc
BF = torch.bfloat16


def _lib():
    lib = native.library()
    if lib is None:
        pytest.skip("the native C kernels are not built on this host (" + native.status().reason + "): these "
                    "check their residual variants only; without them every residual add runs as ATen's add")
    return lib


@pytest.mark.parametrize("n, k", [(5, 33), (768, 768), (257, 1030)])
@pytest.mark.parametrize("weight_t, where", [(False, "apart"), (False, "res-is-y"), (True, "apart"),
                                             (True, "res-is-y"), (True, "x-is-y")])
def test_gemv_res_is_the_product_then_atens_add_bit_for_bit(weight_t, n, k, where):
    """``x-is-y`` only for the split-K ``[K, N]`` product: it reads x before it writes y (an ``[N, K]`` one writes
    rows while other rows still read x, so the executor never hands it an overlapping result)."""
    lib = _lib()
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)
    x, r = torch.randn(k, generator=g), torch.randn(n, generator=g)
    want = torch.add(native.gemv(x.view(1, k), w.t().contiguous() if weight_t else w, b, torch.empty(1, n),
                                 weight_t).view(n), r)
    buf = torch.empty(max(n, k))
    if where == "res-is-y":
        buf[:n] = r
        res_ptr = buf.data_ptr()
    else:
        res_ptr = r.data_ptr()
    if where == "x-is-y":
        buf[:k] = x
        x_ptr = buf.data_ptr()
    else:
        x_ptr = x.data_ptr()
    wk = w.t().contiguous() if weight_t else w
    part = torch.empty(native.split_k_slots(), n)
    lib.hf_gemv_res(wk.data_ptr(), x_ptr, b.data_ptr(), res_ptr, buf.data_ptr(), n, k, int(weight_t), 2,
                    part.data_ptr() if weight_t else None, part.shape[0] if weight_t else 0)
    assert torch.equal(buf[:n], want)


@pytest.mark.parametrize("weight_t", [False, True])
@pytest.mark.parametrize("act", ["none", "gelu_tanh"])
def test_gemv_bf16_res_rounds_like_the_product_then_atens_bf16_add(weight_t, act):
    lib = _lib()
    g = torch.Generator().manual_seed(7)
    n, k = 300, 200
    w, x = (torch.randn(n, k, generator=g) / k**0.5).to(BF), torch.randn(k, generator=g).to(BF)
    b, r = torch.randn(n, generator=g).to(BF), torch.randn(n, generator=g).to(BF)
    wk = w.t().contiguous() if weight_t else w
    want = torch.add(native.gemv_bf16(x, wk, b, weight_t=weight_t, act=act), r)
    y = r.clone()  # the residual is the result's own memory
    part = torch.empty(native.split_k_slots(), n)
    lib.hf_gemv_bf16_res(wk.data_ptr(), x.data_ptr(), b.data_ptr(), y.data_ptr(), y.data_ptr(), n, k, int(weight_t),
                         native.ACT_CODES[act], 2, part.data_ptr() if weight_t else None,
                         part.shape[0] if weight_t else 0)
    assert torch.equal(y, want)


@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_gated_mlp_res_is_the_block_then_atens_add_even_over_its_input(dtype):
    lib = _lib()
    g = torch.Generator().manual_seed(9)
    f, d = 96, 64
    wg, wu = (torch.randn(f, d, generator=g) / 8).to(dtype), (torch.randn(f, d, generator=g) / 8).to(dtype)
    wd = (torch.randn(d, f, generator=g) / 10).to(dtype)
    x, r = torch.randn(d, generator=g).to(dtype), torch.randn(d, generator=g).to(dtype)
    block = native.gated_mlp if dtype == torch.float32 else native.gated_mlp_bf16
    want = torch.add(block(x.view(1, d), wg, wu, wd, "silu").view(d), r)
    y, h = x.clone(), torch.empty(f, dtype=dtype)  # the result over the input: read before the down product
    fn = lib.hf_gated_mlp_res if dtype == torch.float32 else lib.hf_gated_mlp_bf16_res
    fn(y.data_ptr(), wg.data_ptr(), wu.data_ptr(), wd.data_ptr(), h.data_ptr(), r.data_ptr(), y.data_ptr(), f, d,
       native.ACT_CODES["silu"], 2)
    assert torch.equal(y, want)


@pytest.mark.parametrize("name, dtype, fused", [("gpt2-tiny", torch.float32, 4), ("llama-tiny", torch.float32, 2),
                                               ("gpt2-tiny", BF, 4), ("llama-tiny", BF, 2)])
def test_one_token_program_moves_products_to_their_residual_adds_with_the_same_logits(name, dtype, fused,
                                                                                     monkeypatch):
    """A one-token forward's residual adds ride on the native product before them: GPT-2's two per layer (split-K
    Conv1D products), Llama's gated MLP down product (its attention output product is an ``[N, K]`` one, taken
    only where the add's slice is apart from its input: not in these programs). The logits are bit for bit those
    of the program that adds separately (HETFORGE_RESIDUAL_FUSION=0)."""
    _lib()
    from hetforge.compile import compile_graph
    from hetforge.frontend import capture
    from hetforge.models.zoo import example_inputs, load_model

    loaded = load_model(name, dtype=dtype)
    module = loaded.logits_module().eval()
    inputs = example_inputs(loaded, seq=1, seed=1)
    cg = capture(module, inputs, name=name)
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name).executable
    assert exe.stats.native_residual == fused
    assert any(getattr(v, "__name__", "").endswith("_res") for v in exe._globals.values())
    monkeypatch.setenv("HETFORGE_RESIDUAL_FUSION", "0")
    apart = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name + "-apart").executable
    assert apart.stats.native_residual == 0
    with torch.no_grad():
        got, want = exe(*inputs), apart(*inputs)
        assert torch.equal(got, want)
        assert torch.equal(exe(*inputs), got)  # and again: nothing the first call wrote is read stale
