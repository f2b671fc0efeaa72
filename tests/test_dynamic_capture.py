"""One dynamic capture per module, specialised per shape (hetforge.frontend.specialize, ProgramCache capture policy
"dynamic"): the programs it makes compute exactly what the per-shape captures' programs compute."""

import pytest
import torch
from torch.export import Dim

from hetforge.errors import UsageError
from hetforge.frontend import SpecializeError, capture, specialize
from hetforge.models.zoo import load_model
from hetforge.runtime import Engine
from hetforge.runtime.programs import capture_policy
from hetforge.runtime.static_kv import PrefillModule


def _outputs(loaded, policy: str, monkeypatch) -> tuple[list[list[torch.Tensor]], list[str]]:
    monkeypatch.setenv("HETFORGE_CAPTURE", policy)
    eng = Engine(loaded, executor="auto")
    outs, notes = [], []
    g = torch.Generator().manual_seed(0)
    for tier in (32, 64):
        prog, _ = eng.programs.prefill(tier)
        ids = torch.randint(0, loaded.vocab_size, (1, tier), generator=g)
        outs.append([t.clone() for t in prog.run(ids, torch.tensor([tier - 3]))])
        notes.append(prog.notes[0])
    for length in (64, 128):
        prog, _ = eng.programs.decode(length)
        cache = eng.programs.cache(length)
        for b in cache.buffers:
            b.copy_(torch.randn(b.shape, generator=g))
        outs.append([t.clone() for t in prog.run(torch.tensor([[5]]), torch.tensor([[length // 2]]), *cache.buffers)])
        notes.append(prog.notes[0])
    return outs, notes


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_programs_from_one_dynamic_capture_equal_per_shape_captures(name, monkeypatch):
    monkeypatch.setenv("HETFORGE_COMPILE_CACHE", "0")  # both policies must really compile
    loaded = load_model(name)
    static, static_notes = _outputs(loaded, "static", monkeypatch)
    dynamic, notes = _outputs(loaded, "dynamic", monkeypatch)
    assert not any("dynamic export" in n for n in static_notes)
    # one export per module: the first prefill and the first decode make it, the second of each reuses it
    assert ["made now" in n for n in notes] == [True, False, True, False], notes
    assert ["reused" in n for n in notes] == [False, True, False, True], notes
    for a, b in zip(static, dynamic, strict=True):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert x.shape == y.shape
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_specialised_graph_is_static_and_equals_its_own_export():
    loaded = load_model("llama-tiny")
    m = PrefillModule(loaded.model)
    dyn = capture(m, (torch.zeros((1, 32), dtype=torch.long), torch.tensor([31])), stack_traces=False,
                  dynamic_shapes=({1: Dim.DYNAMIC(min=2, max=64)}, None))
    assert any(n.target is torch.ops.aten.sym_size.int for n in dyn.gm.graph.nodes)
    inputs = (torch.randint(0, loaded.vocab_size, (1, 48)), torch.tensor([40]))
    sp = specialize(dyn, inputs)
    for n in sp.gm.graph.nodes:
        v = n.meta.get("val")
        assert not isinstance(v, torch.SymInt) and n.target is not torch.ops.aten.sym_size.int, n
        if isinstance(v, torch.Tensor):
            assert all(isinstance(d, int) for d in v.shape), (n, v.shape)
    with torch.no_grad():
        got, want = sp.gm(*inputs), capture(m, inputs).gm(*inputs)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    with pytest.raises(SpecializeError, match="cannot specialise"):
        specialize(dyn, (torch.zeros((1, 96), dtype=torch.long), torch.tensor([95])))  # past its max of 64


def test_unknown_capture_policy_is_a_usage_error(monkeypatch):
    monkeypatch.setenv("HETFORGE_CAPTURE", "sometimes")
    with pytest.raises(UsageError, match="allowed stamped, static, dynamic"):
        capture_policy()
    assert capture_policy("dynamic") == "dynamic"
    monkeypatch.delenv("HETFORGE_CAPTURE")
    assert capture_policy() == "stamped"
