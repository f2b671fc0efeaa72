"""One measurement: one system on one model, normally in its own process so peak RSS is its own.

``python -m hetforge.benchmarks.worker SPEC.json RESULT.json`` reads a :class:`WorkerSpec`, builds the
model (seeded, so every process gets the same weights), prepares the system (timed per stage), times
prefill and one-token forwards, decode where the system has a KV-cache path, compares the prefill
logits with eager's, and writes a :class:`RunResult` as JSON. Any exception becomes a failed result
carrying the error's first line; the worker itself never crashes the suite.

``python -m hetforge.benchmarks.worker --serve SPEC.json`` prepares the system and then times batches of calls
on request (:func:`serve`), for the side-by-side phase (:mod:`hetforge.benchmarks.side`).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hetforge.benchmarks.base import first_line  # noqa: F401  (re-exported for callers)


@dataclass
class WorkerSpec:
    """What to measure and how hard."""

    system: str
    model: str
    mode: str = "cold"  # "cold": prepare + measure; "warm": prepare only, cache folder already filled
    seq: int = 128
    threads: int = 2
    workdir: str = "."
    cache_dir: str = "."
    ref_path: str = ""  # eager reference logits (torch.save); written by the eager run when missing
    warmup: int = 2
    prefill_iters: int = 10
    step_iters: int = 30
    max_measure_s: float = 4.0  # per latency figure: stop adding iterations after this long (≥ 3 kept)
    decode_tokens: int = 16
    decode: bool = True


@dataclass
class RunResult:
    """Everything one run measured; every figure is measured on this machine in this process."""

    system: str
    model: str
    mode: str
    status: str  # "ok", "failed", "not installed", "timeout"
    error: str = ""
    label: str = ""
    precision: str = ""
    stages: dict[str, float] = field(default_factory=dict)
    prep_s: float | None = None
    prefill_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    ttft_ms: float | None = None
    decode_ms_per_token: float | None = None
    decode_prep_s: float | None = None
    fidelity: dict | None = None
    rss_model_mb: float | None = None
    rss_peak_mb: float | None = None
    wall_s: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def time_calls(fn, args, warmup: int, iters: int, max_s: float) -> list[float]:
    """Milliseconds per call; ``warmup`` untimed calls, then up to ``iters`` timed (≥ 3 if time runs out)."""
    with torch.no_grad():
        for _ in range(max(warmup, 0)):
            fn(*args)
        out: list[float] = []
        start = time.perf_counter()
        for i in range(iters):
            t0 = time.perf_counter()
            fn(*args)
            out.append((time.perf_counter() - t0) * 1e3)
            if i >= 2 and time.perf_counter() - start > max_s:
                break
    return out


def _load_reference(spec: WorkerSpec, loaded, prefill_inputs, step_inputs) -> dict[str, torch.Tensor]:
    """Eager logits for the prefill and one-token inputs (computed once, shared through a file)."""
    path = Path(spec.ref_path) if spec.ref_path else None
    if path is not None and path.is_file():
        return torch.load(path)
    module = loaded.logits_module().eval()
    with torch.no_grad():
        ref = {"prefill": module(*prefill_inputs), "step": module(*step_inputs)}
    if path is not None:
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        torch.save(ref, tmp)
        tmp.replace(path)
    return ref


def _context(spec: WorkerSpec):
    """The seeded model, its example inputs and the folders, as every system's ``prepare`` gets them."""
    from hetforge.benchmarks.systems import PrepContext
    from hetforge.models.zoo import example_inputs, load_model

    torch.set_num_threads(spec.threads)
    loaded = load_model(spec.model)
    workdir = Path(spec.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    Path(spec.cache_dir).mkdir(parents=True, exist_ok=True)
    return PrepContext(loaded, loaded.logits_module().eval(), example_inputs(loaded, seq=spec.seq),
                       example_inputs(loaded, seq=1, seed=1), workdir, Path(spec.cache_dir), spec.threads)


def run_worker(spec: WorkerSpec) -> RunResult:
    """Run one measurement in this process; never raises."""
    from hetforge.benchmarks.systems import SYSTEMS, missing_requirement

    t_start = time.perf_counter()
    res = RunResult(system=spec.system, model=spec.model, mode=spec.mode, status="failed")
    system = SYSTEMS.get(spec.system)
    if system is None:
        res.error = f"unknown system '{spec.system}'"
        return res
    res.label = system.label
    missing = missing_requirement(system)
    if missing:
        res.status, res.error = "not installed", missing
        return res
    try:
        ctx = _context(spec)
        loaded, prefill_inputs, step_inputs = ctx.loaded, ctx.prefill_inputs, ctx.step_inputs
        res.rss_model_mb = _rss_mb()
        ref = _load_reference(spec, loaded, prefill_inputs, step_inputs) if spec.mode == "cold" else None
        prepared = system.prepare(ctx)
        res.stages = dict(prepared.stages)
        res.label = prepared.label or system.label
        res.precision = prepared.precision
        try:
            first = first_calls(prepared, prefill_inputs, step_inputs)
            res.stages[FIRST_CALLS] = first.excess_s
            prepared.notes.append(first.note)
            res.prep_s = sum(res.stages.values())
            if spec.mode == "cold":
                _measure(spec, res, prepared, prefill_inputs, step_inputs, ref, first.outputs)
        finally:
            res.notes = list(prepared.notes)  # the decode path may add notes while it runs
        res.status = "ok"
    except Exception as e:  # a peer may fail anywhere in export/convert/run: that is a result, not a crash
        res.status = "failed"
        res.error = first_line(e)
        res.notes.append("".join(traceback.format_exception_only(type(e), e)).strip()[:2000])
    res.rss_peak_mb = _peak_rss_mb()
    res.wall_s = time.perf_counter() - t_start
    return res


FIRST_CALLS = "first calls above hot"  # the stage every system's one-time first-call work is counted in


@dataclass
class FirstCalls:
    """The first call of each shape, timed against the best of the next two (measured)."""

    outputs: list  # the first calls' outputs (prefill, one token)
    excess_s: float  # sum over the two shapes of max(0, first − best of the next two)
    note: str


def first_calls(prepared, prefill_inputs, step_inputs) -> FirstCalls:
    """Call the prepared forward three times on each shape and count what its first call took above the better of
    the next two, where positive: what it does once (first touch of its buffers, a plugin's lazy allocation, a
    weight packed on first use) is part of being ready to run at speed. Why: one rule for every system, where a
    system could otherwise move one-time work out of its preparation into its first call, or count a whole first
    inference as preparation where a peer counts none."""
    step = prepared.step_forward or prepared.forward
    outs, excess, parts = [], 0.0, []
    with torch.no_grad():
        for tag, fn, args in (("prefill", prepared.forward, prefill_inputs), ("one token", step, step_inputs)):
            times = []
            for i in range(3):
                t0 = time.perf_counter()
                out = fn(*args)
                times.append(time.perf_counter() - t0)
                if i == 0:
                    outs.append(out)
            over = max(0.0, times[0] - min(times[1:]))
            excess += over
            parts.append(f"{tag} {times[0] * 1e3:.1f} ms first, {min(times[1:]) * 1e3:.1f} ms best of the next two")
    return FirstCalls(outs, excess, f"first calls (measured; what the first took above the next two's best is "
                                    f"counted in prep, {excess * 1e3:.1f} ms): {'; '.join(parts)}")


def _measure(spec: WorkerSpec, res: RunResult, prepared, prefill_inputs, step_inputs, ref, first_outputs) -> None:
    from hetforge.verify import compare_logits

    step = prepared.step_forward or prepared.forward
    got = [_logits(o) for o in first_outputs]
    # one comparison over the prefill positions and the one-token position together
    want = torch.cat([ref["prefill"], ref["step"]], dim=1)
    rep = compare_logits(want, torch.cat([g.reshape(r.shape).to(r.dtype) for g, r in
                                          zip(got, (ref["prefill"], ref["step"]), strict=True)], dim=1))
    res.fidelity = {k: v for k, v in rep.to_dict().items() if k not in ("kl_threshold", "abs_threshold", "passed")}
    # first_calls already warmed each path three times
    res.prefill_ms = time_calls(prepared.forward, prefill_inputs, max(spec.warmup - 3, 0), spec.prefill_iters,
                                spec.max_measure_s)
    res.step_ms = time_calls(step, step_inputs, max(spec.warmup - 3, 0), spec.step_iters, spec.max_measure_s)
    if spec.decode and prepared.decode is not None:
        d = prepared.decode(prefill_inputs, spec.decode_tokens)
        res.ttft_ms, res.decode_ms_per_token = d.ttft_ms, d.decode_ms_per_token
        res.decode_prep_s = d.prep_s or None


def _logits(out) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        out = out[0]
    return getattr(out, "logits", out)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def serve(spec: WorkerSpec, commands: Iterable[str], reply: Callable[[dict], None]) -> int:
    """Side-by-side mode (:mod:`hetforge.benchmarks.side`): prepare the system, warm both shapes up (and, where the
    system decodes, run one untimed decode request of ``spec.decode_tokens`` tokens), ``reply`` ``{"ready": true,
    "decode": bool}`` (or ``{"ready": false, "error": ...}`` and return 1), then time one batch of calls per
    command line, ``{"shape": "prefill" | "step", "warmup": w, "calls": n, "max_s": s}`` → ``{"ms": [...]}`` (as
    :func:`time_calls`), or one decode request, ``{"shape": "decode", "tokens": n}`` → ``{"ms": [ms per token],
    "ttft_ms": t}``, until ``{"quit": true}`` or the end of ``commands``. Nothing else runs between the batches:
    the coordinator keeps every other system's process waiting while one times its calls."""
    from hetforge.benchmarks.systems import SYSTEMS, missing_requirement

    try:
        system = SYSTEMS[spec.system]
        missing = missing_requirement(system)
        if missing:
            raise RuntimeError(missing)
        ctx = _context(spec)
        prepared = system.prepare(ctx)
        first_calls(prepared, ctx.prefill_inputs, ctx.step_inputs)
        decodes = spec.decode and prepared.decode is not None
        if decodes:  # compiles (hetforge) or warms the decode path; untimed
            prepared.decode(ctx.prefill_inputs, spec.decode_tokens, tries=1)
    except Exception as e:  # a peer that cannot be prepared is reported, not raised
        reply({"ready": False, "error": first_line(e)})
        return 1
    reply({"ready": True, "label": prepared.label or system.label, "precision": prepared.precision,
           "decode": decodes})
    shapes = {"prefill": (prepared.forward, ctx.prefill_inputs),
              "step": (prepared.step_forward or prepared.forward, ctx.step_inputs)}
    for line in commands:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        if cmd["shape"] == "decode":
            if not decodes:
                reply({"error": f"{spec.system} has no decode path here"})
                continue
            d = prepared.decode(ctx.prefill_inputs, int(cmd["tokens"]), tries=1)
            reply({"ms": [d.decode_ms_per_token], "ttft_ms": d.ttft_ms})
            continue
        fn, args = shapes[cmd["shape"]]
        reply({"ms": time_calls(fn, args, int(cmd.get("warmup", 1)), int(cmd["calls"]),
                                float(cmd.get("max_s", 3.0)))})
    return 0


def _serve_main(spec_path: str) -> int:
    """``--serve SPEC.json``: replies on what was stdout, one JSON line each; stdout itself goes to stderr, so
    that nothing a library prints can be taken for a reply."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(d: dict) -> None:
        out.write(json.dumps(d) + "\n")
        out.flush()

    return serve(WorkerSpec(**json.loads(Path(spec_path).read_text())), sys.stdin, reply)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--serve":
        return _serve_main(argv[1])
    spec = WorkerSpec(**json.loads(Path(argv[0]).read_text()))
    res = run_worker(spec)
    Path(argv[1]).write_text(json.dumps(res.to_dict()))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.exit(main())
