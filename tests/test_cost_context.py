"""The calibrated parts of the cost model: the fits, op keys, composite ops, cache context and program costing."""

import dataclasses
import math

import pytest
import torch
from cost_helpers import F32, T, call, dev  # noqa: F401

from hetforge.cost import CacheContext, cost_mode, estimate, estimate_instr, estimate_parts, estimate_program
from hetforge.cost.composite import decompose
from hetforge.cost.instr import op_call_from_instr
from hetforge.cost.model import op_keys, weight_rows
from hetforge.hardware.calibrate import fit_group, fit_rows, fit_saturating
from hetforge.hardware.profile import SocProfile, row_band
from hetforge.ops import lookup

# ------------------------------------------------------------------ fits


def test_fit_group_is_not_thrown_by_points_faster_than_dispatch():
    # a tanh-like op: 10× slower than the memory roof; the smallest size measures below the dispatch time.
    # Fitting the net time (measured − dispatch) clipped to ~0 made that point dominate and gave e ≈ 2.
    d, bw = 3.5e-6, 24e9
    pts = [(8 * n / bw, d + 8 * n / bw / 0.1) for n in (12288, 98304, 393216)] + [(8 * 768 / bw, 0.8 * d)]
    e, o = fit_group(pts, d)
    assert 0.08 < e < 0.2 and o < 1e-6  # the small point still pulls a little (it cannot be fitted)
    assert fit_group(pts[:3], d)[0] == pytest.approx(0.1, rel=1e-6)


def test_fit_group_recovers_totals_and_single_point_fits_overhead_only():
    d = 2e-6
    pts = [(r, d + 5e-6 + r / 0.5) for r in (1e-6, 1e-5, 1e-4, 1e-3)]
    e, o = fit_group(pts, d)
    assert e == pytest.approx(0.5, rel=1e-6) and o == pytest.approx(5e-6, rel=1e-6)
    # one point cannot separate e from o: only the overhead is fitted (e stays 1 at predict time)
    assert fit_group([(4e-8, d + 1e-6)], d) == (None, pytest.approx(1e-6 - 4e-8))


def test_fit_saturating_recovers_amplitude_and_time_constant():
    p, tau = 50e-6, 8e-3
    pts = [(t, p * min(1.0, t / tau)) for t in (1e-3, 4e-3, 2e-2, 5e-2)]
    pf, tf = fit_saturating(pts)
    assert pf == pytest.approx(p, rel=0.1) and tf == pytest.approx(tau, rel=0.2)


def test_fit_rows_separates_bytes_from_rows():
    # one-row products: 30 GB/s streaming plus 70 ns per weight row, 2 µs fixed
    d, bw = 3e-6, 25e9
    shapes = [(768, 768), (3072, 768), (8192, 768), (768, 3072), (3072, 768)]  # (rows, row length)
    pts = [(4 * r * k / bw, r, d + 2e-6 + 4 * r * k / 30e9 + r * 70e-9) for r, k in shapes]
    e, o, c = fit_rows(pts, d)
    assert e == pytest.approx(30 / 25, rel=1e-4) and o == pytest.approx(2e-6, rel=1e-3)
    assert c == pytest.approx(70e-9, rel=1e-3)
    # rows proportional to bytes cannot be separated: falls back to fit_group, no row term
    e2, o2, c2 = fit_rows([(4 * r * 768 / bw, r, d + 4 * r * 768 / 20e9) for r in (768, 3072, 8192)], d)
    assert c2 == 0.0 and e2 == pytest.approx(0.8, rel=1e-4)


# ------------------------------------------------------------------ keys


def test_op_keys_put_the_variant_and_the_row_band_first():
    g = call("aten.gelu.default", [T(4, 8)], [T(4, 8)], approximate="tanh")
    assert op_keys(g, "transcendental", "memory", "memory")[:2] == ("aten.gelu.default:tanh", "aten.gelu.default")
    lin1 = call("aten.linear.default", [T(1, 768), T(768, 768)], [T(1, 768)])
    assert "matmul:rows<8" in op_keys(lin1, "matmul", "memory", "memory")
    assert [row_band(m) for m in (1, 7, 8, 63, 64, 4096)] == ["rows<8", "rows<8", "rows<64", "rows<64", "rows>=64",
                                                              "rows>=64"]


def test_gemv_pays_a_cost_per_weight_row_in_memory_order():
    lin = call("aten.linear.default", [T(1, 3072), T(768, 3072)], [T(1, 768)])  # 768 rows of 3072
    conv = call("aten.addmm.default", [T(768), T(1, 3072), T(3072, 768)], [T(1, 768)])  # 3072 rows of 768
    assert weight_rows(lin) == 768 and weight_rows(conv) == 3072
    d0, d1 = dev(), dev(overhead_s={"matmul:per-row": 1e-7})
    assert estimate(lin, d1).time_s - estimate(lin, d0).time_s == pytest.approx(768e-7)
    assert estimate(conv, d1).time_s - estimate(conv, d0).time_s == pytest.approx(3072e-7)
    # inside a composite, F.linear's transposed weight view is seen in memory order: N rows of K
    c = call("hetforge.gated_mlp.default", [T(1, 1, 768), T(2048, 768), T(2048, 768), T(768, 2048)],
             [T(1, 1, 768)])
    torch.set_num_threads(1)  # (more threads take the split GEMV of hetforge.ops.gemv)
    mms = [s for s, _ in decompose(c, lookup(c.op)) if s.op == "aten.mm.default"]
    assert [weight_rows(m) for m in mms] == [2048, 2048, 768]


def test_row_band_efficiency_applies_to_its_band_only():
    big = call("aten.linear.default", [T(128, 768), T(3072, 768)], [T(128, 3072)])
    one = call("aten.linear.default", [T(1, 768), T(3072, 768)], [T(1, 3072)])
    plain, banded = dev(), dev(efficiency={"matmul:rows>=64": 0.5})
    assert estimate(big, banded).time_s - 3e-6 == pytest.approx(2 * (estimate(big, plain).time_s - 3e-6))
    assert estimate(one, banded).time_s == pytest.approx(estimate(one, plain).time_s)


def test_tanh_gelu_variant_is_costed_at_its_own_speed():
    x = T(128, 3072)
    exact = call("aten.gelu.default", [x], [x])
    tanh = call("aten.gelu.default", [x], [x], approximate="tanh")
    d = dev(efficiency={"aten.gelu.default": 0.4, "aten.gelu.default:tanh": 0.1})
    assert estimate(tanh, d).time_s - 3e-6 == pytest.approx(4 * (estimate(exact, d).time_s - 3e-6))


# ------------------------------------------------------------------ composite ops


def test_rms_norm_on_a_cpu_is_the_sum_of_its_aten_ops():
    c = call("hetforge.rms_norm.default", [T(1, 128, 768), T(768)], [T(1, 128, 768)])
    subs = decompose(c, lookup(c.op))
    ops = [s.op for s, _ in subs]
    assert ops[:2] == ["aten.pow.Tensor_Scalar", "aten.mean.dim"] and "aten.rsqrt.default" in ops
    assert ops[-1] == "aten.mul.Tensor" and all(lookup(o) is not None for o in ops)
    # the mean reads pow's output (just written): hot; pow reads the op's own input: cold
    assert subs[0][1] == 0 and subs[1][1] == 128 * 768 * 4
    d = dev(efficiency={"cache-hit": 0.5})
    parts = estimate_parts(c, d)
    assert parts[0][1].time_s == 0 and len(parts) == len(subs) + 1 >= 6
    whole = estimate(c, d)
    assert whole.time_s == pytest.approx(sum(p.time_s for _, p in parts))
    assert whole.flops == parts[0][1].flops and whole.group == "norm"
    # five dispatches at least: far above one roofline over the op's bytes
    assert whole.time_s > 5 * 3e-6
    # a GPU runs the fused kernel: one roofline, one dispatch
    gpu = estimate(c, dev(kind="gpu"))
    assert gpu.time_s == pytest.approx(3e-6 + gpu.bytes / 2e10)


def test_linear_act_with_tanh_gelu_includes_its_activation():
    args = [T(128, 768), T(3072, 768), T(3072)]
    d = dev(efficiency={"aten.gelu.default:tanh": 0.1})
    relu = estimate(call("hetforge.linear_act.default", [*args, "relu"], [T(128, 3072)]), d)
    gelu = estimate(call("hetforge.linear_act.default", [*args, "gelu_tanh"], [T(128, 3072)]), d)
    act = estimate(call("aten.gelu.default", [T(128, 3072)], [T(128, 3072)], approximate="tanh"), d,
                   hot_bytes=128 * 3072 * 4)
    assert gelu.time_s - relu.time_s == pytest.approx(act.time_s - estimate(
        call("aten.relu.default", [T(128, 3072)], [T(128, 3072)]), d, hot_bytes=128 * 3072 * 4).time_s, rel=1e-6)


def test_sdpa_is_composite_on_cpu():
    q = T(1, 12, 16, 64)
    c = call("aten.scaled_dot_product_attention.default", [q, q, q, T(1, 1, 16, 16, dtype=torch.bool)], [q])
    ops = [s.op for s, _ in decompose(c, lookup(c.op))]
    assert ops[-1].startswith("aten._scaled_dot_product") and "aten.where.self" in ops


# ------------------------------------------------------------------ cache terms


def test_hot_bytes_cost_the_cache_hit_fraction_and_seq_warm_scales_fixed_costs():
    n = 10**6
    add = call("aten.add.Tensor", [T(n), T(n)], [T(n)])
    d = dev(efficiency={"cache-hit": 0.25, "seq:warm": 2.0})
    assert estimate(add, d).time_s == pytest.approx(2 * 3e-6 + 12 * n / 2e10)
    assert estimate(add, d, hot_bytes=8 * n).time_s == pytest.approx(2 * 3e-6 + (4 * n + 0.25 * 8 * n) / 2e10)
    assert estimate(add, d, hot_bytes=8 * n).fixed_s == pytest.approx(3e-6)


def test_cache_context_cold_code_and_first_op_after_a_long_one():
    d = dev(cache_bytes=1e6, efficiency={"seq:cold": 1.0}, overhead_s={"seq:first": 1e-5, "seq:first-tau": 1e-3})
    view = call("aten.view.default", [T(4, 4), [16]], [T(16)])
    big = call("aten.add.Tensor", [T(10**6), T(10**6)], [T(10**6)])  # 12 MB, 0.6 ms
    ctx = CacheContext(d)
    base = estimate(view, d).time_s
    first = ctx.run("v", estimate(view, d)).time_s
    assert first == pytest.approx(base + 3e-6)  # first run: cold code
    # warm code; the op before took `first`: p_first · first/τ
    assert ctx.run("v", estimate(view, d)).time_s == pytest.approx(base + 1e-5 * first / 1e-3, rel=1e-6)
    b = ctx.run("add", estimate(big, d))
    assert b.time_s > 6e-4
    # after 12 MB (> 2 caches) the view's code is cold again, and the op after a 0.6 ms one pays 0.6 × p_first
    again = ctx.run("v", estimate(view, d)).time_s
    assert again == pytest.approx(base + 3e-6 + 1e-5 * min(1.0, b.time_s / 1e-3), rel=1e-6)
    ctx.touch(["x"])
    assert ctx.hot("x") and not ctx.hot("y")
    ctx.run("add", estimate(big, d))
    assert not ctx.hot("x")  # 12 MB streamed since: evicted
    assert not CacheContext(dev()).active  # no cache size: no context terms


# ------------------------------------------------------------------ programs


@pytest.fixture(scope="module")
def tiny_program():
    """llama-tiny at 4 rows with every multi-row product on ATen (``HETFORGE_GEMM=aten``): its fused hetforge ops
    then run functionally and are copied into their slices, the cost mode the test below needs one of (by default
    4 rows run on the few-row native kernels)."""
    from hetforge.compile import compile_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HETFORGE_GEMM", "aten")
        return compile_model("llama-tiny", seq=4, soc="host")


def _with(soc: SocProfile, **kw) -> SocProfile:
    return dataclasses.replace(soc, devices=[dataclasses.replace(d, **kw) for d in soc.devices])


def test_estimate_program_matches_instructions_without_context_and_adds_with_it(tiny_program):
    res = tiny_program
    prog, planned = res.program, res.memory.offsets
    plain = _with(res.soc, cache_bytes=0.0)
    costs = estimate_program(prog, plain, planned)
    assert len(costs) == len(prog.instrs)
    for ins, c in zip(prog.instrs, costs, strict=True):
        assert c.time_s == pytest.approx(estimate_instr(ins, prog, plain.device(ins.device), planned).time_s)
        assert math.isfinite(c.time_s) and c.time_s >= 0
    kernels = res.executable.kernels
    modes = {cost_mode(i, planned, kernels[i.id]) for i in prog.instrs}
    assert modes <= {"out", "copy", "view-copy", "fresh", "view", "free", "inplace", "transfer", "native"}
    # hetforge ops have no out= variant: functional op + copy into the arena slice, costed as one more op
    fused = [i for i in prog.instrs if i.op.startswith("hetforge.") and cost_mode(i, planned, kernels[i.id]) == "copy"]
    assert fused
    ctx = _with(res.soc, cache_bytes=1e5, efficiency={"seq:cold": 1.0},
                overhead_s={"seq:first": 1e-5, "seq:first-tau": 1e-4})
    with_ctx = estimate_program(prog, ctx, planned)
    # steady state: the first instruction follows the previous run's last one (cold code, after a long op)
    first = prog.instrs[0]
    assert with_ctx[0].time_s > estimate_instr(first, prog, ctx.device(first.device), planned).time_s
    assert sum(c.time_s for c in with_ctx) > sum(c.time_s for c in estimate_program(prog, _with(ctx, cache_bytes=0.0),
                                                                                      planned))


# ------------------------------------------------------------------ native kernels and static views


def test_a_native_op_is_one_roofline_under_the_native_keys_not_its_aten_parts():
    x, w = T(1, 1, 768), T(768)
    c = call("hetforge.rms_norm.default", [x, w, 1e-5], [T(1, 1, 768)])
    d = dev(efficiency={"native:hetforge.rms_norm.default": 0.5}, overhead_s={"native:hetforge.rms_norm.default": 1e-6})
    parts = estimate_parts(c, d)
    assert len(parts) > 2  # on a CPU the ATen path is its parts (pow, mean, add, rsqrt, mul, mul)
    (op, nat), = estimate_parts(c, d, native=True)
    assert op == c.op and nat.fixed_s == pytest.approx(d.dispatch_s + 1e-6)
    plain = estimate_parts(c, dev(), native=True)[0][1]
    assert nat.time_s > plain.time_s  # efficiency 0.5 under the op's native key


def test_estimate_program_prices_the_kernel_recorded_on_each_instruction():
    """Static views cost nothing and native row ops one native roofline — read from ``attrs["kernel"]``; with the
    records rewritten to the per-call view and the functional op plus copy, the same instructions cost more."""
    import dataclasses as dc

    from hetforge.compile import compile_graph
    from hetforge.frontend import capture
    from hetforge.hardware import load_soc
    from hetforge.kernels import native

    class M(torch.nn.Module):
        def forward(self, x, w):
            h = torch.ops.hetforge.rms_norm(x, w, 1e-5)
            return h.view(1, 12, 64).transpose(0, 1) * 2

    inputs = (torch.randn(1, 768), torch.randn(768))
    cg = capture(M(), inputs)
    res = compile_graph(cg.gm, soc="host", example_inputs=inputs, passes=False)
    prog, planned = res.program, res.memory.offsets
    soc = load_soc("host")
    recorded = estimate_program(prog, soc, planned)
    plain = {"static-view": "view", **{k: "functional-copy" for k in ("native:hf_rms_norm",)}}
    swapped = dc.replace(prog, instrs=[dc.replace(i, attrs={**i.attrs, "kernel": plain.get(i.attrs["kernel"],
                                                                                           i.attrs["kernel"])})
                                       for i in prog.instrs])
    rewritten = estimate_program(swapped, soc, planned)
    kinds = [i.attrs["kernel"] for i in prog.instrs]
    for ins, a, b in zip(prog.instrs, recorded, rewritten, strict=True):
        k = ins.attrs["kernel"]
        if k == "static-view":
            assert a.time_s == 0.0 and b.time_s > 0.0
        elif k == "native:hf_rms_norm":  # one roofline under the native keys, not the ATen parts plus a copy
            alone = estimate_parts(op_call_from_instr(ins, prog), soc.device(ins.device), native=True)
            assert len(alone) == 1 and a.flops == alone[0][1].flops and 0 < a.time_s != b.time_s
        else:
            assert a.time_s == pytest.approx(b.time_s)
    if native.library() is not None:
        assert "native:hf_rms_norm" in kinds and "static-view" in kinds
