"""Strategies ``stages`` and ``pgsam``: contiguous placement of decoder layers, plus auxiliary-stage routing.

``stages`` finds the front exactly (:mod:`.exact`) when the plan count fits the budget and runs PGSAM
beyond it (:mod:`.stage_search`, ``search="auto"``); ``pgsam`` always runs PGSAM (QEIL v2's Pareto-guided
search). Both:

1. Group nodes into embedding / decoder layers / head (:mod:`.layers`).
2. Cost every layer on every device from the cost model (:mod:`.layer_costs`), route the embedding and
   LM-head stages to the lowest-power device with memory for them (``aux="power"``, the seed's rule) or
   to the one with the lowest modeled cost for them (``aux="cost"``).
3. Search stage plans (exact DP or PGSAM) for the Pareto front of (energy, bottleneck
   latency, −min DASI); ``objective`` picks one point: ``energy`` (min f1), ``latency`` (min f2) or
   ``balanced`` (min of the larger normalized f1/f2). ``latency_mode="total"`` makes f2 the latency of
   one request (sum of stages) instead of the pipelined bottleneck.
4. Tag every node with its stage's device; a node that device cannot run is split off to its fastest
   capable device (a rejection, and a fallback that ``strict=True`` refuses).

``Placement.extra['front']`` holds the whole front (modeled), so a user can pick another point with
``point=i``.
"""

from __future__ import annotations

import torch

from hetforge.errors import HetforgeError, UsageError
from hetforge.placement import Placement, register_strategy
from hetforge.placement.layer_costs import build_table, charge
from hetforge.placement.layers import EMBED, HEAD, group_stages
from hetforge.placement.loop import Decision, Placing
from hetforge.placement.pgsam_search import pick
from hetforge.placement.stage_search import search_front
from hetforge.placement.stages import stages_of


def describe(assign: tuple[int, ...], devices: list[str]) -> str:
    """``gpu[0-5] npu[6-11]`` for a layer assignment."""
    return " ".join(f"{devices[d]}[{s}-{e - 1}]" for d, s, e in stages_of(assign))


@register_strategy("pgsam")
def pgsam(gm: torch.fx.GraphModule, soc, objective: str | None = "balanced", strict: bool = False,
          pin: dict[str, str] | None = None, search: str = "pgsam", **opts: object) -> Placement:
    """Contiguous layer placement searched by PGSAM (``search="pgsam"``); see :func:`stages`."""
    return stages(gm, soc, objective, strict, pin, search=search, **opts)  # type: ignore[arg-type]


@register_strategy("stages")
def stages(gm: torch.fx.GraphModule, soc, objective: str | None = "balanced", strict: bool = False,
           pin: dict[str, str] | None = None, seed: int = 0, point: int | None = None,
           latency_mode: str = "bottleneck", aux: str = "power", search: str = "auto", budget: int | None = None,
           **pgsam_opts: object) -> Placement:
    """Contiguous layer placement; see module docstring. ``pgsam_opts`` go to :func:`pgsam_search`."""
    st = Placing.start(gm, soc, objective, pin, memory=False)  # the stage search sized memory per stage
    nc, obj = st.nc, st.obj
    groups = group_stages(gm)
    if groups.num_layers == 0:
        raise UsageError("pgsam places decoder layers, but no node of this graph belongs to a layer "
                         "(no '...layers.N' / '...h.N' in nn_module_stack); use the rules or greedy strategy")
    if latency_mode not in ("bottleneck", "total"):
        raise UsageError(f"unknown latency_mode '{latency_mode}'; valid: bottleneck, total")
    if aux not in ("power", "cost"):
        raise UsageError(f"unknown aux routing '{aux}'; valid: power, cost")
    table, aux_choice = build_table(nc, groups, aux, obj)
    table.latency_mode = latency_mode
    res = search_front(table, search, budget, seed=seed, **pgsam_opts)
    if not res.archive.items:
        need = table.weight_bytes.sum()
        size = {a: b for ws in nc.weights.values() for a, b in ws.items()}
        top = ", ".join(f"{a} ({size[a] / 2**20:.0f} MiB)" for a in sorted(size, key=lambda a: -size[a])[:3])
        raise HetforgeError(f"{res.method}: no stage plan fits in memory: decoder layers need {need / 2**30:.2f} GiB, "
                            f"pools have {', '.join(f'{c / 2**30:.2f} GiB' for c in table.capacity)} left "
                            f"after the embedding and head stages; largest tensors: {top}")
    front = sorted(res.archive.items.items(), key=lambda kv: kv[1][0])
    if point is not None:
        if not 0 <= point < len(front):
            raise UsageError(f"point {point} is outside the front (0..{len(front) - 1})")
        chosen, f = front[point][0], front[point][1][0]
        how = f"front point {point} chosen by the user"
    else:
        chosen, f = pick(res.archive, obj)
        how = {"energy": "lowest energy f1", "latency": f"lowest {latency_mode} latency f2"}.get(
            obj, "smallest max of normalized f1, f2")
    devs = table.devices
    layer_dev = {f"layer.{i}": devs[d] for i, d in enumerate(chosen)}
    stage_dev = {**layer_dev, EMBED: aux_choice.embed, HEAD: aux_choice.head}
    plan_text = describe(chosen, devs)
    who = "exact front" if res.method == "exact" else "PGSAM"

    def decide(st: Placing, n: torch.fx.Node) -> Decision:
        stage = groups.of[n.name]
        want = stage_dev[stage]
        if stage in (EMBED, HEAD):
            base = f"auxiliary-stage routing: {stage} stage on {want}, {aux_choice.why[stage]}"
        else:
            base = (f"{who} ({obj}: {how}): {stage} in plan {plan_text}; front point energy {f[0]:.4g} J, "
                    f"{latency_mode} latency {f[1]:.4g} s, min DASI {-f[2]:.3f} (modeled)")
        runs_on = charge(nc, n.name, want).runs_on  # the stage's device, else the fastest that can run it
        if runs_on == want:
            return Decision([want], lambda d: base)
        return Decision([want, runs_on],
                        lambda d: base + f"; split off to {d} because {want} cannot run {nc.ops[n.name]}")

    st.run(decide)
    extra = {
        "plan": plan_text, "latency_mode": latency_mode,
        "objectives": {"energy_j": f[0], "latency_s": f[1], "min_dasi": -f[2]},
        "front": [{"plan": describe(k, devs), "energy_j": v[0][0], "latency_s": v[0][1], "min_dasi": -v[0][2],
                   "chosen": k == chosen} for k, v in front],
        "aux": {EMBED: aux_choice.embed, HEAD: aux_choice.head},
        "search": {"method": res.method, "plans": res.plans, **res.stats},
        "layers": groups.num_layers, "label": "modeled",
    }
    name = "pgsam" if search == "pgsam" else "stages"
    return st.finish(name, strict, extra)
