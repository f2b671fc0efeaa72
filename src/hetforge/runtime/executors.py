"""Program executors: how a captured graph becomes something to call.

* ``backend`` (= ``auto``, the default) — the one execution path: hetforge's compiler for an SoC profile
  with a placement strategy (passes, quantization, placement, lowering, scheduling, memory plan), the
  scheduled program cut into same-device partitions, each compiled on its device's backend (the CPU
  executor with arenas and native kernels, OpenVINO, CUDA, or an emulated device that enforces its op set,
  static shapes, dtypes and memory) and run partition by partition with explicit transfers. A plan for one
  device is one partition. Every call leaves a :class:`~hetforge.hetero.runner.RunReport` (measured call
  and transfer times, modeled ones from the cost model) for the runtime's per-token figures.
* ``fx`` — the optimized ``torch.fx.GraphModule`` called as is: the reference, no placement.

Either executor can quantize the weights of every linear after the passes (``quantize`` = ``w8`` /
``w4`` / ``w8a8``; ``hetforge.quant``), so prefill and decode programs run the int8/int4 kernels; the
scheme is part of the executor's name in every result (e.g. ``backend+w8a8``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hetforge.errors import UsageError

RunFn = Callable[..., Sequence[torch.Tensor]]


@dataclass
class Built:
    """A callable program plus what building it took (measured seconds)."""

    run: RunFn
    optimize_s: float
    compile_s: float
    nodes: int
    notes: list[str] = field(default_factory=list)
    placed: Any = None  # a :class:`Placed` for placed programs (partitions, per-call reports); None for fx


@dataclass(frozen=True)
class StepBinding:
    """How a program run once per generated token is bound to its caller (the runtime's decode step), which takes
    its outputs before calling it again and passes the same tensors at some inputs every call (its KV cache):
    partitions on a backend that takes a binding (``Backend.binds_steps``) keep their outputs in their own memory,
    overwritten by the next call, with no copy on the way out, and bake in the pinned inputs' pointers
    (:class:`hetforge.executor.Executable` ``reuse_outputs`` / ``pinned``)."""

    pinned: dict[int, torch.Tensor] = field(default_factory=dict)  # graph input position → the tensor passed there


def bind_partition(step: StepBinding | None, backend: Any, graph_inputs: Sequence[str],
                   part_inputs: Sequence[str]) -> tuple[bool, dict[int, torch.Tensor]]:
    """``(reuse_outputs, pinned)`` for one partition of a program bound as ``step`` (none: ``(False, {})``): the
    binding where its backend takes one (``Backend.binds_steps``), the pinned tensors by the position of the
    partition's inputs (named as the graph's). Both ways of building a partition use it: compiled here, or rebuilt
    from a compile-cache entry."""
    if step is None or not backend.binds_steps:
        return False, {}
    at = {name: i for i, name in enumerate(graph_inputs)}
    return True, {j: step.pinned[at[n]] for j, n in enumerate(part_inputs) if at.get(n) in step.pinned}


class Executor(Protocol):
    name: str

    def build(self, gm: torch.fx.GraphModule, inputs: tuple, label: str, optimize: bool) -> Built:
        """Make ``gm`` callable on tensors shaped like ``inputs``."""
        ...


def _check_quant(quantize: str, group_size: int) -> None:
    if quantize != "none":
        from hetforge.quant import check_options

        check_options(quantize, group_size, ())


def _quantize(gm: torch.fx.GraphModule, quantize: str, group_size: int) -> tuple[torch.fx.GraphModule, str]:
    from hetforge.quant import quantize_graph

    res = quantize_graph(gm, quantize, group_size=group_size)
    return res.gm, f"quantization: {res.report.summary_line()}"


def _passes(gm: torch.fx.GraphModule, inputs: tuple) -> tuple[torch.fx.GraphModule, str]:
    from hetforge.passes import optimize

    res = optimize(gm, inputs)
    fused = ", ".join(f"{k} x{v}" for k, v in res.fused.items() if v) or "none"
    return res.gm, f"passes: {res.nodes_before} -> {res.nodes_after} nodes; fused ops: {fused}"


@dataclass
class FxExecutor:
    """Runs the (optimized) GraphModule as is: no placement, no arena."""

    quantize: str = "none"
    group_size: int = 128
    name: str = "fx"

    def __post_init__(self) -> None:
        _check_quant(self.quantize, self.group_size)
        if self.quantize != "none":
            self.name = f"fx+{self.quantize}"

    def build(self, gm: torch.fx.GraphModule, inputs: tuple, label: str, optimize: bool) -> Built:
        t0 = time.perf_counter()
        notes = []
        if optimize:
            gm, note = _passes(gm, inputs)
            notes.append(note)
        if self.quantize != "none":
            gm, note = _quantize(gm, self.quantize, self.group_size)
            notes.append(note)
        t1 = time.perf_counter()

        def run(*args: torch.Tensor) -> Sequence[torch.Tensor]:
            with torch.no_grad():
                return gm(*args)

        notes.append("executor: torch.fx GraphModule (eager ATen calls)")
        return Built(run, t1 - t0, 0.0, len(gm.graph.nodes), notes)


@dataclass
class Placed:
    """What a placed program is made of: the compile result, its partitions, their compiled backends."""

    compiled: Any  # hetforge.compile.CompileResult (build=False: the scheduled Program, placement, memory plan)
    partitions: Any  # hetforge.backends.partition.PartitionedGraph
    exe: Any  # hetforge.hetero.runner.HeteroExecutable
    build: Any  # hetforge.hetero.runner.BuildReport
    last: Any = None  # RunReport of the latest call

    def to_dict(self) -> dict[str, Any]:
        pg = self.partitions
        return {"partitions": [{"index": p.index, "device": p.device, "nodes": len(p.nodes),
                                "backend": self.exe.bindings[p.device].spec} for p in pg.partitions],
                "switches": pg.switches, "strategy": getattr(self.compiled.placement, "strategy", None),
                "objective": getattr(self.compiled.placement, "objective", None),
                "instructions_by_device": program_summary(self.compiled)[1]}


@dataclass
class PlacedExecutor:
    """The one execution path: hetforge.compile for an SoC with a placement strategy, cut into same-device
    partitions, each compiled on its device's backend (the CPU executor, OpenVINO, CUDA, or an emulated
    device enforcing its constraints) and run partition by partition with explicit transfers.

    A single-device plan is one partition on one backend: the same runner, no second path.
    """

    soc: Any = "host"  # a name, a path or a SocProfile
    strategy: str = "rules"
    objective: str = "energy"
    quantize: str = "none"
    group_size: int = 128
    backends: dict[str, str] = field(default_factory=dict)  # device → backend spec overrides
    policy: str = "exact"
    name: str = "backend"

    def __post_init__(self) -> None:
        from hetforge.backends.mapping import resolve
        from hetforge.hardware import load_soc
        from hetforge.placement import check_strategy
        from hetforge.placement.costs import check_objective

        _check_quant(self.quantize, self.group_size)
        self.soc_profile = load_soc(self.soc) if isinstance(self.soc, str) else self.soc
        base, _, self.device = self.strategy.partition(":")  # "single:gpu" = everything on one named device
        if self.device:
            if base != "single":
                raise UsageError(f"strategy '{self.strategy}': only 'single' takes a device (single:DEVICE)")
            self.soc_profile.device(self.device)  # names the SoC's devices when unknown
        check_strategy(base)
        self.base_strategy = base
        check_objective(self.objective)
        self.bindings = resolve(self.soc_profile, self.backends, self.policy)
        if self.quantize != "none":
            self.name = f"backend+{self.quantize}"

    def options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {} if self.base_strategy == "support" else {"objective": self.objective}
        if self.device:
            opts["device"] = self.device
        return opts

    def place(self, gm: torch.fx.GraphModule, inputs: tuple, label: str, optimize: bool, placement: Any = None,
              expand: Any = None):
        """Passes → quantization → placement (the strategy, or ``placement`` as given) → lower → schedule →
        memory plan (no arenas: each partition's backend builds its own). ``expand``: ``gm`` is a two-layer
        capture whose other layers are stamped out after the passes (``compile_graph``)."""
        from hetforge.compile import compile_graph

        return compile_graph(gm, soc=self.soc_profile, strategy=self.base_strategy, strategy_options=self.options(),
                             example_inputs=inputs, passes=optimize, name=label, quantize=self.quantize,
                             group_size=self.group_size, build=False, placement=placement, expand=expand)

    def build(self, gm: torch.fx.GraphModule, inputs: tuple, label: str, optimize: bool, expand: Any = None,
              step: StepBinding | None = None) -> Built:
        return self.build_program(self.place(gm, inputs, label, optimize, expand=expand), step=step)

    def build_program(self, res, built: tuple[Any, Any, Any] | None = None, step: StepBinding | None = None) -> Built:
        """Partition a compiled (scheduled) program and compile each partition on its device's backend;
        ``built``: the partitions, executable and build report made already (a compile-cache hit, bound to ``step``
        there); ``step``: the program is a decode step (:class:`StepBinding`)."""
        t0 = time.perf_counter()
        if built is None:
            from hetforge.hetero.program import partition_program
            from hetforge.hetero.runner import build

            pg = partition_program(res.program)
            for part in pg.partitions:
                part.reuse_outputs, part.pinned = bind_partition(step, self.bindings[part.device].backend,
                                                                 pg.graph_inputs, part.inputs)
            exe, breport = build(pg, self.soc_profile, self.bindings, getattr(res, "partition_costs", None))
        else:
            pg, exe, breport = built
        placed = Placed(res, pg, exe, breport)
        copy_aliased = step is None  # a step's caller takes its outputs before the next call

        def call(*args: torch.Tensor) -> Sequence[torch.Tensor]:
            with torch.no_grad():
                out, placed.last = exe.run(args, copy_aliased=copy_aliased)
            return out

        devs = ", ".join(f"{p.device}:{self.bindings[p.device].spec}" for p in pg.partitions)
        instrs, by_device, memory = program_summary(res)
        notes = [f"executor: {len(pg.partitions)} partition(s) on soc '{self.soc_profile.name}' "
                 f"(strategy {self.strategy}), {instrs} instructions, devices {by_device}; partitions {devs}",
                 f"memory plan: {memory}"]
        quant = res.extra.get("quantize")
        if quant is not None:
            notes.append(f"quantization: {quant.report.summary_line()}")
        if res.optimized is not None:
            fused = ", ".join(f"{k} x{v}" for k, v in res.optimized.fused.items() if v) or "none"
            notes.insert(0, f"passes: {res.optimized.nodes_before} -> {res.optimized.nodes_after} nodes; "
                            f"fused ops: {fused}")
        for row in breport.partitions:
            notes += [f"p{row['partition']} ({row['device']}): {n}" for n in row["notes"]]
        secs = res.seconds
        passes_s = secs.get("passes", 0.0)
        compile_s = secs.get("total", 0.0) - passes_s + time.perf_counter() - t0
        return Built(call, passes_s, compile_s, len(res.gm.graph.nodes), notes, placed)


def program_summary(res: Any) -> tuple[int, dict[str, int], dict[str, Any]]:
    """Instruction count, instructions per device and memory-plan figures of a compile result (a compile-cache
    hit carries them as stored, without rebuilding the whole program)."""
    got = getattr(res, "cached_summary", None)
    if got is not None:
        return got
    return len(res.program.instrs), res.program.count_by_device(), res.memory.to_dict()


EXECUTORS = ("auto", "fx", "backend")


def make_executor(kind: str = "auto", soc: Any = "host", quantize: str = "none", group_size: int = 128,
                  strategy: str = "rules", objective: str = "energy", backends: dict[str, str] | None = None,
                  policy: str = "exact") -> Executor:
    """Build the executor called ``kind``: ``backend`` (= ``auto``) places and partitions for ``soc``;
    ``fx`` runs the optimized GraphModule itself (the reference). Both quantize every linear's weights with
    ``quantize`` (``none``, ``w8``, ``w4``, ``w8a8``)."""
    if kind not in EXECUTORS:
        raise UsageError(f"unknown executor '{kind}'; allowed: {', '.join(EXECUTORS)}")
    if kind == "fx":
        return FxExecutor(quantize=quantize, group_size=group_size)
    return PlacedExecutor(soc=soc, strategy=strategy, objective=objective, quantize=quantize,
                          group_size=group_size, backends=dict(backends or {}), policy=policy)
