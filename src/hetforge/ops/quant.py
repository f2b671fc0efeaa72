"""Quantized linear operators: real low-bit matmuls on the CPU, registered like every other op.

The quantization pass (:mod:`hetforge.quant`) replaces float linears with these. Each kernel runs an
integer matmul that PyTorch ships for the CPU; none of them dequantizes the weight to fp32 first:

* ``hetforge::linear_w8(x, qweight int8 [N,K], scales [N], bias?, act)`` — weight-only int8, per output
  channel symmetric: ``aten._weight_int8pack_mm`` (fp32 activations × int8 weights).
* ``hetforge::linear_w4(x, packed uint8 [N,K/2], scales_zeros [K/G,N,2], group_size, bias?, act)`` —
  weight-only int4, group-wise symmetric (zero = 0): ``aten._weight_int4pack_mm_for_cpu`` on the tile layout
  made by ``aten._convert_weight_to_int4pack_for_cpu``. The kernel requires N % 16 == 0, K % G == 0 and
  G in {32, 64, 128, 256}; the pass skips (and reports) layers that do not fit.
* ``hetforge::linear_w8a8(x, qweight int8 [N,K], scales [N], bias?, act)`` — int8 weights and dynamic int8
  activations: FBGEMM's ``quantized::linear_dynamic`` (activation range measured per call over the whole
  input, 7-bit range (``reduce_range``) so AVX2's 16-bit pair sums cannot saturate; int32 accumulation).
  FBGEMM needs its own packed copy of the weight; it is made on first use and cached against the int8
  tensor (weakly: it dies with the graph).

``act`` is ``none`` or one of :data:`hetforge.ops.fused.ACTIVATIONS`, so fused ``linear_act`` nodes keep their
activation. Every op's ``attrs`` say ``weight_dtype`` (``int8``/``int4``) and ``group: matmul``, which is what
the cost model and the ``rules`` placement read; byte formulas count the int8/packed-int4 weight bytes and
the scales, not an fp32 weight.
"""

from __future__ import annotations

import math
import warnings
import weakref

import torch

from hetforge.kernels import native
from hetforge.ops.fused import apply_act
from hetforge.ops.registry import OpCall, TensorMeta, register_op

QUANT_ACTS = ("none", "relu", "gelu", "gelu_tanh", "silu")
INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_N_MULTIPLE = 16
_ACT_FLOPS = {"none": 0, "relu": 1, "gelu": 8, "gelu_tanh": 8, "silu": 4}


def _act(y: torch.Tensor, act: str) -> torch.Tensor:
    return y if act == "none" else apply_act(y, act)


def _arg(call: OpCall, i: int, name: str):
    a = call.args[i] if i < len(call.args) else call.kwargs.get(name)
    return a


def _qlinear_flops(call: OpCall) -> float:
    """``2·M·N·K`` + ``M·N`` (bias) + activation (relu 1, silu 4, gelu 8 per output)."""
    x = _arg(call, 0, "x")
    if not isinstance(x, TensorMeta) or not call.outputs:
        return 0.0
    n_out = call.outputs[0].numel
    names = {"hetforge.linear_w4.default": (4, 5)}.get(call.op, (3, 4))
    bias = isinstance(_arg(call, names[0], "bias"), TensorMeta)
    act = _arg(call, names[1], "act") or "none"
    return float(2 * n_out * x.shape[-1] + (n_out if bias else 0) + _ACT_FLOPS.get(str(act), 4) * n_out)


def _qlinear_nbytes(call: OpCall) -> float:
    """Activations in and out at their dtype; weights at int8 (or packed int4, 2 per byte) plus fp32 scales.

    For ``w8a8`` the int8 copy of the activations is written and read once more (``2·M·K`` bytes).
    """
    total = call.bytes_in() + call.bytes_out()  # the weight's TensorMeta is already int8 / uint8-packed
    if call.op == "hetforge.linear_w8a8.default":
        x = _arg(call, 0, "x")
        if isinstance(x, TensorMeta):
            total += 2 * x.numel
    return float(total)


def _out_like(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


# ---------------------------------------------------------------- int8 weight-only


def _w8_fake(x, qweight, scales, bias=None, act="none"):
    return _out_like(x, qweight.shape[0])


@register_op(
    "hetforge::linear_w8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias=None, str act='none') -> Tensor",
    flops=_qlinear_flops,
    nbytes=_qlinear_nbytes,
    fake=_w8_fake,
)
def linear_w8(x, qweight, scales, bias=None, act="none"):
    """``act(x·(q·s)ᵀ + b)`` with int8 ``q`` [N,K] and per-channel ``s`` [N]: ``aten._weight_int8pack_mm``,
    or for one fp32 row the native int8 GEMV (:mod:`hetforge.kernels.native`: a quarter of the fp32 bytes)."""
    if native.q8_fits(x, qweight, scales, bias, act):
        return native.gemv_q8(x, qweight, scales, bias, act)
    y = torch.ops.aten._weight_int8pack_mm(_flat(x), qweight, scales.to(x.dtype))
    if bias is not None:
        y = y + bias
    return _act(y, act).reshape(*x.shape[:-1], qweight.shape[0])


# ---------------------------------------------------------------- int4 weight-only, group-wise


def _w4_fake(x, packed, scales_zeros, group_size, bias=None, act="none"):
    return _out_like(x, packed.shape[0])


@register_op(
    "hetforge::linear_w4(Tensor x, Tensor packed, Tensor scales_zeros, int group_size, Tensor? bias=None, "
    "str act='none') -> Tensor",
    flops=_qlinear_flops,
    nbytes=_qlinear_nbytes,
    fake=_w4_fake,
)
def linear_w4(x, packed, scales_zeros, group_size, bias=None, act="none"):
    """``act(x·Wᵀ + b)`` with ``W`` group-wise int4 (packed): ``aten._weight_int4pack_mm_for_cpu``."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(_flat(x), packed, group_size, scales_zeros.to(x.dtype))
    if bias is not None:
        y = y + bias
    return _act(y, act).reshape(*x.shape[:-1], packed.shape[0])


# ---------------------------------------------------------------- int8 weights, dynamic int8 activations


_FBGEMM_PACKS: dict[int, tuple[weakref.ref, tuple, object]] = {}  # id(qweight) -> (ref, key, packed)


def _fbgemm_packed(qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    """FBGEMM's packed weight for ``qweight``: made on first use, cached until the int8 tensor dies or changes."""
    key = (qweight._version, scales._version, None if bias is None else (id(bias), bias._version))
    hit = _FBGEMM_PACKS.get(id(qweight))
    if hit is not None and hit[0]() is qweight and hit[1] == key:
        return hit[2]
    zeros = torch.zeros(qweight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch deprecates quantized tensors; FBGEMM's prepack still needs one
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        qw = torch._make_per_channel_quantized_tensor(qweight, scales.double(), zeros, 0)
    packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.float().contiguous())

    def forget(ref: weakref.ref, i: int = id(qweight)) -> None:
        if _FBGEMM_PACKS.get(i, (None,))[0] is ref:
            del _FBGEMM_PACKS[i]

    _FBGEMM_PACKS[id(qweight)] = (weakref.ref(qweight, forget), key, packed)
    return packed


@register_op(
    "hetforge::linear_w8a8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias=None, str act='none') -> Tensor",
    flops=_qlinear_flops,
    nbytes=_qlinear_nbytes,
    fake=_w8_fake,  # same output as w8
)
def linear_w8a8(x, qweight, scales, bias=None, act="none"):
    """int8 × int8 → int32 matmul with dynamic activation quantization: FBGEMM ``quantized::linear_dynamic``."""
    packed = _fbgemm_packed(qweight, scales, bias)
    y = torch.ops.quantized.linear_dynamic(_flat(x).float(), packed, True)
    return _act(y, act).to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


QUANT_OPS = {"w8": linear_w8, "w4": linear_w4, "w8a8": linear_w8a8}


def int8_decomposition(x, qweight, scales, bias=None, act="none"):
    """``w8``/``w8a8`` as ATen for backends with their own int8 handling (OpenVINO): ``Convert(i8)·scale → linear``.

    This is the pattern OpenVINO's CPU plugin executes with compressed int8 weights; hetforge's own CPU kernel
    is the registered one above. (``w4``'s packed tile layout has no ATen unpacking op, so it has none.)
    """
    w = qweight.to(x.dtype) * scales.to(x.dtype)[:, None]
    return _act(torch.nn.functional.linear(x, w, bias), act)


OPENVINO_DECOMPOSITIONS = {"hetforge.linear_w8.default": int8_decomposition,
                           "hetforge.linear_w8a8.default": int8_decomposition}

for _info, _wdt, _adt, _kernel in (
    (linear_w8, "int8", "float", "aten._weight_int8pack_mm"),
    (linear_w4, "int4", "float", "aten._weight_int4pack_mm_for_cpu"),
    (linear_w8a8, "int8", "int8", "quantized::linear_dynamic (FBGEMM)"),
):
    _info.attrs.update({"group": "matmul", "weight_dtype": _wdt, "act_dtype": _adt, "cpu_kernel": _kernel,
                        "quantized": True})


def weight_bytes(scheme: str, n: int, k: int, group_size: int = 128) -> int:
    """Bytes a quantized ``[n, k]`` weight takes in the graph (int8 or packed int4, plus fp32 scales)."""
    if scheme in ("w8", "w8a8"):
        return n * k + 4 * n
    if scheme == "w4":
        return n * math.ceil(k / 2) + 4 * 2 * n * (k // group_size)
    raise ValueError(f"unknown scheme '{scheme}'")
