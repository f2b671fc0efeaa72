"""Cost-model terms added for the out-of-sample accuracy of issue 18: each changes the modeled time the way
its docstring says, and a profile or program without it keeps the old figure."""

import pytest
import torch
from cost_helpers import F32, T, call, dev  # noqa: F401

from hetforge.cost import estimate, estimate_parts

# ------------------------------------------------------------------ oneDNN-fused products


def test_a_onednn_fused_linear_act_is_one_roofline_under_the_product_keys_not_gemm_plus_gelu():
    c = call("hetforge.linear_act.default", [T(1, 128, 768), T(3072, 768), T(3072), "gelu_tanh"], [T(1, 128, 3072)])
    d = dev(efficiency={"matmul:rows>=64": 0.5, "aten.gelu.default:tanh": 0.05},
            overhead_s={"matmul:rows>=64": 2e-5})
    parts = estimate_parts(c, d)
    assert any(op.startswith("aten.gelu") for op, _ in parts)  # the Python implementation: GEMM, then the GELU
    (op, fused), = estimate_parts(c, d, fused=True)
    gemm = estimate(call("aten.linear.default", [T(1, 128, 768), T(3072, 768), T(3072)], [T(1, 128, 3072)]), d)
    assert op == c.op and fused.group == "matmul"
    # one product at the calibrated row-band speed, its fixed part once: the fused GELU adds only its FLOPs
    assert fused.fixed_s == pytest.approx(d.dispatch_s + 2e-5)
    assert fused.time_s == pytest.approx(gemm.time_s, rel=0.02)
    assert fused.time_s < estimate(c, d).time_s  # the unfused GELU at 5% of the roof is gone
    # a plain product is one kernel either way: fused changes nothing for it
    lin = call("aten.linear.default", [T(1, 128, 768), T(3072, 768)], [T(1, 128, 3072)])
    assert estimate_parts(lin, d, fused=True)[0][1].time_s == pytest.approx(estimate(lin, d).time_s)


def test_onednn_mode_instructions_are_costed_fused_and_others_unchanged(monkeypatch):
    from hetforge.compile import compile_graph
    from hetforge.cost import estimate_program
    from hetforge.cost.instr import op_call_from_instr
    from hetforge.frontend import capture
    from hetforge.hardware import load_soc
    from hetforge.ir.kernel_choice import resolved_kernels
    from hetforge.kernels import onednn

    if not onednn.available():
        # a torch wheel without oneDNN (e.g. some non-x86 builds) never runs the packed kernel this test prices
        pytest.skip("this torch build has no oneDNN packed linear, so no instruction runs on it")
    monkeypatch.setenv("HETFORGE_GEMM", "onednn")

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 32))

        def forward(self, x):
            return torch.ops.hetforge.linear_act(x, self.w, None, "gelu_tanh") * 2

    inputs = (torch.randn(1, 8, 32),)
    cg = capture(M(), inputs)
    res = compile_graph(cg.gm, soc="host", example_inputs=inputs, passes=False)
    prog, planned = res.program, res.memory.offsets
    on = resolved_kernels(prog)  # policy onednn: the candidates run on oneDNN
    assert "onednn" in on.values()
    soc = load_soc("host")
    fused = estimate_program(prog, soc, planned)
    monkeypatch.setenv("HETFORGE_GEMM", "aten")  # the same program with the candidates left on ATen
    off = resolved_kernels(prog)
    unfused = estimate_program(prog, soc, planned)
    for ins, a, b in zip(prog.instrs, fused, unfused, strict=True):
        if on[ins.id] == "onednn":
            alone = estimate_parts(op_call_from_instr(ins, prog), soc.device(ins.device), fused=True)
            assert len(alone) == 1 and a.time_s != pytest.approx(b.time_s)
        elif on[ins.id] == off[ins.id] and not on[ins.id].startswith("native:"):
            assert a.time_s == pytest.approx(b.time_s)


def test_calibration_times_multi_row_products_on_the_kernel_the_executor_picks(monkeypatch):
    from hetforge.hardware import calibrate
    from hetforge.kernels import onednn

    monkeypatch.setattr(calibrate, "_cold_cap", [3])
    monkeypatch.setenv("HETFORGE_GEMM", "aten")
    assert calibrate._packed_product(8, 16, 32, bias=False) is None  # the executor keeps ATen's linear
    assert calibrate._packed_product(1, 16, 32, bias=False) is None  # one row: the native GEMV, never oneDNN
    if not onednn.available():
        return
    monkeypatch.setenv("HETFORGE_GEMM", "onednn")
    fn = calibrate._packed_product(8, 16, 32, bias=True)
    assert fn is not None
    out = fn()
    assert tuple(out.shape) == (8, 16) and torch.isfinite(out).all()


# ------------------------------------------------------------------ the kernel a product ran on


def _with(soc, **kw):
    import dataclasses

    return dataclasses.replace(soc, devices=[dataclasses.replace(d, **kw) for d in soc.devices])


def test_a_multi_row_product_the_executor_kept_on_aten_uses_the_aten_keys(monkeypatch):
    from hetforge.compile import compile_graph
    from hetforge.cost import estimate_program
    from hetforge.frontend import capture
    from hetforge.hardware import load_soc
    from hetforge.ir.kernel_choice import onednn_known, resolved_kernels
    from hetforge.kernels import onednn

    monkeypatch.setenv("HETFORGE_GEMM", "aten")

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 64, bias=False)

        def forward(self, x):
            return self.lin(x) * 2

    from hetforge.kernels import native

    # rows above the panel GEMM's (which it takes by rule, known without measuring), below the rows<64 key: the
    # rule's upper end (128 since session 32) leaves no such row count, so this test narrows it to 32, as it was
    monkeypatch.setattr(native, "PANEL_MAX", 32)
    inputs = (torch.randn(1, native.PANEL_MAX + 8, 32),)
    res = compile_graph(capture(M(), inputs).gm, soc="host", example_inputs=inputs, passes=False)
    prog, planned = res.program, res.memory.offsets
    assert "onednn" not in resolved_kernels(prog).values()
    host = load_soc("host")
    base = _with(host, efficiency={"matmul:rows<64": 1.0}, overhead_s={})
    slow_aten = _with(host, efficiency={"matmul:rows<64": 1.0, "aten:matmul:rows<64": 0.01}, overhead_s={})
    idx = next(i for i, ins in enumerate(prog.instrs) if ins.op == "aten.linear.default")
    with_aten = estimate_program(prog, slow_aten, planned)[idx].time_s  # known: ATen's kernel
    known_base = estimate_program(prog, base, planned)[idx].time_s
    if not onednn.available() or not onednn_known(prog.instrs[idx], prog):
        return
    # a oneDNN candidate whose choice is not measured in this process: the kernel is unknown, plain keys
    monkeypatch.setenv("HETFORGE_GEMM", "auto")
    monkeypatch.setattr(onednn, "_choices", {})
    assert not onednn_known(prog.instrs[idx], prog)
    unknown_kernel = estimate_program(prog, slow_aten, planned)[idx].time_s
    assert with_aten > 10 * unknown_kernel
    # a profile without the aten keys gives the same figure whether the kernel is known or not
    assert unknown_kernel == pytest.approx(known_base)
    assert estimate_program(prog, base, planned)[idx].time_s == pytest.approx(known_base)


def test_a_copy_of_a_transposed_view_uses_the_strided_copy_key():
    from hetforge.cost.instr import _copy_cost

    out = T(1, 128, 16, 64)
    d = dev(efficiency={"aten.copy_.default": 2.0, "aten.copy_.default:strided": 0.5})
    assert _copy_cost(out, d, strided=True).time_s > 3 * _copy_cost(out, d).time_s - 1e-12
    plain = dev(efficiency={"aten.copy_.default": 2.0})  # a profile without the strided key: the old figure
    assert _copy_cost(out, plain, strided=True).time_s == pytest.approx(_copy_cost(out, plain).time_s)


# ------------------------------------------------------------------ caches lost over a long op


def _cost(time_s, nbytes, fixed=1e-6):
    from hetforge.cost.model import OpCost

    return OpCost("op", "cpu", 0.0, float(nbytes), 0.0, "memory", time_s, 0.0, 0.0, "memory", True, "other", "fp32",
                  fixed)


def test_a_long_op_leaves_the_data_it_touched_cold_only_under_seq_evict():
    from hetforge.cost import CacheContext

    cap = 32 * 2**20
    lossy = dev(cache_bytes=cap, efficiency={"seq:evict": 1.0}, overhead_s={"seq:evict-tau": 5e-3})
    plain = dev(cache_bytes=cap)  # no seq:evict: the old rule (hot = touched within cache_bytes streamed bytes)
    for d, cold_after_long in ((lossy, True), (plain, False)):
        ctx = CacheContext(d)
        ctx.run("a", _cost(1e-5, 1e3))
        ctx.touch(["x"])
        ctx.run("short", _cost(1e-4, 1e3))  # 0.1 ms: 2% of τ, ~2% of the cache lost: x stays hot
        ctx.touch(["y"])
        assert ctx.hot("x") and ctx.hot("y")
        ctx.run("gemm", _cost(10e-3, 4e6))  # 10 ms, 4 MB: by bytes alone everything stays cached
        ctx.touch(["x", "out"])  # the long op read x and wrote out
        assert ctx.hot("y") is not cold_after_long
        assert ctx.hot("out") is not cold_after_long and ctx.hot("x") is not cold_after_long
        ctx.run("view", _cost(1e-6, 0.0))
        ctx.touch(["out"], moved=False)  # a view of the long op's output moves no bytes
        assert ctx.hot("out") is not cold_after_long


def test_estimate_program_pays_cold_inputs_after_a_long_op_under_seq_evict(monkeypatch):
    from hetforge.compile import compile_graph
    from hetforge.cost import estimate_program
    from hetforge.frontend import capture
    from hetforge.hardware import load_soc

    monkeypatch.setenv("HETFORGE_GEMM", "aten")

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(256, 256)

        def forward(self, x):
            h = x * 2
            return self.lin(h) + h  # the add reads h, touched before the product

    inputs = (torch.randn(1, 64, 256),)
    res = compile_graph(capture(M(), inputs).gm, soc="host", example_inputs=inputs, passes=False)
    prog, planned = res.program, res.memory.offsets
    host = load_soc("host")
    base_eff = {"cache-hit": 0.2}
    plain = _with(host, cache_bytes=32.0 * 2**20, efficiency=base_eff, overhead_s={})
    # τ far below the product's modeled time: the product loses the caches
    lossy = _with(host, cache_bytes=32.0 * 2**20, efficiency={**base_eff, "seq:evict": 1.0},
                  overhead_s={"seq:evict-tau": 1e-9})
    idx = next(i for i, ins in enumerate(prog.instrs) if ins.op == "aten.add.Tensor")
    before = estimate_program(prog, plain, planned)
    after = estimate_program(prog, lossy, planned)
    assert after[idx].time_s > before[idx].time_s  # its inputs are no longer hot
    assert sum(c.time_s for c in after) > sum(c.time_s for c in before)
