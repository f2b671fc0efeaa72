"""Moving a tensor between two devices of an SoC.

    unified link (or same device):  t = 0, E = 0          (zero-copy: both devices see the same DRAM)
    otherwise:                      t = latency + n / bandwidth
                                    E = n · energy_per_byte

Handing work from one device to another also costs the destination's ``switch_overhead_us`` (dispatch +
synchronisation, from the profile): :func:`switch_cost_s`.
"""

from __future__ import annotations

from hetforge.hardware.profile import DeviceProfile, LinkProfile, SocProfile


def transfer_cost(nbytes: float, link: LinkProfile) -> tuple[float, float]:
    """``(seconds, joules)`` to move ``nbytes`` over ``link``; ``(0, 0)`` when unified or nothing moves."""
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    if link.unified or nbytes == 0:
        return 0.0, 0.0
    return link.latency_s + nbytes / link.bandwidth, nbytes * link.energy_per_byte_j


def switch_cost_s(profile: SocProfile, from_device: str | DeviceProfile | None,
                  to_device: str | DeviceProfile) -> float:
    """Seconds one device change costs: ``to_device``'s ``switch_overhead_us`` (0 when the device does not change).

    ``from_device`` None (nothing ran before) costs nothing. Devices may be given by name or profile.
    """
    a = from_device.name if isinstance(from_device, DeviceProfile) else from_device
    b = to_device if isinstance(to_device, DeviceProfile) else profile.device(to_device)
    if a is None or a == b.name:
        return 0.0
    profile.device(a)  # an unknown name is an error, not a free switch
    return b.switch_overhead_us * 1e-6
