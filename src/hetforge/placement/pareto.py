"""Pareto tools: dominance, the non-dominated filter and an archive (all objectives minimized).

Quality indicators (hypervolume, dominated gaps) live with the benchmarks (``bench/search_baselines.py``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np


def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    """``a`` is no worse than ``b`` everywhere and strictly better somewhere (minimization)."""
    return all(x <= y for x, y in zip(a, b, strict=True)) and any(x < y for x, y in zip(a, b, strict=True))


def non_dominated(points: Sequence[Sequence[float]]) -> list[int]:
    """Indices of the points no other point dominates (duplicates keep their first occurrence)."""
    keep: list[int] = []
    seen: set[tuple[float, ...]] = set()
    for i, p in enumerate(points):
        t = tuple(p)
        if t in seen:
            continue
        if not any(dominates(q, p) for j, q in enumerate(points) if j != i):
            keep.append(i)
            seen.add(t)
    return keep


@dataclass
class Archive:
    """Non-dominated solutions seen so far, keyed by a hashable identity (e.g. the layer assignment)."""

    items: dict[Hashable, tuple[tuple[float, ...], object]] = field(default_factory=dict)

    def offer(self, key: Hashable, f: Sequence[float], payload: object = None) -> bool:
        """Add ``(key, f)`` unless something dominates it; drop what it dominates. True if added."""
        f = tuple(float(x) for x in f)
        if key in self.items:
            return False
        for g, _ in self.items.values():
            if dominates(g, f) or g == f:
                return False
        for k in [k for k, (g, _) in self.items.items() if dominates(f, g)]:
            del self.items[k]
        self.items[key] = (f, payload)
        return True

    def points(self) -> np.ndarray:
        if not self.items:
            return np.empty((0, 0))
        return np.array([f for f, _ in self.items.values()], dtype=float).reshape(-1, self._dim())

    def _dim(self) -> int:
        return len(next(iter(self.items.values()))[0]) if self.items else 0

    def __len__(self) -> int:
        return len(self.items)
