"""Pass 1, cleanup: drop nodes that compute nothing in inference, then dead-code elimination.

Removed (each use rewired to the node's input): eval-mode or p=0 dropout; ``aten.to`` to the dtype/device
the tensor already has; ``aten.alias``/``detach``/``detach_``; ``contiguous`` of an already-contiguous tensor;
``view``/``reshape``/``expand`` to the input's own shape; ``_assert_tensor_metadata`` (an export-time check
with no output); a ``cat`` whose other operands are all empty along its dimension (a cache's empty past before
the new keys, in a plain forward that builds a cache), replaced by its one real operand when nothing writes into
the result and the graph does not return it. All of these return their input, an alias of it or a copy of its
values, so removing them is exact. Dropout in training mode is random and stays (reported as a near-miss).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from hetforge.passes.common import (
    NearMiss,
    PassLog,
    Rewrite,
    aten,
    graph_pass,
    may_write,
    scalar,
    tval,
)

_DROPOUTS = (aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default)
# detach_ writes only autograd metadata (no values), so in an inference graph it too is its input
_ALIASES = (aten.alias.default, aten.detach.default, aten.detach_.default, aten.lift_fresh.default)
_SAME_SHAPE = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default)
_ASSERTS = (aten._assert_tensor_metadata.default,)
_TO = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default)


def _is_identity_to(n: Node) -> bool:
    """``aten.to`` that changes nothing: same dtype, device and layout, no copy, no memory-format change."""
    x, out = tval(n.args[0]), tval(n)
    if x is None or out is None or n.target is aten._to_copy.default:
        return False  # _to_copy always makes a new tensor; keep it (in-place users may rely on that)
    if n.kwargs.get("copy") or n.kwargs.get("memory_format") not in (None, torch.preserve_format):
        return False
    if n.target is aten.to.dtype and len(n.args) > 3 and n.args[3]:  # to.dtype(self, dtype, non_blocking, copy)
        return False
    if n.target is aten.to.device and len(n.args) > 4 and n.args[4]:  # to.device(self, device, dtype, nb, copy)
        return False
    return x.dtype == out.dtype and x.device == out.device and x.layout == out.layout and x.shape == out.shape


def _mutates(n: Node) -> bool:
    """Whether ``n`` may write into one of its inputs (:func:`may_write`; here a call of anything but an op with a
    schema counts too: nothing says it does not write)."""
    return may_write(n) or (n.op == "call_function" and not isinstance(n.target, torch._ops.OpOverload))


def _is_view(n: Node) -> bool:
    """Whether ``n``'s result shares its input's memory (an ATen view: its schema's return aliases an input)."""
    schema = getattr(n.target, "_schema", None)
    return n.op == "call_function" and schema is not None and not schema.is_mutable and any(
        r.alias_info is not None for r in schema.returns)


def _written_or_returned(n: Node) -> bool:
    """Whether anything writes into ``n``'s result, directly or through views of it, or the graph returns it or such
    a view (the caller would then get the operand's memory, perhaps an input's, instead of a new tensor)."""
    stack, seen = [n], {n}
    while stack:
        for u in stack.pop().users:
            if u.op == "output" or _mutates(u):
                return True
            if _is_view(u) and u not in seen:
                seen.add(u)
                stack.append(u)
    return False


def _cat_of_one(n: Node) -> Node | None:
    """The one operand of a ``cat`` whose other operands are all empty along the cat dimension (e.g. a KV cache's
    empty past concatenated with the new keys in a plain forward that builds a cache), when it has the cat's shape
    and dtype, nothing writes into the result (which would then write into the operand's memory) and the graph does
    not return it (see :func:`_written_or_returned`)."""
    if n.target is not aten.cat.default or not isinstance(n.args[0], (list, tuple)):
        return None
    out = tval(n)
    if out is None:
        return None
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
    kept = []
    for a in n.args[0]:
        v = tval(a)
        if not isinstance(a, Node) or v is None:
            return None
        empty = (v.dim() == 1 and v.shape[0] == 0) or (v.dim() == out.dim() and v.shape[dim] == 0)
        if not empty:  # (cat skips a 1-D empty tensor of any other rank: the legacy empty-past form)
            kept.append((a, v))
    if len(kept) != 1:
        return None
    a, v = kept[0]
    if tuple(v.shape) != tuple(out.shape) or v.dtype != out.dtype or v.device != out.device:
        return None
    return None if _written_or_returned(n) else a


def _removal(n: Node) -> tuple[str, Node] | str | None:
    """(kind, replacement) when ``n`` can go, a near-miss reason string, or None when it is not a candidate."""
    t = n.target
    if t is aten.cat.default:
        one = _cat_of_one(n)
        return ("cat_of_one", one) if one is not None else None
    if t in _DROPOUTS:
        p = scalar(n.args[1]) if len(n.args) > 1 else 0.0
        train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
        if train is False or p == 0.0:
            return "dropout", n.args[0]
        return f"dropout in training mode (p={p}) is random; kept"
    if t in _TO:
        return ("identity_cast", n.args[0]) if _is_identity_to(n) else None
    if t in _ALIASES:
        return "alias", n.args[0]
    x, out = tval(n.args[0]) if n.args else None, tval(n)
    if x is None or out is None:
        return None
    if t is aten.contiguous.default and x.is_contiguous():
        return "noop_contiguous", n.args[0]
    if t in _SAME_SHAPE and tuple(x.shape) == tuple(out.shape):
        return "noop_view", n.args[0]
    return None


@graph_pass("cleanup")
def cleanup(gm: GraphModule, log: PassLog) -> None:
    """Remove no-op nodes (see module doc) and dead code; returns a new GraphModule in the result."""
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target in _ASSERTS:
            log.rewrites.append(Rewrite("assert_metadata", [n.name], None))
            gm.graph.erase_node(n)
            continue
        r = _removal(n)
        if isinstance(r, str):
            log.near_misses.append(NearMiss("dropout", n.name, r))
        elif r is not None:
            kind, repl = r
            if not isinstance(repl, Node):
                continue
            n.replace_all_uses_with(repl)
            log.rewrites.append(Rewrite(kind, [n.name], repl.name))
            gm.graph.erase_node(n)  # explicitly: DCE keeps random ops such as dropout even when unused
