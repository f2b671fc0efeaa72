"""Build PGSAM's :class:`LayerTable` from a graph: per-layer costs summed from the cost model.

* Layer ``l`` on device ``d``: the sum over the layer's call nodes of their modeled cost on ``d``; a
  node ``d`` cannot run is charged on its fastest capable device plus the copy of its inputs there
  and its output back (what the placement will really do: split it off).
* Layer DASI on ``d``: the time-weighted mean of its nodes' DASI.
* Boundary transfers: the bytes of every activation a layer reads from outside itself (hidden state,
  rotary tables, mask), moved over the SoC link between the two stages' devices, plus the receiving
  device's switch cost (``switch_overhead_us``: dispatch + synchronisation, from the profile).
* Auxiliary stages (seed 004): the embedding and LM-head stages go to the lowest-TDP device that can
  run their weight-bearing ops (the embedding gather, the LM-head matmul) and whose memory takes their
  weights (``aux="power"``), or to the capable device with the lowest modeled stage cost (``aux="cost"``:
  the seed's rule assumes near-zero arithmetic intensity, true for one-token decode but not for a
  prefill LM head); their costs enter the objectives as fixed stages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetforge.cost.transfer import switch_cost_s
from hetforge.placement.costs import NodeCosts
from hetforge.placement.layers import EMBED, HEAD, Stages
from hetforge.placement.plan import pool_capacity, pools
from hetforge.placement.stages import LayerTable


@dataclass
class NodeCharge:
    time: float
    energy: float
    dasi: float
    runs_on: str


def charge(nc: NodeCosts, name: str, device: str) -> NodeCharge:
    """Modeled cost of call node ``name`` when its stage is on ``device`` (split off if unsupported)."""
    if nc.can_run[name][device]:
        c = nc.cost[name][device]
        return NodeCharge(c.time_s, c.energy_j, c.dasi, device)
    capable = [d for d, ok in nc.can_run[name].items() if ok]
    if not capable:
        return NodeCharge(float("inf"), float("inf"), 0.0, device)
    f = min(capable, key=lambda d: nc.cost[name][d].time_s)
    node = nc.index[name]
    nbytes_in = sum(nc.out_bytes.get(a.name, 0) for a in nc.inputs(node))
    t1, e1 = nc.transfer(nbytes_in, device, f)
    t2, e2 = nc.transfer(nc.out_bytes.get(name, 0), f, device)
    c = nc.cost[name][f]
    return NodeCharge(c.time_s + t1 + t2, c.energy_j + e1 + e2, c.dasi, f)


def _stage_sum(nc: NodeCosts, names: list[str], device: str) -> tuple[float, float, float]:
    t = e = wd = 0.0
    for n in names:
        if n not in nc.cost:
            continue
        ch = charge(nc, n, device)
        t, e, wd = t + ch.time, e + ch.energy, wd + ch.dasi * ch.time
    return t, e, (wd / t if t > 0 else 0.0)


def _weights(nc: NodeCosts, names: list[str]) -> dict[str, int]:
    w: dict[str, int] = {}
    for n in names:
        w.update(nc.weights.get(n, {}))
    return w


def _bytes_in(nc: NodeCosts, stages: Stages, key: str) -> float:
    members = set(stages.members.get(key, []))
    ext: dict[str, int] = {}
    for n in nc.nodes:
        if n.name in members:
            for a in nc.inputs(n):
                if a.name not in members:
                    ext[a.name] = nc.out_bytes.get(a.name, 0)
    return float(sum(ext.values()))


def aux_device(nc: NodeCosts, names: list[str], free: dict[str, float], mode: str = "power",
               objective: str = "balanced") -> tuple[str, str]:
    """Device for an auxiliary stage among those that run its weight-bearing ops and have memory for it.

    ``mode="power"`` (QEIL v2): the lowest-TDP such device. ``mode="cost"``: the one whose modeled stage
    cost (time, energy or energy·delay by ``objective``) is lowest.
    """
    heavy = [n for n in names if n in nc.weights and nc.weights[n]]
    need = float(sum(_weights(nc, names).values()))
    pool = pools(nc)
    skipped, ok = [], []
    for d in sorted(nc.soc.devices, key=lambda d: (d.tdp_w, nc.soc.devices.index(d))):
        bad = [nc.ops[n] for n in heavy if not nc.can_run[n][d.name]]
        if bad:
            skipped.append(f"{d.name}: cannot run {bad[0]}")
        elif need > free[pool[d.name]]:
            skipped.append(f"{d.name}: {need / 2**20:.0f} MiB of weights do not fit")
        else:
            ok.append(d)
    if not ok:
        return nc.soc.devices[0].name, f"no device fits it ({'; '.join(skipped)}); host fallback"
    note = f" (skipped {'; '.join(skipped)})" if skipped else ""
    if mode == "power":
        d = ok[0]
        return d.name, f"lowest-power device (TDP {d.tdp_w:g} W) that can run it and has memory for its weights" + note

    def cost(d) -> float:
        t, e, _ = _stage_sum(nc, names, d.name)
        return {"latency": t, "energy": e}.get(objective, t * e)

    d = min(ok, key=cost)
    return d.name, f"lowest modeled {objective} cost among devices that can run it and hold its weights" + note


@dataclass
class AuxChoice:
    embed: str
    head: str
    why: dict[str, str]


def build_table(nc: NodeCosts, stages: Stages, aux: str = "power",
                objective: str = "balanced") -> tuple[LayerTable, AuxChoice]:
    """The layer table PGSAM searches, and where the auxiliary stages went."""
    devs = [d.name for d in nc.soc.devices]
    L, D = stages.num_layers, len(devs)
    pool = pools(nc)
    pool_ids = sorted(set(pool.values()), key=devs.index)
    cap = pool_capacity(nc)
    free = {p: float(cap[p]) for p in pool_ids}
    embed_names, head_names = stages.members.get(EMBED, []), stages.members.get(HEAD, [])
    e_dev, e_why = aux_device(nc, embed_names, free, aux, objective)
    free[pool[e_dev]] -= sum(_weights(nc, embed_names).values())
    h_dev, h_why = aux_device(nc, head_names, free, aux, objective)
    head_w = {k: v for k, v in _weights(nc, head_names).items()
              if k not in _weights(nc, embed_names) or pool[h_dev] != pool[e_dev]}
    free[pool[h_dev]] -= sum(head_w.values())
    act = 2.0 * max((nc.out_bytes.get(n.name, 0) for n in nc.nodes), default=0)  # largest activation, doubled
    for p in pool_ids:
        free[p] -= act
    time = np.zeros((L, D))
    energy = np.zeros((L, D))
    dasi = np.zeros((L, D))
    wbytes = np.zeros(L)
    xt = np.zeros((L + 1, D, D))
    xe = np.zeros((L + 1, D, D))
    for li in range(L):
        names = stages.layer(li)
        wbytes[li] = sum(_weights(nc, names).values())
        for j, d in enumerate(devs):
            time[li, j], energy[li, j], dasi[li, j] = _stage_sum(nc, names, d)
    for li in range(L + 1):
        nbytes = _bytes_in(nc, stages, f"layer.{li}" if li < L else HEAD)
        for a in range(D):
            for b in range(D):
                xt[li, a, b], xe[li, a, b] = nc.transfer(nbytes, devs[a], devs[b])
                xt[li, a, b] += switch_cost_s(nc.soc, devs[a], devs[b])  # dispatch + sync into b
    et, ee, ed = _stage_sum(nc, embed_names, e_dev)
    ht, he, hd = _stage_sum(nc, head_names, h_dev)
    capacity = np.array([free[p] for p in pool_ids])
    resident0 = np.array([cap[p] - free[p] for p in pool_ids])
    table = LayerTable(
        devs, time, energy, dasi, wbytes, capacity, xt, xe, entry=devs.index(e_dev), exit=devs.index(h_dev),
        aux_time=(et, ht), aux_energy=ee + he, aux_dasi=(ed, hd),
        pool=np.array([pool_ids.index(pool[d]) for d in devs]), resident0=resident0,
        cpq_threshold=np.array([d.cpq_threshold for d in nc.soc.devices]),
    )
    return table, AuxChoice(e_dev, h_dev, {EMBED: e_why, HEAD: h_why})
