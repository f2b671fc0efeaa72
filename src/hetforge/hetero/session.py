"""One heterogeneous run end to end: bind backends, compile partitions, run (warm-up + timed repeats), verify
against eager, optionally write a Chrome trace. Shared by ``hetforge run-plan``, ``hetforge hetero`` and
``bench/hetero.py``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetforge.backends.mapping import Binding
from hetforge.backends.partition import PartitionedGraph
from hetforge.hetero.runner import BuildReport, HeteroExecutable, RunReport, build
from hetforge.trace import Trace
from hetforge.verify import FidelityReport, compare_logits

KL_OPENVINO = 1e-6  # OpenVINO at f32 vs eager
KL_TORCH = 1e-8  # PyTorch backends only


def kl_threshold(bindings: dict[str, Binding], used: list[str]) -> float:
    """1e-6 when any used device runs on OpenVINO (f32), else 1e-8."""
    return KL_OPENVINO if any("openvino" in bindings[d].spec for d in used) else KL_TORCH


@dataclass
class HeteroResult:
    """Everything one run-plan produced: build report, timed runs, fidelity, and the trace path if written."""

    build: BuildReport
    runs: list[RunReport]
    fidelity: FidelityReport | None
    bindings: dict[str, Binding]
    partitions: PartitionedGraph
    trace_path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> RunReport:
        walls = sorted(self.runs, key=lambda r: r.wall_s)
        return walls[len(walls) // 2]

    def to_dict(self) -> dict[str, Any]:
        walls = [r.wall_s for r in self.runs]
        return {
            "bindings": {d: b.to_dict() for d, b in self.bindings.items()},
            "partitions": len(self.partitions.partitions),
            "switches": self.median.switches,
            "build": self.build.to_dict(),
            "latency_measured_s": {"median": statistics.median(walls), "min": min(walls), "repeats": len(walls)},
            "median_run": self.median.to_dict(),
            "fidelity": self.fidelity.to_dict() if self.fidelity else None,
            "trace": str(self.trace_path) if self.trace_path else None,
            "fixups": self.partitions.fixups,
            **self.extra,
        }


def execute(pg: PartitionedGraph, soc, bindings: dict[str, Binding], inputs: tuple, eager: Callable | None = None,
            repeat: int = 5, warmup: int = 1, trace_path: str | Path | None = None) -> HeteroResult:
    """Compile and run ``pg``: ``warmup`` untimed runs, ``repeat`` timed ones; compare with ``eager`` if given."""
    import torch

    exe, breport = build(pg, soc, bindings)
    out = None
    for _ in range(max(warmup, 0)):
        out, _ = exe.run(inputs)
    runs: list[RunReport] = []
    for _ in range(max(repeat, 1)):
        out, rep = exe.run(inputs)
        runs.append(rep)
    fidelity = None
    if eager is not None:
        with torch.no_grad():
            ref = eager(*inputs)
        fidelity = compare_logits(ref, out, kl_threshold=kl_threshold(bindings, pg.devices()))
    result = HeteroResult(breport, runs, fidelity, bindings, pg)
    if trace_path is not None:
        result.trace_path = write_trace(exe, result, soc, trace_path)
    return result


def write_trace(exe: HeteroExecutable, result: HeteroResult, soc, path: str | Path) -> Path:
    """Write the median timed run as a Chrome trace (measured and modeled lanes kept apart)."""
    from hetforge.hetero.runner import record_trace

    tr = Trace(title=f"hetforge run on {soc.name}")
    tr.metadata.update({
        "soc": soc.name,
        "bindings": {d: b.spec for d, b in result.bindings.items()},
        "note": "process 'measured' = wall time on this host; process 'modeled' = cost-model prediction for the SoC",
    })
    record_trace(tr, result.median)
    return tr.write(path)
