"""A graph as diffable text for structural Before/Expected tests: one line per op, inputs as ``%xN``, op
results as ``%N`` in graph order, weights as ``@path``; literals as Python writes them. Trailing arguments equal
to the op schema's default are left out (``torch.export`` drops them, a pass may spell them out)."""

from __future__ import annotations

from typing import Any

from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate


def graph_text(gm: GraphModule) -> str:
    names: dict[Node, str] = {}
    lines: list[str] = []

    def show(a: Any) -> str:
        if isinstance(a, Node):
            return names[a]
        if isinstance(a, (list, tuple)):
            inner = ", ".join(show(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        return repr(map_aggregate(a, lambda x: x))

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            names[n] = f"%x{sum(1 for v in names.values() if v.startswith('%x'))}"
        elif n.op == "get_attr":
            names[n] = f"@{n.target}"
        elif n.op == "call_function":
            names[n] = f"%{sum(1 for v in names.values() if v[1:].isdigit())}"
            op = n.target.name() if hasattr(n.target, "name") else getattr(n.target, "__name__", str(n.target))
            args = [show(a) for a in _without_defaults(n)] + [f"{k}={show(v)}" for k, v in n.kwargs.items()]
            lines.append(f"{names[n]} = {op}({', '.join(args)})")
        elif n.op == "output":
            lines.append(f"return {show(n.args[0])}")
    return "\n".join(lines)


def _without_defaults(n: Node) -> tuple:
    args = tuple(n.args)
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return args
    params = schema.arguments
    while args and len(args) <= len(params):
        p = params[len(args) - 1]
        if not p.has_default_value() or isinstance(args[-1], Node) or args[-1] != p.default_value:
            break
        args = args[:-1]
    return args
