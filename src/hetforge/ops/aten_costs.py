"""FLOP and byte formulas for the ATen ops the model zoo produces (and their close relatives).

Conventions (all formulas take an :class:`~hetforge.ops.registry.OpCall`):

* matmul family: ``F = 2·numel(out)·K`` (one multiply + one add per MAC), ``+ numel(out)`` for a bias/β·C add;
  for ``linear(x[...,K], W[N,K])`` this is ``2·M·N·K (+ M·N)`` with ``M = numel(x)/K``.
* attention (SDPA): ``F = 2·B·H·L·S·E + 2·B·H·L·S·Ev + 5·B·H·L·S`` (QKᵀ, P·V, softmax).
* elementwise: ``F = c·numel(out)`` with ``c = 1`` for arithmetic/compare and ``c = 4`` for transcendental
  functions (exp, tanh, sin, rsqrt, silu, …) — a nominal count, not a hardware instruction count.
* softmax ``5·numel``; layer_norm ``8·numel``; reductions ``numel(in)``.
* bytes default to every input and output touched once (:func:`default_nbytes`); gathers (embedding,
  index, gather) read only the rows they fetch: ``bytes = idx + 2·out``; views write and read nothing
  (``is_view=True`` → 0 bytes); creation ops write their output only.
"""

from __future__ import annotations

import math

from hetforge.ops.registry import DEVICE_KINDS, REGISTRY, OpCall, TensorMeta, register_aten

CPU_GPU = ("cpu", "gpu")


def _t(call: OpCall, i: int) -> TensorMeta | None:
    if i < len(call.args) and isinstance(call.args[i], TensorMeta):
        return call.args[i]
    return None


def _out_numel(call: OpCall) -> int:
    return sum(o.numel for o in call.outputs)


def _in_numel(call: OpCall) -> int:
    ts = call.tensors_in()
    return ts[0].numel if ts else 0


def matmul_flops(a_index: int, bias: bool = False):
    """``2·numel(out)·K`` where ``K`` is the last dim of argument ``a_index`` (+ ``numel(out)`` with a bias)."""

    def f(call: OpCall) -> float:
        a = _t(call, a_index)
        if a is None or not call.outputs or not a.shape:
            return 0.0
        k = a.shape[-1]
        n = call.outputs[0].numel
        return float(2 * n * k + (n if bias else 0))

    return f


def linear_flops(call: OpCall) -> float:
    """``linear(x[...,K], W[N,K], b)``: ``2·M·N·K + M·N`` (bias), ``M·N = numel(out)``."""
    has_bias = len(call.args) > 2 and isinstance(call.args[2], TensorMeta)
    return matmul_flops(0, has_bias)(call)


def sdpa_flops(call: OpCall) -> float:
    """``2·B·H·L·S·E + 2·B·H·L·S·Ev + 5·B·H·L·S`` from q ``[...,L,E]``, k ``[...,S,E]``, v ``[...,S,Ev]``."""
    q, k, v = _t(call, 0), _t(call, 1), _t(call, 2)
    if q is None or k is None or v is None:
        return 0.0
    bh = math.prod(q.shape[:-2])
    L, E = q.shape[-2], q.shape[-1]
    S, Ev = k.shape[-2], v.shape[-1]
    return float(bh * L * S * (2 * E + 2 * Ev + 5))


def per_out(c: float):
    """``c·numel(out)``."""

    def f(call: OpCall) -> float:
        return float(c * _out_numel(call))

    return f


def per_in(c: float):
    """``c·numel(first input)``."""

    def f(call: OpCall) -> float:
        return float(c * _in_numel(call))

    return f


def gather_bytes(call: OpCall) -> float:
    """Gathers read the index and the fetched rows and write the output: ``idx + 2·out``."""
    out = call.bytes_out()
    idx = sum(t.nbytes for t in call.tensors_in() if not t.dtype.is_floating_point)
    return float(idx + 2 * out)


def write_only(call: OpCall) -> float:
    """Creation ops write their output only."""
    return call.bytes_out()


def cast_bytes(call: OpCall) -> float:
    """``to``/``_to_copy``: free when dtype and shape are unchanged (returns self), else read + write."""
    x = _t(call, 0)
    if x is not None and call.outputs and call.outputs[0].dtype == x.dtype and call.outputs[0].shape == x.shape:
        return 0.0
    return (x.nbytes if x is not None else 0.0) + call.bytes_out()


def topk_flops(call: OpCall) -> float:
    """``numel(in)·log2(k+1)`` (a heap selection per row)."""
    k = call.args[1] if len(call.args) > 1 and isinstance(call.args[1], int) else call.kwargs.get("k", 1)
    return float(_in_numel(call) * math.log2(int(k) + 1))


def sort_flops(call: OpCall) -> float:
    """``numel·log2(numel of the sorted dim)``, taking the last dim."""
    x = _t(call, 0)
    if x is None or not x.shape:
        return 0.0
    return float(x.numel * math.log2(max(2, x.shape[-1])))


def zero(call: OpCall) -> float:
    return 0.0


def _reg_all(names, group: str, **kw) -> None:
    """Register each name with the same formulas; ``group`` (the cost group) goes to ``info.attrs``."""
    for n in names:
        register_aten(n, **kw).attrs["group"] = group


def _reg(name: str, group: str, **kw) -> None:
    register_aten(name, **kw).attrs["group"] = group


# --- compute: matmul family and attention
_reg("aten.linear.default", "matmul", flops=linear_flops, description="x·Wᵀ + b")
_reg("aten.addmm.default", "matmul", flops=matmul_flops(1, bias=True), description="β·C + A·B")
_reg("aten.mm.default", "matmul", flops=matmul_flops(0))
_reg("aten.matmul.default", "matmul", flops=matmul_flops(0))
_reg("aten.bmm.default", "matmul", flops=matmul_flops(0))
_reg("aten.baddbmm.default", "matmul", flops=matmul_flops(1, bias=True))
_reg("aten.addbmm.default", "matmul", flops=matmul_flops(1, bias=True))
_reg("aten._int_mm.default", "matmul", flops=matmul_flops(0))
_reg("aten._weight_int8pack_mm.default", "matmul", flops=matmul_flops(0))
for _n in ("aten.scaled_dot_product_attention.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
           "aten._scaled_dot_product_efficient_attention.default", "aten._scaled_dot_product_flash_attention.default"):
    _reg(_n, "attention", flops=sdpa_flops, description="softmax(QKᵀ/√d + mask)·V")
# CompositeImplicitAutograd: on a CPU it runs as the ops it decomposes into (a boolean mask becomes a float one
# through ``where``, then the fused kernel); the CPU cost model sums those (hetforge.cost.composite)
REGISTRY["aten.scaled_dot_product_attention.default"].attrs["composite"] = True

# --- elementwise (memory class: AI well below any ridge point)
ARITH = ["add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Scalar", "rsub.Tensor", "mul.Tensor",
         "mul.Scalar", "div.Tensor", "div.Scalar", "div.Tensor_mode", "div_.Tensor", "add_.Tensor", "mul_.Tensor",
         "add_.Scalar", "sub_.Tensor", "sub_.Scalar", "mul_.Scalar", "div_.Scalar",
         "neg.default", "abs.default", "reciprocal.default", "square.default", "clamp.default", "clamp_min.default",
         "clamp_max.default", "maximum.default", "minimum.default", "relu.default", "where.self",
         "masked_fill.Scalar", "masked_fill.Tensor", "masked_fill_.Scalar", "le.Tensor", "le.Scalar", "lt.Tensor",
         "lt.Scalar", "ge.Tensor", "ge.Scalar", "gt.Tensor", "gt.Scalar", "eq.Tensor", "eq.Scalar", "ne.Tensor",
         "ne.Scalar", "__and__.Tensor", "__or__.Tensor", "bitwise_and.Tensor", "bitwise_or.Tensor",
         "bitwise_not.default", "logical_and.default", "logical_not.default", "lerp.Scalar", "addcmul.default",
         "fill.Scalar", "fill_.Scalar", "copy_.default", "copy.default"]
TRANSC = ["exp.default", "log.default", "tanh.default", "sigmoid.default", "sin.default", "cos.default",
          "rsqrt.default", "sqrt.default", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "silu.default",
          "gelu.default", "erf.default", "log1p.default", "expm1.default", "softplus.default", "gelu_tanh.default"]
_reg_all([f"aten.{n}" for n in ARITH], "elementwise", flops=per_out(1), op_class="memory")
_reg_all([f"aten.{n}" for n in TRANSC], "transcendental", flops=per_out(4), op_class="memory")
_reg_all(["aten.softmax.int", "aten._softmax.default", "aten._safe_softmax.default", "aten.log_softmax.int",
          "aten._log_softmax.default"], "softmax", flops=per_out(5), op_class="memory")
_reg_all(["aten.layer_norm.default", "aten.native_layer_norm.default", "aten.rms_norm.default",
          "aten.group_norm.default"], "norm", flops=per_in(8), op_class="memory")

# --- reductions
_reg_all(["aten.mean.dim", "aten.mean.default", "aten.sum.dim_IntList", "aten.sum.default", "aten.amax.default",
          "aten.amin.default", "aten.max.dim", "aten.min.dim", "aten.var.correction", "aten.var_mean.correction",
          "aten.prod.dim_int", "aten.any.dim", "aten.all.dim", "aten.norm.ScalarOpt_dim",
          "aten.linalg_vector_norm.default"], "reduction", flops=per_in(1), op_class="memory")
_reg("aten.argmax.default", "reduction", flops=per_in(1), op_class="memory")
_reg("aten.cumsum.default", "reduction", flops=per_in(1), op_class="memory", devices=CPU_GPU)
_reg("aten.topk.default", "reduction", flops=topk_flops, op_class="memory")
_reg("aten.sort.default", "reduction", flops=sort_flops, op_class="memory", devices=CPU_GPU)
_reg("aten.argsort.default", "reduction", flops=sort_flops, op_class="memory", devices=CPU_GPU)

# --- data movement: gathers, copies, concatenation
_reg_all(["aten.embedding.default", "aten.index.Tensor", "aten.index_select.default", "aten.gather.default"], "gather",
         flops=zero, nbytes=gather_bytes, op_class="memory")
_reg_all(["aten.index_put.default", "aten.index_put_.default", "aten.scatter.src", "aten.scatter.value",
          "aten.scatter_add.default", "aten.index_add.default", "aten.index_copy.default"], "scatter",
         flops=per_out(1), op_class="memory")
_reg_all(["aten.nonzero.default", "aten.masked_select.default"], "control", flops=per_in(1), op_class="control",
         devices=CPU_GPU)
_reg_all(["aten.cat.default", "aten.stack.default", "aten.clone.default", "aten.contiguous.default",
          "aten.repeat.default", "aten.repeat_interleave.self_int", "aten.repeat_interleave.self_Tensor",
          "aten.tril.default", "aten.triu.default", "aten.flip.default", "aten.roll.default",
          "aten.slice_scatter.default", "aten.constant_pad_nd.default", "aten.pad.default", "aten.one_hot.default"],
         "movement", flops=zero, op_class="memory")
_reg_all(["aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default", "aten.to.other", "aten.type_as.default"],
         "movement", flops=zero, nbytes=cast_bytes, op_class="memory")
_reg_all(["aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.new_ones.default",
          "aten.new_zeros.default", "aten.new_full.default", "aten.new_empty.default", "aten.ones.default",
          "aten.zeros.default", "aten.full.default", "aten.empty.memory_format", "aten.ones_like.default",
          "aten.zeros_like.default", "aten.full_like.default", "aten.empty_like.default",
          "aten.scalar_tensor.default", "aten.tensor.default", "aten.lift_fresh_copy.default"], "creation",
         flops=zero, nbytes=write_only, op_class="memory")

# --- views: output aliases input 0, nothing read or written
VIEWS = ["view.default", "_unsafe_view.default", "reshape.default", "transpose.int", "permute.default",
         "unsqueeze.default", "squeeze.dim", "squeeze.dims", "squeeze.default", "expand.default", "slice.Tensor",
         "select.int", "split.Tensor", "split_with_sizes.default", "chunk.default", "unbind.int", "alias.default",
         "t.default", "detach.default", "flatten.using_ints", "unflatten.int", "narrow.default", "as_strided.default",
         "view_as.default", "expand_as.default", "dropout.default", "feature_dropout.default", "movedim.int",
         "diagonal.default", "unfold.default"]
_reg_all([f"aten.{n}" for n in VIEWS], "view", flops=zero, nbytes=zero, op_class="memory", is_view=True)
_reg("getitem", "view", flops=zero, nbytes=zero, op_class="memory", is_view=True,
              description="operator.getitem on a multi-output op")

# --- control: no data work, dispatch only
_reg_all(["aten._assert_tensor_metadata.default", "aten.to.device", "aten._assert_async.msg",
          "aten.sym_size.int", "aten.sym_numel.default", "aten._assert_scalar.default", "aten.item.default",
          "aten.lift_fresh.default", "aten.dim.default"], "control",
         flops=zero, nbytes=zero, op_class="control", devices=DEVICE_KINDS)
