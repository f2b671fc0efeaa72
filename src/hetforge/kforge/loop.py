"""The synthesis loop: functional passes until a candidate is correct, then optimization passes steered by
the performance-analysis agent; every prompt, reply, candidate, log and verdict kept on disk.

Layout: ``OUT/<problem>/round_<n>/`` holds ``prompt.md``, ``reply.md``, ``candidate.py``, the worker's
log, ``result.json`` (what the worker saw), ``attempt.json`` (the verdict) and ``advice.md``;
``OUT/summary.json`` holds the per-problem results and the aggregate metrics.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hetforge.errors import HetforgeError
from hetforge.kforge import harness
from hetforge.kforge.agents import ExtractError, GenerationAgent, PerformanceAnalysisAgent
from hetforge.kforge.harness import Attempt, Config
from hetforge.kforge.platforms import Platform
from hetforge.kforge.problems import Problem
from hetforge.kforge.providers import GenRequest, Provider, Usage


@dataclass
class ProblemResult:
    name: str
    category: str
    compiled: bool = False
    correct: bool = False
    speedup: float | None = None
    time_s: float | None = None
    eager_s: float | None = None
    compile_s: float | None = None
    compile_build_s: float | None = None
    baseline_kind: str | None = None
    flagged: str | None = None
    best_round: int | None = None
    best_code: str | None = None  # path of the best candidate
    error: str | None = None
    rounds: list[dict] = field(default_factory=list)


def host_roofline(profile: str = "host") -> tuple[float, float, bool]:
    """(fp32 peak FLOP/s, memory bandwidth B/s, calibrated?) of the host profile."""
    from hetforge.hardware import load_soc

    p = load_soc(profile)
    d = p.devices[0]
    return d.peak_flops.get("fp32", 0.0), d.mem_bandwidth, bool(getattr(p, "calibrated", False))


def solve(problem: Problem, platform: Platform, provider: Provider, rounds: int, cfg: Config, out: Path,
          usage: Usage, peak: float, bw: float, translate_from: tuple[str, str] | None = None,
          tick: Callable[[str], None] | None = None) -> ProblemResult:
    """Run the loop on one problem."""
    gen, ana = GenerationAgent(), PerformanceAnalysisAgent()
    res = ProblemResult(problem.name, problem.category)
    try:
        ref = harness.reference(problem, cfg)
    except HetforgeError as e:
        res.error = str(e)
        return res
    peak, bw = ref.roofline(peak, bw)  # the GPU's own roofline where the reference measured one, else the host's
    res.eager_s, res.compile_s, res.compile_build_s = ref.eager_s, ref.compile_s, ref.compile_build_s
    res.baseline_kind = ref.baseline_kind
    last: Attempt | None = None
    last_code: str | None = None
    advice = []
    best: Attempt | None = None
    for r in range(1, rounds + 1):
        folder = out / problem.name / f"round_{r}"
        folder.mkdir(parents=True, exist_ok=True)
        phase = "optimization" if best is not None else "functional"
        if tick:
            tick(f"{problem.name} round {r} ({phase})")
        system, prompt = gen.build_prompt(problem, platform, last_code, last, advice,
                                          translate_from if r == 1 else None)
        (folder / "prompt.md").write_text(f"<!-- system -->\n{system}\n\n{prompt}\n")
        reply = provider.generate(GenRequest(problem, platform.name, system, prompt, advice, last, r))
        usage.add(reply)
        (folder / "reply.md").write_text(reply.text)
        if reply.done:
            res.rounds.append({"round": r, "phase": phase, "stopped": reply.note})
            if last is None:
                res.error = f"provider gave no candidate: {reply.note}"
            break
        try:
            code = gen.extract_code(reply.text)
        except ExtractError as e:
            att = Attempt(error=str(e))
            code = ""
        else:
            att = harness.evaluate(problem, code, platform, ref, folder, cfg, peak, bw)
        row = {"round": r, "phase": phase, "note": reply.note, **{k: getattr(att, k) for k in (
            "compiled", "correct", "error", "violations", "time_s", "speedup", "flagged", "build_s")}}
        advice = []
        if att.correct and att.time_s:
            an = ana.analyze(ref, att, code, peak, bw)
            advice = an.advice
            (folder / "advice.md").write_text(an.markdown() + "\n")
            (folder / "analysis.json").write_text(json.dumps(an.to_dict(), indent=1, default=str))
            row["analysis"] = an.figures
        res.rounds.append(row)
        res.compiled |= att.compiled
        if att.correct and (best is None or (att.time_s or math.inf) < (best.time_s or math.inf)) and not (
                att.flagged and best is not None):
            best, res.best_round, res.best_code = att, r, str(folder / "candidate.py")
        last, last_code = att, code
    if best is not None:
        res.correct, res.time_s, res.speedup, res.flagged = True, best.time_s, best.speedup, best.flagged
    elif last is not None:
        res.error = last.error
    return res


def fast_p(results: list[ProblemResult], p: float) -> float:
    """Share of problems that are correct, not flagged, and faster than the baseline by more than p."""
    if not results:
        return 0.0
    return sum(1 for r in results if r.correct and not r.flagged and (r.speedup or 0) > p) / len(results)


def geomean(xs: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def metrics(results: list[ProblemResult]) -> dict:
    ok = [r.speedup for r in results if r.correct and not r.flagged and r.speedup]
    return {"problems": len(results), "compiled": sum(r.compiled for r in results),
            "correct": sum(r.correct for r in results), "flagged": sum(bool(r.flagged) for r in results),
            "fast_0": fast_p(results, 0.0), "fast_1": fast_p(results, 1.0), "fast_1.5": fast_p(results, 1.5),
            "geomean_speedup_correct": geomean(ok),
            "geomean_speedup_all": geomean(ok + [1.0] * (len(results) - len(ok))),
            "label": "measured"}


def summary(results: list[ProblemResult], usage: Usage, cfg: Config, platform: str, provider: str, rounds: int,
            calibrated: bool) -> dict:
    return {"platform": platform, "provider": provider, "rounds": rounds, "metrics": metrics(results),
            "usage": usage.to_dict(), "host_profile_calibrated": calibrated,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
            "problems": [asdict(r) for r in results]}
