"""The executor: run a scheduled, memory-planned program from real arenas.

One preallocated ``uint8`` arena per device (on that device's torch device), and for every planned
buffer a tensor view into its slice, made once. The program is turned into straight-line Python
(one line per instruction, registers as local variables, as ``torch.fx`` codegen does), compiled once
with ``compile()``; calling the executable is calling that function — no per-instruction dispatch loop.

Devices map to torch devices: ``cpu`` → ``cpu``; a ``gpu`` → ``cuda`` when PyTorch sees one, else the
CPU (emulated); an ``npu`` → the CPU (emulated: the partition runs on the CPU, its figures come from
the cost model). Weights are moved once to every torch device that reads them; ``device=`` arguments
baked into the graph are rewritten to the instruction's torch device.

The arenas are reused on every call: the executable is not re-entrant, and graph outputs are never in
an arena (they are fresh tensors each call), so a caller may keep them.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from hetforge.errors import UsageError
from hetforge.executor import onednn
from hetforge.ir.kernel_choice import (  # noqa: F401
    IDENTITY_VIEW_OPS,
    bind_args,
    identity_view,
    is_copy_like,
    out_variant,
)
from hetforge.ir.program import INPLACE, KERNEL, OUTPUT, TRANSFER, VIEW, WEIGHT, Program, Reg
from hetforge.kernels import native
from hetforge.memplan import MemoryPlan
from hetforge.ops import gemv, lookup

MODES = ("arena", "fast")
def default_device_map(p: Program, soc=None) -> dict[str, torch.device]:
    """SoC device name → the torch device that runs it on this host."""
    kinds = {d.name: d.kind for d in soc.devices} if soc is not None else {}
    out = {}
    for d in p.devices:
        kind = kinds.get(d, d)
        out[d] = torch.device("cuda") if kind == "gpu" and torch.cuda.is_available() else torch.device("cpu")
    return out


def returns_alias(target: Any) -> bool:
    """Whether an op's result may share its input's storage (``transpose``, ``view``...: an alias annotation
    in its schema). Mode ``fast`` keeps a kernel's result in its own allocation only when it cannot: a view of
    an arena slice would outlive the slice's planned lifetime, so such a result is copied into its own slice."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


@dataclass
class InstrTime:
    instr: int
    op: str
    device: str
    kind: str
    seconds: float  # measured with the profile's clock, mean over repeats (repeat=1 for per-run values)


@dataclass
class ProfileReport:
    """Per-instruction wall time (measured) and the total of one profiled run."""

    times: list[InstrTime]
    total_seconds: float
    repeats: int

    def by_op(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in self.times:
            out[t.op] = out.get(t.op, 0.0) + t.seconds
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


@dataclass
class ExecStats:
    """How instructions write their results (counts)."""

    out_variant: int = 0
    gemm_out: int = 0
    split_gemv: int = 0  # one-row products run as a threaded bmm over output chunks (ops/gemv.py)
    native_gemv: int = 0  # one-row fp32 products on the native C kernel (kernels/native.py)
    native_ops: int = 0  # hetforge row ops (norms, rotary, decode attention) as one native call into the slice
    onednn_gemm: int = 0  # multi-row linears on oneDNN's packed kernel (executor/onednn.py; result not in the arena)
    copy_into: int = 0  # copy-like op done as slice.copy_(input)
    functional_copy: int = 0  # functional op + copy into the slice
    unplanned: int = 0  # functional result kept outside the arena (mode fast)
    fresh_outputs: int = 0  # graph outputs (fresh each call)
    views: int = 0
    elided_views: int = 0  # views that return their input unchanged: bound, not called
    static_views: int = 0  # views of arena slices / weights: made once at build time, not per call
    inplace: int = 0
    transfers: int = 0
    by_op_fallback: dict[str, int] = field(default_factory=dict)


NATIVE_ROW_OPS = ("hetforge.rms_norm.default", "hetforge.layer_norm.default", "hetforge.rotary.default",
                  "hetforge.kv_attention.default", "hetforge.linear_act.default", "hetforge.gated_mlp.default",
                  "hetforge.linear_w8.default")


class _Codegen:
    def __init__(self, p: Program, plan: MemoryPlan, device_map: dict[str, torch.device], mode: str,
                 arenas: dict[str, torch.Tensor]):
        self.p, self.plan, self.dm, self.mode = p, plan, device_map, mode
        self.g: dict[str, Any] = {"torch": torch}
        self.lines: list[str] = []
        self.stats = ExecStats()
        self.arenas = arenas
        self.weights_on: dict[tuple[int, str], str] = {}
        self.const_ids: dict[int, str] = {}
        self.moved: dict[tuple[int, torch.device], torch.Tensor] = {}
        self.static: dict[int, torch.Tensor] = {}  # views bound at build time (static_view)
        # planned values whose register is their arena slice once written (every arena-mode write does that;
        # mode fast keeps some results in fresh tensors, a zero-copy transfer binds the source)
        self.bound: set[int] = set()
        self.sites = 0  # run-time pointer reads (native.contiguous_ptr call sites)
        # instructions run other than write_mode's rules say (hetforge.cost.instr): "static" views made at
        # build time (free at run time), "native" ops (one native kernel writing the slice)
        self.modes: dict[int, str] = {}

    def const(self, obj: Any, hint: str = "c") -> str:
        key = id(obj)
        if key not in self.const_ids:
            name = f"_{hint}{len(self.g)}"
            self.g[name] = obj
            self.const_ids[key] = name
        return self.const_ids[key]

    def weight(self, vid: int, dev: torch.device) -> str:
        key = (vid, str(dev))
        if key not in self.weights_on:
            t = self.p.tensors[vid]
            mk = (id(t), dev)
            if mk not in self.moved:
                self.moved[mk] = t if t.device == dev else t.to(dev)
            name = f"_w{vid}_{dev.type}{dev.index or 0}"
            self.g[name] = self.moved[mk]
            self.weights_on[key] = name
        return self.weights_on[key]

    def buffer(self, vid: int) -> str:
        name = f"_b{vid}"
        if name not in self.g:
            v = self.p.values[vid]
            arena = self.arenas[v.device]
            off = self.plan.offsets[vid]
            base = arena[off: off + v.nbytes].view(v.dtype)
            self.g[name] = base.as_strided(v.shape, v.stride, base.storage_offset() + v.storage_offset)
        return name

    def expr(self, a: Any, dev: torch.device) -> str:
        if isinstance(a, Reg):
            v = self.p.values[a.id]
            return self.weight(a.id, dev) if v.kind == WEIGHT else f"r{a.id}"
        if isinstance(a, torch.device):
            return self.const(dev, "dev")
        if isinstance(a, (bool, int, str, type(None))):
            return repr(a)
        if isinstance(a, float):
            return repr(a) if math.isfinite(a) else self.const(a)
        if isinstance(a, list):
            return "[" + ", ".join(self.expr(x, dev) for x in a) + "]"
        if isinstance(a, tuple):
            return "(" + "".join(self.expr(x, dev) + ", " for x in a) + ")"
        return self.const(a)

    def call(self, ins, fn_name: str, dev: torch.device, extra: str = "") -> str:
        parts = [self.expr(a, dev) for a in ins.args]
        parts += [f"{k}={self.expr(v, dev)}" for k, v in ins.kwargs.items()]
        if extra:
            parts.append(extra)
        return f"{fn_name}({', '.join(parts)})"

    def planned(self, vid: int) -> bool:
        return vid in self.plan.offsets

    def emit(self, ins) -> list[str]:
        dev = self.dm[ins.device]
        outs = [f"r{o}" for o in ins.outputs]
        if ins.kind == TRANSFER:
            self.stats.transfers += 1
            src = self.expr(ins.args[0], dev)
            o = ins.outputs[0]
            if ins.attrs.get("zero_copy"):
                src_dev = self.dm[self.p.values[ins.args[0].id].device]
                return [f"{outs[0]} = {src}" if src_dev == dev else f"{outs[0]} = {src}.to({self.const(dev, 'dev')})"]
            if self.planned(o):
                self.bound.add(o)
                return [f"{outs[0]} = {self.buffer(o)}.copy_({src})"]
            return [f"{outs[0]} = {src}.to({self.const(dev, 'dev')}, copy=True)"]
        fn = self.const(self.kernel(ins, dev), "f")
        if ins.kind in (VIEW, INPLACE):
            if ins.kind == VIEW:
                self.stats.views += 1
                src = self.identity_view(ins)
                if src is not None:
                    self.stats.elided_views += 1
                    return [f"{outs[0]} = {src}"]
                bound = self.static_view(ins)
                if bound is not None:
                    self.stats.static_views += 1
                    self.modes[ins.id] = "static"
                    return [f"{', '.join(outs)}{',' if len(outs) == 1 and len(bound) > 1 else ''} = "
                            f"{', '.join(bound)}"]
            else:
                self.stats.inplace += 1
            lhs = outs[0] if len(outs) == 1 else ", ".join(outs)
            return [f"{lhs} = {self.call(ins, fn, dev)}"]
        assert ins.kind == KERNEL, ins.kind
        if len(ins.outputs) == 1:
            o = ins.outputs[0]
            v = self.p.values[o]
            line = onednn.codegen_line(self, ins, o, dev)
            if line is not None:
                return [line]
            line = self.gemm(ins, o, dev)
            gemm = line is not None
            if line is None:
                line = self.native_op(ins, o, dev)
            if not self.planned(o):
                if v.kind == OUTPUT:
                    self.stats.fresh_outputs += 1
                return [line or f"{outs[0]} = {self.call(ins, fn, dev)}"]
            buf = self.buffer(o)
            if line is not None:
                self.stats.gemm_out += gemm
                self.bound.add(o)
                return [line]
            if is_copy_like(ins.op, ins.args, ins.kwargs) and isinstance(ins.args[0], Reg) \
                    and tuple(self.p.values[ins.args[0].id].shape) == v.shape:
                self.stats.copy_into += 1
                self.bound.add(o)
                return [f"{outs[0]} = {buf}.copy_({self.expr(ins.args[0], dev)})"]
            ov = out_variant(ins.target)
            if ov is not None:
                self.stats.out_variant += 1
                self.bound.add(o)
                return [f"{outs[0]} = {self.call(ins, self.const(ov, 'fo'), dev, 'out=' + buf)}"]
            self.stats.by_op_fallback[ins.op] = self.stats.by_op_fallback.get(ins.op, 0) + 1
            if self.mode == "fast" and not returns_alias(ins.target):
                self.stats.unplanned += 1
                return [f"{outs[0]} = {self.call(ins, fn, dev)}"]
            self.stats.functional_copy += 1
            self.bound.add(o)
            return [f"{outs[0]} = {buf}.copy_({self.call(ins, fn, dev)})"]
        lines = [f"{', '.join(outs)}, = {self.call(ins, fn, dev)}"]
        self.stats.by_op_fallback[ins.op] = self.stats.by_op_fallback.get(ins.op, 0) + 1
        for o in ins.outputs:
            if self.planned(o):
                if self.mode == "fast" and not returns_alias(ins.target):
                    self.stats.unplanned += 1
                else:
                    self.stats.functional_copy += 1
                    self.bound.add(o)
                    lines.append(f"r{o} = {self.buffer(o)}.copy_(r{o})")
        return lines

    @staticmethod
    def kernel(ins, dev: torch.device) -> Any:
        """What to call for a kernel: a ``hetforge::`` op on the CPU calls its Python implementation directly
        (the op's registered CPU kernel, minus ~10 µs of dispatcher overhead per call); all else its target."""
        t = ins.target
        if dev.type == "cpu" and isinstance(t, torch._ops.OpOverload) and t.namespace == "hetforge":
            info = lookup(t)
            if info is not None and info.reference is not None:
                return info.reference
        return t

    def static_tensor(self, vid: int, dev: torch.device) -> torch.Tensor | None:
        """The tensor ``r<vid>`` always is at run time, when that is known at build time: an arena slice whose
        emitted write binds the register to it (``self.bound``), a weight, or a view made of those."""
        if vid in self.static:
            return self.static[vid]
        if vid in self.bound:
            return self.g[self.buffer(vid)]
        if self.p.values[vid].kind == WEIGHT:
            return self.g[self.weight(vid, dev)]
        return None

    def static_view(self, ins) -> list[str] | None:
        """Bind a view of static tensors once, at build time: the names of its outputs, or None.

        A view of an arena slice or a weight is the same tensor on every call (the slices never move), so
        the call — ~5 µs of dispatch for a few bytes of metadata — is made here once instead of per call."""
        if self.mode == "fast":
            return None
        dev = self.dm[ins.device]
        missing = []

        def sub(a: Any) -> Any:
            if isinstance(a, Reg):
                t = self.static_tensor(a.id, dev)
                if t is None:
                    missing.append(a)
                return t
            if isinstance(a, (list, tuple)):
                return type(a)(sub(x) for x in a)
            return a

        args, kwargs = sub(ins.args), {k: sub(v) for k, v in ins.kwargs.items()}
        if missing or not isinstance(ins.target, torch._ops.OpOverload):
            return None
        got = ins.target(*args, **kwargs)
        outs = list(got) if isinstance(got, (list, tuple)) else [got]
        if len(outs) != len(ins.outputs):
            return None
        sources = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for o, t in zip(ins.outputs, outs, strict=True):
            v = self.p.values[o]
            if not isinstance(t, torch.Tensor) or (tuple(t.shape), tuple(t.stride()), t.dtype) != \
                    (tuple(v.shape), tuple(v.stride), v.dtype) or t.untyped_storage().data_ptr() not in sources:
                return None  # not the layout lowering expects, or not a view (a copy would be a stale snapshot)
        for o, t in zip(ins.outputs, outs, strict=True):
            self.static[o] = t
        return [self.const(t, "sv") for t in outs]

    def identity_view(self, ins) -> str | None:
        """The input register when this view returns its input unchanged (same shape, strides, offset,
        dtype, for an op that then returns ``self`` or an equal view), else None."""
        if not identity_view(ins, self.p, lambda a, b: self.dm[a] == self.dm[b]):
            return None
        return f"r{ins.args[0].id}"

    def gemm(self, ins, o: int, dev: torch.device) -> str | None:
        """A linear-type product as a GEMM into the 2-D view of the slice (x contiguous, w a weight).

        ``aten.linear(x, w, b)`` always becomes ``addmm.out``/``mm.out`` (weight transposed once at load);
        ``aten.addmm(b, x, w)`` and ``aten.mm(x, w)`` with a ``[K, N]`` weight are handled here only for
        the one-row case. One-row fp32 products on the CPU run on the native GEMV (:meth:`native_gemv`);
        without it, on a multi-threaded CPU, on the split GEMV of :mod:`hetforge.ops.gemv` (a chunked view
        of the weight, one parallel ``bmm``; no copy)."""
        if ins.kwargs:
            return None
        if ins.op == "aten.linear.default":
            x, w, b, weight_t = ins.args[0], ins.args[1], (ins.args[2] if len(ins.args) > 2 else None), False
        elif ins.op == "aten.addmm.default" and len(ins.args) == 3:
            b, x, w, weight_t = ins.args[0], ins.args[1], ins.args[2], True
        elif ins.op == "aten.mm.default":
            x, w, b, weight_t = ins.args[0], ins.args[1], None, True
        else:
            return None
        if not (isinstance(x, Reg) and isinstance(w, Reg) and self.p.values[w.id].kind == WEIGHT):
            return None
        vx, vo = self.p.values[x.id], self.p.values[o]
        if not (vx.is_contiguous and vo.is_contiguous and len(vx.shape) >= 2 and (b is None or isinstance(b, Reg))):
            return None
        k, n = vx.shape[-1], vo.shape[-1]
        wname = self.weight(w.id, dev)
        wt = self.g[wname]
        if dev.type == "cpu" and math.prod(vx.shape) == k and wt.is_contiguous():  # one row
            line = self.native_gemv(x, wt, b, weight_t, o, dev)
            if line is not None:
                return line
            c = gemv.chunks_for(wt.shape[0])  # N of an [N, K] weight (split over outputs), K of a [K, N] one
            if c is not None:
                return self.split_gemv(x, wt, b, c, weight_t, o, dev)
        if weight_t or not self.planned(o):  # the out= variant / functional op is the same GEMM
            return None
        buf = self.buffer(o)
        wt = self.const(wt.t(), "wt")
        out2d = self.const(self.g[buf].view(-1, n), "o2d")
        x2d = self.view_of(x.id, (-1, k))
        if b is None:
            return f"{self.const(torch.ops.aten.mm.out, 'fo')}({x2d}, {wt}, out={out2d}); r{o} = {buf}"
        return (f"{self.const(torch.ops.aten.addmm.out, 'fo')}({self.expr(b, dev)}, {x2d}, {wt}, out={out2d}); "
                f"r{o} = {buf}")

    def view_of(self, vid: int, shape: tuple[int, ...], expand: tuple[int, ...] | None = None) -> str:
        """``r<vid>`` viewed as ``shape`` (then expanded): made once when it lives in the arena."""
        if vid in self.bound:
            t = self.g[self.buffer(vid)].view(shape)
            return self.const(t.expand(expand) if expand else t, "xv")
        return f"r{vid}.view({shape})" + (f".expand({expand})" if expand else "")

    def native_gemv(self, x: Reg, w: torch.Tensor, b: Any, weight_t: bool, o: int, dev: torch.device) -> str | None:
        """One-row fp32 product on the native kernel (:mod:`hetforge.kernels.native`), or None when it does
        not apply (not built, other dtype, a bias that is not a contiguous ``[N]`` weight).

        Arena slices never move, so the pointers of planned operands are baked into the line once."""
        vx, vo = self.p.values[x.id], self.p.values[o]
        k, n = (w.shape if weight_t else (w.shape[1], w.shape[0]))
        if dev.type != "cpu" or vo.dtype != vx.dtype or not native.fits(w, None, weight_t, vx.dtype) \
                or self.dm[vx.device] != dev or vx.shape[-1] != k or math.prod(vo.shape) != n:
            return None
        bp = "None"
        if b is not None:
            vb = self.p.values[b.id]
            if vb.kind == WEIGHT:
                bt = self.g[self.weight(b.id, dev)]
                if not native.fits(w, bt, weight_t, vx.dtype):
                    return None
                bp = str(bt.data_ptr())
            elif vb.dtype == vx.dtype and vb.is_contiguous and math.prod(vb.shape) == n and self.dm[vb.device] == dev:
                bp = self.ptr(b.id, dev)
            else:
                return None
        self.stats.native_gemv += 1
        lib = native.library()
        xp = self.ptr(x.id, dev)
        if self.planned(o):
            buf = self.buffer(o)
            yp, pre, post = str(self.g[buf].data_ptr()), "", f"; r{o} = {buf}"
        else:
            fresh = self.const(torch.empty, "f")
            f32 = self.const(torch.float32, "dt")
            pre, yp, post = f"r{o} = {fresh}({tuple(vo.shape)}, dtype={f32}); ", f"r{o}.data_ptr()", ""
        nt = self.const(torch.get_num_threads, "f")
        wp = w.data_ptr()
        if weight_t:
            scratch = self.gemv_scratch(n)
            call = (f"{self.const(lib.hf_gemv_kn, 'nk')}({wp}, {xp}, {bp}, {yp}, {n}, {k}, {nt}(), "
                    f"{scratch.data_ptr()}, {scratch.shape[0]})")
        else:
            call = f"{self.const(lib.hf_gemv_nk, 'nk')}({wp}, {xp}, {bp}, {yp}, {n}, {k}, {nt}())"
        return pre + call + post

    def gemv_scratch(self, n: int) -> torch.Tensor:
        """The split-K partial rows of a native ``[K, N]`` GEMV (one row per possible thread; shared by the
        program's products of width ``n``, which run one at a time)."""
        return self.g.setdefault(f"_gemv_part{n}", torch.empty((max(os.cpu_count() or 1, 2), n), dtype=torch.float32))

    def ptr(self, vid: int, dev: torch.device) -> str:
        """The data pointer of ``r<vid>`` for a native kernel: a literal when the tensor is known at build
        time (arena slices never move; weights; views of those), else read per call through
        :func:`hetforge.kernels.native.contiguous_ptr` (a strided tensor is read through a contiguous copy
        kept in this program's ``_keep``; a non-fp32 or non-CPU one is refused)."""
        t = self.static_tensor(vid, dev)
        if t is not None:
            return str(t.data_ptr())
        self.sites += 1
        self.g.setdefault("_keep", {})
        return f"{self.const(native.contiguous_ptr, 'f')}(r{vid}, _keep, {self.sites})"

    def native_operand(self, a: Any, dev: torch.device, numel: int | None = None) -> bool:
        """Whether ``a`` is a register a native kernel can read: fp32, contiguous, on this CPU (and ``numel``)."""
        if not isinstance(a, Reg):
            return False
        v = self.p.values[a.id]
        return (v.dtype == torch.float32 and v.is_contiguous and self.dm[v.device] == dev
                and (numel is None or math.prod(v.shape) == numel))

    def native_op(self, ins, o: int, dev: torch.device) -> str | None:
        """A ``hetforge::`` row op (rms_norm, layer_norm, rotary, one-row kv_attention) as one call of its
        native kernel, pointers baked in, writing straight into the result's arena slice; None when the op,
        its operands or the host do not allow it (then the op's Python implementation runs)."""
        if dev.type != "cpu" or ins.op not in NATIVE_ROW_OPS or native.library() is None:
            return None
        args = bind_args(ins)
        vo = self.p.values[o]
        if args is None or vo.dtype != torch.float32 or not vo.is_contiguous or not vo.shape:
            return None
        d = vo.shape[-1]
        rows = math.prod(vo.shape) // d
        lib, p = native.library(), (lambda a: "None" if a is None else self.ptr(a.id, dev))
        nt = f"{self.const(torch.get_num_threads, 'f')}()"
        opt = lambda a, n: a is None or self.native_operand(a, dev, n)  # noqa: E731
        x = args.get("x")
        if ins.op in ("hetforge.rms_norm.default", "hetforge.layer_norm.default", "hetforge.rotary.default"):
            if not self.native_operand(x, dev, rows * d) or self.p.values[x.id].shape != vo.shape:
                return None
        if ins.op == "hetforge.rms_norm.default":
            if not opt(args["weight"], d):
                return None
            call = f"hf_rms_norm({p(x)}, {p(args['weight'])}, {{y}}, {rows}, {d}, {float(args['eps'])!r}, {nt})"
        elif ins.op == "hetforge.layer_norm.default":
            if list(args["normalized_shape"]) != [d] or not (opt(args["weight"], d) and opt(args["bias"], d)):
                return None
            call = (f"hf_layer_norm({p(x)}, {p(args['weight'])}, {p(args['bias'])}, {{y}}, {rows}, {d}, "
                    f"{float(args['eps'])!r}, {nt})")
        elif ins.op == "hetforge.rotary.default":
            cos, sin = args["cos"], args["sin"]
            if d % 2 or not (self.native_operand(cos, dev, d) and self.native_operand(sin, dev, d)):
                return None
            call = f"hf_rotary({p(x)}, {p(cos)}, {p(sin)}, {{y}}, {rows}, {d}, {nt})"
        elif ins.op == "hetforge.linear_w8.default":  # int8 weight-only, one row
            qw, sc = args["qweight"], args["scales"]
            if not (isinstance(qw, Reg) and isinstance(sc, Reg)) or args["act"] not in native.ACT_CODES:
                return None
            vq = self.p.values[qw.id]
            kk = math.prod(self.p.values[x.id].shape) if isinstance(x, Reg) else 0
            if not (rows == 1 and self.native_operand(x, dev, kk) and vq.kind == WEIGHT and vq.dtype == torch.int8
                    and vq.is_contiguous and tuple(vq.shape) == (d, kk) and self.dm[vq.device] == dev
                    and self.native_operand(sc, dev, d) and opt(args["bias"], d)):
                return None
            call = (f"hf_gemv_q8({p(qw)}, {p(sc)}, {p(x)}, {p(args['bias'])}, {{y}}, {d}, {kk}, "
                    f"{native.ACT_CODES[args['act']]}, {nt})")
        elif ins.op == "hetforge.linear_act.default":
            w, wt = args["weight"], bool(args["weight_t"])
            if not (self.native_operand(x, dev) and isinstance(w, Reg) and self.p.values[w.id].kind == WEIGHT):
                return None
            ws = self.p.values[w.id].shape
            kk = math.prod(self.p.values[x.id].shape)
            if rows != 1 or args["act"] in ("none", None) or args["act"] not in native.ACT_CODES or len(ws) != 2 \
                    or ws != ((kk, d) if wt else (d, kk)) \
                    or not (self.native_operand(w, dev) and opt(args["bias"], d)):
                return None
            part = self.gemv_scratch(d)
            call = (f"hf_linear_act({p(w)}, {p(x)}, {p(args['bias'])}, {{y}}, {d}, {kk}, {int(wt)}, "
                    f"{native.ACT_CODES[args['act']]}, {nt}, {part.data_ptr()}, {part.shape[0]})")
        elif ins.op == "hetforge.gated_mlp.default":
            wg, wu, wd = args["w_gate"], args["w_up"], args["w_down"]
            if not self.native_operand(x, dev) or any(args[b] is not None for b in ("b_gate", "b_up", "b_down")):
                return None
            dm = math.prod(self.p.values[x.id].shape)
            if not all(isinstance(a, Reg) and self.p.values[a.id].kind == WEIGHT and self.native_operand(a, dev)
                       for a in ([wg, wu] if wd is None else [wg, wu, wd])):
                return None
            f = self.p.values[wg.id].shape[0]
            want = [(f, dm), (f, dm)] + ([] if wd is None else [(dm, f)])
            if rows != 1 or args["act"] in ("none", None) or args["act"] not in native.ACT_CODES or \
                    d != (f if wd is None else dm) or \
                    [tuple(self.p.values[a.id].shape) for a in [wg, wu] + ([] if wd is None else [wd])] != want:
                return None
            h = "{y}" if wd is None else str(self.g[self.const(torch.empty(f, dtype=torch.float32), "scr")].data_ptr())
            call = (f"hf_gated_mlp({p(x)}, {p(wg)}, {p(wu)}, {p(wd)}, {h}, {{y}}, {f}, {dm}, "
                    f"{native.ACT_CODES[args['act']]}, {nt})")
        else:  # kv_attention, one new row
            q, k, v, kc, vc = (args[n] for n in ("q", "k", "v", "k_cache", "v_cache"))
            if not all(isinstance(a, Reg) for a in (q, k, v, kc, vc)):
                return None
            sq, sk, sc = (self.p.values[a.id].shape for a in (q, k, kc))
            if len(sq) != 4 or sq[0] != 1 or sq[2] != 1 or len(sk) != 4 or sk[0] != 1 or sk[2] != 1 or len(sc) != 4:
                return None
            h, hd, hkv, s = sq[1], sq[3], sk[1], sc[2]
            if sk != self.p.values[v.id].shape or sk[3] != hd or h % hkv or tuple(sc) != (1, hkv, s, hd) \
                    or self.p.values[vc.id].shape != sc:
                return None
            if not (all(self.native_operand(a, dev) for a in (q, k, v, kc, vc))
                    and self.native_operand(args["cache_mask"], dev, s) and opt(args["new_mask"], 1)):
                return None
            scratch = self.const(torch.empty((h, s + 1), dtype=torch.float32), "scr")
            call = (f"hf_decode_attention({p(q)}, {p(k)}, {p(v)}, {p(kc)}, {p(vc)}, {p(args['cache_mask'])}, "
                    f"{p(args['new_mask'])}, {{y}}, {self.g[scratch].data_ptr()}, {h}, {hkv}, {s}, {hd}, "
                    f"{float(args['scale'])!r}, {nt})")
        fn, rest = call.split("(", 1)
        call = f"{self.const(getattr(lib, fn), 'nk')}({rest}"
        self.stats.native_ops += 1
        self.modes[ins.id] = "native"
        if self.planned(o):
            buf = self.buffer(o)
            return call.format(y=self.g[buf].data_ptr()) + f"; r{o} = {buf}"
        fresh = self.const(torch.empty, "f")
        return f"r{o} = {fresh}({tuple(vo.shape)}, dtype={self.const(torch.float32, 'dt')}); " + \
            call.format(y=f"r{o}.data_ptr()")

    def split_gemv(self, x: Reg, w: torch.Tensor, b: Any, c: int, weight_t: bool, o: int, dev: torch.device) -> str:
        """One-row product as one threaded ``bmm`` over ``c`` chunks (see :mod:`hetforge.ops.gemv`), into the
        planned slice, or into a fresh tensor when the result is a graph output."""
        self.stats.split_gemv += 1
        wc = self.const(gemv.split_weight(w, c, weight_t), "wc")
        vo = self.p.values[o]
        bias = f".add_({self.expr(b, dev)})" if b is not None else ""
        bmm = self.const(torch.ops.aten.bmm.out, "fo")
        if weight_t:  # split-K: c partial rows into a scratch buffer made once, then summed
            k, n = w.shape
            lhs = self.view_of(x.id, (c, 1, k // c))
            part = self.const(torch.empty((c, 1, n), dtype=w.dtype, device=dev), "part")
            line = f"{bmm}({lhs}, {wc}, out={part}); "
            ssum = self.const(torch.sum, "f")
            if not self.planned(o):
                return line + f"r{o} = {ssum}({part}, 0).view({tuple(vo.shape)}){bias}"
            buf = self.buffer(o)
            o1 = self.const(self.g[buf].view(1, n), "o1")
            return line + f"{ssum}({part}, 0, out={o1}){bias}; r{o} = {buf}"
        k = w.shape[1]
        m = vo.shape[-1] // c
        lhs = self.view_of(x.id, (1, 1, k), (c, 1, k))
        if not self.planned(o):
            return f"r{o} = {self.const(torch.bmm, 'f')}({lhs}, {wc}).view({tuple(vo.shape)}){bias}"
        buf = self.buffer(o)
        o3 = self.const(self.g[buf].view(c, 1, m), "o3")
        line = f"{bmm}({lhs}, {wc}, out={o3}); "
        if b is not None:
            line += f"{self.const(self.g[buf].view(1, -1), 'o1')}{bias}; "
        return line + f"r{o} = {buf}"

    def build(self, profile: bool) -> str:
        p = self.p
        last_use: dict[int, int] = {}
        for k, ins in enumerate(p.instrs):
            for r in ins.input_regs():
                last_use[r] = k
        keep = set(p.output_regs())
        params = ", ".join(f"r{v}" for v in p.inputs)
        body: list[str] = []
        sync = any(d.type == "cuda" for d in self.dm.values())
        if profile:
            body.append("_t = _pc()")
        for k, ins in enumerate(p.instrs):
            body.extend(self.emit(ins))
            if profile:
                if sync:
                    body.append("_sync()")
                body.append(f"_T[{k}] += _pc() - _t; _t = _pc()")
            dead = [f"r{r}" for r in ins.input_regs() if last_use.get(r) == k and r not in keep
                    and p.values[r].kind != WEIGHT]
            dead += [f"r{o}" for o in ins.outputs if o not in last_use and o not in keep]
            if dead:
                body.append(f"{' = '.join(dead)} = None")
        ret = []
        for o in p.outputs:
            ret.append(self.expr(o, self.dm[p.devices[0]]) if isinstance(o, Reg) else repr(o))
        body.append(f"return ({''.join(r + ', ' for r in ret)})")
        return f"def run({params}):\n" + "\n".join("    " + ln for ln in body) + "\n"


class Executable:
    """A compiled program bound to arenas and weights; call it like the captured graph module."""

    def __init__(self, program: Program, plan: MemoryPlan, device_map: dict[str, torch.device] | None = None,
                 mode: str = "arena", soc=None):
        if mode not in MODES:
            raise UsageError(f"unknown executor mode '{mode}'; allowed: {', '.join(MODES)}")
        self.program, self.plan, self.mode = program, plan, mode
        self.device_map = dict(device_map or default_device_map(program, soc))
        missing = [d for d in program.devices if d not in self.device_map]
        if missing:
            raise UsageError(f"device map lacks {', '.join(missing)}")
        self.arenas = {d: torch.empty(plan.devices[d].arena_bytes if d in plan.devices else 0, dtype=torch.uint8,
                                      device=self.device_map[d]) for d in program.devices}
        cg = _Codegen(program, plan, self.device_map, mode, self.arenas)
        self.source = cg.build(profile=False)
        self.stats = cg.stats
        self.write_modes = cg.modes  # for the cost model (hetforge.cost.estimate_program(modes=…))
        self._fn = self._compile(self.source, cg.g, "run")
        self._globals = cg.g
        self._profile_fn = None
        self._inputs = [program.values[v] for v in program.inputs]
        spec = program.attrs.get("out_spec")
        self._out_spec = torch.utils._pytree.treespec_loads(spec) if spec else None

    @staticmethod
    def _compile(src: str, g: dict[str, Any], name: str):
        code = compile(src, f"<hetforge-program:{name}>", "exec")
        ns: dict[str, Any] = {}
        exec(code, g, ns)
        return ns["run"]

    def planned_buffer(self, vid: int) -> torch.Tensor | None:
        """The arena slice the generated code binds to register ``vid`` at build time (None if it has none)."""
        return self._globals.get(f"_b{vid}")

    def check_inputs(self, inputs: tuple[torch.Tensor, ...]) -> None:
        if len(inputs) != len(self._inputs):
            raise UsageError(f"program takes {len(self._inputs)} inputs, got {len(inputs)}")
        for t, v in zip(inputs, self._inputs, strict=True):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != v.shape or t.dtype != v.dtype:
                got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise UsageError(f"input '{v.name}' must be {v.dtype}{list(v.shape)} (compiled static shape), "
                                 f"got {got}")

    def run_flat(self, *inputs: torch.Tensor) -> tuple[Any, ...]:
        """The hot path: no checks, flat outputs."""
        return self._fn(*inputs)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        self.check_inputs(inputs)
        with torch.no_grad():
            out = self._fn(*inputs)
        if self._out_spec is not None:
            return torch.utils._pytree.tree_unflatten(list(out), self._out_spec)
        return out[0] if len(out) == 1 else out

    def profile(self, *inputs: torch.Tensor, warmup: int = 1, repeat: int = 3,
                clock: Any = time.perf_counter) -> ProfileReport:
        """Run ``repeat`` times with a timer around every instruction (measured; synchronizes CUDA).

        ``clock`` times the instructions: wall time by default, or e.g. ``time.thread_time`` (the calling
        thread's CPU time, which leaves out time the thread spent preempted). The total is always wall time."""
        self.check_inputs(inputs)
        n = len(self.program.instrs)
        if self._profile_fn is None:
            cg = _Codegen(self.program, self.plan, self.device_map, self.mode, self.arenas)
            src = cg.build(profile=True)
            cg.g.update({"_pc": time.perf_counter, "_sync": torch.cuda.synchronize if torch.cuda.is_available()
                         else (lambda: None), "_T": [0.0] * n})
            self._profile_fn = self._compile(src, cg.g, "profile")
            self._profile_globals = cg.g
        self._profile_globals["_pc"] = clock
        times = self._profile_globals["_T"]
        with torch.no_grad():
            for _ in range(warmup):
                self._profile_fn(*inputs)
            for k in range(n):
                times[k] = 0.0
            t0 = time.perf_counter()
            for _ in range(repeat):
                self._profile_fn(*inputs)
            total = (time.perf_counter() - t0) / repeat
        return ProfileReport([InstrTime(ins.id, ins.op, ins.device, ins.kind, times[k] / repeat)
                              for k, ins in enumerate(self.program.instrs)], total, repeat)

    def arena_bytes(self) -> dict[str, int]:
        return {d: int(a.numel()) for d, a in self.arenas.items()}
