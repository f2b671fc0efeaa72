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
import weakref
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


def dead_code(graph: torch.fx.Graph) -> bool:
    """Erase every node without users that has no side effect, last node first (so a dead chain goes in one
    sweep): ``Graph.eliminate_dead_code``'s rule (``Node.is_impure``), with each call target's answer asked once
    per sweep, and without its lint (the callers lint). Why: torch asks every node again, and the answer (a
    schema and registry lookup) was about a sixth of the pass pipeline's time. A higher-order operator's answer
    depends on its arguments, so it is asked per node. Returns whether anything was erased."""
    impure: dict[Any, bool] = {}
    changed = False
    for node in reversed(graph.nodes):
        if node.users:
            continue
        if node.op != "call_function" or isinstance(node.target, torch._ops.HigherOrderOperator):
            side = node.is_impure()
        else:
            side = impure.get(node.target)
            if side is None:
                side = impure[node.target] = node.is_impure()
        if not side:
            graph.erase_node(node)
            changed = True
    return changed


def finish(gm: GraphModule, standalone: bool = True) -> GraphModule:
    """Dead-code elimination (:func:`dead_code`), then lint and recompile unless the pass manager does both
    (``standalone=False``)."""
    dead_code(gm.graph)
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


class _NoKey(Exception):
    """An argument :func:`_meta_key` cannot key by value (a symbolic size, an arbitrary object)."""


_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _meta_key(a: Any) -> Any:
    """What a fake kernel can see of ``a``: a tensor's shape, strides, dtype, device and grad flag (never its
    values: fake tensors have none), plain values as they are. Raises :class:`_NoKey` for anything else."""
    if isinstance(a, torch.Tensor):
        shape, stride = tuple(a.shape), a.stride()
        if not all(type(d) is int for d in (*shape, *stride)):
            raise _NoKey
        return ("T", shape, stride, a.dtype, a.device, a.requires_grad)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, *(_meta_key(x) for x in a))
    if isinstance(a, dict):
        return ("D", *((k, _meta_key(v)) for k, v in a.items()))
    if a is None or isinstance(a, _PLAIN):
        return (type(a).__name__, a)
    raise _NoKey


def _out_meta(out: Any) -> Any:
    """``out`` with each tensor replaced by its shape, strides, dtype, device and grad flag (what :func:`_fresh`
    makes new fake tensors from; no tensor kept: a fake tensor holds its fake mode, the memo's weak key)."""
    if isinstance(out, torch.Tensor):
        return ("T", tuple(out.shape), out.stride(), out.dtype, out.device, out.requires_grad)
    if isinstance(out, (list, tuple)):
        return type(out)(_out_meta(x) for x in out)
    return out


def _fresh(meta: Any) -> Any:
    """New fake tensors for :func:`_out_meta`'s record (call inside the fake mode)."""
    if isinstance(meta, tuple) and len(meta) == 6 and meta[0] == "T":
        _, shape, stride, dtype, device, grad = meta
        return torch.empty_strided(shape, stride, dtype=dtype, device=device, requires_grad=grad)
    if isinstance(meta, (list, tuple)):
        return type(meta)(_fresh(x) for x in meta)
    return meta


def _memo_ok(target: Any) -> bool:
    """A hetforge op whose schema returns fresh tensors (no alias annotations): its outputs' metadata is a
    function of its arguments' metadata alone, so one fake-kernel run serves every node with equal arguments."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "hetforge":
        return False
    return all(r.alias_info is None for r in target._schema.returns)


_FAKE_OUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fake mode -> {(target, args' key): _out_meta}


def set_val(node: Node, fake_mode) -> None:
    """Compute ``node.meta['val']`` by running its target on its inputs' fake values.

    A hetforge op's fake kernel runs once per distinct argument metadata in a fake mode (:func:`_memo_ok`);
    a node with the same target and equal argument metadata (the same fused op in the next decoder layer) gets
    fresh fake tensors of that output's shapes, strides and dtypes. Why: dispatching each new node's fake
    kernel through the fake mode was about a third of the pass pipeline's time."""
    if fake_mode is None:
        return
    args = pytree.tree_map_only(Node, lambda a: a.meta.get("val"), node.args)
    kwargs = pytree.tree_map_only(Node, lambda a: a.meta.get("val"), node.kwargs)
    memo = key = None
    if _memo_ok(node.target):
        try:
            key = (node.target, _meta_key(args), _meta_key(kwargs))
            memo = _FAKE_OUTS.setdefault(fake_mode, {})
        except (_NoKey, TypeError):
            memo = None
    with fake_mode:
        if memo is not None and key in memo:
            node.meta["val"] = _fresh(memo[key])
            return
        out = node.target(*args, **kwargs)
        node.meta["val"] = out
    if memo is not None:
        memo[key] = _out_meta(out)


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
