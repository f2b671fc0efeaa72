"""Shared by every strategy: pins, memory (capacity + CPQ), the rejection table, strict mode, plan cost.

Modeled plan cost (``evaluate_plan``): ops run one after another (single batch, no overlap), so

    time   = Σ op time on its device + Σ transfer time of every activation edge that crosses devices
    energy = Σ_d penalty_cpq(d) · Σ op energy on d + Σ transfer energy

where a crossing edge is charged once per (producer, destination device) and ``penalty_cpq(d)`` is
QEIL v2's memory-pressure penalty for the bytes resident on d's memory pool (devices joined by a
unified link share one pool). Resident bytes = the weights used on the device (a weight used on two
devices is resident on both) + twice the largest activation placed there (double buffering).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hetforge.cost import cpq, cpq_penalty, switch_cost_s
from hetforge.errors import HetforgeError, UsageError
from hetforge.placement import Placement, Rejection
from hetforge.placement.costs import NodeCosts


def pools(nc: NodeCosts) -> dict[str, str]:
    """device → memory pool id (the first device of its unified group)."""
    soc = nc.soc
    pool = {d.name: d.name for d in soc.devices}
    for ln in soc.links:
        if ln.unified:
            a, b = pool[ln.a], pool[ln.b]
            for k, v in pool.items():
                if v == b:
                    pool[k] = a
    return pool


def pool_capacity(nc: NodeCosts) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in nc.soc.devices:
        p = pools(nc)[d.name]
        out[p] = min(out.get(p, d.mem_capacity), d.mem_capacity)
    return out


@dataclass
class Memory:
    """Resident bytes per pool while a strategy assigns nodes (weights counted once per device)."""

    nc: NodeCosts
    weights_on: dict[str, set[str]] = field(default_factory=dict)  # device -> get_attr names
    used: dict[str, float] = field(default_factory=dict)  # pool -> bytes
    peak_act: dict[str, int] = field(default_factory=dict)  # device -> largest activation

    def __post_init__(self):
        self.pool = pools(self.nc)
        self.cap = pool_capacity(self.nc)

    def extra_bytes(self, node: str, device: str) -> float:
        have = self.weights_on.get(device, set())
        w = sum(b for a, b in self.nc.weights[node].items() if a not in have)
        act = max(0, 2 * self.nc.out_bytes.get(node, 0) - 2 * self.peak_act.get(device, 0))
        return float(w + act)

    def fits(self, node: str, device: str) -> tuple[bool, str]:
        p = self.pool[device]
        need = self.used.get(p, 0.0) + self.extra_bytes(node, device)
        if need <= self.cap[p]:
            return True, ""
        return False, f"memory: {need / 2**30:.2f} GiB needed on pool '{p}', {self.cap[p] / 2**30:.2f} GiB available"

    def add(self, node: str, device: str) -> None:
        p = self.pool[device]
        self.used[p] = self.used.get(p, 0.0) + self.extra_bytes(node, device)
        self.weights_on.setdefault(device, set()).update(self.nc.weights[node])
        self.peak_act[device] = max(self.peak_act.get(device, 0), self.nc.out_bytes.get(node, 0))


def no_device_error(nc: NodeCosts, node: str, rejections: list[Rejection], mem: Memory) -> HetforgeError:
    """The error when no device can take ``node``: a memory report if memory was the reason everywhere."""
    rs = [r for r in rejections if r.node == node]
    if rs and all(r.why.startswith("memory") for r in rs):
        size = {a: b for ws in nc.weights.values() for a, b in ws.items()}
        placed = {a for ws in mem.weights_on.values() for a in ws}
        tops = sorted(placed, key=lambda a: -size.get(a, 0))[:3]
        top = ", ".join(f"{a} ({size.get(a, 0) / 2**20:.1f} MiB)" for a in tops)
        return HetforgeError(f"memory capacity exceeded placing '{node}' ({nc.ops[node]}): "
                             + "; ".join(f"{r.device}: {r.why[len('memory: '):]}" for r in rs)
                             + f"; largest tensors placed so far: {top}")
    return HetforgeError(f"no device can run node '{node}' ({nc.ops[node]}): " + "; ".join(r.why for r in rs))


def check_pins(nc: NodeCosts, pin: dict[str, str] | None) -> dict[str, str]:
    """Validate user pins (node → device): unknown names are usage errors, impossible pins are refused."""
    pin = dict(pin or {})
    names = {n.name for n in nc.nodes}
    for node, dev in pin.items():
        if node not in names:
            raise UsageError(f"cannot pin '{node}': no such call_function node in the graph")
        nc.soc.device(dev)  # raises UsageError naming the devices
        why = nc.why_not(node, dev)
        if why:
            raise HetforgeError(f"refused: node '{node}' ({nc.ops[node]}) cannot run on device '{dev}': {why}")
    return pin


def rejection_table(rejs: list[Rejection], limit: int = 25) -> str:
    """The 'why not there' table as aligned text (first ``limit`` rows)."""
    rows = [("node", "op", "device", "why not")] + [(r.node, r.op, r.device, r.why) for r in rejs[:limit]]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}" for r in rows]
    if len(rejs) > limit:
        lines.append(f"... and {len(rejs) - limit} more")
    return "\n".join(lines)


def fill_non_ops(gm: torch.fx.GraphModule, assignment: dict[str, str], reasons: dict[str, str], cpu: str) -> None:
    """Placeholders and the output live on the CPU (host memory); a weight lives where its first user runs."""
    for n in gm.graph.nodes:
        if n.name in assignment:
            continue
        if n.op == "get_attr":
            users = [assignment[u.name] for u in n.users if u.name in assignment]
            assignment[n.name] = users[0] if users else cpu
            others = sorted(set(users) - {assignment[n.name]})
            reasons[n.name] = f"weight resident on {assignment[n.name]}, its first user's device" + (
                f" (also resident on {', '.join(others)})" if others else "")
        elif n.op in ("placeholder", "output"):
            assignment[n.name] = cpu
            reasons[n.name] = "graph inputs and outputs live in host memory (CPU)"
        else:
            users = [assignment[u.name] for u in n.users if u.name in assignment]
            assignment[n.name] = users[0] if users else cpu
            reasons[n.name] = "no work; follows its user"


@dataclass
class PlanCost:
    """Modeled cost of a whole placement (see module docstring)."""

    time_s: float
    energy_j: float
    transfers: int
    transfer_bytes: float
    transfer_time_s: float
    transfer_energy_j: float
    switches: int  # device changes between consecutive call_function nodes in graph (FX) order
    by_device: dict[str, dict[str, float]]
    switch_time_s: float = 0.0  # Σ the destination's switch_overhead_us over those changes (in time_s)

    def to_dict(self) -> dict:
        return {"time_s": self.time_s, "energy_j": self.energy_j, "transfers": self.transfers,
                "transfer_bytes": self.transfer_bytes, "transfer_time_s": self.transfer_time_s,
                "transfer_energy_j": self.transfer_energy_j, "switches_fx_order": self.switches,
                "switch_time_s": self.switch_time_s, "by_device": self.by_device, "label": "modeled"}


def evaluate_plan(nc: NodeCosts, assignment: dict[str, str]) -> PlanCost:
    """Modeled time/energy/transfers of ``assignment`` (node → device) over the nodes ``nc`` costed."""
    mem = Memory(nc)
    by = {d.name: {"time_s": 0.0, "energy_j": 0.0, "nodes": 0, "resident_bytes": 0.0} for d in nc.soc.devices}
    moved: set[tuple[str, str]] = set()
    xt = xe = xb = 0.0
    switches = 0
    sw_t = 0.0
    prev = None
    for n in nc.nodes:
        d = assignment[n.name]
        c = nc.cost[n.name][d]
        by[d]["time_s"] += c.time_s
        by[d]["energy_j"] += c.energy_j
        by[d]["nodes"] += 1
        mem.add(n.name, d)
        for a in nc.inputs(n):
            src = assignment.get(a.name, d)
            if src != d and (a.name, d) not in moved:
                moved.add((a.name, d))
                t, e = nc.transfer(nc.out_bytes.get(a.name, 0), src, d)
                xt, xe, xb = xt + t, xe + e, xb + nc.out_bytes.get(a.name, 0)
        if prev is not None and d != prev:
            switches += 1
            sw_t += switch_cost_s(nc.soc, prev, d)
        prev = d
    energy = xe
    for d in nc.soc.devices:
        p = mem.pool[d.name]
        resident = mem.used.get(p, 0.0)
        by[d.name]["resident_bytes"] = resident
        pen = cpq_penalty(cpq(resident, mem.cap[p]), d.cpq_threshold)
        by[d.name]["cpq_penalty"] = pen
        by[d.name]["energy_j"] *= pen
        energy += by[d.name]["energy_j"]
    time_s = sum(v["time_s"] for v in by.values()) + xt + sw_t
    return PlanCost(time_s, energy, len(moved), xb, xt, xe, switches, by, sw_t)


def memory_check(nc: NodeCosts, assignment: dict[str, str]) -> None:
    """Raise HetforgeError when a pool is over capacity: bytes needed vs available, the largest tensors."""
    mem = Memory(nc)
    for n in nc.nodes:
        mem.add(n.name, assignment[n.name])
    for p, used in mem.used.items():
        if used > mem.cap[p]:
            devs = [d for d, q in mem.pool.items() if q == p]
            big = sorted(((b, a) for n in nc.nodes if assignment[n.name] in devs
                          for a, b in nc.weights[n.name].items()), reverse=True)
            seen, top = set(), []
            for b, a in big:
                if a not in seen:
                    seen.add(a)
                    top.append(f"{a} ({b / 2**20:.1f} MiB)")
                if len(top) == 3:
                    break
            raise HetforgeError(
                f"memory capacity exceeded on {'/'.join(devs)}: {used / 2**30:.2f} GiB needed, "
                f"{mem.cap[p] / 2**30:.2f} GiB available; largest tensors: {', '.join(top)}")


def finish(gm: torch.fx.GraphModule, nc: NodeCosts, strategy: str, assignment: dict[str, str],
           reasons: dict[str, str], rejections: list[Rejection], fallbacks: list[str], objective: str | None,
           strict: bool, extra: dict | None = None) -> Placement:
    """Complete a strategy's call-node assignment into a :class:`Placement` (strict, memory, cost)."""
    if strict and fallbacks:
        fb = set(fallbacks)
        table = rejection_table([r for r in rejections if r.node in fb])
        raise HetforgeError(f"strict placement '{strategy}' is infeasible: {len(fb)} node(s) would fall back "
                            f"from their preferred device:\n{table}")
    memory_check(nc, assignment)
    cost = evaluate_plan(nc, assignment)
    cpu = nc.soc.devices[0].name
    fill_non_ops(gm, assignment, reasons, cpu)
    extra = dict(extra or {})
    extra["cost"] = cost.to_dict()
    extra["fallbacks"] = list(fallbacks)
    return Placement(strategy, assignment, reasons, rejections, objective, extra)
