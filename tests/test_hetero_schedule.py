"""Op-level placements: many small partitions in graph order, fewer once scheduled, same outputs.

Also the regression test for views of a partition's inputs: in graph order, llama-tiny's rotary/GQA ``expand``
of a value made by an earlier partition once became a stride-0 arena buffer in the torch-cpu executor.
"""

from __future__ import annotations

import torch

from hetforge.backends import resolve
from hetforge.frontend import capture
from hetforge.hardware import load_soc
from hetforge.hetero.pipeline import partitions_from_placement
from hetforge.hetero.runner import build
from hetforge.models.zoo import example_inputs, load_model
from hetforge.placement import get_strategy
from hetforge.verify import compare_logits


def test_scheduled_order_cuts_fewer_partitions_and_both_match_eager():
    soc = load_soc("test-npu-gaps")  # an NPU without slice/cat/neg/softmax: op-level gaps in every layer
    lm = load_model("llama-tiny")
    inputs = example_inputs(lm, seq=8)
    cg = capture(lm.logits_module(), inputs)
    with torch.no_grad():
        ref = lm.logits_module()(*inputs)
    assignment = get_strategy("support")(cg.gm, soc, prefer="npu").assignment
    bindings = resolve(soc, {"npu": "emulated:torch-cpu"})
    counts = {}
    for scheduled in (False, True):
        pp = partitions_from_placement(cg.gm, assignment, soc, scheduled=scheduled)
        exe, _ = build(pp.partitions, soc, bindings)
        out, rep = exe.run(inputs)
        assert compare_logits(ref, out, kl_threshold=1e-8).passed
        assert rep.switches == len(rep.calls) - 1
        counts[scheduled] = len(rep.calls)
    assert counts[True] < counts[False]
