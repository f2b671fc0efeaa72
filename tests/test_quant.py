"""Weight quantization: schemes, the quantized ops, the graph pass on tiny models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetforge.errors import UsageError
from hetforge.frontend import capture, op_counts, op_name
from hetforge.models.zoo import example_inputs, load_model
from hetforge.ops import lookup, op_call_from_node
from hetforge.ops.quant import int8_decomposition, linear_w4, linear_w8, linear_w8a8
from hetforge.quant import check_options, matches, quantize_graph, quantize_weight
from hetforge.quant.schemes import dequantize_int4, dequantize_int8, pack_int4, quantize_int4, quantize_int8
from hetforge.verify import compare_logits

QOPS = {"w8": "hetforge.linear_w8.default", "w4": "hetforge.linear_w4.default", "w8a8": "hetforge.linear_w8a8.default"}
KERNELS = {"w8": "aten::_weight_int8pack_mm", "w4": "aten::_weight_int4pack_mm_for_cpu",
           "w8a8": "quantized::linear_dynamic"}
# several rows (prefill): w8/w4 dequantize the weight once per call and run one float GEMM (ops/quant.py)
ROWS_KERNELS = {"w8": "aten::linear", "w4": "aten::linear", "w8a8": "quantized::linear_dynamic"}


@pytest.fixture
def w8_weight_only(monkeypatch):
    """``--w8-act weight-only`` and ``--w4-act weight-only``: w8/w4 with fp32 activations on ATen's kernels (the
    arithmetic these tests check against the dequantized weight); the default ``q8`` modes are tested in
    test_native_q8_gemm.py, test_native_q4a.py and below."""
    monkeypatch.setenv("HETFORGE_W8_ACT", "weight-only")
    monkeypatch.setenv("HETFORGE_W4_ACT", "weight-only")


@pytest.fixture(scope="module")
def captured():
    out = {}
    for name in ("gpt2-tiny", "llama-tiny"):
        loaded = load_model(name)
        inputs = example_inputs(loaded, seq=12)
        out[name] = (capture(loaded.logits_module(), inputs, name=name), inputs)
    return out


# ---------------------------------------------------------------- schemes


def test_int8_per_channel_round_trip_bound():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 256, generator=g) * torch.logspace(-3, 1, 96)[:, None]  # rows of very different scale
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (96,)
    err = (w - dequantize_int8(q, s)).abs()
    assert (err <= s[:, None] / 2 + 1e-7).all()  # rounding error ≤ half a step, per channel
    rel = quantize_weight(w, "w8").rel_error
    assert 1e-4 < rel < 0.01


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_group_round_trip_bound(group):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    q, s = quantize_int4(w, group)
    assert int(q.min()) >= -8 and int(q.max()) <= 7 and s.shape == (64, 256 // group)
    deq = dequantize_int4(q, s)
    step = s.repeat_interleave(group, dim=1)
    assert ((w - deq).abs() <= step / 2 + 1e-6).all()
    rel = quantize_weight(w, "w4", group).rel_error
    assert 0.02 < rel < 0.13  # ~0.09 expected for Gaussian weights at 4 bits
    assert quantize_weight(w, "w4", 32).rel_error < quantize_weight(w, "w4", 128).rel_error  # smaller groups help


def test_int4_rejects_group_not_dividing_k():
    with pytest.raises(ValueError, match="does not divide"):
        quantize_weight(torch.randn(32, 96), "w4", 64)


def _block_positions(b: int, n: int, k: int) -> torch.Tensor:
    """What ``_packed_positions`` gives for a torch build that packs blocks of ``b`` rows: slot 2·byte (low
    nibble) and 2·byte + 1 (high) of byte (block, column, i) hold rows block·b + i and block·b + b/2 + i."""
    blk, col, i = torch.meshgrid(torch.arange(n // b), torch.arange(k), torch.arange(b // 2), indexing="ij")
    lo, hi = (blk * b + i) * k + col, (blk * b + b // 2 + i) * k + col
    return torch.stack([lo, hi], dim=-1).reshape(-1)


@pytest.mark.parametrize("block", [64, 32, 16])
def test_int4_layout_probe_finds_the_block_size_of_the_build_when_a_larger_one_divides_n(block, monkeypatch):
    """A build packing 32-row blocks (this torch's AVX2 build) on a 128-row weight: the layout probe tries every
    block size dividing n, largest first, and finds that one (before, it stopped after the largest, 64, and fell
    back to a gather index of n·k entries, used by every dequantization)."""
    from hetforge.ops import quant as q

    monkeypatch.setattr(q, "_packed_positions", lambda n, k: _block_positions(block, n, k))
    monkeypatch.setattr(q, "_INT4_LAYOUT", {})
    assert q._int4_layout(128, 96) == ("block", block)


def test_int4_layout_of_this_torch_build_is_a_block_layout_and_dequantizes_as_its_kernel():
    """On this machine's torch build (no mock): a weight of 128 rows is found in a block layout, not gathered,
    and dequantize_w4 gives the weight ATen's int4 kernel multiplies by."""
    from hetforge.ops import quant as q

    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(5))
    qv, s = quantize_int4(w, 64)
    packed, sz = pack_int4(qv, s)
    kind, b = q._int4_layout(128, 256)
    assert kind == "block" and b in (16, 32, 64)
    deq = q.dequantize_w4(packed, sz, 64)
    assert torch.equal(deq, dequantize_int4(qv, s))
    x = torch.randn(3, 256)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 64, sz)
    assert torch.allclose(x @ deq.t(), want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- ops vs dequantized reference


def _ref(x, deq, b, act="none"):
    y = F.linear(x, deq, b)
    return F.silu(y) if act == "silu" else y


@pytest.mark.parametrize("act", ["none", "silu"])
def test_quant_ops_match_dequantized_reference(act, monkeypatch):
    g = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(48, 128, generator=g), torch.randn(48, generator=g), torch.randn(2, 5, 128, generator=g)
    q, s = quantize_int8(w)
    ref8 = _ref(x, dequantize_int8(q, s), b, act)
    monkeypatch.delenv("HETFORGE_W8_ACT", raising=False)  # default q8: x quantized per block of 32 (native)
    yq = torch.ops.hetforge.linear_w8(x, q, s, b, act)
    assert yq.shape == (2, 5, 48)
    rel = float((yq - ref8).norm() / ref8.norm())
    assert rel < 0.02, rel
    monkeypatch.setenv("HETFORGE_W8_ACT", "weight-only")  # fp32 x: the dequantized reference to rounding
    y8 = torch.ops.hetforge.linear_w8(x, q, s, b, act)
    torch.testing.assert_close(y8, ref8, atol=1e-4, rtol=1e-4)

    q4, s4 = quantize_int4(w, 32)
    packed, sz = pack_int4(q4, s4)
    assert packed.dtype == torch.uint8 and packed.numel() == w.numel() // 2
    y4 = torch.ops.hetforge.linear_w4(x, packed, sz, 32, b, act)
    torch.testing.assert_close(y4, _ref(x, dequantize_int4(q4, s4), b, act), atol=1e-4, rtol=1e-4)

    torch.testing.assert_close(int8_decomposition(x, q, s, b, act), y8, atol=1e-4, rtol=1e-4)

    ya = torch.ops.hetforge.linear_w8a8(x, q, s, b, act)  # activations quantized too: looser, but close
    rel = float((ya - ref8).norm() / ref8.norm())
    assert rel < 0.05, rel


def test_quant_ops_registered_with_low_bit_attrs_and_bytes():
    for op, wdt in (("hetforge.linear_w8.default", "int8"), ("hetforge.linear_w4.default", "int4"),
                    ("hetforge.linear_w8a8.default", "int8")):
        info = lookup(op)
        assert info is not None and info.attrs["weight_dtype"] == wdt and info.attrs["group"] == "matmul"
        assert {"cpu", "gpu", "npu"} <= set(info.devices)
    assert linear_w8.reference is not None and linear_w4.reference is not None and linear_w8a8.reference is not None


# ---------------------------------------------------------------- the pass on tiny models


KL_BOUND = {"w8": 1e-5, "w4": 3e-3, "w8a8": 1e-4}  # random-weight tiny models, measured ~1e-6 / 3e-4 / 4e-6


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_w8_default_q8_mode_runs_its_prefill_on_the_native_gemm_and_stays_close(captured, name, monkeypatch):
    """The default w8 activation mode quantizes each prefill row per block of 32 (``hf_gemm_q8a``, no ATen
    float GEMM of an int8 weight); the logits stay within w8's bound."""
    from hetforge.kernels import native

    if native.library() is None:
        pytest.skip(f"native C kernels not built on this host ({native.status().reason}): the q8 GEMM path "
                    "under test does not exist here; the ATen path has its own tests")
    monkeypatch.delenv("HETFORGE_W8_ACT", raising=False)
    cg, inputs = captured[name]
    res = quantize_graph(cg.gm, "w8", group_size=32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = res.gm(*inputs)
    ran = {e.name for e in prof.events()}
    assert "aten::linear" not in ran and KERNELS["w8"] not in ran, sorted(ran)
    assert compare_logits(cg.gm(*inputs), out).kl_mean < KL_BOUND["w8"]


@pytest.mark.parametrize(("name", "scheme"), [("gpt2-tiny", "w8"), ("gpt2-tiny", "w4"), ("llama-tiny", "w8"),
                                           ("llama-tiny", "w4"), ("llama-tiny", "w8a8")])
def test_quantized_tiny_models_run_close_with_real_kernels(captured, name, scheme, w8_weight_only):
    cg, inputs = captured[name]
    before = {k: v.clone() for k, v in cg.gm.state_dict().items()}
    n_nodes = len(cg.gm.graph.nodes)
    ref = cg.gm(*inputs)
    res = quantize_graph(cg.gm, scheme, group_size=32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = res.gm(*inputs)
    ran = {e.name for e in prof.events()}
    assert ROWS_KERNELS[scheme] in ran, sorted(n for n in ran if "mm" in n or "linear" in n)
    if scheme == "w8a8":
        assert "aten::linear" not in ran and "aten::addmm" not in ran  # no float matmul of any weight left
    rep = compare_logits(ref, out)
    assert rep.kl_mean < KL_BOUND[scheme], rep
    assert 0.5 <= rep.top1_agree <= 1.0  # reported; random logits are flat so a few flips are normal
    # input graph untouched
    assert len(cg.gm.graph.nodes) == n_nodes
    assert all(torch.equal(before[k], v) for k, v in cg.gm.state_dict().items())
    # every linear became a quantized op; new nodes carry meta["val"]; cost formulas see the smaller bytes
    counts = op_counts(res.gm)
    assert counts[QOPS[scheme]] == len(res.report.entries) > 0
    orig = {n.name: n for n in cg.gm.graph.nodes}
    for n in res.gm.graph.nodes:
        if n.op == "get_attr":
            assert isinstance(n.meta.get("val"), torch.Tensor), n
        if n.op == "call_function" and op_name(n) == QOPS[scheme]:
            old = orig[n.meta["quant_of"]]
            assert n.meta["val"].shape == old.meta["val"].shape and n.meta["val"].dtype == old.meta["val"].dtype
            call = op_call_from_node(n)
            assert call.args[1].dtype == (torch.uint8 if scheme == "w4" else torch.int8)
            q_bytes = lookup(op_name(n)).nbytes(call)
            fp_bytes = lookup(op_name(old)).nbytes(op_call_from_node(old))
            w_fp = 4 * old.meta["val"].shape[-1] * call.args[0].shape[-1]
            w_q = sum(a.nbytes for a in call.args[1:3])  # int8 / packed int4 weight + fp32 scales
            extra = 2 * call.args[0].numel if scheme == "w8a8" else 0  # the int8 copy of the activations
            assert q_bytes == fp_bytes - w_fp + w_q + extra and w_q < w_fp / 3
    # the graph holds int8 / packed uint8 weights and no fp32 copy of a quantized weight
    attrs = {str(n.target): n.meta["val"] for n in res.gm.graph.nodes if n.op == "get_attr"}
    for e in res.report.quantized:
        tied = "also read by" in e.reason
        assert (e.target in attrs) == tied, e
        assert e.bytes_after < e.bytes_before or tied
    assert any(v.dtype == (torch.uint8 if scheme == "w4" else torch.int8) for v in attrs.values())
    assert res.report.graph_bytes_after < res.report.graph_bytes_before


@pytest.mark.parametrize("w4_unfit", ["w8", "float"])
def test_skip_list_and_unfit_group_size_are_listed(captured, w4_unfit):
    """Skipped layers stay float; layers whose K the group size does not divide get int8 (``w4_unfit="w8"``, the
    default) or stay float, each listed with the reason."""
    cg, inputs = captured["llama-tiny"]
    res = quantize_graph(cg.gm, "w4", group_size=128, skip=("lm_head", "layers.0", "no_such_layer"),
                         w4_unfit=w4_unfit)
    by_path = {e.path: e for e in res.report.entries}
    assert by_path["lm_head"].scheme == "fp32" and "skip pattern 'lm_head'" in by_path["lm_head"].reason
    assert all(e.scheme == "fp32" for p, e in by_path.items() if ".layers.0." in f".{p}.")
    # layer 1: down_proj has K=128 (fits), the others K=64 (group 128 does not divide 64)
    assert by_path["model.layers.1.mlp.down_proj"].scheme == "w4"
    q1 = by_path["model.layers.1.self_attn.q_proj"]
    assert q1.scheme == ("w8" if w4_unfit == "w8" else "fp32")
    assert "does not divide the input dimension 64" in q1.reason
    unfit = [e for e in res.report.entries if "does not divide" in e.reason]
    assert res.report.unmatched_skip == ["no_such_layer"]
    # skipped (and, under float, unfit) layers still run as float linears with their original weights
    counts = op_counts(res.gm)
    assert counts["aten.linear.default"] == len(res.report.skipped)
    assert counts["hetforge.linear_w4.default"] == 1
    assert counts.get("hetforge.linear_w8.default", 0) == (len(unfit) if w4_unfit == "w8" else 0)
    ref = cg.gm(*inputs)
    got = res.gm(*inputs)
    assert torch.allclose(got[0] if isinstance(got, tuple) else got, ref[0] if isinstance(ref, tuple) else ref,
                          atol=0.5)


def test_w4_gives_a_layer_with_n_not_a_multiple_of_16_int8_weights():
    """GPT-2's LM head has 50257 rows, which the int4 kernel cannot tile: under w4 it gets int8 per channel (the
    report says why) unless ``w4_unfit="float"``; the quantized graph matches the dequantized weights' product."""
    g = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(64, 40, bias=False)  # 40 rows: not a multiple of 16
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 64, generator=g))
    x = torch.randn(1, 3, 64, generator=g)
    cg = capture(lin, (x,))
    res = quantize_graph(cg.gm, "w4", group_size=32)
    (e,) = res.report.entries
    assert e.scheme == "w8" and "not a multiple of 16" in e.reason and e.bytes_after < e.bytes_before / 3
    assert op_counts(res.gm)["hetforge.linear_w8.default"] == 1
    q, s = quantize_int8(lin.weight.detach())
    want = x @ (q.float() * s[:, None]).t()
    got = res.gm(x)
    got = got[0] if isinstance(got, tuple) else got
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    kept = quantize_graph(cg.gm, "w4", group_size=32, w4_unfit="float")
    assert kept.report.entries[0].scheme == "fp32" and "not a multiple of 16" in kept.report.entries[0].reason


def test_bad_w4_unfit_choice_is_refused_by_name():
    with pytest.raises(UsageError, match="--w4-unfit 'int2' is not one of w8, float"):
        check_options("w4", 128, (), "int2")


def test_skip_pattern_matching():
    assert matches("model.layers.1.mlp.up_proj", "layers.1")
    assert not matches("model.layers.10.mlp.up_proj", "layers.1")
    assert matches("transformer.h.0.attn.c_attn", "h.0.*")
    assert matches("lm_head", "lm_head") and not matches("lm_head_2", "lm_head")


def test_already_quantized_graph_is_left_alone(captured):
    cg, inputs = captured["gpt2-tiny"]
    once = quantize_graph(cg.gm, "w8")
    twice = quantize_graph(once.gm, "w4", group_size=32)
    assert twice.gm is once.gm and twice.report.already_quantized
    assert "already" in twice.report.summary_line() and not twice.report.entries


def test_scheme_none_changes_nothing(captured):
    cg, inputs = captured["gpt2-tiny"]
    res = quantize_graph(cg.gm, "none")
    assert torch.equal(res.gm(*inputs), cg.gm(*inputs))
    assert all(e.scheme == "fp32" for e in res.report.entries) and res.report.entries


def test_bad_options_raise_usage_error():
    with pytest.raises(UsageError, match="valid schemes: w8, w4, w8a8, none"):
        check_options("int3", 128, ())
    with pytest.raises(UsageError, match="32, 64, 128, 256"):
        check_options("w4", 48, ())
    with pytest.raises(UsageError):
        check_options("w8", 128, ("",))


class _Fused(torch.nn.Module):
    """A block written directly with hetforge's fused ops (what the opfusion pass produces)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.w1 = torch.nn.Parameter(torch.randn(32, 64, generator=g) * 0.2)  # [in, out]: weight_t layout
        self.b1 = torch.nn.Parameter(torch.randn(64, generator=g) * 0.1)
        self.wg = torch.nn.Parameter(torch.randn(96, 64, generator=g) * 0.2)
        self.wu = torch.nn.Parameter(torch.randn(96, 64, generator=g) * 0.2)
        self.wd = torch.nn.Parameter(torch.randn(64, 96, generator=g) * 0.2)

    def forward(self, x):
        h = torch.ops.hetforge.linear_act(x, self.w1, self.b1, "gelu_tanh", True)
        return torch.ops.hetforge.gated_mlp(h, self.wg, self.wu, self.wd, None, None, None, "silu")


@pytest.mark.parametrize("scheme", ["w8", "w4"])
def test_fused_linear_ops_are_quantized(scheme, w8_weight_only):
    x = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(6))
    cg = capture(_Fused(), (x,))
    assert op_counts(cg.gm)["hetforge.gated_mlp.default"] == 1
    res = quantize_graph(cg.gm, scheme, group_size=32, skip=("wd",) if scheme == "w4" else ())
    counts = op_counts(res.gm)
    assert "hetforge.gated_mlp.default" not in counts and "hetforge.linear_act.default" not in counts
    assert counts[QOPS[scheme]] == (4 if scheme == "w8" else 3)
    assert counts["aten.mul.Tensor"] == 1
    assert ("aten.linear.default" in counts) == (scheme == "w4")  # the skipped down projection stays float
    # reference: the same fused ops with every quantized weight replaced by its dequantized value
    ref = _Fused()
    with torch.no_grad():
        for name in ("w1", "wg", "wu", "wd"):
            p = getattr(ref, name)
            w = p.t() if name == "w1" else p
            if scheme == "w8":
                deq = dequantize_int8(*quantize_int8(w))
            elif name != "wd":
                deq = dequantize_int4(*quantize_int4(w, 32))
            else:
                continue
            p.copy_(deq.t() if name == "w1" else deq)
    torch.testing.assert_close(res.gm(x), ref(x), atol=1e-4, rtol=1e-4)
    acts = [n.args[-1] for n in res.gm.graph.nodes if op_name(n) == QOPS[scheme]]
    assert "gelu_tanh" in acts and "silu" in acts


def test_rules_placement_sees_quantized_linears(captured):
    from hetforge.placement.rules import categorize

    cg, _ = captured["llama-tiny"]
    res = quantize_graph(cg.gm, "w8")
    cats = {categorize(n, op_name(n), 1, "cpu")[0] for n in res.gm.graph.nodes if op_name(n) == QOPS["w8"]}
    assert cats == {"quantized-linear"}
    linears = [n for n in cg.gm.graph.nodes if op_name(n) == "aten.linear.default"]
    assert {categorize(n, op_name(n), 1, "cpu")[0] for n in linears} == {"matmul"}


def test_quantize_after_optimize_passes(captured):
    from hetforge.passes import optimize

    cg, inputs = captured["llama-tiny"]
    opt = optimize(cg.gm, inputs).gm
    assert op_counts(opt)["hetforge.gated_mlp.default"] == 2
    res = quantize_graph(opt, "w8")
    counts = op_counts(res.gm)
    assert counts["hetforge.linear_w8.default"] == 15 and "hetforge.gated_mlp.default" not in counts
    assert compare_logits(cg.gm(*inputs), res.gm(*inputs)).kl_mean < KL_BOUND["w8"]


@pytest.mark.parametrize("scheme", ["w8", "w4"])
@pytest.mark.parametrize(("rows", "n", "k", "group"), [(5, 3072, 768, 128), (16, 768, 256, 64), (3, 48, 64, 32),
                                                       (2, 80, 128, 32)])
def test_weight_only_several_rows_dequantize_and_equal_the_int_kernel(scheme, rows, n, k, group, w8_weight_only):
    """Several rows take the dequantize + float GEMM path (ATen's int8/int4 kernels are far slower there); the
    result equals the ATen kernel to float rounding, for int4 tile layouts found by block probe or by gather."""
    torch.manual_seed(rows + n)
    w, x, b = torch.randn(n, k) * 0.05, torch.randn(rows, k), torch.randn(n)
    q = quantize_weight(w, scheme, group)
    if scheme == "w8":
        qw, s = q.tensors["qweight"], q.tensors["scales"]
        want = torch.ops.aten._weight_int8pack_mm(x, qw, s) + b
        call = lambda: torch.ops.hetforge.linear_w8(x, qw, s, b, "none")  # noqa: E731
    else:
        pk, sz = q.tensors["packed"], q.tensors["scales_zeros"]
        want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, pk, group, sz) + b
        call = lambda: torch.ops.hetforge.linear_w4(x, pk, sz, group, b, "none")  # noqa: E731
    call()  # the first w4 call of a shape finds the tile layout and checks it against one kernel row
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = call()
    ran = {e.name for e in prof.events()}
    assert "aten::linear" in ran and KERNELS[scheme] not in ran
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_fbgemm_packing_serves_equal_scales_held_as_separate_tensors_and_repacks_a_changed_value():
    """One int8 weight, two callers holding equal scales and biases as separate tensors (a prefill and a decode
    program bound from two compile-cache entries): one FBGEMM packing serves both, in turns, with the same result;
    the bias is added after the product, so a caller with another bias shares the packing too; a caller whose
    scale values differ gets a packing of its own values."""
    from hetforge.ops import quant

    torch.manual_seed(0)
    q, s = quantize_int8(torch.randn(24, 32))
    bias = torch.randn(24)
    x = torch.randn(3, 32)
    first = quant._fbgemm_packed(q, s)
    want = torch.ops.hetforge.linear_w8a8(x, q, s, bias)
    s2, b2 = s.clone(), bias.clone()
    for _ in range(3):  # the two callers take turns: no packing again
        assert quant._fbgemm_packed(q, s2) is first
        assert quant._fbgemm_packed(q, s) is first
    torch.testing.assert_close(torch.ops.hetforge.linear_w8a8(x, q, s2, b2), want, rtol=0, atol=0)
    torch.testing.assert_close(torch.ops.hetforge.linear_w8a8(x, q, s, bias + 1.0), want + 1.0, rtol=1e-5, atol=1e-5)
    assert quant._fbgemm_packed(q, s) is first
    s3 = s * 2.0
    other = quant._fbgemm_packed(q, s3)
    assert other is not first
    torch.testing.assert_close(torch.ops.hetforge.linear_w8a8(x, q, s3, bias), 2 * want - bias, rtol=1e-5, atol=1e-5)
    s2.mul_(2.0)  # a caller's tensor written in place: its values are compared again
    assert quant._fbgemm_packed(q, s2) is other


def _w8a8_case(rows: int, k: int = 96, n: int = 40):
    torch.manual_seed(1)
    q, s = quantize_int8(torch.randn(n, k) * 0.05)
    x = torch.randn(rows, k)
    x[:, 5] *= 20.0  # an outlier channel
    x[1] *= 10.0  # a row much larger than the others
    x[2] += 30.0  # a row far from zero
    return q, s, torch.randn(n) * 0.1, x


@pytest.mark.parametrize("kernels", ["with_native", "no_native"])
def test_w8a8_row_results_do_not_depend_on_the_other_rows_or_on_being_alone(kernels, request):
    """FBGEMM measures one activation range over all the rows it is given; w8a8 gives it each row mapped onto
    its own range, so appending rows of any size (a prompt's pad rows, another request in the batch), computing
    a subset or a row alone leaves every row's result bit for bit the same, on the native kernels and in the
    ATen form; and each row is within one quantization step per element of the float product."""
    request.getfixturevalue(kernels)  # conftest's: the native kernels built here, or the ATen path only
    q, s, b, x = _w8a8_case(8)
    w = torch.ops.hetforge.linear_w8a8
    y = w(x, q, s, b)
    padded = w(torch.cat([x, torch.randn(5, x.shape[1]) * 100.0]), q, s, b)
    assert torch.equal(padded[:8], y)
    assert torch.equal(w(x[3:6], q, s, b), y[3:6])
    exact = x @ (q.float() * s[:, None]).T + b
    for r in range(8):
        alone = w(x[r:r + 1], q, s, b)
        step = (x[r].max() - x[r].min()) / 127  # the row's quantization step (7-bit)
        bound = float(step * (q.float() * s[:, None]).abs().sum(1).max())  # every element off by one step
        assert torch.equal(alone[0], y[r])
        assert float((y[r] - exact[r]).abs().max()) <= bound


def test_w8a8_per_row_range_beats_one_range_for_all_rows():
    """With a row ten times larger than the others, one range for all rows (what FBGEMM alone does) quantizes the
    small rows coarsely; each row by its own range is several times closer to the float product."""
    from hetforge.ops import quant

    q, s, b, x = _w8a8_case(16)
    exact = x @ (q.float() * s[:, None]).T + b
    ours = torch.ops.hetforge.linear_w8a8(x, q, s, b)
    one_range = torch.ops.quantized.linear_dynamic(x, quant._fbgemm_packed(q, s).packed, True) + b
    small = [r for r in range(16) if r not in (1, 2)]
    assert float((ours - exact)[small].abs().mean()) * 3 < float((one_range - exact)[small].abs().mean())


@pytest.mark.parametrize("kernels", ["with_native", "no_native"])
def test_w8a8_keeps_nan_and_constant_rows_to_themselves(kernels, request):
    """A row holding NaN or ±Inf gives NaN outputs and leaves the other rows finite and unchanged; a constant
    row and an all-zero row come out as their float products to quantization error."""
    request.getfixturevalue(kernels)  # conftest's: the native kernels built here, or the ATen path only
    q, s, b, x = _w8a8_case(6)
    clean = torch.ops.hetforge.linear_w8a8(x, q, s, b)
    x[1, 7], x[2, 9] = float("nan"), float("inf")
    x[3], x[4] = 2.5, 0.0
    y = torch.ops.hetforge.linear_w8a8(x, q, s, b)
    assert y[1].isnan().all() and y[2].isnan().all()
    assert torch.equal(y[[0, 5]], clean[[0, 5]])
    assert torch.equal(y[4], b)
    exact3 = x[3] @ (q.float() * s[:, None]).T + b
    assert float((y[3] - exact3).abs().max()) <= float(2.5 / 127 * (q.float() * s[:, None]).abs().sum(1).max())
