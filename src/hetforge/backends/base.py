"""The one backend interface: compile a partition, run it, report the measured time.

A :class:`Backend` turns a :class:`~hetforge.backends.partition.Partition` into a :class:`CompiledPartition`;
``CompiledPartition.run(args)`` returns the outputs and the measured wall time of that one call (seconds,
``time.perf_counter``; CUDA synchronizes before reading the clock). ``memory`` names where a backend's
tensors live (``host`` or ``cuda:N``): the runner copies a value only when producer and consumer live in
different memories or the SoC link between their devices is not unified.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hetforge.errors import HetforgeError

if TYPE_CHECKING:
    from hetforge.backends.partition import Partition

PEERS_HINT = "pip install -e .[peers]"


class BackendUnavailable(HetforgeError):
    """A backend the plan needs is not installed or its device is absent (exit 1)."""


class ConstraintViolation(HetforgeError):
    """A partition breaks a constraint of the (emulated) device it is placed on (exit 1)."""


@dataclass
class CompileReport:
    """What compiling one partition did: measured seconds and notes (decompositions, precision, ...)."""

    backend: str
    target: str  # "torch CPU", "OpenVINO CPU plugin", "cuda:0", ...
    seconds: float  # measured
    notes: list[str] = field(default_factory=list)
    modeled: dict[str, float] = field(default_factory=dict)  # emulated devices: time_s, energy_j (modeled)


class CompiledPartition(ABC):
    """A partition ready to run on one backend."""

    backend: str
    memory: str = "host"
    outputs_alias: bool = False  # outputs live in a buffer the next call overwrites (OpenVINO share_outputs)
    report: CompileReport

    @abstractmethod
    def run(self, args: Sequence[Any]) -> tuple[list[Any], float]:
        """Run once on ``args`` (already in this backend's memory); return (outputs, measured seconds)."""

    def modeled(self) -> dict[str, float]:
        """Modeled time/energy of one call on the device it stands for ({} when not modeled)."""
        return dict(self.report.modeled)


class Backend(ABC):
    """A way to run partitions: torch-cpu, torch-cuda, openvino:<plugin>, emulated:<stand-in>."""

    name: str
    memory: str = "host"
    binds_steps: bool = False  # compile() honours a partition's reuse_outputs and pinned inputs

    @abstractmethod
    def check_available(self) -> None:
        """Raise :class:`BackendUnavailable` (with how to get it) when this backend cannot run here."""

    @abstractmethod
    def compile(self, part: Partition) -> CompiledPartition:
        """Compile one partition; raises ConstraintViolation / BackendUnavailable / HetforgeError."""

    def to_memory(self, t: torch.Tensor) -> torch.Tensor:
        """Move ``t`` into this backend's memory (a real copy when it is elsewhere)."""
        return t if t.device.type == "cpu" else t.cpu()

    def describe(self) -> str:
        return self.name

    def fork_refusal(self) -> str | None:
        """Why a ``fork()``-ed child of this process could not compile on this backend (e.g. worker threads a
        runtime started here, which ``fork`` does not copy); None where it can."""
        return None


def example_args(part: Partition) -> list[Any]:
    """Concrete example inputs built from the placeholders' fake values (zeros; shapes/dtypes exact)."""
    out = []
    for v in part.input_metas():
        if isinstance(v, torch.Tensor):
            out.append(torch.zeros(tuple(int(s) for s in v.shape), dtype=v.dtype))
        else:
            out.append(v)
    return out
