"""Load-aware residency (NPUMoE §2.3): which expert groups stay resident on the NPU, which run on the CPU/GPU.

Per layer, per group of a tier plan (:func:`hetforge.moe.choose_tiers`), for calls of ``T`` tokens, all
**modeled** with the SoC profile's roofline (:func:`hetforge.cost.roofline.roofline`) and energy
(:func:`hetforge.cost.energy.stage_energy`):

* how often the group runs: ``P(run) = 1 − Π_e (1 − p_e)^(T·k)`` from the calibrated popularity ``p_e``;
* on the NPU it runs its *static* program: ``G·C`` slots whatever arrived, plus the NPU dispatch and the
  CPU↔NPU synchronisation (link latency both ways) — a fixed cost per call;
* on the CPU or GPU it runs only the rows that arrived and reads only the experts that were hit.

A group goes to the NPU when its expected time there (``P(run) · t_npu``) beats its best CPU/GPU time and its
weights still fit the NPU budget (groups are taken by expected saving, largest first); otherwise to the faster
of CPU and GPU. Hot groups (many tokens per call) amortise the NPU's fixed cost; cold groups do not — that is
the threshold, decided per group by the numbers, not by a fixed popularity cut.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from hetforge.cost.energy import dasi, stage_energy
from hetforge.cost.roofline import roofline
from hetforge.errors import UsageError

_ACT_FLOPS = 5  # silu (4) + the gating multiply (1), per intermediate element


@dataclass
class GroupChoice:
    """One expert group's modeled costs per call and where it was placed, with the reason."""

    layer: int
    group: int
    experts: list[int]
    slots: int  # static slots G·C
    expected_rows: float  # assignments expected per call (kept by capacity)
    p_run: float
    t_s: dict[str, float]  # per call (when it runs), per device
    e_j: dict[str, float]
    device: str
    reason: str
    weight_bytes: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _device_cost(dev, flops: float, nbytes: float, fixed_s: float) -> tuple[float, float]:
    peak = dev.peak("fp32")
    rl = roofline(flops, nbytes, peak, dev.mem_bandwidth, dev.dispatch_s + fixed_s)
    ai = flops / nbytes if nbytes else math.inf
    return rl.time, stage_energy(dev.tdp_w, dasi(ai, peak, dev.mem_bandwidth), rl.time)


def plan_residency(soc, cal: dict[str, Any], plan: dict[str, Any], d_model: int, d_ff: int, tokens: int,
                   dtype_bytes: int = 4, npu_budget_bytes: float | None = None,
                   force: str | None = None, objective: str = "latency") -> list[GroupChoice]:
    """Place every group of ``plan`` for calls of ``tokens`` tokens on ``soc`` (see module docstring).

    ``force``: ``"npu"`` puts every group on the NPU, ``"host"`` none (the baselines the bench compares).
    ``objective``: ``"latency"`` compares expected time per group, ``"energy"`` expected energy."""
    if objective not in ("latency", "energy"):
        raise UsageError(f"objective '{objective}' must be latency or energy")
    names = {d.kind: d for d in soc.devices}
    npu, cpu, gpu = names.get("npu"), names.get("cpu"), names.get("gpu")
    link = None
    if npu is not None and cpu is not None:
        try:
            link = soc.link(cpu.name, npu.name)
        except Exception:  # a profile without a CPU↔NPU link: no sync cost modeled
            link = None
    sync = 2 * link.latency_s if link is not None else 0.0
    per_expert_w = 3 * d_model * d_ff * dtype_bytes
    choices: list[GroupChoice] = []
    for lay in cal["layers"]:
        layer = int(lay["layer"])
        p = plan["layers"].get(layer) or plan["layers"].get(str(layer))
        if p is None:
            continue
        k = int(lay["top_k"])
        share = [float(s) for s in lay["share"]]
        order, caps, g = p["order"], p["capacity"], int(p["group_size"])
        for gi, g0 in enumerate(range(0, len(order), g)):
            ids = order[g0:g0 + g]
            cap = max(caps[g0:g0 + g])
            n = tokens * k
            p_hit = [1.0 - (1.0 - share[e]) ** n for e in ids]
            p_run = 1.0 - math.prod(1.0 - ph for ph in p_hit)
            rows = sum(min(n * share[e], caps[g0 + j]) for j, e in enumerate(ids))
            slots = len(ids) * cap
            act = d_model * dtype_bytes
            per_row_flops = 6 * d_model * d_ff + _ACT_FLOPS * d_ff
            t: dict[str, float] = {}
            en: dict[str, float] = {}
            if npu is not None:
                xfer = 0.0
                if link is not None and not link.unified:
                    xfer = 2 * slots * act / link.bandwidth
                t["npu"], en["npu"] = _device_cost(npu, slots * per_row_flops, len(ids) * per_expert_w
                                                   + 2 * slots * act, sync + xfer)
            cond_rows = rows / p_run if p_run > 0 else 0.0
            cond_w = sum(p_hit) / p_run * per_expert_w if p_run > 0 else 0.0
            for dev in (cpu, gpu):
                if dev is None:
                    continue
                t[dev.kind], en[dev.kind] = _device_cost(dev, cond_rows * per_row_flops, cond_w + 2 * cond_rows * act,
                                                         0.0)
            choices.append(GroupChoice(layer, gi, list(ids), slots, rows, p_run, t, en, "", "",
                                       len(ids) * per_expert_w))
    _decide(choices, npu, npu_budget_bytes, force, objective)
    return choices


def _decide(choices: list[GroupChoice], npu, budget: float | None, force: str | None, objective: str) -> None:
    for c in choices:
        m = c.t_s if objective == "latency" else c.e_j
        others = {d: v for d, v in m.items() if d != "npu"}
        best = min(others, key=others.get) if others else "npu"
        c.device, c.reason = best, ""
    if npu is None or force == "host":
        for c in choices:
            c.reason = "no NPU on this SoC" if npu is None else "baseline: host devices only"
        return
    left = npu.mem_capacity if budget is None else budget
    def metric(c):
        return c.t_s if objective == "latency" else c.e_j

    gain = {id(c): c.p_run * (metric(c)[c.device] - metric(c)["npu"]) for c in choices}
    for c in sorted(choices, key=lambda c: -gain[id(c)]):
        other = c.device
        tn, to = c.t_s["npu"], c.t_s[other]
        if force == "npu":
            c.device, c.reason = "npu", "baseline: every group on the NPU"
            continue
        if objective == "energy" and metric(c)["npu"] >= metric(c)[other]:
            c.reason = (f"{other}: an NPU call costs {c.e_j['npu'] * 1e6:.1f} µJ vs {c.e_j[other] * 1e6:.1f} µJ on "
                        f"{other} for the {c.expected_rows:.1f} rows expected")
        elif objective == "latency" and tn >= to:
            c.reason = (f"{other}: an NPU call costs {tn * 1e6:.0f} µs (static {c.slots} slots + dispatch/sync) vs "
                        f"{to * 1e6:.0f} µs on {other} for the {c.expected_rows:.1f} rows expected")
        elif c.weight_bytes > left:
            c.reason = (f"{other}: NPU budget left {left / 1e6:.1f} MB < {c.weight_bytes / 1e6:.1f} MB of weights "
                        f"(NPU would save {(to - tn) * 1e6:.0f} µs per call)")
        else:
            left -= c.weight_bytes
            c.device = "npu"
            c.reason = (f"npu (resident, {c.weight_bytes / 1e6:.1f} MB): {tn * 1e6:.0f} µs / "
                        f"{c.e_j['npu'] * 1e6:.1f} µJ vs {to * 1e6:.0f} µs / {c.e_j[other] * 1e6:.1f} µJ on {other} "
                        f"per call, runs with p={c.p_run:.2f}")


def summarize(choices: list[GroupChoice], tokens: int) -> dict[str, float]:
    """Expected expert time and energy per token (modeled) of a placement."""
    t = sum(c.p_run * c.t_s[c.device] for c in choices)
    e = sum(c.p_run * c.e_j[c.device] for c in choices)
    on_npu = sum(1 for c in choices if c.device == "npu")
    return {"time_per_token_s": t / tokens, "energy_per_token_j": e / tokens, "groups_on_npu": on_npu,
            "groups": len(choices)}


def expert_dims(model) -> tuple[int, int, int]:
    """``(hidden D, expert FFN F, dtype bytes)`` from a model's first stacked ``down_proj`` ``[E, D, F]``."""
    for name, p in model.named_parameters():
        if name.endswith("down_proj") and p.dim() == 3:
            return int(p.shape[1]), int(p.shape[2]), p.element_size()
    raise UsageError("model has no stacked expert weights ([E, D, F] down_proj)")


def residency_report(loaded, cal: dict[str, Any], soc, tokens: int, share: float = 0.9, group_size: int = 0,
                     capacity_factor: float = 1.0, npu_budget_bytes: float | None = None,
                     layer: int | None = None, objective: str = "latency") -> dict[str, Any]:
    """Groups, their modeled costs and device, and per-token time/energy with and without residency (modeled)."""
    from hetforge.moe import choose_tiers

    d, f, nb = expert_dims(loaded.model)
    plan = choose_tiers(cal, tokens, share=share, group_size=group_size, capacity_factor=capacity_factor)
    if layer is not None:
        cal = {**cal, "layers": [lay for lay in cal["layers"] if int(lay["layer"]) == layer]}
    res = plan_residency(soc, cal, plan, d, f, tokens, nb, npu_budget_bytes, objective=objective)
    host = plan_residency(soc, cal, plan, d, f, tokens, nb, npu_budget_bytes, force="host")
    all_npu = plan_residency(soc, cal, plan, d, f, tokens, nb, npu_budget_bytes, force="npu")
    per_expert = choose_tiers(cal, tokens, share=share, group_size=1, capacity_factor=capacity_factor)
    naive = plan_residency(soc, cal, per_expert, d, f, tokens, nb, npu_budget_bytes, force="npu")
    return {"model": loaded.name, "soc": soc.name, "tokens_per_call": tokens, "share": share, "objective": objective,
            "group_size": group_size, "capacity_factor": capacity_factor,
            "groups": [c.to_dict() for c in res],
            "modeled": {"residency": summarize(res, tokens), "host_only": summarize(host, tokens),
                        "all_groups_on_npu": summarize(all_npu, tokens),
                        "npu_per_expert_calls": summarize(naive, tokens)}}
