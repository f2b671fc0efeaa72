"""Pareto tools: dominance, the non-dominated filter, an archive, and normalized hypervolume.

All objectives are minimized. Hypervolume uses pymoo's exact indicator on points normalized to
[0, 1] by a common ideal/nadir pair, with the reference point at 1.1 in every dimension, so two fronts
are compared on the same scale (pass the same ``lo``/``hi`` to both).
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
        return np.array([f for f, _ in self.items.values()], dtype=float).reshape(-1, self._dim())

    def _dim(self) -> int:
        return len(next(iter(self.items.values()))[0]) if self.items else 0

    def __len__(self) -> int:
        return len(self.items)


def bounds(*fronts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Common ideal (min) and nadir (max) over the given fronts."""
    allp = np.vstack([f for f in fronts if len(f)])
    return allp.min(axis=0), allp.max(axis=0)


def hypervolume(points: np.ndarray, lo: np.ndarray, hi: np.ndarray, ref: float = 1.1) -> float:
    """Hypervolume of ``points`` normalized by ``lo``/``hi`` against the reference point ``ref``·1."""
    from pymoo.indicators.hv import HV

    if len(points) == 0:
        return 0.0
    span = np.where(hi - lo > 0, hi - lo, 1.0)
    norm = (np.asarray(points, dtype=float) - lo) / span
    return float(HV(ref_point=np.full(norm.shape[1], ref))(norm))
