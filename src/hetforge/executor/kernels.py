"""How one instruction writes into its planned arena slice.

Per op, in order of preference:

* ``linear`` with a contiguous input: ``addmm.out`` / ``mm.out`` on 2-D views of input and output with
  the weight transposed once at load — the same GEMM eager's ``linear`` runs, with no per-call reshape
  (``bench/backend.py`` measures it within ~1% of ``aten.linear.out`` and of the functional op);
* copy-like ops (``to``, ``_to_copy``, ``clone``, ``contiguous``, eval-mode ``dropout``) whose output is
  fresh storage: ``slice.copy_(input)`` (copy_ converts dtype and layout);
* an ATen ``out=`` overload with the same arguments as the functional one (found from the schemas);
* otherwise the functional op, then ``slice.copy_(result)`` (mode ``arena``) or the result kept where
  the allocator put it (mode ``fast``, counted as unplanned).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

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
