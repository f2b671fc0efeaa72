"""A lumped thermal RC model per device: temperature from modeled power over time, and clock throttling.

Each device is one thermal node with a junction-to-ambient resistance ``R`` (K/W) and a heat capacity ``C``
(J/K)::

    C · dT/dt = P(t) − (T − T_ambient) / R

For a power held constant over a step ``dt`` the exact solution is used (stable for any step)::

    T(t + dt) = T_ss + (T(t) − T_ss) · exp(−dt / (R·C)),     T_ss = T_ambient + R · P

The firmware throttles a device whose temperature reaches ``throttle_c``: its clock drops to
``throttled_clock`` of the full clock until it cools ``hysteresis_c`` below the throttle point. Each entry
into the throttled state is one *throttling event*.

The parameters come from the profile's ``thermal`` section (every figure with its source; the shipped ones
are labelled estimates). A profile without one (``host``, a calibrated profile) gets the same estimate rule
the shipped profiles use, said so in ``sources``: ambient 25 °C, throttle 95 °C, R such that a third of TDP
settles at the throttle point, τ = R·C = 30 s, throttled clock 0.6, hysteresis 5 °C.

Every temperature and power here is **modeled**: no machine here has a thermal sensor or power meter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hetforge.cost.thermal import phi

DEFAULT_AMBIENT_C = 25.0
DEFAULT_THROTTLE_C = 95.0
DEFAULT_TAU_S = 30.0
DEFAULT_CLOCK = 0.6
DEFAULT_HYSTERESIS_C = 5.0


@dataclass(frozen=True)
class DeviceThermal:
    """One device's thermal node and its cost-model terms (Φ reference and width, idle power)."""

    name: str
    r_k_per_w: float
    c_j_per_k: float
    throttle_c: float
    hysteresis_c: float
    throttled_clock: float
    t_ref_c: float
    sigma_c: float
    idle_w: float
    tdp_w: float

    @property
    def tau_s(self) -> float:
        return self.r_k_per_w * self.c_j_per_k

    def phi(self, temp_c: float) -> float:
        """Φ(T) of the cost model (:mod:`hetforge.cost.thermal`) at ``temp_c``."""
        return phi(temp_c, self.t_ref_c, self.sigma_c)

    def steady_c(self, ambient_c: float, power_w: float) -> float:
        return ambient_c + self.r_k_per_w * power_w

    def advance(self, temp_c: float, ambient_c: float, power_w: float, dt_s: float) -> float:
        """Temperature after ``dt_s`` seconds at constant ``power_w`` (exact RC step)."""
        ss = self.steady_c(ambient_c, power_w)
        return ss + (temp_c - ss) * math.exp(-dt_s / self.tau_s)


@dataclass(frozen=True)
class ThermalParams:
    """The SoC's ambient temperature and one :class:`DeviceThermal` per device, with where each came from."""

    soc: str
    ambient_c: float
    devices: dict[str, DeviceThermal]
    sources: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def to_dict(self) -> dict[str, Any]:
        return {"soc": self.soc, "ambient_c": self.ambient_c, "figure": "modeled",
                "devices": {n: {"r_k_per_w": d.r_k_per_w, "c_j_per_k": d.c_j_per_k, "tau_s": d.tau_s,
                                "throttle_c": d.throttle_c, "hysteresis_c": d.hysteresis_c,
                                "throttled_clock": d.throttled_clock, "t_ref_c": d.t_ref_c, "sigma_c": d.sigma_c}
                            for n, d in self.devices.items()},
                "sources": self.sources}


def thermal_params(soc) -> ThermalParams:
    """The thermal parameters of ``soc`` (a :class:`~hetforge.hardware.SocProfile`): its ``thermal`` section, or
    the documented estimate rule for a device (or a profile) without one."""
    section = (soc.spec or {}).get("thermal") or {}
    sources: dict[str, Any] = {}
    amb = section.get("ambient_c")
    if amb is not None:
        ambient = float(amb["value"])
        sources["ambient_c"] = {k: amb[k] for k in ("source", "estimate") if k in amb}
    else:
        ambient = DEFAULT_AMBIENT_C
        sources["ambient_c"] = {"source": "estimate: no thermal section in the profile; room temperature assumed",
                                "estimate": True}
    devs: dict[str, DeviceThermal] = {}
    for d in soc.devices:
        spec = (section.get("devices") or {}).get(d.name)
        if spec is not None:
            vals = {k: float(v["value"]) for k, v in spec.items()}
            sources[d.name] = {k: {kk: v[kk] for kk in ("source", "estimate") if kk in v} for k, v in spec.items()}
        else:
            r = (DEFAULT_THROTTLE_C - ambient) / (d.tdp_w / 3)
            vals = {"r_k_per_w": r, "c_j_per_k": DEFAULT_TAU_S / r, "throttle_c": DEFAULT_THROTTLE_C,
                    "hysteresis_c": DEFAULT_HYSTERESIS_C, "throttled_clock": DEFAULT_CLOCK}
            sources[d.name] = {"source": "estimate: no thermal entry for this device in the profile; hetforge's "
                                         "default rule (throttle 95 °C, a third of TDP settles at it, τ 30 s, "
                                         "clock 0.6, hysteresis 5 °C)", "estimate": True}
        devs[d.name] = DeviceThermal(d.name, vals["r_k_per_w"], vals["c_j_per_k"], vals["throttle_c"],
                                     vals["hysteresis_c"], vals["throttled_clock"], d.t_ref_c, d.thermal_sigma_c,
                                     d.idle_w, d.tdp_w)
    return ThermalParams(soc.name, ambient, devs, sources)


@dataclass
class ThermalState:
    """Temperatures and throttle states of every device over time (all modeled)."""

    params: ThermalParams
    temps: dict[str, float] = field(default_factory=dict)
    throttled: dict[str, bool] = field(default_factory=dict)
    events: list[tuple[float, str, float]] = field(default_factory=list)  # (time s, device, temperature) onsets
    now_s: float = 0.0

    def __post_init__(self) -> None:
        for n in self.params.devices:
            self.temps.setdefault(n, self.params.ambient_c)
            self.throttled.setdefault(n, False)

    def clock(self, device: str) -> float:
        """The device's clock as a fraction of full (1, or its throttled clock)."""
        d = self.params.devices[device]
        return d.throttled_clock if self.throttled[device] else 1.0

    def step(self, power_w: dict[str, float], dt_s: float) -> list[str]:
        """Advance ``dt_s`` seconds with each device at ``power_w`` (idle power where not given); return the
        devices that started throttling in this step."""
        started = []
        self.now_s += dt_s
        for n, d in self.params.devices.items():
            p = power_w.get(n, d.idle_w)
            self.temps[n] = d.advance(self.temps[n], self.params.ambient_c, p, dt_s)
            t = self.temps[n]
            if not self.throttled[n] and t >= d.throttle_c:
                self.throttled[n] = True
                self.events.append((self.now_s, n, t))
                started.append(n)
            elif self.throttled[n] and t <= d.throttle_c - d.hysteresis_c:
                self.throttled[n] = False
        return started

    def predict(self, power_w: dict[str, float], horizon_s: float) -> dict[str, float]:
        """Each device's temperature after ``horizon_s`` at constant ``power_w`` (no throttling assumed)."""
        return {n: d.advance(self.temps[n], self.params.ambient_c, power_w.get(n, d.idle_w), horizon_s)
                for n, d in self.params.devices.items()}
