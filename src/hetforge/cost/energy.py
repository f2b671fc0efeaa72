"""DASI and stage energy (QEIL v2, seed 004).

    ridge ρ  = π / β                                   (FLOP/byte at which the two roofs meet)
    DASI     = clip(AI / ρ, 0, 1)                      (how saturated the compute units are)
    P        = P_TDP · (0.3 + 0.7 · DASI)              (0.3: idle floor, 0.7·DASI: dynamic share)
    E_stage  = P · t / Φ(T) · penalty_cpq              (joules)
"""

from __future__ import annotations

import math


def dasi(ai: float, peak: float, bandwidth: float) -> float:
    """``clip(AI / (π/β), 0, 1)``; an op with AI = ∞ (no bytes) saturates at 1."""
    if math.isnan(ai):
        return 0.0
    ridge = peak / bandwidth
    return min(1.0, max(0.0, ai / ridge))


def stage_power(tdp_w: float, dasi_value: float) -> float:
    """``P_TDP · (0.3 + 0.7 · DASI)`` in watts."""
    return tdp_w * (0.3 + 0.7 * dasi_value)


def stage_energy(tdp_w: float, dasi_value: float, time_s: float, phi: float = 1.0, penalty_cpq: float = 1.0) -> float:
    """``P_TDP · (0.3 + 0.7·DASI) · t / Φ · penalty_cpq`` in joules."""
    if phi <= 0:
        raise ValueError("thermal factor Φ must be > 0")
    return stage_power(tdp_w, dasi_value) * time_s / phi * penalty_cpq
