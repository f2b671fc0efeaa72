"""The two agents of the synthesis loop.

* :class:`GenerationAgent` writes the prompt (problem, reference source, platform rules, the previous
  round's code and its errors or the analysis agent's advice, or a working kernel from another platform
  to translate) and extracts the candidate code from a reply.
* :class:`PerformanceAnalysisAgent` turns a timed, profiled attempt into roofline figures against the
  host profile (achieved GFLOP/s and GB/s, share of the bound, time in leftover torch ops, allocations)
  and ranked, code-level advice; each piece of advice names the generator knobs it concerns.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from hetforge.kforge.harness import Attempt, RefInfo
from hetforge.kforge.platforms import Platform
from hetforge.kforge.problems import Problem

CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)


class ExtractError(Exception):
    """The reply holds no usable code."""


@dataclass
class Advice:
    rank: int
    text: str
    knobs: list[str] = field(default_factory=list)
    gain: float = 0.0  # estimated share of the time that could go (modeled, from the roofline)


@dataclass
class Analysis:
    figures: dict
    advice: list[Advice]

    def to_dict(self) -> dict:
        return {"figures": self.figures, "advice": [asdict(a) for a in self.advice]}

    def markdown(self) -> str:
        f = self.figures
        lines = [f"achieved {f['gflops']:.2f} GFLOP/s ({f['peak_share']:.1%} of peak), {f['gbps']:.2f} GB/s "
                 f"({f['bw_share']:.1%} of bandwidth); roofline bound {f['bound_us']:.1f} µs "
                 f"({f['bound_kind']}-bound), measured {f['time_us']:.1f} µs"]
        lines += [f"{a.rank}. {a.text}" for a in self.advice]
        return "\n".join(lines)


class GenerationAgent:
    """Prompts for a candidate and pulls the code back out of the reply."""

    system = ("You are an expert performance engineer who writes correct, fast kernels. You replace a PyTorch "
              "reference with a custom kernel on the named platform. Correctness first, then speed.")

    def build_prompt(self, problem: Problem, platform: Platform, last_code: str | None = None,
                     last: Attempt | None = None, advice: list[Advice] | None = None,
                     translate_from: tuple[str, str] | None = None) -> tuple[str, str]:
        parts = [f"# Problem: {problem.name}\n{problem.description}\n", "## Reference (PyTorch)\n```python\n"
                 + problem.source.strip() + "\n```\n", f"## Platform: {platform.language}\n{platform.rules}\n"]
        if translate_from is not None:
            src_platform, src_code = translate_from
            parts.append(f"## A working implementation on {src_platform}\nTranslate it to {platform.language}, "
                         f"keeping its algorithm and fusion:\n```python\n{src_code.strip()}\n```\n")
        if last_code is not None and last is not None:
            parts.append("## Your previous attempt\n```python\n" + last_code.strip() + "\n```\n")
            if not last.correct:
                parts.append(f"It failed: {last.error}\nFix this (functional pass).\n")
            else:
                parts.append(f"It is correct, {last.time_s * 1e6:.1f} µs measured"
                             + (f", speedup {last.speedup:.2f}x." if last.speedup else ".") + "\n")
        if advice:
            parts.append("## Performance analysis (apply the highest-ranked advice first)\n"
                         + "\n".join(f"{a.rank}. {a.text}" for a in advice) + "\n")
        parts.append("Reply with the complete file in one ```python block.")
        return self.system, "\n".join(parts)

    @staticmethod
    def extract_code(reply: str) -> str:
        blocks = [b for b in CODE_BLOCK.findall(reply) if "ModelNew" in b]
        if not blocks:
            raise ExtractError("the reply holds no ```python block that defines ModelNew")
        return blocks[-1].strip() + "\n"


TRANSCENDENTAL = ("expf", "tanhf", "erff", "logf", "sqrtf", "exp(", "tanh(", "erf(")


class PerformanceAnalysisAgent:
    """Roofline figures and ranked advice for a correct, timed attempt."""

    def analyze(self, ref: RefInfo, att: Attempt, code: str, peak_flops: float, bandwidth: float) -> Analysis:
        t = att.time_s or float("nan")
        flops = max(ref.flops, ref.elementwise)
        f_bound = flops / peak_flops
        m_bound = ref.nbytes / bandwidth
        bound = max(f_bound, m_bound)
        prof = att.profile or {}
        total = prof.get("total_us") or t * 1e6
        aten_share = (prof.get("aten_us", 0.0) / total) if total else 0.0
        figs = {"time_us": t * 1e6, "gflops": flops / t / 1e9, "gbps": ref.nbytes / t / 1e9,
                "peak_share": flops / t / peak_flops, "bw_share": ref.nbytes / t / bandwidth,
                "bound_us": bound * 1e6, "bound_kind": "compute" if f_bound >= m_bound else "memory",
                "bound_share": bound / t, "leftover_torch_share": aten_share,
                "allocations_per_call": prof.get("allocations", 0.0), "speedup": att.speedup,
                "top_ops": [o["op"] for o in prof.get("top", [])[:4]]}
        adv: list[Advice] = []
        gap = max(0.0, 1.0 - bound / t)
        gemm = ref.flops > 0
        if gemm and figs["bound_kind"] == "compute":
            adv.append(Advice(0, f"The GEMM runs at {figs['peak_share']:.1%} of fp32 peak: accumulate more output "
                              "columns per pass over K (register blocking, nb) so each loaded x element feeds more "
                              "FMAs, and size the row block (mb) so the weight panel stays in cache.",
                              ["nb", "mb"], gap))
        if any(k in code for k in TRANSCENDENTAL) and "-ffast-math" not in code:
            adv.append(Advice(0, "Transcendental math (exp/tanh/erf) is scalar libm: allow vectorised math "
                              "(-ffast-math pulls in libmvec's SIMD expf) or use a polynomial approximation.",
                              ["fast_math"], gap * 0.8))
        if figs["bound_kind"] == "memory" and figs["bw_share"] < 0.5:
            adv.append(Advice(0, f"Memory-bound at {figs['bw_share']:.1%} of bandwidth: make the inner loops "
                              "vectorise (#pragma omp simd, contiguous j) and make every output one pass.",
                              ["simd", "schedule"], gap * 0.5))
        if t < 50e-6:
            adv.append(Advice(0, f"The call takes {t * 1e6:.1f} µs: the OpenMP fork/join and Python call overhead "
                              "is a large share; run small problems serially (raise the parallel cut-off).",
                              ["parallel_min"], 0.3))
        if aten_share > 0.2:
            adv.append(Advice(0, f"{aten_share:.0%} of the call is in torch ops around the kernel "
                              f"({', '.join(figs['top_ops'][:3])}): avoid .contiguous() copies and extra "
                              "allocations; allocate only the outputs.", [], aten_share))
        if att.speedup is not None and att.speedup < 1:
            adv.append(Advice(0, f"Slower than the baseline ({att.speedup:.2f}x): fuse the tail ops into the main "
                              "loop so the intermediate never goes to memory.", [], 0.0))
        adv.sort(key=lambda a: -a.gain)
        for i, a in enumerate(adv, 1):
            a.rank = i
        return Analysis(figs, adv)
