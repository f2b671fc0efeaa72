"""Fidelity harness: compare a compiled artifact's logits with the eager model's.

Figures: max and mean absolute error of the logits, KL(eager ‖ artifact) of softmax(logits) per
position (mean and max over positions), and top-1 agreement. Thresholds are parameters; the report
says whether each passed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from hetforge.errors import UsageError


@dataclass
class FidelityReport:
    max_abs_err: float
    mean_abs_err: float
    kl_mean: float
    kl_max: float
    top1_agree: float
    positions: int
    kl_threshold: float
    abs_threshold: float | None = None

    @property
    def passed(self) -> bool:
        ok = self.kl_max <= self.kl_threshold
        if self.abs_threshold is not None:
            ok = ok and self.max_abs_err <= self.abs_threshold
        return ok

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d


def compare_logits(
    reference: torch.Tensor, candidate: torch.Tensor, kl_threshold: float = 1e-9, abs_threshold: float | None = None
) -> FidelityReport:
    """Compare two logits tensors of shape [..., vocab] (computed in float64 for the KL)."""
    if reference.shape != candidate.shape:
        raise ValueError(f"shape mismatch: reference {tuple(reference.shape)} vs candidate {tuple(candidate.shape)}")
    ref = reference.detach().double().reshape(-1, reference.shape[-1])
    cand = candidate.detach().double().reshape(-1, candidate.shape[-1])
    diff = (ref - cand).abs()
    logp = torch.log_softmax(ref, -1)
    logq = torch.log_softmax(cand, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0)
    top1 = (ref.argmax(-1) == cand.argmax(-1)).double().mean()
    return FidelityReport(
        max_abs_err=float(diff.max()),
        mean_abs_err=float(diff.mean()),
        kl_mean=float(kl.mean()),
        kl_max=float(kl.max()),
        top1_agree=float(top1),
        positions=int(ref.shape[0]),
        kl_threshold=kl_threshold,
        abs_threshold=abs_threshold,
    )


def check_kl_threshold(value: float, option: str = "--kl-threshold") -> float:
    """A KL threshold must be a finite number ≥ 0 (NaN would make every comparison fail silently)."""
    if not (math.isfinite(value) and value >= 0):
        raise UsageError(f"{option} must be a finite number ≥ 0 (e.g. 1e-8), got {value}")
    return value


def _first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return _first_tensor(out[0])
    if hasattr(out, "logits"):
        return out.logits
    raise TypeError(f"cannot find logits in output of type {type(out).__name__}")


def verify(
    eager: Callable,
    candidate: Callable,
    inputs: Sequence[torch.Tensor],
    kl_threshold: float = 1e-9,
    abs_threshold: float | None = None,
) -> FidelityReport:
    """Run ``eager`` and ``candidate`` on the same inputs and compare their logits."""
    with torch.no_grad():
        ref = _first_tensor(eager(*inputs))
        got = _first_tensor(candidate(*inputs))
    return compare_logits(ref, got, kl_threshold=kl_threshold, abs_threshold=abs_threshold)
