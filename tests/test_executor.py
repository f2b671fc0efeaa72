import pytest
import torch
from test_ir_common import captured

from hetforge.compile import compile_graph
from hetforge.errors import UsageError
from hetforge.executor import Executable, default_device_map
from hetforge.kernels import native
from hetforge.verify import verify

TINY = ["gpt2-tiny", "llama-tiny", "mixtral-tiny", "qwen2-tiny", "bert-tiny"]


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_run_from_arenas_and_match_eager(name):
    module, inputs, cg = captured(name)
    soc = "test-npu-gaps" if name in ("llama-tiny", "mixtral-tiny") else "host"
    res = compile_graph(cg.gm, soc=soc, example_inputs=inputs, name=name)
    exe = res.executable
    rep = verify(module, exe, inputs, kl_threshold=1e-8)
    assert rep.passed and rep.top1_agree == 1.0, rep
    # results really live in the arenas: every planned buffer is a view of its device's arena
    assert exe.stats.out_variant + exe.stats.gemm_out + exe.stats.copy_into > 0
    for vid, off in res.memory.offsets.items():
        buf = exe.planned_buffer(vid)
        if buf is not None:
            arena = exe.arenas[res.program.values[vid].device]
            assert buf.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
            assert buf.data_ptr() == arena.data_ptr() + off


def test_unoptimized_graph_and_fast_mode_match_eager():
    module, inputs, cg = captured("llama-tiny")
    for mode in ("arena", "fast"):
        res = compile_graph(cg.gm, soc="host", example_inputs=inputs, passes=False, mode=mode)
        assert verify(module, res.executable, inputs, kl_threshold=1e-8).passed
    assert res.executable.stats.unplanned > 0  # fast mode keeps some results out of the arena


def test_outputs_survive_the_next_call():
    module, inputs, cg = captured("gpt2-tiny")
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs).executable
    a = exe(*inputs)
    keep = a.clone()
    other = (torch.randint(0, 200, inputs[0].shape), inputs[1])
    b = exe(*other)
    assert torch.equal(a, keep) and not torch.equal(a, b)
    with torch.no_grad():
        torch.testing.assert_close(b, module(*other), rtol=1e-5, atol=1e-5)


def test_generated_code_is_straight_line():
    _, inputs, cg = captured("gpt2-tiny")
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs).executable
    src = exe.source
    assert src.startswith("def run(") and "for " not in src and "while " not in src
    assert "out=_b" in src  # kernels write into planned slices


def test_profile_times_every_instruction():
    _, inputs, cg = captured("llama-tiny")
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs).executable
    pr = exe.profile(*inputs, repeat=2)
    assert len(pr.times) == len(exe.program.instrs)
    assert sum(t.seconds for t in pr.times) <= pr.total_seconds * 1.5
    assert any(op.startswith("hetforge.") or op.startswith("aten.") for op in pr.by_op())
    ticks = iter(range(10**6))  # a fake clock advancing one unit per reading: every instruction takes exactly 1
    one = exe.profile(*inputs, warmup=0, repeat=1, clock=lambda: float(next(ticks)))
    assert [t.seconds for t in one.times] == [1.0] * len(exe.program.instrs)


def test_profile_again_reruns_each_product_and_reports_its_best_repeat_as_hot():
    from hetforge.ir.kernel_choice import ONEDNN_OPS

    _, inputs, cg = captured("llama-tiny")
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs).executable
    with torch.no_grad():
        ref = exe(*inputs)
    plain = exe.profile(*inputs, warmup=0, repeat=1)
    assert all(t.hot_seconds is None for t in plain.times)
    ticks = iter(range(10**6))  # one unit per clock reading: each run of an instruction, first or repeated, takes 1
    rep = exe.profile(*inputs, warmup=0, repeat=1, clock=lambda: float(next(ticks)), again=2, again_ops=ONEDNN_OPS)
    assert [t.seconds for t in rep.times] == [1.0] * len(exe.program.instrs)
    hot = [t for t in rep.times if t.hot_seconds is not None]
    assert hot and all(t.op in ONEDNN_OPS and t.hot_seconds == 1.0 for t in hot)
    # a panel group's later members only pick their part of the group's result: never repeated (the q, k and v
    # products are grouped where the panel GEMM runs them)
    if native.panel_available():
        assert "_pg" in exe.source and len(hot) < sum(t.op in ONEDNN_OPS for t in rep.times)
    with torch.no_grad():
        assert torch.equal(exe(*inputs), ref)  # the repeats only recomputed the same outputs
    assert all(t.hot_seconds is None for t in exe.profile(*inputs, warmup=0, repeat=1).times)


def test_bad_inputs_are_usage_errors():
    _, inputs, cg = captured("gpt2-tiny")
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs).executable
    with pytest.raises(UsageError, match="compiled static shape"):
        exe(torch.zeros(1, 3, dtype=torch.long), inputs[1])
    with pytest.raises(UsageError, match="takes 2 inputs"):
        exe(inputs[0])
    with pytest.raises(UsageError, match="unknown executor mode"):
        compile_graph(cg.gm, soc="host", example_inputs=inputs, mode="turbo")


def test_gpu_device_map_code_path():
    """A cpu+gpu SoC: the gpu maps to CUDA when present, else to the CPU; either way the program runs."""
    module, inputs, cg = captured("llama-tiny")
    res = compile_graph(cg.gm, soc="jetson-orin-nano", example_inputs=inputs)
    dm = default_device_map(res.program, res.soc)
    gpu = next(d.name for d in res.soc.devices if d.kind == "gpu")
    assert dm[gpu].type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert res.program.count_by_device()[gpu] > 0
    assert verify(module, res.executable, inputs, kl_threshold=1e-8).passed
    # an explicit map: arenas are allocated on the mapped device, weights moved there once
    exe = Executable(res.program, res.memory, device_map={d: torch.device("cpu") for d in res.program.devices})
    assert all(a.device.type == "cpu" for a in exe.arenas.values())
    assert verify(module, exe, inputs, kl_threshold=1e-8).passed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_path_matches_eager():
    module, inputs, cg = captured("llama-tiny")
    res = compile_graph(cg.gm, soc="jetson-orin-nano", example_inputs=inputs)
    assert any(a.device.type == "cuda" for a in res.executable.arenas.values())
    assert verify(module, res.executable, inputs, kl_threshold=1e-6).passed


def test_fast_mode_never_bakes_a_slice_a_result_was_not_written_to():
    """In mode fast a planned op with no out= variant keeps its result in a fresh tensor; a native kernel
    reading that value must read the fresh tensor, not the (unwritten) arena slice."""
    from hetforge.compile import compile_graph
    from hetforge.frontend import capture

    class M(torch.nn.Module):
        def forward(self, q, w):
            a = torch.ops.hetforge.attention(q, q, q, None, 0.25, False)
            return torch.ops.hetforge.rms_norm(a, w, 1e-5) * 2

    inputs = (torch.randn(1, 4, 3, 16), torch.randn(16))
    cg = capture(M(), inputs)
    want = M()(*inputs)
    for mode in ("arena", "fast"):
        exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, passes=False, mode=mode).executable
        for _ in range(2):
            torch.testing.assert_close(exe(*inputs), want, rtol=1e-5, atol=1e-5)
