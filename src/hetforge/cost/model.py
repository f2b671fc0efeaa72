"""Per-op cost on one device: FLOPs, bytes, arithmetic intensity, roofline time, DASI and energy.

For an op with registry entry ``info`` on device ``d`` (formulas in the sibling modules):

    F, B      = info.flops(call), (0 if info.is_view else info.nbytes(call))
    e         = d.eff(op name, 'group:roof class', group, class)      (first key present; 1.0 when none)
    o         = d.overhead(same keys)                               (fixed per-op time; 0 when none)
    t         = max(F / (π[dtype]·e), B / (β·e)) + dispatch + o      (roofline.py)
    DASI      = clip(AI / (π/β), 0, 1)                               (energy.py)
    E         = P_TDP · (0.3 + 0.7·DASI) · t / Φ(T) · penalty(CPQ)   (energy.py, thermal.py, memory_pressure.py)

An op with no registry entry is costed as a control op: ``F = B = 0``, ``t = dispatch``, ``known = False``;
its name is remembered in :data:`UNKNOWN_OPS` so callers can warn (it is never silently free).
Control ops (asserts, device moves) and views cost one dispatch; a ``reshape``/``flatten`` node whose input
strides do not allow a view is costed as a copy (group ``movement``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from hetforge.cost.energy import dasi as dasi_of
from hetforge.cost.energy import stage_energy
from hetforge.cost.memory_pressure import cpq, cpq_penalty
from hetforge.cost.roofline import arithmetic_intensity, roofline
from hetforge.cost.thermal import phi
from hetforge.hardware.profile import DeviceProfile
from hetforge.ops.registry import OpCall, OpInfo, lookup, op_call_from_node

UNKNOWN_OPS: set[str] = set()

_NAME_GROUPS = (("attention", "attention"), ("attn", "attention"), ("matmul", "matmul"), ("linear", "matmul"),
                ("gemm", "matmul"), ("mlp", "matmul"), ("norm", "norm"), ("softmax", "softmax"),
                ("rope", "elementwise"), ("rotary", "elementwise"))


@dataclass
class OpCost:
    """The modeled cost of one op on one device (all times/energies are model predictions)."""

    op: str
    device: str
    flops: float
    bytes: float
    ai: float
    op_class: str  # "compute" | "memory" | "control"
    time_s: float
    energy_j: float
    dasi: float
    bound: str  # "compute" | "memory" | "dispatch"
    known: bool
    group: str = "other"
    dtype: str = "fp32"

    def to_dict(self) -> dict:
        return asdict(self)


def dtype_key(call: OpCall, info: OpInfo | None = None) -> str:
    """The rate key an op runs at: int8 for a matmul with int8 operands, else bf16/fp16 when present, else fp32."""
    if info is not None and "dtype" in info.attrs:
        return str(info.attrs["dtype"])
    dts = {t.dtype for t in call.tensors_in()} | {t.dtype for t in call.outputs}
    if torch.int8 in dts or torch.uint8 in dts:
        if info is not None and info.attrs.get("group") in ("matmul", "attention"):
            return "int8"
    if torch.bfloat16 in dts:
        return "bf16"
    if torch.float16 in dts:
        return "fp16"
    return "fp32"


def cost_group(op: str, info: OpInfo | None) -> str:
    """The efficiency group of an op: from ``info.attrs['group']``, else guessed from its name, else its class."""
    if info is None:
        return "control"
    if "group" in info.attrs:
        return str(info.attrs["group"])
    if info.is_view:
        return "view"
    low = op.lower()
    for key, group in _NAME_GROUPS:
        if key in low:
            return group
    return "fused" if op.startswith("hetforge.") else info.op_class


_MAYBE_COPY = ("aten.reshape.default", "aten.flatten.using_ints", "aten.contiguous.default")


def view_copies(node: torch.fx.Node) -> bool:
    """True when a ``reshape``/``flatten`` node cannot be a view of its (non-contiguous) input and copies."""
    x = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
    out = node.meta.get("val")
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or x.is_contiguous():
        return False
    try:
        torch.empty_strided(tuple(x.shape), tuple(x.stride()), device="meta").view(tuple(out.shape))
    except RuntimeError:
        return True
    return False


def estimate(call_or_node: OpCall | torch.fx.Node, device: DeviceProfile, temp_c: float | None = None,
             resident_bytes: float | None = None) -> OpCost:
    """Predict time and energy of one op (an :class:`OpCall` or a ``call_function`` FX node) on ``device``.

    ``resident_bytes`` (for CPQ) defaults to the op's own bytes; pass the bytes kept on the device
    (weights + live activations) for a meaningful memory-pressure penalty. Non-op FX nodes
    (placeholder, get_attr, output) cost nothing.
    """
    if isinstance(call_or_node, torch.fx.Node):
        if call_or_node.op != "call_function":
            return OpCost(call_or_node.op, device.name, 0.0, 0.0, 0.0, "control", 0.0, 0.0, 0.0, "dispatch", True,
                          "control")
        call = op_call_from_node(call_or_node)
        copies = call.op in _MAYBE_COPY and view_copies(call_or_node)
    else:
        call = call_or_node
        copies = False
    info = lookup(call.op)
    if info is None:
        UNKNOWN_OPS.add(call.op)
        t = device.dispatch_s
        e = stage_energy(device.tdp_w, 0.0, t, phi(temp_c, device.t_ref_c, device.thermal_sigma_c))
        return OpCost(call.op, device.name, 0.0, 0.0, 0.0, "control", t, e, 0.0, "dispatch", False, "control")
    flops = float(info.flops(call))
    if copies:  # a reshape of a non-contiguous tensor is a copy: read + write
        nbytes = call.bytes_in() + call.bytes_out()
        group = "movement"
    else:
        nbytes = 0.0 if info.is_view else float(info.nbytes(call))
        group = cost_group(call.op, info)
    dt = dtype_key(call, info)
    peak = device.peak(dt)
    ai = arithmetic_intensity(flops, nbytes)
    pre = roofline(flops, nbytes, peak, device.mem_bandwidth, device.dispatch_s)
    op_class = "control" if info.op_class == "control" else pre.roof_class
    keys = (call.op, f"{group}:{pre.roof_class}", group, op_class)
    rl = roofline(flops, nbytes, peak, device.mem_bandwidth, device.dispatch_s + device.overhead(*keys),
                  device.eff(*keys))
    d = dasi_of(ai, peak, device.mem_bandwidth)
    res = nbytes if resident_bytes is None else resident_bytes
    pen = cpq_penalty(cpq(res, device.mem_capacity), device.cpq_threshold)
    f = phi(temp_c, device.t_ref_c, device.thermal_sigma_c)
    energy = stage_energy(device.tdp_w, d, rl.time, f, pen)
    return OpCost(call.op, device.name, flops, nbytes, ai, op_class, rl.time, energy, d, rl.bound, True, group, dt)
