"""Frontend: ``torch.export`` a model into an ATen FX graph with shapes and dtypes on every node.

Why non-strict by default: non-strict export traces with Python itself instead of TorchDynamo, so it
accepts the Python that Hugging Face models are written in and is about twice as fast on them
(``bench/capture.py`` measures both). Strict mode is available (``strict=True``) for models whose
authors want Dynamo's soundness checks.

The result keeps both the ``ExportedProgram`` (the stable, serializable artifact) and an unlifted
``GraphModule`` in which parameters and buffers are ``get_attr`` nodes named by their module path
(e.g. ``model.layers.3.self_attn.q_proj.weight``): that is the form the passes rewrite.
"""

from __future__ import annotations

import contextlib
import gc
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.export import Dim

from hetforge.errors import CaptureError, HetforgeError
from hetforge.models.shapes import shaped_module
from hetforge.models.zoo import LogitsModule


@dataclass
class CapturedGraph:
    """A captured model: the graph to optimize, the exported program, and how it was made."""

    gm: torch.fx.GraphModule
    exported: torch.export.ExportedProgram
    example_inputs: tuple[torch.Tensor, ...]
    seconds: float
    strict: bool
    name: str = "model"
    param_paths: dict[str, str] = field(default_factory=dict)  # get_attr target -> module path
    note: str = ""  # how it was made, when not by its own export (e.g. specialised from a dynamic capture)
    deferred: Any = None  # layers still to stamp out of a two-layer graph (hetforge.runtime.stamp.Deferred)

    def op_counts(self) -> Counter:
        return op_counts(self.gm)

    def final_note(self) -> str:
        """How it was made, as known once it is complete: a deferred capture's note says what its stamping did (so
        it is read after the stamping), any other capture's is :attr:`note`."""
        return self.deferred.note() if self.deferred is not None else self.note

    @property
    def num_nodes(self) -> int:
        return len(self.gm.graph.nodes)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.exported.state_dict.values() if isinstance(p, torch.Tensor))


def op_name(node: torch.fx.Node) -> str:
    """A short stable name for a node's operation (``aten.linear.default``, ``hetforge.attention``)."""
    if node.op != "call_function":
        return node.op
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._opname}.{t._overloadname}"
    if isinstance(t, torch._ops.OpOverloadPacket):
        return f"{t._qualified_op_name.replace('::', '.')}"
    return getattr(t, "__name__", str(t))


def op_counts(gm: torch.fx.GraphModule) -> Counter:
    return Counter(op_name(n) for n in gm.graph.nodes if n.op == "call_function")


@contextlib.contextmanager
def gc_frozen() -> Iterator[bool]:
    """Inside, the objects that existed on entry are out of the cyclic garbage collector's reach (``gc.freeze``;
    ``gc.unfreeze`` on exit puts them back); yields whether it did that.

    Why: capturing and compiling a program makes a few hundred thousand short-lived objects, enough to trigger a
    full collection, which walks every object of the process again (the model, torch, transformers): a large share
    of a capture + passes (measured: docs/arch/runtime.md, cold compile). Objects made inside are still collected
    as usual. Nothing
    is done where the process froze objects itself (its frozen set is left alone), where the collector is
    disabled, or inside another such block (the decorated functions nest). A nested block is told apart by a
    counter, not by ``gc.get_freeze_count()``: that walks the whole frozen set (every object of the process) on
    each call."""
    global _FROZEN_DEPTH
    if _FROZEN_DEPTH > 0 or not gc.isenabled() or gc.get_freeze_count() > 0:
        yield False
        return
    gc.freeze()
    _FROZEN_DEPTH += 1
    try:
        yield True
    finally:
        _FROZEN_DEPTH -= 1
        gc.unfreeze()


_FROZEN_DEPTH = 0  # gc_frozen blocks open in this process (a forked child inherits the count with the frozen set)

# what the first ``torch.export`` in a process imports (networkx alone is ~300 modules); see preload_capture
_CAPTURE_MODULES = (
    "torch.export._trace", "torch._functorch.aot_autograd", "torch._functorch.partitioners",
    "torch._export.non_strict_utils", "torch._export.passes.replace_set_grad_with_hop_pass",
    "torch._export.passes.replace_autocast_with_hop_pass", "torch._export.passes._node_metadata_hook",
    "torch.fx.experimental.validator", "torch._subclasses.schema_check_mode",
    "torch._inductor.fx_passes.dedupe_symint_uses",
)


def preload_capture() -> float:
    """Import what the first :func:`capture` in this process would import on its way, and return the seconds
    that took (0 when done before).

    Why: a process about to ``fork`` children that capture (``hetforge.runtime.ahead``) imports it once here
    instead of once in itself and once more in every child."""
    import importlib
    import sys

    t0 = time.perf_counter()
    for name in _CAPTURE_MODULES:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except ImportError:  # another torch may have moved one: the capture then imports what it needs
                pass
    return time.perf_counter() - t0


@gc_frozen()
def capture(
    model: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    dynamic_dims: dict[int, dict[int, tuple[str, int, int]]] | None = None,
    strict: bool = False,
    name: str = "model",
    stack_traces: bool = True,
    dynamic_shapes: Any = None,
    guards: bool = True,
) -> CapturedGraph:
    """Export ``model`` on ``example_inputs`` and return the captured graph.

    ``dynamic_dims`` maps input index → {dim: (name, min, max)}; dims with the same name share one
    symbol (e.g. the sequence length of ids and mask). Everything else is specialized (static).
    ``dynamic_shapes`` is passed to ``torch.export`` as is (instead of ``dynamic_dims``).
    ``stack_traces=False`` records no user stack trace per node (``torch.fx.config.do_not_emit_stack_traces``):
    a large share of an export (measured: docs/arch/runtime.md); nothing downstream reads them (the runtime
    captures without).
    ``guards=False`` leaves out export's input-shape check (the ``_guards_fn`` submodule ``ep.module()`` adds and
    generates code for): for a graph that is only lowered (lowering drops that call, and the executor checks its
    inputs' shapes itself), not one that is called with user inputs.
    """
    if dynamic_dims:
        symbols: dict[str, Dim] = {}
        dynamic_shapes = []
        for i, _ in enumerate(example_inputs):
            spec = {}
            for d, (dname, lo, hi) in (dynamic_dims.get(i) or {}).items():
                symbols.setdefault(dname, Dim(dname, min=lo, max=hi))
                spec[d] = symbols[dname]
            dynamic_shapes.append(spec or None)
        dynamic_shapes = tuple(dynamic_shapes)
    model = model.eval()
    t0 = time.perf_counter()
    cfg = torch.fx.config
    has_flag = hasattr(cfg, "do_not_emit_stack_traces")  # a torch older than the pinned one may lack it
    saved = cfg.do_not_emit_stack_traces if has_flag else None
    with lazy_recompile():
        try:
            if has_flag:
                cfg.do_not_emit_stack_traces = saved or not stack_traces
            with torch.no_grad():
                ep = torch.export.export(model, tuple(example_inputs), dynamic_shapes=dynamic_shapes,
                                         strict=strict)
        except HetforgeError:  # a refusal of hetforge's own (e.g. a model feature the runtime's modules lack)
            raise
        except Exception as e:  # torch raises many types here; all mean "this model cannot be captured"
            raise CaptureError(explain_export_failure(e, model)) from None
        finally:
            if has_flag:
                cfg.do_not_emit_stack_traces = saved
        gm = ep.module() if guards else _module_without_guards(ep)
    seconds = time.perf_counter() - t0  # the export and the graph module made from it (unlifting the weights)
    return CapturedGraph(gm, ep, tuple(example_inputs), seconds, strict, name, param_paths(gm, model))


def param_paths(gm: torch.fx.GraphModule, model: nn.Module) -> dict[str, str]:
    """Each ``get_attr`` target of ``gm`` (captured from ``model``) -> the weight's path in the user's model."""
    prefix = _wrapper_prefix(model)
    paths = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            target = str(n.target)
            paths[target] = target[len(prefix):] if prefix and target.startswith(prefix) else target
    return paths


def _module_without_guards(ep: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """``ep.module()`` without its input-shape guard, where this torch can leave it out."""
    try:
        return ep.module(check_guards=False)
    except TypeError:  # a torch whose module() has no such option
        return ep.module()


_LAZY: list[tuple[type, type] | None] = []


def _lazy_classes() -> tuple[type, type] | None:
    """``(GraphModule, a lazily recompiling subclass)`` where this torch has ``_LazyGraphModule`` (a private
    API), else None (then captures take the public path)."""
    if _LAZY:
        return _LAZY[0]
    got = None
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
        from torch.fx.graph import _PyTreeCodeGen
    except ImportError:
        _LazyGraphModule = None  # noqa: N806
    gm_cls = torch.fx.GraphModule
    if (isinstance(_LazyGraphModule, type) and issubclass(_LazyGraphModule, gm_cls) and "__new__" in vars(gm_cls)
            and callable(getattr(_LazyGraphModule, "_lazy_forward", None))):

        class _Forward:
            """``forward`` of a module whose code is not generated yet: read on an instance (a call, or
            ``inspect.signature(gm.forward)`` as ``ep.module()`` does) it generates the code first and gives the
            generated method; read on the class it is torch's lazy marker (``_LazyGraphModule._needs_recompile``)."""

            def __get__(self, obj: Any, cls: type) -> Any:
                if obj is None:
                    return cls._lazy_forward
                obj.real_recompile()
                return type(obj).forward.__get__(obj, cls)

        class LazyGraphModule(_LazyGraphModule):
            """torch's ``_LazyGraphModule`` with two fixes: ``recompile()`` keeps the pytree input/output specs
            current (as ``GraphModule.recompile`` does: ``ep.module()``'s input-check hook reads them before the
            first call), and ``forward`` read on an instance is the generated method with its real signature."""

            forward = _Forward()

            def recompile(self) -> None:  # type: ignore[override]
                codegen = self._graph._codegen
                if isinstance(codegen, _PyTreeCodeGen):
                    self._in_spec = codegen.pytree_info.in_spec
                    self._out_spec = codegen.pytree_info.out_spec
                cls = type(self)
                if "forward" in vars(cls):  # the generated forward (per-instance class): back to the lazy one
                    delattr(cls, "forward")

        got = (gm_cls, LazyGraphModule)
    _LAZY.append(got)
    return got


@contextlib.contextmanager
def lazy_recompile() -> Iterator[bool]:
    """Every ``GraphModule`` made inside generates its Python code on first call or ``.code``, not on each
    ``recompile()``; yields whether that is in effect (else plain ``GraphModule`` s, the public path).

    Why: ``torch.export`` rebuilds and recompiles the graph module 10-30 times per capture (its passes, the
    split and inlining of autocast regions, ``ep.module()``'s unlifting); generating and ``exec``-ing the code
    of a several-hundred-node graph each time was a large share of a capture (measured: docs/arch/runtime.md,
    cold compile), and none of that code runs: the backend executor lowers the graph, and the FX executor's first
    call generates it once.
    How: ``GraphModule.__new__`` (which makes a per-instance subclass) puts torch's own ``_LazyGraphModule``
    (what Inductor uses for the same reason) in that subclass's bases for the duration; the graphs are the same.
    """
    classes = _lazy_classes()
    if classes is None:
        yield False
        return
    gm_cls, lazy_cls = classes
    original = vars(gm_cls)["__new__"]

    def lazy_new(cls: type, *args: Any, **kwargs: Any) -> Any:
        base = next(t for t in cls.__mro__ if t.__qualname__.split(".")[-1] != "GraphModuleImpl")
        if issubclass(base, lazy_cls):
            bases: tuple[type, ...] = (base,)
        elif base is gm_cls:
            bases = (lazy_cls,)
        else:  # a GraphModule subclass (export's stateful module): both, the subclass first
            bases = (base, lazy_cls)
        impl = type(base)("GraphModuleImpl", bases, {})
        return nn.Module.__new__(impl)

    gm_cls.__new__ = staticmethod(lazy_new)  # type: ignore[method-assign,assignment]
    try:
        yield True
    finally:
        gm_cls.__new__ = original  # type: ignore[method-assign]


def is_lazy(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` generates its code lazily (made under :func:`lazy_recompile`)."""
    classes = _lazy_classes()
    return classes is not None and isinstance(gm, classes[1])


class SpecializeError(CaptureError):
    """A dynamic capture that cannot be specialised to the given shapes (outside its range, or a construct
    :func:`specialize` does not know)."""


def _is_symbolic(v: Any) -> bool:
    return isinstance(v, (torch.SymInt, torch.SymBool, torch.SymFloat))


def specialize(cg: CapturedGraph, example_inputs: tuple[torch.Tensor, ...], name: str | None = None
               ) -> CapturedGraph:
    """The static graph for ``example_inputs`` from a capture with dynamic dimensions, without capturing again.

    Why: one ``torch.export`` with a dynamic sequence (or cache) length serves every tier; each tier is then a
    shape propagation (fake tensors, no weights touched) instead of a fresh trace of the model's Python. How: the
    graph is copied (weights shared), every node is run once on fake tensors of the concrete shapes
    (``FakeTensorProp``); a node whose dynamic value was a symbol (``sym_size``, the integer arithmetic on it,
    a guard) now evaluates to a Python number and is replaced by that constant in its users' arguments; a
    runtime assert on a constant is checked here and dropped. Every remaining node gets the static
    ``meta["val"]`` a static capture would have given it.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    t0 = time.perf_counter()
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(cg.gm.graph, env)
    graph.output(out)
    graph._codegen = cg.gm.graph._codegen  # the same pytree calling convention as the captured module
    gm = torch.fx.GraphModule(cg.gm, graph)
    symbolic = {env[n] for n in cg.gm.graph.nodes if _is_symbolic(n.meta.get("val"))}
    values: dict[torch.fx.Node, Any] = {}

    class _Prop(FakeTensorProp):
        def run_node(self, n: torch.fx.Node) -> Any:
            res = super().run_node(n)
            if n in symbolic:
                values[n] = res
            return res

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        _Prop(gm, mode).propagate(*example_inputs)
    except Exception as e:  # a shape outside the captured range trips a guard here
        raise SpecializeError(f"cannot specialise the {cg.name} capture to input shapes "
                              f"{[list(t.shape) for t in example_inputs]}: {str(e).splitlines()[0][:300]}") from None
    for n, v in values.items():
        if _is_symbolic(v) or not isinstance(v, (int, float, bool)):
            raise SpecializeError(f"cannot specialise the {cg.name} capture: node '{n.name}' stays symbolic ({v!r})")
        _replace_uses(n, v)
    for n in reversed(list(graph.nodes)):
        if n.op != "call_function":
            continue
        if n.target is torch.ops.aten._assert_scalar.default and not isinstance(n.args[0], torch.fx.Node):
            if not n.args[0]:
                raise SpecializeError(f"cannot specialise the {cg.name} capture: {n.args[1] if len(n.args) > 1 else n}")
            graph.erase_node(n)
        elif n in values and not n.users:
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return CapturedGraph(gm, cg.exported, tuple(example_inputs), time.perf_counter() - t0, cg.strict,
                         name or cg.name, dict(cg.param_paths))


def _replace_uses(node: torch.fx.Node, value: Any) -> None:
    """Put the constant ``value`` in place of ``node`` in every user's arguments."""
    for user in list(node.users):
        user.args = torch.fx.node.map_arg(user.args, lambda a: value if a is node else a)
        user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: value if a is node else a)


def capture_shaped(name: str = "llama-3.1-8b-shape", seq: int = 16, layers: int | None = None,
                   dtype: torch.dtype = torch.float16, attn: str = "sdpa", overrides: dict | None = None
                   ) -> CapturedGraph:
    """Capture a shape-only model (:mod:`hetforge.models.shapes`): real shapes on the meta device, no weights."""
    model, inputs = shaped_module(name, seq=seq, layers=layers, dtype=dtype, attn=attn, overrides=overrides)
    return capture(model, inputs, name=name)


def _wrapper_prefix(model: nn.Module) -> str:
    """``LogitsModule`` holds the HF model as ``model``; paths are reported relative to it."""
    return "model." if isinstance(model, LogitsModule) else ""


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def explain_export_failure(err: Exception, model: nn.Module) -> str:
    """Turn torch.export's long error into a short message: what construct, where, and a fix."""
    text = str(err)
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(err).__name__)
    lower = text.lower()
    if "data-dependent" in lower or "could not extract specialized integer" in lower:
        construct = "data-dependent control flow (a Python branch or shape that depends on tensor values)"
        fix = ("rewrite the branch with torch.cond / torch.where, or make the value a static Python "
               "number, then capture again")
    elif "unsupported" in lower or "not supported" in lower or "graph break" in lower:
        construct = "a Python construct torch.export does not support"
        fix = "move it out of forward() or try strict=False / strict=True (the other mode)"
    else:
        construct = type(err).__name__
        fix = "see torch.export's documentation on capture failures"
    where = ""
    frames = [(f, ln) for f, ln in _FILE_LINE.findall(text) if "site-packages/torch" not in f]
    if frames:
        f, ln = frames[-1]
        where = f" at {f}:{ln}"
    module = type(model).__name__
    inner = getattr(model, "model", None)
    if inner is not None and isinstance(inner, nn.Module):
        module = f"{module}({type(inner).__name__})"
    return f"cannot capture {module}: {construct}{where}: {first[:300]}. Fix: {fix}."
