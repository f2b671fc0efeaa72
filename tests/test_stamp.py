"""Capture by stamping (hetforge.runtime.stamp): two layers exported, the rest copied from layer 1. The graph must be
the whole export's, node for node (targets, layers, weights, inputs; a copy's node names may differ), and compute
the same outputs bit for bit; non-uniform layers must be refused."""

import pytest
import torch

from hetforge.frontend import capture, param_paths
from hetforge.models.zoo import ZOO, LoadedModel, LogitsModule, _build
from hetforge.placement.layers import layer_index
from hetforge.runtime import Engine, SamplingParams
from hetforge.runtime.batched import BatchedDecodeModule
from hetforge.runtime.stamp import StampRefused, capture_stamped, find_stack
from hetforge.runtime.static_kv import ChunkModule, DecodeModule, PrefillModule, model_dims


def _deep(name: str, layers: int = 4, **config) -> LoadedModel:
    """Zoo model ``name`` with ``layers`` layers (the tiny ones have 2: nothing to stamp), seeded weights."""
    spec = ZOO[name]
    cfg = spec.make_config()
    for k, v in config.items():
        setattr(cfg, k, v)
    setattr(cfg, "n_layer" if "n_layer" in vars(cfg) else "num_hidden_layers", layers)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1] * layers
    torch.manual_seed(0)
    model = _build(spec, cfg, "sdpa").eval()
    return LoadedModel(spec.name, spec.family, spec.kind, model, model.config, "sdpa", "seeded random (seed 0)")


def _cases(model, g):
    layers, kv, hd = model_dims(model)
    vocab = model.config.vocab_size

    def cache(b=1):
        return [torch.randn(b, kv, 48, hd, generator=g) for _ in range(2 * layers)]

    return [
        (PrefillModule, (torch.randint(0, vocab, (1, 16), generator=g), torch.tensor([11]))),
        (DecodeModule, (torch.randint(0, vocab, (1, 1), generator=g), torch.tensor([[30]]), *cache())),
        (ChunkModule, (torch.randint(0, vocab, (1, 4), generator=g), torch.arange(20, 24).unsqueeze(0),
                       torch.tensor([3]), *cache())),
        (BatchedDecodeModule, (torch.randint(0, vocab, (2, 1), generator=g), torch.tensor([[30], [12]]), *cache(2))),
        (LogitsModule, (torch.randint(0, vocab, (1, 12), generator=g), torch.ones((1, 12), dtype=torch.long))),
    ]


def _summary(gm):
    calls = [(str(n.target), layer_index(n)) for n in gm.graph.nodes if n.op == "call_function"]
    attrs = sorted(str(n.target) for n in gm.graph.nodes if n.op == "get_attr")
    inputs = [(n.name, n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder"]
    return calls, attrs, inputs


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "qwen2-tiny", "mixtral-tiny"])
def test_stamped_graph_is_the_whole_export_node_for_node_with_the_same_outputs(name):
    loaded = _deep(name)
    g = torch.Generator().manual_seed(0)
    layers = model_dims(loaded.model)[0]
    assert layers >= 3, "a stamped capture needs layers to copy"
    for cls, inputs in _cases(loaded.model, g):
        stamped = capture_stamped(cls(loaded.model), inputs, "t")
        whole = capture(cls(loaded.model), inputs, stack_traces=False, guards=False)
        assert _summary(stamped.gm) == _summary(whole.gm), cls.__name__
        assert stamped.param_paths == whole.param_paths
        assert f"2 of {layers} layers exported" in stamped.note
        with torch.no_grad():
            got, want = stamped.gm(*inputs), whole.gm(*inputs)
        if cls is LogitsModule:  # one tensor out, as the whole export gives
            assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
            got, want = [got], [want]
        else:
            assert len(got) == len(want) == 1 + 2 * layers
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    # the model is whole again afterwards
    assert len(find_stack(loaded.model).blocks) == layers == model_dims(loaded.model)[0]


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "qwen2-tiny", "mixtral-tiny"])
def test_passes_on_two_layers_then_stamped_give_the_graph_of_the_passes_on_all_layers(name):
    """compile_graph(expand=...): the passes run on the two exported layers and the rest is stamped after them.
    The graph, its pass report's node and fused-op counts and its outputs (bit for bit) must be those of the
    passes run on the whole stamped capture. Mixtral's MoE op reads weights the MoE pass stacks per layer (new
    constants): refused, and the passes then run on the whole graph."""
    from hetforge.compile import _passes_then_stamp
    from hetforge.passes import optimize
    from hetforge.runtime.stamp import capture_layers

    loaded = _deep(name)
    g = torch.Generator().manual_seed(0)
    for cls, inputs in _cases(loaded.model, g):
        cg = capture_layers(cls(loaded.model), inputs, "t", defer=True)
        d = cg.deferred
        assert len(d.two_inputs) < len(inputs) or cls is LogitsModule or cls is PrefillModule
        gm, opt, _ = _passes_then_stamp(cg.gm, inputs, True, d)
        ref = optimize(capture_stamped(cls(loaded.model), inputs, "t").gm, example_inputs=inputs)
        assert d.stamped == (name != "mixtral-tiny"), (cls.__name__, d.refused)
        if not d.stamped:
            assert "moe" in d.refused and "before the passes (stamping the optimized layers refused" in d.note()
        else:
            assert "stamped from layer 1 after the passes" in d.note()
        assert _summary(gm) == _summary(ref.gm), cls.__name__
        # the weights' paths follow the stamped graph: every layer's, not two
        assert cg.param_paths == (param_paths(ref.gm, cls(loaded.model)) if d.stamped else
                                  capture_stamped(cls(loaded.model), inputs, "t").param_paths)
        assert (opt.nodes_before, opt.nodes_after, opt.fused) == (ref.nodes_before, ref.nodes_after, ref.fused)
        with torch.no_grad():
            got, want = gm(*inputs), ref.gm(*inputs)
        got, want = ([got], [want]) if isinstance(got, torch.Tensor) else (got, want)
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_a_constant_the_passes_made_is_never_taken_as_equal_by_value():
    """Layers 0 and 1 made equal, layers 2 and 3 not. A pass that reads each layer's norm weight through a new
    constant (as folding a per-layer expression would) leaves two equal constants: equal by value is how the
    capture's own constants are matched, but a made one may come from its layer's weights, so the optimized
    graph is refused (and would have been accepted without that rule)."""
    from hetforge.passes import copy_gm, optimize
    from hetforge.runtime.stamp import _stamp, capture_layers

    loaded = _deep("llama-tiny")
    blocks = find_stack(loaded.model).blocks
    blocks[1].load_state_dict(blocks[0].state_dict())
    cg = capture_layers(PrefillModule(loaded.model), (torch.zeros((1, 8), dtype=torch.long), torch.tensor([7])), "t",
                        defer=True)
    d = cg.deferred
    optimized = optimize(cg.gm, example_inputs=d.two_inputs).gm

    def folded() -> torch.fx.GraphModule:
        gm = copy_gm(optimized)
        for i, n in enumerate([n for n in gm.graph.nodes if n.op == "get_attr"
                               and str(n.target).endswith("post_attention_layernorm.weight")]):
            gm.register_buffer(f"_folded_{i}", gm.get_parameter(str(n.target)).detach().clone(), persistent=False)
            with gm.graph.inserting_before(n):
                c = gm.graph.get_attr(f"_folded_{i}")
            c.meta = dict(n.meta)
            n.replace_all_uses_with(c)
            gm.graph.erase_node(n)
        gm.recompile()
        return gm

    assert not d.after_passes(folded())
    assert "differs from layer 0's" in d.refused
    assert d.after_passes(copy_gm(optimized))  # the same graph without the made constants is stamped
    _stamp(folded(), d.stack, d.fixed, d.per)  # the capture's rule alone (equal by value) would have stamped it


def test_a_layer_with_its_own_attribute_is_refused_and_the_runtime_exports_the_whole_model(monkeypatch):
    monkeypatch.setenv("HETFORGE_COMPILE_CACHE", "0")
    loaded = _deep("llama-tiny")
    attn = loaded.model.model.layers[2].self_attn
    attn.scaling = attn.scaling * 0.5  # layer 2 scales its scores differently: not a copy of layer 1
    with pytest.raises(StampRefused, match="layer 2 differs from layer 0"):
        find_stack(loaded.model)
    eng = Engine(loaded, executor="auto")
    prog, _ = eng.programs.prefill(32)
    assert prog.notes[0].startswith("capture: the whole module exported (layers not stamped: layer 2 differs")
    ids = torch.randint(0, loaded.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = loaded.model(ids).logits[0, -1]
    torch.testing.assert_close(prog.run(ids, torch.tensor([31]))[0][0], want, rtol=1e-4, atol=1e-4)


def test_a_layer_scaled_by_its_index_is_refused_by_the_module_check():
    loaded = _deep("gpt2-tiny", scale_attn_by_inverse_layer_idx=True)  # layer i's scores divided by i + 1
    with pytest.raises(StampRefused, match="layer 1 differs from layer 0"):
        find_stack(loaded.model)


def test_a_layer_computing_other_constants_is_refused_by_the_graph_check():
    # alike modules whose forward uses the layer's index: only the check of layer 1's graph against layer 0's sees it
    loaded = _deep("gpt2-tiny")
    for i, block in enumerate(loaded.model.transformer.h):
        block.mlp.forward = lambda x, f=block.mlp.forward, s=float(i + 1): f(x) * s
    with pytest.raises(StampRefused, match="layer 1's operation .* differs from layer 0's"):
        capture_stamped(PrefillModule(loaded.model), (torch.zeros((1, 8), dtype=torch.long), torch.tensor([7])), "t")
    assert len(loaded.model.transformer.h) == model_dims(loaded.model)[0]  # restored after the refusal


def test_per_layer_config_lists_and_short_stacks_are_refused():
    loaded = _deep("llama-tiny")
    layers = model_dims(loaded.model)[0]
    loaded.model.config.layer_types = ["full_attention"] * (layers - 1) + ["sliding_attention"]
    with pytest.raises(StampRefused, match="'layer_types' differs between layers"):
        find_stack(loaded.model)
    loaded.model.config.layer_types = ["full_attention"] * layers
    find_stack(loaded.model)  # uniform again: accepted
    loaded.model.model.layers = torch.nn.ModuleList(list(loaded.model.model.layers)[:2])
    loaded.model.config.num_hidden_layers = 2
    with pytest.raises(StampRefused, match="2 layers: nothing to stamp out"):
        find_stack(loaded.model)


def test_engine_generates_the_same_tokens_with_stamped_and_whole_captures(monkeypatch):
    monkeypatch.setenv("HETFORGE_COMPILE_CACHE", "0")
    loaded = _deep("llama-tiny", layers=3)
    got = {}
    for policy in ("stamped", "static"):
        monkeypatch.setenv("HETFORGE_CAPTURE", policy)
        eng = Engine(loaded, executor="auto")
        r = eng.generate(list(range(3, 23)), SamplingParams(max_new_tokens=8, ignore_eos=True))
        got[policy] = r.tokens
        notes = eng.programs.prefill(32)[0].notes
        assert any("layers exported and optimized" in n and "after the passes" in n for n in notes) == \
            (policy == "stamped"), notes
    assert got["stamped"] == got["static"]


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_a_stamped_decode_graph_lowers_to_the_same_views_and_kernels_as_the_whole_export(name):
    """The copied layers keep the fake tensors of layer 1, whose storage lowering does not know; their views
    (GPT-2's q/k/v ``split`` among them) must still lower as views of their input, not as copies."""
    from collections import Counter

    from hetforge.compile import compile_graph

    loaded = _deep(name)
    g = torch.Generator().manual_seed(0)
    _, inputs = _cases(loaded.model, g)[1]
    kinds = {}
    for how in ("stamped", "whole"):
        mod = DecodeModule(loaded.model)
        cg = capture_stamped(mod, inputs, "t") if how == "stamped" else \
            capture(mod, inputs, stack_traces=False, guards=False)
        res = compile_graph(cg.gm, soc="host", example_inputs=inputs, passes=True)
        kinds[how] = Counter((i.op, i.kind, i.attrs.get("kernel")) for i in res.program.instrs)
        with torch.no_grad():
            for x, y in zip(res.executable(*inputs), cg.gm(*inputs), strict=True):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert kinds["stamped"] == kinds["whole"]
    if name == "gpt2-tiny":
        assert kinds["stamped"][("aten.split.Tensor", "view", "static-view")] + \
            kinds["stamped"][("aten.split.Tensor", "view", "view")] == model_dims(loaded.model)[0]


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_compile_model_on_the_stamped_capture_gives_the_whole_exports_program_and_outputs(name):
    """``compile_model(capture_with=capture_layers)`` (what ``hetforge compile`` uses): the same instructions on the
    same devices as from the whole module's export, the same logits bit for bit, and the capture's note says the
    layers were stamped after the passes."""
    import functools

    from hetforge.compile import compile_model
    from hetforge.runtime.stamp import capture_layers

    loaded = _deep(name)
    module = loaded.logits_module().eval()
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, loaded.config.vocab_size, (1, 10), generator=g), torch.ones((1, 10), dtype=torch.long))
    whole = compile_model(module, example_inputs=inputs, name=name)
    stamped = compile_model(module, example_inputs=inputs, name=name,
                            capture_with=functools.partial(capture_layers, defer=True))
    assert "stamped from layer 1 after the passes" in stamped.extra["capture_note"]
    assert stamped.seconds["stamp"] > 0 and "load" in stamped.seconds
    assert [(i.op, i.device) for i in stamped.program.instrs] == [(i.op, i.device) for i in whole.program.instrs]
    with torch.no_grad():
        assert torch.equal(stamped.executable(*inputs), whole.executable(*inputs))
