"""Moving a tensor between two devices of an SoC.

    unified link (or same device):  t = 0, E = 0          (zero-copy: both devices see the same DRAM)
    otherwise:                      t = latency + n / bandwidth
                                    E = n · energy_per_byte
"""

from __future__ import annotations

from hetforge.hardware.profile import LinkProfile


def transfer_cost(nbytes: float, link: LinkProfile) -> tuple[float, float]:
    """``(seconds, joules)`` to move ``nbytes`` over ``link``; ``(0, 0)`` when unified or nothing moves."""
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    if link.unified or nbytes == 0:
        return 0.0, 0.0
    return link.latency_s + nbytes / link.bandwidth, nbytes * link.energy_per_byte_j
