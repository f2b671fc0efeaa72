"""Pass 5, operator fusion: Linear + activation → ``hetforge::linear_act``; SwiGLU MLP → ``hetforge::gated_mlp``;
rotary position embedding → ``hetforge::rotary``.

Gated MLP first: ``act(linear(x, Wg, bg)) * linear(x, Wu, bu)`` with the same ``x`` (act = SiLU for SwiGLU,
or exact/tanh GELU) becomes one op, and when the product's only user is ``linear(·, Wd, bd)`` the down
projection is folded in too (so a whole Llama/Qwen MLP is one ``gated_mlp`` node).

Then every remaining activation — ``relu``, ``gelu`` (exact or ``approximate='tanh'``), ``silu`` and the
decomposed tanh-GELU chain GPT-2 produces, ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`` — whose input is
produced by ``linear``, ``addmm``, ``mm`` or ``matmul`` with a 2-D weight (possibly through one
``view``/``reshape``, as GPT-2's Conv1D does) becomes ``linear_act``. The pre-activation value must not be
used anywhere else (it would have to be recomputed); activations that cannot be fused are near-misses.

Last, Hugging Face's rotary embedding ``x·cos + cat(-x[..., h:], x[..., :h])·sin`` (``h`` = half the last
dimension; seven nodes per q and per k) becomes ``rotary(x, cos, sin)`` when its inner nodes have no other
users. A decode step of llama-110m loses 144 nodes to it (6 per q and k, 12 layers).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx import GraphModule, Node

import hetforge.ops.fused  # noqa: F401  (registers the fused ops)
from hetforge.passes.common import (
    NearMiss,
    PassLog,
    Rewrite,
    aten,
    describe,
    erase_unused,
    fake_mode_of,
    graph_pass,
    is_call,
    new_call,
    norm_dim,
    only_user,
    scalar,
    tval,
)

LINEAR_ACT = torch.ops.hetforge.linear_act.default
GATED_MLP = torch.ops.hetforge.gated_mlp.default
ROTARY = torch.ops.hetforge.rotary.default
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _const_is(x, value: float, tol: float = 1e-6) -> bool:
    s = scalar(x)
    return s is not None and abs(s - value) <= tol * max(1.0, abs(value))


def _other(n: Node, first: Node):
    """The operand of a binary node that is not ``first`` (None if ``first`` is not an operand)."""
    a, b = n.args[0], n.args[1]
    if a is first:
        return b
    if b is first:
        return a
    return None


def _simple_act(n: Node) -> tuple[str, Node] | None:
    if is_call(n, aten.relu.default):
        return "relu", n.args[0]
    if is_call(n, aten.silu.default):
        return "silu", n.args[0]
    if is_call(n, aten.gelu.default):
        approx = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
        return ("gelu_tanh" if approx == "tanh" else "gelu"), n.args[0]
    return None


def _tanh_gelu(t: Node) -> tuple[Node, Node, list[Node]] | None:
    """(output, x, chain) when the tanh node ``t`` is the core of a decomposed tanh-GELU."""
    m1 = t.args[0]
    if not is_call(m1, aten.mul.Tensor) or len(m1.users) != 1:
        return None
    inner = m1.args[0] if isinstance(m1.args[0], Node) else m1.args[1]
    if not _const_is(_other(m1, inner), _SQRT_2_OVER_PI) or not is_call(inner, aten.add.Tensor):
        return None
    for x, m2 in ((inner.args[0], inner.args[1]), (inner.args[1], inner.args[0])):
        if not (isinstance(x, Node) and is_call(m2, aten.mul.Tensor)):
            continue
        pw = m2.args[0] if isinstance(m2.args[0], Node) else m2.args[1]
        if not (is_call(pw, aten.pow.Tensor_Scalar) and pw.args[0] is x and _const_is(pw.args[1], 3.0)):
            continue
        if not _const_is(_other(m2, pw), 0.044715):
            continue
        a1 = only_user(t)
        if not is_call(a1, aten.add.Tensor) or not _const_is(_other(a1, t), 1.0):
            return None
        root = only_user(a1)
        if not is_call(root, aten.mul.Tensor):
            return None
        h = _other(root, a1)
        if not (is_call(h, aten.mul.Tensor) and _other(h, x) is not None and _const_is(_other(h, x), 0.5)):
            return None
        chain = [h, pw, m2, inner, m1, t, a1, root]
        if any(len(c.users) != 1 for c in chain[:-1]):
            return None
        return root, x, chain
    return None


def _activations(gm: GraphModule) -> list[tuple[str, Node, Node, list[Node]]]:
    """(act, output node, input node, chain) for every activation in graph order."""
    found = []
    for n in gm.graph.nodes:
        s = _simple_act(n)
        if s is not None:
            found.append((s[0], n, s[1], [n]))
        elif is_call(n, aten.tanh.default):
            g = _tanh_gelu(n)
            if g is not None:
                found.append(("gelu_tanh", g[0], g[1], g[2]))
    return found


def _linear_parts(p: Node) -> tuple[Node, Node, Node | None, bool] | None:
    """(x, weight, bias, weight_t) when ``p`` is a linear layer in one of the forms ATen shows it in."""
    if is_call(p, aten.linear.default):
        return p.args[0], p.args[1], (p.args[2] if len(p.args) > 2 else p.kwargs.get("bias")), False
    if is_call(p, aten.addmm.default):
        if p.kwargs.get("beta", 1) != 1 or p.kwargs.get("alpha", 1) != 1:
            return None
        return p.args[1], p.args[2], p.args[0], True
    if is_call(p, aten.mm.default, aten.matmul.default):
        w = tval(p.args[1])
        if w is not None and w.dim() == 2:
            return p.args[0], p.args[1], None, True
    return None


def _fuse_gated(gm: GraphModule, fake, rewrites: list[Rewrite]) -> None:
    for n in list(gm.graph.nodes):
        if getattr(n, "_erased", False) or not is_call(n, aten.mul.Tensor):
            continue
        for act_node, up in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
            s = _simple_act(act_node) if isinstance(act_node, Node) else None
            if s is None or s[0] == "relu" or not is_call(s[1], aten.linear.default):
                continue
            if not is_call(up, aten.linear.default):
                continue
            gate = s[1]
            if gate.args[0] is not up.args[0] or gate is up:
                continue
            if any(len(m.users) != 1 for m in (gate, act_node, up)):
                continue
            gx, gw, gb, _ = _linear_parts(gate)
            _, uw, ub, _ = _linear_parts(up)
            out, wd, bd = n, None, None
            down = only_user(n)
            if is_call(down, aten.linear.default) and down.args[0] is n:
                out, wd = down, down.args[1]
                bd = down.args[2] if len(down.args) > 2 else down.kwargs.get("bias")
            new = new_call(gm, out, GATED_MLP, (gx, gw, uw, wd, gb, ub, bd, s[0]), like=out, fake_mode=fake)
            out.replace_all_uses_with(new)
            matched = [gate, act_node, up, n] + ([out] if out is not n else [])
            rewrites.append(Rewrite("gated_mlp", [m.name for m in matched], new.name,
                                    f"act={s[0]} down={'yes' if wd is not None else 'no'}"))
            erase_unused(gm, [out, n, act_node, gate, up])
            break


def _fuse_linear_act(gm: GraphModule, fake, rewrites: list[Rewrite], misses: list[NearMiss]) -> None:
    for act, out, x, chain in _activations(gm):
        if getattr(out, "_erased", False):
            continue
        inside = set(chain)
        if any(u not in inside for u in x.users):
            misses.append(NearMiss("linear_act", out.name, f"{act} input {x.name} is also used outside the "
                                                          "activation; fusing would recompute the linear"))
            continue
        view, p = None, x
        if is_call(x, *_VIEWS) and isinstance(x.args[0], Node):
            view, p = x, x.args[0]
        parts = _linear_parts(p)
        if parts is None:
            misses.append(NearMiss("linear_act", out.name, f"{act} input comes from {describe(p)}, not from a "
                                                          "linear/addmm/mm/matmul with a 2-D weight"))
            continue
        if view is not None and len(p.users) != 1:
            misses.append(NearMiss("linear_act", out.name, f"the linear {p.name} is also used elsewhere"))
            continue
        xin, w, b, wt = parts
        new = new_call(gm, out, LINEAR_ACT, (xin, w, b, act, wt), like=p, fake_mode=fake)
        res = new
        if view is not None:
            res = new_call(gm, out, view.target, (new, *view.args[1:]), dict(view.kwargs), like=view, fake_mode=fake)
        to, tr = tval(out), tval(res)
        if to is not None and tr is not None and (tuple(to.shape) != tuple(tr.shape) or to.dtype != tr.dtype):
            misses.append(NearMiss("linear_act", out.name, f"fused result {tuple(tr.shape)} {tr.dtype} differs "
                                                          f"from {tuple(to.shape)} {to.dtype}"))
            erase_unused(gm, [res, new])
            continue
        out.replace_all_uses_with(res)
        rewrites.append(Rewrite("linear_act", [m.name for m in [p, *([view] if view else []), *chain]], new.name,
                                f"act={act}{' weight_t' if wt else ''}"))
        erase_unused(gm, [*reversed(chain), *([view] if view else []), p])


_END = 2**62  # a slice end at or past this is "to the end"


def _slice_of(n: Any, x: Node, dim: int, start: int, end: int | None) -> bool:
    """``n`` is ``x[..., start:end]`` on ``dim`` (``end`` None = to the end)."""
    if not is_call(n, aten.slice.Tensor) or n.args[0] is not x:
        return False
    args = list(n.args[1:]) + [None] * (4 - len(n.args))
    d, s0, e0 = args[0], args[1] or 0, args[2]
    rank = tval(x).dim()
    if d is None or norm_dim(d, rank) != dim or s0 != start:
        return False
    size = tval(x).shape[dim]
    return (e0 is None or e0 >= min(size, _END)) if end is None else e0 == end


def _rotary_parts(n: Node) -> tuple[Node, Node, Node, list[Node]] | None:
    """(x, cos, sin, chain) when ``n`` is ``x·cos + cat(-x[..., h:], x[..., :h])·sin``."""
    if not is_call(n, aten.add.Tensor) or len(n.args) != 2 or n.kwargs.get("alpha", 1) != 1:
        return None
    for m_rot, m_x in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
        if not (is_call(m_rot, aten.mul.Tensor) and is_call(m_x, aten.mul.Tensor)):
            continue
        for cat, sin in ((m_rot.args[0], m_rot.args[1]), (m_rot.args[1], m_rot.args[0])):
            if not is_call(cat, aten.cat.default) or len(cat.args[0]) != 2:
                continue
            neg, lo = cat.args[0]
            if not is_call(neg, aten.neg.default) or not is_call(lo, aten.slice.Tensor):
                continue
            x, hi = lo.args[0], neg.args[0]
            tx = tval(x)
            if tx is None or tx.shape[-1] % 2:
                continue
            dim, h = tx.dim() - 1, tx.shape[-1] // 2
            cat_dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
            if norm_dim(cat_dim, tx.dim()) != dim:
                continue
            if not (_slice_of(lo, x, dim, 0, h) and _slice_of(hi, x, dim, h, None)):
                continue
            cos = _other(m_x, x)
            if cos is None or not isinstance(cos, Node) or not isinstance(sin, Node):
                continue
            chain = [m_x, hi, neg, lo, cat, m_rot]
            if any(len(c.users) != 1 for c in chain):
                continue
            return x, cos, sin, chain
    return None


def _fuse_rotary(gm: GraphModule, fake, rewrites: list[Rewrite], misses: list[NearMiss]) -> None:
    for n in list(gm.graph.nodes):
        if getattr(n, "_erased", False):
            continue
        parts = _rotary_parts(n)
        if parts is None:
            continue
        x, cos, sin, chain = parts
        new = new_call(gm, n, ROTARY, (x, cos, sin), like=n, fake_mode=fake)
        tn, tr = tval(n), tval(new)
        if tn is not None and tr is not None and (tuple(tn.shape) != tuple(tr.shape) or tn.dtype != tr.dtype):
            misses.append(NearMiss("rotary", n.name, f"fused result {tuple(tr.shape)} {tr.dtype} differs from "
                                                     f"{tuple(tn.shape)} {tn.dtype}"))
            erase_unused(gm, [new])
            continue
        n.replace_all_uses_with(new)
        rewrites.append(Rewrite("rotary", [m.name for m in [*chain, n]], new.name, f"half={tval(x).shape[-1] // 2}"))
        erase_unused(gm, [n, *reversed(chain)])


@graph_pass("op_fusion")
def fuse_operators(gm: GraphModule, log: PassLog) -> None:
    """Fuse gated MLPs, then Linear+activation pairs; returns a new GraphModule in the result."""
    fake = fake_mode_of(gm)
    _fuse_gated(gm, fake, log.rewrites)
    _fuse_linear_act(gm, fake, log.rewrites, log.near_misses)
    _fuse_rotary(gm, fake, log.rewrites, log.near_misses)
