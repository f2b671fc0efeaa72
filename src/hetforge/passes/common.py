"""Shared pieces of the middle-end passes: result records, graph copying and node helpers.

Every pass is a pure function ``GraphModule -> PassResult`` made by one skeleton, :func:`graph_pass`: it
copies the graph first (parameters are shared, never copied or mutated), lets the pass body rewrite the copy
and record what it rewrote and what it deliberately left alone (:class:`PassLog`), runs dead-code elimination
and ``Graph.lint``, and returns the new module inside the result with its node counts and measured seconds.
``inplace=True`` skips the copy, lint and recompile; the pipeline uses it on its own private copy (one copy
per pipeline instead of one per pass) and lets the pass manager recompile.
"""

from __future__ import annotations

import copy
import functools
import operator
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

aten = torch.ops.aten
try:  # generates Python code on first call instead of on every recompile (a third of the pipeline's time)
    from torch.fx._lazy_graph_module import _LazyGraphModule as _LAZY_GM
except ImportError:  # pragma: no cover - older/newer torch without it
    _LAZY_GM = GraphModule
_KEEP_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node", "seq_nr", "torch_fn")


@dataclass
class Rewrite:
    """One rewrite: the matched source nodes and the node that replaced them (None: simply removed)."""

    kind: str
    matched: list[str]
    new_node: str | None
    detail: str = ""


@dataclass
class NearMiss:
    """A pattern that almost matched and was left alone on purpose, with the reason."""

    kind: str
    node: str
    reason: str


@dataclass
class PassResult:
    """What one pass did to the graph."""

    name: str
    gm: GraphModule
    nodes_before: int
    nodes_after: int
    rewrites: list[Rewrite] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    seconds: float = 0.0
    fidelity: dict[str, float] | None = None  # vs the previous graph, when verified

    @property
    def changed(self) -> bool:
        return bool(self.rewrites) or self.nodes_before != self.nodes_after

    def to_dict(self, full: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name, "nodes_before": self.nodes_before, "nodes_after": self.nodes_after,
            "rewrites": len(self.rewrites), "near_misses": len(self.near_misses), "seconds": self.seconds,
        }
        if self.fidelity is not None:
            d["fidelity"] = self.fidelity
        if full:
            d["rewrite_list"] = [asdict(r) for r in self.rewrites]
            d["near_miss_list"] = [asdict(m) for m in self.near_misses]
        return d


class Miss(Exception):
    """A pattern check failed: the candidate is left alone and the message becomes the near-miss reason."""


@dataclass
class PassLog:
    """What a pass body records while it rewrites: the rewrites made and the near-misses left alone."""

    rewrites: list[Rewrite] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)


PassBody = Callable[..., None]


def graph_pass(name: str) -> Callable[[PassBody], Callable[..., PassResult]]:
    """The one pass skeleton. ``body(gm, log, *options)`` rewrites ``gm`` in place and records into ``log``;
    the decorated function ``pass_(gm, *options, inplace=False) -> PassResult`` times it (measured), counts
    nodes before and after, works on a copy unless ``inplace``, and finishes the graph (:func:`finish`)."""

    def wrap(body: PassBody) -> Callable[..., PassResult]:
        @functools.wraps(body)
        def run(gm: GraphModule, *options: Any, inplace: bool = False, **kw: Any) -> PassResult:
            t0 = time.perf_counter()
            before = num_nodes(gm)
            gm = gm if inplace else copy_gm(gm)
            log = PassLog()
            body(gm, log, *options, **kw)
            finish(gm, standalone=not inplace)
            return PassResult(name, gm, before, num_nodes(gm), log.rewrites, log.near_misses,
                              time.perf_counter() - t0)

        del run.__wrapped__  # its signature is (gm, *options, inplace), not the body's
        run.pass_name = name  # type: ignore[attr-defined]
        return run

    return wrap


def copy_gm(gm: GraphModule) -> GraphModule:
    """A new GraphModule with a copied graph; parameters/buffers are shared (not copied), nodes' meta shallow-copied.

    It is a lazily compiled GraphModule (``torch.fx``'s ``_LazyGraphModule``): ``recompile()`` only marks the
    code stale and the Python code is generated once, on the first call.
    """
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    out = graph.graph_copy(gm.graph, env, return_output_node=True)
    if isinstance(out, tuple):
        value, out_node = out
        graph.output(value, type_expr=getattr(out_node, "type", None))
        graph.output_node().meta = copy.copy(out_node.meta)
    graph._codegen = copy.copy(gm.graph._codegen)
    new = _LAZY_GM(gm, graph, class_name="GraphModule")
    new.meta = dict(getattr(gm, "meta", {}) or {})
    return new


def finish(gm: GraphModule, standalone: bool = True) -> GraphModule:
    """Dead-code elimination, then lint and recompile unless the pass manager does both (``standalone=False``)."""
    gm.graph.eliminate_dead_code()
    if standalone:
        gm.graph.lint()
        gm.recompile()
    return gm


def erase_unused(gm: GraphModule, nodes: Iterable[Node]) -> None:
    """Erase the given nodes once they have no users (cheaper than a full DCE per rewrite, and DCE keeps ops
    tagged random such as SDPA and dropout)."""
    pending = [n for n in nodes if isinstance(n, Node)]
    changed = True
    while changed:
        changed = False
        for n in pending:
            if not getattr(n, "_erased", False) and not n.users and n.op == "call_function":
                gm.graph.erase_node(n)
                changed = True


def may_write(n: Node) -> bool:
    """Whether ``n`` is an ATen/library op that may write into its arguments (in-place ops such as ``div_``)."""
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable


def mutated_nodes(gm: GraphModule) -> set[Node]:
    """Nodes passed to an op that may write into its arguments (:func:`may_write`)."""
    out: set[Node] = set()
    for n in gm.graph.nodes:
        if may_write(n):
            out.update(n.all_input_nodes)
    return out


def num_nodes(gm: GraphModule) -> int:
    return len(gm.graph.nodes)


def val(n: Any) -> Any:
    """The fake value (``meta['val']``) of a node, or the object itself when it is not a node."""
    return n.meta.get("val") if isinstance(n, Node) else n


def tval(n: Any) -> torch.Tensor | None:
    """The fake tensor of a node, or None when the node does not produce one tensor."""
    v = val(n)
    return v if isinstance(v, torch.Tensor) else None


def is_call(n: Any, *targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def fake_mode_of(gm: GraphModule):
    """The FakeTensorMode the graph's ``meta['val']`` tensors belong to (None if the graph has none)."""
    from torch._subclasses.fake_tensor import FakeTensor

    for n in gm.graph.nodes:
        v = n.meta.get("val")
        for leaf in pytree.tree_leaves(v):
            if isinstance(leaf, FakeTensor):
                return leaf.fake_mode
    return None


def set_val(node: Node, fake_mode) -> None:
    """Compute ``node.meta['val']`` by running its target on its inputs' fake values."""
    if fake_mode is None:
        return
    args = pytree.tree_map_only(Node, lambda a: a.meta.get("val"), node.args)
    kwargs = pytree.tree_map_only(Node, lambda a: a.meta.get("val"), node.kwargs)
    with fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)


def inherit_meta(new: Node, old: Node) -> None:
    """Carry source location and module path from the node a rewrite replaces (placement reads them)."""
    for k in _KEEP_META:
        if k in old.meta and k not in new.meta:
            new.meta[k] = old.meta[k]


def new_call(gm: GraphModule, before: Node, target, args: tuple, kwargs: dict | None = None,
             like: Node | None = None, fake_mode=None) -> Node:
    """Insert ``target(*args)`` before ``before``, with its fake value and the meta of ``like``."""
    with gm.graph.inserting_before(before):
        n = gm.graph.call_function(target, args, kwargs or {})
    set_val(n, fake_mode)
    if like is not None:
        inherit_meta(n, like)
    return n


def only_user(n: Node) -> Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def scalar(x: Any) -> float | None:
    """A Python number argument as float (None for tensors, nodes and the rest)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    return None


def const_tensor(gm: GraphModule, n: Any) -> torch.Tensor | None:
    """The real tensor behind a ``get_attr`` node (a parameter, buffer or folded constant), else None."""
    if not (isinstance(n, Node) and n.op == "get_attr"):
        return None
    obj: Any = gm
    for part in str(n.target).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None


def const_scalar(gm: GraphModule, x: Any) -> float | None:
    """A Python number, or the value of a 0-d/1-element constant tensor node; None otherwise."""
    s = scalar(x)
    if s is not None:
        return s
    t = const_tensor(gm, x)
    if t is not None and t.numel() == 1 and t.dim() == 0:
        return float(t.item())
    return None


def norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def describe(n: Any) -> str:
    """A short description of what produces a value, for near-miss reasons."""
    if not isinstance(n, Node):
        return repr(n)
    if n.op == "call_function":
        from hetforge.frontend import op_name

        if n.target is operator.getitem and isinstance(n.args[0], Node):
            return f"output {n.args[1]} of {describe(n.args[0])}"
        return f"{op_name(n)} ({n.name})"
    return f"{n.op} {n.name}"


def all_nodes(args: Iterable[Any]) -> list[Node]:
    return [a for a in pytree.tree_leaves(list(args)) if isinstance(a, Node)]


def is_getitem(n: Any, index: int | None = None) -> bool:
    return is_call(n, operator.getitem) and (index is None or n.args[1] == index)


def fused_counts(gm: GraphModule) -> dict[str, int]:
    """How many of each ``hetforge::`` fused op the graph holds."""
    counts = {k: 0 for k in FUSED_OPS}
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "hetforge":
            name = n.target._opname
            counts[name] = counts.get(name, 0) + 1
    return counts


FUSED_OPS = ("attention", "linear_act", "gated_mlp", "rotary", "rms_norm", "layer_norm", "moe")
