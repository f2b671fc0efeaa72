"""OpenVINO weight compression without NNCF: rewrite an ``ov.Model``'s MatMul weights to int8 / int4.

Each MatMul whose second input is a 2-D f32 ``Constant`` gets the decompression subgraph NNCF emits,
``Constant(i8 | i4) → Convert(f32) → Multiply(scale)`` (int4: group-wise, with a Reshape), which the
OpenVINO CPU plugin recognises and executes with compressed weights (the f32 weight is not rebuilt).
Scales use the same schemes as :mod:`hetforge.quant.schemes` (symmetric per channel / per group), so the
OpenVINO figures in ``bench/quant.py`` compare like with like. A weight shared with another consumer (GPT-2's
tied embedding) keeps its f32 constant for that consumer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hetforge.quant.schemes import quantize_int4, quantize_int8


@dataclass
class OvCompression:
    """How many MatMul weights were compressed, and their bytes before/after."""

    scheme: str
    compressed: int = 0
    skipped: int = 0
    bytes_before: int = 0
    bytes_after: int = 0


def compress_weights(model, scheme: str = "w8", group_size: int = 128) -> OvCompression:
    """Compress ``model``'s MatMul weights in place (``w8`` per-channel int8, ``w4`` group-wise int4)."""
    import openvino as ov
    from openvino import opset13 as ops

    rep = OvCompression(scheme)
    for node in model.get_ordered_ops():
        if node.get_type_name() != "MatMul":
            continue
        src = node.input_value(1).get_node()
        if src.get_type_name() != "Constant" or src.get_output_element_type(0) != ov.Type.f32:
            continue
        w = src.get_data()
        if w.ndim != 2:
            continue
        transpose_b = bool(node.get_transpose_b())
        w_nk = torch.from_numpy(np.array(w if transpose_b else w.T, dtype=np.float32))  # [out, in]
        n, k = w_nk.shape
        if scheme == "w4" and k % group_size:
            rep.skipped += 1
            continue
        rep.bytes_before += w.nbytes
        if scheme == "w8":
            q, s = quantize_int8(w_nk)
            deq = ops.multiply(ops.convert(ops.constant(q.numpy()), ov.Type.f32), ops.constant(s[:, None].numpy()))
            rep.bytes_after += q.numel() + 4 * s.numel()
        elif scheme == "w4":
            q, s = quantize_int4(w_nk, group_size)
            groups = k // group_size
            c = _i4_constant(q.numpy(), [n, groups, group_size])
            m = ops.multiply(ops.convert(c, ov.Type.f32), ops.constant(s[..., None].numpy()))
            deq = ops.reshape(m, ops.constant(np.array([n, k], dtype=np.int64)), False)
            rep.bytes_after += q.numel() // 2 + 4 * s.numel()
        else:
            raise ValueError(f"OpenVINO compression supports w8 and w4, not '{scheme}'")
        if not transpose_b:
            deq = ops.transpose(deq, ops.constant(np.array([1, 0], dtype=np.int64)))
        node.input(1).replace_source_output(deq.output(0))
        rep.compressed += 1
    model.validate_nodes_and_infer_types()
    return rep


def _i4_constant(q: np.ndarray, shape: list[int]):
    """An OpenVINO i4 Constant from int8 values in [-8, 7] (two per byte, low nibble first)."""
    import openvino as ov

    u = q.reshape(-1).astype(np.uint8) & 0xF
    t = ov.Tensor(ov.Type.i4, ov.Shape(shape))
    t.data[:] = (u[0::2] | (u[1::2] << 4)).astype(np.int8).reshape(t.data.shape)
    return ov.op.Constant(t)
