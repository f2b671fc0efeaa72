"""Decode programs bound as a step (``runtime.executors.StepBinding``; ``Executable`` ``reuse_outputs`` /
``pinned``): the bits of the unbound program, outputs in the program's own memory (the next call overwrites them),
the KV cache's pointers baked in, and code without the pins for a call that passes other tensors."""

from __future__ import annotations

import pytest
import torch

from hetforge.errors import UsageError
from hetforge.executor import Executable
from hetforge.ir.program import Reg
from hetforge.memplan import plan_memory, verify_plan, with_output_slices
from hetforge.models.zoo import load_model
from hetforge.runtime import Engine, SamplingParams

PROMPT = list(range(3, 40))


def _decode(name: str):
    """An engine's decode program after a request, its torch-cpu partition's Executable, and that partition's
    arguments for one step (the engine's own cache buffers, random contents)."""
    eng = Engine(load_model(name), executor="auto")
    r = eng.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
    prog, _ = eng.programs.decode(r.cache_length)
    cache = eng.programs.cache(r.cache_length)
    g = torch.Generator().manual_seed(1)
    for b in cache.buffers:
        b.copy_(torch.randn(b.shape, generator=g))
    pg = prog.placed.partitions
    assert len(pg.partitions) == 1
    by_name = dict(zip(pg.graph_inputs, (torch.tensor([[7]]), torch.tensor([[20]]), *cache.buffers), strict=True))
    args = tuple(by_name[n] for n in pg.partitions[0].inputs)
    return eng, prog, prog.placed.exe.compiled[0].executable, args


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_a_step_bound_decode_program_has_the_unbound_bits_and_writes_its_outputs_into_its_own_memory(name):
    eng, prog, exe, args = _decode(name)
    assert exe.reuse_outputs and len(exe.pinned) == 2 * eng.programs.layers
    assert any("bound as a step" in n for n in prog.notes)
    plain = Executable(exe.program, exe.plan, exe.device_map, exe.mode)
    want = [t.clone() for t in plain.run_flat(*args)]
    got = exe.run_flat(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    ptrs = [t.data_ptr() for t in got]
    assert [t.data_ptr() for t in exe.run_flat(*args)] == ptrs  # the same memory, call after call
    arena = exe.arenas["cpu"]
    assert all(arena.data_ptr() <= q < arena.data_ptr() + arena.numel() for q in ptrs)
    # the program as the engine calls it (graph inputs in the graph's order) returns those tensors, not copies
    pg = prog.placed.partitions
    by_part = dict(zip(pg.partitions[0].inputs, args, strict=True))
    out = prog.run(*(by_part[n] for n in pg.graph_inputs))
    assert {t.data_ptr() for t in out} <= set(ptrs)


def test_a_pinned_program_called_with_other_tensors_runs_code_without_the_pins_with_the_same_bits():
    _, _, exe, args = _decode("llama-tiny")
    want = [t.clone() for t in exe.run_flat(*args)]
    other = tuple(a.clone() if a.dim() == 4 else a for a in args)
    got = exe.run_flat(*other)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert exe._unpinned.fn is not None  # made on that first call with other tensors


def test_a_pinned_input_that_does_not_match_the_program_is_a_usage_error():
    _, _, exe, args = _decode("gpt2-tiny")
    pos = next(i for i, a in enumerate(args) if a.dim() == 4)
    with pytest.raises(UsageError, match=f"pinned input {pos} does not match"):
        Executable(exe.program, exe.plan, exe.device_map, exe.mode, pinned={pos: args[pos][:, :, :5]})
    with pytest.raises(UsageError, match="pinned input 99 does not match the program's input \\(none\\)"):
        Executable(exe.program, exe.plan, exe.device_map, exe.mode, pinned={99: args[pos]})


def test_output_slices_lie_past_the_arena_one_per_output_root_and_the_plan_stays_valid():
    _, _, exe, _ = _decode("gpt2-tiny")
    p, plan = exe.program, exe.plan
    more = with_output_slices(p, plan)
    roots = {p.root(o.id) for o in p.outputs if isinstance(o, Reg)} - set(plan.offsets)
    roots = {r for r in roots if p.values[r].producer is not None}
    assert roots and roots <= set(more.offsets)
    end = plan.devices["cpu"].arena_bytes
    spans = sorted((more.offsets[r], more.offsets[r] + p.values[r].nbytes) for r in roots)
    assert spans[0][0] >= end and all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= more.devices["cpu"].arena_bytes
    verify_plan(plan.buffers, more.offsets, {d: dp.arena_bytes for d, dp in more.devices.items()})
    assert plan_memory(p).offsets == plan.offsets  # the stored plan is untouched


def test_generation_with_step_bound_decode_gives_the_fx_references_tokens():
    loaded = load_model("llama-tiny")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = Engine(loaded, executor="fx").generate(PROMPT, params)
    eng = Engine(loaded, executor="auto")
    for _ in range(2):  # the second request runs on the bound program made by the first
        assert eng.generate(PROMPT, params).tokens == ref.tokens


@pytest.mark.parametrize("copy_aliased", [True, False])
def test_a_one_partition_host_program_runs_directly_with_the_general_paths_outputs_and_report(copy_aliased):
    """HeteroExecutable.run's direct path (one host partition reading graph inputs only) against its general path on
    the same program: the same outputs (copies exactly where the general path copies) and the same call record."""
    eng, prog, exe, args = _decode("gpt2-tiny")
    hx, pg = prog.placed.exe, prog.placed.partitions
    by_part = dict(zip(pg.partitions[0].inputs, args, strict=True))
    gargs = tuple(by_part[n] for n in pg.graph_inputs)
    got, rep = hx.run(gargs, copy_aliased=copy_aliased)
    assert hx._direct  # planned on the first run
    got = [(t.clone(), t.data_ptr()) for t in got]
    hx._direct = False  # the general path from here on
    want, wrep = hx.run(gargs, copy_aliased=copy_aliased)
    assert [torch.equal(a, b) for (a, _), b in zip(got, want, strict=True)] == [True] * len(want)
    assert [p for _, p in got] == [t.data_ptr() for t in want] or copy_aliased  # not copied: the program's memory
    assert rep.output_copies == wrep.output_copies == (len(want) if copy_aliased else 0)
    (c,), (w,) = rep.calls, wrep.calls
    assert (c.partition, c.device, c.backend, c.nodes, c.modeled_s) == (w.partition, w.device, w.backend, w.nodes,
                                                                        w.modeled_s)
    assert rep.transfers == wrep.transfers == []
