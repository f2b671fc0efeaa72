"""Placement: decide which device runs every graph node, with a reason per node.

Placement is pure tagging (node name → device name + reason); graph surgery (transfers) happens in
lowering. Strategies register themselves with :func:`register_strategy`; every module in this package
is imported on first use of :func:`get_strategy`, so a new strategy is a new file.

A strategy is ``fn(gm: torch.fx.GraphModule, soc: SocProfile, **options) -> Placement``.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from hetforge.errors import UsageError

OBJECTIVES = ("energy", "latency", "balanced")  # what a strategy minimises (see placement/costs.py)
_DECLARED = re.compile(r"""@register_strategy\(["']([\w:-]+)["']\)""")


@dataclass
class Rejection:
    """Why a node could not go to a device (the 'why no partition' table)."""

    node: str
    op: str
    device: str
    why: str


@dataclass
class Placement:
    """node name → device name, a reason per node, and the rejections met on the way."""

    strategy: str
    assignment: dict[str, str]
    reasons: dict[str, str] = field(default_factory=dict)
    rejections: list[Rejection] = field(default_factory=list)
    objective: str | None = None
    extra: dict = field(default_factory=dict)

    def device_of(self, node_name: str) -> str:
        return self.assignment[node_name]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.assignment.values():
            out[d] = out.get(d, 0) + 1
        return out


Strategy = Callable[..., Placement]
STRATEGIES: dict[str, Strategy] = {}


def register_strategy(name: str) -> Callable[[Strategy], Strategy]:
    def deco(fn: Strategy) -> Strategy:
        STRATEGIES[name] = fn
        return fn

    return deco


def _load_all() -> None:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def get_strategy(name: str) -> Strategy:
    """The strategy registered under ``name``, or a UsageError listing the valid names."""
    _load_all()
    if name not in STRATEGIES:
        raise UsageError(f"unknown strategy '{name}'; valid strategies: {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name]


def check_strategy(name: str) -> None:
    """Refuse an unknown strategy name (:func:`get_strategy`'s error) without importing the strategies when the
    name is declared: an executor checks its options at once, and a compile-cache hit never places."""
    if name not in declared_strategies():
        get_strategy(name)


def declared_strategies() -> list[str]:
    """The strategy names this package registers, read from its source (the ``register_strategy`` decorators) without
    importing the strategies (which pull in the cost model): what the CLI's help lists. A test holds it equal to
    :func:`list_strategies`."""
    from pathlib import Path

    names: set[str] = set()
    for folder in __path__:
        for f in Path(folder).glob("*.py"):
            names.update(_DECLARED.findall(f.read_text(encoding="utf-8")))
    return sorted(names)


def list_strategies() -> list[str]:
    _load_all()
    return sorted(STRATEGIES)
