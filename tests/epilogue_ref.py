"""ATen's in-place ops after a product, in the graph's order (act → × mul → + res): the reference the native
kernels' epilogues (panel GEMM, AMX bf16, the bf16 panel kernel, act_inplace) are checked against."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

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


def bf16_ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference in units of the bf16 spacing at the reference's magnitude."""
    spacing = torch.clamp(ref.abs(), min=1e-3) * 2.0 ** -7
    return float(((got.float() - ref) / spacing).abs().max())


def check_bf16_epilogue(pack: Callable[[torch.Tensor], torch.Tensor], gemm: Callable[..., torch.Tensor], m: int,
                        k: int, n: int, act: str, with_mul: bool, with_res: bool, seed: int) -> None:
    """A bf16 kernel's store (``gemm(x, pack(w), b, n, act=, mul=, res=)``) against ATen's in-place bf16 ops on its
    plain product: bit for bit without an activation, within one bf16 step with one (the kernel's own exp/tanh)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    mul = torch.randn(m, n, generator=g).to(torch.bfloat16) if with_mul else None
    res = torch.randn(m, n, generator=g).to(torch.bfloat16) if with_res else None
    p = pack(w)
    ref = aten_after(gemm(x, p, b, n), act, mul, res)
    got = gemm(x, p, b, n, act=act, mul=mul, res=res)
    if act in EXACT:
        assert torch.equal(got, ref)
    else:
        assert bf16_ulps(got.float(), ref.float()) <= 1.0 + 1e-6


def bf16_operands(m: int, k: int, n: int, weight_t: bool, with_bias: bool,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Seeded bf16 ``w`` (``[n, k]``, or ``[k, n]`` when ``weight_t``), ``x`` ``[m, k]`` and ``b`` ``[n]`` or None."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn((k, n) if weight_t else (n, k), generator=g).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
    return w, x, b


def check_rounded_once(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                       weight_t: bool) -> None:
    """A bf16 kernel's ``[m, n]`` product within one bf16 step of the float64 product: the fp32 sum differs from
    float64 far below one step, so the kernel rounded once."""
    ref = F.linear(x.double(), (w.t() if weight_t else w).double(), None if b is None else b.double()).float()
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    assert bf16_ulps(got, ref) <= 1.0


def bf16_prefill(name: str, seq: int):
    """A zoo model cast to bf16, its logits module, a ``seq``-token example input and the compiled host program:
    ``(module, executable, inputs)`` (the bf16 kernels' executor tests)."""
    import copy
    import dataclasses

    from hetforge.compile import compile_graph
    from hetforge.frontend import capture
    from hetforge.models.zoo import example_inputs, load_model

    base = load_model(name)
    loaded = dataclasses.replace(base, model=copy.deepcopy(base.model).to(torch.bfloat16).eval())
    inputs = example_inputs(loaded, seq=seq)
    module = loaded.logits_module()
    exe = compile_graph(capture(module, inputs, name=name).gm, soc="host", example_inputs=inputs, name=name).executable
    return module, exe, inputs
