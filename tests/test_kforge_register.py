"""`kforge register`: a generated kernel becomes a hetforge op, substituted into a captured model, fidelity checked."""

from __future__ import annotations

import torch

from hetforge.kforge import offline, problems, register
from hetforge.ops.registry import lookup


def test_registered_kernel_is_substituted_into_a_larger_captured_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    p = problems.resolve("linear_relu")[0]
    f = tmp_path / "k.py"
    f.write_text(offline.generate(p, offline.Tunables()))
    reg = register.register_kernel(p, f, measured_s=1e-4, flops=2.0 * 128 * 512 * 512)
    info = lookup(reg.op_name)
    assert info is not None and info.devices == frozenset({"cpu"}) and info.attrs["measured_s"] == 1e-4
    mod = p.load()
    torch.manual_seed(0)
    inner = mod.Model(*mod.get_init_inputs())

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(torch.tanh(x)) * 2.0

    x = torch.randn(128, 512)
    rep = register.fidelity(Outer(), (x,), reg)
    assert rep["substituted"] == 1 and rep["op_calls"] == 1 and rep["max_abs_err"] <= 1e-4 and rep["ok"]
    # A different shape must not be substituted: the kernel is built for [128, 512].
    rep2 = register.fidelity(Outer(), (torch.randn(64, 512),), reg)
    assert rep2["substituted"] == 0 and not rep2["ok"]
