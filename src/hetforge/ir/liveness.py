"""Buffer lifetimes over a program's instruction order, and the independent check of a memory plan.

These are facts about a :class:`~hetforge.ir.program.Program` (which values own storage, when they are
live) that both the memory planner (:mod:`hetforge.memplan`) and the program verifier
(:mod:`hetforge.ir.verify`) read; they live here, below both, so the verifier does not import the planner.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetforge.ir.program import KERNEL, TEMP, Instr, Program, Reg

ALIGN = 64


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Buffer:
    """One arena allocation: the root value, its device, aligned size and live interval (positions)."""

    value: int
    device: str
    size: int
    start: int
    end: int

    def overlaps_in_time(self, other: Buffer) -> bool:
        return self.start <= other.end and other.start <= self.end


ATTENTION_OP = "hetforge.attention.default"


def copying_heads_transpose(ins: Instr, p: Program) -> bool:
    """Whether ``ins`` is ``transpose(x, 1, 2)`` of a 4-D value into storage of its own (not a view: the capture
    recorded a dense result, as when ``.contiguous()`` followed it), which the executor runs as a copy."""
    return ins.kind == KERNEL and ins.op == "aten.transpose.int" and len(ins.args) == 3 and len(ins.outputs) == 1 \
        and isinstance(ins.args[0], Reg) and len(p.values[ins.args[0].id].shape) == 4 \
        and sorted(int(d) % 4 for d in ins.args[1:3]) == [1, 2]


def attention_writes(ins: Instr, p: Program, by_id: dict[int, Instr]) -> int | None:
    """The attention instruction that may write ``ins``'s result (the executor's heads-last rows: the attention
    writes the slice of a copying heads transpose of its result, and the copy goes), else None. Such a result
    is live from the attention on, so it never shares storage with what the attention reads."""
    if not copying_heads_transpose(ins, p):
        return None
    att = by_id.get(p.values[ins.args[0].id].producer)
    return att.id if att is not None and att.op == ATTENTION_OP and att.device == ins.device else None


def lifetimes(p: Program) -> dict[int, Buffer]:
    """Buffers of ``p`` (in its current instruction order) with their [first def, last use] intervals (a result
    an attention may write, :func:`attention_writes`, from the attention on)."""
    pos = {ins.id: k for k, ins in enumerate(p.instrs)}
    by_id = {ins.id: ins for ins in p.instrs}
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    for k, ins in enumerate(p.instrs):
        early = attention_writes(ins, p, by_id)
        for o in ins.outputs:
            rt = p.root(o)
            if o == rt:
                start[rt] = k if early is None else min(k, pos.get(early, k))
            end[rt] = max(end.get(rt, k), k)
        for r in ins.input_regs():
            rt = p.root(r)
            end[rt] = max(end.get(rt, k), k)
    out: dict[int, Buffer] = {}
    for vid, v in p.values.items():
        if v.alias_of is None and v.kind == TEMP and v.producer is not None and v.nbytes > 0:
            s = start.get(vid, pos.get(v.producer, 0))
            out[vid] = Buffer(vid, v.device, align(v.nbytes), s, max(end.get(vid, s), s))
    return out


class PlanError(AssertionError):
    """A memory plan breaks an invariant (overlap, alignment or bounds)."""


def verify_plan(buffers: dict[int, Buffer], offsets: dict[int, int], arena: dict[str, int]) -> None:
    """Raise :class:`PlanError` unless every buffer is aligned, inside its arena, and no two buffers live at
    the same time share a byte. Independent of the packing algorithms: a sweep over start times."""
    for b in buffers.values():
        off = offsets.get(b.value)
        if off is None:
            raise PlanError(f"buffer %{b.value} has no offset")
        if off % ALIGN:
            raise PlanError(f"buffer %{b.value} at offset {off} is not {ALIGN}-byte aligned")
        if off < 0 or off + b.size > arena.get(b.device, -1):
            raise PlanError(f"buffer %{b.value} [{off}, {off + b.size}) exceeds the {b.device} arena "
                            f"({arena.get(b.device)} bytes)")
    by_dev: dict[str, list[Buffer]] = {}
    for b in buffers.values():
        by_dev.setdefault(b.device, []).append(b)
    for bufs in by_dev.values():
        active: list[Buffer] = []
        for b in sorted(bufs, key=lambda b: (b.start, b.value)):
            active = [a for a in active if a.end >= b.start]
            lo, hi = offsets[b.value], offsets[b.value] + b.size
            for a in active:
                alo, ahi = offsets[a.value], offsets[a.value] + a.size
                if lo < ahi and alo < hi:
                    raise PlanError(f"buffers %{a.value} (live {a.start}..{a.end}, bytes [{alo}, {ahi})) and "
                                    f"%{b.value} (live {b.start}..{b.end}, bytes [{lo}, {hi})) overlap")
            active.append(b)
