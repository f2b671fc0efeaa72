"""Compile one module for several static input shapes at once: the first shape in this process, the others in
forked children (:mod:`hetforge.runtime.ahead`) at the same time.

Why: hetforge compiles static shapes, and a program's build is mostly Python on one core (``torch.export``
capture, the passes, lowering), so on two or more cores the shapes can be built side by side, as a cold request's
prefill and decode programs are. A child captures, optimizes, places, lowers and schedules its shape exactly as
this process would (``hetforge.compile.compile_graph`` with the same options), writes the scheduled program
(:func:`hetforge.runtime.compile_cache.program_payload`: the model's parameters by path, the tensors the passes
made beside it) to a private temporary folder and exits; this process binds it to the module's own weights,
checks it as a compile-cache hit is checked (:func:`~hetforge.runtime.compile_cache.bind_program`) and builds its
executor. A child that fails (e.g. a kernel choice it would have to measure: children never measure) leaves
that shape to this process, which builds it afterwards. Refused (every shape built here, one after the other)
where :func:`hetforge.runtime.ahead.process_refusal` or, for quantized programs,
:func:`~hetforge.runtime.ahead.quantize_refusal` says so. At most one child per spare core runs; further
shapes are built here after the first.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hetforge.runtime import ahead


@dataclass
class ShapeProgram:
    """One shape's compiled program: its executor and what making it took (measured)."""

    inputs: tuple[torch.Tensor, ...]
    executable: Any  # hetforge.executor.Executable
    program: Any  # the scheduled Program
    seconds: dict[str, float]  # stage seconds where they were spent (capture, passes, ...; a child's own for a child)
    passes_note: str = ""
    child_s: float | None = None  # built in a forked child: its own wall seconds
    notes: list[str] = field(default_factory=list)


@dataclass
class ShapesResult:
    programs: list[ShapeProgram]
    wall_s: float  # what the caller waited for all of them (measured)
    own_stages: dict[str, float]  # stage seconds spent in this process (the shapes built here)
    refused: str = ""  # why nothing was built in a child ("" when children were used)


def _compile(module: torch.nn.Module, inputs: tuple, name: str, build: bool, options: dict[str, Any]) \
        -> tuple[Any, str]:
    """The shape's ``compile_graph`` result and how it was captured (a stamped capture's note, else "")."""
    from hetforge.compile import compile_graph
    from hetforge.frontend import capture
    from hetforge.runtime.programs import policy_capture

    stamped = policy_capture()  # the passes on two layers, the others stamped out after them
    cg = stamped(module, inputs, name) if stamped is not None else \
        capture(module, inputs, name=name, stack_traces=False, guards=False)  # lowered only: no guard needed
    res = compile_graph(cg.gm, example_inputs=inputs, name=name, build=build, expand=cg.deferred, **options)
    res.seconds = {"capture": cg.seconds, **res.seconds}
    return res, cg.final_note()


def _stages(secs: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in secs.items() if k != "total"}


def compile_shapes(module: torch.nn.Module, shapes: Sequence[tuple[torch.Tensor, ...]], name: str = "model",
                   **options: Any) -> ShapesResult:
    """One program per input shape in ``shapes`` (``options`` go to ``compile_graph``: ``soc``, ``quantize``,
    ...), in the order given; see the module docstring for how they are built."""
    t_all = time.perf_counter()
    shapes = [tuple(s) for s in shapes]
    labels = [f"{name}-{i}" for i in range(len(shapes))]
    spare = ahead.spare_cores()
    why = (ahead.process_refusal() or ahead.quantize_refusal(options.get("quantize"))) if len(shapes) > 1 \
        else "one shape"
    jobs: dict[int, tuple[Any, str]] = {}
    folder = tempfile.mkdtemp(prefix="hetforge-shapes-") if not why else ""
    out: list[ShapeProgram | None] = [None] * len(shapes)
    own: dict[str, float] = {}
    try:
        for i in range(1, len(shapes)) if not why else ():
            if len(jobs) >= spare:
                break
            path = os.path.join(folder, f"{i}.pt")

            def build(i: int = i, path: str = path) -> bool:
                from hetforge.runtime.compile_cache import program_payload

                res, note = _compile(module, shapes[i], labels[i], False, options)
                pd, extra = program_payload(res.program)
                torch.save({"program": pd, "extra": extra, "seconds": _stages(res.seconds),
                            "passes_note": res.passes_note, "capture_note": note}, path + ".tmp")
                os.replace(path + ".tmp", path)
                return True

            t0 = time.perf_counter()
            job = ahead.start(build)
            imports = job.imports_s if job is not None else 0.0
            own["capture imports"] = own.get("capture imports", 0.0) + imports  # what the first capture would import
            own["start children"] = own.get("start children", 0.0) + time.perf_counter() - t0 - imports
            if job is not None:
                jobs[i] = (job, path)
        for i in range(len(shapes)):  # the first, and any shape no child builds
            if i in jobs:
                continue
            res, note = _compile(module, shapes[i], labels[i], True, options)
            stages = _stages(res.seconds)
            for k, v in stages.items():
                own[k] = own.get(k, 0.0) + v
            out[i] = ShapeProgram(shapes[i], res.executable, res.program, stages, res.passes_note,
                                  notes=[note] if note else [])
        # the oneDNN weights packed now, not in each program's first call (packing writes only new pages: done
        # while the children still run)
        t0 = time.perf_counter()
        for p in out:
            if p is not None and p.executable is not None:
                p.executable.prepack()
        own["pack weights"] = time.perf_counter() - t0
        for i, (job, path) in jobs.items():
            out[i] = _collect(module, shapes[i], labels[i], job, path, options, own)
            jobs[i] = (None, path)
            if out[i].executable is not None:
                t0 = time.perf_counter()
                out[i].executable.prepack()
                own["pack weights"] += time.perf_counter() - t0
    finally:
        for job, _ in jobs.values():
            if job is not None:
                job.cancel()
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    return ShapesResult([p for p in out if p is not None], time.perf_counter() - t_all, own, why or "")


def _collect(module: torch.nn.Module, inputs: tuple, label: str, job: Any, path: str, options: dict[str, Any],
             own: dict[str, float]) -> ShapeProgram:
    """The child's program bound to this process's weights, or (the child failed, or its program does not fit)
    the shape built here."""
    from hetforge.executor import Executable
    from hetforge.hardware import load_soc
    from hetforge.runtime.compile_cache import CacheEntryError, bind_program

    ok, child_s, err, waited = job.join()
    t0 = time.perf_counter()
    if ok:
        try:
            # written a moment ago by this process's own forked child into a folder only this user can write
            # (mkdtemp): the same trust as this process's memory, so the C unpickler, not the weights-only one
            # (a tenth of the time on a program payload, measured)
            got = torch.load(path, weights_only=False)
            program, plan = bind_program(got["program"], got["extra"], module)
            soc = options.get("soc", "host")
            soc = load_soc(soc) if isinstance(soc, str) else soc
            exe = Executable(program, plan, options.get("device_map"), mode=options.get("mode", "arena"), soc=soc)
        except (OSError, CacheEntryError, KeyError, RuntimeError) as e:
            err = f"its program could not be used ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        else:
            took = time.perf_counter() - t0
            own["built alongside (wait + bind)"] = own.get("built alongside (wait + bind)", 0.0) + waited + took
            return ShapeProgram(inputs, exe, program, got["seconds"], got["passes_note"], child_s,
                                [f"built in a forked child ({child_s:.3f} s of its own, measured); waited "
                                 f"{waited:.3f} s, bound and built here in {took:.3f} s",
                                 *([got["capture_note"]] if got.get("capture_note") else [])])
    res, note = _compile(module, inputs, label, True, options)
    stages = _stages(res.seconds)
    for k, v in stages.items():
        own[k] = own.get(k, 0.0) + v
    own["built alongside (wait + bind)"] = own.get("built alongside (wait + bind)", 0.0) + waited
    return ShapeProgram(inputs, res.executable, res.program, stages, res.passes_note, None,
                        [f"the forked child building this shape failed ({err or 'no program'}); built here",
                         *([note] if note else [])])
