"""Kernel choice: the lowering step that decides which kernel runs each instruction, recorded on it.

:func:`lower_kernels` runs after memory planning (it needs to know which values have an arena slice) and
writes ``Instr.attrs["kernel"]`` on every instruction — saved with the program and shown in its text.
The arena executor (:mod:`hetforge.executor.runtime`) only emits code for the recorded kernel, and the
cost model (:mod:`hetforge.cost.instr`) only reads it. Op-specific kernels are registered per op
(:data:`OP_KERNELS`: op name → chooser); the general rules below apply to every other op.

The kernels, per instruction kind:

* view: ``elided`` (a view that returns its input unchanged, :func:`identity_view`: the register is bound,
  no call), ``static-view`` (a view of arena slices or weights, made once when the executable is built;
  mode ``arena`` only), else ``view`` (called per run);
* in-place: ``inplace``; transfer: ``zero-copy`` (the source is bound), ``transfer-copy`` (copied into the
  destination's slice) or ``transfer`` (a fresh tensor on the destination);
* kernel, op-specific (registered): ``native:<fn>`` (one call of the native C kernel ``fn`` of
  :mod:`hetforge.kernels.native`: one-row GEMVs and the ``hetforge::`` row ops, writing the slice; a
  prefill rotary, many positions, is ``native:hf_rotary_pos``, which reads a transposed projection output with
  its strides instead of copying it, and a prefill ``attention`` is ``native:hf_prefill_attention``, likewise; a
  bf16 instruction gets the ``_bf16`` twin of its fp32 kernel, and a one-row bf16 ``linear``/``addmm``/``mm``/
  ``linear_act`` ``native:hf_gemv_bf16``, not measured against oneDNN),
  ``native:hf_gemm_few`` / ``native:hf_gemm_few_kn`` / ``native:hf_gated_mlp_few`` (fp32 ``linear``/``addmm``/
  ``mm``/``linear_act`` / ``gated_mlp`` of 2..8 rows, the weight read as the GEMVs read it; :data:`NATIVE_FEW`),
  ``split-gemv:<c>`` (a one-row product as one threaded ``bmm`` over ``c`` chunks, :mod:`hetforge.ops.gemv`),
  ``gemm-out`` (``linear`` as ``addmm.out``/``mm.out`` on 2-D views of input and slice, the weight
  transposed once at load — the same GEMM eager's ``linear`` runs);
* kernel, general: ``fresh`` (the output is not planned — a graph output — so the functional op runs),
  ``copy-into`` (a copy-like op — ``to``, ``_to_copy``, ``clone``, ``contiguous``, eval ``dropout`` — as
  ``slice.copy_(input)``), ``out-variant`` (the ATen ``out=`` overload with the functional op's arguments),
  ``unplanned`` (mode ``fast``: the functional result kept where the allocator put it) or
  ``functional-copy`` (the functional op, then ``slice.copy_(result)``).

oneDNN's packed GEMM (:mod:`hetforge.kernels.onednn`) is a *measured* choice: which of it and ATen is
faster is timed once per shape and process when an executable is first built for that shape. Lowering
records only the static candidacy, ``attrs["onednn"] = [rows, K, N]`` beside the kernel that runs when
oneDNN loses; :func:`resolved_kernels` gives what really runs (``onednn`` for a candidate measured faster, and
``view`` for a static view over a oneDNN result, which is a fresh tensor each call), from the measured choices.

The choice depends on the host (torch devices, the native library, thread count) and the executor mode;
the program records them in ``attrs["kernel_context"]`` and an executable built under another context
lowers a copy again (:func:`with_kernels`).
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from hetforge.errors import UsageError
from hetforge.ir.program import INPLACE, KERNEL, TRANSFER, VIEW, WEIGHT, Instr, Program, Reg, map_regs
from hetforge.kernels import native, onednn
from hetforge.ops import gemv, moe, quant

KERNEL_ATTR, ONEDNN_ATTR, CONTEXT_ATTR = "kernel", "onednn", "kernel_context"
MODES = ("arena", "fast")
GEMM_OPS = ("aten.linear.default", "aten.addmm.default", "aten.mm.default")
ONEDNN_OPS = GEMM_OPS + ("hetforge.linear_act.default", "hetforge.gated_mlp.default")
QUANT_LINEAR_OPS = ("hetforge.linear_w8.default", "hetforge.linear_w4.default")
NATIVE_GEMV = ("native:hf_gemv_nk", "native:hf_gemv_kn")  # one-row products (costed as the op itself)
# fp32 products of 2..native.FEW_MAX rows (linear, linear_act; gated_mlp: NATIVE_FEW_MLP),
# not measured against oneDNN: at a few rows a product streams its weight like a GEMV, and oneDNN's packed GEMM read
# it at ~0.6-0.95x the native kernel's rate with the weights coming from memory (docs/arch/runtime.md)
NATIVE_FEW, NATIVE_FEW_MLP = "native:hf_gemm_few", "native:hf_gated_mlp_few"
NATIVE_FEW_KN = "native:hf_gemm_few_kn"  # the same for a [K, N] weight (GPT-2's Conv1D), split over K
# one bf16 row of a linear/addmm/mm (costed as the op itself, as NATIVE_GEMV) or of a linear_act
NATIVE_GEMV_BF16 = "native:hf_gemv_bf16"
BF16 = torch.bfloat16
# kernels that leave the register bound to its arena slice (a later view of it can be made at build time)
WRITES_SLICE = ("gemm-out", "copy-into", "out-variant", "functional-copy", "transfer-copy")
# views that return their input (or an equal view of it) when shape and dtype do not change
IDENTITY_VIEW_OPS = {
    "aten.alias.default", "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten.to.other",
    "aten.expand.default", "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
}
RESHAPE_VIEWS = ("aten.reshape.default", "aten.view.default", "aten._unsafe_view.default")
COPY_LIKE = {
    "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten.to.other", "aten._to_copy.default",
    "aten.clone.default", "aten.contiguous.default", "aten.alias.default",
}


@functools.cache
def out_variant(target: Any) -> Any:
    """The ``out=`` overload of an ATen OpOverload with identical non-out arguments (names and types)."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    fs = target._schema
    if len(fs.returns) != 1:
        return None
    want = [(a.name, str(a.type)) for a in fs.arguments]
    packet = getattr(getattr(torch.ops, target.namespace), target._opname)
    for name in packet.overloads():
        ov = getattr(packet, name)
        s = ov._schema
        outs = [a for a in s.arguments if a.is_out]
        if len(outs) != 1 or outs[0].name != "out":
            continue
        if [(a.name, str(a.type)) for a in s.arguments if not a.is_out] == want:
            return ov
    return None


def returns_alias(target: Any) -> bool:
    """Whether an op's result may share its input's storage (``transpose``, ``view``...: an alias annotation
    in its schema). Mode ``fast`` keeps a kernel's result in its own allocation only when it cannot: a view of
    an arena slice would outlive the slice's planned lifetime, so such a result is copied into its own slice."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def is_copy_like(op: str, args: tuple, kwargs: dict) -> bool:
    if op in COPY_LIKE:
        return True
    if op == "aten.dropout.default":
        train = args[2] if len(args) > 2 else kwargs.get("train", True)
        return train is False
    return False


def identity_view(ins: Instr, program: Program,
                  same_device: Callable[[str, str], bool] | None = None) -> bool:
    """Whether a view returns its input unchanged, so the executor binds the register with no call: an op of
    :data:`IDENTITY_VIEW_OPS` whose output has its input's shape, strides, offset and dtype, on the input's
    device (``same_device(a, b)``: by name unless the caller maps devices)."""
    if ins.op not in IDENTITY_VIEW_OPS or len(ins.outputs) != 1 or not ins.args or not isinstance(ins.args[0], Reg):
        return False
    a, o = program.values[ins.args[0].id], program.values[ins.outputs[0]]
    if a.kind == WEIGHT or not (same_device or str.__eq__)(a.device, ins.device):
        return False
    return (a.shape, a.stride, a.storage_offset, a.dtype) == (o.shape, o.stride, o.storage_offset, o.dtype)


def bind_args(ins) -> dict[str, Any] | None:
    """The instruction's arguments by schema name, defaults filled in (None when they do not bind)."""
    schema = getattr(ins.target, "_schema", None)
    if schema is None:
        return None
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(ins.args):
            out[a.name] = ins.args[i]
        elif a.name in ins.kwargs:
            out[a.name] = ins.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            return None
    return out


def gemm_operands(ins: Instr) -> tuple[Any, Any, Any, bool] | None:
    """``(x, w, bias, weight_t)`` of an ATen ``linear`` (``[N, K]`` weight), ``addmm`` or ``mm`` (``[K, N]``
    weight: ``weight_t``), or None for another op or form."""
    a = ins.args
    if ins.op == "aten.linear.default":
        return a[0], a[1], (a[2] if len(a) > 2 else None), False
    if ins.op == "aten.addmm.default" and len(a) == 3:
        return a[1], a[2], a[0], True
    if ins.op == "aten.mm.default":
        return a[0], a[1], None, True
    return None


def default_device_map(p: Program, soc=None) -> dict[str, torch.device]:
    """SoC device name → the torch device that runs it on this host: ``cpu`` → ``cpu``; a ``gpu`` → ``cuda``
    when PyTorch sees one, else the CPU (emulated); anything else → the CPU."""
    kinds = {d.name: d.kind for d in soc.devices} if soc is not None else {}
    out = {}
    for d in p.devices:
        kind = kinds.get(d, d)
        out[d] = torch.device("cuda") if kind == "gpu" and torch.cuda.is_available() else torch.device("cpu")
    return out


class Lowering:
    """What a chooser reads: the program, its planned values, the device map and the executor mode."""

    def __init__(self, p: Program, planned, device_map: dict[str, torch.device], mode: str):
        self.p, self.planned, self.dm, self.mode = p, planned, device_map, mode
        self._moved: dict[tuple[int, str], torch.Tensor] = {}

    def weight(self, vid: int, dev: torch.device) -> torch.Tensor:
        """Weight ``vid`` as the executor will hold it on ``dev`` (the choosers ask only for CPU devices)."""
        t = self.p.tensors[vid]
        if t.device == dev:
            return t
        if (vid, str(dev)) not in self._moved:
            self._moved[(vid, str(dev))] = t.to(dev)
        return self._moved[(vid, str(dev))]

    def native_operand(self, a: Any, dev: torch.device, numel: int | None = None,
                       dtype: torch.dtype = torch.float32) -> bool:
        """Whether ``a`` is a register a native kernel can read: ``dtype`` (fp32, or bf16 for the ``_bf16``
        kernels), contiguous, on this CPU (and ``numel``)."""
        if not isinstance(a, Reg):
            return False
        v = self.p.values[a.id]
        return (v.dtype == dtype and v.is_contiguous and self.dm[v.device] == dev
                and (numel is None or math.prod(v.shape) == numel))

    def is_weight(self, a: Any) -> bool:
        return isinstance(a, Reg) and self.p.values[a.id].kind == WEIGHT


Chooser = Callable[[Lowering, Instr, int, torch.device], str | None]
OP_KERNELS: dict[str, Chooser] = {}  # op name → its op-specific kernel (None: the general rules apply)
ONEDNN_CANDIDATES: dict[str, Callable[[Lowering, Instr, int, torch.device], list[int] | None]] = {}
# op name → what packs an op's own weights when a program is built (``Executable.prepack``): called with the
# instruction's args and kwargs and a function mapping an argument to its tensor (a weight's, a meta stand-in of
# another register's shape and dtype, else None); returns how many weights it packed
PREPACK: dict[str, Callable[[tuple, dict, Callable[[Any], Any]], int]] = {"hetforge.moe.default": moe.prepack_call}
# op name → what packs the weights of all of a program's calls of that op at once, on several threads (called with
# the calls' (args, kwargs), the same argument-to-tensor function and the thread count; returns how many it packed)
PREPACK_ALL: dict[str, Callable[[list, Callable[[Any], Any], int], int]] = {"hetforge.linear_w8a8.default":
                                                                          quant.prepack_w8a8}


def register(table: dict, *ops: str):
    """Register a chooser for ``ops`` in ``table`` (:data:`OP_KERNELS` or :data:`ONEDNN_CANDIDATES`)."""
    def deco(fn):
        for op in ops:
            table[op] = fn
        return fn
    return deco


@register(OP_KERNELS, *GEMM_OPS)
def _gemm(lw: Lowering, ins: Instr, o: int, dev: torch.device) -> str | None:
    """A linear-type product with a weight: one fp32 row on the native GEMV, else (threaded CPU) the split
    GEMV; ``linear`` of a contiguous input into a planned slice as ``addmm.out``/``mm.out`` (``gemm-out``)."""
    ops = None if ins.kwargs else gemm_operands(ins)
    if ops is None:
        return None
    x, w, b, weight_t = ops
    if not (isinstance(x, Reg) and lw.is_weight(w)):
        return None
    vx, vo = lw.p.values[x.id], lw.p.values[o]
    if not (vx.is_contiguous and vo.is_contiguous and len(vx.shape) >= 2 and (b is None or isinstance(b, Reg))):
        return None
    k = vx.shape[-1]
    rows = math.prod(vx.shape) // k if k else 0
    wt = lw.weight(w.id, dev) if dev.type == "cpu" and 1 <= rows <= native.FEW_MAX else None
    if wt is not None and wt.is_contiguous() and rows == 1:  # one row on the CPU
        if _native_gemv_fits(lw, x, wt, b, weight_t, o, dev):
            return NATIVE_GEMV[weight_t]
        if _native_gemv_fits(lw, x, wt, b, weight_t, o, dev, bf16=True):
            return NATIVE_GEMV_BF16
        c = gemv.chunks_for(wt.shape[0])  # N of an [N, K] weight (split over outputs), K of a [K, N] one
        if c is not None:
            return f"split-gemv:{c}"
    if wt is not None and wt.is_contiguous() and _few(rows, vo.dtype) \
            and _native_gemv_fits(lw, x, wt, b, weight_t, o, dev, rows=rows):
        return NATIVE_FEW_KN if weight_t else NATIVE_FEW
    if weight_t or o not in lw.planned:  # the out= variant / functional op is the same GEMM
        return None
    return "gemm-out"


def _few(rows: int, dtype: torch.dtype) -> bool:
    """Whether a product of ``rows`` rows may run on a few-row native kernel (:data:`NATIVE_FEW`): fp32, 2..8 rows
    (:data:`native.FEW_MAX`) that the panel GEMM does not take by rule (:func:`onednn.panel_rows`: from
    :data:`native.PANEL_MIN` rows it read the weights faster than the few-row kernels on the calibration shapes),
    and no GEMM policy forced (``HETFORGE_GEMM=aten``/``onednn`` keep every multi-row product on that kernel)."""
    return (1 < rows <= native.FEW_MAX and dtype == torch.float32 and onednn.policy() == "auto"
            and not onednn.panel_rows(rows, dtype))


def _native_gemv_fits(lw: Lowering, x: Reg, w: torch.Tensor, b: Any, weight_t: bool, o: int,
                      dev: torch.device, bf16: bool = False, rows: int = 1) -> bool:
    """Whether a native one-row GEMV (or, ``rows`` > 1, ``hf_gemm_few``) runs this product: the library built,
    input, output and weight of one dtype the kernel takes (fp32: ``hf_gemv_nk``/``hf_gemv_kn``/``hf_gemm_few``;
    ``bf16``: ``hf_gemv_bf16``), a bias that is a contiguous ``[N]``. bf16 is chosen over oneDNN's bf16 linear
    without measuring: one row is a bandwidth-bound stream, which the native kernel reads at the host's stream rate
    (the fp32 GEMV's rule; :data:`NATIVE_FEW` says why a few rows follow it)."""
    vx, vo = lw.p.values[x.id], lw.p.values[o]
    k, n = (w.shape if weight_t else (w.shape[1], w.shape[0]))
    w_ok = (vx.dtype == BF16 and w.dim() == 2 and native.bf16_fits(w)) if bf16 \
        else native.fits(w, None, weight_t, vx.dtype)
    if dev.type != "cpu" or vo.dtype != vx.dtype or not w_ok or lw.dm[vx.device] != dev or vx.shape[-1] != k \
            or math.prod(vo.shape) != rows * n:
        return False
    if b is None:
        return True
    vb = lw.p.values[b.id]
    if vb.kind == WEIGHT:
        bt = lw.weight(b.id, dev)
        return (native.bf16_fits(bt) and bt.numel() == n) if bf16 else native.fits(w, bt, weight_t, vx.dtype)
    return vb.dtype == vx.dtype and vb.is_contiguous and math.prod(vb.shape) == n and lw.dm[vb.device] == dev


def _row_shape(lw: Lowering, ins: Instr, o: int, dev: torch.device) -> tuple[dict, int, int] | None:
    """Bound arguments, rows and last dim of a ``hetforge::`` row op the native kernels may run (fp32, or bf16
    for the ``_bf16`` kernels), or None."""
    if dev.type != "cpu" or native.library() is None:
        return None
    args = bind_args(ins)
    vo = lw.p.values[o]
    if args is None or vo.dtype not in (torch.float32, BF16) or not vo.is_contiguous or not vo.shape:
        return None
    d = vo.shape[-1]
    return args, math.prod(vo.shape) // d, d


def native_row_op(*ops: str):
    """Register a chooser of a ``hetforge::`` row op's native kernel for ``ops``: it is called with the op's
    bound arguments, its rows and last dim, only where a native kernel can run at all (:func:`_row_shape`)."""
    def deco(fn):
        def chooser(lw: Lowering, ins: Instr, o: int, dev: torch.device) -> str | None:
            got = _row_shape(lw, ins, o, dev)
            return None if got is None else fn(lw, ins, o, dev, *got)
        register(OP_KERNELS, *ops)(chooser)
        return fn
    return deco


def _optional(lw: Lowering, a: Any, dev: torch.device, n: int, dtype: torch.dtype = torch.float32) -> bool:
    return a is None or lw.native_operand(a, dev, n, dtype)


def _bf16_suffix(dt: torch.dtype) -> str:
    """``_bf16`` for a bf16 instruction (its kernel is the fp32 one's ``_bf16`` twin in native.c), else ``""``."""
    return "_bf16" if dt == BF16 else ""


@native_row_op("hetforge.rms_norm.default", "hetforge.layer_norm.default", "hetforge.rotary.default")
def _native_row(lw: Lowering, ins: Instr, o: int, dev: torch.device, args: dict, rows: int,
                d: int) -> str | None:
    x, dt = args["x"], lw.p.values[o].dtype
    if not lw.native_operand(x, dev, rows * d, dt) or lw.p.values[x.id].shape != lw.p.values[o].shape:
        return _native_rotary_positions(lw, ins, o, dev, args, d) if ins.op == "hetforge.rotary.default" else None
    if ins.op == "hetforge.rms_norm.default":
        ok, fn = _optional(lw, args["weight"], dev, d, dt), "hf_rms_norm"
    elif ins.op == "hetforge.layer_norm.default":
        ok = list(args["normalized_shape"]) == [d] and _optional(lw, args["weight"], dev, d, dt) \
            and _optional(lw, args["bias"], dev, d, dt)
        fn = "hf_layer_norm"
    else:
        ok = not d % 2 and lw.native_operand(args["cos"], dev, d, dt) and lw.native_operand(args["sin"], dev, d, dt)
        fn = "hf_rotary"
    return f"native:{fn}{_bf16_suffix(dt)}" if ok else None


def rotary_cos_stride(lw: Lowering, a: Any, dev: torch.device, s: int, d: int) -> int | None:
    """How a rotary ``cos``/``sin`` operand steps from one position's row to the next (``d``: one row per
    position, ``[.., s, d]``; ``0``: one row for all), or None when ``hf_rotary_pos`` cannot read it (not a dense
    fp32 operand on this CPU, or another broadcast)."""
    if not isinstance(a, Reg):
        return None
    shape, dt = tuple(lw.p.values[a.id].shape), lw.p.values[a.id].dtype
    dt = dt if dt == BF16 else torch.float32
    if lw.native_operand(a, dev, d, dt) and shape[-1:] == (d,):
        return 0
    if lw.native_operand(a, dev, s * d, dt) and shape[-2:] == (s, d):
        return d
    return None


def _native_rotary_positions(lw: Lowering, ins: Instr, o: int, dev: torch.device, args: dict,
                             d: int) -> str | None:
    """Rotary over many positions (prefill) on ``hf_rotary_pos``: a 4-D fp32 ``x`` read with its own strides (a
    transposed view of a projection: no copy; the last dim dense), one cos/sin row per position."""
    x = args["x"]
    if not isinstance(x, Reg) or d % 2:
        return None
    vx, vo = lw.p.values[x.id], lw.p.values[o]
    if vx.dtype not in (torch.float32, BF16) or vo.dtype != vx.dtype or lw.dm[vx.device] != dev \
            or len(vx.shape) != 4 or vx.stride[-1] != 1 or tuple(vx.shape) != tuple(vo.shape):
        return None
    s = vx.shape[2]
    cs = rotary_cos_stride(lw, args["cos"], dev, s, d)
    if cs is None or rotary_cos_stride(lw, args["sin"], dev, s, d) != cs \
            or any(lw.p.values[args[n].id].dtype != vx.dtype for n in ("cos", "sin")):
        return None
    return f"native:hf_rotary_pos{_bf16_suffix(vx.dtype)}"


@native_row_op(QUANT_LINEAR_OPS[0])
def _native_w8(lw: Lowering, ins: Instr, o: int, dev: torch.device, args: dict, rows: int,
               d: int) -> str | None:
    """An int8-weight product on a native kernel, by the w8 activation mode (:func:`native.w8_act_mode`): one row
    on ``hf_gemv_q8a`` (``q8``: x quantized per block of 32) or ``hf_gemv_q8`` (``weight-only``: fp32 x); several
    rows (prefill, chunk) on ``hf_gemm_q8a`` under ``q8`` (the same per-row arithmetic as the decode GEMV), or
    under ``weight-only`` none (the op's own dequantize + float GEMM)."""
    x, qw, sc = args["x"], args["qweight"], args["scales"]
    if not (isinstance(qw, Reg) and isinstance(sc, Reg) and isinstance(x, Reg)) or args["act"] not in native.ACT_CODES:
        return None
    fn = native.q8_kernel(rows)
    vq, vx = lw.p.values[qw.id], lw.p.values[x.id]
    kk = vx.shape[-1] if vx.shape else 0
    ok = (fn is not None and rows >= 1 and lw.native_operand(x, dev, rows * kk) and vq.kind == WEIGHT
          and vq.dtype == torch.int8 and vq.is_contiguous and tuple(vq.shape) == (d, kk) and lw.dm[vq.device] == dev
          and lw.native_operand(sc, dev, d) and _optional(lw, args["bias"], dev, d))
    return f"native:{fn}" if ok else None


@native_row_op(QUANT_LINEAR_OPS[1])
def _native_w4(lw: Lowering, ins: Instr, o: int, dev: torch.device, args: dict, rows: int,
               d: int) -> str | None:
    """A group-wise int4 product on hetforge's int4·int8 kernels under the w4 activation mode ``q8``
    (:func:`native.q4_kernel`): one row on ``hf_gemv_q4a``, several (prefill, chunk) on ``hf_gemm_q4a``, x quantized
    per block of 32 either way; a weight they cannot read (:func:`hetforge.ops.quant.w4_weight_fits`) or the
    ``weight-only`` mode keeps the op's own path (ATen's int4 kernel / dequantize + float GEMM)."""
    from hetforge.ops.quant import w4_weight_fits

    x, pk, sz, g = args["x"], args["packed"], args["scales_zeros"], args["group_size"]
    if not (isinstance(x, Reg) and lw.is_weight(pk) and lw.is_weight(sz)) or args["act"] not in native.ACT_CODES \
            or lw.p.values[o].dtype != torch.float32:
        return None
    fn = native.q4_kernel(rows)
    vx, vp = lw.p.values[x.id], lw.p.values[pk.id]
    kk = vx.shape[-1] if vx.shape else 0
    ok = (fn is not None and lw.native_operand(x, dev, rows * kk) and tuple(vp.shape) == (d, kk // 2)
          and lw.dm[vp.device] == dev and lw.dm[lw.p.values[sz.id].device] == dev
          and _optional(lw, args["bias"], dev, d) and isinstance(g, int)
          and w4_weight_fits(lw.weight(pk.id, dev), lw.weight(sz.id, dev), g))
    return f"native:{fn}" if ok else None


@native_row_op("hetforge.linear_act.default")
def _native_linear_act(lw: Lowering, ins: Instr, o: int, dev: torch.device, args: dict, rows: int,
                       d: int) -> str | None:
    """One row of ``act(x·W + b)`` on the native fused kernel (``hf_gemv_bf16`` with its activation for bf16); a few
    fp32 rows on ``hf_gemm_few`` / ``hf_gemm_few_kn`` (:data:`NATIVE_FEW`)."""
    x, w, wt, dt = args["x"], args["weight"], bool(args["weight_t"]), lw.p.values[o].dtype
    if not (lw.native_operand(x, dev, None, dt) and lw.is_weight(w)):
        return None
    ws = lw.p.values[w.id].shape
    kk = math.prod(lw.p.values[x.id].shape)
    if _few(rows, dt) and kk == rows * ws[0 if wt else -1]:
        kk //= rows  # a few rows (NATIVE_FEW, NATIVE_FEW_KN)
    elif rows != 1:
        return None
    if args["act"] in ("none", None) or args["act"] not in native.ACT_CODES or len(ws) != 2 \
            or ws != ((kk, d) if wt else (d, kk)) \
            or not (lw.native_operand(w, dev, None, dt) and _optional(lw, args["bias"], dev, d, dt)):
        return None
    if rows > 1:
        return NATIVE_FEW_KN if wt else NATIVE_FEW
    return NATIVE_GEMV_BF16 if dt == BF16 else "native:hf_linear_act"


@native_row_op("hetforge.gated_mlp.default")
def _native_gated_mlp(lw: Lowering, ins: Instr, o: int, dev: torch.device, args: dict, rows: int,
                      d: int) -> str | None:
    """One row of a gated MLP (gate, up, and down when present) on the native fused kernel; a few fp32 rows on
    ``hf_gated_mlp_few`` (:data:`NATIVE_FEW_MLP`)."""
    x, wg, wu, wd, dt = args["x"], args["w_gate"], args["w_up"], args["w_down"], lw.p.values[o].dtype
    if not lw.native_operand(x, dev, None, dt) or any(args[b] is not None for b in ("b_gate", "b_up", "b_down")):
        return None
    dm = math.prod(lw.p.values[x.id].shape)
    ws = [wg, wu] if wd is None else [wg, wu, wd]
    if not all(lw.is_weight(a) and lw.native_operand(a, dev, None, dt) for a in ws):
        return None
    if _few(rows, dt) and dm % rows == 0:
        dm //= rows  # a few rows (NATIVE_FEW_MLP)
    elif rows != 1:
        return None
    f = lw.p.values[wg.id].shape[0]
    want = [(f, dm), (f, dm)] + ([] if wd is None else [(dm, f)])
    if args["act"] in ("none", None) or args["act"] not in native.ACT_CODES or \
            d != (f if wd is None else dm) or [tuple(lw.p.values[a.id].shape) for a in ws] != want:
        return None
    return NATIVE_FEW_MLP if rows > 1 else f"native:hf_gated_mlp{_bf16_suffix(dt)}"


@native_row_op("hetforge.kv_attention.default")
def _native_decode_attention(lw: Lowering, ins: Instr, o: int, dev: torch.device, args: dict, rows: int,
                             d: int) -> str | None:
    """Attention of one new row over the KV cache on the native kernel."""
    q, k, v, kc, vc = (args[n] for n in ("q", "k", "v", "k_cache", "v_cache"))
    if not all(isinstance(a, Reg) for a in (q, k, v, kc, vc)):
        return None
    sq, sk, sc = (lw.p.values[a.id].shape for a in (q, k, kc))
    if len(sq) != 4 or sq[0] != 1 or sq[2] != 1 or len(sk) != 4 or sk[0] != 1 or sk[2] != 1 or len(sc) != 4:
        return None
    h, hd, hkv, s = sq[1], sq[3], sk[1], sc[2]
    if sk != lw.p.values[v.id].shape or sk[3] != hd or h % hkv or tuple(sc) != (1, hkv, s, hd) \
            or lw.p.values[vc.id].shape != sc:
        return None
    dt = lw.p.values[o].dtype
    if not (all(lw.native_operand(a, dev, None, dt) for a in (q, k, v, kc, vc))
            and lw.native_operand(args["cache_mask"], dev, s, dt) and _optional(lw, args["new_mask"], dev, 1, dt)):
        return None
    return f"native:hf_decode_attention{_bf16_suffix(dt)}"


@native_row_op("hetforge.attention.default")
def _native_prefill_attention(lw: Lowering, ins: Instr, o: int, dev: torch.device, args: dict, rows: int,
                              d: int) -> str | None:
    """Attention of many query rows (prefill) on ``hf_prefill_attention``: 4-D q/k/v of one dtype, fp32 or bf16,
    on this CPU with any strides (the transposed views of a fused projection are read in place), grouped-query
    heads, no mask or a mask that broadcasts to the scores — bool, or additive in q's dtype — (not with
    ``is_causal``); heads of at most
    :data:`native.PREFILL_ATTENTION_DMAX`. The output is the dense ``[b, h, l, dv]`` slice."""
    q, k, v, mask = args["q"], args["k"], args["v"], args["mask"]
    if not all(isinstance(a, Reg) for a in (q, k, v)) or (mask is not None and not isinstance(mask, Reg)):
        return None
    vq, vk, vv, vo = (lw.p.values[a.id] for a in (q, k, v, Reg(o)))
    if vq.dtype not in (torch.float32, BF16) or vo.dtype != vq.dtype or any(
            x.dtype != vq.dtype or lw.dm[x.device] != dev or len(x.shape) != 4 for x in (vq, vk, vv)):
        return None
    b, h, ell, hd = vq.shape
    hkv, s = vk.shape[1], vk.shape[2]
    dmax = native.PREFILL_ATTENTION_DMAX
    if not (vk.shape[0] == b and tuple(vv.shape[:3]) == (b, hkv, s) and vk.shape[3] == hd and hkv and h % hkv == 0
            and ell and s and hd <= dmax and 0 < d <= dmax and tuple(vo.shape) == (b, h, ell, d) and vv.shape[3] == d):
        return None
    if mask is not None:
        vm = lw.p.values[mask.id]
        kind_ok = vm.dtype in (torch.bool, vq.dtype)
        if bool(args["is_causal"]) or not kind_ok or lw.dm[vm.device] != dev \
                or len(vm.shape) > 4 or not all(m in (1, w) for m, w in zip(vm.shape[::-1], (s, ell, h, b),
                                                                            strict=False)):
            return None
    if not native.prefill_attention_native(vq.dtype, ell):
        return None
    return "native:hf_prefill_attention"


def onednn_operands(ins: Instr) -> tuple[Any, Any, Any, bool, str, tuple | None] | None:
    """``(x, w, bias, weight_t, act, gate)`` of an instruction oneDNN's packed linear may run (``gate``:
    ``(w_gate, b_gate, w_down, b_down)`` of a gated MLP, whose ``w``/``bias`` are the up projection's)."""
    if ins.op not in ONEDNN_OPS or ins.kwargs and not ins.op.startswith("hetforge."):
        return None
    ops = gemm_operands(ins)
    if ops is not None:
        return (*ops, "none", None)
    if ins.op in GEMM_OPS:
        return None
    args = bind_args(ins)
    if args is None:
        return None
    if ins.op == "hetforge.linear_act.default":
        return args["x"], args["weight"], args["bias"], bool(args["weight_t"]), args["act"], None
    return (args["x"], args["w_up"], args["b_up"], False, args["act"],
            (args["w_gate"], args["b_gate"], args["w_down"], args["b_down"]))


@register(ONEDNN_CANDIDATES, *ONEDNN_OPS)
def _onednn(lw: Lowering, ins: Instr, o: int, dev: torch.device) -> list[int] | None:
    """``[rows, K, N]`` when oneDNN's packed linear can run this instruction (weights that are program weights,
    a contiguous fp32 input of two rows or more, or bf16, on this CPU); whether it does is measured."""
    ops = onednn_operands(ins) if dev.type == "cpu" and onednn.available() else None
    if ops is None:
        return None
    x, w, b, wt, act, gate = ops
    if act not in onednn.ACT_ATTR or not isinstance(x, Reg) or not lw.is_weight(w):
        return None
    vx, vo = lw.p.values[x.id], lw.p.values[o]
    wten = lw.weight(w.id, dev)
    if wten.dim() != 2 or not vx.is_contiguous or lw.dm[vx.device] != dev or vx.dtype != vo.dtype \
            or not onednn.dtype_ok(vx.dtype) or wten.dtype != vx.dtype or not vx.shape:
        return None
    k = vx.shape[-1]
    n = wten.shape[1] if wt else wten.shape[0]
    rows = math.prod(vx.shape) // k if k else 0
    if (wten.shape[0] if wt else wten.shape[1]) != k or not _dnn_bias(lw, b, dev):
        return None
    if rows < 1 or (rows < 2 and vx.dtype == torch.float32):
        return None
    if gate is not None:
        wg, bg, wd, bd = gate
        if not (lw.is_weight(wg) and tuple(lw.weight(wg.id, dev).shape) == tuple(wten.shape)
                and _dnn_bias(lw, bg, dev) and _dnn_bias(lw, bd, dev)):
            return None
        if wd is not None:
            wdt = lw.weight(wd.id, dev) if lw.is_weight(wd) else None
            if wdt is None or wdt.dim() != 2 or wdt.shape[1] != n:
                return None
    return [rows, k, n]


def _dnn_bias(lw: Lowering, a: Any, dev: torch.device) -> bool:
    if a is None:
        return True
    if not lw.is_weight(a):
        return False
    t = lw.weight(a.id, dev)
    return t.dim() == 1 and t.is_contiguous()


def _general(lw: Lowering, ins: Instr, o: int | None) -> str:
    """The kernel of an instruction no op-specific chooser took."""
    p = lw.p
    if o is None:  # several outputs: the functional op, then a copy of each planned one
        if not any(x in lw.planned for x in ins.outputs):
            return "fresh"
        return "unplanned" if lw.mode == "fast" and not returns_alias(ins.target) else "functional-copy"
    if o not in lw.planned:
        return "fresh"
    if is_copy_like(ins.op, ins.args, ins.kwargs) and isinstance(ins.args[0], Reg) \
            and tuple(p.values[ins.args[0].id].shape) == p.values[o].shape:
        return "copy-into"
    if out_variant(ins.target) is not None:
        return "out-variant"
    return "unplanned" if lw.mode == "fast" and not returns_alias(ins.target) else "functional-copy"


def _views_as_planned(p: Program, ins: Instr) -> bool:
    """Whether ``ins``, run on tensors of its inputs' layouts (on the meta device), returns views of them with
    the planned layouts of its outputs (:meth:`Value.laid_out_as`) — what the executor checks before binding a
    view at build time (a copy would be a stale snapshot; another layout is not what later instructions were
    lowered for)."""
    if not isinstance(ins.target, torch._ops.OpOverload):
        return False

    def meta(r: Reg) -> torch.Tensor:
        v = p.values[r.id]
        return torch.empty(max(v.nbytes // v.itemsize, 1), dtype=v.dtype, device="meta").as_strided(
            v.shape, v.stride, v.storage_offset)

    args, kwargs = map_regs(ins.args, meta), map_regs(ins.kwargs, meta)
    try:
        got = ins.target(*args, **kwargs)
    except Exception:  # an op the meta device does not run: leave it a per-call view
        return False
    outs = list(got) if isinstance(got, (list, tuple)) else [got]
    sources = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    if len(outs) != len(ins.outputs):
        return False
    for o, t in zip(ins.outputs, outs, strict=True):
        v = p.values[o]
        if not isinstance(t, torch.Tensor) or not v.laid_out_as(t) or t.untyped_storage()._cdata not in sources:
            return False
    return True


def kernel_context(device_map: dict[str, torch.device], mode: str, planned) -> dict[str, Any]:
    """What the choice depends on besides the program: torch devices, executor mode, native library, threads, the
    GEMM policy, and which values the memory plan gave a slice (a CRC-32 of their ids)."""
    return {"mode": mode, "devices": {d: str(t) for d, t in sorted(device_map.items())},
            "native": native.library() is not None, "onednn": onednn.available(),
            "threads": onednn.threads(), "gemm": onednn.policy(), "w8_act": native.w8_act_mode(),
            "w4_act": native.w4_act_mode(),
            "planned": zlib.crc32(repr(sorted(planned)).encode())}


def lower_kernels(p: Program, planned, device_map: dict[str, torch.device] | None = None,
                  mode: str = "arena", soc=None) -> Program:
    """Record on every instruction of ``p`` (in place) the kernel that runs it (``attrs["kernel"]``) and, for
    oneDNN candidates, ``attrs["onednn"] = [rows, K, N]``; ``planned``: the value ids with an arena slice
    (``MemoryPlan.offsets``). Returns ``p``."""
    if mode not in MODES:
        raise UsageError(f"unknown executor mode '{mode}'; allowed: {', '.join(MODES)}")
    dm = dict(device_map or default_device_map(p, soc))
    lw = Lowering(p, planned, dm, mode)
    static: set[int] = set()  # registers whose tensor is known when the executable is built
    for ins in p.instrs:
        dev = dm[ins.device]
        o = ins.outputs[0] if len(ins.outputs) == 1 else None
        ins.attrs.pop(ONEDNN_ATTR, None)
        cand = None
        if ins.kind == TRANSFER:
            k = "zero-copy" if ins.attrs.get("zero_copy") else "transfer-copy" if o in planned else "transfer"
        elif ins.kind == INPLACE:
            k = "inplace"
        elif ins.kind == VIEW:
            if identity_view(ins, p, lambda a, b: dm[a] == dm[b]):
                k = "elided"
            elif mode == "arena" and all(r in static or p.values[r].kind == WEIGHT for r in ins.input_regs()) \
                    and _views_as_planned(p, ins):
                k = "static-view"
            else:
                k = "view"
        else:
            assert ins.kind == KERNEL, ins.kind
            chooser = OP_KERNELS.get(ins.op) if o is not None else None
            k = (chooser(lw, ins, o, dev) if chooser is not None else None) or _general(lw, ins, o)
            # a native kernel (one row) is not measured against oneDNN: the one-row rule of the fp32 GEMV
            cand_fn = ONEDNN_CANDIDATES.get(ins.op) if o is not None and not k.startswith("native:") else None
            cand = cand_fn(lw, ins, o, dev) if cand_fn is not None else None
        ins.attrs[KERNEL_ATTR] = k
        if cand is not None:
            ins.attrs[ONEDNN_ATTR] = cand
        if k == "static-view":
            static.update(ins.outputs)
        elif k in WRITES_SLICE or k.startswith(("native:", "split-gemv:")):
            static.update(x for x in ins.outputs if x in planned)
    p.attrs[CONTEXT_ATTR] = kernel_context(dm, mode, planned)
    return p


def with_kernels(p: Program, planned, device_map: dict[str, torch.device], mode: str) -> Program:
    """``p`` when its recorded kernels were chosen under this context, else a copy lowered for it."""
    if p.attrs.get(CONTEXT_ATTR) == kernel_context(device_map, mode, planned) \
            and all(KERNEL_ATTR in i.attrs for i in p.instrs):
        return p
    q = Program(p.name, p.soc, list(p.devices), p.values, [replace(i, attrs=dict(i.attrs)) for i in p.instrs],
                list(p.inputs), list(p.outputs), p.weights, dict(p.attrs), p.tensors, p.soc_spec, p.memory)
    return lower_kernels(q, planned, device_map, mode)


def _onednn_choice(ins: Instr, p: Program) -> bool | None:
    """The choice measured in this process for a oneDNN candidate (None when not measured)."""
    rows, k, n = ins.attrs[ONEDNN_ATTR]
    ops = onednn_operands(ins)
    return onednn.decided(rows, k, n, p.values[ins.outputs[0]].dtype, ops[4] if ops is not None else "none")


def onednn_decided(ins: Instr, p: Program) -> bool:
    """Whether oneDNN runs a candidate, by the choice measured in this process (False when not measured)."""
    return bool(_onednn_choice(ins, p))


# Ops whose kernel the cost model prices by kind: multi-row products that ATen runs when oneDNN does not
# (``aten:matmul`` keys), and views whose copy reads the source with strides (``aten.copy_.default:strided``).
def reshape_view(ins: Instr) -> bool:
    """Whether ``ins`` is a view that only reshapes (view, reshape, _unsafe_view)."""
    return ins.kind == VIEW and ins.op in RESHAPE_VIEWS


def heads_transpose(ins: Instr) -> bool:
    """Whether ``ins`` is the view ``transpose(x, 1, 2)`` of a 4-D value (how Hugging Face starts merging heads)."""
    return ins.kind == VIEW and ins.op == "aten.transpose.int" and len(ins.args) == 3 \
        and sorted(int(d) % 4 for d in ins.args[1:3]) == [1, 2]


def plain_add(ins: Instr) -> tuple[Reg, Reg] | None:
    """The two register operands of ``add(a, b)`` with alpha 1, else None (the residual add a product may take)."""
    if ins.op != "aten.add.Tensor" or len(ins.args) != 2 or ins.kwargs or len(ins.outputs) != 1:
        return None
    a, b = ins.args
    return (a, b) if isinstance(a, Reg) and isinstance(b, Reg) and a.id != b.id else None


ATEN_PRODUCTS = ("aten.linear.default", "aten.addmm.default", "aten.mm.default")
PERMUTING_VIEWS = ("aten.transpose.int", "aten.permute.default", "aten.t.default", "aten.swapaxes.default")


def onednn_known(ins: Instr, p: Program) -> bool:
    """Whether the kernel that runs ``ins`` is known: always, except for a oneDNN candidate whose choice has not
    been measured (nor seeded) in this process."""
    return ONEDNN_ATTR not in ins.attrs or _onednn_choice(ins, p) is not None


def resolved_kernels(p: Program, decide: Callable[[Instr], bool] | None = None) -> dict[int, str]:
    """Instruction id → the kernel that runs it: the recorded one, except ``onednn`` for a candidate that
    ``decide`` takes (default: the choice measured in this process, :func:`onednn_decided`) and ``view`` for a
    static view over a oneDNN result (a fresh tensor each call, so not known at build time)."""
    decide = decide or (lambda ins: onednn_decided(ins, p))
    out: dict[int, str] = {}
    fresh: set[int] = set()
    for ins in p.instrs:
        k = ins.attrs[KERNEL_ATTR]
        if ONEDNN_ATTR in ins.attrs and decide(ins):
            k = "onednn"
            fresh.update(ins.outputs)
        elif k == "static-view" and any(r in fresh for r in ins.input_regs()):
            k = "view"
            fresh.update(ins.outputs)
        out[ins.id] = k
    return out


def program_kernels(p: Program, planned) -> dict[int, str]:
    """:func:`resolved_kernels` of ``p``, lowering a copy first (host defaults, mode ``arena``) when ``p``
    carries no record (a program made without :func:`lower_kernels`)."""
    if not all(KERNEL_ATTR in i.attrs for i in p.instrs):
        dm = default_device_map(p)
        p = with_kernels(p, planned, dm, "arena")
    return resolved_kernels(p)
