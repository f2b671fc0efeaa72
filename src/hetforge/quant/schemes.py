"""Weight quantization schemes: how a float ``[N, K]`` weight becomes int8 / int4 tensors, and back.

* ``w8`` / ``w8a8``: per output channel, symmetric: ``s[n] = max|W[n,:]| / 127``, ``q = round(W / s)`` in
  [-127, 127] (int8). Dequantized: ``q · s``.
* ``w4``: per (output channel, group of ``G`` inputs), symmetric: ``s[n,g] = max|W[n,g·G:(g+1)·G]| / 7``,
  ``q = clamp(round(W / s), -8, 7)``; stored as ``q + 8`` in 0..15 and packed two per byte by
  ``aten._convert_weight_to_int4pack_for_cpu`` (the CPU kernel dequantizes ``(u - 8)·s + z`` with ``z = 0``).

Every function here is pure (new tensors, input untouched).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetforge.kernels import native
from hetforge.ops.quant import INT4_GROUP_SIZES, INT4_N_MULTIPLE

SCHEMES = ("w8", "w4", "w8a8", "none")
_TINY = 1e-12


@dataclass
class QuantizedWeight:
    """The tensors a quantized linear reads, plus the dequantized weight's error."""

    scheme: str
    tensors: dict[str, torch.Tensor]  # name -> tensor, in the op's argument order
    rel_error: float  # ‖W − deq(Q)‖_F / ‖W‖_F
    group_size: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric int8: ``(q int8 [N,K], scales fp32 [N])``."""
    w = w.detach().float().contiguous()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(_TINY)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales[:, None]


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-wise symmetric int4: ``(q int8 in [-8, 7] [N,K], scales fp32 [N, K/G])`` (not yet packed)."""
    w = w.detach().float().contiguous()
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension {k}")
    g = w.reshape(n, k // group_size, group_size)
    scales = (g.abs().amax(dim=2) / 7.0).clamp_min(_TINY)
    q = torch.round(g / scales[..., None]).clamp(-8, 7).reshape(n, k).to(torch.int8)
    return q, scales


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    groups = scales.shape[1]
    return (q.float().reshape(n, groups, k // groups) * scales[..., None]).reshape(n, k)


def pack_int4(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernel's layout: ``(packed uint8 [N, K/2], scales_zeros fp32 [K/G, N, 2])`` with zeros 0."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8).contiguous(), 1)
    st = scales.t().contiguous()
    scales_zeros = torch.stack([st, torch.zeros_like(st)], dim=-1).contiguous()
    return packed, scales_zeros


def int4_unfit_reason(n: int, k: int, group_size: int) -> str | None:
    """Why the int4 CPU kernel cannot take an ``[n, k]`` weight at this group size (None if it can)."""
    if group_size not in INT4_GROUP_SIZES:
        return f"group size {group_size} not supported by the int4 kernel (allowed: {INT4_GROUP_SIZES})"
    if k % group_size:
        return f"group size {group_size} does not divide the input dimension {k}"
    if n % INT4_N_MULTIPLE:
        return f"output dimension {n} is not a multiple of {INT4_N_MULTIPLE} (int4 CPU kernel tile)"
    return None


def _rel_error(w: torch.Tensor, deq: torch.Tensor) -> float:
    w = w.detach().float().contiguous()
    denom = float(torch.linalg.vector_norm(w))
    return float(torch.linalg.vector_norm(w - deq)) / denom if denom > 0 else 0.0


def quantize_weight(w: torch.Tensor, scheme: str, group_size: int = 128) -> QuantizedWeight:
    """Quantize a float ``[N, K]`` weight (``F.linear`` layout) for ``scheme``."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"expected a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    if scheme in ("w8", "w8a8"):
        fast = native.quantize_i8(w.detach())  # the same q and s in two passes (None: take ATen's path)
        if fast is not None:
            return QuantizedWeight(scheme, {"qweight": fast[0], "scales": fast[1]}, fast[2])
        q, s = quantize_int8(w)
        return QuantizedWeight(scheme, {"qweight": q, "scales": s}, _rel_error(w, dequantize_int8(q, s)))
    if scheme == "w4":
        reason = int4_unfit_reason(*w.shape, group_size)
        if reason:
            raise ValueError(reason)
        q, s = quantize_int4(w, group_size)
        packed, sz = pack_int4(q, s)
        return QuantizedWeight(scheme, {"packed": packed, "scales_zeros": sz},
                               _rel_error(w, dequantize_int4(q, s)), group_size)
    raise ValueError(f"unknown scheme '{scheme}'; allowed: {', '.join(SCHEMES)}")
