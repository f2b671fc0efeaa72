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
