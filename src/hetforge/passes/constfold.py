"""Pass 2, constant folding: subgraphs whose inputs are all constants become constant buffers.

A node is constant when it is a ``get_attr`` of a tensor, or a deterministic, non-mutating ATen call whose
node inputs are all constant and whose shape is static (creation ops such as ``arange``/``zeros`` have no
node inputs, so they are constant too). Each constant node that feeds a non-constant node (the frontier) is
evaluated once on real tensors and replaced by a new ``get_attr`` buffer (``_folded_<n>``) whose fake value
keeps shapes flowing. Typical catches: the causal part of the attention mask for a static sequence length,
rotary cos/sin tables, weight transposes. Equal results share one buffer. Results above ``max_bytes`` stay
in the graph (near-miss).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from hetforge.passes.common import (
    NearMiss,
    PassLog,
    Rewrite,
    const_tensor,
    fake_mode_of,
    graph_pass,
    mutated_nodes,
    val,
)

DEFAULT_MAX_BYTES = 64 * 2**20
_NEVER = {torch.ops.aten._assert_tensor_metadata.default}


def _static(v: Any) -> bool:
    leaves = pytree.tree_leaves(v)
    return bool(leaves) and all(
        isinstance(t, torch.Tensor) and all(isinstance(s, int) for s in t.shape) for t in leaves
    )


def _foldable_op(n: Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return True
    t = n.target
    if not isinstance(t, torch._ops.OpOverload) or t in _NEVER or t.namespace not in ("aten", "prims"):
        return False
    if t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags or n.is_impure():
        return False
    return _static(val(n))


def _constant_nodes(gm: GraphModule, attrs: dict[Node, torch.Tensor]) -> set[Node]:
    const: set[Node] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            t = attrs[n] = const_tensor(gm, n)
            if t is not None and not t.is_meta:  # weights on the meta device have no values to fold
                const.add(n)
        elif all(a in const for a in n.all_input_nodes) and _foldable_op(n):  # cheap test first
            const.add(n)
    return const


def _nbytes(v: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor))


def _ancestors(n: Node, const: set[Node]) -> list[Node]:
    seen: dict[Node, None] = {}
    stack = [n]
    while stack:
        m = stack.pop()
        if m in seen or m not in const or m.op != "call_function":
            continue
        seen[m] = None
        stack.extend(m.all_input_nodes)
    return list(seen)


def _same_value(folded: list[tuple[str, torch.Tensor]], value: torch.Tensor) -> str | None:
    for name, t in folded:
        if t.shape == value.shape and t.dtype == value.dtype and torch.equal(t, value):
            return name
    return None


def _unique_name(gm: GraphModule, base: str) -> str:
    i = 0
    while hasattr(gm, f"{base}{i}"):
        i += 1
    return f"{base}{i}"


@graph_pass("constant_fold")
def constant_fold(gm: GraphModule, log: PassLog, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
    """Fold constant subgraphs into ``get_attr`` buffers (each at most ``max_bytes``)."""
    fake_mode = fake_mode_of(gm)
    attrs: dict[Node, torch.Tensor] = {}
    const = _constant_nodes(gm, attrs)
    env: dict[Node, Any] = {}

    def evaluate(n: Node) -> Any:
        if n in env:
            return env[n]
        if n.op == "get_attr":
            env[n] = attrs[n] if n in attrs else const_tensor(gm, n)
            return env[n]
        for a in n.all_input_nodes:
            evaluate(a)
        args = pytree.tree_map_only(Node, lambda a: env[a], n.args)
        kwargs = pytree.tree_map_only(Node, lambda a: env[a], n.kwargs)
        env[n] = n.target(*args, **kwargs)
        return env[n]

    folded: list[tuple[str, torch.Tensor]] = []
    mutated = mutated_nodes(gm)
    param_ptrs = {t.untyped_storage().data_ptr() for t in attrs.values() if t is not None}
    for n in list(gm.graph.nodes):
        if n not in const or n.op != "call_function" or not isinstance(val(n), torch.Tensor):
            continue
        if all(u in const for u in n.users):
            continue  # interior of a constant subgraph: folded with its frontier
        if n in mutated:
            log.near_misses.append(NearMiss("constant", n.name, "an in-place op writes into it; a folded buffer would "
                                                        "carry the write into the next call"))
            continue
        size = _nbytes(val(n))
        if size > max_bytes:
            log.near_misses.append(NearMiss("constant", n.name, f"constant result is {size / 2**20:.1f} MiB, above the "
                                                        f"{max_bytes / 2**20:.1f} MiB folding limit"))
            continue
        with torch.no_grad():
            value = evaluate(n).detach().contiguous()
        if value.untyped_storage().data_ptr() in param_ptrs:  # a view of a weight: own the folded copy
            value = value.clone()
        name = _same_value(folded, value)
        if name is None:  # equal values (e.g. each layer's copy of the rotary table) share one buffer
            name = _unique_name(gm, "_folded_")
            gm.register_buffer(name, value, persistent=False)
            folded.append((name, value))
        with gm.graph.inserting_before(n):
            c = gm.graph.get_attr(name)
        c.meta["val"] = fake_mode.from_tensor(value, static_shapes=True) if fake_mode is not None else value
        for k in ("stack_trace", "nn_module_stack"):
            if k in n.meta:
                c.meta[k] = n.meta[k]
        n.replace_all_uses_with(c)
        log.rewrites.append(Rewrite("fold", [m.name for m in _ancestors(n, const)], name,
                                f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"))
