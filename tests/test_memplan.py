import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ir_common import captured

from hetforge.compile import compile_graph
from hetforge.memplan import (
    ALGORITHMS,
    ALIGN,
    Buffer,
    PlanError,
    arena_size,
    lifetimes,
    lower_bound,
    plan_memory,
    verify_plan,
)


@st.composite
def buffer_sets(draw):
    n = draw(st.integers(1, 25))
    bufs = []
    for i in range(n):
        s = draw(st.integers(0, 30))
        e = s + draw(st.integers(0, 10))
        size = draw(st.integers(1, 5000))
        bufs.append(Buffer(i, "cpu", (size + ALIGN - 1) // ALIGN * ALIGN, s, e))
    return bufs


@settings(max_examples=80, deadline=None)
@given(buffer_sets())
def test_every_algorithm_gives_a_valid_plan_within_bounds(bufs):
    lb = lower_bound(bufs)
    for algo in ALGORITHMS.values():
        offs = algo(bufs)
        size = arena_size(bufs, offs)
        verify_plan({b.value: b for b in bufs}, offs, {"cpu": size})
        assert lb <= size <= sum(b.size for b in bufs)


@settings(max_examples=60, deadline=None)
@given(buffer_sets())
def test_verifier_rejects_a_corrupted_plan(bufs):
    offs = ALGORITHMS["greedy-by-size"](bufs)
    size = arena_size(bufs, offs)
    pairs = [(a, b) for a in bufs for b in bufs if a.value < b.value and a.overlaps_in_time(b)]
    if not pairs:
        # nothing overlaps in time: misalignment must still be caught
        bad = dict(offs)
        bad[bufs[0].value] += 8
        with pytest.raises(PlanError):
            verify_plan({b.value: b for b in bufs}, bad, {"cpu": size + 64})
        return
    a, b = pairs[0]
    bad = dict(offs)
    bad[b.value] = bad[a.value]  # two simultaneously live buffers on the same bytes
    with pytest.raises(PlanError, match="overlap"):
        verify_plan({x.value: x for x in bufs}, bad, {"cpu": max(size, bad[a.value] + max(a.size, b.size))})


def test_verifier_rejects_out_of_arena():
    bufs = {0: Buffer(0, "cpu", 128, 0, 3)}
    with pytest.raises(PlanError, match="exceeds"):
        verify_plan(bufs, {0: 64}, {"cpu": 128})


@pytest.mark.parametrize("name", ["gpt2-tiny", "mixtral-tiny"])
def test_alias_lifetimes_cover_their_uses_and_plan_is_tight(name):
    _, inputs, cg = captured(name)
    res = compile_graph(cg.gm, soc="test-npu-gaps", example_inputs=inputs, build=False)
    p, plan = res.program, res.memory
    bufs = lifetimes(p)
    pos = {i.id: k for k, i in enumerate(p.instrs)}
    n_alias = 0
    for k, ins in enumerate(p.instrs):
        for r in list(ins.input_regs()) + list(ins.outputs):
            root = p.root(r)
            if root in bufs:
                b = bufs[root]
                assert b.start <= k <= b.end, (r, root, k, b)
                n_alias += r != root
        for o in ins.outputs:
            if p.values[o].alias_of is not None:
                root = p.root(o)
                if root in bufs:  # the root is defined before any alias of it
                    assert pos[p.values[root].producer] <= k
    assert n_alias > 0
    for d, dp in plan.devices.items():
        assert dp.lower_bound_bytes <= dp.arena_bytes <= dp.naive_bytes
        assert dp.arena_bytes <= 1.05 * dp.lower_bound_bytes + ALIGN, d
    assert set(plan.devices["cpu"].candidates) == set(ALGORITHMS)


def test_inputs_weights_and_outputs_are_outside_the_arena():
    _, inputs, cg = captured("gpt2-tiny")
    res = compile_graph(cg.gm, soc="host", example_inputs=inputs, build=False)
    p = res.program
    plan = plan_memory(p)
    for vid in plan.offsets:
        assert p.values[vid].kind == "temp" and p.values[vid].alias_of is None
    for vid in list(p.inputs) + list(p.weights) + [p.root(o) for o in p.output_regs()]:
        assert vid not in plan.offsets


def synthetic_program(seed: int, n: int, devices: int):
    """A random program over the IR: each instruction reads 1-2 earlier values and defines either fresh
    storage or a view of an earlier value (so alias chains of any depth appear)."""
    import random

    import torch

    from hetforge.ir import KERNEL, VIEW, Instr, Program, Reg, Value

    rng = random.Random(seed)
    devs = ["cpu", "npu", "gpu"][:devices]
    p = Program("synthetic", "none", devs)
    p.values[0] = Value(0, (4,), (1,), torch.float32, "input", "cpu")
    p.inputs = [0]
    for i in range(n):
        reads = rng.sample(sorted(p.values), k=min(len(p.values), rng.randint(1, 2)))
        vid = len(p.values)
        dev = rng.choice(devs)
        base = reads[0]
        is_view = rng.random() < 0.4 and p.values[base].kind == "temp"
        size = rng.randint(1, 300)
        p.values[vid] = Value(vid, (size,), (1,), torch.float32, "temp", dev, i, base if is_view else None)
        p.instrs.append(Instr(i, "synthetic", tuple(Reg(r) for r in reads), {}, (vid,), dev,
                              VIEW if is_view else KERNEL))
    p.outputs = [Reg(len(p.values) - 1)]
    return p


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 30), st.integers(1, 3))
def test_schedule_and_plan_random_alias_programs(seed, n, devices):
    from hetforge.schedule import dependencies, is_topological, schedule

    p = synthetic_program(seed, n, devices)
    s = schedule(p)
    assert is_topological(s.order, dependencies(p))
    plan = plan_memory(s.program)  # verify=True: raises if two live buffers share bytes
    bufs = lifetimes(s.program)
    q = s.program
    for k, ins in enumerate(q.instrs):
        for r in list(ins.input_regs()) + list(ins.outputs):
            root = q.root(r)
            if root in bufs:  # every use of a view lies inside its root's lifetime
                assert bufs[root].start <= k <= bufs[root].end
    for d, dp in plan.devices.items():
        assert dp.lower_bound_bytes <= dp.arena_bytes <= dp.naive_bytes, d
