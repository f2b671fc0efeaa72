"""Run-time re-placement: programs cached per situation, switched to when the situation changes.

The routing note places once and keeps that plan; here the runtime keeps one set of placed programs per
*situation* (:class:`~hetforge.hardware.situation.Situation`: failed devices, device temperatures and
throttled clocks, load from other work) and, before every step, asks which situation holds now. When it
differs from the one the current program was placed for, the step runs on the program placed for the new
situation (compiled on first need, or ahead of time) and the switch is logged with its reason. A prompt that
lands in another prefill tier than the previous request's is logged the same way. The KV cache is a set of host
buffers passed to every decode program as inputs, so a switch carries it over unchanged.

Device failure (:mod:`hetforge.runtime.failover`) is one more situation change, detected when a step raises
:class:`~hetforge.runtime.failover.DeviceFault`: the failed step is run again on the survivors' program
(compiled ahead of time for every single-device failure of the devices the request's programs use, when
``prepare_failover`` is on) and the time from the fault to the step's result is the measured recovery time.

Where the situation comes from: ``changes`` scheduled at given tokens (``--set-load gpu=0.5@10``,
``--set-temp gpu=90@4``) stand in for the load and temperature sensors a deployed runtime would read; this host
has none. Temperatures are binned to 5 °C (only above the device's Φ reference, below it Φ = 1 and the plan
cannot change), loads to 0.25, so a small drift does not recompile.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hetforge.errors import UsageError
from hetforge.hardware.situation import Situation, situated_soc
from hetforge.runtime.engine import Engine, Generation
from hetforge.runtime.failover import DeviceFault, FailoverError, FaultSpec, check_coverage, inject_fault, uses_device
from hetforge.runtime.programs import Program, ProgramCache
from hetforge.runtime.sampling import SamplingParams

TEMP_BIN_C = 5.0
LOAD_BIN = 0.25


@dataclass(frozen=True)
class Change:
    """At the ``token``-th new token (1-based), ``device``'s ``what`` (``load`` or ``temp``) becomes ``value``."""

    token: int
    device: str
    what: str
    value: float


def parse_change(text: str, what: str, devices: Sequence[str]) -> Change:
    """``DEVICE=VALUE[@TOKEN]`` for ``--set-load`` (VALUE in [0, 1)) or ``--set-temp`` (°C, -40..150)."""
    opt = f"--set-{what}"
    m = re.fullmatch(r"([a-z][a-z0-9_-]*)=([-+0-9.eE]+)(?:@(\d+))?", text.strip())
    if m is None:
        raise UsageError(f"{opt} '{text}': expected DEVICE=VALUE[@TOKEN], e.g. gpu=0.5@10 (devices: "
                         f"{', '.join(devices)})")
    dev, tok = m.group(1), int(m.group(3) or 1)
    if dev not in devices:
        raise UsageError(f"{opt} '{text}': unknown device '{dev}'; devices: {', '.join(devices)}")
    try:
        val = float(m.group(2))
    except ValueError:
        raise UsageError(f"{opt} '{text}': '{m.group(2)}' is not a number") from None
    lo, hi, rng = (0.0, 1.0, "[0, 1)") if what == "load" else (-40.0, 150.0, "[-40, 150] °C")
    if not math.isfinite(val) or val < lo or val > hi or (what == "load" and val >= 1.0):
        raise UsageError(f"{opt} '{text}': value {val:g} is out of range; allowed: {rng}")
    if tok < 1:
        raise UsageError(f"{opt} '{text}': TOKEN must be >= 1")
    return Change(tok, dev, what, val)


@dataclass
class SwitchRecord:
    """One change of program at run time (measured seconds to obtain the new program)."""

    request: int
    token: int  # the new token (1-based) whose step ran on the new program
    kind: str  # prefill | decode
    before: str
    after: str
    reason: str
    measured_s: float
    compiled: bool  # the program had to be compiled now (not cached)

    def to_dict(self) -> dict[str, Any]:
        return {"request": self.request, "token": self.token, "kind": self.kind, "before": self.before,
                "after": self.after, "reason": self.reason, "measured_s": self.measured_s,
                "compiled": self.compiled, "timing": "measured"}


@dataclass
class RecoveryRecord:
    """One device failure and what recovering from it took (measured)."""

    request: int
    token: int
    device: str
    kind: str
    recovery_s: float  # from the fault to the failed step's result on the survivors' program
    replan_s: float  # of which: obtaining the survivors' program (cache lookup, or compiling)
    plan_was_cached: bool
    survivors: list[str]
    rerun_s: float = 0.0  # of which: running the failed step again on the survivors' program
    lost_s: float = 0.0  # before the fault: the failed step's work up to the dead partition (thrown away)

    def to_dict(self) -> dict[str, Any]:
        return {"request": self.request, "token": self.token, "device": self.device, "kind": self.kind,
                "recovery_ms": 1e3 * self.recovery_s, "replan_ms": 1e3 * self.replan_s,
                "rerun_ms": 1e3 * self.rerun_s, "lost_ms": 1e3 * self.lost_s,
                "plan_was_cached": self.plan_was_cached, "survivors": self.survivors, "timing": "measured"}


class SituatedPrograms:
    """The engine's programs, one :class:`ProgramCache` per situation (the nominal one is the engine's own)."""

    def __init__(self, engine: Engine):
        ex = engine.executor
        if not hasattr(ex, "soc_profile"):
            raise UsageError("run-time re-placement and failover need the placed executor (executor 'backend')")
        self.engine, self.base = engine, ex
        self.caches: dict[Situation, ProgramCache] = {Situation(): engine.programs}

    @property
    def soc(self):
        return self.base.soc_profile

    def programs(self, sit: Situation) -> ProgramCache:
        if sit not in self.caches:
            from hetforge.runtime.executors import PlacedExecutor

            ex = self.base
            soc = situated_soc(self.soc, sit)
            backends = {d: b for d, b in ex.backends.items() if d not in sit.failed}
            strategy = ex.strategy
            if ex.device and ex.device in sit.failed:
                strategy = "single"  # everything on one device that failed: everything on the survivors' host
            pex = PlacedExecutor(soc=soc, strategy=strategy, objective=ex.objective, quantize=ex.quantize,
                                 group_size=ex.group_size, backends=backends, policy=ex.policy)
            pc = ProgramCache(self.engine.loaded.model, self.engine.loaded.max_positions, pex,
                              optimize=self.engine.programs.optimize)
            pc.caches = self.engine.programs.caches  # the request's KV caches: its decode steps are bound to them
            self.caches[sit] = pc
        return self.caches[sit]

    def cached(self, kind: str, length: int, sit: Situation) -> bool:
        pc = self.caches.get(sit)
        return pc is not None and (kind, length) in pc.programs

    def get(self, kind: str, length: int, sit: Situation) -> tuple[Program, bool]:
        pc = self.programs(sit)
        return pc.prefill(length) if kind == "prefill" else pc.decode(length)

    def all_programs(self) -> list[Program]:
        return [p for pc in self.caches.values() for p in pc.programs.values()]


@dataclass
class Adaptive:
    """Run-time re-placement and failover around an :class:`Engine` (see the module docstring)."""

    engine: Engine
    fault: FaultSpec | None = None
    changes: Sequence[Change] = ()
    prepare_failover: bool | Sequence[str] = True  # True: every used device; or only these devices
    situated: SituatedPrograms | None = None  # programs per situation (shared between Adaptives of one engine)
    switches: list[SwitchRecord] = field(default_factory=list)
    recoveries: list[RecoveryRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    prepare_s: float = 0.0  # measured: compiling failover plans ahead of time

    def __post_init__(self) -> None:
        if self.situated is None:
            self.situated = SituatedPrograms(self.engine)
        elif self.situated.engine is not self.engine:
            raise ValueError("situated programs of another engine")
        names = self.situated.soc.device_names
        for c in self.changes:
            if c.device not in names:
                raise UsageError(f"unknown device '{c.device}'; devices: {', '.join(names)}")
        if self.fault is not None and self.fault.device not in names:
            raise UsageError(f"--inject-fault: unknown device '{self.fault.device}'; devices: {', '.join(names)}")
        self.failed: set[str] = set()
        self.loads: dict[str, float] = {}
        self.temps: dict[str, float] = {}
        self.current: dict[str, Situation] = {}  # kind → situation of the program the last step ran on
        self.requests = 0
        self.last_tier: int | None = None
        self.fault_fired = False

    # ---- the situation -------------------------------------------------------------------------------------
    def situation(self) -> Situation:
        soc = self.situated.soc
        temps: dict[str, float] = {}
        clocks: dict[str, float] = {}
        from hetforge.cost.thermal_rc import thermal_params

        tp = thermal_params(soc) if self.temps else None
        for d, t in self.temps.items():
            if d in self.failed:  # a failed device's readings no longer matter
                continue
            dev = soc.device(d)
            if t > dev.t_ref_c:
                temps[d] = TEMP_BIN_C * math.floor(t / TEMP_BIN_C)
            if tp is not None and t >= tp.devices[d].throttle_c:
                clocks[d] = tp.devices[d].throttled_clock
        loads = {d: LOAD_BIN * math.floor(x / LOAD_BIN) for d, x in self.loads.items() if d not in self.failed}
        return Situation.make(self.failed, temps, clocks, loads)

    def _apply_changes(self, token: int) -> list[str]:
        reasons = []
        for c in self.changes:
            if c.token == token:
                (self.loads if c.what == "load" else self.temps)[c.device] = c.value
                unit = " °C" if c.what == "temp" else ""
                reasons.append(f"{c.device} {c.what} {c.value:g}{unit} at token {token}")
        return reasons

    # ---- one program call ----------------------------------------------------------------------------------
    def _program(self, kind: str, length: int, token: int, reason: str) -> tuple[Program, Situation]:
        sit = self.situation()
        prev = self.current.get(kind)
        t0 = time.perf_counter()
        was = self.situated.cached(kind, length, sit)
        prog, fresh = self.situated.get(kind, length, sit)
        if fresh:
            self.engine_result_compile(kind, length, prog)
        if prev is not None and prev != sit:
            self.switches.append(SwitchRecord(self.requests, token, kind, prev.key(), sit.key(),
                                              reason or "situation changed", time.perf_counter() - t0, not was))
        self.current[kind] = sit
        return prog, sit

    def engine_result_compile(self, kind: str, length: int, prog: Program) -> None:
        gen = getattr(self, "_gen", None)
        if gen is not None:
            gen.result.compile_s[f"{kind}-{length}@{self.situation().key()}"] = prog.total_s

    def call(self, kind: str, length: int, args: tuple, token: int, reason: str = "") -> tuple[Any, Program]:
        """Run the ``kind`` program of ``length`` for the situation now; recover from a device fault."""
        prog, sit = self._program(kind, length, token, reason)
        if self.fault is not None and not self.fault_fired and token >= self.fault.token:
            self.fault_fired = True
            hit = sum(inject_fault(p, self.fault.device) for p in self.situated.all_programs())
            if not uses_device(prog, self.fault.device):
                self.failed.add(self.fault.device)
                self.notes.append(f"fault injected into {self.fault.device} at token {token}: the current {kind} "
                                  f"plan does not use it ({hit} partition(s) of other cached programs killed); "
                                  f"later steps are placed without it")
        ts = time.perf_counter()
        try:
            return prog.run(*args), prog
        except DeviceFault as f:
            t0 = time.perf_counter()
            self.failed.add(f.device)
            check_coverage(prog, self.situated.soc, self.failed, f"{kind} of token {token}")
            new = self.situation()
            was = self.situated.cached(kind, length, new)
            prog2, fresh = self.situated.get(kind, length, new)
            if fresh:
                self.engine_result_compile(kind, length, prog2)
            t1 = time.perf_counter()
            out = prog2.run(*args)
            t2 = time.perf_counter()
            self.recoveries.append(RecoveryRecord(self.requests, token, f.device, kind, t2 - t0, t1 - t0, was,
                                                  [d.name for d in self.situated.soc.devices
                                                   if d.name not in self.failed], t2 - t1, t0 - ts))
            self.switches.append(SwitchRecord(self.requests, token, kind, sit.key(), new.key(),
                                              f"device {f.device} failed", t1 - t0, not was))
            self.current[kind] = new
            return out, prog2

    def prepare(self, tier: int, length: int, decode: bool) -> None:
        """Compile, ahead of time, the programs for every single-device failure of a device the request's
        nominal programs use (failover plans), so recovery is a cache lookup."""
        if not self.prepare_failover:
            return
        base = self.situation()
        t0 = time.perf_counter()
        need = [("prefill", tier)] + ([("decode", length)] if decode else [])
        for kind, n in need:
            prog, _ = self.situated.get(kind, n, base)
            devs = {p.device for p in prog.placed.partitions.partitions} if prog.placed is not None else set()
            if not isinstance(self.prepare_failover, bool):
                devs &= set(self.prepare_failover)
            for d in sorted(devs - base.failed):
                sit = Situation.make(base.failed | {d}, dict(base.temps), dict(base.clocks), dict(base.loads))
                if self.situated.cached(kind, n, sit):
                    continue
                try:
                    check_coverage(prog, self.situated.soc, base.failed | {d}, kind)
                except FailoverError as e:
                    self.notes.append(f"no failover plan for {d} ({kind}-{n}): {e}")
                    continue
                self.situated.get(kind, n, sit)
        self.prepare_s += time.perf_counter() - t0

    def stream(self, prompt: str | list[int], params: SamplingParams) -> AdaptiveGeneration:
        return AdaptiveGeneration(self, self.engine.encode(prompt), params)

    def generate(self, prompt: str | list[int], params: SamplingParams):
        gen = self.stream(prompt, params)
        for _ in gen:
            pass
        return gen.result

    def summary(self) -> dict[str, Any]:
        return {"switches": [s.to_dict() for s in self.switches],
                "recoveries": [r.to_dict() for r in self.recoveries], "notes": list(self.notes),
                "failed": sorted(self.failed), "situation": self.situation().key(),
                "failover_plans_compile_s": self.prepare_s, "plans_cached": {
                    s.key(): sorted(f"{k}-{n}" for k, n in pc.programs) for s, pc in self.situated.caches.items()}}


class AdaptiveGeneration(Generation):
    """One request whose every step runs on the program placed for the situation at that step."""

    chunkable = False  # its prefill is one placed tier call (the failover plans hold tier programs only)

    def __init__(self, adaptive: Adaptive, prompt_ids: list[int], params: SamplingParams):
        super().__init__(adaptive.engine, prompt_ids, params)
        self.adaptive = adaptive

    def _start(self) -> None:
        """Before prefill: note a prefill-tier switch, apply the changes due at step 1, prepare the plans."""
        a, r = self.adaptive, self.result
        a.requests += 1
        a._gen = self
        n = len(self.prompt_ids)
        tier_reason = ""
        if a.last_tier is not None and a.last_tier != r.prefill_tier:
            tier_reason = f"prompt of {n} tokens moved from prefill tier {a.last_tier} to {r.prefill_tier}"
            a.switches.append(SwitchRecord(a.requests, 1, "prefill", f"tier {a.last_tier}", f"tier {r.prefill_tier}",
                                           tier_reason, 0.0, not a.situated.cached("prefill", r.prefill_tier,
                                                                                  a.situation())))
        a.last_tier = r.prefill_tier
        self._reasons = a._apply_changes(1)
        a.prepare(r.prefill_tier, r.cache_length, self.max_new > 1)
        self._start_threads()  # the engine's adaptive thread count, as a plain request uses

    def _prefill(self, ids: torch.Tensor, last: torch.Tensor) -> tuple[Any, Any]:
        """Prefill on the program placed for the current situation (failing over where it must)."""
        try:
            out, prog = self.adaptive.call("prefill", self.result.prefill_tier, (ids, last), 1,
                                           "; ".join(self._reasons))
        except FailoverError as err:
            self._fail(err)
        return out, prog.placed

    def _before_step(self) -> Any:
        """Apply the changes due at this step; returns the step number, their reasons and the tuner's thread
        count for the step."""
        k = len(self.result.tokens) + 1
        reasons = self.adaptive._apply_changes(k)
        return k, reasons, self.tuner.before()

    def _decode(self, args: tuple, step: Any) -> tuple[Any, Any]:
        """One decode step on the program placed for the situation at this step."""
        k, reasons, _ = step
        try:
            out, prog = self.adaptive.call("decode", self.result.cache_length, args, k, "; ".join(reasons))
        except FailoverError as err:
            self._fail(err)
        return out, prog.placed

    def _after_step(self, step: Any) -> None:
        self.tuner.after(step[2], self.result.decode_s[-1])

    def _fail(self, err: FailoverError):
        self.result.stop_reason = "device failure"
        if self.tuner is not None:
            self.tuner.restore()
        self.finish()
        err.result = self.result
        raise err


def parse_options(devices: Sequence[str], inject_fault: str | None, set_load, set_temp,
                  failover_plans: str = "ahead") -> tuple[FaultSpec | None, list[Change]]:
    """The CLI's ``--inject-fault``, ``--set-load`` and ``--set-temp`` values, checked against ``devices``."""
    from hetforge.runtime.failover import parse_fault

    if failover_plans not in ("ahead", "on-demand"):
        raise UsageError(f"--failover-plans must be ahead or on-demand, got '{failover_plans}'")
    fault = parse_fault(inject_fault, devices) if inject_fault else None
    changes = [parse_change(t, "load", devices) for t in set_load or ()]
    changes += [parse_change(t, "temp", devices) for t in set_temp or ()]
    return fault, changes


def make_adaptive(engine: Engine, inject_fault: str | None, set_load, set_temp,
                  failover_plans: str = "ahead") -> Adaptive:
    """An :class:`Adaptive` runtime around ``engine`` from the CLI's options."""
    names = getattr(engine.executor, "soc_profile", None)
    if names is None:
        raise UsageError("--inject-fault/--set-load/--set-temp need the placed executor (executor 'backend')")
    fault, changes = parse_options(names.device_names, inject_fault, set_load, set_temp, failover_plans)
    return Adaptive(engine, fault, changes, prepare_failover=failover_plans == "ahead")


def adaptive_lines(a: Adaptive) -> list[str]:
    """Human-readable lines: re-placements with their reasons, recoveries (measured), notes."""
    out = []
    if a.prepare_s:
        out.append(f"failover plans compiled ahead for every single-device failure: {a.prepare_s:.2f} s (measured)")
    for s in a.switches:
        how = "compiled now" if s.compiled else "cached plan"
        out.append(f"re-placed at token {s.token} ({s.kind}): {s.before} -> {s.after} because {s.reason} "
                   f"({how}, {1e3 * s.measured_s:.2f} ms to switch, measured)")
    for r in a.recoveries:
        out.append(f"recovered from {r.device} failure at token {r.token} ({r.kind}) in {1e3 * r.recovery_s:.1f} ms "
                   f"(measured: fault -> step result on {'+'.join(r.survivors)}; re-plan {1e3 * r.replan_s:.2f} ms, "
                   f"re-run of the step {1e3 * r.rerun_s:.1f} ms, "
                   f"plan {'cached ahead' if r.plan_was_cached else 'compiled after the fault'})")
    out += a.notes
    return out
