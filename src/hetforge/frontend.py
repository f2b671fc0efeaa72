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

import re
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.export import Dim

from hetforge.errors import CaptureError
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

    def op_counts(self) -> Counter:
        return op_counts(self.gm)

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


def capture(
    model: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    dynamic_dims: dict[int, dict[int, tuple[str, int, int]]] | None = None,
    strict: bool = False,
    name: str = "model",
) -> CapturedGraph:
    """Export ``model`` on ``example_inputs`` and return the captured graph.

    ``dynamic_dims`` maps input index → {dim: (name, min, max)}; dims with the same name share one
    symbol (e.g. the sequence length of ids and mask). Everything else is specialized (static).
    """
    dynamic_shapes = None
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
    try:
        with torch.no_grad():
            ep = torch.export.export(model, tuple(example_inputs), dynamic_shapes=dynamic_shapes, strict=strict)
    except Exception as e:  # torch raises many types here; all mean "this model cannot be captured"
        raise CaptureError(explain_export_failure(e, model)) from None
    seconds = time.perf_counter() - t0
    gm = ep.module()
    prefix = _wrapper_prefix(model)
    paths = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            target = str(n.target)
            paths[target] = target[len(prefix):] if prefix and target.startswith(prefix) else target
    return CapturedGraph(gm, ep, tuple(example_inputs), seconds, strict, name, paths)


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
