"""Before/Expected structural tests for every fusion (and the three clean-up passes), beside the numeric ones.

Each case is a small module written the way Hugging Face writes the pattern. ``Before`` is the captured graph as
the fusion pass sees it in the pipeline (after cleanup), ``Expected`` the graph the pass must leave, both as
:func:`fusion_text.graph_text` listings; the rewritten graph must also equal the capture of a module that calls
the fused op directly (where there is one), and compute what the original module computes. The MoE fusion's
Before/Expected test is ``tests/test_moe.py::test_rewrite_before_expected``.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from fusion_text import graph_text
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hetforge.frontend import capture
from hetforge.passes import cleanup, constant_fold, cse, fuse_attention, fuse_norms, fuse_operators

hf = torch.ops.hetforge


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class RmsNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = LlamaRMSNorm(16, eps=1e-5)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))

    def forward(self, x):
        return self.norm(x)


class LayerNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)

    def forward(self, x):
        return self.ln(x)


class GatedMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=False)
        self.down = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class LinearAct(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x):
        return nn.functional.gelu(self.fc(x))


class Rotary(nn.Module):
    def forward(self, q, cos, sin):
        h = q.shape[-1] // 2
        return q * cos + torch.cat((-q[..., h:], q[..., :h]), dim=-1) * sin


class EagerAttention(nn.Module):
    def forward(self, q, k, v, mask):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.5 + mask, dim=-1) @ v


class CausalBufferAttention(nn.Module):
    """Eager attention over a causal mask built once as a buffer (``-inf`` above the diagonal)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.full((6, 6), float("-inf")).triu(1))

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.5 + self.mask, dim=-1) @ v


class GqaAttention(nn.Module):
    """Hugging Face's eager attention with ``repeat_kv``: 4 query heads over 2 key/value heads."""

    def forward(self, q, k, v):
        b, kv, s, d = k.shape
        k = k[:, :, None].expand(b, kv, 2, s, d).reshape(b, 2 * kv, s, d)
        v = v[:, :, None].expand(b, kv, 2, s, d).reshape(b, 2 * kv, s, d)
        return torch.softmax(q @ k.transpose(-1, -2) * 0.5, dim=-1) @ v


class SdpaAttention(nn.Module):
    def forward(self, q, k, v):
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class Repeated(nn.Module):
    """The same expression twice (CSE) and a constant subgraph over a buffer (constant folding)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(16, dtype=torch.float32))

    def forward(self, x):
        return torch.tanh(x) + torch.tanh(x) + torch.cos(self.table) * 2


class Noops(nn.Module):
    """Eval-mode dropout, a same-shape view and an alias: all removed by cleanup."""

    def forward(self, x):
        return torch.relu(torch.ops.aten.alias(nn.functional.dropout(x, 0.1, training=False).view(x.shape)))


ATTN = (1, 4, 6, 8)
KV = (1, 2, 6, 8)

# name: (module, inputs, pass, Before, Expected, a module calling the fused op directly or None)
CASES = {
    "rms_norm": (RmsNorm, lambda: (_x(2, 5, 16),), fuse_norms, """
        %0 = aten::pow.Tensor_Scalar(%x0, 2)
        %1 = aten::mean.dim(%0, [-1], True)
        %2 = aten::add.Tensor(%1, 1e-05)
        %3 = aten::rsqrt(%2)
        %4 = aten::mul.Tensor(%x0, %3)
        %5 = aten::mul.Tensor(@norm.weight, %4)
        return (%5,)""", """
        %0 = hetforge::rms_norm(%x0, @norm.weight, 1e-05)
        return (%0,)""", lambda m: lambda x: hf.rms_norm(x, m.norm.weight, 1e-5)),
    "layer_norm": (LayerNorm, lambda: (_x(2, 5, 16),), fuse_norms, """
        %0 = aten::layer_norm(%x0, [16], @ln.weight, @ln.bias, 1e-05, False)
        return (%0,)""", """
        %0 = hetforge::layer_norm(%x0, [16], @ln.weight, @ln.bias)
        return (%0,)""", lambda m: lambda x: hf.layer_norm(x, [16], m.ln.weight, m.ln.bias, 1e-5)),
    "gated_mlp": (GatedMlp, lambda: (_x(2, 5, 16),), fuse_operators, """
        %0 = aten::linear(%x0, @gate.weight)
        %1 = aten::silu(%0)
        %2 = aten::linear(%x0, @up.weight)
        %3 = aten::mul.Tensor(%1, %2)
        %4 = aten::linear(%3, @down.weight)
        return (%4,)""", """
        %0 = hetforge::gated_mlp(%x0, @gate.weight, @up.weight, @down.weight)
        return (%0,)""",
        lambda m: lambda x: hf.gated_mlp(x, m.gate.weight, m.up.weight, m.down.weight, None, None, None, "silu")),
    "linear_act": (LinearAct, lambda: (_x(2, 5, 16),), fuse_operators, """
        %0 = aten::linear(%x0, @fc.weight, @fc.bias)
        %1 = aten::gelu(%0)
        return (%1,)""", """
        %0 = hetforge::linear_act(%x0, @fc.weight, @fc.bias, 'gelu')
        return (%0,)""", lambda m: lambda x: hf.linear_act(x, m.fc.weight, m.fc.bias, "gelu", False)),
    "rotary": (Rotary, lambda: (_x(1, 4, 5, 8), _x(1, 1, 5, 8, seed=1), _x(1, 1, 5, 8, seed=2)), fuse_operators, """
        %0 = aten::mul.Tensor(%x0, %x1)
        %1 = aten::slice.Tensor(%x0, 3, 4, 9223372036854775807)
        %2 = aten::neg(%1)
        %3 = aten::slice.Tensor(%x0, 3, 0, 4)
        %4 = aten::cat([%2, %3], -1)
        %5 = aten::mul.Tensor(%4, %x2)
        %6 = aten::add.Tensor(%0, %5)
        return (%6,)""", """
        %0 = hetforge::rotary(%x0, %x1, %x2)
        return (%0,)""", lambda m: hf.rotary),
    "attention (eager)": (EagerAttention, lambda: (_x(*ATTN), _x(*ATTN, seed=1), _x(*ATTN, seed=2),
                                                  torch.zeros(1, 1, 6, 6).triu(1) * -1e9), fuse_attention, """
        %0 = aten::transpose.int(%x1, -1, -2)
        %1 = aten::matmul(%x0, %0)
        %2 = aten::mul.Tensor(%1, 0.5)
        %3 = aten::add.Tensor(%2, %x3)
        %4 = aten::softmax.int(%3, -1)
        %5 = aten::matmul(%4, %x2)
        return (%5,)""", """
        %0 = hetforge::attention(%x0, %x1, %x2, %x3, 0.5)
        return (%0,)""", lambda m: lambda q, k, v, mask: hf.attention(q, k, v, mask, 0.5, False)),
    "attention (constant causal mask)": (CausalBufferAttention, lambda: (_x(*ATTN), _x(*ATTN, seed=1),
                                                                       _x(*ATTN, seed=2)), fuse_attention, """
        %0 = aten::transpose.int(%x1, -1, -2)
        %1 = aten::matmul(%x0, %0)
        %2 = aten::mul.Tensor(%1, 0.5)
        %3 = aten::add.Tensor(%2, @mask)
        %4 = aten::softmax.int(%3, -1)
        %5 = aten::matmul(%4, %x2)
        return (%5,)""", """
        %0 = hetforge::attention(%x0, %x1, %x2, None, 0.5, True)
        return (%0,)""", lambda m: lambda q, k, v: hf.attention(q, k, v, None, 0.5, True)),
    "attention (repeat_kv)": (GqaAttention, lambda: (_x(*ATTN), _x(*KV, seed=1), _x(*KV, seed=2)), fuse_attention, """
        %0 = aten::unsqueeze(%x1, 2)
        %1 = aten::expand(%0, [1, 2, 2, 6, 8])
        %2 = aten::reshape(%1, [1, 4, 6, 8])
        %3 = aten::unsqueeze(%x2, 2)
        %4 = aten::expand(%3, [1, 2, 2, 6, 8])
        %5 = aten::reshape(%4, [1, 4, 6, 8])
        %6 = aten::transpose.int(%2, -1, -2)
        %7 = aten::matmul(%x0, %6)
        %8 = aten::mul.Tensor(%7, 0.5)
        %9 = aten::softmax.int(%8, -1)
        %10 = aten::matmul(%9, %5)
        return (%10,)""", """
        %0 = hetforge::attention(%x0, %x1, %x2, None, 0.5)
        return (%0,)""", None),
    "attention (sdpa)": (SdpaAttention, lambda: (_x(*ATTN), _x(*ATTN, seed=1), _x(*ATTN, seed=2)), fuse_attention, """
        %0 = aten::scaled_dot_product_attention(%x0, %x1, %x2, None, 0.0, True)
        return (%0,)""", """
        %0 = hetforge::attention(%x0, %x1, %x2, None, 0.35355339059327373, True)
        return (%0,)""", None),
    "cse + constant folding": (Repeated, lambda: (_x(3, 16),), lambda gm: constant_fold(cse(gm).gm), """
        %0 = aten::tanh(%x0)
        %1 = aten::tanh(%x0)
        %2 = aten::add.Tensor(%0, %1)
        %3 = aten::cos(@table)
        %4 = aten::mul.Tensor(%3, 2)
        %5 = aten::add.Tensor(%2, %4)
        return (%5,)""", """
        %0 = aten::tanh(%x0)
        %1 = aten::add.Tensor(%0, %0)
        %2 = aten::add.Tensor(%1, @_folded_0)
        return (%2,)""", None),
}


def _listing(text: str) -> str:
    return textwrap.dedent(text).strip()


@pytest.mark.parametrize("name", list(CASES))
def test_fusion_before_expected(name):
    make, inputs_of, run_pass, before, expected, direct = CASES[name]
    module, inputs = make().eval(), inputs_of()
    gm = cleanup(capture(module, inputs).gm).gm
    assert graph_text(gm) == _listing(before)
    out = run_pass(gm).gm
    assert graph_text(out) == _listing(expected)
    if direct is not None:  # the expected listing is what a module calling the fused op captures to
        class Direct(nn.Module):
            def __init__(self):
                super().__init__()
                for k, v in module.named_children():
                    self.add_module(k, v)
                self.fn = direct(module)

            def forward(self, *xs):
                return self.fn(*xs)

        assert graph_text(capture(Direct().eval(), inputs).gm) == _listing(expected)
    with torch.no_grad():
        torch.testing.assert_close(out(*inputs), module(*inputs), rtol=1e-5, atol=1e-5)


def test_cleanup_before_expected():
    module, x = Noops().eval(), _x(3, 16)
    gm = capture(module, (x,)).gm
    assert graph_text(gm) == _listing("""
        %0 = aten::dropout(%x0, 0.1, False)
        %1 = aten::view(%0, [3, 16])
        %2 = aten::alias(%1)
        %3 = aten::relu(%2)
        return (%3,)""")
    out = cleanup(gm).gm
    assert graph_text(out) == _listing("""
        %0 = aten::relu(%x0)
        return (%0,)""")
    torch.testing.assert_close(out(x), module(x))


class EmptyPastCat(nn.Module):
    """A cache's empty past before the new keys, as Hugging Face's cache writes it in a plain forward (no
    ``use_cache=False``): ``torch.tensor([])`` (the legacy 1-D empty form, which cat skips) and an empty [1, 2, 0, 4]
    tensor."""

    def forward(self, k):
        legacy = torch.cat([torch.tensor([]), k.transpose(1, 2)], dim=-2)
        shaped = torch.cat([torch.zeros(1, 2, 0, 4), k.transpose(1, 2)], dim=-2)
        return legacy * 2, shaped + 1


def test_cleanup_drops_a_cat_whose_other_operands_are_empty_before_expected():
    module, k = EmptyPastCat().eval(), _x(1, 3, 2, 4)
    gm = capture(module, (k,)).gm
    before = graph_text(gm)
    assert before.count("aten::cat(") == 2
    out = cleanup(gm).gm
    assert graph_text(out) == _listing("""
        %0 = aten::transpose.int(%x0, 1, 2)
        %1 = aten::transpose.int(%x0, 1, 2)
        %2 = aten::mul.Tensor(%0, 2)
        %3 = aten::add.Tensor(%1, 1)
        return (%2, %3)""")  # the legacy empty tensor (lift_fresh_copy, detach_) goes with the cat
    torch.testing.assert_close(out(k), module(k))


@pytest.mark.parametrize("after", ["add", "add_", "view+add_", "returned"])
def test_cleanup_keeps_a_cat_of_one_real_operand_only_when_its_result_is_written_or_returned(after):
    """Dropping the cat would make an in-place add after it (directly or through a view) write into the operand's
    memory, here the graph's input, and returning it would hand the caller that input: then it stays; with an
    out-of-place add it goes. (torch.export functionalizes such writes away, so the graph is built by hand, with
    real tensors as the nodes' values.)"""
    aten = torch.ops.aten
    g = torch.fx.Graph()
    x = g.placeholder("x")
    e = g.call_function(aten.zeros.default, ([0, 4],))
    c = g.call_function(aten.cat.default, ([e, x], 0))
    k = _x(3, 4)
    vals = [(x, k), (e, torch.zeros(0, 4)), (c, k.clone())]
    if after == "returned":
        g.output(c)
    else:
        src = c
        if after == "view+add_":
            src = g.call_function(aten.view.default, (c, [12]))
            vals.append((src, k.reshape(12)))
        a = g.call_function(aten.add.Tensor if after == "add" else aten.add_.Tensor, (src, 1))
        vals.append((a, (k + 1).reshape(src is c and (3, 4) or (12,))))
        g.output(a)
    for n, v in vals:
        n.meta["val"] = v
    out = cleanup(torch.fx.GraphModule(nn.Module(), g)).gm
    cats = sum(1 for n in out.graph.nodes if n.target is aten.cat.default)
    assert cats == (0 if after == "add" else 1)
    kin = k.clone()
    torch.testing.assert_close(out(kin).reshape(3, 4), k if after == "returned" else k + 1)
    assert torch.equal(kin, k)  # the input is never written


def test_graph_text_tells_graphs_apart():
    """The listing is a real comparison: a different literal, input order or op gives a different text."""
    a = capture(LinearAct().eval(), (_x(2, 5, 16),)).gm
    texts = {graph_text(a)}
    for f in (lambda x: nn.functional.gelu(x) * 2, lambda x: nn.functional.gelu(x) * 3, lambda x: torch.relu(x) * 2):
        class M(nn.Module):
            def forward(self, x, f=f):
                return f(x)

        texts.add(graph_text(capture(M().eval(), (_x(2, 5, 16),)).gm))
    assert len(texts) == 4
