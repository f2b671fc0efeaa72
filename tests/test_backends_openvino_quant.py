"""OpenVINO runs int8-quantized partitions for real (weights stay int8 through the quant decomposition)."""

from __future__ import annotations

import pytest
import torch
from fx_partition import partition_graph

from hetforge.backends import make_backend
from hetforge.frontend import capture
from hetforge.models.zoo import example_inputs, load_model
from hetforge.verify import compare_logits

pytest.importorskip("openvino", reason="OpenVINO is the optional peers extra: pip install -e .[peers]")


def test_int8_weights_run_on_openvino_through_the_quant_decomposition():
    """A w8-quantized partition compiles on OpenVINO (int8 weights kept) and matches the torch int8 kernel."""
    from hetforge.quant import quantize_graph

    lm = load_model("qwen2-tiny")
    inputs = example_inputs(lm, seq=8)
    gm = quantize_graph(capture(lm.logits_module(), inputs).gm, "w8").gm
    pg = partition_graph(gm, {n.name: "npu" for n in gm.graph.nodes})
    part = pg.partitions[0]
    comp = make_backend("openvino:CPU").compile(part)
    assert any("hetforge.linear_w8.default" in n for n in comp.report.notes)
    out, _ = comp.run(list(inputs))
    with torch.no_grad():
        ref = part.gm(*inputs)[0]  # the torch int8 kernel (aten._weight_int8pack_mm)
    assert compare_logits(ref, out[0], kl_threshold=1e-6).passed


@pytest.mark.parametrize("mode", ["q8", "weight-only"])
def test_openvino_w8_partition_computes_the_cpu_kernels_activation_arithmetic(mode, monkeypatch):
    """Under each ``--w8-act`` mode the OpenVINO partition's w8 products take their activation as hetforge's CPU
    kernels do (q8: quantized per block of 32; weight-only: float), so one placed program computes one w8
    arithmetic: OpenVINO's output is far closer to the torch partition of the same mode than to the other mode's."""
    from hetforge.kernels import native
    from hetforge.quant import quantize_graph

    if native.library() is None:
        pytest.skip("the native kernels are not built (no C compiler/OpenMP here): the q8 CPU kernel this compares "
                    "OpenVINO with does not exist on this host")
    lm = load_model("llama-tiny")
    inputs = example_inputs(lm, seq=8)
    gm = quantize_graph(capture(lm.logits_module(), inputs).gm, "w8").gm
    part = partition_graph(gm, {n.name: "npu" for n in gm.graph.nodes}).partitions[0]
    ref = {}
    for m in ("q8", "weight-only"):
        monkeypatch.setenv("HETFORGE_W8_ACT", m)
        with torch.no_grad():
            ref[m] = part.gm(*inputs)[0]
    monkeypatch.setenv("HETFORGE_W8_ACT", mode)
    out = make_backend("openvino:CPU").compile(part).run(list(inputs))[0][0]
    other = "weight-only" if mode == "q8" else "q8"
    same, diff = (out - ref[mode]).abs().max().item(), (out - ref[other]).abs().max().item()
    assert (ref["q8"] - ref["weight-only"]).abs().max().item() > 1e-3  # the two modes really differ here
    assert same < 0.1 * diff, (same, diff)


def test_q8_blocks_matches_the_native_block_quantizer():
    """``q8_blocks`` (the ATen form used for OpenVINO) gives the values hf_quantize_q8_blocks makes, incl. a
    zero block and a length that is not a multiple of 32."""
    from hetforge.kernels import native
    from hetforge.ops.quant import q8_blocks

    lib = native.library()
    if lib is None:
        pytest.skip("the native kernels are not built (no C compiler/OpenMP here): there is no native block quantizer "
                    "to compare q8_blocks with")
    k, nb = 70, 3
    x = torch.randn(3, k) * 3
    x[1, 32:64] = 0
    want = torch.empty(3, k)
    for r in range(3):
        xq, xd, xd8 = torch.empty(nb * 32, dtype=torch.int8), torch.empty(nb), torch.empty(nb * 8)
        lib.hf_quantize_q8_blocks(x[r].data_ptr(), k, xq.data_ptr(), xd.data_ptr(), xd8.data_ptr())
        want[r] = (xq.float() * xd.repeat_interleave(32))[:k]
    assert torch.equal(q8_blocks(x), want)
