"""Guardrails: ways a candidate can "pass" without doing the work, each turned into a named violation.

Static checks read the candidate's source; dynamic ones read what the candidate worker recorded
(ATen ops its forward dispatched, casts, mutated inputs, timers replaced) and what the parent saw when it
compared outputs (caching, nondeterminism from uninitialised memory, a time below the roofline bound).
"""

from __future__ import annotations

import re

from hetforge.kforge.platforms import ALLOWED_OPS

DOWNCAST = re.compile(r"(\.half\(|torch\.half\b|\bHalf\b|\bBFloat16\b|float16|bfloat16|__half\b|__nv_bfloat16|kHalf|"
                      r"kBFloat16|float8\w*|_Float16|__fp16)")
REFERENCE_CALL = re.compile(r"(?<![\w.])(Model\s*\(|get_inputs\s*\(|get_init_inputs\s*\(|kforge_reference)")
TIMER_PATCH = re.compile(r"(time\.(perf_counter|perf_counter_ns|time|monotonic)\s*=|"
                         r"torch\.cuda\.(synchronize|Event)\s*=|elapsed_time\s*=)")


def static_violations(code: str) -> list[str]:
    """Violations visible in the source alone."""
    out = []
    m = DOWNCAST.search(code)
    if m:
        out.append(f"precision downcast: the source uses '{m.group(0)}' (fp32 problems must compute in fp32)")
    m = REFERENCE_CALL.search(code)
    if m:
        out.append(f"calls the reference: '{m.group(0).strip()}' appears in the candidate")
    m = TIMER_PATCH.search(code)
    if m:
        out.append(f"timer tampering: the source assigns '{m.group(0)}'")
    return out


def forbidden_ops(ops: dict[str, int], platform_forbids_torch: bool = True) -> list[str]:
    """ATen ops ModelNew.forward dispatched that do computation (the platform wants it in the kernel)."""
    if not platform_forbids_torch:
        return []
    return sorted(k for k in ops if k not in ALLOWED_OPS)


def roofline_bound_s(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> float:
    """The least time the problem can take on the host: all FLOPs at peak, or all compulsory bytes at bandwidth."""
    return max(flops / peak_flops if peak_flops else 0.0, nbytes / bandwidth if bandwidth else 0.0)
