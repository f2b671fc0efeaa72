"""The one per-node placement loop that the node-by-node strategies plug a decision into.

:meth:`Placing.start` prices the graph (:class:`~hetforge.placement.costs.NodeCosts`) and checks the user's
pins; :meth:`Placing.run` walks the call nodes in graph order: a pinned node goes where the user pinned it,
every other node asks the strategy's ``decide(placing, node)`` for a :class:`Decision` (devices to try, best
first, and how to explain the outcome), takes the first device that can run the node and (unless the plan was
sized elsewhere) has memory left, records a rejection for every device skipped, and marks the node a *fallback*
when the first device was skipped. :meth:`Placing.finish` turns the result into a
:class:`~hetforge.placement.Placement` (strict check, memory check, modeled cost).
``greedy``, ``single``, ``rules``, ``stages`` and ``pgsam`` use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hetforge.placement import Placement, Rejection
from hetforge.placement.costs import NodeCosts, check_objective, resolve_soc
from hetforge.placement.plan import Memory, check_pins, finish, no_device_error


@dataclass
class Decision:
    """A strategy's decision for one node: the devices to try, best first, and the reason for the one taken.

    ``reason(device)`` returns the reason, or ``(device', reason)`` to settle on another device after all (the
    ``rules`` strategy's stay-or-move); a node settled off the device taken is not a fallback."""

    prefs: list[str]
    reason: Callable[[str], str | tuple[str, str]]


@dataclass
class Placing:
    """The state of one placement run: costs, objective, memory pools and what has been decided so far."""

    gm: torch.fx.GraphModule
    nc: NodeCosts
    obj: str
    pin: dict[str, str]
    mem: Memory | None  # None: memory was accounted for by the strategy (whole stages), not node by node
    assignment: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    rejections: list[Rejection] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, gm: torch.fx.GraphModule, soc, objective: str | None, pin: dict[str, str] | None,
              memory: bool = True) -> Placing:
        soc = resolve_soc(soc)
        obj = check_objective(objective)
        nc = NodeCosts.build(gm, soc)
        return cls(gm, nc, obj, check_pins(nc, pin), Memory(nc) if memory else None)

    @property
    def soc(self):
        return self.nc.soc

    def usable(self, node: str, device: str) -> str | None:
        """None when ``device`` can run ``node`` and has memory for it, else why not."""
        why = self.nc.why_not(node, device)
        if why is None and self.mem is not None:
            ok, why = self.mem.fits(node, device)
            return None if ok else why
        return why

    def _assign(self, node: str, device: str, reason: str) -> None:
        self.assignment[node], self.reasons[node] = device, reason
        if self.mem is not None:
            self.mem.add(node, device)

    def run(self, decide: Callable[[Placing, torch.fx.Node], Decision]) -> Placing:
        """Place every call node in graph order (see the module docstring)."""
        for n in self.nc.nodes:
            if n.name in self.pin:
                self._assign(n.name, self.pin[n.name], f"pinned to {self.pin[n.name]} by the user")
                continue
            dec = decide(self, n)
            chosen = None
            for i, d in enumerate(dec.prefs):
                why = self.usable(n.name, d)
                if why is None:
                    chosen = d
                    break
                self.rejections.append(Rejection(n.name, self.nc.ops[n.name], d, why))
                if i == 0:
                    self.fallbacks.append(n.name)
            if chosen is None:
                raise no_device_error(self.nc, n.name, self.rejections, self.mem or Memory(self.nc))
            settled = dec.reason(chosen)
            if isinstance(settled, tuple):
                device, reason = settled
                if device != chosen and n.name in self.fallbacks:
                    self.fallbacks.remove(n.name)
            else:
                device, reason = chosen, settled
            self._assign(n.name, device, reason)
        return self

    def finish(self, strategy: str, strict: bool, extra: dict | None = None) -> Placement:
        return finish(self.gm, self.nc, strategy, self.assignment, self.reasons, self.rejections, self.fallbacks,
                      self.obj, strict, extra)
