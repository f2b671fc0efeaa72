"""``torch-cpu``: run a partition with PyTorch on the host CPU (measured).

Two engines: ``executor`` (default) lowers the partition to the backend's register IR and runs it with
:class:`hetforge.executor.Executable` (straight-line code over a planned arena; ``lower`` → ``plan_memory``);
``fx`` calls the partition's GraphModule eagerly (the reference path).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from hetforge.backends.base import Backend, CompiledPartition, CompileReport
from hetforge.backends.partition import Partition
from hetforge.errors import UsageError


class TorchCompiled(CompiledPartition):
    """A partition GraphModule run eagerly (each ATen node one PyTorch call)."""

    def __init__(self, backend: str, fn, report: CompileReport, memory: str = "host", sync=None):
        self.backend = backend
        self.fn = fn
        self.report = report
        self.memory = memory
        self._sync = sync
        self.executable: Any = None  # the hetforge Executable behind ``fn`` (engine ``executor``), else None

    def run(self, args: Sequence[Any]) -> tuple[list[Any], float]:
        if self._sync is not None:
            self._sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.fn(*args)
        if self._sync is not None:
            self._sync()
        return list(out), time.perf_counter() - t0


ENGINES = ("executor", "fx")


class TorchCpuBackend(Backend):
    """PyTorch on the host CPU, through hetforge's executor (default) or the eager GraphModule."""

    memory = "host"

    def __init__(self, engine: str = "executor"):
        if engine not in ENGINES:
            raise UsageError(f"unknown torch-cpu engine '{engine}'; allowed: {', '.join(ENGINES)}")
        self.engine = engine
        self.name = "torch-cpu" if engine == "executor" else "torch-cpu:fx"
        self.binds_steps = engine == "executor"

    def check_available(self) -> None:
        return None

    def compile(self, part: Partition) -> CompiledPartition:
        t0 = time.perf_counter()
        if self.engine == "fx":
            part.gm.recompile()
            report = CompileReport(self.name, "torch CPU (eager GraphModule)", time.perf_counter() - t0)
            return TorchCompiled(self.name, part.gm, report)
        from hetforge.lower import lower
        from hetforge.memplan import plan_memory

        prog = lower(part.gm, None, None, name=part.name).program
        return self.executable(prog, plan_memory(prog), t0, part.reuse_outputs, part.pinned)

    def executable(self, prog: Any, plan: Any, t0: float, reuse_outputs: bool = False,
                   pinned: dict[int, torch.Tensor] | None = None) -> TorchCompiled:
        """A lowered partition program and its memory plan as a compiled partition on hetforge's executor (the
        compile cache calls this with a stored program, skipping the lowering above); ``reuse_outputs`` and
        ``pinned``: a step program's binding (:class:`hetforge.executor.Executable`)."""
        from hetforge.executor import Executable

        exe = Executable(prog, plan, {d: torch.device("cpu") for d in prog.devices}, mode="arena",
                         reuse_outputs=reuse_outputs, pinned=pinned)
        arena = sum(exe.arena_bytes().values())
        notes = [f"executor: {len(prog.instrs)} instructions, arena {arena / 2**20:.2f} MiB"]
        if exe.stats.call_lists:
            notes.append(f"executor: {exe.stats.listed_calls} native calls run as {exe.stats.call_lists} call "
                         "list(s) (executor.calllist)")
        if reuse_outputs or pinned:
            notes.append(f"executor: bound as a step (outputs in its own memory, overwritten by the next call; "
                         f"{len(pinned or {})} input(s) pinned to the caller's tensors)")
        report = CompileReport(self.name, "torch CPU (hetforge executor)", time.perf_counter() - t0, notes)
        out = TorchCompiled(self.name, exe.run_flat, report)
        out.executable = exe  # what the compile cache stores (the lowered, kernel-chosen program)
        out.outputs_alias = reuse_outputs
        return out
