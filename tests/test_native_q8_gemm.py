"""hf_gemm_q8a: the w8 prefill product (several rows, each quantized per block of 32, int8·int8 sums).

Checked against a torch reference of the same quantized arithmetic, on every compiled path (AVX512-VNNI, AVX2,
portable C), row by row against the one-row kernel hf_gemv_q8a (a prefill computes what a decode step computes),
with odd shapes, NaN/Inf inputs, the executor's kernel choice in a compiled w8 prefill program, and the CLI's
``--w8-act`` (bad value: one line, exit 2)."""

from __future__ import annotations

import math

import pytest
import torch
from test_native import needs_cc
from test_native_q8a import _reference, _run

from hetforge.kernels import native

pytestmark = needs_cc

SHAPES = [(1, 1, 1), (2, 3, 31), (3, 5, 33), (5, 7, 64), (6, 13, 100), (7, 16, 96), (9, 17, 130), (4, 40, 768),
          (33, 70, 200), (17, 18, 128)]


def _gemm(q, s, x, b, act="none", threads=2, path=-1):
    lib = native.library()
    m, k = x.shape
    y = torch.full((m, q.shape[0]), -7.0)
    lib.hf_q8a_path(path)
    try:
        rc = lib.hf_gemm_q8a(q.data_ptr(), s.data_ptr(), x.data_ptr(), None if b is None else b.data_ptr(),
                             y.data_ptr(), m, q.shape[0], k, native.ACT_CODES[act], threads)
    finally:
        lib.hf_q8a_path(-1)
    assert rc == 0
    return y


def _case(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)  # -128 too: the u8 offset trick must hold
    return q, torch.rand(n, generator=g) / 50, torch.randn(m, k, generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_gemm_rows_equal_the_reference_and_the_gemv_on_every_path(m, n, k):
    q, s, x, b = _case(m, n, k, m * 7919 + n * 31 + k)
    best = native.library().hf_q8a_path(-1)
    ys = {p: _gemm(q, s, x, b, path=p) for p in range(best + 1)}
    want = torch.stack([_reference(q, s, x[r], b, "none") for r in range(m)])
    torch.testing.assert_close(ys[best], want, rtol=1e-5, atol=1e-5)
    for p, y in ys.items():  # portable C (0), AVX2 (1), VNNI (2): the same bits
        assert torch.equal(y, ys[best]), p
    gemv = torch.stack([_run(q, s, x[r].contiguous(), b, "none", 1) for r in range(m)])
    assert torch.equal(ys[best], gemv)  # row r of the prefill product is the decode GEMV of row r
    assert torch.equal(_gemm(q, s, x, b, threads=1), _gemm(q, s, x, b, threads=3))


@pytest.mark.parametrize(("m", "n", "k"), [(5, 7, 64), (7, 83, 128), (13, 161, 192), (2, 85, 256), (9, 80, 64)])
@pytest.mark.parametrize(("act", "bias"), [("none", True), ("relu", True), ("none", False), ("relu", False)])
def test_gemm_edge_tiles_equal_the_gemv(m, n, k, act, bias):
    """K in whole 64-byte steps (the VNNI tile's in-register sums and vector epilogue), m and n not multiples of
    the tile (4 × 5) or of the 80-row chunk: every row has the GEMV's bits, every path the same."""
    q, s, x, b = _case(m, n, k, m * 31 + n + k)
    b = b if bias else None
    best = native.library().hf_q8a_path(-1)
    y = _gemm(q, s, x, b, act)
    assert torch.equal(y, torch.stack([_run(q, s, x[r].contiguous(), b, act, 1) for r in range(m)]))
    for p in range(best):
        assert torch.equal(_gemm(q, s, x, b, act, path=p), y), p


@pytest.mark.parametrize("act", ["relu", "silu", "gelu", "gelu_tanh"])
def test_gemm_activations_without_bias(act):
    q, s, x, _ = _case(6, 10, 70, 3)
    want = torch.stack([_reference(q, s, x[r], None, act) for r in range(6)])
    torch.testing.assert_close(_gemm(q, s, x, None, act), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nan_or_inf_input_makes_its_rows_nan(bad):
    """A non-finite x must not be quantized into finite integers (fmaxf drops a NaN, a NaN cast to int8 is
    undefined): its block's scale is NaN, so every output of that row is NaN; other rows are untouched."""
    q, s, x, b = _case(5, 12, 100, 4)
    clean = _gemm(q, s, x, b)
    x[2, 70] = bad
    for p in range(native.library().hf_q8a_path(-1) + 1):
        y = _gemm(q, s, x, b, path=p)
        assert torch.isnan(y[2]).all(), p
        assert torch.equal(y[[0, 1, 3, 4]], clean[[0, 1, 3, 4]]), p
        assert torch.isnan(_run(q, s, x[2].contiguous(), b, "none", 2, p)).all(), p


def test_linear_w8_op_takes_the_gemm_under_q8_and_the_float_gemm_under_weight_only(monkeypatch):
    q, s, x, b = _case(8, 24, 96, 5)
    x3 = x.view(2, 4, 96)
    monkeypatch.setenv("HETFORGE_W8_ACT", "q8")
    assert native.q8_kernel(8) == "hf_gemm_q8a"
    got = torch.ops.hetforge.linear_w8(x3, q, s, b, "none")
    assert got.shape == (2, 4, 24) and torch.equal(got.view(8, 24), _gemm(q, s, x, b))
    monkeypatch.setenv("HETFORGE_W8_ACT", "weight-only")
    assert native.q8_kernel(8) is None and native.q8_kernel(1) == "hf_gemv_q8"
    want = torch.nn.functional.linear(x, q.float() * s[:, None], b)
    torch.testing.assert_close(torch.ops.hetforge.linear_w8(x, q, s, b, "none"), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("HETFORGE_W8_ACT", "float")  # the earlier name of weight-only
    assert native.w8_act_mode() == "weight-only"


def test_compiled_w8_prefill_records_and_runs_the_gemm(with_native, monkeypatch):
    """A compiled w8 prefill program lowers every int8 product to ``native:hf_gemm_q8a`` (recorded on the
    instruction, priced by the cost model), and its logits equal the eager op's; under weight-only none does."""
    from hetforge.compile import compile_graph
    from hetforge.cost.instr import estimate_instr
    from hetforge.frontend import capture
    from hetforge.models.zoo import load_model
    from hetforge.runtime.static_kv import PrefillModule

    m = load_model("llama-tiny").model.eval()
    ids = torch.randint(0, 100, (1, 19), generator=torch.Generator().manual_seed(0))
    inputs = (ids, torch.tensor([18]))
    cg = capture(PrefillModule(m), inputs)
    monkeypatch.setenv("HETFORGE_W8_ACT", "q8")
    res = compile_graph(cg.gm, soc="host", example_inputs=inputs, quantize="w8")
    exe = res.executable

    def rows(ins, p):
        shape = p.values[ins.outputs[0]].shape
        return math.prod(shape) // shape[-1]

    w8 = [ins for ins in exe.program.instrs if ins.op == "hetforge.linear_w8.default" and rows(ins, exe.program) > 1]
    # q, k, v, o, gate, up, down per layer; the last layer's o, gate, up and down run on the selected row only
    # (passes/rowprune.py)
    assert len(w8) >= 7 * (m.config.num_hidden_layers - 1) + 3
    assert all(exe.kernels[ins.id] == ins.attrs["kernel"] == "native:hf_gemm_q8a" for ins in w8)
    planned = set(res.memory.offsets)
    ins = w8[0]
    cost = estimate_instr(ins, exe.program, res.soc.device(ins.device), planned)
    assert cost.time_s > 0 and cost.flops > 0
    got = exe.run_flat(*inputs)[0].clone()
    want = res.gm(*inputs)
    want = want[0] if isinstance(want, (tuple, list)) else want
    torch.testing.assert_close(got, want.view_as(got), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("HETFORGE_W8_ACT", "weight-only")
    exe2 = compile_graph(cg.gm, soc="host", example_inputs=inputs, quantize="w8").executable
    several = [i for i in exe2.program.instrs if i.op == "hetforge.linear_w8.default" and rows(i, exe2.program) > 1]
    assert several and not any(exe2.kernels[i.id].startswith("native:") for i in several)
    with torch.no_grad():
        ref = m(ids).logits[:, -1]
    from hetforge.verify import compare_logits

    assert compare_logits(ref, got.view_as(ref)).kl_mean < 1e-4


def test_gemm_op_applies_gelu_and_silu_after_the_product():
    """GELU/SiLU of a several-row w8 product run as a vectorized pass on the C result (bias included): ATen's erf
    GELU bit for bit, the native tanh GELU and SiLU (native.act_inplace) within float rounding of ATen's."""
    q, s, x, b = _case(6, 20, 64, 6)
    for act in ("gelu", "gelu_tanh", "silu", "relu"):
        got = native.gemm_q8a(x, q, s, b, act)
        want = _gemm(q, s, x, b, "none")
        want = {"gelu": torch.nn.functional.gelu(want), "silu": torch.nn.functional.silu(want),
                "relu": torch.relu(want),
                "gelu_tanh": torch.nn.functional.gelu(want, approximate="tanh")}[act]
        if act in ("gelu", "relu"):
            assert torch.equal(got, want), act
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=act)

