"""Backend specs and the default device → backend mapping for an SoC on this host.

A backend spec is a string: ``torch-cpu``, ``torch-cuda[:N]``, ``openvino:CPU|GPU|NPU``, or
``emulated:<stand-in spec>`` (e.g. ``emulated:openvino:CPU``). The default mapping for a device:

* cpu → ``torch-cpu`` (the host CPU, real);
* gpu → ``torch-cuda`` if PyTorch sees a CUDA device, else ``openvino:GPU`` if OpenVINO has a GPU plugin, else
  ``emulated:torch-cpu``;
* npu → ``openvino:NPU`` if OpenVINO has an NPU plugin, else ``emulated:openvino:CPU`` (OpenVINO is what would
  compile for a real NPU; without OpenVINO installed the plan says how to get it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetforge.backends.base import Backend
from hetforge.backends.openvino import available_plugins
from hetforge.errors import UsageError

BACKEND_SPECS = ("torch-cpu", "torch-cpu:fx", "torch-cuda", "torch-cuda:N", "openvino:CPU", "openvino:GPU",
                 "openvino:NPU",
                 "emulated:torch-cpu", "emulated:openvino:CPU")


@dataclass
class Binding:
    """One SoC device bound to a backend on this host."""

    device: str
    kind: str
    spec: str
    backend: Backend
    emulated: bool
    why: str

    def to_dict(self) -> dict:
        return {"device": self.device, "kind": self.kind, "backend": self.spec, "emulated": self.emulated,
                "why": self.why}


def default_spec(kind: str) -> tuple[str, str]:
    """(spec, why) of the default backend for a device kind on this host."""
    if kind == "cpu":  # before asking OpenVINO: importing it costs ~0.2-0.5 s a CPU-only program never needs
        return "torch-cpu", "the host CPU (real)"
    plugins = available_plugins()
    if kind == "gpu":
        if torch.cuda.is_available():
            return "torch-cuda", f"CUDA device present: {torch.cuda.get_device_name(0)} (real)"
        if any(p.startswith("GPU") for p in plugins):
            return "openvino:GPU", "OpenVINO GPU plugin present (real)"
        return "emulated:torch-cpu", "no CUDA device and no OpenVINO GPU plugin: emulated on torch-cpu"
    if any(p.startswith("NPU") for p in plugins):
        return "openvino:NPU", "OpenVINO NPU plugin present (real)"
    return "emulated:openvino:CPU", "no NPU on this host: emulated on OpenVINO's CPU plugin"


def make_backend(spec: str, device=None, policy: str = "exact", precision: str = "f32") -> Backend:
    """Build the backend a spec names (``device``: the DeviceProfile an ``emulated:`` spec stands for)."""
    from hetforge.backends.emulated import EmulatedBackend
    from hetforge.backends.openvino import OpenVinoBackend
    from hetforge.backends.torch_cpu import TorchCpuBackend
    from hetforge.backends.torch_cuda import TorchCudaBackend

    if spec.startswith("emulated:"):
        if device is None:
            raise UsageError(f"backend '{spec}' stands for a device; it needs the device's profile")
        return EmulatedBackend(device, make_backend(spec[len("emulated:"):], None, policy, precision), policy)
    if spec == "torch-cpu":
        return TorchCpuBackend()
    if spec == "torch-cpu:fx":
        return TorchCpuBackend("fx")
    if spec == "torch-cuda" or spec.startswith("torch-cuda:"):
        idx = spec.partition(":")[2] or "0"
        if not idx.isdigit():
            raise UsageError(f"backend '{spec}': the CUDA index must be a number (torch-cuda:0)")
        return TorchCudaBackend(int(idx))
    if spec.startswith("openvino"):
        plugin = spec.partition(":")[2] or "CPU"
        if plugin not in ("CPU", "GPU", "NPU") and not plugin.startswith(("GPU.", "NPU.")):
            raise UsageError(f"backend '{spec}': unknown OpenVINO plugin '{plugin}'; allowed: CPU, GPU, NPU")
        return OpenVinoBackend(plugin, precision)
    raise UsageError(f"unknown backend '{spec}'; valid: {', '.join(BACKEND_SPECS)}")


def parse_overrides(items: list[str] | None, devices: list[str]) -> dict[str, str]:
    """``['npu=torch-cpu', ...]`` → {'npu': 'torch-cpu'}, checking device names."""
    out: dict[str, str] = {}
    for item in items or []:
        dev, eq, spec = item.partition("=")
        if not eq or not dev or not spec:
            raise UsageError(f"--backend '{item}' must look like DEVICE=BACKEND, e.g. npu=emulated:torch-cpu")
        if dev not in devices:
            raise UsageError(f"--backend '{item}': unknown device '{dev}'; this SoC has {', '.join(devices)}")
        out[dev] = spec
    return out


def resolve(soc, overrides: dict[str, str] | None = None, policy: str = "exact",
            precision: str = "f32") -> dict[str, Binding]:
    """Bind every device of ``soc`` to a backend (defaults, then ``overrides`` device → spec)."""
    overrides = overrides or {}
    out: dict[str, Binding] = {}
    for d in soc.devices:
        if d.name in overrides:
            spec, why = overrides[d.name], "chosen with --backend"
        else:
            spec, why = default_spec(d.kind)
        backend = make_backend(spec, d, policy, precision)
        out[d.name] = Binding(d.name, d.kind, spec, backend, spec.startswith("emulated:"), why)
    return out
