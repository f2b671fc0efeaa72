"""ATen's in-place ops after a product, in the graph's order (act → × mul → + res): the reference the native
kernels' epilogues (panel GEMM, AMX bf16, act_inplace) are checked against."""

from __future__ import annotations

import torch

ACTS = ["none", "relu", "gelu_tanh", "silu", "gelu"]
# the activations whose epilogue result is bit-equal to ATen's: relu (exact) and the erf GELU (left to ATen)
EXACT = ("none", "relu", "gelu")


def aten_after(y: torch.Tensor, act: str, mul: torch.Tensor | None = None,
               res: torch.Tensor | None = None) -> torch.Tensor:
    """``y`` with ATen's in-place activation, then ``* mul``, then ``+ res`` (each only when given)."""
    if act != "none":
        y = {"relu": torch.relu_, "gelu": torch.ops.aten.gelu_, "silu": torch.ops.aten.silu_,
             "gelu_tanh": lambda t: torch.ops.aten.gelu_(t, approximate="tanh")}[act](y)
    if mul is not None:
        y = y.mul_(mul)
    return y if res is None else y.add_(res)
