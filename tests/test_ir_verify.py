"""The program verifier: real compiled programs pass it; each deliberately broken copy is caught, by name."""

from __future__ import annotations

import dataclasses

import pytest

from hetforge.compile import compile_model
from hetforge.ir import Program, Reg
from hetforge.ir.program import KERNEL, TEMP, TRANSFER, VIEW
from hetforge.ir.verify import ProgramVerifyError, verify_program
from hetforge.memplan import ALIGN


@pytest.fixture(scope="module")
def compiled():
    """llama-tiny on the 155H with greedy placement: kernels on several devices, views, copying transfers."""
    return compile_model("llama-tiny", seq=8, soc="intel-core-ultra-155h", strategy="greedy", build=False)


@pytest.fixture(scope="module")
def unified():
    """llama-tiny on the Jetson AGX Orin (unified memory): zero-copy transfers that alias across devices."""
    return compile_model("llama-tiny", seq=8, soc="jetson-agx-orin", strategy="greedy", build=False)


def clone(p: Program) -> Program:
    return Program(p.name, p.soc, list(p.devices), {k: dataclasses.replace(v) for k, v in p.values.items()},
                   [dataclasses.replace(i, attrs=dict(i.attrs)) for i in p.instrs], list(p.inputs),
                   list(p.outputs), dict(p.weights), dict(p.attrs), p.tensors, p.soc_spec, p.memory)


def _mem(res):
    return dict(res.memory.offsets), {d: dp.arena_bytes for d, dp in res.memory.devices.items()}


@pytest.mark.parametrize("model,soc,strategy", [("llama-tiny", "intel-core-ultra-155h", "greedy"),
                                                ("gpt2-tiny", "jetson-agx-orin", "rules"),
                                                ("mixtral-tiny", "test-npu-gaps", "support")])
def test_compiled_programs_pass_every_stage(model, soc, strategy):
    res = compile_model(model, seq=8, soc=soc, strategy=strategy, build=False)  # verifies inside, too
    off, arena = _mem(res)
    verify_program(res.lowered.program, "lower")
    verify_program(res.program, "schedule")
    verify_program(res.program, "memory", off, arena)
    assert res.program.memory["offsets"] and res.program.transfers()


def _first(p, pred):
    return next(i for i in p.instrs if pred(i))


def _kernel_reading_temp(p):
    return _first(p, lambda i: i.kind == KERNEL and any(p.values[r].kind == TEMP for r in i.input_regs()))


def use_before_def(p):
    ins = _kernel_reading_temp(p)
    r = next(r for r in ins.input_regs() if p.values[r].kind == TEMP)
    prod = next(k for k, i in enumerate(p.instrs) if r in i.outputs)
    k = p.instrs.index(ins)
    p.instrs.insert(prod, p.instrs.pop(k))
    return "is used before it is defined"


def undeclared_register(p):
    ins = _kernel_reading_temp(p)
    ins.args = (Reg(99999), *ins.args[1:])
    return "%99999, which is not declared"


def defined_twice(p):
    a = _kernel_reading_temp(p)
    b = next(i for i in p.instrs[p.instrs.index(a) + 1:] if i.kind == KERNEL and i.outputs)
    b.outputs = (*b.outputs, a.outputs[0])
    return "is defined twice"


def output_never_defined(p):
    vid = max(p.values) + 1
    p.values[vid] = dataclasses.replace(p.values[p.inputs[0]], id=vid, kind=TEMP, producer=12345)
    p.outputs = [*p.outputs, Reg(vid)]
    return "names instruction 12345 as producer"


def cross_device_read(p):
    devs = p.devices
    ins = _kernel_reading_temp(p)
    other = next(d for d in devs if d != ins.device)
    ins.device = other
    for o in ins.outputs:
        p.values[o].device = other
    return "with no transfer"


def transfer_wrong_device(p):
    t = _first(p, lambda i: i.kind == TRANSFER)
    t.attrs["dst"] = t.attrs["src"]
    return "but says"


def zero_copy_not_aliased(p):
    t = _first(p, lambda i: i.kind == TRANSFER and i.attrs.get("zero_copy"))
    p.values[t.outputs[0]].alias_of = None
    return "does not alias"


def kernel_output_aliases(p):
    ins = _kernel_reading_temp(p)
    src = next(r for r in ins.input_regs() if p.values[r].kind == TEMP and p.values[r].device == ins.device)
    p.values[ins.outputs[0]].alias_of = src
    return "a kernel writes fresh storage"


def view_aliases_elsewhere(p):
    v = _first(p, lambda i: i.kind == VIEW and p.values[i.outputs[0]].alias_of is not None)
    stranger = next(vid for vid, x in p.values.items()
                    if x.kind == TEMP and x.alias_of is None and x.device == v.device
                    and vid not in {p.root(r) for r in v.input_regs()})
    p.values[v.outputs[0]].alias_of = stranger
    return "not in one of its inputs"


def alias_cycle(p):
    v = _first(p, lambda i: i.kind == VIEW and p.values[i.outputs[0]].alias_of is not None)
    o = v.outputs[0]
    p.values[p.values[o].alias_of].alias_of = o
    return "alias cycle"


def temp_without_producer(p):
    ins = _kernel_reading_temp(p)
    r = next(r for r in ins.input_regs() if p.values[r].kind == TEMP)
    vid = max(p.values) + 1
    p.values[vid] = dataclasses.replace(p.values[r], id=vid, producer=None, alias_of=None)
    ins.args = tuple(Reg(vid) if a == Reg(r) else a for a in ins.args)
    return f"%{vid} \\(temp\\) has no producer"


def copy_transfer_aliased(p):
    t = _first(p, lambda i: i.kind == TRANSFER and not i.attrs.get("zero_copy"))
    p.values[t.outputs[0]].alias_of = t.input_regs()[0]
    return "copying transfer"


PROGRAM_BREAKS = [use_before_def, undeclared_register, defined_twice, output_never_defined, cross_device_read,
                  transfer_wrong_device, kernel_output_aliases, view_aliases_elsewhere, alias_cycle,
                  temp_without_producer, copy_transfer_aliased]


@pytest.mark.parametrize("brk", PROGRAM_BREAKS, ids=lambda f: f.__name__)
def test_verifier_catches_a_broken_program(compiled, brk):
    _broken(compiled, brk)


@pytest.mark.parametrize("brk", [zero_copy_not_aliased, transfer_wrong_device, cross_device_read],
                         ids=lambda f: f.__name__)
def test_verifier_catches_a_broken_unified_memory_program(unified, brk):
    _broken(unified, brk)


def _broken(res, brk):
    p = clone(res.program)
    verify_program(p, "schedule")  # the unbroken copy passes
    msg = brk(p)
    with pytest.raises(ProgramVerifyError, match=msg):
        verify_program(p, "schedule")


def _input_in_arena(p, off, arena):
    off[p.inputs[0]] = 0
    return "input .* is placed inside"


def _weight_in_arena(p, off, arena):
    off[next(iter(p.weights))] = 0
    return "weight .* is placed inside"


def _output_in_arena(p, off, arena):
    vid = next(vid for vid, v in p.values.items() if v.kind == "output")
    off[vid] = 0
    return "output .* is placed inside"


def _missing_offset(p, off, arena):
    off.pop(next(iter(off)))
    return "has no arena offset"


def _overlap(p, off, arena):
    from hetforge.memplan import lifetimes

    bufs = lifetimes(p)
    a, b = next((a, b) for a in bufs.values() for b in bufs.values()
                if a.value < b.value and a.device == b.device and a.overlaps_in_time(b))
    off[b.value] = off[a.value]
    return "overlap"


def _misaligned(p, off, arena):
    k = next(k for k, v in off.items() if v > 0)
    off[k] += 1
    return f"not {ALIGN}-byte aligned"


def _arena_too_small(p, off, arena):
    d = next(d for d, n in arena.items() if n > 0)
    arena[d] = 1
    return "exceeds the"


MEMORY_BREAKS = [_input_in_arena, _weight_in_arena, _output_in_arena, _missing_offset, _overlap, _misaligned,
                 _arena_too_small]


@pytest.mark.parametrize("brk", MEMORY_BREAKS, ids=lambda f: f.__name__.strip("_"))
def test_verifier_catches_a_broken_memory_plan(compiled, brk):
    p = compiled.program
    off, arena = _mem(compiled)
    verify_program(p, "memory", off, arena)
    msg = brk(p, off, arena)
    with pytest.raises(ProgramVerifyError, match=msg):
        verify_program(p, "memory", off, arena)


def test_saved_memory_plan_is_rechecked_at_load(compiled):
    """At load the saved offsets are checked against lifetimes recomputed from the loaded instruction order:
    the compiler's own plan passes; the same plan with every buffer at offset 0 does not."""
    from hetforge.ir.verify import memory_record

    p = clone(compiled.program)
    off, arena = _mem(compiled)
    p.memory = memory_record(off, arena)
    verify_program(p, "load")
    p.memory = memory_record({k: 0 for k in off}, arena)
    with pytest.raises(ProgramVerifyError, match="overlap"):
        verify_program(p, "load")


def test_input_value_kinds_are_checked(compiled):
    p = clone(compiled.program)
    p.values[p.inputs[0]].kind = TEMP
    with pytest.raises(ProgramVerifyError, match="has no producer|is not a declared input"):
        verify_program(p, "lower")
