"""Pass 4, attention fusion: the eager attention chain and ATen SDPA → one ``hetforge::attention``.

Eager chain, matched backwards from every softmax whose result feeds a matmul::

    s = q @ kᵀ              (matmul/bmm; kᵀ a transpose/permute of k over its last two dims)
    s = s * c  |  s / c     (optional; a Python scalar or a 0-d constant; absent = pre-scaled q, scale 1)
    s = s + mask            (optional additive float mask of the scores' dtype, broadcastable to s)
      | where(m, s, fill)   (optional boolean mask with a scalar fill → an additive mask node)
    p = softmax(s, -1)      (over the last dim; in the scores' dtype, or float32 then cast back for fp16/bf16)
    p = dropout(p)          (optional; only p=0 / eval, cleanup normally removed it already)
    o = p @ v

Grouped-query attention: when k (or v) is ``reshape(expand(unsqueeze(k0, 2), [B,Hkv,n,L,D]), [B,Hkv·n,L,D])``
(Hugging Face ``repeat_kv``) the fused op takes ``k0`` and broadcasts heads itself. Every check that fails
(softmax dim, scale, transpose dims, mask dtype/shape, extra users of an intermediate) leaves the chain alone
and records a near-miss with the reason. ``aten.scaled_dot_product_attention`` nodes (dropout 0) are
normalized to the same op, keeping scale, causality and mask.

A constant mask that hides exactly the keys after each query (0 on and below the diagonal, ``-inf`` or the
dtype's lowest value above it, or the boolean ``tril``; square scores) becomes ``is_causal`` with no mask: the
same result (a hidden score's weight is exactly 0 either way, and every row sees its diagonal), and a kernel
that knows the structure skips the hidden half instead of reading a mask for it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx import GraphModule, Node

import hetforge.ops.fused  # noqa: F401  (registers hetforge::attention)
from hetforge.passes.common import (
    Miss,
    NearMiss,
    PassLog,
    Rewrite,
    aten,
    const_scalar,
    const_tensor,
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

ATTENTION = torch.ops.hetforge.attention.default
_MATMUL = (aten.matmul.default, aten.bmm.default)
_SOFTMAX = (aten.softmax.int, aten._softmax.default, aten._safe_softmax.default)
_DROPOUT = (aten.dropout.default,)
_RESHAPE = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default)
_HALF = (torch.float16, torch.bfloat16)


def strip_repeat_kv(x: Node) -> tuple[Node, int]:
    """``(k0, n)`` when ``x`` is Hugging Face's ``repeat_kv(k0, n)`` chain, else ``(x, 1)``."""
    if not is_call(x, *_RESHAPE):
        return x, 1
    ex = x.args[0]
    if not is_call(ex, aten.expand.default) or not is_call(ex.args[0], aten.unsqueeze.default):
        return x, 1
    un = ex.args[0]
    k0 = un.args[0]
    t0, te, tx = tval(k0), tval(ex), tval(x)
    if t0 is None or te is None or tx is None or t0.dim() != 4 or norm_dim(un.args[1], 5) != 2:
        return x, 1
    b, h, seq, d = t0.shape
    n = te.shape[2]
    if tuple(te.shape) != (b, h, n, seq, d) or tuple(tx.shape) != (b, h * n, seq, d):
        return x, 1
    if len(ex.users) != 1 or len(un.users) != 1:
        return x, 1
    return k0, n


def _key_from_transposed(kt: Node) -> Node:
    """``k`` when ``kt`` is k transposed over its last two dims; raises Miss otherwise."""
    t = tval(kt)
    if t is None:
        raise Miss("the key operand has no shape metadata")
    r = t.dim()
    if is_call(kt, aten.transpose.int):
        dims = {norm_dim(kt.args[1], r), norm_dim(kt.args[2], r)}
        if dims != {r - 1, r - 2}:
            raise Miss(f"the key is transposed over dims {sorted(dims)}, not its last two dims")
        return kt.args[0]
    if is_call(kt, aten.permute.default):
        perm = [norm_dim(d, r) for d in kt.args[1]]
        if perm != [*range(r - 2), r - 1, r - 2]:
            raise Miss(f"the key is permuted by {perm}, which is not a swap of its last two dims")
        return kt.args[0]
    if is_call(kt, aten.t.default) and r == 2:
        return kt.args[0]
    raise Miss(f"the second operand of q·kᵀ is {describe(kt)}, not a transpose of the key")


def _scale_of(gm: GraphModule, n: Node) -> tuple[Node, float] | None:
    """(input, scale) when ``n`` multiplies/divides the scores by a scalar; None when it is not a scaling."""
    if not is_call(n, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
        return None
    a, b = n.args[0], n.args[1]
    is_mul = n.target in (aten.mul.Tensor, aten.mul.Scalar)
    if is_mul and is_call(b, *_MATMUL) and not is_call(a, *_MATMUL):
        a, b = b, a  # scale * scores
    if not is_call(a, *_MATMUL):
        return None
    s = const_scalar(gm, b)
    if s is None:
        tb = tval(b)
        shape = tuple(tb.shape) if tb is not None else "?"
        raise Miss(f"the scores are scaled by {describe(b)} of shape {shape}, not a scalar constant")
    if not is_mul and s == 0:
        raise Miss("the scores are divided by zero")
    return a, (s if is_mul else 1.0 / s)


def _match_eager(gm: GraphModule, sm: Node) -> tuple[Node, tuple, list[Node], list[Node]]:
    """(output node, op args, nodes to fuse, extra nodes to insert) for a softmax that feeds p @ v."""
    fake = fake_mode_of(gm)
    x = sm.args[0]
    tx, tsm = tval(x), tval(sm)
    if tx is None or tsm is None:
        raise Miss("the softmax has no shape metadata")
    dim = norm_dim(sm.args[1], tx.dim())
    if dim != tx.dim() - 1:
        raise Miss(f"softmax over dim {sm.args[1]} (of {tx.dim()}), attention needs the last dim")
    # forward: optional upcast-softmax cast back, optional eval dropout, then p @ v
    p = sm
    chain = [sm]
    nxt = only_user(p)
    if tsm.dtype != tx.dtype:
        # Hugging Face eager on fp16/bf16: softmax(s, -1, dtype=float32).to(s.dtype); SDPA's kernels also
        # run the softmax in float32 for half inputs, so this upcast is the fused op's own behaviour
        back = tval(nxt) if is_call(nxt, *_CASTS) else None
        if not (tsm.dtype == torch.float32 and tx.dtype in _HALF and back is not None and back.dtype == tx.dtype):
            raise Miss(f"softmax computes in {tsm.dtype} but the scores are {tx.dtype}")
        chain.append(nxt)
        p = nxt
        nxt = only_user(p)
    if is_call(nxt, *_DROPOUT):
        if not (nxt.args[2] is False or scalar(nxt.args[1]) == 0.0):
            raise Miss("attention dropout is active (training mode)")
        chain.append(nxt)
        p = nxt
        nxt = only_user(p)
    if not is_call(nxt, *_MATMUL) or nxt.args[0] is not p:
        raise Miss("the attention probabilities are not only used as the left operand of p·v")
    out, v = nxt, nxt.args[1]
    # backward: optional mask, optional scale, q @ kᵀ
    mask: Node | None = None
    s = x
    extra: list[Node] = []
    if is_call(s, aten.add.Tensor) and all(isinstance(a, Node) for a in s.args[:2]):
        a, b = s.args[0], s.args[1]
        if not _scores_side(a) and _scores_side(b):
            a, b = b, a  # mask + scores
        tm = tval(b)
        if tm is None or not tm.dtype.is_floating_point or tm.dtype != tx.dtype:
            raise Miss(f"additive mask {describe(b)} has dtype {getattr(tm, 'dtype', '?')}, scores are {tx.dtype}")
        if torch.broadcast_shapes(tuple(tm.shape), tuple(tx.shape)) != tuple(tx.shape):
            raise Miss(f"mask shape {tuple(tm.shape)} does not broadcast to the scores {tuple(tx.shape)}")
        if len(s.args) > 2 or s.kwargs.get("alpha", 1) != 1:
            raise Miss("the mask is added with alpha != 1")
        chain.append(s)
        mask, s = b, a
    elif is_call(s, aten.where.self, aten.where.ScalarOther):
        cond, a, fill = s.args[0], s.args[1], s.args[2]
        tc = tval(cond)
        fill_v = const_scalar(gm, fill)
        if tc is None or tc.dtype != torch.bool:
            raise Miss(f"where-mask condition {describe(cond)} is not boolean")
        if fill_v is None:
            raise Miss(f"where-mask fill {describe(fill)} is not a scalar constant")
        chain.append(s)
        with gm.graph.inserting_before(s):
            zero = gm.graph.call_function(aten.scalar_tensor.default, (0.0,), {"dtype": tx.dtype})
        zero.meta["val"] = fake.from_tensor(torch.scalar_tensor(0.0, dtype=tx.dtype)) if fake else None
        m = new_call(gm, s, aten.where.ScalarOther, (cond, zero, fill_v), like=s, fake_mode=fake)
        extra += [zero, m]
        mask, s = m, a
    scale = 1.0
    sc = _scale_of(gm, s)
    if sc is not None:
        chain.append(s)
        s, scale = sc
    if not is_call(s, *_MATMUL):
        raise Miss(f"the softmax input comes from {describe(s)}, not from a q·kᵀ matmul")
    chain.append(s)
    q, k = s.args[0], _key_from_transposed(s.args[1])
    _check_users(chain, out)
    tq, tk, tv = tval(q), tval(k), tval(v)
    if tq is None or tk is None or tv is None or min(tq.dim(), tk.dim(), tv.dim()) < 3:
        raise Miss("q, k and v must have a batch/head dim (rank ≥ 3) with shape metadata")
    k0, nk = strip_repeat_kv(k)
    v0, nv = strip_repeat_kv(v)
    if nk != nv:
        k0, v0 = k, v
    if tq.shape[:-2] != tk.shape[:-2] or tk.shape[:-1] != tv.shape[:-1] or tq.shape[-1] != tk.shape[-1]:
        raise Miss(f"q {tuple(tq.shape)}, k {tuple(tk.shape)}, v {tuple(tv.shape)} do not line up (broadcast "
                   "batch dims are not fused)")
    return out, (q, k0, v0, mask, float(scale), False), chain + [out], extra


def _scores_side(n: Node) -> bool:
    """True for q·kᵀ itself or a mul/div with q·kᵀ as an operand (the scores side of ``scores + mask``)."""
    if is_call(n, *_MATMUL):
        return True
    scale_ops = (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar)
    return is_call(n, *scale_ops) and any(is_call(a, *_MATMUL) for a in n.args[:2])


def _check_users(chain: list[Node], out: Node) -> None:
    """Every fused node except the output must be used only inside the chain."""
    inside = set(chain) | {out}
    for n in chain:
        for u in n.users:
            if u not in inside:
                raise Miss(f"intermediate {n.name} is also used by {u.name}; fusing would recompute it")


def _match_sdpa(n: Node) -> tuple:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = (None, None, None, None, 0.0, False, None, False)
    a = {k: (n.args[i] if i < len(n.args) else n.kwargs.get(k, defaults[i])) for i, k in enumerate(names)}
    if scalar(a["dropout_p"]) not in (None, 0.0):
        raise Miss(f"SDPA with dropout_p={a['dropout_p']}")
    q, k, v = a["query"], a["key"], a["value"]
    tq = tval(q)
    if tq is None:
        raise Miss("SDPA query has no shape metadata")
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(tq.shape[-1])
    k0, nk = strip_repeat_kv(k)
    v0, nv = strip_repeat_kv(v)
    if nk != nv:
        k0, v0 = k, v
    return (q, k0, v0, a["attn_mask"], float(scale), bool(a["is_causal"]))


def constant_causal(gm: GraphModule, q: Node, k: Node, mask: Any) -> bool:
    """Whether ``mask`` is a constant causal mask for square scores: broadcastable to ``[..., l, l]`` (l = q's
    and k's rows), every broadcast slice the same: visible (0, or True) on and below the diagonal and hidden
    (``-inf`` or the dtype's lowest finite value, or False) above it."""
    m, tq, tk = const_tensor(gm, mask), tval(q), tval(k)
    if m is None or tq is None or tk is None or m.dim() < 2:
        return False
    ell = tq.shape[-2]
    if tk.shape[-2] != ell or tuple(m.shape[-2:]) != (ell, ell):
        return False
    hidden = torch.ones(ell, ell, dtype=torch.bool).triu(1)
    if m.dtype == torch.bool:
        return bool((m == ~hidden).all())
    if not m.is_floating_point():
        return False
    lowest = torch.finfo(m.dtype).min
    above = m[..., hidden]
    return bool((m[..., ~hidden] == 0).all()) and bool(((above == -math.inf) | (above == lowest)).all())


@graph_pass("attention")
def fuse_attention(gm: GraphModule, log: PassLog) -> None:
    """Fuse attention chains and SDPA nodes into ``hetforge::attention``; returns a new GraphModule."""
    fake = fake_mode_of(gm)
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or getattr(n, "_erased", False):
            continue
        try:
            if n.target is aten.scaled_dot_product_attention.default:
                args, out, matched, extra = _match_sdpa(n), n, [n], []
            elif n.target in _SOFTMAX and _feeds_matmul(n):
                out, args, matched, extra = _match_eager(gm, n)
            else:
                continue
        except Miss as e:
            log.near_misses.append(NearMiss("attention", n.name, str(e)))
            continue
        new = new_call(gm, out, ATTENTION, args, like=out, fake_mode=fake)
        to, tn = tval(out), tval(new)
        if to is not None and tn is not None and (tuple(to.shape) != tuple(tn.shape) or to.dtype != tn.dtype):
            gm.graph.erase_node(new)
            for e in reversed(extra):
                gm.graph.erase_node(e)
            log.near_misses.append(NearMiss("attention", n.name, f"fused output {tuple(tn.shape)} {tn.dtype} "
                                                                 f"differs from {tuple(to.shape)} {to.dtype}"))
            continue
        out.replace_all_uses_with(new)
        q, k, v, mask, scale, causal = args
        from_mask = not causal and mask is not None and constant_causal(gm, q, k, mask)
        if from_mask:
            new.args = (q, k, v, None, scale, True)
            if not mask.users:
                gm.graph.erase_node(mask)
            mask, causal = None, True
        detail = f"scale={scale:g} causal={causal} mask={'yes' if mask is not None else 'no'}"
        if from_mask:
            detail += " (a constant causal mask)"
        if k is not None and tval(k) is not None and tval(q) is not None and tval(k).shape[-3] != tval(q).shape[-3]:
            detail += f" gqa={tval(q).shape[-3]}/{tval(k).shape[-3]}"
        log.rewrites.append(Rewrite("attention", [m.name for m in matched], new.name, detail))
        # the fused chain is dead now: erase it so later softmax candidates do not see stale users
        erase_unused(gm, matched)


def _feeds_matmul(sm: Node) -> bool:
    """A softmax is an attention candidate when its result reaches a matmul's left operand."""
    p = sm
    for _ in range(2):
        for u in p.users:
            if is_call(u, *_MATMUL) and u.args[0] is p:
                return True
        u = only_user(p)
        if not is_call(u, *_DROPOUT, aten.to.dtype, aten.clone.default):
            return False
        p = u
    return False
