"""The open operator registry.

One entry per op, in one place: how to compute it (a reference implementation), what it costs
(FLOP and byte formulas the cost model reads), which device kinds can run it, and its class
(compute / memory / control). Nothing else in the compiler keeps a hard-coded list of ops:
placement asks ``lookup(name).devices``, the cost model asks ``lookup(name).flops(call)``.

Two ways in:

* ``@register_op("hetforge::name(Tensor x, ...) -> Tensor", flops=..., nbytes=..., devices=...)`` on a
  Python function makes it a real PyTorch custom op (``torch.library``) whose CPU kernel and reference
  are that function; a fake (meta) kernel keeps graphs exportable and shape-propagated.
* ``register_aten("aten.linear.default", flops=..., nbytes=..., devices=...)`` gives an existing ATen op
  its formulas.

Formulas take an :class:`OpCall` (tensor arguments reduced to shape + dtype) so the same formula
serves FX nodes and IR instructions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

DEVICE_KINDS = ("cpu", "gpu", "npu")
OP_CLASSES = ("compute", "memory", "control")


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor argument or result (no data)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


def dtype_bytes(dtype: torch.dtype) -> float:
    if dtype in (torch.bool, torch.uint8, torch.int8):
        return 1
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class OpCall:
    """One call of an op: its arguments with tensors replaced by :class:`TensorMeta`, and its outputs."""

    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[TensorMeta, ...]

    def tensors_in(self) -> list[TensorMeta]:
        out = []

        def walk(a):
            if isinstance(a, TensorMeta):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    walk(x)

        for a in self.args:
            walk(a)
        for a in self.kwargs.values():
            walk(a)
        return out

    def bytes_in(self) -> float:
        return float(sum(t.nbytes for t in self.tensors_in()))

    def bytes_out(self) -> float:
        return float(sum(t.nbytes for t in self.outputs))


Formula = Callable[[OpCall], float]


def default_nbytes(call: OpCall) -> float:
    """Bytes read plus bytes written: every input and output touched once."""
    return call.bytes_in() + call.bytes_out()


def zero(call: OpCall) -> float:
    return 0.0


@dataclass
class OpInfo:
    """Everything the compiler knows about one op."""

    name: str  # "aten.linear.default", "hetforge.attention.default"
    flops: Formula
    nbytes: Formula = default_nbytes
    devices: frozenset[str] = frozenset(DEVICE_KINDS)
    op_class: str = "compute"
    reference: Callable | None = None
    overload: Any = None  # the torch OpOverload, when this is a torch op
    description: str = ""
    is_view: bool = False  # output aliases input 0's storage (no bytes written)
    attrs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        bad = set(self.devices) - set(DEVICE_KINDS)
        if bad:
            raise ValueError(f"op {self.name}: unknown device kinds {sorted(bad)}; allowed: {DEVICE_KINDS}")
        if self.op_class not in OP_CLASSES:
            raise ValueError(f"op {self.name}: op_class '{self.op_class}' not in {OP_CLASSES}")


REGISTRY: dict[str, OpInfo] = {}


def _overload_name(op) -> str:
    if isinstance(op, torch._ops.OpOverload):
        return f"{op.namespace}.{op._opname}.{op._overloadname}"
    return str(op)


def register_aten(
    name: str,
    flops: Formula = zero,
    nbytes: Formula = default_nbytes,
    devices: tuple[str, ...] | frozenset[str] = DEVICE_KINDS,
    op_class: str = "compute",
    is_view: bool = False,
    description: str = "",
) -> OpInfo:
    """Give an existing op (``aten.x.overload`` or ``operator.getitem``) its formulas and device support."""
    info = OpInfo(name, flops, nbytes, frozenset(devices), op_class, None, None, description, is_view)
    REGISTRY[name] = info
    return info


def register_op(
    schema: str,
    *,
    flops: Formula,
    nbytes: Formula = default_nbytes,
    devices: tuple[str, ...] = DEVICE_KINDS,
    op_class: str = "compute",
    fake: Callable | None = None,
    description: str = "",
) -> Callable[[Callable], OpInfo]:
    """Decorator: make ``fn`` the kernel/reference of a new ``hetforge::`` custom op and register it.

    ``schema`` is ``"hetforge::name(Tensor x, float scale) -> Tensor"``. ``fake`` computes output
    shapes on fake tensors; if omitted, ``fn`` itself is run on the fake tensors (fine for ops built
    from ATen calls only).
    """
    qualname, sig = schema.split("(", 1)
    ns, opname = qualname.split("::")

    def deco(fn: Callable) -> OpInfo:
        lib = _library(ns)
        lib.define(f"{opname}({sig}")
        lib.impl(opname, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{ns}::{opname}", fake or fn, lib=lib)
        overload = getattr(getattr(torch.ops, ns), opname).default
        info = OpInfo(
            _overload_name(overload), flops, nbytes, frozenset(devices), op_class, fn, overload,
            description or (fn.__doc__ or "").strip().split("\n")[0],
        )
        REGISTRY[info.name] = info
        return info

    return deco


_LIBS: dict[str, torch.library.Library] = {}


def _library(ns: str) -> torch.library.Library:
    if ns not in _LIBS:
        _LIBS[ns] = torch.library.Library(ns, "DEF")
    return _LIBS[ns]


def lookup(name_or_target) -> OpInfo | None:
    """The registry entry for an op name or FX node target, or None if hetforge has no formula."""
    name = name_or_target if isinstance(name_or_target, str) else _target_name(name_or_target)
    return REGISTRY.get(name)


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return _overload_name(target)
    return getattr(target, "__name__", str(target))


def _meta_of(x) -> Any:
    if isinstance(x, torch.fx.Node):
        v = x.meta.get("val")
        if isinstance(v, torch.Tensor):
            return TensorMeta(tuple(int(s) for s in v.shape), v.dtype)
        if isinstance(v, (list, tuple)):
            return tuple(TensorMeta(tuple(int(s) for s in t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
                         for t in v)
        return v
    if isinstance(x, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in x.shape), x.dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_meta_of(a) for a in x)
    return x


def op_call_from_node(node: torch.fx.Node) -> OpCall:
    """Build an :class:`OpCall` from an FX node using the shapes in ``node.meta['val']``."""
    out = _meta_of(node)
    outs: tuple = out if isinstance(out, tuple) else (out,) if isinstance(out, TensorMeta) else ()
    outs = tuple(o for o in outs if isinstance(o, TensorMeta))
    return OpCall(
        _target_name(node.target),
        tuple(_meta_of(a) for a in node.args),
        {k: _meta_of(v) for k, v in node.kwargs.items()},
        outs,
    )
