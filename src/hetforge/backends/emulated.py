"""``emulated:<stand-in>``: a device the host lacks, run for real on a stand-in backend under its constraints.

Compiling a partition for an emulated device first checks the device's constraints, node by node, and
refuses the partition (:class:`ConstraintViolation`, naming the node and the constraint) when one breaks:

* op set — ``DeviceProfile.supports(op)``;
* static shapes — every shape in the partition must be concrete when ``static_shapes`` is set;
* dtypes — every floating/int8 tensor dtype must be one the device lists (``dtypes``), and a quantized op
  (registry ``attrs['weight_dtype']``/``['act_dtype']``: int8, int4) needs that integer type there too. With the
  ``exact`` precision policy (default) fp32 is admitted on a float device that lacks it, computed at fp32 by
  the stand-in so outputs stay comparable, and the report says so (the cost model charges the device's own
  float rate); ``strict`` refuses it. int8/int4 weights must be in ``dtypes`` either way;
* memory — weights plus peak live activations of the partition must fit ``mem_capacity``.

Then the stand-in (``torch-cpu`` or ``openvino:CPU``) compiles and runs the partition: the measured time is
the stand-in's; the device's own time and energy are modeled by the cost model (both reported, labelled).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hetforge.backends.base import Backend, BackendUnavailable, CompiledPartition, ConstraintViolation
from hetforge.backends.partition import Partition, fetch_attr

POLICIES = ("exact", "strict")
_DTYPE_KEYS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "int8",
               torch.uint8: "int8", torch.float64: "fp64"}


@dataclass
class Violation:
    node: str
    op: str
    constraint: str

    def __str__(self) -> str:
        return f"node '{self.node}' ({self.op}): {self.constraint}"


def dtype_key(dtype: torch.dtype) -> str | None:
    """Profile dtype name of a tensor dtype; None for index/bool types, which no device constraint covers."""
    return _DTYPE_KEYS.get(dtype)


def _tensors(val) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []


def check_constraints(part: Partition, device, policy: str = "exact") -> tuple[list[Violation], list[str]]:
    """Violations of ``device``'s constraints by ``part``, and notes on what was admitted (e.g. fp32 → exact)."""
    from hetforge.frontend import op_name

    if policy not in POLICIES:
        raise ValueError(f"unknown precision policy '{policy}'; allowed: {POLICIES}")
    out: list[Violation] = []
    notes: list[str] = []
    dtypes = set(device.dtypes)
    floats = dtypes & {"fp32", "fp16", "bf16"}
    admitted_fp32 = False
    for n in part.gm.graph.nodes:
        if n.op not in ("call_function", "get_attr", "placeholder"):
            continue
        op = op_name(n) if n.op == "call_function" else n.op
        if n.op == "call_function" and not device.supports(op):
            out.append(Violation(n.name, op, f"op not supported by {device.kind} '{device.name}'"))
        if n.op == "call_function":
            out += _quantized_dtypes(n, op, device, dtypes)
        vals = _tensors(n.meta.get("val"))
        if n.op == "get_attr":
            t = fetch_attr(part.gm, str(n.target))
            vals = [t] if isinstance(t, torch.Tensor) else vals
            if _feeds_only_quantized_ops(n, device):
                vals = []
        for t in vals:
            if device.static_shapes and any(not isinstance(s, int) for s in t.shape):
                out.append(Violation(n.name, op,
                                     f"dynamic shape {tuple(t.shape)}; '{device.name}' needs static shapes"))
            key = dtype_key(t.dtype)
            if key is None or key in dtypes:
                continue
            if key == "fp32" and floats and policy == "exact":
                admitted_fp32 = True
                continue
            out.append(Violation(n.name, op, f"dtype {key} not in {device.name}'s dtypes {sorted(dtypes)}"))
    if admitted_fp32:
        notes.append(f"fp32 computed exactly by the stand-in; '{device.name}' computes floats in "
                     f"{'/'.join(sorted(floats))} only (precision policy 'exact'; the cost model charges that rate)")
    need = part.weight_bytes() + peak_activation_bytes(part)
    if need > device.mem_capacity:
        out.append(Violation(part.name, "partition", f"needs {need / 2**20:.1f} MiB (weights + peak activations), "
                                                      f"'{device.name}' has {device.mem_capacity / 2**20:.1f} MiB"))
    return out, notes


def _quantized_dtypes(n, op: str, device, dtypes: set[str]) -> list[Violation]:
    """A quantized op needs its integer types on the device (:meth:`DeviceProfile.quant_gaps` says which)."""
    return [Violation(n.name, op, f"{gap}, not in {device.name}'s dtypes {sorted(dtypes)}")
            for gap in device.quant_gaps(op)]


def _feeds_only_quantized_ops(n, device) -> bool:
    """True for a weight read only by quantized ops the device runs (their rule covers its integer type)."""
    from hetforge.frontend import op_name
    from hetforge.ops.registry import lookup

    users = list(n.users)
    return bool(users) and all(u.op == "call_function" and (info := lookup(op_name(u))) is not None
                               and info.attrs.get("quantized") and not device.quant_gaps(op_name(u)) for u in users)


def peak_activation_bytes(part: Partition) -> int:
    """Peak bytes of live activations over the partition's node order (inputs live from the start)."""
    nodes = [n for n in part.gm.graph.nodes if n.op in ("placeholder", "call_function")]
    last_use: dict[str, int] = {}
    for i, n in enumerate(part.gm.graph.nodes):
        for a in n.all_input_nodes:
            last_use[a.name] = i
    index = {n.name: i for i, n in enumerate(part.gm.graph.nodes)}
    size = {n.name: sum(t.numel() * t.element_size() for t in _tensors(n.meta.get("val"))
                        if all(isinstance(s, int) for s in t.shape)) for n in nodes}
    live, peak = 0, 0
    ends: dict[int, int] = {}
    for n in nodes:
        i = index[n.name]
        live += size[n.name]
        peak = max(peak, live)
        ends[last_use.get(n.name, i)] = ends.get(last_use.get(n.name, i), 0) + size[n.name]
        live -= ends.pop(i, 0)
    return peak


class EmulatedCompiled(CompiledPartition):
    """The stand-in's compiled partition, with the emulated device's modeled cost attached."""

    def __init__(self, inner: CompiledPartition, backend: str):
        self.inner = inner
        self.backend = backend
        self.memory = inner.memory
        self.report = inner.report
        self.outputs_alias = getattr(inner, "outputs_alias", False)

    def run(self, args: Sequence[Any]) -> tuple[list[Any], float]:
        return self.inner.run(args)


class EmulatedBackend(Backend):
    """Runs a device the host lacks on ``stand_in`` while enforcing ``device``'s constraints."""

    def __init__(self, device, stand_in: Backend, policy: str = "exact"):
        if policy not in POLICIES:
            raise ValueError(f"unknown precision policy '{policy}'; allowed: {POLICIES}")
        self.device = device
        self.stand_in = stand_in
        self.policy = policy
        self.name = f"emulated:{stand_in.name}"
        self.memory = stand_in.memory

    def check_available(self) -> None:
        try:
            self.stand_in.check_available()
        except BackendUnavailable as e:
            raise BackendUnavailable(f"device '{self.device.name}' is emulated on {self.stand_in.name}: {e}") from None

    def to_memory(self, t: torch.Tensor) -> torch.Tensor:
        return self.stand_in.to_memory(t)

    def fork_refusal(self) -> str | None:
        return self.stand_in.fork_refusal()

    def compile(self, part: Partition) -> CompiledPartition:
        violations, notes = check_constraints(part, self.device, self.policy)
        if violations:
            shown = "; ".join(str(v) for v in violations[:3])
            more = f" (and {len(violations) - 3} more)" if len(violations) > 3 else ""
            raise ConstraintViolation(
                f"partition {part.name} breaks a constraint of emulated {self.device.kind} '{self.device.name}': "
                f"{shown}{more}; place those nodes on another device (no silent fallback)"
            )
        self.check_available()
        inner = self.stand_in.compile(part)
        inner.report.notes = [f"emulated {self.device.kind} '{self.device.name}' on {self.stand_in.name}",
                              *notes, *inner.report.notes]
        inner.report.backend = self.name
        return EmulatedCompiled(inner, self.name)
