"""Rows nobody reads: a selected row computed through the layers that need only it (run after stamping).

A generation's prefill returns the logits of one row (``index_select(hidden, 1, last)`` before the LM head) and the
K/V rows of every position. So the last decoder layer's attention output, output projection, residual adds, norms and
MLP are needed for that one row only: the other rows' values feed nothing but the selected row. This pass moves the
row selection up through the operations that act on each row alone, as far as every use of a value lies on the
selected row's path, and selects the row of the first value that is also read elsewhere (the last layer's input, which
its K/V projections read) or that an operation it does not know produced (an MoE block's output). In the last layer
the attention then runs for the one query row, against all keys (the causal mask becomes a mask of the keys up to
``last``), and the products after it run on one row. For a decoder of L layers that is roughly ``9 / (12 L)`` (a fused
q/k/v product) to ``10 / (12 L)`` of the prefill's product FLOPs not done (llama.cpp's graphs select the output rows in
their last layer after the attention: ``// skip computing output for unused tokens``).

Row-wise operations it moves through: elementwise add / sub / mul and ``hetforge::rotary`` (an operand that broadcasts
over the rows, such as one position's cos/sin, is read as it is; a cos/sin with a row per position has its row
selected too), the norms (``hetforge::layer_norm`` / ``rms_norm`` over the last dimensions), the products (``linear``,
``addmm``, ``hetforge::linear_act``, ``hetforge::gated_mlp``), ``view`` / ``reshape`` that keep the row dimension
whole, ``transpose``, and ``hetforge::attention`` (its query rows). The row's values equal the full graph's to
rounding (one-row products run other kernels: a different summation order), not bit for bit.

Why after stamping: the middle-end passes run on a two-layer capture whose layer 1 is then copied out to the other
layers (``runtime.stamp``); pruning that layer first would make it differ from layer 0 and refuse the stamping.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

import torch
from torch.fx import GraphModule, Node

from hetforge.passes.common import PassLog, Rewrite, fake_mode_of, graph_pass, new_call, tval

aten = torch.ops.aten
_EWISE = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _hf(name: str):
    return getattr(torch.ops.hetforge, name).default


def _row_input_dim(n: Node, d: int) -> dict[int, int] | None:
    """For ``n`` whose output row dimension is ``d``: {argument index: that argument's row dimension} for the
    arguments that carry the rows (the others are read as they are), or None where ``n`` is not row-wise in ``d``."""
    out = tval(n)
    if out is None or n.op != "call_function":
        return None
    rank, t = out.dim(), out.shape[d]
    tgt = n.target
    if tgt in _EWISE or tgt is _hf("rotary"):  # rotary: x·cos + rotate_half(x)·sin, within each row (last dim)
        if tgt is _hf("rotary") and d == rank - 1:
            return None
        dims = {}
        for i, a in enumerate(n.args[:3]):
            v = tval(a)
            if v is None:
                continue
            ad = d - (rank - v.dim())
            if ad >= 0 and v.shape[ad] == t and t != 1:
                dims[i] = ad
            elif ad >= 0 and v.shape[ad] != 1:
                return None
        return dims
    if tgt in (_hf("layer_norm"),):
        return {0: d} if d < rank - len(n.args[1]) else None
    if tgt in (_hf("rms_norm"), aten.linear.default, _hf("linear_act"), _hf("gated_mlp")):
        return {0: d} if d < rank - 1 else None
    if tgt is aten.addmm.default:
        bias = tval(n.args[0])
        return {1: 0} if d == 0 and bias is not None and bias.dim() <= 1 else None
    if tgt is aten.transpose.int:
        a, b = (x % rank for x in n.args[1:3])
        return {0: b if d == a else a if d == b else d}
    if tgt in _VIEWS:
        src = tval(n.args[0])
        before = math.prod(out.shape[:d])
        for di in range(src.dim()):
            if (src.shape[di] == t and math.prod(src.shape[:di]) == before
                    and math.prod(src.shape[di + 1:]) == math.prod(out.shape[d + 1:])):
                return {0: di}
        return None
    if tgt is _hf("attention"):
        q, mask = tval(n.args[0]), n.args[3] if len(n.args) > 3 else n.kwargs.get("mask")
        if d != rank - 2 or q is None or q.shape[-2] != t:
            return None
        m = tval(mask)
        if mask is not None and (m is None or m.dim() < 2 or m.shape[-2] not in (1, t)):
            return None
        return {0: d}
    return None


def _pruned_set(root: Node, d0: int) -> dict[Node, tuple[int, dict[int, int]]] | None:
    """The nodes whose every use lies on the selected row's path, from the node ``root`` selects from (row dimension
    ``d0``), each with its row dimension and :func:`_row_input_dim`'s map; empty when that node is read elsewhere,
    None when some value is read with its rows along two different dimensions."""
    x0 = root.args[0]
    row: dict[Node, tuple[int, dict[int, int]]] = {}
    want: dict[Node, int] = {x0: d0}
    order = {n: i for i, n in enumerate(root.graph.nodes)}
    # producers latest first (a heap on -position): a node joins once all its users are the root or joined nodes
    pending = [(-order[x0], x0)]
    while pending:
        n = heapq.heappop(pending)[1]
        d = want[n]
        if any(u is not root and u not in row for u in n.users):
            continue
        dims = _row_input_dim(n, d)
        if dims is None:
            continue
        row[n] = (d, dims)
        for i, ad in dims.items():
            a = n.args[i]
            if isinstance(a, Node):
                if a in want and want[a] != ad:
                    return None
                if a not in want:
                    heapq.heappush(pending, (-order[a], a))
                want[a] = ad
    return row


def _mask_upto(gm: GraphModule, before: Node, idx: Node, keys: int, fake: Any) -> Node:
    """A bool mask ``[1, 1, 1, keys]`` of the keys at positions up to ``idx`` (the selected row's causal view)."""
    ar = new_call(gm, before, aten.arange.default, (keys,), {"device": torch.device("cpu"), "dtype": torch.long},
                  fake_mode=fake)
    le = new_call(gm, before, aten.le.Tensor, (ar, idx), fake_mode=fake)
    return new_call(gm, before, aten.view.default, (le, [1, 1, 1, keys]), fake_mode=fake)


def _rewrite(gm: GraphModule, row: dict[Node, tuple[int, dict[int, int]]], idx: Node, fake: Any) \
        -> dict[Node, Node]:
    """Each node of ``row`` computed for the selected row only, right after the node it copies; its operands are
    their copies, or an ``index_select`` of the operand where the operand stays whole. Returns node -> copy."""
    made: dict[Node, Node] = {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in sorted(row, key=order.__getitem__):
        (d, dims), after = row[n], n.next
        args, kwargs = list(n.args), dict(n.kwargs)
        for i, ad in dims.items():
            a = n.args[i]
            args[i] = made[a] if a in made else new_call(gm, after, aten.index_select.default, (a, ad, idx),
                                                         like=a, fake_mode=fake)
        if n.target in _VIEWS:
            shape = list(tval(n).shape)
            shape[d] = 1
            args[1] = shape
        if n.target is _hf("attention"):
            keys = tval(n.args[1]).shape[-2]
            causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
            mask = args[3] if len(args) > 3 else kwargs.get("mask")
            if causal:
                mask = _mask_upto(gm, after, idx, keys, fake)
            elif mask is not None and tval(mask).shape[-2] != 1:
                mask = new_call(gm, after, aten.index_select.default, (mask, tval(mask).dim() - 2, idx),
                                fake_mode=fake)
            args = args[:3] + [mask] + args[4:5]
            kwargs = {k: v for k, v in kwargs.items() if k == "scale"}
        made[n] = new_call(gm, after, n.target, tuple(args), kwargs, like=n, fake_mode=fake)
    return made


@graph_pass("row_prune")
def prune_rows(gm: GraphModule, log: PassLog) -> None:
    """Move each one-row ``index_select`` up through the row-wise operations only its row needs (module doc)."""
    fake = fake_mode_of(gm)
    roots = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.index_select.default
             and isinstance(n.args[0], Node) and tval(n.args[0]) is not None and tval(n.args[2]) is not None
             and tval(n.args[2]).numel() == 1]
    for root in roots:
        x0, dim, idx = root.args
        d0 = dim % tval(x0).dim()
        row = _pruned_set(root, d0) if tval(x0).shape[d0] > 1 else None  # one row already: nothing to prune
        if not row:
            continue
        new = _rewrite(gm, row, idx, fake)[x0]
        root.replace_all_uses_with(new)
        log.rewrites.append(Rewrite("row_prune", [n.name for n in row], new.name,
                                    f"{len(row)} operations on the selected row only"))
