"""Pass 3, common-subexpression elimination.

Two nodes are the same expression when they call the same deterministic, non-mutating op on the same
inputs (after earlier merges) and the same literal arguments; the later one is replaced by the earlier one.
``get_attr`` nodes of the same attribute merge too. Nodes that an in-place op mutates, random ops and
side-effecting nodes are never merged, nor nodes reading a mutated value (merging them would make two
values share storage or a seed, or read a value before and after a write as one).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

from hetforge.passes.common import PassLog, Rewrite, graph_pass, mutated_nodes


def _pure(n: Node) -> bool:
    if n.op == "get_attr":
        return True
    if n.op != "call_function":
        return False
    t = n.target
    if t is operator.getitem:
        return True
    if not isinstance(t, torch._ops.OpOverload):
        return False
    return not (t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags or n.is_impure())


def _key(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_key(a) for a in x))
    if isinstance(x, dict):
        return tuple(sorted((k, _key(v)) for k, v in x.items()))
    if isinstance(x, float) and x != x:
        return ("nan",)
    if isinstance(x, slice):
        return ("slice", x.start, x.stop, x.step)
    hash(x)  # raises TypeError for unhashable literals; the caller then skips the node
    return (type(x).__name__, x) if isinstance(x, (bool, int, float)) else x


@graph_pass("cse")
def cse(gm: GraphModule, log: PassLog) -> None:
    """Merge repeated pure expressions; returns a new GraphModule in the result."""
    mutated = mutated_nodes(gm)
    seen: dict[Any, Node] = {}
    for n in list(gm.graph.nodes):
        if not _pure(n) or n in mutated or any(a in mutated for a in n.all_input_nodes):
            continue  # a value read before and after an in-place write is not one expression
        try:
            key = (n.op, n.target, _key(n.args), _key(n.kwargs))
        except TypeError:
            continue
        first = seen.get(key)
        if first is None:
            seen[key] = n
            continue
        n.replace_all_uses_with(first)
        gm.graph.erase_node(n)
        log.rewrites.append(Rewrite("cse", [n.name], first.name))
