"""Per-token accounting of a generation on placed programs: measured here, modeled for the SoC.

Every prefill/decode call of a placed program leaves a :class:`~hetforge.hetero.runner.RunReport`
(measured call and transfer times on this host; modeled ones from the cost model). The ledger keeps them
with the call's start time and turns them into

* **modeled** figures for the SoC — per step, the list schedule of :mod:`hetforge.hetero.timeline`
  (devices overlap where the partition DAG allows; device switches cost what the profile says): latency,
  energy, per device busy time and energy, switches, transfers and bytes moved;
* **measured** host overheads of the heterogeneous runner — time spent in transfers (real copies standing
  in for the SoC's links) and between calls.

and, on request, a Perfetto/Chrome trace of the whole generation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

from hetforge.hetero.runner import RunReport, record_trace
from hetforge.hetero.timeline import Timeline
from hetforge.trace import Trace


@dataclass
class Step:
    kind: str  # "prefill" | "decode" | "verify"
    start_s: float  # measured: from the generation's start
    report: RunReport
    placed: Any  # runtime.executors.Placed

    @property
    def timeline(self) -> Timeline:
        return self.report.timeline()


def _step_figures(step: Step) -> dict[str, Any]:
    tl, rep = step.timeline, step.report
    copies = [t for t in rep.transfers if t.mode == "copy"]
    return {
        "modeled_ms": 1e3 * tl.makespan_s, "modeled_mj": 1e3 * tl.energy_j,
        "modeled_serial_ms": 1e3 * tl.serial_s, "modeled_switch_ms": 1e3 * tl.switch_s,
        "modeled_bottleneck_ms": 1e3 * tl.bottleneck_s,  # pipelined period: the most loaded device
        "switches": tl.switches, "transfers": len(rep.transfers), "zero_copy": len(rep.transfers) - len(copies),
        "bytes_moved": sum(t.nbytes for t in copies),
        "by_device": {d: {"modeled_ms": 1e3 * v["busy_s"], "modeled_mj": 1e3 * v["energy_j"]}
                      for d, v in tl.by_device().items()},
        "measured_transfer_ms": 1e3 * sum(t.measured_s for t in rep.transfers),
        "measured_calls_ms": 1e3 * sum(c.measured_s for c in rep.calls),
        "measured_wall_ms": 1e3 * rep.wall_s,
    }


def _mean(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in rows[0].items():
        if isinstance(v, dict):
            out[k] = {d: _mean([r[k].get(d, dict.fromkeys(v[d], 0.0)) for r in rows]) for d in v}
        else:
            out[k] = fmean(r[k] for r in rows)
    return out


@dataclass
class Ledger:
    """The placed calls of one generation, in order."""

    soc: str
    steps: list[Step] = field(default_factory=list)

    def add(self, kind: str, start_s: float, placed) -> None:
        if placed is not None and placed.last is not None:
            self.steps.append(Step(kind, start_s, placed.last, placed))

    def summary(self) -> dict[str, Any] | None:
        """Modeled (SoC) and measured (host) figures: prefill once, decode as a mean per token."""
        if not self.steps:
            return None
        pre = [_step_figures(s) for s in self.steps if s.kind == "prefill"]
        dec = [_step_figures(s) for s in self.steps if s.kind == "decode"]
        out: dict[str, Any] = {
            "soc": self.soc,
            "labels": {"modeled_*": "modeled (cost model of the SoC, list-scheduled timeline)",
                       "measured_*": "measured (this host, the stand-in backends)",
                       "switches/transfers/bytes_moved": "counted on the run"},
            "prefill": pre[0] if pre else None,
            "decode_per_token": _mean(dec) if dec else None,
            "decode_tokens": len(dec),
        }
        ver = [_step_figures(s) for s in self.steps if s.kind == "verify"]
        if ver:  # the self-verification pass over the candidates (runtime.verify)
            out["verify"] = {"calls": len(ver), "modeled_mj": sum(v["modeled_mj"] for v in ver),
                             "modeled_ms": sum(v["modeled_ms"] for v in ver)}
        last = self.steps[-1].placed
        out["partitions"] = {s.kind: s.placed.to_dict() for s in self.steps[:1] + self.steps[-1:]}
        out["bindings"] = {d: b.to_dict() for d, b in last.exe.bindings.items()}
        return out

    def trace(self, path: str | Path, title: str = "hetforge generation") -> Path:
        """A Chrome/Perfetto trace of the whole generation: measured lanes (this host, at real times) and
        modeled lanes (each step's list schedule, steps back to back), one lane per device, switches, and
        transfers as flows from the producing device's lane to the consuming one."""
        tr = Trace(title)
        cursor = 0.0
        for k, step in enumerate(self.steps):
            label = f"{step.kind} {k}" if step.kind != "prefill" else "prefill"
            cursor = record_trace(tr, step.report, step.start_s, cursor, label)
        tr.metadata["soc"] = self.soc
        return tr.write(path)
