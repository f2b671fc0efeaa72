"""Thermal efficiency factor Φ(T) (QEIL v2).

Leakage current rises steeply with temperature; the model stands for it with a Gaussian decay of
efficiency above a reference temperature:

    Φ(T) = 1                                   for T ≤ T_ref (or T unknown)
    Φ(T) = exp(−((T − T_ref) / σ)² / 2)        for T > T_ref

Energy is divided by Φ, so a hot device costs more. Defaults: T_ref = 60 °C, σ = 25 °C (per device in the
profile: ``t_ref_c``, ``thermal_sigma_c``). Φ is floored at 1e-3 to keep energies finite.
"""

from __future__ import annotations

import math

PHI_FLOOR = 1e-3


def phi(temp_c: float | None, t_ref_c: float = 60.0, sigma_c: float = 25.0) -> float:
    """Φ(T) as in the module docstring."""
    if temp_c is None or temp_c <= t_ref_c:
        return 1.0
    if sigma_c <= 0:
        raise ValueError("thermal sigma must be > 0")
    return max(PHI_FLOOR, math.exp(-0.5 * ((temp_c - t_ref_c) / sigma_c) ** 2))
