"""The middle-end passes on the tiny zoo models and on small hand-written modules."""

import functools
import gc
import json
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from typer.testing import CliRunner

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands
from hetforge.errors import UsageError
from hetforge.frontend import capture, op_counts
from hetforge.models.zoo import example_inputs, load_model
from hetforge.passes import PASS_NAMES, cleanup, constant_fold, cse, optimize
from hetforge.passes.common import _FAKE_OUTS, dead_code, graph_pass, set_val
from hetforge.verify import compare_logits, verify

_load_commands()
runner = CliRunner()

MODELS = ["gpt2-tiny", "llama-tiny", "qwen2-tiny", "mixtral-tiny"]
UNFUSED_ACTS = ("aten.relu.default", "aten.gelu.default", "aten.silu.default", "aten.tanh.default")


@functools.cache
def _captured(name: str, attn: str):
    loaded = load_model(name, attn=attn)
    inputs = example_inputs(loaded, seq=10)
    return loaded, inputs, capture(loaded.logits_module(), inputs, name=name)


@functools.cache
def _optimized(name: str, attn: str):
    loaded, inputs, cg = _captured(name, attn)
    return optimize(cg.gm, inputs)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", MODELS)
def test_zoo_models_fuse_fully_and_keep_logits(name, attn):
    loaded, inputs, cg = _captured(name, attn)
    code_before, nodes_before = cg.gm.code, len(cg.gm.graph.nodes)
    res = _optimized(name, attn)
    layers = loaded.config.num_hidden_layers
    fused = res.fused
    assert fused["attention"] == layers
    counts = op_counts(res.gm)
    assert counts["aten.softmax.int"] == 0  # mixtral's router softmax is inside hetforge::moe now
    assert counts["aten.scaled_dot_product_attention.default"] == 0
    if name == "gpt2-tiny":
        assert fused["layer_norm"] == 2 * layers + 1 and fused["linear_act"] == layers
    else:
        assert fused["rms_norm"] == 2 * layers + 1
        assert counts["aten.rsqrt.default"] == 0
    if name in ("llama-tiny", "qwen2-tiny"):
        assert fused["gated_mlp"] == layers
    assert fused["moe"] == (layers if name == "mixtral-tiny" else 0)
    assert counts["aten.topk.default"] == 0 and counts["aten.bmm.default"] == 0
    assert not any(counts[a] for a in UNFUSED_ACTS), counts
    rep = verify(loaded.logits_module(), res.gm, inputs, kl_threshold=1e-8)
    assert rep.passed and rep.top1_agree == 1.0, rep
    # the input graph is untouched, and every node the passes made carries a fake value
    assert cg.gm.code == code_before and len(cg.gm.graph.nodes) == nodes_before
    for n in res.gm.graph.nodes:
        if n.op in ("call_function", "get_attr") and n.target != torch.ops.aten._assert_scalar.default:
            assert "val" in n.meta, n


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", MODELS)
def test_pipeline_is_idempotent(name, attn):
    first = _optimized(name, attn)
    again = optimize(first.gm)
    assert all(not p.rewrites for p in again.passes), [(p.name, p.rewrites[:2]) for p in again.passes]
    assert again.nodes_after == first.nodes_after
    assert op_counts(again.gm) == op_counts(first.gm)


def test_bert_layer_norms_and_attention_fuse():
    loaded = load_model("bert-tiny", attn="eager")
    inputs = example_inputs(loaded, seq=8)
    res = optimize(capture(loaded.logits_module(), inputs).gm, inputs)
    assert res.fused["attention"] == 2 and res.fused["layer_norm"] == 6 and res.fused["linear_act"] >= 2
    assert verify(loaded.logits_module(), res.gm, inputs, kl_threshold=1e-8).passed


def test_dynamic_sequence_graph_fuses_and_runs_other_lengths():
    loaded = load_model("llama-tiny", attn="eager")
    cg = capture(loaded.logits_module(), example_inputs(loaded, seq=8),
                 dynamic_dims={0: {1: ("seq", 2, 64)}, 1: {1: ("seq", 2, 64)}})
    res = optimize(cg.gm)
    assert res.fused["attention"] == 2 and res.fused["gated_mlp"] == 2 and res.fused["rms_norm"] == 5
    assert verify(loaded.logits_module(), res.gm, example_inputs(loaded, seq=19), kl_threshold=1e-8).passed


def test_verify_each_and_dump_dir(tmp_path):
    loaded, inputs, cg = _captured("llama-tiny", "eager")
    res = optimize(cg.gm, inputs, verify_each=True, dump_dir=tmp_path / "g")
    files = sorted(p.name for p in (tmp_path / "g").iterdir())
    assert files == ["00_input.txt"] + [f"{i + 1:02d}_{n}.txt" for i, n in enumerate(PASS_NAMES)]
    attn_file = tmp_path / "g" / f"{PASS_NAMES.index('attention') + 1:02d}_attention.txt"
    assert "hetforge.attention.default" in attn_file.read_text()
    for p in res.passes:
        assert p.fidelity is not None and p.fidelity["passed"], (p.name, p.fidelity)
        assert p.seconds > 0


def test_pass_subset_and_bad_names():
    loaded, inputs, cg = _captured("gpt2-tiny", "sdpa")
    res = optimize(cg.gm, passes="cleanup,attention")
    assert [p.name for p in res.passes] == ["cleanup", "attention"] and res.fused["attention"] == 2
    assert res.fused["layer_norm"] == 0
    with pytest.raises(UsageError, match="valid passes: cleanup, constant_fold"):
        optimize(cg.gm, passes=["cleanup", "fuse_everything"])
    with pytest.raises(UsageError):
        optimize(cg.gm, verify_each=True)  # needs inputs
    with pytest.raises(UsageError, match="not a folder"):
        optimize(cg.gm, dump_dir=__file__)


# ---------------------------------------------------------------- hand-written modules


class _Attn(nn.Module):
    """Eager attention with knobs for the near-miss cases."""

    def __init__(self, softmax_dim=-1, tensor_scale=False, mask="add", div=False, gqa=1, swap=False, upcast=False):
        super().__init__()
        self.softmax_dim, self.mask, self.div, self.gqa, self.swap = softmax_dim, mask, div, gqa, swap
        self.upcast = upcast
        self.scale = nn.Parameter(torch.rand(1, 4, 1, 1) + 0.5) if tensor_scale else None
        self.proj = nn.Linear(16, 16 + 2 * 16 // gqa)

    def forward(self, x, m):
        b, s, _ = x.shape
        q, k, v = self.proj(x).split([16, 16 // self.gqa, 16 // self.gqa], -1)
        q = q.view(b, s, 4, 4).transpose(1, 2)
        k = k.view(b, s, 4 // self.gqa, 4).transpose(1, 2)
        v = v.view(b, s, 4 // self.gqa, 4).transpose(1, 2)
        if self.gqa > 1:  # Hugging Face repeat_kv
            k = k[:, :, None].expand(b, 4 // self.gqa, self.gqa, s, 4).reshape(b, 4, s, 4)
            v = v[:, :, None].expand(b, 4 // self.gqa, self.gqa, s, 4).reshape(b, 4, s, 4)
        w = q @ k.transpose(-1, -2)
        if self.scale is not None:
            w = self.scale * w if self.swap else w * self.scale
        else:
            w = w / 2.0 if self.div else (0.5 * w if self.swap else w * 0.5)
        if self.mask == "add":
            w = m + w if self.swap else w + m
        elif self.mask == "where":
            w = torch.where(m > -1.0, w, torch.finfo(w.dtype).min)
        if self.upcast:  # Hugging Face eager in half precision
            return torch.softmax(w, dim=self.softmax_dim, dtype=torch.float32).to(w.dtype) @ v
        return torch.softmax(w, dim=self.softmax_dim) @ v


def _run(module, inputs):
    module = module.eval()
    cg = capture(module, inputs)
    res = optimize(cg.gm, inputs)
    with torch.no_grad():
        want = module(*inputs)
        got = res.gm(*inputs)
    return res, want, got


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 16, generator=g)
    m = torch.zeros(1, 1, 6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), -1e9)
    return x, m


@pytest.mark.parametrize("kw", [dict(), dict(div=True), dict(mask="where"), dict(mask="none"), dict(gqa=2),
                                dict(swap=True)])
def test_attention_variants_fuse(kw):
    torch.manual_seed(0)
    res, want, got = _run(_Attn(**kw), _inputs())
    assert res.fused["attention"] == 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    rw = next(p for p in res.passes if p.name == "attention").rewrites[0]
    assert ("gqa=4/2" in rw.detail) == (kw.get("gqa") == 2)
    assert "scale=0.5" in rw.detail and ("mask=no" in rw.detail) == (kw.get("mask") == "none")


@pytest.mark.parametrize("kw, reason", [
    (dict(softmax_dim=-2), "softmax over dim -2"),
    (dict(tensor_scale=True), "not a scalar constant"),
    (dict(tensor_scale=True, swap=True), "not a scalar constant"),
])
def test_attention_near_misses_are_left_alone(kw, reason):
    torch.manual_seed(0)
    res, want, got = _run(_Attn(**kw), _inputs())
    assert res.fused["attention"] == 0
    misses = next(p for p in res.passes if p.name == "attention").near_misses
    assert len(misses) == 1 and reason in misses[0].reason, misses
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


class _BufferMaskAttn(nn.Module):
    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, q, k, v):
        if self.mask.dtype == torch.bool:  # a boolean mask reaches the fused op through SDPA
            return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=0.5)
        return torch.softmax(q @ k.transpose(-1, -2) * 0.5 + self.mask, dim=-1) @ v


def _causal_masks() -> dict[str, tuple[torch.Tensor, bool]]:
    """name → (a constant mask for 6 × 6 scores, whether it is exactly causal)."""
    hidden = torch.ones(6, 6, dtype=torch.bool).triu(1)
    ninf = torch.zeros(6, 6).masked_fill(hidden, float("-inf"))
    lowest = torch.zeros(6, 6).masked_fill(hidden, torch.finfo(torch.float32).min)
    big = torch.zeros(6, 6).masked_fill(hidden, -1e9)  # a large finite value is not exactly "hidden"
    one_off = ninf.clone()
    one_off[3, 1] = float("-inf")  # hides a key below the diagonal
    window = ninf.masked_fill(torch.ones(6, 6, dtype=torch.bool).tril(-3), float("-inf"))  # sliding window
    bias = ninf.clone()
    bias[2, 0] = 0.25  # a visible position with a bias
    return {"-inf": (ninf, True), "finfo.min": (lowest, True), "bool tril": (~hidden, True),
            "4-D broadcast": (ninf[None, None], True), "-1e9": (big, False), "one more hidden": (one_off, False),
            "sliding window": (window, False), "biased": (bias, False), "bool window": (~window.isinf(), False)}


@pytest.mark.parametrize("name", list(_causal_masks()))
def test_only_an_exactly_causal_constant_mask_becomes_is_causal(name):
    mask, causal = _causal_masks()[name]
    q, k, v = (torch.randn(1, 4, 6, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    res, want, got = _run(_BufferMaskAttn(mask), (q, k, v))
    assert res.fused["attention"] == 1
    node = next(n for n in res.gm.graph.nodes if n.target == torch.ops.hetforge.attention.default)
    assert (node.args[3] is None and node.args[5] is True) == causal, node.args
    rw = next(p for p in res.passes if p.name == "attention").rewrites[0]
    assert ("a constant causal mask" in rw.detail) == causal
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_bfloat16_attention_with_float32_softmax_fuses():
    torch.manual_seed(0)
    x, m = _inputs()
    res, want, got = _run(_Attn(upcast=True).to(torch.bfloat16), (x.bfloat16(), m.bfloat16()))
    assert res.fused["attention"] == 1
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)  # bf16 rounding of a different op order


def test_linear_act_near_miss_when_preactivation_is_reused():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            y = torch.relu(self.b(x))  # fusable
            return torch.nn.functional.gelu(h) + h + y  # h is used twice: not fusable

    res, want, got = _run(M(), (torch.randn(3, 8),))
    assert res.fused["linear_act"] == 1
    misses = next(p for p in res.passes if p.name == "op_fusion").near_misses
    assert len(misses) == 1 and "also used outside" in misses[0].reason
    torch.testing.assert_close(got, want)


def test_rms_norm_in_bfloat16_keeps_hugging_face_casts():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = LlamaRMSNorm(16)
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return self.lin(self.norm(x))

    torch.manual_seed(0)
    m = M().to(torch.bfloat16)
    with torch.no_grad():
        m.norm.weight.uniform_(0.5, 1.5)
    res, want, got = _run(m, (torch.randn(2, 5, 16, dtype=torch.bfloat16),))
    assert res.fused["rms_norm"] == 1
    assert torch.equal(got, want)


def test_rms_norm_over_wrong_dim_is_a_near_miss():
    class M(nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)

    res, want, got = _run(M(), (torch.randn(2, 5, 16),))
    assert res.fused["rms_norm"] == 0
    misses = next(p for p in res.passes if p.name == "norm_fusion").near_misses
    assert len(misses) == 1 and "mean over dims" in misses[0].reason
    torch.testing.assert_close(got, want)


def test_cse_and_folding_limit():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            a = torch.sin(x) * 2
            b = torch.sin(x) * 2  # same expression
            return a + b + x @ self.w.t().exp()  # the transpose+exp of the weight is constant

    m = M().eval()
    x = (torch.randn(4, 16),)
    gm = capture(m, x).gm
    c = cse(gm)
    assert len(c.rewrites) == 2 and op_counts(c.gm)["aten.sin.default"] == 1
    folded = constant_fold(gm)
    assert [r.kind for r in folded.rewrites] == ["fold"] and op_counts(folded.gm)["aten.exp.default"] == 0
    limited = constant_fold(gm, max_bytes=100)
    assert not limited.rewrites and "folding limit" in limited.near_misses[0].reason
    with torch.no_grad():
        torch.testing.assert_close(folded.gm(*x), m(*x))
        torch.testing.assert_close(c.gm(*x), m(*x))


@torch.library.custom_op("hftest::mystery", mutates_args=())
def _mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 3 + 1


@_mystery.register_fake
def _(x):
    return torch.empty_like(x)


def test_unknown_ops_pass_through_and_are_reported():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.lin(torch.ops.hftest.mystery(x)))

    res, want, got = _run(M(), (torch.randn(2, 8),))
    assert res.unknown_ops == {"hftest.mystery.default": 1} and res.fused["linear_act"] == 1
    torch.testing.assert_close(got, want)


def test_constants_written_in_place_are_not_folded():
    class M(nn.Module):
        def forward(self, x):
            c = torch.arange(4.0)
            c.add_(x.sum())  # a folded buffer would keep this write for the next call
            return x + c

    m = M()
    x = torch.randn(3, 4)
    res = optimize(capture(m, (x,)).gm, (x,))
    fold = next(p for p in res.passes if p.name == "constant_fold")
    assert not fold.rewrites and "in-place" in fold.near_misses[0].reason
    for _ in range(2):
        torch.testing.assert_close(res.gm(x), m(x))


def test_cleanup_keeps_training_dropout_and_removes_eval_dropout():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.ops.aten.dropout.default, (x, 0.1, False))
    b = g.call_function(torch.ops.aten.dropout.default, (a, 0.1, True))
    g.output(b)
    gm = torch.fx.GraphModule(nn.Module(), g)
    res = cleanup(gm)
    targets = [n.args for n in res.gm.graph.nodes if n.op == "call_function"]
    assert len(targets) == 1 and targets[0][2] is True
    assert len(res.rewrites) == 1 and "training mode" in res.near_misses[0].reason
    assert len(gm.graph.nodes) == 4  # input untouched


# ---------------------------------------------------------------- CLI


def test_cli_optimize_json():
    r = runner.invoke(app, ["optimize", "llama-tiny", "--seq", "8", "--attn", "eager", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [p["name"] for p in d["passes"]] == list(PASS_NAMES)
    assert set(d["passes"][0]) >= {"name", "nodes_before", "nodes_after", "rewrites", "near_misses", "seconds"}
    assert d["fused"] == {"attention": 2, "linear_act": 0, "gated_mlp": 2, "rotary": 4, "rms_norm": 5, "layer_norm": 0,
                         "moe": 0}
    assert d["kl_mean"] < 1e-8 and d["max_abs_err"] < 1e-4


def test_cli_table_and_bad_pass_name():
    r = runner.invoke(app, ["optimize", "gpt2-tiny", "--seq", "8", "--passes", "cleanup,attention", "--verify-each"])
    assert r.exit_code == 0, r.output
    assert "attention" in r.output and "PASS" in r.output and "measured" in r.output
    r = runner.invoke(app, ["optimize", "gpt2-tiny", "--passes", "cleanup,fusion"])
    assert r.exit_code == 2
    assert "unknown pass 'fusion'" in r.output and "norm_fusion" in r.output


def test_compare_logits_sees_a_wrong_rewrite():
    """The fidelity check used above can fail: a rewrite that changes the scale is caught."""
    loaded, inputs, cg = _captured("llama-tiny", "sdpa")
    res = _optimized("llama-tiny", "sdpa")
    gm = res.gm
    node = next(n for n in gm.graph.nodes if n.target == torch.ops.hetforge.attention.default)
    old = node.args
    node.args = (*old[:4], old[4] * 1.5, old[5])
    gm.recompile()
    try:
        with torch.no_grad():
            rep = compare_logits(loaded.logits_module()(*inputs), gm(*inputs), kl_threshold=1e-8)
        assert not rep.passed
    finally:
        node.args = old
        gm.recompile()


class _Rope(nn.Module):
    """Hugging Face's apply_rotary_pos_emb on q and k; ``half`` moves the split point for the negative case."""

    def __init__(self, half: int | None = None):
        super().__init__()
        self.half = half

    def forward(self, q, k, cos, sin):
        def rot(x):
            h = self.half or x.shape[-1] // 2
            return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _rope_inputs():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(1, 4, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g),
            torch.randn(1, 5, 8, generator=g), torch.randn(1, 5, 8, generator=g))


def test_rotary_embedding_fuses_to_one_node_bit_equal():
    inputs = _rope_inputs()
    cg = capture(_Rope(), inputs)
    res = optimize(cg.gm, inputs)
    assert res.fused["rotary"] == 2
    counts = op_counts(res.gm)
    assert not any(k in counts for k in ("aten.neg.default", "aten.cat.default", "aten.slice.Tensor"))
    for got, want in zip(res.gm(*inputs), _Rope()(*inputs), strict=True):
        assert torch.equal(got, want)


def test_rotary_with_an_uneven_split_is_left_alone():
    inputs = _rope_inputs()
    cg = capture(_Rope(half=3), inputs)  # not rotate_half: x[..., 3:] / x[..., :3]
    res = optimize(cg.gm, inputs)
    assert res.fused["rotary"] == 0
    for got, want in zip(res.gm(*inputs), _Rope(half=3)(*inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---------------------------------------------------------------- the pipeline's own costs


_DCE_OPS = [  # (target, arity, impure): impure ones must survive without users
    (torch.ops.aten.add.Tensor, 2, False), (torch.ops.aten.mul.Tensor, 2, False),
    (torch.ops.aten.relu.default, 1, False), (torch.ops.aten.neg.default, 1, False),
    (torch.ops.aten.add_.Tensor, 2, True), (torch.ops.aten.rand_like.default, 1, True),
]


def _random_graph(ops: list[tuple[int, list[int]]], outputs: list[int]) -> torch.fx.Graph:
    g = torch.fx.Graph()
    nodes = [g.placeholder("x"), g.placeholder("y")]
    for op, picks in ops:
        target, arity, _ = _DCE_OPS[op]
        nodes.append(g.call_function(target, tuple(nodes[p % len(nodes)] for p in picks[:arity])))
    g.output(tuple(nodes[o % len(nodes)] for o in outputs))
    return g


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_DCE_OPS) - 1), st.lists(st.integers(0, 40), min_size=2, max_size=2)),
                max_size=30),
       st.lists(st.integers(0, 40), min_size=1, max_size=3))
def test_dead_code_erases_exactly_what_torch_eliminate_dead_code_erases(ops, outputs):
    ours, theirs = _random_graph(ops, outputs), _random_graph(ops, outputs)
    assert dead_code(ours) == theirs.eliminate_dead_code()
    assert [n.name for n in ours.nodes] == [n.name for n in theirs.nodes]
    kept = {n.name for n in ours.nodes}
    for n, (op, _) in zip(list(_random_graph(ops, outputs).nodes)[2:], ops, strict=False):
        if _DCE_OPS[op][2]:
            assert n.name in kept, n  # an in-place or random op stays even when nothing reads it


def test_dead_code_asks_each_call_target_once_per_sweep(monkeypatch):
    g = _random_graph([(0, [0, 1])] * 20 + [(2, [2, 0])] * 20 + [(4, [0, 1])] * 3, [0])
    asked: list = []
    real = torch.fx.Node.is_impure
    monkeypatch.setattr(torch.fx.Node, "is_impure", lambda self, *a: asked.append(self.target) or real(self, *a))
    dead_code(g)
    calls = [t for t in asked if not isinstance(t, str)]
    assert sorted(map(str, calls)) == sorted(map(str, {torch.ops.aten.add.Tensor, torch.ops.aten.relu.default,
                                                        torch.ops.aten.add_.Tensor}))
    assert sum(n.target is torch.ops.aten.add_.Tensor for n in g.nodes) == 3  # impure, kept


def test_fused_nodes_get_their_own_fake_values_equal_to_their_fake_kernels_and_real_shapes():
    """A fused op's fake kernel runs once per argument metadata (set_val's memo); every node still gets its own
    fake tensors, with the shape, stride and dtype its fake kernel gives when run for that node alone, and the
    shape and dtype the graph computes on real inputs."""
    loaded, inputs, _ = _captured("llama-tiny", "eager")
    cg = capture(loaded.logits_module(), inputs)  # its own fake mode, so the memo starts empty
    res = optimize(cg.gm, inputs)
    fused = [n for n in res.gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("hetforge.")]
    vals = [n.meta["val"] for n in fused]
    assert len({id(v) for v in vals}) == len(vals) and len(fused) >= 10
    mode = vals[0].fake_mode
    assert 0 < len(_FAKE_OUTS[mode]) < len(fused)  # fake kernels run fewer times than there are fused nodes
    real: dict[str, torch.Tensor] = {}

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            real[n.name] = out
            return out

    with torch.no_grad():
        Record(res.gm).run(*inputs)
    for n, v in zip(fused, vals, strict=True):
        args = torch.utils._pytree.tree_map_only(torch.fx.Node, lambda a: a.meta["val"], (n.args, n.kwargs))
        with mode:
            alone = n.target(*args[0], **args[1])
        assert (v.shape, v.stride(), v.dtype) == (alone.shape, alone.stride(), alone.dtype), n
        assert (v.shape, v.dtype) == (real[n.name].shape, real[n.name].dtype), n


def test_set_val_keys_its_memo_by_dtype_and_shape_and_does_not_keep_the_fake_mode_alive():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    g = torch.fx.Graph()
    outs = []
    for shape, dtype in [((2, 8), torch.float32), ((2, 8), torch.bfloat16), ((3, 8), torch.float32),
                         ((2, 8), torch.float32)]:
        x = g.placeholder(f"x{len(outs)}")
        with mode:
            x.meta["val"] = torch.empty(shape, dtype=dtype)
        n = g.call_function(torch.ops.hetforge.rms_norm.default, (x, None, 1e-6))
        set_val(n, mode)
        outs.append(n.meta["val"])
    assert [(tuple(o.shape), o.dtype) for o in outs] == [((2, 8), torch.float32), ((2, 8), torch.bfloat16),
                                                         ((3, 8), torch.float32), ((2, 8), torch.float32)]
    assert len(_FAKE_OUTS[mode]) == 3 and outs[3] is not outs[0]
    ref = weakref.ref(mode)
    del mode, g, outs, x, n
    gc.collect()
    assert ref() is None  # the memo keeps metadata, not fake tensors (which would keep their mode alive)


def _rename_pass():
    @graph_pass("cse")
    def broken(gm, log):  # two nodes of one name: Graph.lint's "redefined name"
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        calls[1].name = calls[0].name

    return broken


def test_a_malformed_graph_fails_the_pipeline_and_names_its_pass_when_verifying(monkeypatch):
    import hetforge.passes.manager as manager

    loaded, inputs, cg = _captured("gpt2-tiny", "sdpa")
    monkeypatch.setitem(manager.PASSES, "cse", _rename_pass())
    with pytest.raises(RuntimeError, match="redefined name"):
        optimize(cg.gm, inputs)  # linted once, at the end
    with pytest.raises(Exception, match="'cse' pass") as err:
        optimize(cg.gm, inputs, verify_each=True)  # linted after each pass
    assert "redefined name" in str(err.value.__cause__)
