"""The run-time situation of an SoC — failed devices, temperatures, throttled clocks, load from other work — and
the profile that describes the SoC *in* that situation, so the unchanged cost model and placement plan for it.

``situated_soc(soc, situation)`` returns a :class:`SocProfile` with

* failed devices (and their links) removed — placement then only sees the survivors;
* each device's ``temp_c`` set, so every cost estimate applies Φ(T) (hot devices cost more energy);
* each device's peak rates scaled by its clock fraction (a throttled device is slower) and by the share of it
  left after other work's load (``1 − load``; bandwidth too).

Situations are hashable (plans are cached per situation) and print as one short readable key.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hetforge.errors import UsageError
from hetforge.hardware.profile import SocProfile


@dataclass(frozen=True)
class Situation:
    """What is different from the nominal SoC. Empty = nominal."""

    failed: frozenset[str] = frozenset()
    temps: tuple[tuple[str, float], ...] = ()  # (device, °C) for devices whose temperature matters
    clocks: tuple[tuple[str, float], ...] = ()  # (device, clock fraction in (0, 1]) for throttled devices
    loads: tuple[tuple[str, float], ...] = ()  # (device, fraction in [0, 1) taken by other work)

    @classmethod
    def make(cls, failed=(), temps: dict[str, float] | None = None, clocks: dict[str, float] | None = None,
             loads: dict[str, float] | None = None) -> Situation:
        return cls(frozenset(failed), tuple(sorted((temps or {}).items())),
                   tuple(sorted((k, v) for k, v in (clocks or {}).items() if v != 1.0)),
                   tuple(sorted((k, v) for k, v in (loads or {}).items() if v > 0)))

    @property
    def nominal(self) -> bool:
        return not (self.failed or self.temps or self.clocks or self.loads)

    def key(self) -> str:
        parts = [f"failed={'+'.join(sorted(self.failed))}"] if self.failed else []
        parts += [f"{d}@{t:g}C" for d, t in self.temps]
        parts += [f"{d}:clock{c:g}" for d, c in self.clocks]
        parts += [f"{d}:load{x:g}" for d, x in self.loads]
        return ",".join(parts) or "nominal"

    def __str__(self) -> str:
        return self.key()


def survivors(soc: SocProfile, failed) -> list[str]:
    """Names of the devices of ``soc`` not in ``failed`` (each failed name checked against the SoC)."""
    for f in failed:
        soc.device(f)  # names the SoC's devices when unknown
    return [d.name for d in soc.devices if d.name not in failed]


def situated_soc(soc: SocProfile, situation: Situation) -> SocProfile:
    """``soc`` as it stands in ``situation`` (see the module docstring)."""
    if situation.nominal:
        return soc
    alive = survivors(soc, situation.failed)
    if not alive:
        raise UsageError(f"no device of SoC '{soc.name}' is left ({', '.join(sorted(situation.failed))} failed)")
    temps, clocks, loads = dict(situation.temps), dict(situation.clocks), dict(situation.loads)
    for name in (*temps, *clocks, *loads):
        soc.device(name)
    devs = []
    for d in soc.devices:
        if d.name not in alive:
            continue
        clock = clocks.get(d.name, 1.0)
        share = 1.0 - loads.get(d.name, 0.0)
        if not (0 < clock <= 1) or not (0 < share <= 1):
            raise UsageError(f"device '{d.name}': clock must be in (0, 1] and load in [0, 1), got clock {clock}, "
                             f"load {1 - share}")
        devs.append(replace(d, temp_c=temps.get(d.name, d.temp_c),
                            peak_flops={k: v * clock * share for k, v in d.peak_flops.items()},
                            mem_bandwidth=d.mem_bandwidth * share))
    links = [ln for ln in soc.links if ln.a in alive and ln.b in alive]
    return replace(soc, devices=devs, links=links)
