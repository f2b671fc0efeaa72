"""Roofline time of one op on one device.

    AI        = F / B                                  (FLOP per byte; ∞ when B = 0 < F, 0 when both are 0)
    t_compute = F / π_eff,   π_eff = π[dtype] · e      (e: the device's efficiency factor for this op)
    t_memory  = B / β_eff,   β_eff = β · e
    t         = max(t_compute, t_memory) + t_dispatch
    bound     = "dispatch" if t_dispatch > max(t_compute, t_memory)
                else "compute" if t_compute ≥ t_memory else "memory"
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """``F / B``; ``inf`` when the op reads/writes nothing but computes, ``0`` when it does neither."""
    if nbytes > 0:
        return flops / nbytes
    return math.inf if flops > 0 else 0.0


@dataclass(frozen=True)
class Roofline:
    t_compute: float
    t_memory: float
    t_dispatch: float

    @property
    def time(self) -> float:
        return max(self.t_compute, self.t_memory) + self.t_dispatch

    @property
    def roof_class(self) -> str:
        """Which roof limits the data work: ``compute`` or ``memory``."""
        return "compute" if self.t_compute >= self.t_memory and self.t_compute > 0 else "memory"

    @property
    def bound(self) -> str:
        if self.t_dispatch > max(self.t_compute, self.t_memory):
            return "dispatch"
        return self.roof_class


def roofline(flops: float, nbytes: float, peak: float, bandwidth: float, dispatch_s: float,
             efficiency: float = 1.0) -> Roofline:
    """Times of the compute roof, the memory roof and dispatch (see module docstring)."""
    if peak <= 0 or bandwidth <= 0 or efficiency <= 0:
        raise ValueError("peak, bandwidth and efficiency must be > 0")
    return Roofline(flops / (peak * efficiency), nbytes / (bandwidth * efficiency), dispatch_s)
