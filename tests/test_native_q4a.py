"""hf_gemv_q4a / hf_gemm_q4a: hetforge's group-wise int4 weights (ATen's packed layout, read in place) × int8
activation blocks of 32, against a torch reference of the same arithmetic on every compiled path; the ``--w4-act``
mode that selects them (bad value: one line, exit 2); the compiled w4 programs that run them, and their fidelity."""

from __future__ import annotations

import math

import pytest
import torch
from test_native import needs_cc
from typer.testing import CliRunner

from hetforge.errors import UsageError
from hetforge.kernels import native
from hetforge.ops.quant import INT4_GROUP_SIZES, _act, dequantize_w4, w4_native_fits, w4_weight_fits
from hetforge.quant.schemes import dequantize_int4, pack_int4, quantize_int4

pytestmark = needs_cc


@pytest.fixture(autouse=True)
def _q4_host(monkeypatch):
    """These tests run the kernels: they need the library and its VNNI or AVX2 path (the portable path is compared
    with it; on hosts with neither w4 stays on ATen's kernels, which test_quant.py covers)."""
    if native.library() is None:
        pytest.skip(f"native C kernels not built on this host ({native.status().reason})")
    # A CPU or compiler with neither AVX512-VNNI+VBMI nor AVX2+FMA builds only the plain C path, which w4 never
    # runs there (q4_kernel returns None): nothing these tests compare is in use; ATen's path is test_quant.py's.
    if native.q4a_path() == "portable":
        pytest.skip("this CPU/compiler has neither AVX512-VNNI+VBMI nor AVX2+FMA, so hetforge never runs its int4 "
                    "kernels here (w4 uses ATen's int4 path, tested in test_quant.py)")
    monkeypatch.delenv("HETFORGE_W4_ACT", raising=False)


def _case(m: int, n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 7919 + m * 131 + n * 17 + k + group)
    w = torch.randn(n, k, generator=g)
    q, s = quantize_int4(w, group)
    packed, sz = pack_int4(q, s)
    return q, s, packed, sz, torch.randn(m, k, generator=g), torch.randn(n, generator=g)


def _reference(q: torch.Tensor, s: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None, group: int,
               act: str = "none") -> torch.Tensor:
    """The kernels' arithmetic in torch: x per block of 32 (amax/127, round half even), exact int block sums
    Σ q·x_q, then acc = acc + (d_b·s[n, g])·sum_b in fp32 (three roundings), blocks in order; (+ bias), act."""
    m, k = x.shape
    n, nb = q.shape[0], k // 32
    xb = x.reshape(m, nb, 32)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    xq = torch.round(xb * inv[..., None]).clamp(-127, 127)
    dots = torch.einsum("mbi,nbi->mnb", xq.double(), q.double().reshape(n, nb, 32)).float()  # exact integers
    sb = s.repeat_interleave(group // 32, dim=1)  # [n, nb]
    acc = torch.zeros(m, n)
    for blk in range(nb):
        acc = acc + (d[:, blk:blk + 1] * sb[None, :, blk]) * dots[:, :, blk]
    return _act(acc + b if b is not None else acc, act)


def _run(packed, sz, x, b, group, act="none", path=None, threads=None):
    saved = torch.get_num_threads()
    if path is not None:
        native.q4a_path(path)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return native.q4a(x, packed, sz, group, b, act)
    finally:
        native.q4a_path(None)
        torch.set_num_threads(saved)


@pytest.mark.parametrize("group", INT4_GROUP_SIZES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 64, 256), (1, 192, 512), (2, 64, 768), (5, 128, 256),
                                           (7, 192, 512), (13, 64, 1024), (16, 256, 256)])
def test_q4a_equals_the_reference_bit_for_bit_on_every_path(m, n, k, group):
    assert k % group == 0  # every K above is a multiple of every group size
    q, s, packed, sz, x, b = _case(m, n, k, group)
    want = _reference(q, s, x, b, group)
    best = _run(packed, sz, x, b, group)  # the VNNI or AVX2 path, whichever this build has
    assert torch.equal(best, want)
    assert torch.equal(_run(packed, sz, x, b, group, path="portable"), best)  # plain C: the same bits
    assert torch.equal(_run(packed, sz, x, b, group, threads=1), best)  # any thread count
    if m > 1:  # row r of a prefill has the bits of a decode step on row r
        rows = torch.cat([_run(packed, sz, x[r:r + 1].clone(), b, group) for r in range(m)])
        assert torch.equal(rows, best)


@pytest.mark.parametrize(("m", "blocks", "k", "group"), [(1, 3, 512, 32), (9, 3, 768, 256), (4, 5, 1024, 128)])
def test_q4a_reads_an_odd_number_of_row_blocks_of_its_build(m, blocks, k, group):
    """N an odd multiple of the build's row block (32 on AVX2 builds, 64 on VNNI ones): every block read where
    it sits, and the weight fits the kernels (w4_weight_fits checks the layout against ATen's kernel)."""
    n = blocks * native.q4_row_block()
    q, s, packed, sz, x, b = _case(m, n, k, group, seed=6)
    assert w4_weight_fits(packed, sz, group)
    got = _run(packed, sz, x, b, group)
    assert torch.equal(got, _reference(q, s, x, b, group))
    assert torch.equal(_run(packed, sz, x, b, group, path="portable"), got)


@pytest.mark.parametrize("act", ["relu", "silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("m", [1, 6])
def test_q4a_activations_and_no_bias(act, m):
    q, s, packed, sz, x, _ = _case(m, 128, 256, 64, seed=1)
    got = _run(packed, sz, x, None, 64, act)
    want = _reference(q, s, x, None, 64, act)
    if act == "relu" or (m > 1 and act == "gelu"):  # C's relu; several rows: ATen's in-place erf GELU after C
        assert torch.equal(got, want)
    else:  # one row: libm's erff/tanhf/expf in C; several rows: the vectorized tanh GELU / SiLU (act_inplace)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_q4a_is_close_to_the_dequantized_float_product():
    """Quantizing x per block of 32 costs about 1/127 of each block's range: well under 1% relative."""
    q, s, packed, sz, x, b = _case(9, 256, 768, 128, seed=2)
    want = torch.nn.functional.linear(x, dequantize_int4(q, s), b)
    rel = float((_run(packed, sz, x, b, 128) - want).norm() / want.norm())
    assert 1e-5 < rel < 0.01, rel


def test_a_nan_input_block_makes_its_row_nan_and_leaves_the_others():
    q, s, packed, sz, x, b = _case(4, 64, 256, 32, seed=3)
    x[2, 40] = float("nan")
    y = _run(packed, sz, x, b, 32)
    assert torch.isnan(y[2]).all() and not torch.isnan(y[[0, 1, 3]]).any()


def test_the_kernels_refuse_shapes_outside_them():
    _, _, packed, sz, x, _ = _case(1, 64, 256, 64)
    lib = native.library()
    y = torch.empty(1, 48)
    rc = lib.hf_gemv_q4a(packed.data_ptr(), sz.data_ptr(), x.data_ptr(), None, y.data_ptr(), 48, 256, 64, 0, 1)
    assert rc == -2
    with pytest.raises(ValueError, match="shape outside"):
        native.check_q4_rc(rc)


def test_weights_the_kernels_cannot_read_keep_the_aten_path():
    """N not a multiple of the kernels' row block (64 or 32), or nonzero zeros: w4_weight_fits says no and
    linear_w4 computes what ATen does."""
    q, s, packed, sz, x, b = _case(3, 48, 256, 64, seed=4)
    assert not w4_weight_fits(packed, sz, 64)
    want = torch.nn.functional.linear(x, dequantize_w4(packed, sz, 64), b)
    torch.testing.assert_close(torch.ops.hetforge.linear_w4(x, packed, sz, 64, b), want, rtol=1e-5, atol=1e-5)
    _, _, packed, sz, x, b = _case(3, 64, 256, 64, seed=4)
    assert w4_weight_fits(packed, sz, 64) and w4_native_fits(x, packed, sz, 64, b, "none")
    sz2 = sz.clone()
    sz2[..., 1] = 0.01  # an asymmetric (zero-point) weight: not hetforge's int4, not these kernels' arithmetic
    assert not w4_weight_fits(packed, sz2, 64)
    assert not w4_native_fits(x.double(), packed, sz, 64, b, "none")


def test_w4_act_mode_selects_the_kernels_and_refuses_unknown_values(monkeypatch):
    q, s, packed, sz, x, b = _case(8, 128, 512, 128, seed=5)
    x3 = x.view(2, 4, 512)
    assert native.w4_act_mode() == "q8"
    assert native.q4_kernel(1) == "hf_gemv_q4a" and native.q4_kernel(8) == "hf_gemm_q4a"
    got = torch.ops.hetforge.linear_w4(x3, packed, sz, 128, b, "none")
    assert got.shape == (2, 4, 128) and torch.equal(got.view(8, 128), _reference(q, s, x, b, 128))
    assert torch.equal(torch.ops.hetforge.linear_w4(x[:1], packed, sz, 128, b), _reference(q, s, x[:1], b, 128))
    for mode in ("weight-only", "float"):  # float: weight-only's other name, as for --w8-act
        monkeypatch.setenv("HETFORGE_W4_ACT", mode)
        assert native.w4_act_mode() == "weight-only" and native.q4_kernel(1) is None and native.q4_kernel(8) is None
    want = torch.nn.functional.linear(x, dequantize_int4(q, s), b)
    torch.testing.assert_close(torch.ops.hetforge.linear_w4(x, packed, sz, 128, b), want, rtol=1e-5, atol=1e-5)
    one = torch.ops.aten._weight_int4pack_mm_for_cpu(x[:1], packed, 128, sz) + b
    assert torch.equal(torch.ops.hetforge.linear_w4(x[:1], packed, sz, 128, b), one)
    monkeypatch.setenv("HETFORGE_W4_ACT", "int4")
    with pytest.raises(UsageError, match="HETFORGE_W4_ACT"):
        native.w4_act_mode()


@pytest.mark.parametrize("scheme", ["w8", "w4"])
def test_cli_refuses_a_bad_activation_mode_with_one_line_and_exit_2(scheme):
    from hetforge.cli.common import app
    from hetforge.cli.main import _load_commands

    _load_commands()
    r = CliRunner().invoke(app, ["compile", "llama-tiny", "--quantize", scheme, f"--{scheme}-act", "int3"])
    assert r.exit_code == 2, r.output
    assert f"{scheme}-act" in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize(("scheme", "other"), [("w8", "none"), ("w4", "w8")])
def test_compile_cache_key_follows_the_activation_mode_of_its_scheme_only(monkeypatch, scheme, other):
    from hetforge.models.zoo import load_model
    from hetforge.runtime.compile_cache import key_document, key_of

    m = load_model("llama-tiny").model

    def key(quantize: str, mode: str) -> str:
        monkeypatch.setenv(f"HETFORGE_{scheme.upper()}_ACT", mode)
        return key_of(key_document(m, {"quantize": quantize}, True, "prefill", 32))

    assert key(scheme, "q8") != key(scheme, "weight-only")
    assert key(other, "q8") == key(other, "weight-only")  # no products of that scheme: the mode changes nothing


def _logits_module(name: str):
    from hetforge.models.zoo import load_model
    from hetforge.runtime.static_kv import PrefillModule

    m = load_model(name).model.eval()
    ids = torch.randint(0, 200, (1, 21), generator=torch.Generator().manual_seed(0))
    return m, PrefillModule(m), (ids, torch.tensor([20])), ids


def test_compiled_w4_prefill_records_and_runs_the_gemm_kernel(monkeypatch):
    """A compiled w4 prefill lowers every int4 product the kernels can read to ``native:hf_gemm_q4a`` (recorded
    on the instruction, priced by the cost model; the others keep the op) and its logits equal the eager op's;
    under weight-only none does. Fidelity against the float model is reported for both modes."""
    from hetforge.compile import compile_graph
    from hetforge.cost.instr import estimate_instr
    from hetforge.frontend import capture
    from hetforge.verify import compare_logits

    m, mod, inputs, ids = _logits_module("llama-tiny")
    cg = capture(mod, inputs)
    with torch.no_grad():
        ref = m(ids).logits[:, -1]

    def rows(ins, p):
        shape = p.values[ins.outputs[0]].shape
        return math.prod(shape) // shape[-1]

    kl = {}
    for mode in ("q8", "weight-only"):
        monkeypatch.setenv("HETFORGE_W4_ACT", mode)
        res = compile_graph(cg.gm, soc="host", example_inputs=inputs, quantize="w4", group_size=32)
        exe = res.executable
        w4 = [i for i in exe.program.instrs if i.op == "hetforge.linear_w4.default" and rows(i, exe.program) > 1]
        native_ones = [i for i in w4 if exe.kernels[i.id] == "native:hf_gemm_q4a"]
        if mode == "q8":  # q, o, gate, up, down per layer read by the kernels (k, v: N = 32, on 32-row block
            # builds only); the last layer's o, gate, up and down run on the selected row only (passes/rowprune.py),
            # its q on every row
            assert len(native_ones) >= 5 * (m.config.num_hidden_layers - 1) + 1
            assert all(i.attrs["kernel"] == "native:hf_gemm_q4a" for i in native_ones)
            cost = estimate_instr(native_ones[0], exe.program, res.soc.device(native_ones[0].device),
                                  set(res.memory.offsets))
            assert cost.time_s > 0 and cost.flops > 0
        else:
            assert w4 and not native_ones
        got = exe.run_flat(*inputs)[0].clone()
        want = res.gm(*inputs)
        want = want[0] if isinstance(want, (tuple, list)) else want
        torch.testing.assert_close(got, want.view_as(got), rtol=1e-5, atol=1e-5)
        kl[mode] = compare_logits(ref, got.view_as(ref)).kl_mean
    print(f"w4 vs float llama-tiny, KL mean (measured): q8 {kl['q8']:.2e}, weight-only {kl['weight-only']:.2e}")
    assert kl["q8"] < 3e-3 and kl["weight-only"] < 3e-3  # test_quant.py's w4 bound


def test_compiled_w4_decode_step_records_and_runs_the_gemv_kernel():
    """A compiled w4 decode step (one row over the KV cache) lowers every int4 product the kernels can read to
    ``native:hf_gemv_q4a`` (called from the generated code) and its outputs equal the eager graph's."""
    from test_runtime import _decode_graph

    from hetforge.compile import compile_graph

    cg, inputs, layers = _decode_graph("llama-tiny", 32, token=5, pos=20)
    res = compile_graph(cg.gm, soc="host", example_inputs=inputs, quantize="w4", group_size=32)
    exe = res.executable
    w4 = [i for i in exe.program.instrs if i.op == "hetforge.linear_w4.default"]
    native_ones = [i for i in w4 if exe.kernels[i.id] == "native:hf_gemv_q4a"]
    assert len(native_ones) >= 5 * layers  # q, o, gate, up, down per layer; k, v (N = 32): 32-row builds only
    assert all(i.attrs["kernel"] == "native:hf_gemv_q4a" for i in native_ones) and "hf_gemv_q4a" in exe.source
    got = [t.clone() for t in exe.run_flat(*inputs)]
    with torch.no_grad():
        want = res.gm(*inputs)
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b.view_as(a), rtol=1e-5, atol=1e-5)


def test_w4_gpt2_tiny_fidelity_q8_vs_weight_only_reported(monkeypatch):
    """gpt2-tiny's w4 graph (every product read by the kernels under q8) against the float model, under both
    activation modes: KL of the logits (measured, printed) within test_quant.py's w4 bound."""
    from hetforge.frontend import capture
    from hetforge.models.zoo import example_inputs, load_model
    from hetforge.quant import quantize_graph
    from hetforge.verify import compare_logits

    loaded = load_model("gpt2-tiny")
    inputs = example_inputs(loaded, seq=17)
    cg = capture(loaded.logits_module(), inputs, name="gpt2-tiny")
    ref = cg.gm(*inputs)
    kl = {}
    for mode in ("q8", "weight-only"):
        monkeypatch.setenv("HETFORGE_W4_ACT", mode)
        kl[mode] = compare_logits(ref, quantize_graph(cg.gm, "w4", group_size=32).gm(*inputs)).kl_mean
    print(f"w4 vs float gpt2-tiny, KL mean (measured): q8 {kl['q8']:.2e}, weight-only {kl['weight-only']:.2e}")
    assert kl["q8"] < 3e-3 and kl["weight-only"] < 3e-3
