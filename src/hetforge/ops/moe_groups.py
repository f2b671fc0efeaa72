"""The expert groups of a Mixture-of-Experts block as separate, placeable ops (NPUMoE residency, executed).

``hetforge::moe`` is one node, so one device runs the whole block. To run the hot expert groups on the NPU and
the cold ones on the CPU/GPU, :mod:`hetforge.moe.expand` rewrites each ``hetforge::moe`` node into

* ``moe_route(x, router_w, ...) -> table [T, 2k]`` (control, CPU): router linear → softmax (float32) → top-k
  (renormalised when asked) → each assignment's static *slot* (its expert's slot base plus its rank among the
  expert's assignments, most important first), or −1 when the expert's capacity is full (dropped by
  importance, lowest router weight first — the same rule as ``hetforge::moe``). The table holds the k combine
  weights (float32; 0 for a dropped assignment) and then the k slots as float32 (exact below 2^24);
* per group ``moe_gather(x, table, offset, experts, capacity) -> xs [G, C, D]`` (control, CPU): the group's
  static slots filled with its assigned rows (zeros in unused slots);
* per group ``moe_group(xs, w_gate_up, w_down, act, transposed) -> ys [G, C, D]`` (compute, CPU/GPU/NPU): one
  batched GEMM pair + the gated activation over the group's stacked weights — static shapes, no control flow,
  what an NPU runs;
* per group ``moe_scatter(acc, ys, table, offset, experts, capacity, first) -> out`` (control, CPU): the
  weighted combine of the group's slots into the tokens (``first``: start from zeros shaped like ``acc``).

Groups are laid out back to back in one slot space: group ``g`` owns slots ``[offset_g, offset_g + G·C_g)``.
The numbers equal ``hetforge::moe`` with the same capacities, order and group size (same slots, same ``bmm``
per group, the same accumulation order per group).
"""

from __future__ import annotations

import torch

from hetforge.ops.fused import ACTIVATIONS, apply_act
from hetforge.ops.registry import OpCall, TensorMeta, register_op

_ACT_FLOPS = {"relu": 1, "gelu": 8, "gelu_tanh": 8, "silu": 4}


def _slots_of(table: torch.Tensor, k: int) -> torch.Tensor:
    return table[:, k:].to(torch.long)


def route_table(x: torch.Tensor, router_w: torch.Tensor, top_k: int, norm_topk: bool, capacity: list[int],
                base: list[int], order: list[int], layer: int = -1) -> torch.Tensor:
    """The routing table ``[T, 2k]`` (weights, then slots; see module docstring)."""
    from hetforge.ops.moe import _ACTIVE, CallStats, route

    d = x.shape[-1]
    h = x.reshape(-1, d)
    e = router_w.shape[0]
    probs, w, idx = route(h, router_w, top_k, norm_topk)
    t, k = idx.shape
    pos = idx
    if order:
        inv = torch.empty(e, dtype=torch.long)
        inv[torch.tensor(order, dtype=torch.long)] = torch.arange(e)
        pos = inv[idx]
    flat_e, flat_w = pos.reshape(-1), w.reshape(-1).float()
    by_weight = torch.argsort(flat_w, descending=True, stable=True)  # most important first within an expert
    perm = by_weight[torch.argsort(flat_e[by_weight], stable=True)]
    se = flat_e[perm]
    counts = torch.bincount(flat_e, minlength=e)
    starts = torch.zeros(e, dtype=torch.long)
    starts[1:] = torch.cumsum(counts, 0)[:-1]
    rank = torch.arange(se.numel()) - starts[se]
    cap_t = torch.tensor(capacity, dtype=torch.long)
    keep = rank < cap_t[se]
    slot_sorted = torch.where(keep, torch.tensor(base, dtype=torch.long)[se] + rank, torch.full_like(rank, -1))
    slot = torch.empty_like(slot_sorted)
    slot[perm] = slot_sorted
    wk = torch.where(slot >= 0, flat_w, torch.zeros_like(flat_w))
    table = torch.cat([wk.reshape(t, k), slot.reshape(t, k).float()], dim=1)
    if _ACTIVE:
        kept = int(keep.sum())
        stats = CallStats(layer, t, k, torch.bincount(idx.reshape(-1), minlength=e).tolist(),
                          probs.sum(0).double().tolist(), dropped=t * k - kept, slots=sum(capacity), used=kept)
        for rec in _ACTIVE:
            rec.calls.append(stats)
    return table


def _meta(call: OpCall, i: int) -> TensorMeta | None:
    a = call.args[i] if i < len(call.args) else None
    return a if isinstance(a, TensorMeta) else None


def _route_flops(call: OpCall) -> float:
    """Router ``2·T·D·E + 5·T·E`` + the slot bookkeeping (a few ops per assignment)."""
    x, rw = _meta(call, 0), _meta(call, 1)
    if x is None or rw is None:
        return 0.0
    d, e = x.shape[-1], rw.shape[0]
    t = x.numel // d
    k = int(call.args[2]) if len(call.args) > 2 else 2
    return float(2 * t * d * e + 5 * t * e + 8 * t * k)


def _route_fake(x, router_w, top_k, norm_topk, capacity, base, order, layer=-1):
    t = x.numel() // x.shape[-1]
    return x.new_empty((t, 2 * top_k), dtype=torch.float32)


@register_op(
    "hetforge::moe_route(Tensor x, Tensor router_w, int top_k, bool norm_topk, int[] capacity, int[] base, "
    "int[] order, int layer=-1) -> Tensor",
    flops=_route_flops,
    devices=("cpu",),
    op_class="control",
    fake=_route_fake,
)
def moe_route(x, router_w, top_k, norm_topk, capacity, base, order, layer=-1):
    """MoE router + top-k + static slot assignment (capacity drops by importance): the routing table."""
    return route_table(x, router_w, top_k, norm_topk, list(capacity), list(base), list(order), layer)


def _group_rows(table: torch.Tensor, offset: int, n_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token, column, local slot)`` of the table entries in ``[offset, offset + n_slots)``, by slot."""
    k = table.shape[1] // 2
    slot = _slots_of(table, k) - offset
    hit = (slot >= 0) & (slot < n_slots)
    tok, col = hit.nonzero(as_tuple=True)
    loc = slot[tok, col]
    o = torch.argsort(loc)
    return tok[o], col[o], loc[o]


def _gather_fake(x, table, offset, experts, capacity):
    return x.new_empty((experts, capacity, x.shape[-1]))


def _gather_flops(call: OpCall) -> float:
    return 0.0


@register_op(
    "hetforge::moe_gather(Tensor x, Tensor table, int offset, int experts, int capacity) -> Tensor",
    flops=_gather_flops,
    devices=("cpu",),
    op_class="control",
    fake=_gather_fake,
)
def moe_gather(x, table, offset, experts, capacity):
    """Fill one expert group's static slots ``[G, C, D]`` with the rows routed to it (dispatch)."""
    d = x.shape[-1]
    h = x.reshape(-1, d)
    xs = h.new_zeros((experts * capacity, d))
    tok, _, loc = _group_rows(table, offset, experts * capacity)
    xs[loc] = h[tok]
    return xs.reshape(experts, capacity, d)


def _group_flops(call: OpCall) -> float:
    """``G·C`` slots × ``(6·D·F + (c+1)·F)`` — every static slot is computed, padding included."""
    xs, wgu = _meta(call, 0), _meta(call, 1)
    if xs is None or wgu is None:
        return 0.0
    g, c, d = xs.shape
    transposed = bool(call.args[4]) if len(call.args) > 4 else False
    f = (wgu.shape[2] if transposed else wgu.shape[1]) // 2
    act = str(call.args[3]) if len(call.args) > 3 else "silu"
    return float(g * c * (6 * d * f + (_ACT_FLOPS.get(act, 4) + 1) * f))


def _group_fake(xs, w_gate_up, w_down, act="silu", transposed=False):
    return xs.new_empty(xs.shape)


@register_op(
    "hetforge::moe_group(Tensor xs, Tensor w_gate_up, Tensor w_down, str act='silu', bool transposed=False) "
    "-> Tensor",
    flops=_group_flops,
    devices=("cpu", "gpu", "npu"),
    op_class="compute",
    fake=_group_fake,
)
def moe_group(xs, w_gate_up, w_down, act="silu", transposed=False):
    """One expert group's FFNs over its static slots: a batched GEMM pair + gated activation (NPU-shaped)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown activation '{act}'; allowed: {', '.join(ACTIVATIONS)}")
    y = torch.bmm(xs, w_gate_up if transposed else w_gate_up.transpose(1, 2))
    gate, up = y.chunk(2, dim=-1)
    return torch.bmm(apply_act(gate, act) * up, w_down if transposed else w_down.transpose(1, 2))


def _scatter_flops(call: OpCall) -> float:
    ys = _meta(call, 1)
    return float(2 * ys.numel) if ys is not None else 0.0


def _scatter_fake(acc, ys, table, offset, experts, capacity, first=False):
    return acc.new_empty(acc.shape)


@register_op(
    "hetforge::moe_scatter(Tensor acc, Tensor ys, Tensor table, int offset, int experts, int capacity, "
    "bool first=False) -> Tensor",
    flops=_scatter_flops,
    devices=("cpu",),
    op_class="control",
    fake=_scatter_fake,
)
def moe_scatter(acc, ys, table, offset, experts, capacity, first=False):
    """Weighted combine of one group's slots into the tokens (``first``: start from zeros shaped like ``acc``)."""
    d = acc.shape[-1]
    out = torch.zeros_like(acc).reshape(-1, d) if first else acc.reshape(-1, d).clone()
    tok, col, loc = _group_rows(table, offset, experts * capacity)
    if tok.numel():
        y = ys.reshape(-1, d)[loc]
        out.index_add_(0, tok, y * table[tok, col].to(y.dtype)[:, None])
    return out.reshape(acc.shape)
