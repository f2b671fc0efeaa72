"""Capture a runtime module by exporting two decoder layers and stamping out the rest.

``torch.export`` traces every operation of every layer through fake tensors, so a capture's time grows with the
layer count, while a decoder's layers are one graph repeated with other weights (and, in decode, other cache
inputs). So the model's layer list is cut to its first two layers, that is exported, and layer 1's nodes are copied
for layers 2..L-1: each copy reads its own layer's weights and cache inputs, takes the previous copy's values where
layer 1 took layer 0's, and the nodes after the stack read the last copy. The graph is what the full export gives,
node for node (``tests/test_stamp.py`` compares the two and their outputs on the zoo).

``LogitsModule`` (the forward programs of ``runtime.shapes``) is captured the same way. Two layers, not one,
because layer 1 is checked against layer 0 before anything is copied: the same operations with the same constants,
weights of the same names and shapes, layer 0's inputs in the places where layer 1 reads layer 0's outputs. Where
layers differ (per-layer attention types or windows in the config or on the modules, other module types, other
shapes) or the stack is not one clean region of the graph, the capture is refused with the reason, and the caller
exports the whole model.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.fx.node import map_aggregate
from torch.utils._pytree import tree_flatten

from hetforge.frontend import CapturedGraph, capture, param_paths
from hetforge.runtime.static_kv import model_dims

LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
_PLAIN = (int, float, str, bool, type(None))


class StampRefused(Exception):
    """The model's layers cannot be stamped out from two (the message says why); export the whole model."""


@dataclass
class Stack:
    """The decoder layer list of a causal LM: its path under the runtime wrapper and the config field counting it."""

    path: str  # e.g. "model.transformer.h" (the wrapper holds the HF model as ``model``)
    blocks: nn.ModuleList
    owner: nn.Module
    attr: str
    count_field: str


def find_stack(model: nn.Module) -> Stack:
    """The one ``ModuleList`` of ``L`` same-typed layers, checked to be uniform (else :class:`StampRefused`)."""
    try:
        layers = model_dims(model)[0]
    except (AttributeError, TypeError):
        raise StampRefused("no layer count in the model's config") from None
    if layers < 3:
        raise StampRefused(f"{layers} layers: nothing to stamp out")
    found = [(name, mod) for name, mod in model.named_modules()
             if isinstance(mod, nn.ModuleList) and len(mod) == layers and len({type(b) for b in mod}) == 1]
    if len(found) != 1:
        raise StampRefused(f"{len(found)} module lists of {layers} same-typed layers (need exactly one)")
    name, blocks = found[0]
    owner_name, _, attr = name.rpartition(".")
    field = next((f for f in LAYER_COUNT_FIELDS if f in vars(model.config) and getattr(model.config, f) == layers),
                 None)
    if field is None:
        raise StampRefused(f"no config field among {', '.join(LAYER_COUNT_FIELDS)} holds the layer count {layers}")
    for key, value in vars(model.config).items():
        if isinstance(value, list | tuple) and len(value) == layers and len({repr(v) for v in value}) > 1:
            raise StampRefused(f"the config's '{key}' differs between layers")
    first = _signature(blocks[0])
    for i, b in enumerate(blocks):
        if _signature(b) != first:
            raise StampRefused(f"layer {i} differs from layer 0 (its modules, attributes or weight shapes)")
    return Stack(f"model.{name}", blocks, model.get_submodule(owner_name), attr, field)


def _signature(block: nn.Module) -> list:
    """What must be equal between two layers for one to stand for the other: each submodule's type and plain
    attributes (but its layer index), each weight's name, shape and dtype."""
    sig: list = []
    for name, mod in block.named_modules():
        plain = sorted((k, repr(v)) for k, v in vars(mod).items()
                       if not k.startswith("_") and k != "layer_idx" and isinstance(v, _PLAIN))
        sig.append((name, type(mod).__qualname__, plain))
    for name, t in [*block.named_parameters(), *block.named_buffers()]:
        sig.append((name, tuple(t.shape), t.dtype))
    return sig


@contextlib.contextmanager
def _cut(stack: Stack, model: nn.Module, keep: int) -> Iterator[None]:
    """The model with its first ``keep`` layers only (the layer list and the config's count), restored after."""
    setattr(stack.owner, stack.attr, nn.ModuleList(list(stack.blocks)[:keep]))
    count = getattr(model.config, stack.count_field)
    setattr(model.config, stack.count_field, keep)
    try:
        yield
    finally:
        setattr(stack.owner, stack.attr, stack.blocks)
        setattr(model.config, stack.count_field, count)


def _two_layers(module: nn.Module, inputs: tuple, name: str) -> tuple[CapturedGraph, Stack, int, int, _Two]:
    """``module``'s first two layers exported, checked for stamping (:class:`StampRefused` when they cannot be)."""
    model = getattr(module, "model", None)
    if not isinstance(model, nn.Module):
        raise StampRefused("the module holds no Hugging Face model as 'model'")
    stack = find_stack(model)
    layers = len(stack.blocks)
    per = getattr(type(module), "LAYER_INPUTS", 0)
    fixed = len(inputs) - per * layers
    with _cut(stack, model, 2):
        cg = capture(module, tuple(inputs[:fixed + 2 * per]), name=name, stack_traces=False, guards=False)
    return cg, stack, fixed, per, _checked(cg.gm, stack, fixed, per)


def capture_stamped(module: nn.Module, inputs: tuple, name: str) -> CapturedGraph:
    """Capture ``module`` (a wrapper holding the HF model as ``model``: the runtime's ``static_kv`` / ``batched``
    modules, whose class's ``LAYER_INPUTS`` inputs per layer come last, or ``LogitsModule``) on ``inputs`` by
    exporting two layers and stamping out the rest; :class:`StampRefused` when the layers are not uniform."""
    t0 = time.perf_counter()
    cg, stack, fixed, per, two = _two_layers(module, inputs, name)
    layers = len(stack.blocks)
    _stamp(cg.gm, stack, fixed, per, two=two)
    seconds = time.perf_counter() - t0
    return CapturedGraph(cg.gm, cg.exported, tuple(inputs), seconds, cg.strict, name, param_paths(cg.gm, module),
                         note=f"capture: 2 of {layers} layers exported, layers 2..{layers - 1} stamped from layer 1 "
                              "(the exported program holds the 2 layers)")


@dataclass
class Deferred:
    """A two-layer capture whose other layers are stamped out after the middle-end passes, so the passes run on two
    layers, not all (``hetforge.compile.compile_graph``'s ``expand``).

    :meth:`after_passes` stamps the optimized graph where layer 1 is still layer 0 one layer on (the check of the
    capture, run again), reading no constant the passes made unless layer 0 reads the same node: a folded
    constant may come from one layer's weights, so it is never taken as equal by value. An operation of layer 0
    that reads nothing of any layer (what common-subexpression elimination kept of a computation every layer
    repeats, e.g. the rotary tables' unsqueeze) counts as before the layers: every copy reads it, as after the
    whole graph's passes. Where it is refused, :meth:`whole` gives the capture stamped before any pass, and the
    caller runs the passes on that. ``tests/test_stamp.py`` checks the result is the whole graph's passes'
    graph, node for node, with the same outputs bit for bit."""

    cg: CapturedGraph  # the two-layer capture (never modified before whole())
    module: nn.Module  # what was captured (the weights' paths are read from it once the layers are stamped)
    stack: Stack
    fixed: int
    per: int
    inputs: tuple  # the whole module's inputs
    per_layer: int  # nodes each stamped layer adds before the passes (its inputs, weights and operations)
    refused: str = ""
    stamped: bool = False
    seconds: float = 0.0  # stamping, measured

    @property
    def two_inputs(self) -> tuple:
        """The inputs of the two-layer graph."""
        return tuple(self.inputs[:self.fixed + 2 * self.per])

    @property
    def layers(self) -> int:
        return len(self.stack.blocks)

    def whole_nodes(self) -> int:
        """The node count of the whole capture (what stamping before the passes gives)."""
        return len(self.cg.gm.graph.nodes) + (self.layers - 2) * self.per_layer

    def after_passes(self, gm: torch.fx.GraphModule) -> bool:
        """Stamp layers 2.. out of ``gm`` (the optimized two-layer graph) in place; False (why: ``refused``) where
        its layers are refused."""
        t0 = time.perf_counter()
        known = {str(n.target) for n in self.cg.gm.graph.nodes if n.op == "get_attr"}
        made = frozenset(str(n.target) for n in gm.graph.nodes if n.op == "get_attr") - known
        try:
            _stamp(gm, self.stack, self.fixed, self.per, made=made)
            self.stamped = True
            self.cg.param_paths = param_paths(gm, self.module)
        except StampRefused as e:
            self.refused = str(e)
        self.seconds += time.perf_counter() - t0
        return self.stamped

    def whole(self) -> torch.fx.GraphModule:
        """The capture with its layers stamped out before any pass (in place: call it once)."""
        t0 = time.perf_counter()
        _stamp(self.cg.gm, self.stack, self.fixed, self.per)
        self.cg.param_paths = param_paths(self.cg.gm, self.module)
        self.seconds += time.perf_counter() - t0
        return self.cg.gm

    def note(self) -> str:
        n = self.layers
        if self.stamped:
            return (f"capture: 2 of {n} layers exported and optimized, layers 2..{n - 1} stamped from layer 1 after "
                    "the passes (the exported program holds the 2 layers)")
        why = f" (stamping the optimized layers refused: {self.refused})" if self.refused else ""
        return (f"capture: 2 of {n} layers exported, layers 2..{n - 1} stamped from layer 1 before the passes{why} "
                "(the exported program holds the 2 layers)")


def capture_layers(module: nn.Module, inputs: tuple, name: str, defer: bool = False) -> CapturedGraph:
    """:func:`capture_stamped`, or the whole module's export (its note says why) where the layers are refused.

    ``defer``: the layers are not stamped yet: the result holds the two-layer graph and, as ``deferred``, the
    :class:`Deferred` that stamps them (for a caller that hands it to ``compile_graph(expand=...)``); None there
    where the whole module was exported."""
    t0 = time.perf_counter()
    try:
        if not defer:
            return capture_stamped(module, inputs, name)
        cg, stack, fixed, per, two = _two_layers(module, inputs, name)
        d = Deferred(cg, module, stack, fixed, per, tuple(inputs),
                     len(two.inputs1) + len(two.weights1) + len(two.ops1))
        cg.seconds = time.perf_counter() - t0
        cg.note = d.note()
        cg.deferred = d
        return cg
    except StampRefused as e:
        cg = capture(module, inputs, name=name, stack_traces=False, guards=False)
        cg.seconds = time.perf_counter() - t0
        cg.note = f"capture: the whole module exported (layers not stamped: {e})"
        return cg


@dataclass
class _Two:
    """A 2-layer graph read for stamping: each node's layer (None outside the stack), layer 1's operations, inputs
    and weights, each layer-1 node's layer-0 counterpart, the operations after the stack, the graph's outputs and
    the positions of layer 1's among them."""

    layer: dict
    ops1: list
    inputs1: list
    weights1: list
    counterpart: dict
    after: list
    results: tuple
    out1: list


def _stamp(gm: torch.fx.GraphModule, stack: Stack, fixed: int, per: int, two: _Two | None = None,
           made: frozenset[str] | None = None) -> None:
    """Copy layer 1 of a 2-layer graph out to ``len(stack.blocks)`` layers, in place (checked first, unless
    ``two`` is the check's result for ``gm`` as it is). ``made``: given for an optimized graph, the constants
    the passes made (see :func:`_checked` and :class:`Deferred`)."""
    two = two if two is not None else _checked(gm, stack, fixed, per, made)
    g, layer, counterpart = gm.graph, two.layer, two.counterpart
    inv = {v: k for k, v in counterpart.items()}  # layer-0 node -> layer-1 node
    prev = dict(inv)  # layer-0 node -> its counterpart in the layer copied last (what the next copy reads)
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    last_ph = placeholders[-1] if placeholders else None
    last_attr, last_op = (two.weights1[-1] if two.weights1 else None), two.ops1[-1]
    added: list[torch.fx.Node] = []
    rests = [(a, _in_layer(stack, str(a.target))) for a in two.weights1]  # each weight's path inside its layer
    for k in range(2, len(stack.blocks)):
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for p in two.inputs1:  # this layer's own inputs (decode: its K/V cache), after the last input
            with g.inserting_after(last_ph):
                env[p] = last_ph = g.placeholder(_renumber(p.name, (k - 1) * per))
            last_ph.meta = dict(p.meta)
        for a, rest in rests:  # this layer's own weights, after the last layer's
            target = f"{stack.path}.{k}.{rest}"
            _set_attr(gm, target, _fetch(stack.blocks[k], rest))
            with g.inserting_after(last_attr):
                env[a] = last_attr = g.get_attr(target)
            last_attr.meta = dict(a.meta)
        for n in two.ops1:  # layer 1's operations reading this layer's inputs and weights and the last copy's values
            with g.inserting_after(last_op):
                last_op = g.node_copy(n, lambda x, env=env, prev=prev: env.get(x) or prev.get(x, x))
            last_op.meta["nn_module_stack"] = _restack(n.meta.get("nn_module_stack") or {}, stack.path, k)
            env[n] = last_op
        prev = {x0: env[x1] for x0, x1 in inv.items() if x1 in env}
        added += [env[two.results[i]] for i in two.out1]
    for n in two.after:  # the nodes after the layers read the last copy
        n.args = map_aggregate(n.args, lambda x: _last(x, layer, counterpart, prev))
        n.kwargs = map_aggregate(n.kwargs, lambda x: _last(x, layer, counterpart, prev))
    out_spec = g._codegen.pytree_info.out_spec if isinstance(g._codegen, _PyTreeCodeGen) else None
    if two.out1:  # the per-layer outputs grow: a flat tuple of them all
        end = two.out1[-1] + 1
        results = (*two.results[:end], *added, *two.results[end:])
        out_spec = tree_flatten(results)[1]
        g.output_node().args = (results,)
    names = [p.name for p in g.nodes if p.op == "placeholder"]
    g._codegen = _PyTreeCodeGen(_PyTreeInfo(names, tree_flatten((tuple(names), {}))[1], out_spec))
    g.lint()
    gm.recompile()


def _layers(g: torch.fx.Graph, stack: Stack, fixed: int, per: int) -> dict:
    """Each node's layer: a placeholder's from its position (``per`` inputs per layer after ``fixed``), a weight's
    from its path, an operation's from its module stack; None outside the layers."""
    pattern = re.compile(rf"^{re.escape(stack.path)}\.(\d+)(?:\.|$)")

    def of_path(path: str) -> int | None:
        m = pattern.match(path)
        return int(m.group(1)) if m else None

    layer: dict[torch.fx.Node, int | None] = {}
    for i, n in enumerate(n for n in g.nodes if n.op == "placeholder"):
        layer[n] = (i - fixed) // per if i >= fixed else None
    for n in g.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "get_attr":
            layer[n] = of_path(str(n.target))
        elif n.op == "call_function":
            paths = [of_path(str(p)) for p, _ in (n.meta.get("nn_module_stack") or {}).values()]
            layer[n] = next((x for x in paths if x is not None), None)
        else:
            layer[n] = None
    return layer


def _checked(gm: torch.fx.GraphModule, stack: Stack, fixed: int, per: int,
             made: frozenset[str] | None = None) -> _Two:
    """The 2-layer graph read for stamping, once layer 1 is checked to be layer 0 one layer on (else
    :class:`StampRefused`). ``made`` (given for an optimized graph, :class:`Deferred`): the constants the passes
    made, never compared by value."""
    g = gm.graph
    layer = _layers(g, stack, fixed, per)
    calls = [n for n in g.nodes if n.op == "call_function"]
    hoisted = set()
    if made is not None:  # optimized: the passes' common-subexpression elimination keeps one copy of what every
        # layer computes alike from the inputs alone (e.g. the rotary tables' unsqueeze), in layer 0; it belongs
        # before the layers (the later layers read it, as after the whole graph's passes)
        for n in calls:
            if layer[n] == 0 and all(layer.get(a) is None for a in n.all_input_nodes):
                layer[n] = None
                hoisted.add(n)
    b0 = [n for n in calls if layer[n] == 0]
    b1 = [n for n in calls if layer[n] == 1]
    if not b0 or len(b0) != len(b1):
        raise StampRefused(f"layer 0 has {len(b0)} operations, layer 1 {len(b1)}")
    first, last = calls.index(b0[0]), calls.index(b1[-1])
    if [n for n in calls[first:last + 1] if n not in hoisted] != b0 + b1:
        raise StampRefused("the two layers are not one region of the graph (other operations between them)")
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    ph1 = [p for p in placeholders if layer[p] == 1]
    attrs = {str(n.target): n for n in g.nodes if n.op == "get_attr"}
    at1 = [n for n in g.nodes if n.op == "get_attr" and layer[n] == 1]
    counterpart = dict(zip(b1, b0, strict=True))  # layer-1 node -> layer-0 node
    counterpart.update(zip(ph1, [p for p in placeholders if layer[p] == 0], strict=True))
    for n in at1:
        twin = attrs.get(f"{stack.path}.0.{_in_layer(stack, str(n.target))}")
        if twin is None:
            raise StampRefused(f"layer 1 reads '{n.target}', layer 0 has no such weight")
        counterpart[n] = twin
    for a, b in zip(b1, b0, strict=True):
        if a.target != b.target or not _same_args(a, b, layer, counterpart, gm, made):
            raise StampRefused(f"layer 1's operation {a.name} ({a.target}) differs from layer 0's {b.name}")
    after = calls[last + 1:]
    if any(layer[x] == 0 for n in after for x in n.all_input_nodes):
        raise StampRefused("an operation after the layers reads layer 0")
    results = g.output_node().args[0]
    if not isinstance(results, tuple | list) or any(isinstance(r, tuple | list | dict) for r in results):
        raise StampRefused("the module's outputs are not one flat tuple")
    o0 = [i for i, r in enumerate(results) if isinstance(r, torch.fx.Node) and layer[r] == 0]
    o1 = [i for i, r in enumerate(results) if isinstance(r, torch.fx.Node) and layer[r] == 1]
    if len(o0) != len(o1) or (o0 and o1 != list(range(o0[-1] + 1, o0[-1] + 1 + len(o1)))) or \
            any(counterpart.get(results[j]) is not results[i] for i, j in zip(o0, o1, strict=True)):
        raise StampRefused("layer 1's outputs do not mirror layer 0's")
    return _Two(layer, b1, ph1, at1, counterpart, after, tuple(results), o1)


def _last(x, layer: dict, counterpart: dict, prev: dict):
    """What an operation after the layers reads in place of layer-1 value ``x``: the last copy's."""
    return prev[counterpart[x]] if isinstance(x, torch.fx.Node) and layer.get(x) == 1 else x


def _in_layer(stack: Stack, target: str) -> str:
    """The path of ``target`` (a weight of one layer, ``<stack>.<i>.<rest>``) inside its layer: ``rest``."""
    return target[len(stack.path) + 1:].split(".", 1)[1]


def _renumber(name: str, shift: int) -> str:
    """``cache_2`` shifted by 4 is ``cache_6`` (export's names for the layer-k inputs); other names get a suffix."""
    m = re.match(r"^(.*_)(\d+)$", name)
    return f"{m.group(1)}{int(m.group(2)) + shift}" if m else f"{name}_{shift}"


def _fetch(root: nn.Module, path: str):
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _set_attr(gm: nn.Module, target: str, value: torch.Tensor) -> None:
    """Hold ``value`` at ``target`` on ``gm`` (as the exported module holds layer 1's weights)."""
    *parents, leaf = target.split(".")
    mod = gm
    for p in parents:
        if not hasattr(mod, p):
            mod.add_module(p, nn.Module())
        mod = getattr(mod, p)
    if isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        mod.register_buffer(leaf, value)
    else:
        setattr(mod, leaf, value)


def _restack(stack_meta: dict, path: str, k: int) -> dict:
    """A layer-1 node's module stack with its layer made ``k``."""
    one = re.compile(rf"{re.escape(path)}\.1(?=\.|$)")
    return {one.sub(f"{path}.{k}", key): (one.sub(f"{path}.{k}", str(p)), t) for key, (p, t) in stack_meta.items()}


def _leaves(x, out: list) -> list:
    """``x`` (a node's args) flattened, with markers for the containers so two structures compare."""
    if isinstance(x, tuple | list):
        out.append(("seq", len(x)))
        for e in x:
            _leaves(e, out)
    elif isinstance(x, dict):
        out.append(("map", tuple(x)))
        for e in x.values():
            _leaves(e, out)
    else:
        out.append(x)
    return out


def _same_args(a: torch.fx.Node, b: torch.fx.Node, layer: dict, counterpart: dict, gm: nn.Module,
               made: frozenset[str] | None = None) -> bool:
    """Whether layer-1 node ``a`` computes what layer-0 node ``b`` does, one layer on: its layer-1 inputs are
    ``b``'s layer-0 counterparts, where it reads layer 0 ``b`` reads what comes before the layers, everything else
    (constants, masks, rotary tables) is the same."""
    xs, ys = _leaves((a.args, a.kwargs), []), _leaves((b.args, b.kwargs), [])
    if len(xs) != len(ys):
        return False
    for x, y in zip(xs, ys, strict=True):
        if isinstance(x, torch.fx.Node) != isinstance(y, torch.fx.Node):
            return False
        if not isinstance(x, torch.fx.Node):
            if type(x) is not type(y) or repr(x) != repr(y):
                return False
        elif layer.get(x) == 1:
            if counterpart.get(x) is not y:
                return False
        elif layer.get(x) == 0:
            if layer.get(y) is not None:
                return False
        elif x is not y and not (x.op == y.op == "get_attr" and layer.get(y) is None
                                 and not ({str(x.target), str(y.target)} & (made or frozenset()))
                                 and _equal(_fetch(gm, str(x.target)), _fetch(gm, str(y.target)))):
            return False
    return True


def _equal(x, y) -> bool:
    return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype and \
        x.shape == y.shape and bool(torch.equal(x, y))
