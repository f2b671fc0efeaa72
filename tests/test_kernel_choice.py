"""Kernel choice as a lowering step: every instruction carries the kernel that runs it (``attrs["kernel"]``),
the executor emits exactly that kernel, and the cost model prices what is recorded."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from hetforge.compile import compile_graph
from hetforge.cost import estimate_program
from hetforge.executor import Executable
from hetforge.frontend import capture
from hetforge.hardware import load_soc
from hetforge.ir.kernel_choice import CONTEXT_ATTR, NATIVE_GEMV, OP_KERNELS, lower_kernels, resolved_kernels
from hetforge.ir.serialize import load_program, save_program
from hetforge.models import example_inputs, load_model

GENERAL = {"elided", "static-view", "view", "inplace", "zero-copy", "transfer-copy", "transfer", "gemm-out",
           "fresh", "copy-into", "out-variant", "unplanned", "functional-copy"}


def _known(k: str) -> bool:
    return k in GENERAL or re.fullmatch(r"native:hf_\w+|split-gemv:\d+", k) is not None


def _decode(name: str):
    from hetforge.runtime.kvcache import KVCache
    from hetforge.runtime.programs import model_dims
    from hetforge.runtime.static_kv import DecodeModule

    m = load_model(name).model.eval()
    layers, kv_heads, hd = model_dims(m)
    cache = KVCache(layers, kv_heads, 16, hd, torch.float32)
    inputs = (torch.tensor([[7]]), torch.tensor([[3]]), *cache.buffers)
    return capture(DecodeModule(m), inputs), inputs


@pytest.fixture(scope="module", params=[("gpt2-tiny", "prefill"), ("llama-tiny", "prefill"),
                                        ("gpt2-tiny", "decode"), ("llama-tiny", "decode")], ids=lambda p: "-".join(p))
def compiled(request):
    name, phase = request.param
    if phase == "prefill":
        loaded = load_model(name)
        inputs = example_inputs(loaded, seq=8)
        cg = capture(loaded.logits_module(), inputs, name=name)
    else:
        cg, inputs = _decode(name)
    return compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name), inputs


def test_every_instruction_records_a_known_kernel_shown_in_the_text_and_saved(compiled, tmp_path: Path):
    res, _ = compiled
    p = res.program
    kernels = [i.attrs.get("kernel") for i in p.instrs]
    assert all(k is not None and _known(k) for k in kernels), [k for k in kernels if k is None or not _known(k)]
    assert p.attrs[CONTEXT_ATTR]["mode"] == "arena"
    text = p.text()
    assert text.count("kernel=") == len(p.instrs)
    back = load_program(save_program(p, tmp_path / "p.json"), res.gm)
    assert [i.attrs["kernel"] for i in back.instrs] == kernels
    assert [i.attrs.get("onednn") for i in back.instrs] == [i.attrs.get("onednn") for i in p.instrs]


def test_the_executor_emits_the_recorded_kernel(compiled):
    """What the code generator ran per instruction equals the record (oneDNN candidates: the measured choice),
    and its counters agree kernel by kernel."""
    res, inputs = compiled
    exe, p = res.executable, res.program
    assert exe.program is p  # lowered for this host and mode already: no second lowering
    assert exe.kernels == resolved_kernels(p)
    # where it differs from the record: a oneDNN candidate measured faster, or a static view of its fresh result
    for ins in p.instrs:
        ran, rec = exe.kernels[ins.id], ins.attrs["kernel"]
        assert ran == rec or ("onednn" in ins.attrs and ran == "onednn") or (rec, ran) == ("static-view", "view")
    ran = list(exe.kernels.values())
    s = exe.stats
    assert s.elided_views == ran.count("elided") and s.static_views == ran.count("static-view")
    # a packed product ("onednn") runs on oneDNN's kernel or MKL's packed sgemm, whichever was measured faster, or
    # by rule on the native panel GEMM (fp32, native.PANEL_MIN..PANEL_MAX rows) or AMX kernel (bf16)
    assert s.onednn_gemm + s.mkl_gemm + s.panel_gemm + s.amx_gemm == ran.count("onednn")
    assert s.copy_into == ran.count("copy-into")
    assert s.native_ops == sum(k.startswith("native:") and k not in NATIVE_GEMV for k in ran)
    assert s.native_gemv == sum(k in NATIVE_GEMV for k in ran)
    assert s.split_gemv == sum(k.startswith("split-gemv:") for k in ran)
    # a residual add the product before it takes runs no kernel of its own: a few-row native product's
    # (ExecStats.native_residual) or a packed one's (onednn_residual: oneDNN's add post-op, the panel GEMM's epilogue)
    assert s.out_variant + s.native_residual + s.onednn_residual == ran.count("out-variant")
    exe.run_flat(*inputs)


def test_changing_the_record_changes_what_the_executor_runs_and_what_the_cost_model_prices(compiled):
    """A native row op rewritten to the functional op plus copy: the executor emits that instead (same
    outputs to rounding), and the modeled cost of that instruction changes."""
    res, inputs = compiled
    p = res.program
    target = next((i for i in p.instrs if i.attrs["kernel"].startswith("native:")
                   and i.attrs["kernel"] not in NATIVE_GEMV), None)
    if target is None:
        # the native kernels are compiled with the host's C compiler on first use; without one, every row op runs
        # its ATen form and there is no native record to swap (tests/test_native.py covers the build itself)
        pytest.skip("the native C kernels are not built on this host (no C compiler): no native kernel to swap")
    swapped = dataclasses.replace(p, instrs=[dataclasses.replace(i, attrs={**i.attrs, "kernel": "functional-copy"})
                                             if i is target else i for i in p.instrs])
    soc = load_soc("host")
    k = p.instrs.index(target)
    before, after = estimate_program(p, soc, res.memory.offsets), estimate_program(swapped, soc, res.memory.offsets)
    assert after[k].time_s != before[k].time_s
    exe = Executable(swapped, res.memory, mode="arena", soc=res.soc)
    assert exe.kernels[target.id] == "functional-copy"
    assert exe.stats.native_ops == res.executable.stats.native_ops - 1
    assert exe.stats.functional_copy == res.executable.stats.functional_copy + 1
    want = [t.clone() for t in res.executable.run_flat(*inputs)]
    for a, b in zip(exe.run_flat(*inputs), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_an_executable_in_another_mode_lowers_a_copy_and_leaves_the_record(compiled):
    res, _ = compiled
    p = res.program
    recorded = [i.attrs["kernel"] for i in p.instrs]
    exe = Executable(p, res.memory, mode="fast", soc=res.soc)
    assert exe.program is not p and exe.program.attrs[CONTEXT_ATTR]["mode"] == "fast"
    assert "static-view" not in [i.attrs["kernel"] for i in exe.program.instrs]
    assert [i.attrs["kernel"] for i in p.instrs] == recorded


def test_the_executor_and_cost_model_hold_no_op_name_rules():
    """Op-specific kernels are registered per op in ir/kernel_choice.py; the executor and the cost model
    name no op (no ``"aten.…"`` or ``"hetforge.…"`` string) to decide a kernel."""
    root = Path(__file__).resolve().parents[1] / "src" / "hetforge"
    for rel in ("executor/runtime.py", "executor/onednn.py", "cost/instr.py"):
        src = (root / rel).read_text()
        names = set(re.findall(r"[\"']((?:aten|hetforge)\.\w+\.\w+)[\"']", src))
        assert names <= {"aten.copy_.default"}, rel  # the copy the cost model prices after a functional op
    assert {"aten.linear.default", "hetforge.rms_norm.default", "hetforge.kv_attention.default"} <= set(OP_KERNELS)


def test_lowering_refuses_an_unknown_mode():
    from hetforge.errors import UsageError

    loaded = load_model("gpt2-tiny")
    res = compile_graph(capture(loaded.logits_module(), example_inputs(loaded, seq=4)).gm, soc="host", build=False)
    with pytest.raises(UsageError, match="unknown executor mode 'turbo'"):
        lower_kernels(res.program, res.memory.offsets, mode="turbo")
