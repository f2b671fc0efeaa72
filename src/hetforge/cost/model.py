"""Per-op cost on one device: FLOPs, bytes, arithmetic intensity, roofline time, DASI and energy.

For an op with registry entry ``info`` on device ``d`` (formulas in the sibling modules):

    F, B      = info.flops(call), (0 if info.is_view else info.nbytes(call))
    keys      = (op variant, op name, 'matmul:<row band>', 'group:roof class', group, class)   (op_keys)
    e         = d.eff(*keys)                                         (first key present; 1.0 when none)
    o         = d.overhead(*keys)                                    (fixed per-op time; 0 when none)
    B'        = B − (1 − h)·hot_bytes  (+ R·c·β·e, matmul group)    h = d.efficiency['cache-hit'] (1 when absent)
    t         = max(F / (π[dtype]·ce·e), B' / (β·be·e)) + s·(dispatch + o)
                (roofline.py; ce, be = d.compute_efficiency, d.bandwidth_efficiency: the profile's per-unit terms,
                 1 when absent; s = d.efficiency['seq:warm'], 1 when absent: fixed costs inside a program)
    DASI      = clip(AI / (π/β), 0, 1)                               (energy.py)
    E         = P_TDP · (0.3 + 0.7·DASI) · t / Φ(T) · penalty(CPQ)   (energy.py, thermal.py, memory_pressure.py)

A native kernel (``native=True``) with a string argument ``a`` (its activation) also pays
``overhead_s['native:<op>:act:<a>']`` seconds per output element (measured by ``hetforge calibrate``).
A matmul-group op also pays ``c = overhead_s['matmul:per-row']`` per row ``R`` of its weight in memory order
(:func:`weight_rows`), in its memory time: one-row products (GEMVs) stream a weight row by row. ``hot_bytes``
(inputs in the last-level cache) comes from a caller that tracks the program (:mod:`hetforge.cost.context`).
The op variant is ``op:<string arguments>`` (``aten.gelu.default:tanh``: the tanh GELU is ~4× slower than
the exact one on a CPU); the row band (``rows<8``, ``rows<64``, ``rows>=64``) is that of the output rows of
a matmul-group op. On a device of kind ``cpu``, a composite op — a ``hetforge::`` op, which the executor runs
as its Python reference, or an ATen op marked ``composite`` (``scaled_dot_product_attention``) — is costed
as the sum of the ATen ops its implementation runs (:mod:`hetforge.cost.composite`): time and energy are
the sums over those ops, F and B stay the op's own formulas.

An op with no registry entry is costed as a control op: ``F = B = 0``, ``t = dispatch``, ``known = False``;
its name is remembered in :data:`UNKNOWN_OPS` so callers can warn (it is never silently free).
Control ops (asserts, device moves) and views cost one dispatch; a ``reshape``/``flatten`` node whose input
strides do not allow a view is costed as a copy (group ``movement``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from hetforge.cost.composite import decompose
from hetforge.cost.energy import dasi as dasi_of
from hetforge.cost.energy import stage_energy
from hetforge.cost.memory_pressure import cpq, cpq_penalty
from hetforge.cost.roofline import arithmetic_intensity, roofline
from hetforge.cost.thermal import phi
from hetforge.hardware.profile import DeviceProfile, row_band
from hetforge.ops.registry import OpCall, OpInfo, TensorMeta, lookup, op_call_from_node

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
    fixed_s: float = 0.0  # dispatch + fitted overhead, before the in-program factor (the part cache context scales)

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


def weight_rows(call: OpCall) -> int:
    """Rows of a product's weight in memory order: dim 0 of its last 2-D tensor argument (``linear``'s
    ``[N, K]``, ``addmm``/``mm``'s ``[K, N]``); 0 when it has none."""
    mats = [a for a in call.args if isinstance(a, TensorMeta) and len(a.shape) == 2]
    return mats[-1].shape[0] if mats else 0


def op_keys(call: OpCall, group: str, roof_class: str, op_class: str) -> tuple[str, ...]:
    """Efficiency/overhead keys for ``call``, most specific first (see the module docstring)."""
    keys = []
    strs = [a for a in (*call.args, *call.kwargs.values()) if isinstance(a, str)]
    if strs:
        keys.append(f"{call.op}:{','.join(strs)}")
    keys.append(call.op)
    if group == "matmul" and call.outputs and call.outputs[0].shape:
        out = call.outputs[0]
        keys.append(f"matmul:{row_band(out.numel // max(1, out.shape[-1]))}")
    keys += [f"{group}:{roof_class}", group, op_class]
    return tuple(keys)


def estimate(call_or_node: OpCall | torch.fx.Node, device: DeviceProfile, temp_c: float | None = None,
             resident_bytes: float | None = None, hot_bytes: float = 0.0) -> OpCost:
    """Predict time and energy of one op (an :class:`OpCall` or a ``call_function`` FX node) on ``device``.

    ``resident_bytes`` (for CPQ) defaults to the op's own bytes; pass the bytes kept on the device
    (weights + live activations) for a meaningful memory-pressure penalty. ``hot_bytes``: bytes of the
    inputs known to be in the last-level cache (a caller that tracks the program, :mod:`hetforge.cost.context`);
    they cost ``efficiency['cache-hit']`` of a DRAM byte. Non-op FX nodes (placeholder, get_attr, output)
    cost nothing. A composite op on a CPU is the sum of :func:`estimate_parts`.
    """
    parts = estimate_parts(call_or_node, device, temp_c, resident_bytes, hot_bytes)
    if len(parts) == 1:
        return parts[0][1]
    whole = parts[0][1]
    main = max((c for _, c in parts[1:]), key=lambda c: c.time_s)
    return replace(whole, time_s=sum(c.time_s for _, c in parts[1:]), energy_j=sum(c.energy_j for _, c in parts[1:]),
                   bound=main.bound, fixed_s=sum(c.fixed_s for _, c in parts[1:]))


def estimate_parts(call_or_node: OpCall | torch.fx.Node, device: DeviceProfile, temp_c: float | None = None,
                   resident_bytes: float | None = None, hot_bytes: float = 0.0,
                   native: bool = False, fused: bool = False,
                   first_keys: tuple[str, ...] = ()) -> list[tuple[str, OpCost]]:
    """``[(op, cost)]`` of what runs: one entry for an op that is one kernel; for a composite op on a CPU
    (:mod:`hetforge.cost.composite`) the op itself (its F, B and class, time 0) followed by every ATen op its
    implementation runs, each costed on its own (an intermediate it reads was just written: hot).

    ``native``: the executor runs the op as one native kernel (:mod:`hetforge.kernels.native`): one roofline
    over the op's F and B under the calibrated ``native`` efficiency and overhead, not its ATen parts.

    ``fused``: the executor runs the op as one library kernel with its activation (and a gated MLP's product)
    fused in — oneDNN's packed linear (mode ``onednn``, :mod:`hetforge.executor.onednn`): one roofline over
    the op's F and B under its ordinary keys (a product's ``matmul:<row band>``, calibrated on the kernel the
    executor picks), not the GEMM, activation and copies of its Python implementation.

    ``first_keys``: efficiency/overhead keys looked up before the op's own (what the caller knows about the
    kernel that runs: ``aten:matmul:<row band>`` for a product the executor kept on ATen's ``linear``,
    ``aten.copy_.default:strided`` for a copy that reads a permuted view)."""
    if temp_c is None:  # a device profile may carry its temperature (hetforge.thermal): Φ(T) in every estimate
        temp_c = device.temp_c
    if isinstance(call_or_node, torch.fx.Node):
        if call_or_node.op != "call_function":
            return [(call_or_node.op, OpCost(call_or_node.op, device.name, 0.0, 0.0, 0.0, "control", 0.0, 0.0, 0.0,
                                             "dispatch", True, "control"))]
        call = op_call_from_node(call_or_node)
        copies = call.op in _MAYBE_COPY and view_copies(call_or_node)
    else:
        call = call_or_node
        copies = False
    info = lookup(call.op)
    if info is None:
        UNKNOWN_OPS.add(call.op)
        return [(call.op, _dispatch_only(call.op, device, temp_c, known=False))]
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
    pre = roofline(flops, nbytes, peak * device.compute_efficiency,
                   device.mem_bandwidth * device.bandwidth_efficiency, device.dispatch_s)
    op_class = "control" if info.op_class == "control" else pre.roof_class
    d = dasi_of(ai, peak, device.mem_bandwidth)
    subs = decompose(call, info) if device.kind == "cpu" and not copies and not native and not fused else None
    if subs:
        out = [(call.op, OpCost(call.op, device.name, flops, nbytes, ai, op_class, 0.0, 0.0, d, pre.bound, True,
                                group, dt))]
        for sub, hot in subs:
            sinfo = lookup(sub.op)
            c = (_dispatch_only(sub.op, device, temp_c, known=False) if sinfo is None
                 else estimate(sub, device, temp_c, resident_bytes, hot))
            out.append((sub.op, c))
        return out
    keys = op_keys(call, group, pre.roof_class, op_class)
    if native:
        keys = (f"native:{call.op}", "native", *keys)
    keys = (*first_keys, *keys)
    fixed = device.dispatch_s + device.overhead(*keys)
    act_s = 0.0
    if native:  # a native kernel's activation: calibrated seconds per output element (hardware/calibrate.py)
        per_out = sum(device.overhead_s.get(f"native:{call.op}:act:{a}", 0.0) for a in call.args if isinstance(a, str))
        act_s = per_out * sum(o.numel for o in call.outputs)
    eff = device.eff(*keys)
    hit = min(1.0, device.efficiency.get("cache-hit", 1.0))
    b_eff = nbytes - (1.0 - hit) * min(max(hot_bytes, 0.0), call.bytes_in(), nbytes)
    per_row = device.overhead_s.get("matmul:per-row", 0.0) if group == "matmul" and not native else 0.0
    if per_row > 0:  # a product streams its weight row by row: a fixed cost per row, as bytes at β·e
        b_eff += weight_rows(call) * per_row * device.mem_bandwidth * eff
    rl = roofline(flops, b_eff, peak * device.compute_efficiency, device.mem_bandwidth * device.bandwidth_efficiency,
                  fixed * device.efficiency.get("seq:warm", 1.0), eff)
    if act_s > 0:
        rl = replace(rl, t_dispatch=rl.t_dispatch + act_s)  # added once, not scaled as fixed costs are
    res = nbytes if resident_bytes is None else resident_bytes
    pen = cpq_penalty(cpq(res, device.mem_capacity), device.cpq_threshold)
    f = phi(temp_c, device.t_ref_c, device.thermal_sigma_c)
    energy = stage_energy(device.tdp_w, d, rl.time, f, pen)
    return [(call.op, OpCost(call.op, device.name, flops, nbytes, ai, op_class, rl.time, energy, d, rl.bound, True,
                             group, dt, fixed))]


def _dispatch_only(op: str, device: DeviceProfile, temp_c: float | None, known: bool) -> OpCost:
    """An op with no formula: one dispatch (control class)."""
    t = device.dispatch_s * device.efficiency.get("seq:warm", 1.0)
    e = stage_energy(device.tdp_w, 0.0, t, phi(temp_c, device.t_ref_c, device.thermal_sigma_c))
    return OpCost(op, device.name, 0.0, 0.0, 0.0, "control", t, e, 0.0, "dispatch", known, "control", "fp32",
                  device.dispatch_s)


def model_terms(device: DeviceProfile) -> dict[str, dict]:
    """Which per-device terms the model applies to ``device``'s figures, each with its value and provenance.

    ``compute_efficiency``/``bandwidth_efficiency`` scale π and β, ``dispatch_s`` is added per op,
    ``switch_overhead_us`` per device change into the unit; ``calibrated`` lists the fitted per-op keys
    (``efficiency``/``overhead_s``) when the profile has any. A term the profile does not give says so.
    """
    out: dict[str, dict] = {}
    for k, default in (("compute_efficiency", 1.0), ("bandwidth_efficiency", 1.0), ("dispatch_s", None),
                       ("switch_overhead_us", 0.0)):
        src = device.sources.get(k)
        val = getattr(device, k)
        if src is None:
            out[k] = {"value": val, "source": "not in the profile (default)" if default is not None else "",
                      "estimate": None}
        else:
            out[k] = {"value": val, "source": src.get("source", ""), "estimate": bool(src.get("estimate", False))}
    keys = sorted(set(device.efficiency) | set(device.overhead_s))
    out["calibrated"] = {"value": len(keys), "keys": keys,
                         "source": device.sources.get("efficiency", {}).get("source", "") if keys else "none"}
    return out
