"""Cold compile speed-ups that must not change what is compiled: lazily generated graph-module code during
capture, the garbage collector kept off the process's existing objects while compiling, and the MoE pass's
numerical check on a narrow instance of the experts first."""

import gc

import pytest
import torch

import hetforge.frontend as fe
import hetforge.passes.moe as moe
from hetforge.compile import compile_graph
from hetforge.models.zoo import example_inputs, load_model
from hetforge.passes import optimize


@pytest.fixture
def eager_capture(monkeypatch):
    """Captures take torch's public path (plain ``GraphModule`` s), as on a torch without the lazy class."""
    monkeypatch.setattr(fe, "_LAZY", [None])


def _count_real_recompiles(monkeypatch) -> list[int]:
    calls = [0]
    original = torch.fx.GraphModule.recompile

    def counted(self):
        calls[0] += 1
        return original(self)

    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counted)
    return calls


def test_capture_takes_the_lazy_path_on_this_torch(monkeypatch):
    loaded = load_model("llama-tiny")
    inputs = example_inputs(loaded, seq=8)
    calls = _count_real_recompiles(monkeypatch)
    cg = fe.capture(loaded.logits_module(), inputs)
    lazy_calls = calls[0]
    assert fe.is_lazy(cg.gm)
    monkeypatch.setattr(fe, "_LAZY", [None])
    calls[0] = 0
    cg2 = fe.capture(loaded.logits_module(), inputs)
    assert not fe.is_lazy(cg2.gm)
    # torch.export regenerates the module's code several times per capture; lazily, once at most (ep.module()
    # reads the forward's signature)
    assert lazy_calls <= 1 < calls[0]
    # outside a capture, graph modules are torch's own again
    assert not fe.is_lazy(torch.fx.GraphModule(cg.gm, cg.gm.graph))


@pytest.mark.parametrize("name", ["gpt2", "llama-110m"])
def test_lazy_capture_compiles_the_same_program_as_the_public_path(name, monkeypatch):
    loaded = load_model(name)
    inputs = example_inputs(loaded, seq=16)
    module = loaded.logits_module().eval()
    got = {}
    for lazy in (True, False):
        if not lazy:
            monkeypatch.setattr(fe, "_LAZY", [None])
        cg = fe.capture(module, inputs, stack_traces=False)
        assert fe.is_lazy(cg.gm) == lazy
        res = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name)
        with torch.no_grad():
            got[lazy] = (cg.gm.code, res.gm.code, len(res.program.instrs), cg.gm(*inputs), res.executable(*inputs))
    a, b = got[True], got[False]
    assert a[:3] == b[:3]
    assert torch.equal(a[3], b[3])
    assert torch.equal(a[4][0] if isinstance(a[4], (tuple, list)) else a[4],
                       b[4][0] if isinstance(b[4], (tuple, list)) else b[4])


def test_dynamic_capture_with_guards_runs_lazily():
    loaded = load_model("llama-tiny")
    inputs = example_inputs(loaded, seq=8)
    cg = fe.capture(loaded.logits_module(), inputs, dynamic_dims={0: {1: ("seq", 2, 64)}, 1: {1: ("seq", 2, 64)}})
    assert fe.is_lazy(cg.gm)
    other = example_inputs(loaded, seq=20)
    with torch.no_grad():
        want = loaded.logits_module()(*other)
        got = cg.gm(*other)
    got = got[0] if isinstance(got, (tuple, list)) else got
    assert torch.allclose(got, want, atol=1e-5)


def test_public_path_capture_still_works(eager_capture):
    loaded = load_model("llama-tiny")
    inputs = example_inputs(loaded, seq=8)
    cg = fe.capture(loaded.logits_module(), inputs)
    assert not fe.is_lazy(cg.gm)
    with fe.lazy_recompile() as lazy:
        assert lazy is False


def test_gc_frozen_freezes_inside_and_restores_and_nests():
    if gc.get_freeze_count():  # the test process froze objects itself: the block must leave them alone
        with fe.gc_frozen() as did:
            assert did is False
        return
    with fe.gc_frozen() as did:
        assert did is True and gc.get_freeze_count() > 0
        with fe.gc_frozen() as inner:
            assert inner is False
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_gc_frozen_leaves_a_disabled_collector_alone():
    was = gc.isenabled()
    gc.disable()
    try:
        with fe.gc_frozen() as did:
            assert did is False and gc.get_freeze_count() == 0
    finally:
        if was:
            gc.enable()


def test_gc_frozen_leaves_the_process_s_own_frozen_objects_frozen():
    if gc.get_freeze_count():
        pytest.skip("the test process froze objects itself before this test: it checks that gc_frozen leaves a "
                    "freeze it did not make alone, which needs a freeze of its own made from an unfrozen start")
    probe = [1, 2]  # a tracked container of this test's, frozen with the rest
    gc.freeze()
    try:
        with fe.gc_frozen() as did:
            assert did is False
        # still in the permanent generation (gc.get_objects() leaves it out); the freeze count itself may drop
        # meanwhile, when some other frozen object is freed
        assert gc.get_freeze_count() > 0 and not any(o is probe for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is probe for o in gc.get_objects())


@pytest.mark.parametrize("name", ["mixtral-tiny", "qwen2-moe-tiny", "olmoe-tiny", "mixtral-small"])
def test_moe_narrow_check_picks_the_layout_the_full_check_picks(name, monkeypatch):
    loaded = load_model(name)
    inputs = example_inputs(loaded, seq=12)
    got = {}
    default = moe.NARROW_F
    for narrow in (default, 0):
        monkeypatch.setattr(moe, "NARROW_F", narrow)
        cg = fe.capture(loaded.logits_module(), inputs, name=name)
        res = optimize(cg.gm, inputs)
        details = [r.detail for r in next(p for p in res.passes if p.name == "moe").rewrites]
        assert details and res.fused["moe"] == loaded.config.num_hidden_layers
        with torch.no_grad():
            out = res.gm(*inputs)
        got[narrow] = (res.gm.code, out[0] if isinstance(out, (tuple, list)) else out, details)
    narrow, full = got[default], got[0]
    assert narrow[0] == full[0] and torch.equal(narrow[1], full[1])
    assert any("slice of the experts" in d for d in narrow[2]), narrow[2]  # the narrow check was what decided
    assert not any("slice of the experts" in d for d in full[2])


def test_a_capture_without_guards_generates_no_code_and_lowers_to_the_same_program(monkeypatch):
    loaded = load_model("gpt2-tiny")
    inputs = example_inputs(loaded, seq=8)
    module = loaded.logits_module().eval()
    calls = _count_real_recompiles(monkeypatch)
    bare = fe.capture(module, inputs, stack_traces=False, guards=False)
    assert calls[0] == 0  # the guard's signature read is what generated the module's code
    guarded = fe.capture(module, inputs, stack_traces=False)
    modules = {str(n.target) for n in guarded.gm.graph.nodes if n.op == "call_module"}
    assert "_guards_fn" in modules  # what guards=False leaves out
    assert not [n for n in bare.gm.graph.nodes if n.op == "call_module"]
    a = compile_graph(bare.gm, soc="host", example_inputs=inputs, name="bare")
    b = compile_graph(guarded.gm, soc="host", example_inputs=inputs, name="guarded")
    assert [(i.op, i.device) for i in a.program.instrs] == [(i.op, i.device) for i in b.program.instrs]
    with torch.no_grad():
        x, y = a.executable(*inputs), b.executable(*inputs)
    assert torch.equal(x[0] if isinstance(x, (tuple, list)) else x, y[0] if isinstance(y, (tuple, list)) else y)
