"""The program IR: instructions over virtual registers, one device per instruction.

A :class:`Program` is what lowering makes and what the scheduler, the memory planner and the executor
read. Every tensor is a :class:`Value` (a virtual register ``%N`` with shape, strides, dtype and the
bytes its storage spans); every operation is an :class:`Instr` that reads registers and defines new
ones on one device. Storage sharing is explicit: a value whose ``alias_of`` is set has no storage of
its own and lives inside its root's bytes (views, in-place results, getitem of split, zero-copy
transfers). Weights and graph inputs live outside the activation arena.

``str(program)`` is the stable text form: one line per value declaration and per instruction, in
program order, with no addresses or timings in it, so two programs diff line by line.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# value kinds
INPUT, WEIGHT, TEMP, OUTPUT = "input", "weight", "temp", "output"
# instruction kinds
KERNEL, VIEW, INPLACE, TRANSFER = "kernel", "view", "inplace", "transfer"

_DTYPE_SHORT = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "b8", torch.complex64: "c64",
}
_SHORT_DTYPE = {v: k for k, v in _DTYPE_SHORT.items()}


def dtype_short(dtype: torch.dtype) -> str:
    return _DTYPE_SHORT.get(dtype, str(dtype).replace("torch.", ""))


def dtype_from_short(s: str) -> torch.dtype:
    if s in _SHORT_DTYPE:
        return _SHORT_DTYPE[s]
    dt = getattr(torch, s, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype '{s}'")
    return dt


@dataclass(frozen=True)
class Reg:
    """A reference to a virtual register inside an instruction's arguments."""

    id: int

    def __repr__(self) -> str:
        return f"%{self.id}"


@dataclass
class Value:
    """A virtual register: one tensor's shape, layout, dtype, storage size and origin."""

    id: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    kind: str = TEMP  # input | weight | temp | output
    device: str = "cpu"
    producer: int | None = None  # instruction id, None for inputs and weights
    alias_of: int | None = None  # root value whose storage this one lives in
    storage_offset: int = 0
    name: str = ""  # the FX node it came from, for people reading the text

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes the storage must span for this layout (0 for an empty tensor)."""
        if self.numel == 0:
            return 0
        extent = self.storage_offset + 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=True))
        return extent * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        expect, st = 1, []
        for s in reversed(self.shape):
            st.append(expect)
            expect *= s
        return all(s == 1 or a == b for s, a, b in zip(self.shape, self.stride, reversed(st), strict=True))

    def laid_out_as(self, t: torch.Tensor) -> bool:
        """Whether tensor ``t`` has this value's shape and dtype and the same stride on every dimension longer
        than one (a length-1 dimension's stride addresses nothing: views and the fake tensors of a capture may
        disagree on it). The storage offset is not compared."""
        return tuple(t.shape) == self.shape and t.dtype == self.dtype and \
            all(s == 1 or a == b for s, a, b in zip(self.shape, t.stride(), self.stride, strict=True))

    def type_str(self) -> str:
        s = f"{dtype_short(self.dtype)}[{','.join(map(str, self.shape))}]"
        if not self.is_contiguous:
            s += f"{{{','.join(map(str, self.stride))}}}"
        if self.storage_offset:
            s += f"+{self.storage_offset}"
        return s


@dataclass
class Instr:
    """One operation: ``outputs = op(args, kwargs)`` on ``device``.

    ``kind`` is ``kernel`` (writes fresh storage), ``view`` (outputs alias an input), ``inplace``
    (mutates input 0 and returns it) or ``transfer`` (copies one register to another device; with
    ``attrs['zero_copy']`` the output aliases the source). ``target`` is the callable (an ATen or
    hetforge OpOverload); it is not part of the text form and is re-resolved from ``op`` on load.
    """

    id: int
    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[int, ...]
    device: str
    kind: str = KERNEL
    attrs: dict[str, Any] = field(default_factory=dict)
    target: Any = field(default=None, repr=False, compare=False)

    def input_regs(self) -> list[int]:
        """Register ids read by this instruction, in argument order, without duplicates."""
        seen: list[int] = []
        _collect_regs(self.args, seen)
        _collect_regs(self.kwargs, seen)
        return seen


def _collect_regs(obj: Any, seen: list[int]) -> None:
    """:func:`iter_regs` into ``seen`` without duplicates, as plain recursion (no generator per level: this is
    called for every instruction by liveness, memory planning and code generation)."""
    if isinstance(obj, Reg):
        if obj.id not in seen:
            seen.append(obj.id)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _collect_regs(x, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            _collect_regs(x, seen)


def iter_regs(obj: Any) -> Iterator[int]:
    if isinstance(obj, Reg):
        yield obj.id
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from iter_regs(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from iter_regs(x)


def map_regs(obj: Any, fn) -> Any:
    """Rebuild ``obj`` with every :class:`Reg` replaced by ``fn(reg)``."""
    if isinstance(obj, Reg):
        return fn(obj)
    if isinstance(obj, list):
        return [map_regs(x, fn) for x in obj]
    if isinstance(obj, tuple):
        return tuple(map_regs(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: map_regs(v, fn) for k, v in obj.items()}
    return obj


@dataclass
class WeightRef:
    """A weight referenced by the module path it is read from, with its shape, dtype and checksum."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    checksum: str  # "crc32:xxxxxxxx" of the bytes
    inline: bytes | None = None  # a saved copy (buffers and graph constants; parameters are only referenced)
    param: bool = True  # a model parameter: referenced by path, never copied into the program file


def _fmt_const(x: Any) -> str:
    if isinstance(x, Reg):
        return repr(x)
    if isinstance(x, torch.dtype):
        return dtype_short(x)
    if isinstance(x, torch.device):
        return f"device({x})"
    if isinstance(x, float):
        return repr(x) if math.isfinite(x) else f"float('{x}')"
    if isinstance(x, list):
        return "[" + ", ".join(_fmt_const(a) for a in x) + "]"
    if isinstance(x, tuple):
        return "(" + ", ".join(_fmt_const(a) for a in x) + ("," if len(x) == 1 else "") + ")"
    return repr(x) if isinstance(x, (int, bool, str, type(None))) else str(x)


@dataclass
class Program:
    """Values, instructions in program order, graph inputs/outputs and the weights they reference."""

    name: str
    soc: str
    devices: list[str]
    values: dict[int, Value] = field(default_factory=dict)
    instrs: list[Instr] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)  # flat list of Reg (or constants)
    weights: dict[int, WeightRef] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)  # out_spec, dropped-node counts, ...
    tensors: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)  # weight id → bound tensor
    soc_spec: dict[str, Any] | None = field(default=None, repr=False, compare=False)  # the SoC profile, as JSON
    memory: dict[str, Any] | None = field(default=None, repr=False, compare=False)  # saved arena offsets

    # --- queries -------------------------------------------------------------------------------
    def root(self, vid: int) -> int:
        """The value whose storage ``vid`` lives in (itself when it owns storage)."""
        seen = 0
        while self.values[vid].alias_of is not None:
            vid = self.values[vid].alias_of
            seen += 1
            if seen > len(self.values):
                raise ValueError("alias cycle in program")
        return vid

    def instr_by_id(self) -> dict[int, Instr]:
        return {i.id: i for i in self.instrs}

    def consumers(self) -> dict[int, list[int]]:
        """value id → ids of instructions reading it (in program order)."""
        out: dict[int, list[int]] = {v: [] for v in self.values}
        for ins in self.instrs:
            for r in ins.input_regs():
                out[r].append(ins.id)
        return out

    def output_regs(self) -> list[int]:
        return [r for r in iter_regs(self.outputs)]

    def count_by_device(self, include_views: bool = True) -> dict[str, int]:
        out = {d: 0 for d in self.devices}
        for ins in self.instrs:
            if include_views or ins.kind != VIEW:
                out[ins.device] = out.get(ins.device, 0) + 1
        return out

    def transfers(self) -> list[Instr]:
        return [i for i in self.instrs if i.kind == TRANSFER]

    def with_order(self, order: list[int]) -> Program:
        """A copy sharing values, with instructions in ``order`` (a list of instruction ids)."""
        by_id = self.instr_by_id()
        if sorted(order) != sorted(by_id):
            raise ValueError("order must be a permutation of the program's instruction ids")
        return Program(self.name, self.soc, list(self.devices), self.values, [by_id[i] for i in order],
                       list(self.inputs), list(self.outputs), self.weights, dict(self.attrs), self.tensors,
                       self.soc_spec, self.memory)

    # --- text form -----------------------------------------------------------------------------
    def _value_decl(self, v: Value) -> str:
        s = f"%{v.id}: {v.type_str()}"
        return s

    def text(self) -> str:
        lines = [f"program {self.name} soc={self.soc} devices=[{', '.join(self.devices)}]"]
        for vid in self.inputs:
            v = self.values[vid]
            lines.append(f"input {self._value_decl(v)} @{v.device}  # {v.name}")
        for vid, w in sorted(self.weights.items()):
            v = self.values[vid]
            alias = f" alias %{v.alias_of}" if v.alias_of is not None else ""
            lines.append(f"weight {self._value_decl(v)} = {w.path}{alias}")
        for ins in self.instrs:
            outs = ", ".join(self._value_decl(self.values[o]) for o in ins.outputs) or "()"
            args = ", ".join([_fmt_const(a) for a in ins.args] + [f"{k}={_fmt_const(v)}" for k, v in
                                                                   sorted(ins.kwargs.items())])
            notes = []
            for o in ins.outputs:
                v = self.values[o]
                if v.alias_of is not None:
                    notes.append(f"%{o} alias %{v.alias_of}")
                if v.kind == OUTPUT:
                    notes.append(f"%{o} output")
            for k in sorted(ins.attrs):
                if k not in ("node",):
                    notes.append(f"{k}={_fmt_const(ins.attrs[k])}")
            tail = f"  # {ins.attrs.get('node', '')}" + (f" [{'; '.join(notes)}]" if notes else "")
            lines.append(f"{outs} = {ins.kind} {ins.op}({args}) @{ins.device}{tail}")
        lines.append(f"return {_fmt_const(list(self.outputs))}")
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.text()
