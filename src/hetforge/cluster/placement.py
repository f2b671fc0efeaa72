"""Placement across nodes: contiguous decoder-layer stages over nodes, then over devices inside each node.

1. Every node's SoC costs the graph once (:class:`hetforge.placement.costs.NodeCosts`,
   :func:`hetforge.placement.layer_costs.build_table`): per layer, per device, modeled time/energy/DASI.
2. A *node-level* :class:`~hetforge.placement.stages.LayerTable` has one column per node: a layer's cost on
   a node is its cost on that node's best device for the objective (what the in-node search can reach for
   that layer alone); the bytes a layer holds are its weights plus its slice of the KV cache; a node's
   capacity is its memory (the sum of its memory pools, less what the cluster file says its OS and runtime
   keep) less twice the largest activation and, on the home
   node, the embedding and LM-head weights; the transfer into layer ``l`` between two nodes is the bytes
   crossing a cut before ``l`` (every value made before it and read after it, the KV cache excepted: it
   stays on its node) over the cluster's network link — the same latency + bytes/bandwidth, bytes × energy
   per byte formula as any on-chip link (:func:`hetforge.cost.transfer.transfer_cost`).
3. The exact front (:func:`hetforge.placement.exact.exact_front`, PGSAM beyond its budget) over that table,
   the home node as entry (embedding) and exit (LM head), one point picked by the objective.
4. Inside each node the same search runs over its devices on its slice of layers (the ``stages`` strategy's
   front), which gives the node's modeled time and energy per token and its device plan.

Every figure is **modeled**. :func:`explain_cuts` says why each cut is where it is: memory (the next layer
would not fit), or the modeled cost of moving it one layer either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hetforge.cluster.spec import Cluster
from hetforge.cost.transfer import transfer_cost
from hetforge.errors import HetforgeError, UsageError
from hetforge.placement.costs import NodeCosts, check_objective, tensor_bytes
from hetforge.placement.layer_costs import build_table
from hetforge.placement.layers import EMBED, HEAD, Stages, group_stages
from hetforge.placement.pgsam_search import pick
from hetforge.placement.stage_search import search_front
from hetforge.placement.stages import LayerTable, evaluate, stages_of


@dataclass
class Stage:
    """One stage of the cluster pipeline: a node and what of the model it runs."""

    index: int
    node: str
    layers: tuple[int, int]  # [start, end) decoder layers (equal: none)
    embed: bool = False
    head: bool = False
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    modeled_s: float = 0.0
    modeled_j: float = 0.0
    devices: str = ""  # the in-node device plan, e.g. "gpu[0-11]"

    @property
    def label(self) -> str:
        parts = (["embed"] if self.embed else []) + (
            [f"layers {self.layers[0]}-{self.layers[1] - 1}"] if self.layers[1] > self.layers[0] else []) + (
            ["head"] if self.head else [])
        return f"{self.node}: {', '.join(parts)}"

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "node": self.node, "layers": list(self.layers), "embed": self.embed,
                "head": self.head, "weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes,
                "modeled_ms": 1e3 * self.modeled_s, "modeled_mj": 1e3 * self.modeled_j, "devices": self.devices}


@dataclass
class Hop:
    """Activations crossing the network between two stages (modeled)."""

    src: str
    dst: str
    before: str  # "layer.N" or "head"
    nbytes: float
    modeled_s: float
    modeled_j: float

    def to_dict(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "before": self.before, "bytes": self.nbytes,
                "modeled_ms": 1e3 * self.modeled_s, "modeled_mj": 1e3 * self.modeled_j}


@dataclass
class ClusterPlan:
    """Where every stage runs, what it holds, what one token costs (modeled), and why."""

    cluster: Cluster
    objective: str
    num_layers: int
    assign: tuple[int, ...]  # layer → node index (into cluster.nodes)
    stages: list[Stage]
    hops: list[Hop]
    memory: dict[str, dict[str, float]]  # node → {"used": bytes, "capacity": bytes}
    explain: list[str] = field(default_factory=list)
    front: list[dict[str, Any]] = field(default_factory=list)
    search: dict[str, Any] = field(default_factory=dict)
    table: LayerTable | None = field(default=None, repr=False)

    @property
    def modeled_s(self) -> float:
        return sum(s.modeled_s for s in self.stages) + sum(h.modeled_s for h in self.hops)

    @property
    def modeled_j(self) -> float:
        return sum(s.modeled_j for s in self.stages) + sum(h.modeled_j for h in self.hops)

    @property
    def wire_bytes(self) -> float:
        return float(sum(h.nbytes for h in self.hops))

    def layer_nodes(self) -> dict[int, str]:
        return {i: self.cluster.nodes[d].name for i, d in enumerate(self.assign)}

    def describe(self) -> str:
        return " | ".join(s.label for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster.name, "objective": self.objective, "layers": self.num_layers,
                "plan": self.describe(), "stages": [s.to_dict() for s in self.stages],
                "hops": [h.to_dict() for h in self.hops], "memory": self.memory,
                "per_token": {"modeled_ms": 1e3 * self.modeled_s, "modeled_mj": 1e3 * self.modeled_j,
                              "wire_bytes": self.wire_bytes},
                "explain": self.explain, "front": self.front, "search": self.search, "figures": "modeled"}


def stage_order(groups: Stages, name: str) -> int:
    """Order of a stage along the model: embed -1, layer.i i, head L."""
    if name == EMBED:
        return -1
    if name == HEAD:
        return groups.num_layers
    return int(name.split(".")[1])


def cut_bytes(gm: torch.fx.GraphModule, groups: Stages, resident: set[str]) -> np.ndarray:
    """``out[c]`` = bytes of every value made before cut ``c`` (c in 0..L; L = before the head) and read by a
    node after it; values in ``resident`` (KV cache inputs: they live on their node) never cross, nor do graph
    outputs (new K/V rows stay in their node's cache)."""
    L = groups.num_layers
    out = np.zeros(L + 1)
    for n in gm.graph.nodes:
        if n.op in ("get_attr", "output") or n.name in resident or n.name not in groups.of:
            continue
        src = stage_order(groups, groups.of[n.name])
        # the graph's outputs are read where they are made: new K/V rows go into that node's cache, logits
        # are made on the home node
        users = [stage_order(groups, groups.of[u.name]) for u in n.users if u.name in groups.of and u.op != "output"]
        if not users:
            continue
        last = max(users)
        nb = tensor_bytes(n.meta.get("val"))
        for c in range(max(src + 1, 0), min(last, L) + 1):
            out[c] += nb
    return out


def _weights(nc: NodeCosts, names: list[str]) -> float:
    w: dict[str, int] = {}
    for n in names:
        w.update(nc.weights.get(n, {}))
    return float(sum(w.values()))


def model_bytes(nc: NodeCosts) -> float:
    return float(sum({a: b for ws in nc.weights.values() for a, b in ws.items()}.values()))


def plan_cluster(gm: torch.fx.GraphModule, cluster: Cluster, objective: str = "latency",
                 kv_layer_bytes: float = 0.0, resident: set[str] | None = None,
                 latency_mode: str = "total", force_spread: bool = False) -> ClusterPlan:
    """Place ``gm``'s decoder layers over ``cluster``'s nodes (see module docstring)."""
    obj = check_objective(objective)
    groups = group_stages(gm)
    L = groups.num_layers
    if L == 0:
        raise UsageError("placing across nodes needs decoder layers, but no node of this graph belongs to one")
    names = cluster.node_names
    N = len(names)
    home = names.index(cluster.home)
    tables: dict[str, tuple[LayerTable, Any, NodeCosts]] = {}
    for nd in cluster.nodes:
        key = f"{nd.soc.name}|{nd.soc.path}"
        if key not in tables:
            nc = NodeCosts.build(gm, nd.soc)
            t, aux = build_table(nc, groups, "power", obj)
            tables[key] = (t, aux, nc)
    soc_t = [tables[f"{nd.soc.name}|{nd.soc.path}"] for nd in cluster.nodes]
    nc0 = soc_t[0][2]
    embed_w = _weights(nc0, groups.members.get(EMBED, []))
    head_w = _weights(nc0, groups.members.get(HEAD, []))
    ew = {a for n in groups.members.get(EMBED, []) for a in nc0.weights.get(n, {})}
    head_w = float(sum(b for n in groups.members.get(HEAD, []) for a, b in nc0.weights.get(n, {}).items()
                       if a not in ew))  # tied embeddings are held once
    act = 2.0 * max((nc0.out_bytes.get(n.name, 0) for n in nc0.nodes), default=0)
    wbytes = soc_t[0][0].weight_bytes + kv_layer_bytes
    mem = np.array([float(nd.memory) for nd in cluster.nodes])
    capacity = mem - act
    capacity[home] -= embed_w + head_w
    need = float(wbytes.sum()) + embed_w + head_w
    if need + act > mem.sum():
        raise HetforgeError(
            f"model does not fit cluster '{cluster.name}': it needs {need:,.0f} bytes (weights "
            f"{need - kv_layer_bytes * L:,.0f} + KV cache {kv_layer_bytes * L:,.0f}) plus {act:,.0f} of activations; "
            f"the {N} node(s) have {mem.sum():,.0f} bytes ({_per_node(names, mem)})")
    time = np.zeros((L, N))
    energy = np.zeros((L, N))
    dasi = np.zeros((L, N))
    for j, (t, _, _) in enumerate(soc_t):
        col = t.time if obj == "latency" else t.energy if obj == "energy" else t.time * t.energy
        best = np.argmin(col, axis=1)
        time[:, j] = t.time[np.arange(L), best]
        energy[:, j] = t.energy[np.arange(L), best]
        dasi[:, j] = t.dasi[np.arange(L), best]
    cb = cut_bytes(gm, groups, resident or set())
    xt = np.zeros((L + 1, N, N))
    xe = np.zeros((L + 1, N, N))
    for li in range(L + 1):
        for a in range(N):
            for b in range(N):
                if a != b:
                    xt[li, a, b], xe[li, a, b] = transfer_cost(cb[li], cluster.link(names[a], names[b]))
    ht, hauxc, _ = soc_t[home]
    table = LayerTable(names, time, energy, dasi, wbytes, capacity, xt, xe, entry=home, exit=home,
                       aux_time=ht.aux_time, aux_energy=ht.aux_energy, aux_dasi=ht.aux_dasi,
                       latency_mode=latency_mode)
    if force_spread:
        if L < N:
            raise UsageError(f"--spread needs at least one decoder layer per node: {L} layers, {N} nodes")
        chosen = tuple(li * N // L for li in range(L))
        f = evaluate(table, chosen)
        if f is None:
            raise HetforgeError(f"the even split over every node ({_runs(chosen, names)}) does not fit"
                                "  the nodes' memory; drop --spread to let the search place it")
        plan = _build(cluster, obj, table, chosen, soc_t, groups, cb, kv_layer_bytes, embed_w, head_w, mem)
        plan.search = {"method": "spread (even layer counts, cuts not chosen by the cost model)", "plans": 1,
                       "latency_mode": latency_mode, "objectives": {"energy_j": f[0], "latency_s": f[1]}}
        plan.explain = ["--spread: every node gets an even share of the layers, in the cluster file's order; the cuts "
                        "are set by layer count, not by the cost model", *explain_cuts(plan, table, need)[1:]]
        return plan
    res = search_front(table, "auto")
    if not res.archive.items:
        raise HetforgeError(
            f"no contiguous split of the {L} decoder layers fits cluster '{cluster.name}': layers need "
            f"{wbytes.sum():,.0f} bytes (with KV cache), nodes have {_per_node(names, capacity)} "
            "bytes left after the home node's embedding/head and activations")
    chosen, f = pick(res.archive, obj)
    plan = _build(cluster, obj, table, tuple(chosen), soc_t, groups, cb, kv_layer_bytes, embed_w, head_w, mem)
    plan.front = [{"plan": _runs(k, names), "energy_j": v[0][0],
                   "latency_s": v[0][1], "chosen": k == chosen} for k, v in sorted(res.archive.items.items(),
                                                                                  key=lambda kv: kv[1][0][1])]
    plan.search = {"method": res.method, "plans": res.plans, "latency_mode": latency_mode,
                   "objectives": {"energy_j": f[0], "latency_s": f[1]}}
    plan.explain = explain_cuts(plan, table, need)
    return plan


def _inner(t: LayerTable, s: int, e: int, obj: str) -> tuple[float, float, str]:
    """Modeled (seconds, joules, device plan) of layers [s, e) on one node: the in-node stage front."""
    sub = LayerTable(t.devices, t.time[s:e], t.energy[s:e], t.dasi[s:e], t.weight_bytes[s:e],
                     t.capacity + (t.resident0 if t.resident0 is not None else 0.0), t.xfer_time[s:e + 1],
                     t.xfer_energy[s:e + 1], pool=t.pool, latency_mode="total")
    res = search_front(sub, "auto")
    if not res.archive.items:  # the node-level check passed; the in-node split of pools may still refuse
        best = int(np.argmin(sub.time.sum(axis=0)))
        return float(sub.time[:, best].sum()), float(sub.energy[:, best].sum()), f"{t.devices[best]}[{s}-{e - 1}]"
    a, f = pick(res.archive, obj)
    return float(f[1]), float(f[0]), " ".join(f"{t.devices[d]}[{s + a0}-{s + b0 - 1}]" for d, a0, b0 in stages_of(a))


def _build(cluster, obj, table, assign, soc_t, groups, cb, kv_layer, embed_w, head_w, mem) -> ClusterPlan:
    names = cluster.node_names
    home = cluster.home
    hi = names.index(home)
    runs = stages_of(assign)
    stages: list[Stage] = []
    hops: list[Hop] = []
    ht = soc_t[hi][0]
    e_t, h_t = ht.aux_time
    aux_e = ht.aux_energy
    e_j = aux_e * (e_t / (e_t + h_t)) if e_t + h_t > 0 else 0.0
    aux = soc_t[hi][1]
    if names[runs[0][0]] != home:
        stages.append(Stage(0, home, (0, 0), embed=True, weight_bytes=embed_w, modeled_s=e_t, modeled_j=e_j,
                            devices=f"embed:{aux.embed}"))
    prev = home
    for d, s, e in runs:
        node = names[d]
        if node != prev:
            t, j = transfer_cost(cb[s], cluster.link(prev, node))
            hops.append(Hop(prev, node, f"layer.{s}", float(cb[s]), t, j))
        ts, js, devs = _inner(soc_t[d][0], s, e, obj)
        st = Stage(len(stages), node, (s, e), weight_bytes=float(soc_t[d][0].weight_bytes[s:e].sum()),
                   kv_bytes=kv_layer * (e - s), modeled_s=ts, modeled_j=js, devices=devs)
        if node == home and not stages:
            st.embed, st.weight_bytes, st.modeled_s, st.modeled_j = True, st.weight_bytes + embed_w, ts + e_t, js + e_j
            st.devices = f"embed:{aux.embed} " + st.devices
        stages.append(st)
        prev = node
    h_j = aux_e - e_j
    if prev != home:
        t, j = transfer_cost(cb[table.num_layers], cluster.link(prev, home))
        hops.append(Hop(prev, home, "head", float(cb[table.num_layers]), t, j))
        stages.append(Stage(len(stages), home, (table.num_layers, table.num_layers), head=True,
                            weight_bytes=head_w, modeled_s=h_t, modeled_j=h_j, devices=f"head:{aux.head}"))
    else:
        last = stages[-1]
        last.head, last.weight_bytes = True, last.weight_bytes + head_w
        last.modeled_s, last.modeled_j = last.modeled_s + h_t, last.modeled_j + h_j
        last.devices += f" head:{aux.head}"
    used: dict[str, float] = {}
    for st in stages:
        used[st.node] = used.get(st.node, 0.0) + st.weight_bytes + st.kv_bytes
    memory = {n: {"used": used.get(n, 0.0), "capacity": float(mem[i])} for i, n in enumerate(names)}
    return ClusterPlan(cluster, obj, table.num_layers, assign, stages, hops, memory, table=table)


def explain_cuts(plan: ClusterPlan, table: LayerTable, need: float) -> list[str]:
    """Why the plan splits at all, and why each cut is where it is (memory, or modeled cost either way)."""
    names = plan.cluster.node_names
    L = table.num_layers
    k = 1 if plan.objective == "latency" else 0
    unit, scale = ("ms", 1e3) if k == 1 else ("mJ", 1e3)
    what = "latency" if k == 1 else "energy"
    base = evaluate(table, plan.assign)
    assert base is not None
    out: list[str] = []
    runs = stages_of(plan.assign)
    singles = []
    for d, n in enumerate(names):
        f = evaluate(table, (d,) * L)
        singles.append(f"{n}: " + ("does not fit (layers + KV cache "
                                   f"{table.weight_bytes.sum():,.0f} B > {table.capacity[d]:,.0f} B free)"
                                   if f is None else f"{scale * f[k]:.3f} {unit}"))
    if len(runs) == 1:
        out.append(f"one node runs every layer ({names[runs[0][0]]}): the modeled {what} per token is lowest "
                   f"there ({scale * base[k]:.3f} {unit}); one node alone: {'; '.join(singles)}")
        return out
    out.append(f"split over {len(runs)} nodes: modeled {what} per token {scale * base[k]:.3f} {unit}; "
               f"one node alone: {'; '.join(singles)}")
    for (da, sa, ea), (db, _, eb) in zip(runs, runs[1:], strict=False):
        c = ea
        used_a = float(table.weight_bytes[sa:ea].sum())
        why = [f"cut before layer {c} ({names[da]} | {names[db]})"]
        later = list(plan.assign)
        if c < eb - 0 and c < L:
            later[c] = da  # layer c moves to node a
            f = evaluate(table, tuple(later))
            if f is None:
                why.append(f"one layer later: layer {c} ({table.weight_bytes[c]:,.0f} B) does not fit on {names[da]} "
                           f"({used_a:,.0f} of {table.capacity[da]:,.0f} B free already used)")
            else:
                why.append(f"one layer later: {_delta(scale * (f[k] - base[k]), unit)}")
        earlier = list(plan.assign)
        if c - 1 >= sa and ea - sa > 1:
            earlier[c - 1] = db
            f = evaluate(table, tuple(earlier))
            if f is None:
                why.append(f"one layer earlier: layer {c - 1} does not fit on {names[db]}")
            else:
                why.append(f"one layer earlier: {_delta(scale * (f[k] - base[k]), unit)}")
        hop = next((h for h in plan.hops if h.before == f"layer.{c}"), None)
        if hop is not None:
            why.append(f"{hop.nbytes:,.0f} B cross the link ({1e3 * hop.modeled_s:.3f} ms, modeled)")
        out.append("; ".join(why))
    return out


def _delta(d: float, unit: str) -> str:
    if abs(d) < 5e-4:
        return "the same modeled cost (equal nodes: the search keeps the first of equal plans)"
    return f"{d:+.3f} {unit} modeled"


def _per_node(names: list[str], values) -> str:
    return ", ".join(f"{n} {v:,.0f}" for n, v in zip(names, values, strict=True))


def _runs(assign: tuple[int, ...], names: list[str]) -> str:
    return " ".join(f"{names[d]}[{s}-{e - 1}]" for d, s, e in stages_of(assign))
