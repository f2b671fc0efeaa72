"""The validated on-disk format of an SoC profile (pydantic), and its error messages.

A profile file is JSON. Every number is a ``{"value": ..., "source": "...", "estimate": bool}`` object so
that each figure carries where it came from; ``estimate: true`` marks a figure derived by arithmetic or
assumed (per-unit power is always an estimate: no vendor publishes it). Units are SI base units:
FLOP/s (or OP/s for int8/int4), bytes/s, bytes, watts, seconds, degrees Celsius.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DTYPES = ("fp32", "fp16", "bf16", "int8", "int4")
KINDS = ("cpu", "gpu", "npu")


class Figure(BaseModel):
    """One number with its provenance."""

    model_config = ConfigDict(extra="forbid")

    value: float = Field(ge=0)
    source: str = Field(min_length=1)
    estimate: bool = False


class PositiveFigure(Figure):
    value: float = Field(gt=0)


class EfficiencyFigure(Figure):
    """A fraction of a peak the unit reaches in practice: in (0, 1]."""

    value: float = Field(gt=0, le=1)


# allowed ranges named in error messages (field name → range)
RANGES = {"compute_efficiency": "(0, 1]", "bandwidth_efficiency": "(0, 1]", "switch_overhead_us": ">= 0 (µs)",
          "dispatch_s": ">= 0 (s)", "idle_w": ">= 0 (W)", "latency_s": ">= 0 (s)", "energy_per_byte_j": ">= 0 (J)"}


class DeviceSpec(BaseModel):
    """One compute unit of an SoC as written in a profile file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[a-z][a-z0-9_-]*$")
    kind: Literal["cpu", "gpu", "npu"]
    peak_flops: dict[Literal["fp32", "fp16", "bf16", "int8", "int4"], PositiveFigure] = Field(min_length=1)
    mem_bandwidth: PositiveFigure
    mem_capacity: PositiveFigure
    tdp_w: PositiveFigure
    idle_w: Figure
    dispatch_s: Figure
    static_shapes: bool = False
    dtypes: list[Literal["fp32", "fp16", "bf16", "int8", "int4"]] | None = None
    unsupported_ops: list[str] = Field(default_factory=list)
    unsupported_ops_source: str = ""
    efficiency: dict[str, float] = Field(default_factory=dict)
    overhead_s: dict[str, float] = Field(default_factory=dict)
    efficiency_source: str = ""
    # published/estimated per-unit efficiency and overhead terms (shipped SoCs; a calibrated host fits its own)
    compute_efficiency: EfficiencyFigure | None = None  # achieved / peak FLOP rate on large dense work
    bandwidth_efficiency: EfficiencyFigure | None = None  # achieved / peak DRAM bandwidth (STREAM-like)
    switch_overhead_us: Figure | None = None  # dispatch + synchronisation paid once per device change into this unit
    cache_bytes: PositiveFigure | None = None
    t_ref_c: float = 60.0
    thermal_sigma_c: float = Field(default=25.0, gt=0)
    cpq_threshold: float = Field(default=0.8, gt=0, le=1)

    @field_validator("efficiency")
    @classmethod
    def _positive_eff(cls, v: dict[str, float]) -> dict[str, float]:
        for k, x in v.items():
            if not x > 0:
                raise ValueError(f"efficiency factor '{k}' must be > 0, got {x}")
        return v

    @field_validator("overhead_s")
    @classmethod
    def _nonneg_overhead(cls, v: dict[str, float]) -> dict[str, float]:
        for k, x in v.items():
            if not x >= 0:
                raise ValueError(f"overhead_s '{k}' must be >= 0, got {x}")
        return v

    @model_validator(mode="after")
    def _idle_below_tdp(self) -> DeviceSpec:
        if self.idle_w.value > self.tdp_w.value:
            raise ValueError(f"idle_w ({self.idle_w.value}) exceeds tdp_w ({self.tdp_w.value})")
        return self


class LinkSpec(BaseModel):
    """A data path between two devices of the SoC."""

    model_config = ConfigDict(extra="forbid")

    a: str
    b: str
    unified: bool
    bandwidth: PositiveFigure
    latency_s: Figure
    energy_per_byte_j: Figure


# the thermal section (hetforge.thermal): a lumped RC per device; the ranges are physical plausibility bounds
RANGES.update({"ambient_c": "[-40, 60] (°C)", "r_k_per_w": "(0, 50] (K/W)", "c_j_per_k": "(0, 10000] (J/K)",
               "throttle_c": "[40, 125] (°C)", "hysteresis_c": "[0, 30] (°C)", "throttled_clock": "(0, 1]"})


class AmbientFigure(Figure):
    value: float = Field(ge=-40, le=60)


class ResistanceFigure(Figure):
    value: float = Field(gt=0, le=50)


class CapacitanceFigure(Figure):
    value: float = Field(gt=0, le=10000)


class ThrottleFigure(Figure):
    value: float = Field(ge=40, le=125)


class HysteresisFigure(Figure):
    value: float = Field(ge=0, le=30)


class ClockFigure(Figure):
    value: float = Field(gt=0, le=1)


class ThermalDeviceSpec(BaseModel):
    """One device's lumped thermal RC: junction-to-ambient resistance, heat capacity, throttle point and clock."""

    model_config = ConfigDict(extra="forbid")

    r_k_per_w: ResistanceFigure  # steady-state rise per watt (K/W)
    c_j_per_k: CapacitanceFigure  # heat capacity of die + spreader share (J/K); τ = R·C
    throttle_c: ThrottleFigure  # the firmware throttles the clock above this temperature
    hysteresis_c: HysteresisFigure  # ... and releases it this far below
    throttled_clock: ClockFigure  # clock while throttled, as a fraction of the full clock


class ThermalSpec(BaseModel):
    """The SoC's thermal section: ambient temperature and a lumped RC per device."""

    model_config = ConfigDict(extra="forbid")

    ambient_c: AmbientFigure
    devices: dict[str, ThermalDeviceSpec] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _throttle_above_ambient(self) -> ThermalSpec:
        for name, d in self.devices.items():
            if d.throttle_c.value <= self.ambient_c.value:
                raise ValueError(f"thermal.devices.{name}.throttle_c ({d.throttle_c.value}) must be above "
                                 f"thermal.ambient_c ({self.ambient_c.value})")
        return self


class SocSpec(BaseModel):
    """A whole SoC profile file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    description: str = ""
    source: str = ""
    calibrated: bool = False
    devices: list[DeviceSpec] = Field(min_length=1)
    links: list[LinkSpec] = Field(default_factory=list)
    thermal: ThermalSpec | None = None

    @model_validator(mode="after")
    def _consistent(self) -> SocSpec:
        names = [d.name for d in self.devices]
        for t in (self.thermal.devices if self.thermal is not None else {}):
            if t not in names:
                raise ValueError(f"thermal.devices: unknown device '{t}'; devices are {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"device names must be unique, got {names}")
        for ln in self.links:
            for end in (ln.a, ln.b):
                if end not in names:
                    raise ValueError(f"link {ln.a}<->{ln.b}: unknown device '{end}'; devices are {names}")
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if not any({ln.a, ln.b} == {a, b} for ln in self.links):
                    raise ValueError(f"no link between '{a}' and '{b}': every pair of devices needs one")
        return self


def format_validation_error(path: str, err) -> str:
    """Turn a pydantic ValidationError into one line naming the file, each field and the allowed values."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"]
        typ = e.get("type", "")
        if typ == "missing":
            msg = "missing (required field)"
        elif typ == "literal_error":
            ctx = e.get("ctx", {})
            msg = f"got {e.get('input')!r}; allowed values: {ctx.get('expected', '')}"
        elif typ == "extra_forbidden":
            msg = "unknown field (not part of the profile format)"
        elif typ in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            field = next((str(x) for x in reversed(e["loc"]) if str(x) in RANGES), None)
            allowed = RANGES[field] if field else msg.lower().removeprefix("input should be ")
            msg = f"got {e.get('input')!r}; allowed range: {allowed}"
        lines.append(f"field '{loc}': {msg}")
    return f"invalid SoC profile '{path}': " + "; ".join(lines)
