"""OpenVINO as a hetforge backend, for real: a partition compiled at f32 and fused ops decomposed for it."""

from __future__ import annotations

import pytest
import torch
from fx_partition import partition_graph

from hetforge.backends import make_backend
from hetforge.frontend import capture
from hetforge.models.zoo import example_inputs, load_model
from hetforge.verify import compare_logits

pytest.importorskip("openvino", reason="OpenVINO is the optional peers extra: pip install -e .[peers]")


def test_openvino_compiles_the_partition_for_real_at_f32(parts):
    pg, args, *_ = parts
    part = pg.partitions[1]  # ends in the LM head: its output is the logits
    with torch.no_grad():
        ref = part.gm(*args[1])[0]
    be = make_backend("openvino:CPU")
    comp = be.compile(part)
    assert comp.report.target.startswith("OpenVINO") and "INFERENCE_PRECISION_HINT=f32" in comp.report.notes
    assert comp.compiled.get_property("INFERENCE_PRECISION_HINT").to_string() == "f32"
    out, _ = comp.run(args[1])
    assert compare_logits(ref, out[0], kl_threshold=1e-6).passed
    assert out[0].data_ptr() != ref.data_ptr()


def test_fused_ops_are_decomposed_for_openvino_and_still_match():
    """A graph optimized by the passes holds hetforge:: fused ops; OpenVINO runs them decomposed to ATen."""
    from hetforge.passes import optimize

    lm = load_model("llama-tiny")
    inputs = example_inputs(lm, seq=8)
    cg = capture(lm.logits_module(), inputs)
    opt = optimize(cg.gm, inputs)
    assert sum(opt.fused.values()) > 0
    pg = partition_graph(opt.gm, {n.name: "npu" for n in opt.gm.graph.nodes})
    comp = make_backend("openvino:CPU").compile(pg.partitions[0])
    decomposed = [n for n in comp.report.notes if n.startswith("decomposed for OpenVINO")]
    assert decomposed and "hetforge." in decomposed[0]
    out, _ = comp.run(list(inputs))
    with torch.no_grad():
        ref = lm.logits_module()(*inputs)
    assert compare_logits(ref, out[0], kl_threshold=1e-6).passed

