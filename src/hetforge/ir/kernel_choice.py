"""Kernel choice: how each instruction writes its result into its planned arena slice.

The arena executor (:mod:`hetforge.executor.runtime`) emits code by these rules and the cost model
(:mod:`hetforge.cost.instr`) prices an instruction by them; both read them from here, one definition below
both, instead of the cost model re-deriving the executor's decisions.

Per op, in order of preference:

* ``linear`` with a contiguous input: ``addmm.out`` / ``mm.out`` on 2-D views of input and output with
  the weight transposed once at load — the same GEMM eager's ``linear`` runs, with no per-call reshape
  (``bench/backend.py`` measures it within ~1% of ``aten.linear.out`` and of the functional op);
* copy-like ops (``to``, ``_to_copy``, ``clone``, ``contiguous``, eval-mode ``dropout``) whose output is
  fresh storage: ``slice.copy_(input)`` (copy_ converts dtype and layout);
* an ATen ``out=`` overload with the same arguments as the functional one (found from the schemas);
* otherwise the functional op, then ``slice.copy_(result)`` (mode ``arena``) or the result kept where
  the allocator put it (mode ``fast``, counted as unplanned).

A view that returns its input unchanged (:func:`identity_view`) is elided: no call at all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from hetforge.ir.program import INPLACE, TRANSFER, VIEW, WEIGHT, Instr, Program, Reg
from hetforge.ops.registry import lookup

GEMM_OPS = ("aten.linear.default", "aten.addmm.default", "aten.mm.default")
# views that return their input (or an equal view of it) when shape and dtype do not change
IDENTITY_VIEW_OPS = {
    "aten.alias.default", "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten.to.other",
    "aten.expand.default", "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
}



COPY_LIKE = {
    "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten.to.other", "aten._to_copy.default",
    "aten.clone.default", "aten.contiguous.default", "aten.alias.default",
}


@functools.cache
def out_variant(target: Any) -> Any:
    """The ``out=`` overload of an ATen OpOverload with identical non-out arguments (names and types)."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    fs = target._schema
    if len(fs.returns) != 1:
        return None
    want = [(a.name, str(a.type)) for a in fs.arguments]
    packet = getattr(getattr(torch.ops, target.namespace), target._opname)
    for name in packet.overloads():
        ov = getattr(packet, name)
        s = ov._schema
        outs = [a for a in s.arguments if a.is_out]
        if len(outs) != 1 or outs[0].name != "out":
            continue
        if [(a.name, str(a.type)) for a in s.arguments if not a.is_out] == want:
            return ov
    return None


def is_copy_like(op: str, args: tuple, kwargs: dict) -> bool:
    if op in COPY_LIKE:
        return True
    if op == "aten.dropout.default":
        train = args[2] if len(args) > 2 else kwargs.get("train", True)
        return train is False
    return False


def write_mode(ins: Instr, program: Program, planned: set[int] | dict[int, Any]) -> str:
    """How the arena executor writes ``ins``'s result: ``out``, ``copy``, ``view-copy``, ``fresh``, ``view``,
    ``elided``, ``inplace`` or ``transfer`` (see the module docstring). ``planned``: the value ids with an arena slice
    (``MemoryPlan.offsets``)."""
    if ins.kind == VIEW and identity_view(ins, program):
        return "elided"
    if ins.kind in (VIEW, INPLACE, TRANSFER):
        return ins.kind
    if not any(o in planned for o in ins.outputs):
        return "fresh"
    info = lookup(ins.op)
    if info is not None and info.is_view:
        return "view-copy"
    if len(ins.outputs) != 1:
        return "copy"
    if is_copy_like(ins.op, ins.args, ins.kwargs):
        return "out"
    if ins.op in GEMM_OPS and len(ins.args) > 1 and isinstance(ins.args[1], Reg):
        return "out"
    return "out" if ins.target is not None and out_variant(ins.target) is not None else "copy"


def identity_view(ins: Instr, program: Program,
                  same_device: Callable[[str, str], bool] | None = None) -> bool:
    """Whether a view returns its input unchanged, so the executor binds the register with no call: an op of
    :data:`IDENTITY_VIEW_OPS` whose output has its input's shape, strides, offset and dtype, on the input's
    device (``same_device(a, b)``: by name unless the caller maps devices)."""
    if ins.op not in IDENTITY_VIEW_OPS or len(ins.outputs) != 1 or not ins.args or not isinstance(ins.args[0], Reg):
        return False
    a, o = program.values[ins.args[0].id], program.values[ins.outputs[0]]
    if a.kind == WEIGHT or not (same_device or str.__eq__)(a.device, ins.device):
        return False
    return (a.shape, a.stride, a.storage_offset, a.dtype) == (o.shape, o.stride, o.storage_offset, o.dtype)


def bind_args(ins) -> dict[str, Any] | None:
    """The instruction's arguments by schema name, defaults filled in (None when they do not bind)."""
    schema = getattr(ins.target, "_schema", None)
    if schema is None:
        return None
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(ins.args):
            out[a.name] = ins.args[i]
        elif a.name in ins.kwargs:
            out[a.name] = ins.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            return None
    return out
