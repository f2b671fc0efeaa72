"""The host CPU's model and instruction-set flags (from /proc/cpuinfo), recorded with every benchmark result
and checked before a precision that needs them (``--precision bf16``)."""

from __future__ import annotations

import os
import platform

from hetforge.cpuinfo import fields as cpu_fields
from hetforge.cpuinfo import flag_text
from hetforge.hardware.host import cpu_count, cpu_name

# flags worth recording for CPU inference (vector widths, FMA, dot products, bf16/fp16/int8 matrix units)
RELEVANT = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
            "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16", "i8mm")
# precision → the CPU features that run it natively (any one of them is enough)
NATIVE_FOR = {"bf16": ("avx512_bf16", "amx_bf16", "bf16")}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """Every flag of the first processor in /proc/cpuinfo (``flags`` on x86, ``Features`` on ARM); empty when
    unreadable. ``HETFORGE_CPU_FLAGS`` (space-separated) replaces them: to check what hetforge does on another
    CPU (the tests use it for the refusal of a precision the CPU lacks)."""
    env = os.environ.get("HETFORGE_CPU_FLAGS")
    if cpuinfo is None and env is not None:
        return set(env.split())
    return set(flag_text(cpu_fields(cpuinfo)).split())


def isa_flags(flags: set[str] | None = None) -> list[str]:
    """The :data:`RELEVANT` flags this CPU has, in that order."""
    flags = cpu_flags() if flags is None else flags
    return [f for f in RELEVANT if f in flags]


def missing_feature(precision: str, flags: set[str] | None = None) -> str | None:
    """None when the CPU runs ``precision`` natively, else the name of the feature it lacks."""
    need = NATIVE_FOR.get(precision)
    if need is None:
        return None
    flags = cpu_flags() if flags is None else flags
    return None if any(f in flags for f in need) else " or ".join(f.upper() for f in need[:2])


def host_record() -> dict:
    """CPU model, core count and ISA flags, for a benchmark's JSON."""
    return {"cpu": cpu_name(), "cores": cpu_count(), "machine": platform.machine(), "isa": isa_flags()}
