"""The program verifier: invariants every :class:`~hetforge.ir.Program` must keep, checked after lowering,
after scheduling, after memory planning, and when a plan file is loaded (as ExecuTorch verifies each dialect).

What it checks (the first broken one is reported, naming the instruction and register):

* **identity** — instruction ids are unique; every register an instruction defines is declared, names that
  instruction as its producer, and is defined once; registers without a producer are graph inputs or weights;
  every device named is one of the program's devices.
* **def before use** — walking the instructions in order, every register read (and every program output) is
  a graph input, a weight, or defined by an earlier instruction.
* **aliases** — ``alias_of`` names a declared register and has no cycle; a view's outputs live in one of its
  inputs' storage, an in-place op's output in its first input's, a kernel's outputs in fresh storage; only a
  zero-copy transfer may bring storage to another device (views of its output then alias a root there).
* **devices** — a kernel, view or in-place op reads non-weight registers on its own device and defines its
  outputs there; a transfer reads one register on its ``src`` device and defines one on its ``dst`` device
  (``src != dst``).
* **memory** (with a plan) — arena buffers are exactly the storage-owning temporaries (graph inputs, outputs
  and weights are never inside an arena); each has an offset that is aligned, inside its device's arena, and
  disjoint from every buffer live at the same time (:func:`hetforge.memplan.verify_plan`).
"""

from __future__ import annotations

from typing import Any

from hetforge.errors import HetforgeError
from hetforge.ir.liveness import ALIGN, PlanError, lifetimes, verify_plan
from hetforge.ir.program import INPLACE, INPUT, KERNEL, OUTPUT, TEMP, TRANSFER, VIEW, WEIGHT, Program, iter_regs

STAGES = ("lower", "schedule", "memory", "load")


class ProgramVerifyError(HetforgeError):
    """A program breaks an IR invariant (a compiler bug, or a damaged plan file)."""

    def __init__(self, stage: str, msg: str):
        super().__init__(f"program verifier ({stage}): {msg}")
        self.stage = stage
        self.problem = msg


def _roots(p: Program, stage: str) -> dict[int, int]:
    roots: dict[int, int] = {}
    for vid, v in p.values.items():
        if v.alias_of is not None and v.alias_of not in p.values:
            raise ProgramVerifyError(stage, f"%{vid} aliases %{v.alias_of}, which is not declared")
        seen = {vid}
        r = vid
        while p.values[r].alias_of is not None:
            r = p.values[r].alias_of
            if r in seen:
                raise ProgramVerifyError(stage, f"alias cycle through %{vid}")
            seen.add(r)
        roots[vid] = r
    return roots


def _check_identity(p: Program, stage: str) -> None:
    devices = set(p.devices)
    ids: set[int] = set()
    defined_by: dict[int, int] = {}
    for ins in p.instrs:
        if ins.id in ids:
            raise ProgramVerifyError(stage, f"instruction id {ins.id} appears twice")
        ids.add(ins.id)
        if ins.device not in devices:
            raise ProgramVerifyError(stage, f"instruction {ins.id} ({ins.op}) runs on '{ins.device}', not one of "
                                            f"the program's devices {p.devices}")
        for o in ins.outputs:
            if o not in p.values:
                raise ProgramVerifyError(stage, f"instruction {ins.id} ({ins.op}) defines %{o}, which is not declared")
            if o in defined_by:
                raise ProgramVerifyError(stage, f"%{o} is defined twice (instructions {defined_by[o]} and {ins.id})")
            defined_by[o] = ins.id
            if p.values[o].producer != ins.id:
                raise ProgramVerifyError(stage, f"%{o} is defined by instruction {ins.id} but its producer says "
                                                f"{p.values[o].producer}")
    for vid, v in p.values.items():
        if v.device not in devices:
            raise ProgramVerifyError(stage, f"%{vid} lives on '{v.device}', not one of the program's devices")
        if v.producer is not None and defined_by.get(vid) != v.producer:
            raise ProgramVerifyError(stage, f"%{vid} names instruction {v.producer} as producer, which does not "
                                            "define it")
        if v.producer is None and v.kind not in (INPUT, WEIGHT):
            raise ProgramVerifyError(stage, f"%{vid} ({v.kind}) has no producer; only inputs and weights may")
    for vid in p.inputs:
        if vid not in p.values or p.values[vid].kind != INPUT:
            raise ProgramVerifyError(stage, f"graph input %{vid} is not a declared input register")
    for vid in p.weights:
        if vid not in p.values or p.values[vid].kind != WEIGHT:
            raise ProgramVerifyError(stage, f"weight %{vid} is not a declared weight register")


def _check_def_use(p: Program, stage: str) -> None:
    defined = {vid for vid, v in p.values.items() if v.producer is None}
    for ins in p.instrs:
        for r in ins.input_regs():
            if r not in defined:
                what = "is not declared" if r not in p.values else "is used before it is defined"
                raise ProgramVerifyError(stage, f"instruction {ins.id} ({ins.op}) reads %{r}, which {what}")
        defined.update(ins.outputs)
    for r in iter_regs(p.outputs):
        if r not in defined:
            raise ProgramVerifyError(stage, f"program output %{r} is never defined")


def _check_aliases_devices(p: Program, stage: str, roots: dict[int, int]) -> None:
    for ins in p.instrs:
        ins_in = ins.input_regs()
        if ins.kind == TRANSFER:
            src, dst = ins.attrs.get("src"), ins.attrs.get("dst")
            if len(ins_in) != 1 or len(ins.outputs) != 1:
                raise ProgramVerifyError(stage, f"transfer {ins.id} must read one register and define one")
            a, b = p.values[ins_in[0]], p.values[ins.outputs[0]]
            if src == dst or a.device != src or b.device != dst:
                raise ProgramVerifyError(stage, f"transfer {ins.id} moves %{a.id} ({a.device}) to %{b.id} ({b.device}) "
                                                f"but says {src} → {dst}")
            if ins.attrs.get("zero_copy"):
                if roots[b.id] != roots[a.id]:
                    raise ProgramVerifyError(stage, f"zero-copy transfer {ins.id}: %{b.id} does not alias %{a.id}")
            elif b.alias_of is not None:
                raise ProgramVerifyError(stage, f"copying transfer {ins.id}: %{b.id} aliases %{b.alias_of}")
            continue
        for r in ins_in:
            v = p.values[r]
            if v.kind != WEIGHT and roots[r] not in p.weights and v.device != ins.device:
                raise ProgramVerifyError(stage, f"instruction {ins.id} ({ins.op}) on {ins.device} reads %{r} on "
                                                f"{v.device} with no transfer")
        in_roots = {roots[r] for r in ins_in}
        for o in ins.outputs:
            v = p.values[o]
            if v.device != ins.device:
                raise ProgramVerifyError(stage, f"instruction {ins.id} ({ins.op}) on {ins.device} defines %{o} on "
                                                f"{v.device}")
            if v.alias_of is None:
                continue
            # alias_of names the storage root, which may sit on another device when the storage came over a
            # zero-copy transfer; that transfer was checked where it was defined, and a view's or in-place
            # op's output must share the storage of an input on its own device (checked below)
            if ins.kind == KERNEL:
                raise ProgramVerifyError(stage, f"kernel {ins.id} ({ins.op}) output %{o} aliases %{v.alias_of}; a "
                                                "kernel writes fresh storage")
            if ins.kind == VIEW and roots[o] not in in_roots:
                raise ProgramVerifyError(stage, f"view {ins.id} ({ins.op}) output %{o} lives in %{roots[o]}, not in "
                                                "one of its inputs")
            if ins.kind == INPLACE and (not ins_in or roots[o] != roots[ins_in[0]]):
                raise ProgramVerifyError(stage, f"in-place {ins.id} ({ins.op}) output %{o} is not its first input's "
                                                "storage")


def arena_buffers(p: Program, roots: dict[int, int] | None = None) -> set[int]:
    """Registers that must own a slice of an arena: storage-owning temporaries with bytes."""
    return {vid for vid, v in p.values.items()
            if v.alias_of is None and v.kind == TEMP and v.producer is not None and v.nbytes > 0}


def _check_memory(p: Program, stage: str, offsets: dict[int, int], arena: dict[str, int]) -> None:
    for vid in offsets:
        v = p.values.get(vid)
        if v is None:
            raise ProgramVerifyError(stage, f"the memory plan places %{vid}, which is not declared")
        if v.kind in (INPUT, OUTPUT, WEIGHT):
            raise ProgramVerifyError(stage, f"{v.kind} %{vid} is placed inside the {v.device} arena; graph inputs, "
                                            "outputs and weights live outside it")
        if v.alias_of is not None:
            raise ProgramVerifyError(stage, f"%{vid} aliases %{v.alias_of} but has its own arena offset")
    missing = sorted(arena_buffers(p) - set(offsets))
    if missing:
        raise ProgramVerifyError(stage, f"%{missing[0]} owns storage but has no arena offset"
                                 + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for d in arena:
        if d not in p.devices:
            raise ProgramVerifyError(stage, f"the memory plan has an arena for '{d}', not one of the program's "
                                            "devices")
    try:
        verify_plan(lifetimes(p), offsets, arena)
    except PlanError as e:
        raise ProgramVerifyError(stage, str(e)) from None


def memory_record(offsets: dict[int, int], arena: dict[str, int]) -> dict[str, Any]:
    """The JSON form of a memory plan saved with a program (offsets keyed by register id)."""
    return {"align": ALIGN, "arena_bytes": dict(arena), "offsets": {str(k): int(v) for k, v in sorted(offsets.items())}}


def _saved_memory(p: Program, stage: str) -> tuple[dict[int, int], dict[str, int]]:
    m = p.memory or {}
    try:
        offsets = {int(k): v for k, v in dict(m["offsets"]).items()}
        arena = dict(m["arena_bytes"])
    except (KeyError, TypeError, ValueError):
        raise ProgramVerifyError(stage, "the saved memory plan needs 'offsets' {register: byte} and "
                                        "'arena_bytes' {device: bytes}") from None
    bad = [v for v in [*offsets.values(), *arena.values()] if not isinstance(v, int) or isinstance(v, bool)]
    if bad:
        raise ProgramVerifyError(stage, f"the saved memory plan holds {bad[0]!r} where a byte count belongs")
    return offsets, arena


def verify_program(p: Program, stage: str = "lower", offsets: dict[int, int] | None = None,
                   arena: dict[str, int] | None = None) -> None:
    """Raise :class:`ProgramVerifyError` naming the first broken invariant of ``p`` (see the module doc).

    The memory checks run when ``offsets``/``arena`` are given, or at ``stage='load'`` when the program carries
    a saved plan (``p.memory``), which is re-checked against the loaded instruction order."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}")
    roots = _roots(p, stage)
    _check_identity(p, stage)
    _check_def_use(p, stage)
    _check_aliases_devices(p, stage, roots)
    if offsets is None and stage == "load" and p.memory is not None:
        offsets, arena = _saved_memory(p, stage)
    if offsets is not None:
        _check_memory(p, stage, offsets, arena or {})
