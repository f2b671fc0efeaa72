"""Run the compiler stage by stage for a report, recording each stage's measured seconds and, when one fails,
which stage it was and why — the page is written either way.

The stages are the ones :func:`hetforge.compile.compile_model` composes (load, capture, passes, quantize, place,
lower, schedule, memory), called one by one so a failure is attributed to its stage; then ``run``: the scheduled
program cut into same-device partitions and run once on this host's backends for each SoC device
(:func:`hetforge.hetero.session.execute`), which gives the measured wall time, the fidelity against eager and
the modeled list schedule of that run.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from hetforge.errors import HetforgeError, UsageError


@dataclass
class StageLog:
    """Stages run so far: name → measured seconds, and the failure (stage, message) if any."""

    stages: list[dict[str, Any]] = field(default_factory=list)
    failure: dict[str, str] | None = None

    def run(self, name: str, fn, /, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
        except UsageError:
            if name == "load":  # a wrong model name or folder: the user's mistake, no report (exit 2)
                raise
            self._fail(name, str(sys.exc_info()[1]), "UsageError", t0)
            raise
        except HetforgeError as e:
            self._fail(name, str(e), type(e).__name__, t0)
            raise
        except Exception as e:  # a stage bug or a backend failure: still attributed to its stage on the page
            self._fail(name, f"{type(e).__name__}: {e}", type(e).__name__, t0)
            raise StageFailed(name, f"{type(e).__name__}: {e}") from e
        self.stages.append({"name": name, "status": "ok", "seconds": time.perf_counter() - t0})
        return out

    def _fail(self, name: str, msg: str, kind: str, t0: float) -> None:
        self.stages.append({"name": name, "status": "failed", "seconds": time.perf_counter() - t0})
        self.failure = {"stage": name, "error": msg, "type": kind}


class StageFailed(HetforgeError):
    """A stage raised something other than a HetforgeError; carries the stage name (exit 1)."""

    def __init__(self, stage: str, msg: str):
        super().__init__(f"stage '{stage}' failed: {msg}")
        self.stage = stage


def compile_report_data(model: str, soc: Any, strategy: str = "rules", objective: str = "energy",
                        quantize: str = "none", group_size: int = 128, seq: int = 16, run: bool = True,
                        strategy_options: dict | None = None) -> tuple[dict[str, Any], StageLog]:
    """The data of a compile report (see :mod:`hetforge.report`). Never raises for a stage failure: the
    returned log's ``failure`` says which stage failed and why, and the sections reached so far are filled."""
    from hetforge.frontend import capture
    from hetforge.ir.verify import memory_record, verify_program
    from hetforge.lower import lower
    from hetforge.memplan import plan_memory
    from hetforge.models.zoo import example_inputs, load_model
    from hetforge.passes import optimize
    from hetforge.placement import get_strategy
    from hetforge.report.collect import compile_sections, passes_section, soc_summary
    from hetforge.schedule import schedule

    log = StageLog()
    data: dict[str, Any] = {"kind": "compile", "model": model, "soc": soc.name, "devices": soc_summary(soc),
                            "strategy": strategy, "objective": objective if strategy != "support" else None,
                            "quantize": quantize, "group_size": group_size if quantize == "w4" else None, "seq": seq}
    options = {} if strategy == "support" else {"objective": objective}
    options.update(strategy_options or {})
    try:
        loaded = log.run("load", load_model, model)
        data["model"] = loaded.name
        module = loaded.logits_module()
        inputs = example_inputs(loaded, seq=seq)
        cg = log.run("capture", capture, module, inputs, name=loaded.name)
        data["graph_nodes"] = len(cg.gm.graph.nodes)
        opt = log.run("passes", optimize, cg.gm, example_inputs=inputs)
        gm = opt.gm
        data["passes"] = passes_section(opt, cg.gm, gm)
        quant = None
        if quantize != "none":
            from hetforge.quant import quantize_graph

            quant = log.run("quantize", quantize_graph, gm, scheme=quantize, group_size=group_size)
            gm = quant.gm
        placement = log.run("place", get_strategy(strategy), gm, soc, **options)
        low = log.run("lower", _lower, lower, verify_program, gm, placement, soc, loaded.name)
        sch = log.run("schedule", _schedule, schedule, verify_program, low.program)
        mem = log.run("memory", _memory, plan_memory, verify_program, memory_record, sch.program)
        res = _result(loaded.name, soc, gm, placement, low, sch, mem, cg, opt, inputs, quant, module)
        report = None
        if run:
            hr = log.run("run", _hetero_run, res, soc, module, inputs)
            report = hr.median
            data["fidelity"] = hr.fidelity.to_dict() if hr.fidelity else None
            data["bindings"] = {d: b.to_dict() for d, b in hr.bindings.items()}
            data["measured_wall_s"] = report.wall_s
        data.update(compile_sections(res, report, cg.gm, "one forward pass of the compiled program"))
        data["totals"] = _totals(res, report, log)
    except HetforgeError:
        if log.failure is None:  # a wrong model name or folder (UsageError at load): no report, exit 2
            raise
        # otherwise recorded in the log: the page says which stage failed and why
    data["stages"] = log.stages
    data["failure"] = log.failure
    return data, log


def _lower(lower, verify_program, gm, placement, soc, name):
    low = lower(gm, placement, soc, name=name)
    verify_program(low.program, "lower")
    return low


def _schedule(schedule, verify_program, program):
    sch = schedule(program)
    verify_program(sch.program, "schedule")
    return sch


def _memory(plan_memory, verify_program, memory_record, program):
    mem = plan_memory(program)
    arenas = {d: dp.arena_bytes for d, dp in mem.devices.items()}
    verify_program(program, "memory", mem.offsets, arenas)
    program.memory = memory_record(mem.offsets, arenas)
    return mem


def _result(name, soc, gm, placement, low, sch, mem, cg, opt, inputs, quant, module):
    from hetforge.compile import CompileResult, _transfer_seconds

    res = CompileResult(name, soc, gm, placement, low, sch, mem, None, {}, captured=cg, optimized=opt,
                        example_inputs=tuple(inputs))
    res.extra.update({"quantize": quant, "module": module,
                      "transfer_seconds_modeled": _transfer_seconds(sch.program, soc)})
    return res


def _hetero_run(res, soc, module, inputs):
    from hetforge.backends.mapping import resolve
    from hetforge.hetero.program import partition_program
    from hetforge.hetero.session import execute

    pg = partition_program(res.program)
    return execute(pg, soc, resolve(soc), tuple(inputs), module, repeat=1, warmup=1)


def _totals(res, report, log: StageLog) -> list[dict[str, Any]]:
    """The summary's headline figures, each labelled measured or modeled."""
    cost = (res.placement.extra or {}).get("cost") or {}
    out = [{"what": "compile (all stages before run)", "value": sum(s["seconds"] for s in log.stages
                                                                      if s["name"] != "run"), "unit": "s",
            "figure": "measured"}]
    if cost:
        out += [{"what": "placement plan time (ops in sequence + transfers)", "value": cost["time_s"], "unit": "s",
                 "figure": "modeled"},
                {"what": "placement plan energy", "value": cost["energy_j"], "unit": "J", "figure": "modeled"}]
    if report is not None:
        tl = report.timeline()
        out += [{"what": "one forward pass on the SoC (list-scheduled makespan)", "value": tl.makespan_s,
                 "unit": "s", "figure": "modeled"},
                {"what": "one forward pass energy on the SoC", "value": tl.energy_j, "unit": "J", "figure": "modeled"},
                {"what": "one forward pass on this host (stand-in backends)", "value": report.wall_s, "unit": "s",
                 "figure": "measured"}]
    out.append({"what": "activation arenas, all devices", "value": res.memory.planned_bytes, "unit": "B",
                "figure": "planned"})
    return out
