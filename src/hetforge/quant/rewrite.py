"""The quantization pass: float linears → ``hetforge::linear_w8 / linear_w4 / linear_w8a8`` (graph → graph).

Precondition: an unlifted FX graph (``CapturedGraph.gm`` or a pass's output) whose weights are ``get_attr``
nodes and whose nodes carry ``meta["val"]``. What it rewrites:

* ``aten.linear(x, W[N,K], b?)``;
* ``aten.addmm(b[N], x, W[K,N])`` with ``alpha = beta = 1`` (GPT-2's Conv1D: the weight is stored
  transposed, so it is quantized as ``Wᵀ``);
* ``hetforge::linear_act(x, W, b?, act, weight_t)`` → one quantized op that keeps ``act``;
* ``hetforge::gated_mlp`` → quantized gate (with ``act``), up and down linears and an ``aten.mul``.

Only weights that are ``get_attr`` 2-D float tensors are touched. A layer is kept in float (and listed
with the reason) when its module path matches a ``skip`` pattern. Under ``w4`` a layer whose shape the int4
kernel cannot take (group size not dividing K, N not a multiple of 16: GPT-2's 50257-row LM head) gets int8
per-channel weights (``linear_w8``) and the reason in its report entry; ``w4_unfit="float"`` keeps such layers
in float instead. A graph that already holds quantized ops or integer linear weights is reported and returned as is.

The input graph module is not mutated: the result is a new GraphModule over a copied graph whose
submodules are fresh containers; float weights that no node reads any more are not carried over, new
int8/uint8 tensors are registered as buffers next to them (``<weight>_int8``, ``<weight>_scales``, ...).
"""

from __future__ import annotations

import copy
import fnmatch
import weakref
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from hetforge.errors import UsageError
from hetforge.frontend import op_name
from hetforge.ops.quant import INT4_GROUP_SIZES, QUANT_OPS
from hetforge.quant.report import QuantReport, TensorEntry
from hetforge.quant.schemes import SCHEMES, QuantizedWeight, int4_unfit_reason, quantize_weight

LINEAR = "aten.linear.default"
ADDMM = "aten.addmm.default"
LINEAR_ACT = "hetforge.linear_act.default"
GATED_MLP = "hetforge.gated_mlp.default"
_FLOAT = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_WRAPPER_PREFIX = "model."  # LogitsModule holds the HF model as ``model``


@dataclass
class QuantizeResult:
    """The quantized graph module and the per-tensor report."""

    gm: GraphModule
    report: QuantReport


@dataclass
class _Linear:
    """One float linear inside a node, normalized: ``act(x·Wᵀ + b)`` (``W`` is [K,N] when ``weight_t``)."""

    x: Node
    weight: Node
    bias: Node | None
    act: str
    weight_t: bool


W4_UNFIT = ("w8", "float")  # what a layer the int4 kernel cannot take gets under w4


def check_options(scheme: str, group_size: int, skip: tuple[str, ...] | list[str], w4_unfit: str = "w8") -> None:
    """Raise UsageError naming the valid values for a bad scheme, group size, skip pattern or w4 fallback."""
    if w4_unfit not in W4_UNFIT:
        raise UsageError(f"--w4-unfit {w4_unfit!r} is not one of {', '.join(W4_UNFIT)}")
    if scheme not in SCHEMES:
        raise UsageError(f"unknown quantization scheme '{scheme}'; valid schemes: {', '.join(SCHEMES)}")
    if scheme == "w4" and group_size not in INT4_GROUP_SIZES:
        raise UsageError(f"--group-size {group_size} is not supported for w4; valid: "
                         f"{', '.join(map(str, INT4_GROUP_SIZES))}")
    for p in skip:
        if not isinstance(p, str) or not p.strip():
            raise UsageError(f"empty --skip pattern {p!r}: give a module path or glob (e.g. 'lm_head', 'layers.0.*')")


_SHARED: dict[tuple, tuple[weakref.ref, int, QuantizedWeight]] = {}


def shared_quantized(src: torch.Tensor, w_nk: torch.Tensor, scheme: str, group_size: int,
                     weight_t: bool) -> QuantizedWeight:
    """``quantize_weight(w_nk, ...)``, shared by every graph quantized from the same weight tensor ``src``.

    The runtime quantizes each static-shape program (a prefill tier, a decode length) from the same model
    parameters; sharing keeps one int8/int4 copy (and one FBGEMM prepack, which is keyed by the int8
    tensor) per weight instead of one per program. A cached entry holds only a weak reference to ``src``
    and is dropped when ``src`` dies or is modified in place (its version changes)."""
    key = (id(src), scheme, group_size, weight_t)
    hit = _SHARED.get(key)
    if hit is not None and hit[0]() is src and hit[1] == src._version:
        return hit[2]
    qw = quantize_weight(w_nk, scheme, group_size)

    def forget(ref: weakref.ref, k: tuple = key) -> None:
        if _SHARED.get(k, (None,))[0] is ref:
            del _SHARED[k]

    _SHARED[key] = (weakref.ref(src, forget), src._version, qw)
    return qw


def shared_tensors() -> list[torch.Tensor]:
    """Every tensor of the weights :func:`shared_quantized` holds for this process now (their sources alive)."""
    return [t for ref, _, qw in list(_SHARED.values()) if ref() is not None for t in qw.tensors.values()]


def module_path(target: str) -> str:
    """The layer's module path from a weight's get_attr target (wrapper prefix and ``.weight`` removed)."""
    path = target[len(_WRAPPER_PREFIX):] if target.startswith(_WRAPPER_PREFIX) else target
    return path[: -len(".weight")] if path.endswith(".weight") else path


def matches(path: str, pattern: str) -> bool:
    """Globs match the path or any dotted tail of it (``h.0.*`` hits ``transformer.h.0.attn``); plain patterns
    match whole dotted segments (``layers.1`` hits ``model.layers.1.mlp`` but not ``layers.10``)."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, "*." + pattern)
    return f".{pattern}." in f".{path}."


def quantize_graph(gm: GraphModule, scheme: str = "w8", group_size: int = 128,
                   skip: tuple[str, ...] | list[str] = (), w4_unfit: str = "w8") -> QuantizeResult:
    """Quantize every float linear of ``gm`` with ``scheme`` (``w8``/``w4``/``w8a8``/``none``); under ``w4`` the
    layers the int4 kernel cannot take get ``w4_unfit`` (``w8``: int8 per channel, or ``float``).

    >>> res = quantize_graph(captured.gm, "w4", group_size=64, skip=("lm_head",))  # doctest: +SKIP
    >>> res.gm(*inputs); res.report.summary_line()                                  # doctest: +SKIP
    """
    skip = tuple(skip)
    check_options(scheme, group_size, skip, w4_unfit)
    report = QuantReport(scheme, group_size if scheme == "w4" else None, skip)
    report.graph_bytes_before = _graph_bytes(gm)
    already = already_quantized(gm)
    if already:
        report.already_quantized = already
        report.graph_bytes_after = report.graph_bytes_before
        return QuantizeResult(gm, report)
    new_gm = _copy_graph_module(gm)
    _Rewriter(new_gm, scheme, group_size, skip, report, w4_unfit).run()
    report.graph_bytes_after = _graph_bytes(new_gm)
    used = {p for e in report.entries for p in skip if matches(e.path, p)}
    report.unmatched_skip = [p for p in skip if p not in used]
    return QuantizeResult(new_gm, report)


def already_quantized(gm: GraphModule) -> str:
    """Non-empty (the reason) when the graph already holds quantized linears or integer linear weights."""
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = op_name(n)
        if name.startswith(("hetforge.linear_w", "quantized.")) or "dequantize" in name:
            return f"the graph already holds quantized ops ({name} at node {n.name}); nothing was changed"
        for lin in _linears(n):
            v = lin.weight.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dtype not in _FLOAT:
                return (f"weight '{lin.weight.target}' is already {v.dtype} (quantized by the model's author); "
                        "nothing was changed")
    return ""


def _linears(n: Node) -> list[_Linear]:
    """The float linears a node computes, with ``get_attr`` weights (empty if none / not a linear)."""
    name = op_name(n)
    out: list[_Linear] = []
    if name == LINEAR:
        out = [_Linear(n.args[0], n.args[1], _arg(n, 2, "bias"), "none", False)]
    elif name == ADDMM:
        if _arg(n, 3, "beta", 1) == 1 and _arg(n, 4, "alpha", 1) == 1 and _is_1d(n.args[0]) and _dim(n.args[1]) == 2:
            out = [_Linear(n.args[1], n.args[2], n.args[0], "none", True)]
    elif name == LINEAR_ACT:
        out = [_Linear(n.args[0], n.args[1], _arg(n, 2, "bias"), _arg(n, 3, "act", "relu"),
                       bool(_arg(n, 4, "weight_t", False)))]
    elif name == GATED_MLP:
        x, act = n.args[0], _arg(n, 7, "act", "silu")
        out = [_Linear(x, _arg(n, 1, "w_gate"), _arg(n, 4, "b_gate"), act, False),
               _Linear(x, _arg(n, 2, "w_up"), _arg(n, 5, "b_up"), "none", False)]
        if _arg(n, 3, "w_down") is not None:
            out.append(_Linear(x, _arg(n, 3, "w_down"), _arg(n, 6, "b_down"), "none", False))
    ok = [lin for lin in out if isinstance(lin.weight, Node) and lin.weight.op == "get_attr" and _dim(lin.weight) == 2]
    return ok if len(ok) == len(out) else []  # a gated MLP is rewritten whole or not at all


class _Rewriter:
    """Walks the copied graph once, quantizing each weight once and rewriting every node that reads it."""

    def __init__(self, gm: GraphModule, scheme: str, group_size: int, skip: tuple[str, ...], report: QuantReport,
                 w4_unfit: str = "w8"):
        self.gm, self.graph = gm, gm.graph
        self.scheme, self.group_size, self.skip, self.report = scheme, group_size, skip, report
        self.w4_unfit = w4_unfit
        self.fake_mode = _fake_mode(gm)
        self.entries: dict[tuple[str, bool], TensorEntry] = {}
        self.qweights: dict[tuple[str, bool], QuantizedWeight] = {}
        self.qnodes: dict[tuple[str, bool], list[Node]] = {}

    def run(self) -> None:
        for n in list(self.graph.nodes):
            if n.op == "call_function" and _linears(n):
                self._rewrite(n)
        self._drop_dead_weights()
        self.report.entries = list(self.entries.values())
        self.graph.lint()
        self.gm.recompile()

    # -- one node
    def _rewrite(self, n: Node) -> None:
        name = op_name(n)
        lins = _linears(n)
        plans = [self._plan(lin, name) for lin in lins]
        if self.scheme == "none" or not any(plans):
            return
        with self.graph.inserting_before(n):
            if name == GATED_MLP:
                gate = self._emit(lins[0], plans[0], n)
                up = self._emit(lins[1], plans[1], n)
                h = self._call(torch.ops.aten.mul.Tensor, (gate, up), {}, n)
                new = self._emit(_Linear(h, *_rest(lins[2])), plans[2], n) if len(lins) == 3 else h
            else:
                new = self._emit(lins[0], plans[0], n)
        n.replace_all_uses_with(new)
        self.graph.erase_node(n)
        self.report.rewritten_nodes += 1

    def _plan(self, lin: _Linear, op: str) -> QuantizedWeight | None:
        """The quantized weight for ``lin`` (cached per weight), or None when it stays float."""
        key = (str(lin.weight.target), lin.weight_t)
        entry = self.entries.get(key)
        if entry is not None:
            if op not in entry.ops:
                entry.ops.append(op)
            return self.qweights.get(key)
        src = _tensor(self.gm, str(lin.weight.target))
        w = src.detach()
        w_nk = w.t() if lin.weight_t else w
        n_out, k_in = w_nk.shape
        path = module_path(str(lin.weight.target))
        nbytes = w.numel() * w.element_size()
        entry = TensorEntry(path, str(lin.weight.target), [op], (n_out, k_in), "fp32", nbytes, nbytes)
        self.entries[key] = entry
        reason = self._why_float(lin, path, n_out, k_in)
        scheme = self.scheme
        if not reason and scheme == "w4":
            unfit = int4_unfit_reason(n_out, k_in, self.group_size)
            if unfit and self.w4_unfit == "float":
                reason = unfit
            elif unfit:
                scheme, entry.reason = "w8", f"int8 per channel: {unfit}"
        if reason:
            entry.reason = reason
            return None
        qw = shared_quantized(src, w_nk, scheme, self.group_size, lin.weight_t)
        entry.scheme, entry.rel_error, entry.group_size = scheme, qw.rel_error, qw.group_size
        entry.bytes_after = qw.nbytes
        self.qweights[key] = qw
        self.qnodes[key] = self._add_tensors(str(lin.weight.target), qw, lin.weight.meta)
        return qw

    def _why_float(self, lin: _Linear, path: str, n_out: int, k_in: int) -> str:
        if self.scheme == "none":
            return "scheme none"
        hit = next((p for p in self.skip if matches(path, p)), None)
        if hit is not None:
            return f"skip pattern '{hit}'"
        xv = lin.x.meta.get("val") if isinstance(lin.x, Node) else None
        if not isinstance(xv, torch.Tensor) or xv.dtype not in _FLOAT[:3]:
            return "input has no float meta['val']"
        if self.scheme == "w8a8" and xv.dtype != torch.float32:
            return f"w8a8 kernel (FBGEMM) takes float32 activations, not {xv.dtype}"
        return ""

    # -- emission
    def _add_tensors(self, target: str, qw: QuantizedWeight, meta: dict) -> list[Node]:
        """Register the quantized tensors as buffers beside the float weight; one get_attr node each."""
        nodes = []
        first = next(iter(n for n in self.graph.nodes if n.op != "placeholder"))
        with self.graph.inserting_before(first):
            for name, t in qw.tensors.items():
                new_target = _free_name(self.gm, f"{target}_{name}")
                _set_buffer(self.gm, new_target, t)
                node = self.graph.get_attr(new_target)
                node.meta["val"] = self.fake_mode.from_tensor(t, static_shapes=True)
                node.meta["quant"] = {"scheme": qw.scheme, "of": target}
                nodes.append(node)
        return nodes

    def _emit(self, lin: _Linear, qw: QuantizedWeight | None, origin: Node) -> Node:
        if qw is None:  # float linear (only inside a gated MLP where some weight is skipped)
            if lin.act == "none" and not lin.weight_t:
                return self._call(torch.ops.aten.linear.default, (lin.x, lin.weight, lin.bias), {}, origin)
            return self._call(torch.ops.hetforge.linear_act.default,
                              (lin.x, lin.weight, lin.bias, lin.act, lin.weight_t), {}, origin)
        qnodes = self.qnodes[(str(lin.weight.target), lin.weight_t)]
        op = QUANT_OPS[qw.scheme].overload
        extra = (qw.group_size,) if qw.scheme == "w4" else ()
        return self._call(op, (lin.x, *qnodes, *extra, lin.bias, lin.act), {}, origin)

    def _call(self, target, args: tuple, kwargs: dict, origin: Node) -> Node:
        node = self.graph.call_function(target, args, kwargs)
        for k in ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node"):
            if k in origin.meta:
                node.meta[k] = origin.meta[k]
        fake_args = map_arg(args, lambda a: a.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*fake_args, **kwargs)
        node.meta["quant_of"] = origin.name
        return node

    def _drop_dead_weights(self) -> None:
        """Erase float weight get_attr nodes no node reads any more, and the tensors behind them."""
        targets = {e.target for e in self.entries.values()}
        for n in list(self.graph.nodes):
            if n.op == "get_attr" and not n.users and str(n.target) in targets:
                target = str(n.target)
                self.graph.erase_node(n)
                if not any(m.op == "get_attr" and m.target == target for m in self.graph.nodes):
                    _del_attr(self.gm, target)
        live = {str(m.target) for m in self.graph.nodes if m.op == "get_attr"}
        for e in self.entries.values():
            if e.quantized and e.target in live:
                e.bytes_after += e.bytes_before
                users = sorted({op_name(u) for m in self.graph.nodes if m.op == "get_attr" and m.target == e.target
                                for u in m.users})
                kept = f"float copy kept: also read by {', '.join(users)}"
                e.reason = f"{e.reason}; {kept}" if e.reason else kept


def _rest(lin: _Linear) -> tuple:
    return lin.weight, lin.bias, lin.act, lin.weight_t


def _arg(n: Node, i: int, name: str, default=None):
    if i < len(n.args):
        return n.args[i]
    return n.kwargs.get(name, default)


def _dim(a) -> int:
    v = a.meta.get("val") if isinstance(a, Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else -1


def _is_1d(a) -> bool:
    return _dim(a) == 1


def _fake_mode(gm: GraphModule):
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    vals = [n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    return detect_fake_mode(vals) or FakeTensorMode(allow_non_fake_inputs=True)


def _copy_graph_module(gm: GraphModule) -> GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (nodes and meta copied shallowly, tensors shared)."""
    graph = Graph()
    val_map: dict[Node, Node] = {}
    out, out_node = graph.graph_copy(gm.graph, val_map, return_output_node=True)
    new_out = graph.output(out, out_node.type)
    new_out.meta = copy.copy(out_node.meta)
    graph._codegen = gm.graph._codegen  # calling convention (pytree specs): read-only, shared
    new = GraphModule(gm, graph)
    new.meta = copy.copy(getattr(gm, "meta", {}))
    return new


def _tensor(gm: GraphModule, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _owner(gm: GraphModule, target: str) -> tuple[torch.nn.Module, str]:
    *prefix, field = target.split(".")
    mod = gm
    for p in prefix:
        mod = getattr(mod, p)
    return mod, field


def _set_buffer(gm: GraphModule, target: str, t: torch.Tensor) -> None:
    mod, field = _owner(gm, target)
    mod.register_buffer(field, t)


def _del_attr(gm: GraphModule, target: str) -> None:
    mod, field = _owner(gm, target)
    delattr(mod, field)


def _free_name(gm: GraphModule, target: str) -> str:
    mod, field = _owner(gm, target)
    name, i = field, 1
    while hasattr(mod, name):
        name, i = f"{field}_{i}", i + 1
    return target.rsplit(".", 1)[0] + "." + name if "." in target else name


def _graph_bytes(gm: GraphModule) -> int:
    """Bytes of every distinct tensor a get_attr node reads."""
    seen: dict[int, int] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            t = _tensor(gm, str(n.target))
            if isinstance(t, torch.Tensor):
                seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())
