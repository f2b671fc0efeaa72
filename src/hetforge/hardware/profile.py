"""Device, link and SoC profiles: the hardware description every other stage reads.

Profiles are immutable dataclasses built from a validated file (:mod:`hetforge.hardware.schema`).
``sources`` keeps, for every number, where it came from and whether it is an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hetforge.errors import UsageError

FLOAT_FALLBACK = ("fp16", "bf16", "fp32")
# GEMM row bands (M = output rows): calibration fits one efficiency per band, key ``matmul:<band>``, because
# skinny products reuse each weight element less and run further below the peak than square ones
ROW_BANDS: tuple[tuple[int | None, str], ...] = ((8, "rows<8"), (64, "rows<64"), (None, "rows>=64"))


def row_band(rows: int) -> str:
    """The GEMM row band of a product with ``rows`` output rows (``rows<8``, ``rows<64`` or ``rows>=64``)."""
    return next(name for lim, name in ROW_BANDS if lim is None or rows < lim)


@dataclass(frozen=True)
class DeviceProfile:
    """One compute unit (CPU cluster, GPU, NPU) of an SoC.

    ``peak_flops`` holds only the rates the file gives (FLOP/s, or OP/s for int8/int4);
    :meth:`peak` falls back for a dtype the unit has no native rate for.
    ``efficiency`` maps an op name, a cost group (``matmul``, ``attention``, ``elementwise``,
    ``reduction``, ``movement``, ``view``) or an op class (``compute``/``memory``/``control``) to a factor
    that scales both peak rate and bandwidth in the roofline (1.0 when absent); ``overhead_s`` maps the same
    keys to a fixed time added to the dispatch overhead (0 when absent). Both are fitted by calibration.
    Calibration also writes the in-program fixed-cost factors (``efficiency['seq:warm']``,
    ``efficiency['seq:cold']``, ``overhead_s['seq:first']``, ``overhead_s['seq:first-tau']``), the cache-hit
    byte cost (``efficiency['cache-hit']``) that :mod:`hetforge.cost` uses with ``cache_bytes`` (the last-level
    cache), and the per-weight-row cost of products (``overhead_s['matmul:per-row']``).
    ``compute_efficiency`` and ``bandwidth_efficiency`` (in (0, 1]) scale the peak rate and the bandwidth
    separately (published or estimated per-unit terms, ``sources`` says which); ``switch_overhead_us`` is the
    cost of handing work to this unit from another one (:func:`hetforge.cost.transfer.switch_cost_s`).
    """

    name: str
    kind: str
    peak_flops: dict[str, float]
    mem_bandwidth: float
    mem_capacity: int
    tdp_w: float
    idle_w: float
    dispatch_s: float
    static_shapes: bool = False
    dtypes: frozenset[str] = frozenset()
    unsupported_ops: frozenset[str] = frozenset()
    efficiency: dict[str, float] = field(default_factory=dict)
    overhead_s: dict[str, float] = field(default_factory=dict)
    cache_bytes: float = 0.0  # last-level cache (bytes); 0 = unknown (no cache-context terms in the cost model)
    compute_efficiency: float = 1.0  # achieved / peak FLOP rate (profile term; 1 = plain roofline)
    bandwidth_efficiency: float = 1.0  # achieved / peak DRAM bandwidth
    switch_overhead_us: float = 0.0  # dispatch + synchronisation per device change into this unit (µs)
    t_ref_c: float = 60.0
    thermal_sigma_c: float = 25.0
    cpq_threshold: float = 0.8
    temp_c: float | None = None  # the unit's current temperature (hetforge.thermal); None = unknown, Φ = 1
    sources: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False, hash=False)

    def __hash__(self) -> int:
        return hash((self.name, self.kind, self.mem_bandwidth, self.mem_capacity))

    def supports(self, op_name: str) -> bool:
        """True when the registry says this device kind can run ``op_name``, the profile does not exclude it, and,
        for a quantized op, the device lists its integer weight/activation types (e.g. int8, int4).

        An op the registry does not know is assumed runnable (it will be costed as a control op).
        """
        from hetforge.ops.registry import lookup

        if op_name in self.unsupported_ops:
            return False
        info = lookup(op_name)
        if info is None:
            return True
        if self.kind not in info.devices:
            return False
        return not self.quant_gaps(op_name)

    def quant_gaps(self, op_name: str) -> list[str]:
        """What a quantized op needs that this unit lacks, e.g. ``["weights in int4"]``; empty for other ops.

        Integer activations need the unit to compute in that type (it must be in ``dtypes``). Weight-only formats
        are unpacked to a float type inside the kernel, which any programmable CPU or GPU does (llama.cpp's
        Q4_0 / Q8_0 run on every CPU and GPU backend), so only an NPU must list the weight type. A profile
        without ``dtypes`` constrains nothing.
        """
        from hetforge.ops.registry import lookup

        info = lookup(op_name)
        if info is None or not info.attrs.get("quantized") or not self.dtypes:
            return []
        gaps = []
        for role, label in (("weight_dtype", "weights"), ("act_dtype", "activations")):
            want = str(info.attrs.get(role, ""))
            if not want.startswith("int") or want in self.dtypes:
                continue
            if role == "weight_dtype" and self.kind in ("cpu", "gpu"):
                continue
            gaps.append(f"{label} in {want}")
        return gaps

    def peak(self, dtype: str) -> float:
        """Peak rate for ``dtype``; without a native rate, the best floating-point rate the unit has.

        (An fp32 graph on an fp16-only NPU runs at the NPU's fp16 rate after conversion.)
        """
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        for d in FLOAT_FALLBACK:
            if d in self.peak_flops:
                return self.peak_flops[d]
        return max(self.peak_flops.values())

    @property
    def ridge(self) -> float:
        """Ridge point π/β in FLOP/byte at fp32 (or the fallback rate)."""
        return self.peak("fp32") / self.mem_bandwidth

    def eff(self, *keys: str) -> float:
        """First efficiency factor found among ``keys`` (most specific first), else 1.0."""
        for k in keys:
            if k in self.efficiency:
                return self.efficiency[k]
        return 1.0

    def overhead(self, *keys: str) -> float:
        """First fixed per-op overhead found among ``keys`` (most specific first), else 0."""
        for k in keys:
            if k in self.overhead_s:
                return self.overhead_s[k]
        return 0.0


@dataclass(frozen=True)
class LinkProfile:
    """A data path between two devices: bandwidth (B/s), latency (s), or unified memory (zero-copy)."""

    a: str
    b: str
    bandwidth: float
    latency_s: float
    unified: bool
    energy_per_byte_j: float = 0.0


def by_name(items: list, name: str, owner: str, kind: str):
    """The item of ``items`` whose ``.name`` is ``name``; else a UsageError naming ``owner`` and the ``kind``s
    it has (a SoC's devices, a cluster's nodes)."""
    for it in items:
        if it.name == name:
            return it
    raise UsageError(f"{owner} has no {kind} '{name}'; {kind}s: {', '.join(it.name for it in items)}")


@dataclass(frozen=True)
class SocProfile:
    """A whole SoC: its devices (CPU first) and the links between them."""

    name: str
    devices: list[DeviceProfile]
    links: list[LinkProfile]
    description: str = ""
    source: str = ""
    calibrated: bool = False
    path: str = ""
    spec: dict[str, Any] | None = field(default=None, repr=False, compare=False)  # the validated file, as JSON

    def __hash__(self) -> int:
        return hash((self.name, self.path))

    @property
    def device_names(self) -> list[str]:
        return [d.name for d in self.devices]

    def device(self, name: str) -> DeviceProfile:
        return by_name(self.devices, name, f"SoC '{self.name}'", "device")

    def link(self, a: str, b: str) -> LinkProfile:
        """The link between devices ``a`` and ``b``; ``a == b`` is a unified, zero-cost link."""
        self.device(a)
        self.device(b)
        if a == b:
            return LinkProfile(a, b, float("inf"), 0.0, True, 0.0)
        for ln in self.links:
            if {ln.a, ln.b} == {a, b}:
                return ln
        raise UsageError(f"SoC '{self.name}' has no link between '{a}' and '{b}'")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "description": self.description, "source": self.source,
            "calibrated": self.calibrated, "path": self.path,
            "devices": [
                {"name": d.name, "kind": d.kind, "peak_flops": d.peak_flops, "mem_bandwidth": d.mem_bandwidth,
                 "mem_capacity": d.mem_capacity, "tdp_w": d.tdp_w, "idle_w": d.idle_w, "dispatch_s": d.dispatch_s,
                 "static_shapes": d.static_shapes, "dtypes": sorted(d.dtypes),
                 "unsupported_ops": sorted(d.unsupported_ops), "efficiency": d.efficiency,
                 "overhead_s": d.overhead_s, "cache_bytes": d.cache_bytes, "sources": d.sources}
                for d in self.devices
            ],
            "links": [{"a": ln.a, "b": ln.b, "bandwidth": ln.bandwidth, "latency_s": ln.latency_s,
                       "unified": ln.unified, "energy_per_byte_j": ln.energy_per_byte_j} for ln in self.links],
        }
