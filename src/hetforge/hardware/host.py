"""The ``host`` profile: the machine hetforge runs on, as one CPU device.

Without a calibration file, ``load_soc("host")`` returns :func:`default_host_spec`: nominal per-core figures
(every one marked ``estimate: true`` and "not calibrated") scaled by the core count and the RAM psutil
reports. ``hetforge calibrate`` measures the real figures and writes them to ``~/.cache/hetforge/host.json``.
"""

from __future__ import annotations

import os
import platform

import psutil

from hetforge.cpuinfo import fields as cpu_fields
from hetforge.hardware.schema import DeviceSpec, Figure, PositiveFigure, SocSpec

NOT_CAL = "built-in default, NOT calibrated (run `hetforge calibrate`): "
# Nominal per-core figures for a recent x86/Arm core (assumed, not measured).
FP32_PER_CORE = 50e9  # FLOP/s: 2x256-bit FMA at ~3 GHz is ~100 GFLOP/s peak; ~half is reached by GEMM libraries
BW_PER_CORE = 8e9  # B/s of DRAM bandwidth one core can pull
TDP_PER_CORE_W = 8.0
POWER_SRC = "estimate: no power sensor is read; per-core share of a typical mobile/server TDP assumed"


def cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS
        return max(1, os.cpu_count() or 1)


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo, with its x86 family, model and stepping where it has them: a VM
    often shows only a generic name ("AMD EPYC" for Zen 4 and Zen 5 alike), and results from two CPU generations
    must not read as one machine's."""
    fields = cpu_fields(cpuinfo)
    name = fields.get("model name") or platform.processor() or platform.machine()
    if all(fields.get(k) for k in ("cpu family", "model", "stepping")):
        name += f" (family {fields['cpu family']}, model {fields['model']}, stepping {fields['stepping']})"
    return name


def default_host_spec() -> SocSpec:
    """A nominal, uncalibrated host: figures per core × cores (all labelled estimates)."""
    n = cpu_count()

    def est(v: float, what: str) -> PositiveFigure:
        return PositiveFigure(value=v, source=NOT_CAL + what, estimate=True)

    dev = DeviceSpec(
        name="cpu", kind="cpu",
        peak_flops={"fp32": est(FP32_PER_CORE * n, f"{FP32_PER_CORE / 1e9:.0f} GFLOP/s per core x {n} cores"),
                    "bf16": est(FP32_PER_CORE * n / 2, "half the fp32 rate (bf16 converted on CPUs without AMX)"),
                    "int8": est(FP32_PER_CORE * n * 2, "twice the fp32 rate (VNNI/SDOT)")},
        # int4: hetforge::linear_w4 (int4 x q8 activation blocks on the native VNNI kernels; weight-only: ATen's int4
        # kernel for one row, dequantize + float GEMM for more)
        dtypes=["fp32", "bf16", "int8", "int4"],
        mem_bandwidth=est(BW_PER_CORE * n, f"{BW_PER_CORE / 1e9:.0f} GB/s per core x {n} cores"),
        mem_capacity=PositiveFigure(value=float(psutil.virtual_memory().total), source="psutil total RAM (measured)"),
        tdp_w=est(TDP_PER_CORE_W * n, POWER_SRC),
        idle_w=Figure(value=TDP_PER_CORE_W * n * 0.1, source=POWER_SRC, estimate=True),
        dispatch_s=Figure(value=5e-6, source=NOT_CAL + "typical eager dispatch of one ATen op", estimate=True),
    )
    return SocSpec(name="host", description=f"this machine: {cpu_name()}, {n} cores (uncalibrated default)",
                   source=NOT_CAL.rstrip(": "), calibrated=False, devices=[dev], links=[])
