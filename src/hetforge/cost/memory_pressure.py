"""Capacity pressure quotient CPQ and its energy penalty (QEIL v2).

    CPQ      = resident bytes / device memory capacity
    penalty  = 1                                          for CPQ ≤ θ
    penalty  = 1 + α · ((CPQ − θ) / (1 − θ))²             for CPQ > θ      (α = 4, θ = 0.8 by default)

so the penalty is 1 up to the threshold, 5 when the device is exactly full, and keeps growing past it
(swapping / eviction). It is monotone non-decreasing in CPQ.
"""

from __future__ import annotations

ALPHA = 4.0


def cpq(resident_bytes: float, capacity_bytes: float) -> float:
    """``resident / capacity``."""
    if capacity_bytes <= 0:
        raise ValueError("capacity must be > 0")
    return max(0.0, resident_bytes) / capacity_bytes


def cpq_penalty(cpq_value: float, threshold: float = 0.8, alpha: float = ALPHA) -> float:
    """The penalty of the module docstring."""
    if not 0 < threshold < 1:
        threshold = min(max(threshold, 1e-6), 1 - 1e-6)
    if cpq_value <= threshold:
        return 1.0
    return 1.0 + alpha * ((cpq_value - threshold) / (1.0 - threshold)) ** 2
