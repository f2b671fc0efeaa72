"""hetforge's fused operators: real ``torch.library`` custom ops the middle-end passes introduce.

Each op is one :func:`~hetforge.ops.registry.register_op` definition: the Python function is both the CPU
kernel and the reference implementation (it only calls ATen, so it also serves as the fake kernel and as the
decomposition the OpenVINO backend uses), and the decorator records FLOP/byte formulas and device kinds.

* ``hetforge::attention(q, k, v, mask?, scale, is_causal)`` — softmax(q·kᵀ·scale + mask)·v via
  ``F.scaled_dot_product_attention``; ``k``/``v`` may have fewer heads than ``q`` (grouped-query attention:
  query head ``h`` uses key/value head ``h // (Hq / Hkv)``). A boolean mask means True = attend; a float
  mask is added to the scores.
* ``hetforge::kv_attention(q, k, v, k_cache, v_cache, cache_mask, new_mask?, scale)`` — the decode step's
  attention: new rows over a read-only KV cache plus themselves, one softmax, grouped-query heads as rows.
  The runtime's decode modules call it directly, so a decode graph has one attention node per layer.
* ``hetforge::linear_act(x, weight, bias?, act, weight_t)`` — ``act(x·Wᵀ + b)``; ``weight`` is ``[out, in]``
  (``F.linear`` layout) or ``[in, out]`` when ``weight_t`` (GPT-2's Conv1D / ``addmm`` / ``matmul`` layout,
  so no transposed copy of the weight is ever made).
* ``hetforge::gated_mlp(x, w_gate, w_up, w_down?, b_gate?, b_up?, b_down?, act)`` — the gated MLP
  ``act(x·Wgᵀ) * (x·Wuᵀ)``, **followed by the down projection when ``w_down`` is given** (the pass includes
  it when the product feeds exactly one linear), so a whole SwiGLU MLP is one op.
* ``hetforge::rotary(x, cos, sin)`` — rotary position embedding ``x·cos + rotate_half(x)·sin`` (Llama/Qwen
  q and k), one node instead of seven.
* ``hetforge::rms_norm(x, weight?, eps)`` — Hugging Face's RMSNorm with its casts: computed in float32,
  cast back to ``x``'s dtype, then multiplied by ``weight``.
* ``hetforge::layer_norm(x, normalized_shape, weight?, bias?, eps)`` — ``F.layer_norm``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hetforge.kernels import native
from hetforge.ops import gemv
from hetforge.ops.registry import OpCall, TensorMeta, register_op

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
_ACT_FLOPS = {"relu": 1, "gelu": 8, "gelu_tanh": 8, "silu": 4}


def apply_act(y: torch.Tensor, act: str) -> torch.Tensor:
    """Apply one of :data:`ACTIVATIONS` (exact GELU, tanh-approximated GELU, SiLU, ReLU)."""
    if act == "relu":
        return torch.relu(y)
    if act == "gelu":
        return F.gelu(y)
    if act == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    if act == "silu":
        return F.silu(y)
    raise ValueError(f"unknown activation '{act}'; allowed: {', '.join(ACTIVATIONS)}")


def _arg(call: OpCall, i: int) -> TensorMeta | None:
    a = call.args[i] if i < len(call.args) else None
    return a if isinstance(a, TensorMeta) else None


def _str_arg(call: OpCall, i: int, name: str, default: str) -> str:
    if i < len(call.args) and isinstance(call.args[i], str):
        return call.args[i]
    return str(call.kwargs.get(name, default))


def _bool_arg(call: OpCall, i: int, name: str, default: bool) -> bool:
    if i < len(call.args) and isinstance(call.args[i], bool):
        return call.args[i]
    return bool(call.kwargs.get(name, default))


# ---------------------------------------------------------------- attention


def _attention_flops(call: OpCall) -> float:
    """``2·B·H·S·L·D`` (q·kᵀ) + ``2·B·H·S·L·Dv`` (p·v) + ``5·B·H·S·L`` (scale, mask, softmax)."""
    q, k, v = _arg(call, 0), _arg(call, 1), _arg(call, 2)
    if q is None or k is None or v is None:
        return 0.0
    bh_s = math.prod(q.shape[:-1])  # B·H·S
    ell = k.shape[-2]
    return float(bh_s * ell * (2 * q.shape[-1] + 2 * v.shape[-1] + 5))


def _attention_fake(q, k, v, mask=None, scale=1.0, is_causal=False):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@register_op(
    "hetforge::attention(Tensor q, Tensor k, Tensor v, Tensor? mask=None, float scale=1.0, "
    "bool is_causal=False) -> Tensor",
    flops=_attention_flops,
    fake=_attention_fake,
)
def attention(q, k, v, mask=None, scale=1.0, is_causal=False):
    """Scaled dot-product attention with optional mask, causality and grouped-query k/v (fp32 or bf16 on the CPU:
    the native flash-style kernel, equal to SDPA to rounding, see ``native.c``'s prefill attention, except where
    :func:`hetforge.kernels.native.prefill_attention_native` sends it to SDPA: bf16 prompts of many rows)."""
    if native.prefill_attention_fits(q, k, v, mask, is_causal) and \
            native.prefill_attention_native(q.dtype, q.shape[-2]):
        return native.prefill_attention(q, k, v, mask, scale, is_causal)
    gqa = q.dim() >= 3 and k.dim() >= 3 and k.shape[-3] != q.shape[-3]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=is_causal,
                                          scale=scale, enable_gqa=gqa)


def _kv_attention_flops(call: OpCall) -> float:
    """Over ``L = S + T`` keys (``S`` cached, ``T`` new): ``2·B·H·T·L·D`` (q·kᵀ) + ``2·B·H·T·L·D`` (p·v)
    + ``5·B·H·T·L`` (scale, mask, softmax)."""
    q, kc = _arg(call, 0), _arg(call, 3)
    if q is None or kc is None:
        return 0.0
    bht = math.prod(q.shape[:-1])
    ell = kc.shape[-2] + q.shape[-2]
    return float(bht * ell * (4 * q.shape[-1] + 5))


def _kv_attention_fake(q, k, v, k_cache, v_cache, cache_mask, new_mask=None, scale=1.0):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@register_op(
    "hetforge::kv_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor cache_mask, "
    "Tensor? new_mask=None, float scale=1.0) -> Tensor",
    flops=_kv_attention_flops,
    fake=_kv_attention_fake,
)
def kv_attention(q, k, v, k_cache, v_cache, cache_mask, new_mask=None, scale=1.0):
    """Attention of new rows over a read-only KV cache plus themselves (the decode step's attention).

    ``q [B, H, T, D]``, ``k``/``v [B, Hkv, T, D]`` (new rows), caches ``[B, Hkv, S, D]``, ``cache_mask [1, S]``
    (or ``[T, S]``: one row per new row, a sliding window over a chunk) and ``new_mask [T, T]`` additive. The cache
    is only read: the two score blocks are joined before one softmax, and grouped-query heads are rows of ``q``
    viewed as ``[Hkv, G·T]`` (no K/V repeat)."""
    if native.decode_attention_fits(q, k, v, k_cache, v_cache, cache_mask, new_mask):
        return native.decode_attention(q, k, v, k_cache, v_cache, cache_mask, new_mask, scale)
    return kv_attention_aten(q, k, v, k_cache, v_cache, cache_mask, new_mask, scale)


def kv_attention_aten(q, k, v, k_cache, v_cache, cache_mask, new_mask=None, scale=1.0, softcap=None):
    """:func:`kv_attention` in ATen ops, and with Gemma 2's ``softcap`` (``tanh(s / c) · c`` on the scores before
    the masks, as Hugging Face applies it), which the op and the native kernel do not have: the runtime's decode
    module writes a soft-capped layer's attention out with this instead of calling the op."""
    b, h, t, d = q.shape
    hkv, n = k.shape[1], k_cache.shape[2]
    g = h // hkv
    # 3-D batched products (bmm/baddbmm: no matmul reshape logic per call); head = kv_head * g + i,
    # row = i * t + position
    qg = q.reshape(b * hkv, g * t, d)
    if cache_mask.dim() == 2 and cache_mask.shape[0] > 1 and g > 1:  # [T, S]: the rows of each group's T rows
        cache_mask = cache_mask.repeat(g, 1)
    kt = k_cache.reshape(b * hkv, n, d).transpose(1, 2)
    if softcap is None:
        s_cache = torch.baddbmm(cache_mask, qg, kt, alpha=scale)
        s_new = torch.bmm(qg, k.reshape(b * hkv, t, d).transpose(1, 2)) * scale
    else:
        s_cache = torch.tanh(torch.bmm(qg, kt) * scale / softcap) * softcap + cache_mask
        s_new = torch.tanh(torch.bmm(qg, k.reshape(b * hkv, t, d).transpose(1, 2)) * scale / softcap) * softcap
    if new_mask is not None:
        s_new = s_new + (new_mask if g == 1 else new_mask.repeat(g, 1))
    p = torch.softmax(torch.cat([s_cache, s_new], dim=-1), dim=-1)
    new = torch.bmm(p[..., n:], v.reshape(b * hkv, t, -1))
    out = torch.baddbmm(new, p[..., :n], v_cache.reshape(b * hkv, n, -1))
    return out.reshape(b, h, t, v.shape[-1])


# ---------------------------------------------------------------- linear + activation


def _linear_act_flops(call: OpCall) -> float:
    """``2·M·N·K`` + ``M·N`` (bias) + ``c·M·N`` (activation: relu 1, silu 4, gelu 8)."""
    x = _arg(call, 0)
    if x is None or not call.outputs:
        return 0.0
    n_out = call.outputs[0].numel
    bias = _arg(call, 2) is not None
    act = _str_arg(call, 3, "act", "relu")
    return float(2 * n_out * x.shape[-1] + (n_out if bias else 0) + _ACT_FLOPS.get(act, 4) * n_out)


_linear = gemv.linear  # one row on several threads: the split GEMV; otherwise linear / addmm / matmul


def _linear_act_fake(x, weight, bias=None, act="relu", weight_t=False):
    n = weight.shape[-1] if weight_t else weight.shape[0]
    return x.new_empty((*x.shape[:-1], n))


@register_op(
    "hetforge::linear_act(Tensor x, Tensor weight, Tensor? bias=None, str act='relu', bool weight_t=False) -> Tensor",
    flops=_linear_act_flops,
    fake=_linear_act_fake,
)
def linear_act(x, weight, bias=None, act="relu", weight_t=False):
    """``act(x·Wᵀ + b)`` (``W`` is ``[in, out]`` when ``weight_t``); act in relu/gelu/gelu_tanh/silu."""
    return apply_act(_linear(x, weight, bias, weight_t), act)


# ---------------------------------------------------------------- gated MLP


def _gated_mlp_flops(call: OpCall) -> float:
    """Gate and up: ``2·(2·M·F·K)``; activation ``4·M·F``; product ``M·F``; down (if any) ``2·M·D·F``."""
    x, wg, wd = _arg(call, 0), _arg(call, 1), _arg(call, 3)
    if x is None or wg is None:
        return 0.0
    k = x.shape[-1]
    m = x.numel // k if k else 0
    f = wg.shape[0]
    total = 4 * m * f * k + 5 * m * f
    if wd is not None:
        total += 2 * m * wd.shape[0] * f
    return float(total)


def _gated_mlp_fake(x, w_gate, w_up, w_down=None, b_gate=None, b_up=None, b_down=None, act="silu"):
    n = w_down.shape[0] if w_down is not None else w_gate.shape[0]
    return x.new_empty((*x.shape[:-1], n))


@register_op(
    "hetforge::gated_mlp(Tensor x, Tensor w_gate, Tensor w_up, Tensor? w_down=None, Tensor? b_gate=None, "
    "Tensor? b_up=None, Tensor? b_down=None, str act='silu') -> Tensor",
    flops=_gated_mlp_flops,
    fake=_gated_mlp_fake,
)
def gated_mlp(x, w_gate, w_up, w_down=None, b_gate=None, b_up=None, b_down=None, act="silu"):
    """``act(x·Wgᵀ) * (x·Wuᵀ)``, then ``·Wdᵀ`` when ``w_down`` is given (SwiGLU with act='silu')."""
    h = apply_act(_linear(x, w_gate, b_gate, False), act) * _linear(x, w_up, b_up, False)
    return _linear(h, w_down, b_down, False) if w_down is not None else h


# ---------------------------------------------------------------- rotary position embedding


def _rotary_flops(call: OpCall) -> float:
    """``4·numel(out)``: two products, a sum and a negation per element."""
    return float(4 * call.outputs[0].numel) if call.outputs else 0.0


def _rotary_fake(x, cos, sin):
    return x.new_empty(torch.broadcast_shapes(x.shape, cos.shape, sin.shape))


@register_op(
    "hetforge::rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor",
    flops=_rotary_flops,
    op_class="memory",
    fake=_rotary_fake,
)
def rotary(x, cos, sin):
    """Rotary position embedding, Hugging Face's ``x·cos + rotate_half(x)·sin`` with
    ``rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])`` (same ops, same order: bit-equal to the chain)."""
    h = x.shape[-1] // 2
    if x.shape[-1] % 2 == 0 and cos.dim() <= x.dim() and native.row_op_fits(x, cos, sin):
        return native.rotary(x, cos, sin)  # one position for every row: one C loop, same roundings
    # contiguous, as the fake kernel (and so the compiled program's metadata) says: on the strided view of a fused
    # projection the elementwise chain would otherwise keep x's permuted strides
    return (x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin).contiguous()


# ---------------------------------------------------------------- norms


def _norm_flops(per_elem: int):
    def f(call: OpCall) -> float:
        x = _arg(call, 0)
        return float(per_elem * x.numel) if x is not None else 0.0

    f.__doc__ = f"``{per_elem}·numel(x)``"
    return f


def _rms_norm_fake(x, weight=None, eps=1e-6):
    if weight is None:
        return x.new_empty(x.shape)
    shape = torch.broadcast_shapes(x.shape, weight.shape)
    return x.new_empty(shape, dtype=torch.promote_types(weight.dtype, x.dtype))


@register_op(
    "hetforge::rms_norm(Tensor x, Tensor? weight=None, float eps=1e-06) -> Tensor",
    flops=_norm_flops(5),
    op_class="memory",
    fake=_rms_norm_fake,
)
def rms_norm(x, weight=None, eps=1e-6):
    """Hugging Face RMSNorm: ``weight * (x32 * rsqrt(mean(x32², -1) + eps)).to(x.dtype)``."""
    if weight is None or weight.dim() == 1:
        if native.row_op_fits(x, weight):
            return native.rms_norm(x, weight, eps)
    if x.dtype == torch.float32:  # one ATen call (it runs the same 5 kernels in C++; bit-equal here, see tests)
        h = F.rms_norm(x, (x.shape[-1],), None, eps)
        return weight * h if weight is not None else h
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h.to(x.dtype)
    return weight * h if weight is not None else h


def _layer_norm_fake(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    return x.new_empty(x.shape)


@register_op(
    "hetforge::layer_norm(Tensor x, int[] normalized_shape, Tensor? weight=None, Tensor? bias=None, "
    "float eps=1e-05) -> Tensor",
    flops=_norm_flops(8),
    op_class="memory",
    fake=_layer_norm_fake,
)
def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``F.layer_norm`` over the trailing ``normalized_shape`` dims (the native kernel for one fp32 dim)."""
    if (len(normalized_shape) == 1 and x.shape[-1] == normalized_shape[0] and native.row_op_fits(x, weight, bias)
            and all(t is None or t.dim() == 1 for t in (weight, bias))):
        return native.layer_norm(x, weight, bias, eps)
    return F.layer_norm(x, list(normalized_shape), weight, bias, eps)
