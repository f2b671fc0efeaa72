"""Chrome-trace (Trace Event Format) writer: open the file in Perfetto (ui.perfetto.dev) or chrome://tracing.

Measured and modeled timelines are kept in separate *processes* so they never share a lane: process 1 is
"measured (this host)", process 2 "modeled (<soc> cost model)". Each device gets one lane (thread) in each;
transfers get their own lane, device switches are instant events on a "switches" lane. Every event carries
``args.figure = "measured" | "modeled"``. Times are in microseconds, as the format requires.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetforge.files import write_json

MEASURED, MODELED = "measured", "modeled"


@dataclass
class Trace:
    """Collects trace events; :meth:`write` saves them atomically."""

    title: str = "hetforge"
    processes: dict[str, int] = field(default_factory=dict)
    lanes: dict[tuple[str, str], int] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    def _pid(self, process: str) -> int:
        if process not in self.processes:
            pid = len(self.processes) + 1
            self.processes[process] = pid
            self.events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}})
            self.events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                                "args": {"sort_index": pid}})
        return self.processes[process]

    def lane(self, process: str, lane: str) -> tuple[int, int]:
        """(pid, tid) of a lane, created (with its name) on first use."""
        pid = self._pid(process)
        key = (process, lane)
        if key not in self.lanes:
            tid = sum(1 for p, _ in self.lanes if p == process) + 1
            self.lanes[key] = tid
            self.events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
            self.events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                                "args": {"sort_index": tid}})
        return pid, self.lanes[key]

    def span(self, process: str, lane: str, name: str, start_s: float, dur_s: float, figure: str,
             cat: str = "call", **args: Any) -> None:
        """A complete event ("X") of ``dur_s`` seconds starting ``start_s`` seconds after the trace origin."""
        pid, tid = self.lane(process, lane)
        self.events.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid,
                            "ts": round(start_s * 1e6, 3), "dur": round(max(dur_s, 0.0) * 1e6, 3),
                            "args": {"figure": figure, **args}})

    def instant(self, process: str, lane: str, name: str, at_s: float, figure: str, cat: str = "switch",
                **args: Any) -> None:
        pid, tid = self.lane(process, lane)
        self.events.append({"ph": "i", "s": "t", "name": name, "cat": cat, "pid": pid, "tid": tid,
                            "ts": round(at_s * 1e6, 3), "args": {"figure": figure, **args}})

    def flow(self, process: str, src_lane: str, dst_lane: str, name: str, start_s: float, end_s: float, flow_id: int,
             figure: str, **args: Any) -> None:
        """A transfer: a span on the ``transfers`` lane plus a flow arrow from ``src_lane`` (at ``start_s``) to
        ``dst_lane`` (at ``end_s``)."""
        self.span(process, "transfers", name, start_s, end_s - start_s, figure, "transfer", **args)
        for ph, lane, at in (("s", src_lane, start_s), ("f", dst_lane, end_s)):
            pid, tid = self.lane(process, lane)
            ev = {"ph": ph, "id": flow_id, "name": name, "cat": "transfer", "pid": pid, "tid": tid,
                  "ts": round(at * 1e6, 3), "args": {"figure": figure}}
            if ph == "f":
                ev["bp"] = "e"
            self.events.append(ev)

    def to_dict(self) -> dict[str, Any]:
        return {"traceEvents": self.events, "displayTimeUnit": "ms",
                "otherData": {"title": self.title, **self.metadata}}

    def write(self, path: str | Path, what: str = "") -> Path:
        """Write the trace JSON to ``path`` atomically (never a half-written file; see :mod:`hetforge.files`)."""
        path = Path(path)
        with contextlib.suppress(OSError):  # a folder that cannot be made is reported by write_json, in one line
            path.parent.mkdir(parents=True, exist_ok=True)
        return write_json(path, self.to_dict(), what)
