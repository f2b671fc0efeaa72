"""The native panel GEMM (a short prompt's fp32 products): numerics against a float64 product for both weight
layouts with tails in every dimension, the same bits whatever the thread count and on the plain C path as on the
vector one, the rule that sends a short prompt's products to it, the executor's use of it (KL ≤ 1e-8 against eager),
and packed copies shared by the programs of several prompt lengths. Its speed is measured by bench/panel_gemm.py,
not here."""

from __future__ import annotations

import ctypes
import functools
import mmap
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from epilogue_ref import ACTS, EXACT, aten_after
from hypothesis import given, settings
from hypothesis import strategies as st

from hetforge.compile import compile_graph
from hetforge.executor import onednn as onednn_exec
from hetforge.frontend import capture
from hetforge.kernels import native, onednn
from hetforge.models.zoo import example_inputs, load_model
from hetforge.verify import verify

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="the native kernels are not built on this machine (no C compiler, or "
                                       "HETFORGE_NATIVE=0): the panel GEMM is part of them, and products run on "
                                       "torch's kernels instead")
needs_simd = pytest.mark.skipif(not native.panel_available(),
                                reason="the native library has no vector path here (AVX-512, or AVX2 with FMA), "
                                       "so lowering never picks the panel GEMM (its plain C path is still tested)")


def _case(m: int, k: int, n: int, weight_t: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn((k, n) if weight_t else (n, k), generator=g)
    return torch.randn(m, k, generator=g), w, torch.randn(n, generator=g)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 140), k=st.integers(1, 130), n=st.integers(1, 150), weight_t=st.booleans(),
       with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_panel_gemm_matches_a_float64_product_for_both_layouts_and_any_tail(m, k, n, weight_t, with_bias, seed):
    x, w, b = _case(m, k, n, weight_t, seed)
    b = b if with_bias else None
    packed = native.pack_panels(w, weight_t)
    assert packed.numel() == -(-n // native.PANEL_NB) * native.PANEL_NB * k
    got = native.gemm_panel(x, packed, b, n)
    ref = F.linear(x.double(), (w.t() if weight_t else w).double(), None if b is None else b.double())
    assert got.shape == (m, n)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6 * (k + 1) ** 0.5 * 4)
    assert torch.equal(native.gemm_panel(x, packed, b, n, threads=1), got)  # no dependence on the thread count


@pytest.mark.parametrize("k", [256, 517, 768, 1024, 3072])
def test_panel_gemm_sums_every_k_row_when_its_streams_are_skewed_apart(k):
    """From k = 256 the k-rows per stream are raised so the four streams start apart in L1 (native.c's panel_q;
    k = 768, 1024 and 3072 would otherwise give a multiple of 64 rows per stream): the last stream is then shorter
    and every k-row must still be summed exactly once, at the row counts of every code path (one or two row groups,
    three and more, a row block past the 128-row scratch)."""
    for m in (5, 16, 48, 130):
        x, w, b = _case(m, k, 72, False, k + m)
        packed = native.pack_panels(w)
        got = native.gemm_panel(x, packed, b, 72)
        ref = F.linear(x.double(), w.double(), b.double())
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6 * (k + 1) ** 0.5 * 4)
        assert torch.equal(native.gemm_panel(x, packed, b, 72, threads=1), got)


def test_panel_gemm_keeps_the_leading_dimensions_and_refuses_what_does_not_fit():
    x, w, b = _case(24, 64, 100, False, 0)
    packed = native.pack_panels(w)
    y = native.gemm_panel(x.view(2, 12, 64), packed, b, 100)
    assert y.shape == (2, 12, 100) and torch.equal(y.view(24, 100), native.gemm_panel(x, packed, b, 100))
    with pytest.raises(ValueError, match="does not fit"):
        native.gemm_panel(x[:, :63].contiguous(), packed, b, 100)
    with pytest.raises(ValueError, match="does not fit"):
        native.gemm_panel(x.t().contiguous().t(), packed, b, 100)  # a strided input would be misread
    with pytest.raises(ValueError, match="float32"):
        native.pack_panels(w.to(torch.bfloat16))


def test_panel_gemm_with_no_k_rows_gives_the_bias_in_every_row():
    """K = 0: no products, so every row is the bias (zeros without one), not whatever the output memory held."""
    w, b, x = torch.zeros(50, 0), torch.randn(50), torch.zeros(3, 0)
    packed = native.pack_panels(w)
    assert torch.equal(native.gemm_panel(x, packed, b, 50), b.expand(3, 50))
    assert torch.equal(native.gemm_panel(x, packed, None, 50), torch.zeros(3, 50))


@functools.cache
def _plain_library(tmp: str):
    """native.c built without ``-march=native`` (the plain C path), loaded beside the real library."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = f"{tmp}/plain.so"
    err = native._build(cc, native.FLAG_SETS[1], Path(out))
    assert err is None, err
    lib = ctypes.CDLL(out)
    for name, argtypes in native.SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, native.RESTYPES.get(name)
    return lib


@needs_simd
def test_the_plain_c_path_gives_the_same_bits_as_the_vector_path(tmp_path_factory):
    """Each output is one chain of fused multiply-adds from the bias in K order on both paths (fmaf in C)."""
    lib = _plain_library(str(tmp_path_factory.mktemp("plain")))
    if lib is None:
        # the comparison needs a second build of native.c without -march=native; the library this run loaded
        # (e.g. from the kernel cache) is still checked by every other test in this file
        pytest.skip("no C compiler (cc or gcc) on PATH to build the plain, non-AVX-512 copy of the native kernels "
                    "that this test compares against; the loaded kernels are tested by the other tests here")
    assert lib.hf_panel_simd() == 0
    # (141, 517, 97): two row blocks of the 128-row scratch (128 + 13), five k-blocks, a k tail and a
    # partial last panel
    for m, k, n, weight_t in [(16, 96, 100, False), (19, 70, 48, True), (3, 5, 7, False), (141, 517, 97, False)]:
        x, w, b = _case(m, k, n, weight_t, m)
        packed = native.pack_panels(w, weight_t)
        plain_packed = torch.empty_like(packed)
        lib.hf_pack_panels(w.data_ptr(), plain_packed.data_ptr(), n, k, int(weight_t), 2)
        assert torch.equal(plain_packed, packed)
        y = torch.empty(m, n)
        rc = lib.hf_gemm_panel(x.data_ptr(), packed.data_ptr(), b.data_ptr(), y.data_ptr(), m, n, k, 2, 0, None, None)
        assert rc == 0
        assert torch.equal(y, native.gemm_panel(x, packed, b, n))
        if not weight_t:  # the gated call (gate = this weight, up = its negation; the plain build's epilogue has
            # no activation)
            up = native.pack_panels(-w)
            rc = lib.hf_gemm_panel_gated(x.data_ptr(), packed.data_ptr(), up.data_ptr(), b.data_ptr(), None,
                                         y.data_ptr(), m, n, k, 2, 0, None)
            assert rc == 0
            assert torch.equal(y, native.gemm_panel_gated(x, packed, up, b, None, n, "none"))


@needs_simd
def test_a_short_prompts_fp32_products_take_the_panel_gemm_by_rule(monkeypatch):
    monkeypatch.delenv("HETFORGE_GEMM", raising=False)
    lo, hi = native.PANEL_MIN, native.PANEL_MAX
    assert 2 < lo <= native.FEW_MAX < hi  # the few-row kernels keep only the rows below lo
    before = len(onednn.measured_choices())
    for rows in (lo, hi):
        assert onednn.pick(rows, 96, 112, torch.float32) == "panel" and onednn.choose(rows, 96, 112, torch.float32)
        assert onednn.decided(rows, 96, 112, torch.float32) is True
    assert len(onednn.measured_choices()) == before  # a rule: nothing timed
    assert onednn.pick(hi + 1, 96, 112, torch.float32) != "panel"
    assert onednn.pick(lo, 96, 112, torch.bfloat16) != "panel"
    monkeypatch.setenv("HETFORGE_GEMM", "panel")
    assert onednn.pick(hi + 100, 96, 112, torch.float32) == "panel"
    monkeypatch.setenv("HETFORGE_GEMM", "mkl")
    assert onednn.pick(lo, 96, 112, torch.float32) != "panel"


@functools.cache
def _loaded(name: str):
    return load_model(name)


@functools.cache
def _captured(name: str, seq: int):
    """(module, inputs, capture) of zoo model ``name`` at [1, seq]; one loaded model (one set of weights) per name."""
    loaded = _loaded(name)
    inputs = example_inputs(loaded, seq=seq)
    module = loaded.logits_module()
    return module, inputs, capture(module, inputs, name=name)


@needs_simd
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "qwen2-tiny"])
def test_executor_runs_a_short_prompts_linears_on_the_panel_gemm_within_kl_1e8(name, monkeypatch):
    """A 24-token prefill (or the most rows the panel GEMM takes by rule where that is fewer: 16 on an AVX2 build):
    every multi-row product on the panel GEMM (activation, gated MLP product and residual add in place after it),
    KL ≤ 1e-8 against eager, the same top-1, and results that survive the next call."""
    monkeypatch.delenv("HETFORGE_GEMM", raising=False)
    module, inputs, cg = _captured(name, min(24, native.PANEL_MAX))
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name).executable
    assert exe.stats.panel_gemm > 0 and exe.stats.mkl_gemm == exe.stats.onednn_gemm == 0
    rep = verify(module, exe, inputs, kl_threshold=1e-8)
    assert rep.passed and rep.top1_agree == 1.0, rep
    first = exe(*inputs).clone()
    exe(*inputs)
    torch.testing.assert_close(exe(*inputs), first, rtol=0, atol=0)


def test_panel_gemm_multi_gives_each_product_the_bits_of_its_own_call():
    """One call for several weights of one input (X packed once, their panels split between the threads as one
    list): each result has gemm_panel's bits for that weight alone, whatever the thread count, also with a weight
    of no outputs, partial last panels, a K tail and more rows than one 128-row block."""
    for m, k, ns in [(24, 96, [96, 96, 96]), (17, 70, [100, 5, 48, 49]), (141, 517, [97, 30]), (9, 40, [0, 50])]:
        g = torch.Generator().manual_seed(m + k)
        x = torch.randn(m, k, generator=g)
        packs = [native.pack_panels(torch.randn(n, k, generator=g)) for n in ns]
        biases = [torch.randn(n, generator=g) if i % 2 == 0 else None for i, n in enumerate(ns)]
        got = native.gemm_panel_multi(x, packs, biases, ns)
        assert [tuple(y.shape) for y in got] == [(m, n) for n in ns]
        for y, pk, b, n in zip(got, packs, biases, ns, strict=True):
            assert torch.equal(y, native.gemm_panel(x, pk, b, n))
        for y, y1 in zip(got, native.gemm_panel_multi(x, packs, biases, ns, threads=1), strict=True):
            assert torch.equal(y, y1)
    with pytest.raises(ValueError, match="1..4 weights"):
        native.gemm_panel_multi(x, packs * 3, biases * 3, ns * 3)  # six weights
    with pytest.raises(ValueError, match="does not fit"):
        native.gemm_panel_multi(x[:, :-1].contiguous(), packs, biases, ns)


@pytest.mark.parametrize("m,k,n,bias,res", [(128, 96, 100, False, False), (17, 70, 48, True, True),
                                             (141, 517, 97, True, False), (3, 5, 7, False, True),
                                             (4, 0, 9, True, True)])
def test_gated_call_gives_the_bits_of_the_gate_call_then_the_up_call_with_its_result_as_mul(m, k, n, bias, res):
    """A gated MLP's gate and up products as one call: bit-equal to gemm_panel(gate, act) followed by
    gemm_panel(up, mul=that, res) for every activation the epilogue has, whatever the thread count, also with
    biases, a residual, partial panels, a K tail, more rows than one 128-row block and no k-rows at all."""
    g = torch.Generator().manual_seed(m * 7 + k)
    x = torch.randn(m, k, generator=g)
    pg, pu = (native.pack_panels(torch.randn(n, k, generator=g)) for _ in range(2))
    bg, bu = (torch.randn(n, generator=g) if bias else None for _ in range(2))
    r = torch.randn(m, n, generator=g) if res else None
    acts = [a for a in ACTS if native.epilogue_act(a)]
    assert "none" in acts
    for act in acts:
        ref = native.gemm_panel(x, pu, bu, n, mul=native.gemm_panel(x, pg, bg, n, act=act), res=r)
        for threads in (1, 2, 3):
            assert torch.equal(native.gemm_panel_gated(x, pg, pu, bg, bu, n, act, res=r, threads=threads), ref)
    with pytest.raises(ValueError, match="does not fit"):
        native.gemm_panel_gated(torch.randn(m, k + 1), pg, pu, bg, bu, n, "none")  # not the packed K


def _llama_tiny_with_and_without(monkeypatch, env: str) -> tuple:
    """llama-tiny's 24-token forward (fewer where the panel GEMM's rule stops below 24 rows: as in
    test_executor_runs_a_short_prompts_linears_on_the_panel_gemm_within_kl_1e8) compiled with the executor switch
    ``env`` at "0" and at "1" (the default kernel choice otherwise): (module, inputs, program with 0, program with
    1)."""
    monkeypatch.delenv("HETFORGE_GEMM", raising=False)
    module, inputs, cg = _captured("llama-tiny", min(24, native.PANEL_MAX))
    exes = []
    for value in ("0", "1"):
        monkeypatch.setenv(env, value)
        exes.append(compile_graph(cg.gm, soc="host", example_inputs=inputs, name=f"{env}-{value}").executable)
    return module, inputs, *exes


def test_a_gated_mlps_gate_and_up_products_run_as_one_panel_call_with_the_same_bits(monkeypatch):
    """Where the panel GEMM runs a Llama-style MLP (silu gate times up, then down), each layer's gate and up products
    are one gemm_panel_gated call (none where it does not run), and the logits are bit-equal to the program with
    two calls (HETFORGE_PANEL_GATED=0)."""
    module, inputs, apart, fused = _llama_tiny_with_and_without(monkeypatch, onednn_exec.PANEL_GATED_ENV)
    layers = _loaded("llama-tiny").model.config.num_hidden_layers
    panel = native.panel_available() and native.epilogue_act("silu")

    def gated_calls(exe) -> int:
        names = [k for k, v in exe._globals.items() if v is native.gemm_panel_gated]
        return sum(exe.source.count(f"{k}(") for k in names)

    assert gated_calls(fused) == (layers if panel else 0) and gated_calls(apart) == 0
    assert torch.equal(fused(*inputs), apart(*inputs))
    assert verify(module, fused, inputs, kl_threshold=1e-8).passed


def test_a_layers_q_k_v_products_run_as_one_panel_call_with_the_same_bits(monkeypatch):
    """Llama-style q, k and v projections of one input (three weights) run as one gemm_panel_multi call per layer
    where the panel GEMM runs (none are grouped where it does not), and the program's logits are bit-equal to the
    program with each product on its own call."""
    module, inputs, apart, grouped = _llama_tiny_with_and_without(monkeypatch, onednn_exec.PANEL_MULTI_ENV)
    layers = _loaded("llama-tiny").model.config.num_hidden_layers if native.panel_available() else 0
    assert apart.stats.panel_groups == 0 and grouped.stats.panel_groups == layers  # one group (q, k, v) a layer
    assert grouped.stats.panel_gemm == apart.stats.panel_gemm
    assert torch.equal(grouped(*inputs), apart(*inputs))
    assert verify(module, grouped, inputs, kl_threshold=1e-8).passed


@needs_simd
def test_programs_of_two_prompt_lengths_share_one_packed_copy_per_weight(monkeypatch):
    """Packed copies are keyed by the weight's memory, not the tensor object: each prompt length's program holds its
    own tensor objects over the model's weights, and must not pack them again (one more model of memory each)."""
    monkeypatch.delenv("HETFORGE_GEMM", raising=False)
    made = []
    real = onednn._reorder
    monkeypatch.setattr(onednn, "_reorder", lambda w, t, r, k="onednn": made.append(k) or real(w, t, r, k))
    exes = []
    loaded = load_model("gpt2-tiny")  # its own weights: packings other tests made of theirs may still be alive (a
    for seq in (native.PANEL_MIN, native.PANEL_MIN + 8):  # program in a reference cycle dies at the next collection)
        inputs = example_inputs(loaded, seq=seq)
        module = loaded.logits_module()
        cg = capture(module, inputs, name="gpt2-tiny")
        exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=f"share-{seq}").executable
        assert exe.prepack() > 0
        exes.append((exe, module, inputs))
    lazy = [v for exe, _, _ in exes for v in exe._globals.values() if isinstance(v, onednn.LazyPacked)]
    objects, copies = {id(v.w) for v in lazy}, {id(v.get()) for v in lazy}
    assert len(objects) > len(copies) and made == ["panel"] * len(copies)  # several objects, one copy a weight
    for exe, module, inputs in exes:
        assert verify(module, exe, inputs, kl_threshold=1e-8).passed


def test_an_in_place_write_to_a_weight_is_never_served_its_old_packing():
    w = torch.randn(64, 32)
    kind = "panel" if native.panel_available() else "onednn"
    first = onednn.packed_weight(w, False, 16, kind)
    assert onednn.packed_weight(w.view(64, 32), False, 16, kind) is first  # the same memory: the same copy
    w.mul_(2.0)
    again = onednn.packed_weight(w, False, 16, kind)
    assert again is not first
    x = torch.randn(16, 32)
    got = native.gemm_panel(x, again, None, 64) if kind == "panel" else onednn.linear_fn(again, None)(x)
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-5)


def test_an_inference_tensor_weight_packs_too():
    """Weights made under ``torch.inference_mode`` have no version counter: still one packing per weight."""
    with torch.inference_mode():
        w = torch.randn(48, 16)
    kind = "panel" if native.panel_available() else "onednn"
    assert onednn.packed_weight(w, False, 16, kind) is onednn.packed_weight(w.view(48, 16), False, 16, kind)


def _child_products(w: torch.Tensor, x: torch.Tensor, out) -> None:
    torch.set_num_threads(2)  # as many as the parent: the kernels must not start a team the fork broke
    out.put(native.gemm_panel(x, native.pack_panels(w), None, w.shape[0]).tolist())


def test_the_panel_gemm_runs_in_a_forked_child_after_the_parent_used_the_team():
    """libgomp's team does not survive fork(): a two-thread region in the child of a parent that had started it
    hangs. The native library's team kernels run every chunk on the calling thread in a forked child instead
    (the same chunks, so the same bits)."""
    import multiprocessing as mp

    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(200, 64, generator=g), torch.randn(20, 64, generator=g)
    want = native.gemm_panel(x, native.pack_panels(w, threads=2), None, 200, threads=2)  # the parent's team runs
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_products, args=(w, x, out))
    child.start()
    try:
        got = out.get(timeout=60)
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    assert torch.equal(torch.tensor(got), want)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 140), k=st.integers(1, 100), n=st.integers(1, 120), act=st.sampled_from(ACTS),
       with_mul=st.booleans(), with_res=st.booleans(),
    seed=st.integers(0, 2**16))
def test_panel_epilogue_matches_atens_ops_after_the_product(m, k, n, act, with_mul, with_res, seed):
    """act → × mul → + res in the panel GEMM's store equals ATen's in-place ops on the plain product: bit for bit
    without an activation (or with relu, or gelu, which runs as ATen's op after the kernel), within a few fp32 ulp
    for the kernel's own tanh GELU and SiLU."""
    x, w, b = _case(m, k, n, False, seed)
    g = torch.Generator().manual_seed(seed + 1)
    mul = torch.randn(m, n, generator=g) if with_mul else None
    res = torch.randn(m, n, generator=g) if with_res else None
    packed = native.pack_panels(w)
    ref = aten_after(native.gemm_panel(x, packed, b, n), act, mul, res)
    got = native.gemm_panel(x, packed, b, n, act=act, mul=mul, res=res)
    if act in EXACT:
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, rtol=4e-6, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 70000), act=st.sampled_from(ACTS),
       with_mul=st.booleans(), seed=st.integers(0, 2**16))
def test_act_inplace_matches_atens_activation_then_mul(n, act, with_mul, seed):
    """native.act_inplace (MKL's products' activation and a gated MLP's gate): ATen's in-place ops bit for bit
    where it defers to them (erf GELU) or the op is exact (relu, × mul alone), within a few fp32 ulp for the
    vectorized tanh GELU and SiLU; a strided tensor takes ATen's ops."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n, generator=g) * 6
    mul = torch.randn(n, generator=g) if with_mul else None
    want = aten_after(y.clone(), act, mul)
    got = native.act_inplace(y, act, mul)
    assert got is y
    if act in EXACT:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-6)
    base = torch.randn(2 * max(n, 2), generator=g)  # two elements at least: one element counts as contiguous
    strided, ref = base[::2], base.clone()[::2]  # the same layout: ATen's strided path rounds as it does here
    assert not strided.is_contiguous()
    native.act_inplace(strided, "gelu_tanh")
    assert torch.equal(strided, torch.ops.aten.gelu_(ref, approximate="tanh"))


def test_many_panels_split_between_threads_give_the_same_bits_as_one_thread():
    """43 panels (N = 2048) split into near-equal ranges for 2 and 3 threads: the float64 product within fp32
    rounding, and the same bits as one thread (each output is one fixed chain whatever range holds its panel)."""
    x, w, b = _case(20, 96, 2048, False, 3)
    packed = native.pack_panels(w)
    one = native.gemm_panel(x, packed, b, 2048, threads=1)
    torch.testing.assert_close(one.double(), F.linear(x.double(), w.double(), b.double()), rtol=0, atol=1e-4)
    for t in (2, 3):
        assert torch.equal(native.gemm_panel(x, packed, b, 2048, threads=t), one)


@pytest.mark.parametrize("m", [64, 100, 200])
def test_leftover_panels_split_by_rows_between_threads_give_the_same_bits_as_one_thread(m):
    """Enough rows for row slices (64 and more for two threads): 43 panels (N = 2048) run as 40 in runs of 4 and
    the 3 left over in row slices (for 3 threads: 36 and 7), plain and gated, with 100 rows (a partial row group)
    and 200 (two row blocks of the kernel); every output the same bits as one thread. The activation is SiLU where
    the build's epilogue has it (AVX-512), else none (the plain C path's gated kernel takes no other)."""
    act = "silu" if native.epilogue_act("silu") else "none"
    ref = F.silu if act == "silu" else (lambda t: t)
    x, w, b = _case(m, 96, 2048, False, 5)
    _, u, bu = _case(m, 96, 2048, False, 6)
    packed, up = native.pack_panels(w), native.pack_panels(u)
    res = torch.randn(m, 2048, generator=torch.Generator().manual_seed(7))
    one = native.gemm_panel(x, packed, b, 2048, threads=1, act=act, res=res)
    gated = native.gemm_panel_gated(x, packed, up, b, bu, 2048, act, res=res, threads=1)
    torch.testing.assert_close(one.double(), ref(F.linear(x.double(), w.double(), b.double())) + res.double(),
                               rtol=0, atol=1e-4)
    for t in (2, 3):
        assert torch.equal(native.gemm_panel(x, packed, b, 2048, threads=t, act=act, res=res), one)
        assert torch.equal(native.gemm_panel_gated(x, packed, up, b, bu, 2048, act, res=res, threads=t), gated)


def _vm_flags(addr: int) -> set[str]:
    """The VmFlags of the mapping of this process holding ``addr`` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    return set()


def _advice_taken() -> bool:
    """Whether this OS takes MADV_HUGEPAGE on a fresh anonymous mapping (what huge_empty asks for)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    mm = mmap.mmap(-1, native.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(advice)
        return True
    except OSError:
        return False
    finally:
        mm.close()


def test_packed_panels_live_on_memory_advised_for_huge_pages_where_the_os_takes_the_advice(monkeypatch):
    """pack_panels' buffer (huge_empty): where the OS takes MADV_HUGEPAGE, it starts on a 2 MiB boundary of a mapping
    the kernel marks as advised (VmFlags ``hg``, read where /proc/self/smaps exists); where the OS refuses, it is a
    plain tensor. Either way it holds what was packed after the mapping's Python object is gone, and memory below
    one huge page or with HETFORGE_HUGE_PAGES=0 is not advised."""
    smaps = Path("/proc/self/smaps").exists()

    def advised(t: torch.Tensor) -> bool:
        return "hg" in _vm_flags(t.data_ptr())

    monkeypatch.setenv("HETFORGE_HUGE_PAGES", "1")  # asked for whatever earlier packings measured
    w = torch.randn(3000, 512)  # 64 panels x 512 x 48 floats = 6 MiB
    packed = native.pack_panels(w)
    if _advice_taken():
        assert packed.data_ptr() % native.HUGE_PAGE == 0
        assert not smaps or advised(packed)
    else:
        assert not smaps or not advised(packed)  # the fallback: torch.empty
    x = torch.randn(5, 512)
    torch.testing.assert_close(native.gemm_panel(x, packed, None, 3000), x @ w.t(), rtol=1e-5, atol=1e-4)
    small = native.huge_empty(1000)
    assert small.numel() == 1000 and (not smaps or not advised(small))
    monkeypatch.setenv("HETFORGE_HUGE_PAGES", "0")
    plain = native.huge_empty(4 << 20)
    assert plain.numel() == 4 << 20 and (not smaps or not advised(plain))


def test_packing_stops_asking_for_huge_pages_once_they_prove_slower_than_the_rate_ordinary_pages_ran_at(monkeypatch):
    """By default pack_panels asks for huge pages until the process's packings onto them, summed over at least
    HUGE_JUDGE_BYTES, ran below HUGE_MIN_RATE; from then on its buffers are ordinary memory (not advised), with the
    same packed values. A rate no packing can miss keeps asking."""
    check_flags = _advice_taken() and Path("/proc/self/smaps").exists()
    monkeypatch.delenv("HETFORGE_HUGE_PAGES", raising=False)
    w = torch.randn(3000, 512)  # 6 MiB packed
    monkeypatch.setattr(native, "_huge_packing", {"bytes": 0, "seconds": 0.0, "slow": False})
    monkeypatch.setattr(native, "HUGE_JUDGE_BYTES", 4 << 20)
    monkeypatch.setattr(native, "HUGE_MIN_RATE", 0.0)  # never too slow
    for _ in range(2):
        p = native.pack_panels(w)
        assert not check_flags or "hg" in _vm_flags(p.data_ptr())
    assert native.huge_pages_wanted() and native._huge_packing["bytes"] == 2 * p.numel() * 4
    monkeypatch.setattr(native, "HUGE_MIN_RATE", 1e30)  # always too slow: judged after this packing
    first = native.pack_panels(w)
    assert native._huge_packing["slow"] and not native.huge_pages_wanted()
    later = native.pack_panels(w)
    assert not check_flags or "hg" not in _vm_flags(later.data_ptr())
    assert torch.equal(first, later) and torch.equal(first, p)
    monkeypatch.setenv("HETFORGE_HUGE_PAGES", "1")  # forced on whatever was measured
    assert native.huge_pages_wanted()
