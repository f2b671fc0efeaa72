"""Device failure during generation: how a fault is injected, detected and checked for recoverability.

A *fault* makes a device stop answering: every partition of a compiled program that runs on it raises
:class:`DeviceFault` when called (``inject_fault`` swaps the partition's compiled backend for a dead one, so the
failure happens inside the real heterogeneous runner, mid-step, after the earlier partitions already ran).
The generation loop (:mod:`hetforge.runtime.replan`) catches it, re-plans the remaining work onto the surviving
devices (a program compiled for the SoC without the failed device — cached ahead of time), and runs the failed
step again: the KV cache lives in host buffers that a step only writes after its program returns, so nothing of
it is lost and the tokens equal a run without the fault.

When no surviving device can run an op of the program, :func:`check_coverage` raises :class:`FailoverError`
naming the op; the generation keeps the tokens it made so far (``FailoverError.result``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hetforge.errors import HetforgeError, UsageError


class DeviceFault(RuntimeError):
    """A device stopped answering (raised by a dead partition inside the runner)."""

    def __init__(self, device: str):
        super().__init__(f"device '{device}' failed")
        self.device = device


class FailoverError(HetforgeError):
    """The work of a failed device cannot be moved (exit 1); ``result`` holds what was generated so far."""

    def __init__(self, message: str, result: Any = None):
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class FaultSpec:
    """``DEVICE@TOKEN``: ``device`` fails while the ``token``-th new token (1-based) is being computed."""

    device: str
    token: int

    def __str__(self) -> str:
        return f"{self.device}@{self.token}"


def parse_fault(text: str, devices: Sequence[str]) -> FaultSpec:
    """Parse ``DEVICE@TOKEN`` (usage error naming the form, the SoC's devices or the range when wrong)."""
    m = re.fullmatch(r"([a-z][a-z0-9_-]*)@(-?\d+)", text.strip())
    if m is None:
        raise UsageError(f"--inject-fault '{text}': expected DEVICE@TOKEN, e.g. gpu@3 (devices: {', '.join(devices)})")
    dev, tok = m.group(1), int(m.group(2))
    if dev not in devices:
        raise UsageError(f"--inject-fault '{text}': unknown device '{dev}'; devices: {', '.join(devices)}")
    if tok < 1:
        raise UsageError(f"--inject-fault '{text}': TOKEN must be >= 1 (token 1 is made by prefill), got {tok}")
    return FaultSpec(dev, tok)


class _Dead:
    """A compiled partition whose device has failed: every call raises :class:`DeviceFault`."""

    def __init__(self, inner, device: str):
        self.inner, self.device = inner, device
        self.backend = inner.backend
        self.memory = inner.memory
        self.outputs_alias = inner.outputs_alias
        self.report = inner.report

    def run(self, args):
        raise DeviceFault(self.device)


def inject_fault(program, device: str) -> int:
    """Make every partition of ``program`` (a runtime Program with a placed executable) that runs on ``device``
    fail from now on; returns how many partitions were killed (0: the program does not use the device)."""
    placed = getattr(program, "placed", None)
    if placed is None:
        return 0
    exe, n = placed.exe, 0
    for i, part in enumerate(placed.partitions.partitions):
        if part.device == device and not isinstance(exe.compiled[i], _Dead):
            exe.compiled[i] = _Dead(exe.compiled[i], device)
            n += 1
    return n


def revive(program, device: str | None = None) -> int:
    """Undo :func:`inject_fault`: the device (every device when ``None``) answers again (a device that came back,
    or the next repetition of a benchmark); returns how many partitions were revived."""
    placed = getattr(program, "placed", None)
    if placed is None:
        return 0
    exe, n = placed.exe, 0
    for i, comp in enumerate(exe.compiled):
        if isinstance(comp, _Dead) and (device is None or comp.device == device):
            exe.compiled[i] = comp.inner
            n += 1
    return n


def uses_device(program, device: str) -> bool:
    placed = getattr(program, "placed", None)
    return placed is not None and any(p.device == device for p in placed.partitions.partitions)


def check_coverage(program, soc, failed, label: str) -> None:
    """Raise :class:`FailoverError` when an op of ``program`` can run on no device of ``soc`` outside ``failed``;
    the message names the op, the node and which devices could have run it. Read from the program's
    instructions (each records its graph node), so a program from the compile cache, which keeps no graph,
    is checked the same way."""
    from hetforge.ir.program import TRANSFER

    placed = getattr(program, "placed", None)
    if placed is None:
        return
    alive = [d for d in soc.devices if d.name not in failed]
    seen: set[str] = set()
    for ins in placed.compiled.program.instrs:
        node = ins.attrs.get("node")
        if ins.kind == TRANSFER or node is None or node in seen:
            continue
        seen.add(node)
        op = ins.op
        if not any(d.supports(op) for d in alive):
            able = [d.name for d in soc.devices if d.supports(op)]
            raise FailoverError(f"device '{'+'.join(sorted(failed))}' failed during {label} and no surviving device "
                                f"({', '.join(d.name for d in alive) or 'none'}) can run op {op} (node {node}; "
                                f"only {', '.join(able) or 'no device'} can)")
