"""Shared, cached captures of the tiny zoo models for the backend tests, and a shared check (no tests here)."""

from __future__ import annotations

import functools

import torch

from hetforge.frontend import capture
from hetforge.models.zoo import example_inputs, load_model

SEQ = 8


@functools.cache
def captured(name: str, seq: int = SEQ):
    """(module, inputs, captured graph) of a tiny zoo model at [1, seq]."""
    loaded = load_model(name)
    inputs = example_inputs(loaded, seq=seq)
    module = loaded.logits_module()
    return module, inputs, capture(module, inputs, name=name)


def check_native_prefill_kernel(name: str, op: str, kernel: str, without: str, seq: int = SEQ) -> None:
    """A compiled prefill of zoo model ``name`` runs every ``op`` instruction on native ``kernel`` and matches eager
    (KL ≤ 1e-8, same top-1); compiled again with the native library off (``without``: what runs instead) no
    instruction records it, and both programs agree to 1e-5."""
    from hetforge.compile import compile_graph
    from hetforge.kernels import native
    from hetforge.verify import verify

    module, inputs, cg = captured(name, seq)
    res = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name)
    ins = [i for i in res.program.instrs if i.op == op]
    assert ins and inputs[0].shape[1] > 1
    assert {res.executable.kernels[i.id] for i in ins} == {kernel}
    rep = verify(module, res.executable, inputs, kl_threshold=1e-8)
    assert rep.passed and rep.top1_agree == 1.0, rep
    with native.disabled(f"A/B: {without}"):
        ref = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name).executable
    assert {ref.kernels[i.id] for i in ins} != {kernel}
    with torch.no_grad():
        torch.testing.assert_close(res.executable(*inputs), ref(*inputs), rtol=1e-5, atol=1e-5)
