"""The MoE pass and ``hetforge::moe``: recognition on real HF MoE families, a before/expected rewrite, near-misses
for variants it must not fuse, and the grouped / capacity-limited kernel against a plain per-token reference."""

import contextlib
import functools
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hetforge.ops  # noqa: F401  (registers hetforge::moe)
from hetforge.frontend import capture, op_counts
from hetforge.models.zoo import example_inputs, load_model
from hetforge.ops.moe import auto_group_size, moe_forward, recording
from hetforge.passes import fuse_moe, optimize
from hetforge.verify import verify

MOE_MODELS = ["mixtral-tiny", "qwen2-moe-tiny", "olmoe-tiny"]


@functools.cache
def _optimized(name: str):
    loaded = load_model(name)
    inputs = example_inputs(loaded, seq=12)
    cg = capture(loaded.logits_module(), inputs, name=name)
    return loaded, inputs, optimize(cg.gm, inputs)


@pytest.mark.parametrize("name", MOE_MODELS)
def test_hf_moe_families_fuse_to_one_moe_op_per_layer_and_match_eager(name):
    loaded, inputs, res = _optimized(name)
    layers = loaded.config.num_hidden_layers
    assert res.fused["moe"] == layers
    counts = op_counts(res.gm)
    assert counts["aten.topk.default"] == 0 and counts["aten.bmm.default"] == 0
    moe_pass = next(p for p in res.passes if p.name == "moe")
    assert not moe_pass.near_misses
    details = [r.detail for r in moe_pass.rewrites]
    if name == "qwen2-moe-tiny":
        assert all("shared expert" in d and "renormalised" not in d for d in details)
    if name == "mixtral-tiny":
        assert all("renormalised" in d for d in details)
    rep = verify(loaded.logits_module(), res.gm, inputs, kl_threshold=1e-8)
    assert rep.passed and rep.kl_max < 1e-8 and rep.top1_agree == 1.0, rep


def test_a_bf16_moe_model_fuses_too_and_stays_close_to_its_bf16_eager_run():
    """In bf16 the op and HF's block round intermediates at different points: the numeric check allows two bf16
    rounding steps (not fp32's 1e-4), so the block still fuses (it did not, and ran unfused, before)."""
    loaded = load_model("mixtral-tiny", dtype=torch.bfloat16)
    inputs = example_inputs(loaded, seq=12)
    res = optimize(capture(loaded.logits_module(), inputs, name="mixtral-tiny-bf16").gm, inputs)
    assert res.fused["moe"] == loaded.config.num_hidden_layers
    assert not next(p for p in res.passes if p.name == "moe").near_misses
    with torch.no_grad():
        want, got = loaded.logits_module()(*inputs).float(), res.gm(*inputs).float()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert float((got - want).abs().max()) <= 0.1 * (1.0 + float(want.abs().max()))


# ---------------------------------------------------------------- hand-written blocks

E, D, FF, K = 4, 16, 24, 2


class Shared(nn.Module):
    """A gated shared expert named the Hugging Face way (gate_proj / up_proj / down_proj)."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        self.down_proj = nn.Linear(FF, D, bias=False)

    def forward(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Block(nn.Module):
    """A Mixtral-style MoE block written out in plain torch (stacked expert weights, gathered per token)."""

    def __init__(self, routing: str = "softmax", scale: float = 1.0, renorm: bool = True, shared: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.router = nn.Parameter(torch.randn(E, D, generator=g) * 0.5)
        self.gate_up = nn.Parameter(torch.randn(E, 2 * FF, D, generator=g) * 0.2)
        self.down = nn.Parameter(torch.randn(E, D, FF, generator=g) * 0.2)
        self.routing, self.scale, self.renorm = routing, scale, renorm
        self.shared_expert = Shared() if shared else None

    def forward(self, x):
        b, s, d = x.shape
        h = x.view(-1, d)
        logits = F.linear(h, self.router)
        probs = torch.softmax(logits, -1) if self.routing == "softmax" else torch.sigmoid(logits)
        w, idx = torch.topk(probs, K, dim=-1)
        if self.renorm:
            w = w / w.sum(-1, keepdim=True)
        hs = h.repeat_interleave(K, 0)
        gu = torch.bmm(self.gate_up[idx.reshape(-1)], hs.unsqueeze(-1)).squeeze(-1)
        gate, up = gu.chunk(2, -1)
        y = torch.bmm(self.down[idx.reshape(-1)], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        y = (y * w.reshape(-1, 1) * self.scale).view(-1, K, d).sum(1)
        if self.shared_expert is not None:
            y = y + self.shared_expert(h)
        return y.view(b, s, d)


class Model(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.moe = Block(**kw)

    def forward(self, x):
        return x + self.moe(torch.tanh(x))


class Expected(nn.Module):
    """What the rewrite must produce for :class:`Model`: one ``hetforge::moe`` call in place of the block."""

    def __init__(self, ref: Model):
        super().__init__()
        self.moe = ref.moe

    def forward(self, x):
        m = self.moe
        y = torch.ops.hetforge.moe(torch.tanh(x), m.router, m.gate_up, m.down, top_k=K, norm_topk=True, act="silu",
                                   transposed=False, layer=0)
        return x + y


def _x(seed=1, s=7):
    return torch.randn(1, s, D, generator=torch.Generator().manual_seed(seed))


def _ops(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_rewrite_before_expected():
    model, x = Model().eval(), _x()
    res = fuse_moe(capture(model, (x,)).gm)
    expected = capture(Expected(model).eval(), (x,)).gm
    assert _ops(res.gm) == _ops(expected) == ["aten.tanh.default", "hetforge.moe.default", "aten.add.Tensor"]
    got = next(n for n in res.gm.graph.nodes if n.target is torch.ops.hetforge.moe.default)
    want = next(n for n in expected.graph.nodes if n.target is torch.ops.hetforge.moe.default)
    def norm(n):
        return [a.target if isinstance(a, torch.fx.Node) and a.op == "get_attr" else a for a in n.args[1:]]

    assert norm(got) == norm(want) and not got.kwargs
    assert tuple(got.meta["val"].shape) == (1, 7, D)
    with torch.no_grad():
        torch.testing.assert_close(res.gm(x), model(x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(res.gm(_x(2)), model(_x(2)), rtol=1e-6, atol=1e-6)  # other data, same graph


def test_shared_expert_and_no_renormalisation_are_recognised():
    model, x = Model(renorm=False, shared=True).eval(), _x()
    res = fuse_moe(capture(model, (x,)).gm)
    node = next(n for n in res.gm.graph.nodes if n.target is torch.ops.hetforge.moe.default)
    assert node.args[9] is False and node.args[5] is not None and node.args[6] is not None
    with torch.no_grad():
        torch.testing.assert_close(res.gm(x), model(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw, reason", [
    ({"routing": "sigmoid"}, "not a softmax"),
    ({"scale": 2.0}, "differs from the block"),  # same structure, different math: caught by the numeric check
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unrecognised_variants_stay_unfused_as_near_misses(kw, reason, dtype):
    model, x = Model(**kw).eval().to(dtype), _x().to(dtype)
    cg = capture(model, (x,))
    res = fuse_moe(cg.gm)
    assert not res.rewrites and len(res.near_misses) == 1 and reason in res.near_misses[0].reason
    assert _ops(res.gm) == _ops(cg.gm)
    with torch.no_grad():
        torch.testing.assert_close(res.gm(x), model(x))


# ---------------------------------------------------------------- the kernel


def _weights(e=8, d=16, f=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, d, generator=g), torch.randn(e, 2 * f, d, generator=g) * 0.3,
            torch.randn(e, d, f, generator=g) * 0.3)


def _per_token(x, rw, wgu, wd, k, keep=None):
    """Plain reference: each (token, choice) through its expert, summed with the router weights."""
    probs = torch.softmax(F.linear(x, rw), -1)
    w, idx = torch.topk(probs, k, -1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            if keep is not None and not keep[t][j]:
                continue
            e = int(idx[t, j])
            gate, up = F.linear(x[t], wgu[e]).chunk(2, -1)
            out[t] += w[t, j] * F.linear(F.silu(gate) * up, wd[e])
    return out, w, idx


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 40), group=st.sampled_from([0, 1, 2, 4, 8]), k=st.integers(1, 3), seed=st.integers(0, 99))
def test_grouped_execution_equals_per_token_reference(t, group, k, seed):
    rw, wgu, wd = _weights(seed=seed)
    x = torch.randn(t, 16, generator=torch.Generator().manual_seed(seed + 1))
    ref, _, _ = _per_token(x, rw, wgu, wd, k)
    with recording() as rec:
        got = moe_forward(x, rw, wgu, wd, top_k=k, group_size=group)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    c = rec.calls[0]
    assert sum(c.routed) == t * k and c.dropped == 0 and c.used == t * k
    assert c.groups == -(-8 // (group or auto_group_size(t, k, 8))) and c.groups_run <= c.groups
    assert abs(sum(c.mass) - t) < 1e-4  # every token's full softmax sums to 1


def test_capacity_drops_lowest_router_weight_first_and_counts_padding():
    rw, wgu, wd = _weights()
    x = torch.randn(30, 16, generator=torch.Generator().manual_seed(5))
    _, w, idx = _per_token(x, rw, wgu, wd, 2)
    cap = [3, 1, 2, 5, 0, 4, 2, 1]
    # expected survivors: per expert, the `cap` assignments with the largest router weight
    keep = [[False, False] for _ in range(30)]
    for e in range(8):
        pairs = sorted(((float(w[t, j]), t, j) for t in range(30) for j in range(2) if int(idx[t, j]) == e),
                       key=lambda p: -p[0])
        for _, t, j in pairs[:cap[e]]:
            keep[t][j] = True
    ref, _, _ = _per_token(x, rw, wgu, wd, 2, keep)
    with recording() as rec:
        got = moe_forward(x, rw, wgu, wd, top_k=2, group_size=2, capacity=cap)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    c = rec.calls[0]
    kept = sum(map(sum, keep))
    assert c.dropped == 60 - kept and c.used == kept
    routed = torch.bincount(idx.reshape(-1), minlength=8).tolist()
    # every group that has a kept token computes G × (largest capacity in the group) slots
    slots = sum(2 * max(cap[g:g + 2]) for g in range(0, 8, 2) if sum(min(routed[e], cap[e]) for e in (g, g + 1)))
    assert c.slots == slots and c.padded == slots - kept


def test_order_permutes_stored_experts_without_changing_the_result():
    rw, wgu, wd = _weights()
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(3))
    order = [5, 2, 7, 0, 1, 3, 6, 4]
    ref = moe_forward(x, rw, wgu, wd, top_k=2)
    got = moe_forward(x, rw, wgu[order], wd[order], top_k=2, group_size=4, order=order)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(k=st.integers(1, 3), seed=st.integers(0, 99), transposed=st.booleans())
def test_one_token_takes_no_dispatch_and_gives_the_dispatched_bits_and_counts(k, seed, transposed):
    """Without the native library, a decode step's token skips the sort/count dispatch; an identity ``order``
    forces the dispatched path, which must give the same bits and the same routing statistics."""
    from hetforge.kernels import native

    rw, wgu, wd = _weights(d=64, f=48, seed=seed)
    if transposed:
        wgu, wd = wgu.transpose(1, 2).contiguous(), wd.transpose(1, 2).contiguous()
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(seed + 1))
    with native.disabled("the Python one-token path"), recording() as rec:
        with mock.patch.object(torch, "argsort", side_effect=AssertionError("the one-token path sorted")):
            fast = moe_forward(x, rw, wgu, wd, top_k=k, transposed=transposed)
        dispatched = moe_forward(x, rw, wgu, wd, top_k=k, transposed=transposed, group_size=1, order=list(range(8)))
    assert torch.equal(fast, dispatched)
    a, b = rec.calls
    assert (a.groups, a.groups_run, a.slots, a.used, a.dropped, a.routed) == \
        (b.groups, b.groups_run, b.slots, b.used, b.dropped, b.routed) and a.used == k


@settings(max_examples=20, deadline=None)
@given(k=st.integers(1, 3), seed=st.integers(0, 99), norm=st.booleans(), act=st.sampled_from(["silu", "gelu"]))
def test_one_token_runs_in_one_native_call_and_equals_the_aten_routing_and_experts(k, seed, norm, act):
    """With the library built, a decode step's token goes through ``hf_moe_token`` (router, softmax, top-k, its
    experts and their weighted sum in C: no ATen routing op runs) and equals the ATen path to rounding — the same
    experts, weights and routing statistics (the probabilities to rounding)."""
    from hetforge.kernels import native
    from hetforge.ops import moe

    if native.library() is None:
        pytest.skip("the native C kernels are not built on this host (" + native.status().reason + "): this checks "
                    "a native kernel only; without it the ATen path runs, which the other MoE tests cover")
    rw, wgu, wd = _weights(d=64, f=48, seed=seed)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(seed + 1))
    with recording() as rec:
        with mock.patch.object(moe, "route", side_effect=AssertionError("routed in ATen")):
            got = moe_forward(x, rw, wgu, wd, top_k=k, norm_topk=norm, act=act)
        with native.disabled("the ATen routing and experts"):
            want = moe_forward(x, rw, wgu, wd, top_k=k, norm_topk=norm, act=act)
    # a different summation order: error relative to the output's scale (an element near 0 is a cancellation)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    a, b = rec.calls
    assert (a.groups, a.groups_run, a.slots, a.used, a.routed) == (b.groups, b.groups_run, b.slots, b.used, b.routed)
    assert a.mass == pytest.approx(b.mass, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_expert_runs_the_native_gated_mlp_and_matches_the_aten_chain(dtype):
    """A decode step's expert FFN is one native gated-MLP call (gate and up in one pool call, no ATen op between
    them) when the library is built; it equals the ATen chain it replaces to rounding, and the ATen chain is what
    runs without the library."""
    from hetforge.kernels import native
    from hetforge.ops.moe import _expert_ffn

    if native.library() is None:
        pytest.skip("the native C kernels are not built on this host (" + native.status().reason + "): this checks "
                    "a native kernel only; without it the ATen path runs, which the other MoE tests cover")
    _, wgu, wd = _weights(d=64, f=48, seed=4)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))
    x, wgu, wd = x.to(dtype), wgu[3].to(dtype).contiguous(), wd[3].to(dtype).contiguous()
    gate, up = F.linear(x, wgu).chunk(2, dim=-1)
    ref = F.linear(F.silu(gate) * up, wd)
    kernel = "gated_mlp" if dtype == torch.float32 else "gated_mlp_bf16"
    with mock.patch.object(native, kernel, wraps=getattr(native, kernel)) as called:
        got = _expert_ffn(x, wgu, wd, "silu", False)
    assert called.call_count == 1 and got.shape == ref.shape and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, ref, **tol)
    with native.disabled("the ATen chain"), mock.patch.object(native, kernel, side_effect=AssertionError):
        torch.testing.assert_close(_expert_ffn(x, wgu, wd, "silu", False), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_experts_run_on_packed_onednn_weights_where_it_runs_their_dtype_and_match_the_aten_chain(dtype):
    """Several tokens: where oneDNN runs the dtype here (:func:`onednn.dtype_ok`; bf16 needs AVX512BW/VL/DQ or
    AVX-NE-CONVERT), every expert's rows go through oneDNN on packed copies of its gate, up and down weights (no
    ATen expert chain runs), one packed copy per expert whatever its row count; elsewhere they run the ATen chain
    and nothing is packed. Either way equal to the ATen chain (``HETFORGE_MOE_PACKED=0``) to rounding."""
    from hetforge.kernels import onednn
    from hetforge.ops import moe

    if not onednn.available():
        pytest.skip("this torch has no oneDNN: experts run on ATen's linear, which the other MoE tests cover")
    rw, wgu, wd = (t.to(dtype) for t in _weights(d=64, f=48, seed=4))
    for t in (24, 57):  # two token counts: different rows per expert, the same packed copies
        x = torch.randn(t, 64, generator=torch.Generator().manual_seed(t)).to(dtype)
        packs = onednn.dtype_ok(dtype)
        guard = mock.patch.object(moe, "_expert_ffn", side_effect=AssertionError("an expert ran the ATen chain")) \
            if packs else contextlib.nullcontext()
        with guard:
            got = moe_forward(x, rw, wgu, wd, top_k=2)
        with mock.patch.dict("os.environ", {"HETFORGE_MOE_PACKED": "0"}):
            want = moe_forward(x, rw, wgu, wd, top_k=2)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    mine = moe._PACKED.get((onednn._memory_key(wgu, False, "moe"), onednn._memory_key(wd, False, "moe")))
    if packs:
        assert all(p is not None and len(p) == 3 for p in mine)  # 81 assignments over 8 experts: each one packed
    else:
        assert mine is None or all(p is None for p in mine)


def test_a_moe_prefill_program_packs_its_experts_when_built_not_in_its_first_call():
    """``Executable.prepack`` (run when a program is built) packs every expert of each MoE layer of a prefill
    program; its first call then packs nothing, and its logits equal eager's."""
    from hetforge.compile import compile_graph
    from hetforge.kernels import onednn
    from hetforge.ops import moe

    if not onednn.available():
        pytest.skip("this torch has no oneDNN: experts run on ATen's linear, so there is nothing to pack")
    loaded = load_model("mixtral-tiny")
    inputs = example_inputs(loaded, seq=24)
    cg = capture(loaded.logits_module(), inputs, name="mixtral-tiny")
    res = compile_graph(cg.gm, example_inputs=inputs, name="mixtral-tiny", soc="host")
    layers = sum(ins.op == "hetforge.moe.default" for ins in res.program.instrs)
    ex = res.executable
    experts = loaded.model.config.num_local_experts
    n = ex.prepack()
    assert n >= layers * experts > 0
    with mock.patch.object(moe, "_pack_expert", side_effect=AssertionError("packed in the first call")):
        got = ex(*inputs)
    with torch.no_grad():
        want = loaded.logits_module()(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
