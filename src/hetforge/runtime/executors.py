"""Pluggable program executors: how a captured graph becomes something to call.

* ``backend`` — hetforge's own compile pipeline (``hetforge.compile.compile_graph``: passes, placement
  for a SoC profile, lowering, scheduling, liveness memory plan, arena codegen). The default.
* ``fx`` — run the optimization passes (when installed) and call the ``torch.fx.GraphModule``
  directly. The fallback when the backend is not installed, and a reference.

``auto`` picks ``backend`` when it can be imported and ``fx`` otherwise; the chosen name is reported
with every result so output always says which one ran.

Either executor can quantize the weights of every linear after the passes (``quantize`` = ``w8`` /
``w4`` / ``w8a8``; ``hetforge.quant``), so prefill and decode programs run the int8/int4 kernels; the
scheme is part of the executor's name in every result (e.g. ``backend+w8a8``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

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
    try:
        from hetforge.passes import optimize
    except ImportError:
        return gm, "passes: hetforge.passes not installed, graph left as captured"
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


def backend_available() -> bool:
    try:
        from hetforge.compile import compile_graph  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class BackendExecutor:
    """hetforge.compile for one SoC profile; runs the generated arena program (``run_flat``)."""

    soc: str = "host"
    mode: str = "arena"
    quantize: str = "none"
    group_size: int = 128
    name: str = "backend"

    def __post_init__(self) -> None:
        _check_quant(self.quantize, self.group_size)
        if self.quantize != "none":
            self.name = f"backend+{self.quantize}"

    def build(self, gm: torch.fx.GraphModule, inputs: tuple, label: str, optimize: bool) -> Built:
        from hetforge.compile import compile_graph

        res = compile_graph(gm, soc=self.soc, example_inputs=inputs, passes=optimize, name=label, mode=self.mode,
                            quantize=self.quantize, group_size=self.group_size)
        exe = res.executable
        secs = res.seconds
        mem = res.memory.to_dict()
        run = exe.run_flat

        def call(*args: torch.Tensor) -> Sequence[torch.Tensor]:
            with torch.no_grad():
                return run(*args)

        notes = [f"executor: hetforge.compile ({self.mode}) for soc '{getattr(res.soc, 'name', self.soc)}', "
                 f"{len(res.program.instrs)} instructions, devices {res.program.count_by_device()}",
                 f"memory plan: {mem}"]
        quant = res.extra.get("quantize")
        if quant is not None:
            notes.append(f"quantization: {quant.report.summary_line()}")
        if res.optimized is not None:
            fused = ", ".join(f"{k} x{v}" for k, v in res.optimized.fused.items() if v) or "none"
            notes.insert(0, f"passes: {res.optimized.nodes_before} -> {res.optimized.nodes_after} nodes; "
                            f"fused ops: {fused}")
        passes_s = secs.get("passes", 0.0)
        return Built(call, passes_s, secs.get("total", 0.0) - passes_s, len(res.gm.graph.nodes), notes)


EXECUTORS = ("auto", "fx", "backend")


def make_executor(kind: str = "auto", soc: str = "host", quantize: str = "none", group_size: int = 128) -> Executor:
    """Build the executor called ``kind`` (``auto`` prefers the backend when installed), quantizing the
    linears' weights with ``quantize`` (``none``, ``w8``, ``w4``, ``w8a8``)."""
    if kind not in EXECUTORS:
        raise UsageError(f"unknown executor '{kind}'; allowed: {', '.join(EXECUTORS)}")
    if kind == "auto":
        kind = "backend" if backend_available() else "fx"
    if kind == "backend":
        if not backend_available():
            raise UsageError("executor 'backend' needs hetforge.compile, which is not installed; use 'fx'")
        return BackendExecutor(soc=soc, quantize=quantize, group_size=group_size)
    return FxExecutor(quantize=quantize, group_size=group_size)
