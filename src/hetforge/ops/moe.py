"""``hetforge::moe``: a whole Mixture-of-Experts block as one op, executed the NPUMoE way.

The op is router + top-k (control) → dispatch into capacity slots → grouped expert FFNs → weighted combine,
plus an optional (sigmoid-gated) shared expert. Its CPU kernel is the grouped execution itself:

* **Grouped experts.** Experts ``[g0, g0 + G)`` run as *one* ``bmm`` over their stacked weights
  (``w_gate_up[g0:g1]`` is a view: no weight is gathered or copied) on slots ``[G, C, D]``, one dispatch
  per group instead of one per expert (``group_size`` ``G``; 0 = one expert per group with unlimited capacity,
  see :func:`auto_group_size`, one group of all experts with capacities). A group no token was routed to is
  skipped (a CPU fallback can; a static NPU program of the group would run it).
* **Static capacity.** ``capacity`` gives every expert (in the op's order) its slot count; a group's slots
  are the largest capacity in it (experts of one tier share it), so the group's shape is static. Tokens
  beyond an expert's capacity are dropped by importance, lowest router weight first (a dropped
  assignment contributes nothing; the residual path still carries the token). Empty ``capacity`` =
  unlimited: every assignment is kept, slots sized to the busiest expert, and the result equals eager.
* **Order.** ``order[j]`` is the original expert id stored at position ``j`` of the weights (the tiering
  step stores hot experts next to each other so that a group is a tier); empty = identity.

While :func:`recording` is active the kernel appends per-call routing statistics (tokens routed and
router-probability mass per expert, dropped assignments, used and padded slots, groups run) to the
recorder: calibration and the drop/padding report read them.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from hetforge.kernels import native, onednn
from hetforge.ops import gemv
from hetforge.ops.fused import ACTIVATIONS, apply_act
from hetforge.ops.registry import OpCall, TensorMeta, register_op

_ACT_FLOPS = {"relu": 1, "gelu": 8, "gelu_tanh": 8, "silu": 4}

# schema argument positions (the cost formulas read OpCall.args / kwargs by these)
ARG_NAMES = ("x", "router_w", "w_gate_up", "w_down", "s_gate", "s_up", "s_down", "s_router", "top_k",
             "norm_topk", "act", "transposed", "group_size", "capacity", "order", "layer")
DEFAULTS = {"top_k": 2, "norm_topk": True, "act": "silu", "transposed": False, "group_size": 0,
            "capacity": [], "order": [], "layer": -1}


@dataclass
class CallStats:
    """Routing statistics of one call of one MoE layer (expert lists in *original* expert ids)."""

    layer: int
    tokens: int
    top_k: int
    routed: list[int]  # assignments per expert (before any drop)
    mass: list[float]  # summed router probability per expert (full softmax, every token)
    dropped: int = 0  # assignments dropped by capacity
    slots: int = 0  # capacity slots computed (groups run × G × C)
    used: int = 0  # slots holding a kept assignment
    groups_run: int = 0
    groups: int = 0

    @property
    def padded(self) -> int:
        return self.slots - self.used


@dataclass
class Recorder:
    """Collects :class:`CallStats` from every ``hetforge::moe`` call while active."""

    calls: list[CallStats] = field(default_factory=list)

    def per_layer(self) -> dict[int, dict]:
        """Totals per layer: tokens, routed/mass per expert, dropped assignments, slots, padding."""
        out: dict[int, dict] = {}
        for c in self.calls:
            d = out.setdefault(c.layer, {"tokens": 0, "assignments": 0, "routed": [0] * len(c.routed),
                                         "mass": [0.0] * len(c.mass), "dropped": 0, "slots": 0, "used": 0,
                                         "groups_run": 0, "groups": 0, "calls": 0})
            d["tokens"] += c.tokens
            d["assignments"] += c.tokens * c.top_k
            d["routed"] = [a + b for a, b in zip(d["routed"], c.routed, strict=True)]
            d["mass"] = [a + b for a, b in zip(d["mass"], c.mass, strict=True)]
            for k in ("dropped", "slots", "used", "groups_run", "groups"):
                d[k] += getattr(c, k)
            d["calls"] += 1
        for d in out.values():
            d["drop_rate"] = d["dropped"] / d["assignments"] if d["assignments"] else 0.0
            d["padding_waste"] = (d["slots"] - d["used"]) / d["slots"] if d["slots"] else 0.0
        return out


_ACTIVE: list[Recorder] = []


@contextmanager
def recording() -> Iterator[Recorder]:
    """Record routing statistics of every ``hetforge::moe`` call inside the ``with`` block."""
    rec = Recorder()
    _ACTIVE.append(rec)
    try:
        yield rec
    finally:
        _ACTIVE.remove(rec)


def route(h: torch.Tensor, router_w: torch.Tensor, top_k: int, norm_topk: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router linear → softmax (float32) → top-k, renormalised over the k when ``norm_topk``."""
    probs = torch.softmax(F.linear(h, router_w).float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        w = w / w.sum(dim=-1, keepdim=True)
    return probs, w.to(h.dtype), idx


def auto_group_size(t: int, k: int, e: int) -> int:
    """``group_size=0`` with unlimited capacity: one expert per group. On a CPU an expert group of one runs on
    exactly its rows (no slots, no padding; one-row products on the native GEMV), while one static group of all
    experts pads every expert to the busiest one — measured on mixtral-small's real routing at 512 tokens, 2.9×
    slower (docs/bench/moe.md). Grouping pays where a call is expensive (an NPU: modeled by
    :mod:`hetforge.moe.residency`) or shapes must be static (capacities given: then 0 means one group)."""
    return 1


def _experts(h, w, idx, w_gate_up, w_down, act, transposed, group_size, capacity, order, stats):
    """Dispatch the ``T·k`` assignments into per-expert slots and run each group as one pair of bmm calls."""
    t, k = idx.shape
    e = w_gate_up.shape[0]
    g_size = group_size if group_size > 0 else (e if capacity else auto_group_size(t, k, e))
    if t == 1 and g_size == 1 and not capacity and not order:
        return _one_token(h, w, idx, w_gate_up, w_down, act, transposed, stats)
    out = torch.zeros_like(h)
    pos = idx
    if order:
        inv = torch.empty(e, dtype=torch.long)
        inv[torch.tensor(order, dtype=torch.long)] = torch.arange(e)
        pos = inv[idx]
    flat_e = pos.reshape(-1)
    flat_w = w.reshape(-1)
    flat_t = torch.arange(t).repeat_interleave(k)
    if capacity:
        by_weight = torch.argsort(flat_w, descending=True, stable=True)  # most important first within an expert
        perm = by_weight[torch.argsort(flat_e[by_weight], stable=True)]
    else:
        perm = torch.argsort(flat_e, stable=True)
    se = flat_e[perm]
    counts_t = torch.bincount(flat_e, minlength=e)
    counts = counts_t.tolist()
    starts = [0] * (e + 1)
    for i, c in enumerate(counts):
        starts[i + 1] = starts[i] + c
    rank = torch.arange(se.numel()) - torch.tensor(starts[:-1], dtype=torch.long)[se]
    # the experts' packed copies when groups of one run on oneDNN (decided once per call, not per expert)
    packed = _packed_list(w_gate_up, w_down) if not capacity \
        and packed_experts_on(h.dtype, w_gate_up, act, transposed) else None
    for g0 in range(0, e, g_size):
        g1 = min(g0 + g_size, e)
        a0, a1 = starts[g0], starts[g1]
        stats.groups += 1
        if a1 == a0:
            continue
        sel, le, r = perm[a0:a1], se[a0:a1] - g0, rank[a0:a1]
        if capacity:
            cap = max(capacity[g0:g1])
            keep = r < torch.tensor(capacity[g0:g1], dtype=torch.long)[le]
            n_keep = int(keep.sum())
            stats.dropped += (a1 - a0) - n_keep
            if n_keep == 0:
                continue
            if n_keep < a1 - a0:
                sel, le, r = sel[keep], le[keep], r[keep]
        else:
            cap = max(counts[g0:g1])
            n_keep = a1 - a0
        stats.groups_run += 1
        stats.slots += (g1 - g0) * cap
        stats.used += n_keep
        tok = flat_t[sel]
        if g1 - g0 == 1 and not capacity:  # a group of one expert: its rows are already contiguous, no slots
            xe = h[tok]
            y = _packed_ffn(xe, packed, w_gate_up, w_down, g0, act) if packed is not None and xe.shape[0] >= 2 \
                else _expert_ffn(xe, w_gate_up[g0], w_down[g0], act, transposed)
            out.index_add_(0, tok, y * flat_w[sel, None])
            continue
        xs = h.new_zeros((g1 - g0, cap, h.shape[-1]))
        xs[le, r] = h[tok]
        wgu, wd = w_gate_up[g0:g1], w_down[g0:g1]
        y = torch.bmm(xs, wgu if transposed else wgu.transpose(1, 2))
        gate, up = y.chunk(2, dim=-1)
        y = torch.bmm(apply_act(gate, act) * up, wd if transposed else wd.transpose(1, 2))
        out.index_add_(0, tok, y[le, r] * flat_w[sel, None])
    return out


# (w_gate_up's memory, w_down's memory) -> per expert: (gate, up, down) packed for oneDNN, or None until used
_PACKED: dict[tuple, list] = {}


def packed_experts_on(dtype: torch.dtype, w_gate_up: torch.Tensor, act: str, transposed: bool) -> bool:
    """Whether experts' rows of ``dtype`` (several per expert) run on oneDNN's packed kernels (:func:`_packed_ffn`): a
    CPU float32/bfloat16 ``[2F, D]`` expert with an activation oneDNN fuses, oneDNN here, and ``HETFORGE_GEMM`` /
    ``HETFORGE_MOE_PACKED=0`` not asking for ATen. Why: a prefill's expert products read their weights from memory
    in row counts of a few dozen to a few hundred, where the packed kernels ran the whole op faster than ATen's
    ``linear`` on shapes no evaluated model has (docs/bench/moe.md §7); the SwiGLU's product fuses into the up
    projection as in the dense gated MLP."""
    return (not transposed and w_gate_up.device.type == "cpu" and onednn.dtype_ok(dtype)
            and dtype == w_gate_up.dtype and act in onednn.ACT_ATTR and act != "none"
            and os.environ.get("HETFORGE_MOE_PACKED", "1") != "0" and onednn.policy() != "aten")


def _packed_list(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> list:
    key = (onednn._memory_key(w_gate_up, False, "moe"), onednn._memory_key(w_down, False, "moe"))
    got = _PACKED.get(key)
    if got is None:
        got = _PACKED[key] = [None] * w_gate_up.shape[0]
        for w in (w_gate_up, w_down):  # freed with either weight (keyed by their memory, which may then be reused)
            weakref.finalize(w, _PACKED.pop, key, None)
    return got


def prepack_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, rows: int) -> int:
    """Pack every expert of one MoE block now (a prefill program's build) instead of in the first call that routes
    a token to it; returns how many were packed."""
    mine, n = _packed_list(w_gate_up, w_down), 0
    for ex in range(w_gate_up.shape[0]):
        if mine[ex] is None:
            mine[ex] = _pack_expert(w_gate_up[ex], w_down[ex], rows)
            n += 1
    return n


def prepack_call(args: tuple, kwargs: dict, tensor: Callable[[Any], torch.Tensor | None]) -> int:
    """:func:`prepack_experts` for one ``hetforge::moe`` call of a program (``tensor`` maps an argument to its
    weight tensor, None when it is not a weight), where its experts would run packed: several tokens, nothing a
    static capacity drops, one expert per group. Returns how many experts were packed."""
    def arg(name: str):
        i = ARG_NAMES.index(name)
        return args[i] if i < len(args) else kwargs.get(name, DEFAULTS.get(name))

    wgu, wd = tensor(arg("w_gate_up")), tensor(arg("w_down"))
    x = tensor(arg("x"))  # the caller's stand-in: a meta tensor of the input's shape and dtype
    if wgu is None or wd is None or x is None or arg("capacity") or int(arg("group_size") or 0) > 1:
        return 0
    t, k, e = x.numel() // max(x.shape[-1], 1), int(arg("top_k")), wgu.shape[0]
    rows = max(2, t * k // max(e, 1))  # the mean rows per expert (the packing serves every count alike)
    if t < 2 or not packed_experts_on(x.dtype, wgu, str(arg("act")), bool(arg("transposed"))):
        return 0
    return prepack_experts(wgu, wd, rows)


def _pack_expert(w_gate_up: torch.Tensor, w_down: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    f = w_gate_up.shape[0] // 2
    return tuple(onednn.pack(w, False, max(rows, 2), "onednn") for w in (w_gate_up[:f], w_gate_up[f:], w_down))


def _packed_ffn(x, mine, w_gate_up, w_down, ex, act):
    """Expert ``ex``'s gated FFN on its rows ``x`` through oneDNN: ``act(x·Gᵀ)`` (the activation a post-op),
    ``(x·Uᵀ) * that`` (the product a binary post-op), then the down projection. ``mine``: the block's packed copies
    (:func:`_packed_list`); the expert's three weights are packed once (:func:`prepack_experts`, for the mean rows per
    expert, else on first use for that call's rows), and that copy runs every row count (oneDNN's packed linear takes
    any count; the hint only steers its layout choice, tested against ATen's chain at two counts)."""
    got = mine[ex]
    if got is None:
        got = mine[ex] = _pack_expert(w_gate_up[ex], w_down[ex], x.shape[0])
    g, u, d = got
    attr, scalars, algo = onednn.ACT_ATTR[act]
    lp = torch.ops.mkldnn._linear_pointwise
    h = lp.binary(x, lp(x, g, None, attr, scalars, algo), u, None, "mul")
    return lp(h, d, None, "none", [], "")


def _expert_ffn(x, w_gate_up, w_down, act, transposed):
    """One expert's gated FFN on its rows. One row (a decode step's) in the ``[2F, D]`` layout runs as one native
    gated-MLP call when the library is built: gate and up in one pool call, the activation and product in C,
    then the down GEMV (no ATen op in between: after a weight stream each costs several µs of cold dispatch);
    otherwise ATen / the native GEMV per product."""
    if x.shape[0] == 1 and not transposed:
        f = w_gate_up.shape[0] // 2
        wg, wu = w_gate_up[:f], w_gate_up[f:]
        if native.gated_mlp_fits(x, wg, wu, w_down, act):
            return (native.gated_mlp if x.dtype == torch.float32 else native.gated_mlp_bf16)(x, wg, wu, w_down, act)
    gate, up = gemv.linear(x, w_gate_up, weight_t=transposed).chunk(2, dim=-1)
    return gemv.linear(apply_act(gate, act) * up, w_down, weight_t=transposed)


def _one_token(h, w, idx, w_gate_up, w_down, act, transposed, stats):
    """One token (a decode step), one expert per group, nothing dropped: its ``k`` experts in ascending expert
    order, as the sorted dispatch of :func:`_experts` runs and adds them (the same bits), with none of the
    dispatch's sort, count and index tensors (on a small expert they cost about as much as its two GEMVs)."""
    out = torch.zeros_like(h)
    ws = w[0].tolist()  # Python floats of the weights' values: scaling by one rounds as by the 0-dim tensor
    for ex, j in sorted(zip(idx[0].tolist(), range(idx.shape[1]), strict=True)):
        out.add_(_expert_ffn(h, w_gate_up[ex], w_down[ex], act, transposed).mul_(ws[j]))
    _count_one_token(stats, w_gate_up.shape[0], idx.shape[1])
    return out


def _count_one_token(stats, e: int, k: int) -> None:
    """A one-token call's statistics: every expert a group of one, ``k`` of them run on one used slot each."""
    stats.groups += e
    stats.groups_run, stats.slots, stats.used = stats.groups_run + k, stats.slots + k, stats.used + k


def moe_forward(x, router_w, w_gate_up, w_down, s_gate=None, s_up=None, s_down=None, s_router=None,
                top_k=2, norm_topk=True, act="silu", transposed=False, group_size=0, capacity=(), order=(),
                layer=-1):
    """The MoE block: route, dispatch into (capacity) slots, grouped expert FFNs, weighted combine, shared expert."""
    d = x.shape[-1]
    h = x.reshape(-1, d)
    e = w_gate_up.shape[0]
    capacity, order = list(capacity), list(order)
    stats = CallStats(layer, h.shape[0], top_k, [], [])
    one = h.shape[0] == 1 and not capacity and not order and not transposed \
        and (group_size if group_size > 0 else auto_group_size(1, top_k, e)) == 1
    if one and native.moe_token_fits(h, router_w, w_gate_up, w_down, act, top_k):
        # a decode step's token: routing, its k experts and their weighted sum in one native call (hf_moe_token)
        out, w, idx, probs = native.moe_token(h, router_w, w_gate_up, w_down, top_k, norm_topk, act)
        _count_one_token(stats, e, top_k)
    else:
        probs, w, idx = route(h, router_w, top_k, norm_topk)
        out = _experts(h, w, idx, w_gate_up, w_down, act, transposed, group_size, capacity, order, stats)
    if s_up is not None and s_down is not None:
        sh = F.linear(h, s_up)
        if s_gate is not None:
            sh = apply_act(F.linear(h, s_gate), act) * sh
        sh = F.linear(sh, s_down)
        if s_router is not None:
            sh = torch.sigmoid(F.linear(h, s_router)) * sh
        out = out + sh
    if _ACTIVE:
        routed = torch.bincount(idx.reshape(-1), minlength=e)
        stats.routed = routed.tolist()
        stats.mass = probs.sum(0).double().tolist()
        for rec in _ACTIVE:
            rec.calls.append(stats)
    return out.reshape(x.shape)


def _arg(call: OpCall, name: str):
    i = ARG_NAMES.index(name)
    if i < len(call.args):
        return call.args[i]
    return call.kwargs.get(name, DEFAULTS.get(name))


def _dims(call: OpCall) -> tuple[int, int, int, int, int] | None:
    """``(T, D, E, F, k)`` of a call, or None when shapes are unknown."""
    x, wgu = _arg(call, "x"), _arg(call, "w_gate_up")
    if not isinstance(x, TensorMeta) or not isinstance(wgu, TensorMeta):
        return None
    d = x.shape[-1]
    t = x.numel // d
    e = wgu.shape[0]
    f = (wgu.shape[2] if _arg(call, "transposed") else wgu.shape[1]) // 2
    return t, d, e, f, int(_arg(call, "top_k"))


def expert_slots(call: OpCall) -> float:
    """Expert-FFN rows computed: ``T·k`` with unlimited capacity, else the static slots of the groups expected to
    run (every group of a static program; ``G·C`` each)."""
    dims = _dims(call)
    if dims is None:
        return 0.0
    t, _, e, _, k = dims
    cap = list(_arg(call, "capacity") or [])
    if not cap:
        return float(t * k)
    g = int(_arg(call, "group_size") or 0) or e
    return float(sum((min(g0 + g, e) - g0) * max(cap[g0:g0 + g]) for g0 in range(0, e, g)))


def _moe_flops(call: OpCall) -> float:
    """Router ``2·T·D·E + 5·T·E`` + expert rows × ``(6·D·F + c·F + F)`` + combine ``2·T·k·D``
    + shared expert ``T·(6·D·Fs + (c+1)·Fs) + 2·T·D`` (c = activation FLOPs per element)."""
    dims = _dims(call)
    if dims is None:
        return 0.0
    t, d, e, f, k = dims
    c = _ACT_FLOPS.get(str(_arg(call, "act")), 4)
    total = 2 * t * d * e + 5 * t * e + expert_slots(call) * (6 * d * f + (c + 1) * f) + 2 * t * k * d
    su = _arg(call, "s_up")
    if isinstance(su, TensorMeta):
        fs = su.shape[0]
        total += t * (6 * d * fs + (c + 1) * fs) + 2 * t * d
    return float(total)


def expected_groups_hit(t: int, k: int, e: int, g: int) -> float:
    """Expected number of groups that receive at least one of ``T·k`` assignments under uniform routing."""
    n_groups = math.ceil(e / g)
    return n_groups * (1.0 - (1.0 - g / e) ** (t * k)) if t * k else 0.0


def _moe_bytes(call: OpCall) -> float:
    """Activations in/out + router weight + the expert weights of the groups expected to run (uniform routing:
    a decode step reads only the groups its ``k`` choices hit) + shared-expert weights."""
    dims = _dims(call)
    if dims is None:
        return call.bytes_in() + call.bytes_out()
    t, _, e, _, k = dims
    g = int(_arg(call, "group_size") or 0) or (e if _arg(call, "capacity") else auto_group_size(t, k, e))
    x, rw, wgu, wd = (_arg(call, n) for n in ("x", "router_w", "w_gate_up", "w_down"))
    per_expert = (wgu.nbytes + wd.nbytes) / e
    hit = expected_groups_hit(t, k, e, g)
    total = 2 * x.nbytes + rw.nbytes + hit * min(g, e) * per_expert
    for n in ("s_gate", "s_up", "s_down", "s_router"):
        a = _arg(call, n)
        if isinstance(a, TensorMeta):
            total += a.nbytes
    return float(total)


def _moe_fake(x, router_w, w_gate_up, w_down, s_gate=None, s_up=None, s_down=None, s_router=None, top_k=2,
              norm_topk=True, act="silu", transposed=False, group_size=0, capacity=(), order=(), layer=-1):
    return x.new_empty(x.shape)


@register_op(
    "hetforge::moe(Tensor x, Tensor router_w, Tensor w_gate_up, Tensor w_down, Tensor? s_gate=None, "
    "Tensor? s_up=None, Tensor? s_down=None, Tensor? s_router=None, int top_k=2, bool norm_topk=True, "
    "str act='silu', bool transposed=False, int group_size=0, int[] capacity=[], int[] order=[], "
    "int layer=-1) -> Tensor",
    flops=_moe_flops,
    nbytes=_moe_bytes,
    devices=("cpu", "gpu"),
    op_class="compute",
    fake=_moe_fake,
)
def moe(x, router_w, w_gate_up, w_down, s_gate=None, s_up=None, s_down=None, s_router=None, top_k=2,
        norm_topk=True, act="silu", transposed=False, group_size=0, capacity=(), order=(), layer=-1):
    """Mixture-of-Experts block: softmax top-k router, grouped expert FFNs over capacity slots, weighted combine."""
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown activation '{act}'; allowed: {', '.join(ACTIVATIONS)}")
    return moe_forward(x, router_w, w_gate_up, w_down, s_gate, s_up, s_down, s_router, top_k, norm_topk, act,
                       transposed, group_size, capacity, order, layer)
