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
an arena (they are fresh tensors each call), so a caller may keep them — except in a program built with
``reuse_outputs`` (a decode step, whose caller takes them before the next call): there they have their own
ranges past the arena's end. Runs of native kernel calls whose arguments are known when the code is made run
as one call list (:mod:`hetforge.executor.calllist`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from hetforge.errors import UsageError
from hetforge.executor import onednn
from hetforge.executor.allocator import keep_freed_memory
from hetforge.executor.calllist import batch_native_calls
from hetforge.ir.kernel_choice import (  # noqa: F401  (default_device_map, returns_alias: re-exported)
    MODES,
    NATIVE_GEMV,
    ONEDNN_OPS,
    PREPACK,
    PREPACK_ALL,
    QUANT_LINEAR_OPS,
    bind_args,
    default_device_map,
    gemm_operands,
    heads_transpose,
    out_variant,
    reshape_view,
    resolved_kernels,
    returns_alias,
    with_kernels,
)
from hetforge.ir.liveness import copying_heads_transpose
from hetforge.ir.program import INPLACE, KERNEL, OUTPUT, TRANSFER, VIEW, WEIGHT, Program, Reg, iter_regs
from hetforge.kernels import native
from hetforge.memplan import MemoryPlan, with_output_slices
from hetforge.ops import gemv, lookup

_PRODUCT_OPS = frozenset(ONEDNN_OPS + QUANT_LINEAR_OPS)  # linear-type products (on_team counts their rows)


@dataclass
class InstrTime:
    instr: int
    op: str
    device: str
    kind: str
    seconds: float  # measured with the profile's clock, mean over repeats (repeat=1 for per-run values)
    # with Executable.profile's ``again``: the best of that many further runs of the instruction right after its own
    # (its inputs and weights then in cache: the call hot, as a kernel alone), measured; else None
    hot_seconds: float | None = None


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
    gemv_groups: int = 0  # groups of one-row products of one input run as one hf_gemv_nk_multi call (e.g. q, k, v)
    call_lists: int = 0  # runs of native calls made one hf_run_calls call each (executor.calllist)
    listed_calls: int = 0  # the native calls those lists run
    native_ewise: int = 0  # of the out_variant ones: adds / muls of two dense rows on hf_ewise (native_ewise)
    native_ops: int = 0  # hetforge row ops (norms, rotary, decode attention) as one native call into the slice
    onednn_gemm: int = 0  # multi-row linears on oneDNN's packed kernel (executor/onednn.py; result not in the arena)
    onednn_residual: int = 0  # residual adds the packed product before them took (oneDNN post-op, MKL, panel)
    native_residual: int = 0  # residual adds taken by the one-row native product before them (hf_gemv_res, ...)
    mkl_gemm: int = 0  # multi-row linears on MKL's packed sgemm (the other side of the oneDNN choice)
    panel_gemm: int = 0  # multi-row linears on the native panel GEMM (a short prompt's row counts)
    panel_groups: int = 0  # groups of panel-GEMM products of one input run as one gemm_panel_multi call (q, k, v)
    panel_gated: int = 0  # oneDNN gated MLPs whose gate and up run as one native gated call (onednn.gated_pick)
    amx_gemm: int = 0  # multi-row bf16 linears on the native AMX kernel (hf_gemm_amx_bf16)
    bf16_panel_gemm: int = 0  # multi-row bf16 linears on the native AVX512-BF16 kernel (hf_gemm_bf16_panel)
    composed_views: int = 0  # views of oneDNN results made in one as_strided step (or not at all) per call
    copy_into: int = 0  # copy-like op done as slice.copy_(input)
    functional_copy: int = 0  # functional op + copy into the slice
    heads_last_copies: int = 0  # copying heads transposes the attention before them wrote (bound, no copy)
    unplanned: int = 0  # functional result kept outside the arena (mode fast)
    fresh_outputs: int = 0  # graph outputs (fresh each call)
    views: int = 0
    elided_views: int = 0  # views that return their input unchanged: bound, not called
    static_views: int = 0  # views of arena slices / weights: made once at build time, not per call
    inplace: int = 0
    transfers: int = 0
    by_op_fallback: dict[str, int] = field(default_factory=dict)


COMPOSE_ENV = "HETFORGE_COMPOSE_VIEWS"  # "0": every view of a oneDNN result is its own call (composed_views)
EWISE_MAX = 16384  # most values an add / mul runs on hf_ewise (one thread; a decode step's rows are ~1-4 K)
CALL_LISTS_ENV = "HETFORGE_CALL_LISTS"  # "0": every native call from Python on its own (executor.calllist)


class _Codegen:
    def __init__(self, p: Program, plan: MemoryPlan, device_map: dict[str, torch.device], mode: str,
                 arenas: dict[str, torch.Tensor], pinned: dict[int, torch.Tensor] | None = None,
                 unpinned: Any = None):
        self.p, self.plan, self.dm, self.mode = p, plan, device_map, mode
        self.g: dict[str, Any] = {"torch": torch}
        self.lines: list[str] = []
        self.stats = ExecStats()
        self.arenas = arenas
        self.weights_on: dict[tuple[int, str], str] = {}
        self.const_ids: dict[int, str] = {}
        self.moved: dict[tuple[int, torch.device], torch.Tensor] = {}
        # views bound at build time (static_view), and the pinned inputs (input register → the tensor every call gets)
        self.pinned = {p.inputs[pos]: t for pos, t in (pinned or {}).items()}
        self.unpinned = unpinned  # what a call with other tensors at the pinned inputs runs instead
        self.static: dict[int, torch.Tensor] = dict(self.pinned)
        # planned values whose register is their arena slice once written (every arena-mode write does that;
        # mode fast keeps some results in fresh tensors, a zero-copy transfer binds the source)
        self.bound: set[int] = set()
        self.sites = 0  # run-time pointer reads (native.contiguous_ptr call sites)
        # the kernel of every instruction: the one kernel lowering recorded (hetforge.ir.kernel_choice), with
        # oneDNN candidates decided by measurement here; a static view that cannot be bound here becomes "view"
        self.kernels = resolved_kernels(p, lambda ins: onednn.chosen(self, ins))
        # residual adds a oneDNN product takes as its post-op: product id → the add's other operand; add id →
        # the register the add binds to (its own instruction runs no kernel)
        self.readers = p.consumers()  # value id → ids of the instructions reading it
        self.by_id = p.instr_by_id()
        self.residual, self.fused_adds = onednn.residual_adds(self, lambda g: onednn.takes_residual(self, g))
        # panel-GEMM products of one input run as one call at the first (onednn.panel_groups): member id → (first
        # member's id, index, group)
        self.panel_group_of = onednn.panel_groups(self) if mode != "fast" else {}
        self.dense: set[int] = set()  # registers that hold a fresh dense tensor each call (oneDNN results)
        self.heads_last_views: dict[int, torch.Tensor] = {}  # transpose instruction id → its static result
        # views of oneDNN results made in one step from the result: register → (root register, a meta tensor
        # with the view's size, strides and offset in the root's storage); view instructions all of whose
        # outputs are there emit only the outputs a non-view instruction reads (see composed_views)
        self.composed, self.composed_ids = self.composed_views() \
            if mode != "fast" and os.environ.get(COMPOSE_ENV, "1") != "0" else ({}, set())
        # one-row products that share their input, run as one native call at the first one (see gemv_group)
        self.groups: dict[int, list] = {}  # first member's instruction id → the group's instructions
        self.grouped: dict[int, torch.Tensor] = {}  # member id → the scratch row the group's call writes it to
        if os.environ.get("HETFORGE_GEMV_MULTI", "1") != "0" and mode != "fast":
            self.groups = self.gemv_groups()
        # one-row native products that may take the residual add after them (see native_residual): product id →
        # (add instruction, its other operand); decided when the product is emitted (its operands' pointers must
        # be known then), recorded in ``res_at`` (add id → product instruction, residual) for the add's line
        self.res_candidates: dict[int, tuple[Any, Reg]] = {}
        if mode != "fast":
            products, _ = onednn.residual_adds(self, self.native_takes_residual, self.native_residual_fits)
            for gid, other in products.items():
                self.res_candidates[gid] = (self.residual_add_of(gid), other)
        self.res_at: dict[int, tuple[Any, Reg]] = {}

    def heads_last(self, o: int) -> torch.Tensor | None:
        """The prefill attention's result as a ``[b, h, l, dv]`` view of its arena slice laid out ``[b, l, h, dv]``,
        when the program only ever reads it through ``transpose(1, 2)`` and then reshapes of that: the attention
        writes rows in that order (``hf_prefill_attention``'s output strides), the transpose is the dense slice
        (bound here, at build time) and the reshape that merges the heads a view of it, where with a dense
        ``[b, h, l, dv]`` result it copied the whole output each call. None otherwise. The slice lives until the
        reshapes' last reads: the plan keeps a view's storage live for its aliases. Where the transpose is a copy
        into storage of its own (a plain forward's ``.contiguous()``), the slice is that storage, which the plan
        makes live from the attention on (``ir.liveness.attention_writes``), and the copy goes."""
        p, outs = self.p, set(self.p.output_regs())
        vo = p.values[o]
        if self.mode == "fast" or not self.planned(o) or o in outs or len(vo.shape) != 4:
            return None

        def readers(r: int) -> list:
            return [self.by_id[i] for i in self.readers.get(r, [])]

        users = readers(o)
        # a reshape to its own shape (Llama's, before its transpose) is the same tensor
        while len(users) == 1 and reshape_view(users[0]) and \
                len(users[0].outputs) == 1 and p.values[users[0].outputs[0]].shape == vo.shape:
            if users[0].outputs[0] in outs:
                return None
            users = readers(users[0].outputs[0])
        if len(users) != 1:
            return None
        t = users[0]
        if len(t.outputs) != 1 or t.outputs[0] in outs:
            return None
        b, h, ell, dv = vo.shape
        to = t.outputs[0]
        if copying_heads_transpose(t, p) and self.planned(to) and self.p.values[to].is_contiguous:
            # the transpose copies into its own dense slice: the attention writes there instead, when the slice
            # shares no byte with what the attention reads (the plan may give it their slots: they die there)
            slab = self.g[self.buffer(to)]
            att = self.by_id[p.values[o].producer]
            if any(self.overlaps(slab, r) for r in iter_regs((att.args, att.kwargs))):
                return None
            slab = slab.view(b, ell, h, dv)
        else:
            if not heads_transpose(t):
                return None
            merges = readers(to)  # each must live in the result's storage: the plan then keeps it live
            if not merges or any(not reshape_view(r) or any(p.root(x) != p.root(o) for x in r.outputs)
                                 for r in merges):
                return None
            slab = self.g[self.buffer(o)].view(b, ell, h, dv)
        self.heads_last_views[t.id] = slab
        return slab.transpose(1, 2)

    def overlaps(self, t: torch.Tensor, r: int) -> bool:
        """Whether register ``r``'s planned storage shares a byte with ``t`` (False where it has none)."""
        root = self.p.root(r)
        if not self.planned(root):
            return False
        u = self.g[self.buffer(root)]
        a0, b0 = t.data_ptr(), u.data_ptr()
        return a0 < b0 + self.p.values[root].nbytes and b0 < a0 + t.numel() * t.element_size()

    def composed_views(self) -> tuple[dict[int, tuple[int, torch.Tensor]], set[int]]:
        """Chains of views over a oneDNN result (a fresh dense tensor each call, offset 0): each view's outputs as
        a meta tensor laid out in the result's storage, computed once here by running the view ops on a meta
        stand-in of the result. A view instruction whose outputs all come out as views of it (not copies) with
        the layout the program records is composed: it emits, per call, one ``as_strided`` of the result for each
        output that a non-view instruction or the program's outputs read, and nothing for the others. Why: a
        fused projection's q/k/v are a view, a split, then a view and a transpose each (eight calls), and each
        such call between two products costs more than its work because the product evicted the interpreter's
        data from cache; composed, they are three."""
        p = self.p
        comp: dict[int, tuple[int, torch.Tensor]] = {}
        ids: set[int] = set()
        for ins in p.instrs:
            k = self.kernels.get(ins.id)
            if ins.kind == KERNEL and len(ins.outputs) == 1 and (k == "onednn" or ins.id in self.fused_adds):
                o, v = ins.outputs[0], p.values[ins.outputs[0]]
                if ins.id in self.fused_adds:
                    if self.fused_adds[ins.id] in comp:
                        comp[o] = comp[self.fused_adds[ins.id]]
                elif v.is_contiguous and self.dm[ins.device].type == "cpu":
                    comp[o] = (o, torch.empty(v.shape, dtype=v.dtype, device="meta"))
                continue
            if ins.kind != VIEW or k not in ("view", "static-view") \
                    or not isinstance(ins.target, torch._ops.OpOverload):
                continue
            regs = ins.input_regs()
            roots = {comp[r][0] for r in regs if r in comp}
            if not regs or len(roots) != 1 or any(r not in comp for r in regs):
                continue
            root = roots.pop()
            base = comp[root][1]

            def sub(a: Any) -> Any:
                if isinstance(a, Reg):
                    return comp[a.id][1]
                if isinstance(a, (list, tuple)):
                    return type(a)(sub(x) for x in a)
                return a

            try:
                got = ins.target(*sub(ins.args), **{n: sub(x) for n, x in ins.kwargs.items()})
            except (RuntimeError, TypeError, ValueError, NotImplementedError):
                continue
            outs = list(got) if isinstance(got, (list, tuple)) else [got]
            if len(outs) != len(ins.outputs) or not all(
                    isinstance(t, torch.Tensor) and (t is base or t._base is base) and p.values[o].laid_out_as(t)
                    for o, t in zip(ins.outputs, outs, strict=True)):
                continue  # a copy (a reshape that cannot view), or not the layout the program records
            for o, t in zip(ins.outputs, outs, strict=True):
                comp[o] = (root, t)
            ids.add(ins.id)
        return comp, ids

    def composed_reads(self) -> dict[int, list[int]]:
        """Per composed view instruction, the registers its emitted lines read: its root, when it emits any
        (after :meth:`needed_views` has set ``need_views``)."""
        return {ins.id: [self.composed[o][0] for o in ins.outputs if o in self.need_views][:1]
                for ins in self.p.instrs if ins.id in self.composed_ids}

    def needed_views(self) -> set[int]:
        """Outputs of composed views that the program's outputs or a non-composed instruction read."""
        need = {r for r in self.p.output_regs() if r in self.composed}
        for ins in self.p.instrs:
            if ins.id not in self.composed_ids:
                need.update(r for r in ins.input_regs() if r in self.composed)
        return need

    def never_made(self, r: int) -> bool:
        """Whether ``r<r>`` is a composed view no line makes (nothing reads it: see composed_views)."""
        return r in self.composed and r not in self.need_views and self.composed[r][0] != r

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
        """The lines of one instruction, for the kernel recorded on it (see :mod:`hetforge.ir.kernel_choice`)."""
        dev = self.dm[ins.device]
        k = self.kernels[ins.id]
        outs = [f"r{o}" for o in ins.outputs]
        if ins.kind == TRANSFER:
            self.stats.transfers += 1
            src = self.expr(ins.args[0], dev)
            o = ins.outputs[0]
            if k == "zero-copy":
                src_dev = self.dm[self.p.values[ins.args[0].id].device]
                return [f"{outs[0]} = {src}" if src_dev == dev else f"{outs[0]} = {src}.to({self.const(dev, 'dev')})"]
            if k == "transfer-copy":
                self.bound.add(o)
                return [f"{outs[0]} = {self.buffer(o)}.copy_({src})"]
            return [f"{outs[0]} = {src}.to({self.const(dev, 'dev')}, copy=True)"]
        fn = self.const(self.kernel(ins, dev), "f")
        lhs = outs[0] if len(outs) == 1 else ", ".join(outs)
        if ins.kind != VIEW and ins.id in self.heads_last_views:  # a copying transpose the attention wrote: its
            # slice, bound (the record keeps the copy's kernel: what it names is what the slice holds)
            t = self.heads_last_views[ins.id]
            self.static[ins.outputs[0]] = t
            self.stats.heads_last_copies += 1
            return [f"{outs[0]} = {self.const(t, 'sv')}"]
        if ins.kind == VIEW:
            self.stats.views += 1
            if ins.id in self.heads_last_views:  # the transpose of a heads-last attention result: dense, static
                t = self.heads_last_views[ins.id]
                self.static[ins.outputs[0]] = t
                self.stats.static_views += 1
                return [f"{outs[0]} = {self.const(t, 'sv')}"]
            if ins.id in self.composed_ids:  # one as_strided of the oneDNN result per output read (composed_views)
                self.stats.composed_views += 1
                lines = []
                for o in ins.outputs:
                    if o not in self.need_views:
                        continue
                    root, t = self.composed[o]
                    b = self.composed[root][1]
                    same = (t.shape, t.stride(), t.storage_offset()) == (b.shape, b.stride(), b.storage_offset())
                    lines.append(f"r{o} = r{root}" if same else
                                 f"r{o} = r{root}.as_strided({tuple(t.shape)}, {t.stride()}, {t.storage_offset()})")
                return lines
            if k == "elided":
                self.stats.elided_views += 1
                return [f"{outs[0]} = r{ins.args[0].id}"]
            # a view lowering left per call can still be bound here when its inputs turned out static (the
            # reshape after a heads-last attention result: a view of the slice, where lowering expected a copy)
            if k == "static-view" or (k == "view" and ins.id not in self.composed_ids and all(
                    self.static_tensor(r, dev) is not None for r in ins.input_regs())):
                bound = self.static_view(ins)
                if bound is not None:
                    self.stats.static_views += 1
                    return [f"{', '.join(outs)}{',' if len(outs) == 1 and len(bound) > 1 else ''} = "
                            f"{', '.join(bound)}"]
                self.kernels[ins.id] = "view"  # not the view lowering expected (see static_view): per call
            return [f"{lhs} = {self.call(ins, fn, dev)}"]
        if ins.kind == INPLACE:
            self.stats.inplace += 1
            return [f"{lhs} = {self.call(ins, fn, dev)}"]
        assert ins.kind == KERNEL, ins.kind
        if ins.id in self.res_candidates and self.native_residual(ins, dev):
            return []  # its call runs at the residual add after it (res_at), into the add's slice
        if ins.id in self.res_at:
            prod, res = self.res_at.pop(ins.id)
            o = ins.outputs[0]
            self.bound.add(o)
            self.stats.native_residual += 1
            k_prod = self.kernels[prod.id]
            if k_prod in NATIVE_GEMV:
                x, w, b, weight_t = gemm_operands(prod)
                return [self.native_gemv(x, self.g[self.weight(w.id, dev)], b, weight_t, prod.outputs[0], dev,
                                         into=o, res=res)]
            return [self.native_op(prod, prod.outputs[0], dev, k_prod[7:], into=o, res=res)]
        if len(ins.outputs) == 1:
            o = ins.outputs[0]
            v = self.p.values[o]
            if ins.id in self.fused_adds:  # computed by the product before it (onednn.residual_adds)
                if v.is_contiguous:  # the product's dense result, or a view of it to the add's shape
                    self.dense.add(o)
                return [f"{outs[0]} = r{self.fused_adds[ins.id]}"]
            if k == "onednn":
                if v.is_contiguous:
                    self.dense.add(o)
                return [onednn.codegen_line(self, ins, o, dev)]
            if ins.id in self.groups or ins.id in self.grouped:
                line = self.gemv_group(ins, o, dev)
                if line is not None:
                    return [line]
            gemm = k in NATIVE_GEMV or k.startswith("split-gemv:") or k == "gemm-out"
            line = self.gemm(ins, o, dev, k) if gemm else self.native_op(ins, o, dev, k[7:]) \
                if k.startswith("native:") else None
            if not self.planned(o):
                if v.kind == OUTPUT:
                    self.stats.fresh_outputs += 1
                return [line or f"{outs[0]} = {self.call(ins, fn, dev)}"]
            buf = self.buffer(o)
            if line is not None:
                self.stats.gemm_out += gemm
                if o not in self.static:  # a heads-last attention result is a permuted view (heads_last)
                    self.bound.add(o)
                return [line]
            if k == "copy-into":
                self.stats.copy_into += 1
                self.bound.add(o)
                return [f"{outs[0]} = {buf}.copy_({self.expr(ins.args[0], dev)})"]
            if k == "out-variant" and ins.op in native.EWISE_OPS:
                line = self.native_ewise(ins, o)
                if line is not None:
                    return [line]
            if k == "out-variant":
                self.stats.out_variant += 1
                self.bound.add(o)
                ov = self.const(out_variant(ins.target), "fo")
                return [f"{outs[0]} = {self.call(ins, ov, dev, 'out=' + buf)}"]
            self.stats.by_op_fallback[ins.op] = self.stats.by_op_fallback.get(ins.op, 0) + 1
            if k == "unplanned":
                self.stats.unplanned += 1
                return [f"{outs[0]} = {self.call(ins, fn, dev)}"]
            self.stats.functional_copy += 1
            self.bound.add(o)
            return [f"{outs[0]} = {buf}.copy_({self.call(ins, fn, dev)})"]
        lines = [f"{', '.join(outs)}, = {self.call(ins, fn, dev)}"]
        self.stats.by_op_fallback[ins.op] = self.stats.by_op_fallback.get(ins.op, 0) + 1
        for o in ins.outputs:
            if self.planned(o):
                if k == "unplanned":
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
            if not isinstance(t, torch.Tensor) or not v.laid_out_as(t) or t.untyped_storage().data_ptr() not in sources:
                return None  # not the layout lowering expects, or not a view (a copy would be a stale snapshot)
        for o, t in zip(ins.outputs, outs, strict=True):
            self.static[o] = t
        return [self.const(t, "sv") for t in outs]

    def gemm(self, ins, o: int, dev: torch.device, k: str) -> str:
        """A linear-type product into the result (kernel ``gemm-out``, ``split-gemv:<c>`` or a native GEMV)."""
        x, w, b, weight_t = gemm_operands(ins)
        wt = self.g[self.weight(w.id, dev)]
        if k in NATIVE_GEMV:
            return self.native_gemv(x, wt, b, weight_t, o, dev)
        if k.startswith("split-gemv:"):
            return self.split_gemv(x, wt, b, int(k.split(":")[1]), weight_t, o, dev)
        buf = self.buffer(o)
        kk, n = self.p.values[x.id].shape[-1], self.p.values[o].shape[-1]
        wt = self.const(wt.t(), "wt")  # addmm.out / mm.out on 2-D views, the weight transposed once here
        out2d = self.const(self.g[buf].view(-1, n), "o2d")
        x2d = self.view_of(x.id, (-1, kk))
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

    def native_gemv(self, x: Reg, w: torch.Tensor, b: Any, weight_t: bool, o: int, dev: torch.device,
                    into: int | None = None, res: Reg | None = None) -> str:
        """One-row fp32 product on the native kernel (:mod:`hetforge.kernels.native`); with ``res``, plus that
        residual, written into ``into``'s slice (``hf_gemv_res``: see :meth:`native_residual`).

        Arena slices never move, so the pointers of planned operands are baked into the line once."""
        vo = self.p.values[o]
        k, n = (w.shape if weight_t else (w.shape[1], w.shape[0]))
        bp = "None"
        if b is not None:
            bp = str(self.g[self.weight(b.id, dev)].data_ptr()) if self.p.values[b.id].kind == WEIGHT \
                else self.ptr(b.id, dev)
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
        if res is not None:
            buf = self.buffer(into)
            yp, post = str(self.g[buf].data_ptr()), f"; r{into} = {buf}"
            scratch = self.gemv_scratch(n) if weight_t else None
            part = f"{scratch.data_ptr()}, {scratch.shape[0]}" if weight_t else "None, 0"
            return (f"{self.const(lib.hf_gemv_res, 'nk')}({wp}, {xp}, {bp}, {self.ptr(res.id, dev)}, {yp}, {n}, "
                    f"{k}, {int(weight_t)}, {nt}(), {part})" + post)
        if weight_t:
            scratch = self.gemv_scratch(n)
            call = (f"{self.const(lib.hf_gemv_kn, 'nk')}({wp}, {xp}, {bp}, {yp}, {n}, {k}, {nt}(), "
                    f"{scratch.data_ptr()}, {scratch.shape[0]})")
        else:
            call = f"{self.const(lib.hf_gemv_nk, 'nk')}({wp}, {xp}, {bp}, {yp}, {n}, {k}, {nt}())"
        return pre + call + post

    NATIVE_RESIDUAL = (*NATIVE_GEMV, "native:hf_gemv_bf16", "native:hf_gated_mlp", "native:hf_gated_mlp_bf16")

    def native_takes_residual(self, g) -> bool:
        """Whether the one-row native product ``g`` has a ``_res`` kernel variant that can add the residual after it
        (``hf_gemv_res``, ``hf_gemv_bf16_res``, the gated MLPs' with a down product); not a grouped product."""
        k = self.kernels.get(g.id)
        if k not in self.NATIVE_RESIDUAL or self.dm[g.device].type != "cpu" \
                or any(g.id == m.id for ms in self.groups.values() for m in ms):
            return False
        if k in ("native:hf_gated_mlp", "native:hf_gated_mlp_bf16"):
            return bind_args(g).get("w_down") is not None
        return k in NATIVE_GEMV or gemm_operands(g) is not None or "x" in (bind_args(g) or {})

    def native_residual_fits(self, g, add, other: Reg) -> bool:
        """The structural half of :meth:`native_residual`: only views between the product and its add (nothing
        writes memory there, so the product's operands still hold its inputs when its call runs at the add), and
        both the product's and the add's results in arena slices (not graph outputs)."""
        if not hasattr(self, "_pos"):
            self._pos = {ins.id: i for i, ins in enumerate(self.p.instrs)}  # program order
        lo, hi = self._pos[g.id], self._pos[add.id]
        outs = set(self.p.output_regs())
        o = add.outputs[0]
        return all(ins.kind == VIEW for ins in self.p.instrs[lo + 1:hi]) and self.planned(o) and o not in outs \
            and self.planned(g.outputs[0])

    def residual_add_of(self, gid: int):
        """The add instruction that reads product ``gid``'s result (directly or through one reshape)."""
        r = self.by_id[gid].outputs[0]
        nxt = self.by_id[self.readers[r][0]]
        return nxt if nxt.kind != VIEW else self.by_id[self.readers[nxt.outputs[0]][0]]

    def native_residual(self, ins, dev: torch.device) -> bool:
        """Whether the one-row native product ``ins`` takes the residual add after it: its call then runs where the
        add stands, on the kernel's ``_res`` variant, writing ``product + residual`` straight into the add's
        slice (the same bits as the product then ATen's add: one fp32 add, or bf16's rounding of it); the product's
        own instruction runs nothing. Why: after a weight stream, the add's ATen dispatch runs from a cold cache
        (several µs), once per layer and residual, in every decode step. Only where every pointer is known now
        (operands in arena slices or weights), the residual is the add's slice itself or apart from it, and the
        add's slice is apart from the product's input, or the kernel reads its input in a pass before the one that
        writes its result: a split-K ``[K, N]`` product (partial sums, then the reduce that writes) and a gated MLP
        (gate and up into scratch, then the down product). The add's slice may be the input's own memory: the
        plan frees the input at the product, which now runs later."""
        add, other = self.res_candidates[ins.id]
        k = self.kernels[ins.id]
        if k in NATIVE_GEMV:
            x, _, b, weight_t = gemm_operands(ins)
        elif k == "native:hf_gemv_bf16":
            gops = gemm_operands(ins)
            args = bind_args(ins)
            x, b, weight_t = (gops[0], gops[2], gops[3]) if gops is not None else \
                (args["x"], args["bias"], bool(args["weight_t"]))
        else:
            x, b, weight_t = bind_args(ins)["x"], None, True  # a gated MLP: x is read before the down product
        regs = [r for r in (x, b, other) if isinstance(r, Reg)]
        if not isinstance(x, Reg) or any(self.static_tensor(r.id, dev) is None for r in regs) \
                or (isinstance(b, Reg) and self.p.values[b.id].kind != WEIGHT):  # a bias the plan may overwrite
            return False
        y = self.g[self.buffer(add.outputs[0])]

        def span(t: torch.Tensor) -> tuple[int, int]:
            return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()

        def apart(a: tuple[int, int], c: tuple[int, int]) -> bool:
            return a[1] <= c[0] or c[1] <= a[0]

        ys, xs, rs = span(y), span(self.static_tensor(x.id, dev)), span(self.static_tensor(other.id, dev))
        if not (weight_t or apart(ys, xs)) or not (rs == ys or apart(ys, rs)):
            return False
        self.res_at[add.id] = (ins, other)
        self.bound.add(ins.outputs[0])  # its slice (never written): views of it may bind, nothing reads them
        return True

    def gemv_groups(self) -> dict[int, list]:
        """Native ``[N, K]`` one-row products that read the same input register (a layer's q, k and v
        projections), in program order, cut into groups of 2..``native.MULTI_MAX``: each group runs as one
        ``hf_gemv_nk_multi`` call where its first product stands (one pool call instead of several; every result
        bit-equal). Computing the later ones early is sound: their input is the same register, and their weights
        and biases are constants. Not grouped: products with a bias that is not a weight, and any group with an
        in-place instruction between its members."""
        by_x: dict[int, list] = {}
        pos = {ins.id: n for n, ins in enumerate(self.p.instrs)}
        for ins in self.p.instrs:
            if ins.kind != KERNEL or len(ins.outputs) != 1 or self.kernels.get(ins.id) != "native:hf_gemv_nk" \
                    or self.dm[ins.device].type != "cpu":
                continue
            x, w, b, weight_t = gemm_operands(ins)
            if weight_t or not isinstance(x, Reg) or (b is not None and self.p.values[b.id].kind != WEIGHT) \
                    or self.p.values[ins.outputs[0]].dtype != torch.float32:
                continue
            by_x.setdefault(x.id, []).append(ins)
        inplace = [n for n, ins in enumerate(self.p.instrs) if ins.kind == INPLACE]
        groups: dict[int, list] = {}
        for members in by_x.values():
            for i in range(0, len(members), native.MULTI_MAX):
                g = members[i:i + native.MULTI_MAX]
                lo, hi = pos[g[0].id], pos[g[-1].id]
                if len(g) > 1 and not any(lo < n < hi for n in inplace):
                    groups[g[0].id] = g
        return groups

    def gemv_group(self, ins, o: int, dev: torch.device) -> str | None:
        """The line of a grouped one-row product (see :meth:`gemv_groups`): at the first member, the one native
        call for the whole group (its own result straight into its arena slice when it has one; the others' into
        scratch rows made once); at a later member, its row copied from scratch into its slice (a fresh tensor
        when it is a graph output). None: not grouped after all (the input's pointer is only known at run time)."""
        if ins.id in self.grouped:
            scr = self.grouped.pop(ins.id)
            if self.planned(o):
                buf = self.buffer(o)
                self.bound.add(o)
                self.stats.gemm_out += 1
                mm = self.const(native.library().hf_copy, "nk")
                return f"{mm}({self.g[buf].data_ptr()}, {scr.data_ptr()}, {scr.numel() * 4}); r{o} = {buf}"
            self.stats.fresh_outputs += self.p.values[o].kind == OUTPUT
            return f"r{o} = {self.const(scr, 'scr')}.clone()"
        group = self.groups.pop(ins.id)
        x = gemm_operands(ins)[0]
        xt = self.static_tensor(x.id, dev)
        if xt is None:
            return None
        ws, bs, ys, rows = [], [], [], []
        for n, m in enumerate(group):
            _, w, b, _ = gemm_operands(m)
            mo = m.outputs[0]
            wt = self.g[self.weight(w.id, dev)]
            ws.append(wt.data_ptr())
            rows.append(wt.shape[0])
            bs.append(None if b is None else self.g[self.weight(b.id, dev)].data_ptr())
            if n == 0 and self.planned(mo):  # straight into its slice
                ys.append(self.g[self.buffer(mo)].data_ptr())
            else:
                scr = self.grouped[m.id] = torch.empty(self.p.values[mo].shape, dtype=torch.float32)
                self.const(scr, "scr")  # kept alive by the generated code's globals: its pointer is baked in
                ys.append(scr.data_ptr())
        self.stats.native_gemv += len(group)
        self.stats.gemv_groups += 1
        k = xt.numel()
        args = self.const(native.MultiArgs(ws, bs, ys, rows), "mg")
        nt = self.const(torch.get_num_threads, "f")
        call = f"{args}.call({xt.data_ptr()}, {k}, {nt}())"
        if ins.id in self.grouped:  # the first member's own row went to scratch too: copy it now
            return call + "; " + self.gemv_group(ins, o, dev)
        self.bound.add(o)
        self.stats.gemm_out += 1
        return f"{call}; r{o} = {self.buffer(o)}"

    def gemv_scratch(self, n: int) -> torch.Tensor:
        """The split-K partial rows of a native ``[K, N]`` GEMV (one row per part of K; shared by the
        program's products of width ``n``, which run one at a time)."""
        return self.g.setdefault(f"_gemv_part{n}", torch.empty((native.split_k_slots(), n), dtype=torch.float32))

    def ptr(self, vid: int, dev: torch.device) -> str:
        """The data pointer of ``r<vid>`` for a native kernel: a literal when the tensor is known at build
        time (arena slices never move; weights; views of those), the register's own pointer for a fresh dense
        oneDNN result (``self.dense``), else read per call through
        :func:`hetforge.kernels.native.contiguous_ptr` (a strided tensor is read through a contiguous copy
        kept in this program's ``_keep``; a non-fp32 or non-CPU one is refused)."""
        t = self.static_tensor(vid, dev)
        if t is not None:
            return str(t.data_ptr())
        if vid in self.dense:
            return f"r{vid}.data_ptr()"
        self.sites += 1
        self.g.setdefault("_keep", {})
        dt = self.p.values[vid].dtype  # bf16 for the _bf16 kernels (lowering checked every operand's dtype)
        extra = "" if dt == torch.float32 else f", {self.const(dt, 'dt')}"
        return f"{self.const(native.contiguous_ptr, 'f')}(r{vid}, _keep, {self.sites}{extra})"

    def native_op(self, ins, o: int, dev: torch.device, fn: str, into: int | None = None,
                  res: Reg | None = None) -> str:
        """A ``hetforge::`` row op (rms_norm, layer_norm, rotary, one-row kv_attention, linear_act, gated_mlp,
        linear_w8, prefill attention) as one call of its native kernel ``fn`` (chosen by lowering), pointers baked
        in, writing straight into the result's arena slice (or a fresh tensor when the result is a graph output).
        With ``res`` (``hf_gemv_bf16``, the gated MLPs with a down product): plus that residual, into ``into``'s
        slice, on the kernel's ``_res`` variant (see :meth:`native_residual`)."""
        args = bind_args(ins)
        vo = self.p.values[o]
        d = vo.shape[-1]
        rows = math.prod(vo.shape) // d
        lib, p = native.library(), (lambda a: "None" if a is None else self.ptr(a.id, dev))
        post = ""  # code run after the call (hf_gemm_q8a: an activation ATen applies in place)
        nt = f"{self.const(torch.get_num_threads, 'f')}()"
        x = args.get("x")
        if fn == "hf_rms_norm":
            call = f"hf_rms_norm({p(x)}, {p(args['weight'])}, {{y}}, {rows}, {d}, {float(args['eps'])!r}, {nt})"
        elif fn == "hf_layer_norm":
            call = (f"hf_layer_norm({p(x)}, {p(args['weight'])}, {p(args['bias'])}, {{y}}, {rows}, {d}, "
                    f"{float(args['eps'])!r}, {nt})")
        elif fn == "hf_rotary":
            call = f"hf_rotary({p(x)}, {p(args['cos'])}, {p(args['sin'])}, {{y}}, {rows}, {d}, {nt})"
        elif fn in ("hf_rotary_pos", "hf_rotary_pos_bf16"):  # x read with its own strides (known at run time)
            cs = 0 if math.prod(self.p.values[args["cos"].id].shape) == d else d  # as lowering checked it
            dt = "" if fn == "hf_rotary_pos" else f", {self.const(vo.dtype, 'dt')}"
            call = (f"{self.const(native.rotary_positions, 'f')}(r{x.id}, {p(args['cos'])}, {p(args['sin'])}, "
                    f"{{y}}, {cs}{dt})")
        elif fn in ("hf_gemv_q8", "hf_gemv_q8a"):  # int8 weights, one row (q8a: x quantized per block of 32)
            kk = math.prod(self.p.values[x.id].shape)
            call = (f"{fn}({p(args['qweight'])}, {p(args['scales'])}, {p(x)}, {p(args['bias'])}, {{y}}, {d}, "
                    f"{kk}, {native.ACT_CODES[args['act']]}, {nt})")
        elif fn == "hf_gemm_q8a":  # int8 weights, several rows, each quantized per block of 32
            kk = self.p.values[x.id].shape[-1]
            code, after = native.gemm_act_split(args["act"])  # GELU/SiLU: ATen's in place on the result
            call = (f"hf_gemm_q8a({p(args['qweight'])}, {p(args['scales'])}, {p(x)}, {p(args['bias'])}, {{y}}, "
                    f"{rows}, {d}, {kk}, {code}, {nt})")
            if after != "none":
                post = f"; {self.const(native.act_inplace, 'f')}(r{o}, {after!r})"
        elif fn in ("hf_gemv_q4a", "hf_gemm_q4a"):  # int4 weights (ATen's packed layout), x per block of 32
            kk = self.p.values[x.id].shape[-1]
            n_rows = "" if fn == "hf_gemv_q4a" else f"{rows}, "
            code, after = (native.ACT_CODES[args["act"]], "none") if fn == "hf_gemv_q4a" \
                else native.gemm_act_split(args["act"])
            call = (f"{fn}({p(args['packed'])}, {p(args['scales_zeros'])}, {p(x)}, {p(args['bias'])}, {{y}}, "
                    f"{n_rows}{d}, {kk}, {int(args['group_size'])}, {code}, {nt})")
            if after != "none":
                post = f"; {self.const(native.act_inplace, 'f')}(r{o}, {after!r})"
        elif fn == "hf_linear_act":
            w, wt = args["weight"], bool(args["weight_t"])
            kk = math.prod(self.p.values[x.id].shape)
            part = self.gemv_scratch(d)
            call = (f"hf_linear_act({p(w)}, {p(x)}, {p(args['bias'])}, {{y}}, {d}, {kk}, {int(wt)}, "
                    f"{native.ACT_CODES[args['act']]}, {nt}, {part.data_ptr()}, {part.shape[0]})")
        elif fn in ("hf_gated_mlp", "hf_gated_mlp_bf16"):
            wg, wu, wd = args["w_gate"], args["w_up"], args["w_down"]
            dm = math.prod(self.p.values[x.id].shape)
            f = self.p.values[wg.id].shape[0]
            h = "{y}" if wd is None else str(self.g[self.const(torch.empty(f, dtype=vo.dtype), "scr")].data_ptr())
            rp = "" if res is None else f"{p(res)}, "
            call = (f"{fn}{'_res' if res is not None else ''}({p(x)}, {p(wg)}, {p(wu)}, {p(wd)}, {h}, {rp}{{y}}, "
                    f"{f}, {dm}, {native.ACT_CODES[args['act']]}, {nt})")
        elif fn in ("hf_gemm_few", "hf_gemm_few_kn"):  # a few fp32 rows: linear / addmm / mm, or linear_act
            gops = gemm_operands(ins)
            x, w, b, act = (*gops[:3], "none") if gops is not None else \
                (args["x"], args["weight"], args["bias"], args["act"])
            kk = self.p.values[x.id].shape[-1]
            call = f"{fn}({p(w)}, {p(x)}, {p(b)}, {{y}}, {rows}, {d}, {kk}, {native.ACT_CODES[act]}, {nt}"
            if fn == "hf_gemm_few":
                call += ")"
            else:  # split-K parts: a scratch shared by the program's products of this size (they run one at a time)
                part = self.g.setdefault(f"_few_part{rows * d}",
                                         torch.empty((native.FEW_KN_SLOTS, rows * d), dtype=torch.float32))
                call += f", {part.data_ptr()}, {native.FEW_KN_SLOTS})"
        elif fn == "hf_gated_mlp_few":
            wg, wu, wd = args["w_gate"], args["w_up"], args["w_down"]
            f = self.p.values[wg.id].shape[0]
            dm = self.p.values[x.id].shape[-1]
            scr = self.g[self.const(torch.empty(2 * rows * f, dtype=torch.float32), "scr")]
            call = (f"hf_gated_mlp_few({p(x)}, {p(wg)}, {p(wu)}, {p(wd)}, {scr.data_ptr()}, "
                    f"{scr[rows * f:].data_ptr()}, {{y}}, {rows}, {f}, {dm}, {native.ACT_CODES[args['act']]}, {nt})")
        elif fn == "hf_gemv_bf16":  # one bf16 row: linear / addmm / mm, or linear_act with its activation
            gops = gemm_operands(ins)
            if gops is not None:
                x, w, b, wt = gops
                act = "none"
            else:
                x, w, b, wt, act = args["x"], args["weight"], args["bias"], bool(args["weight_t"]), args["act"]
            kk = math.prod(self.p.values[x.id].shape)
            part = f"{self.gemv_scratch(d).data_ptr()}, {self.gemv_scratch(d).shape[0]}" if wt else "None, 0"
            rp = "" if res is None else f"{p(res)}, "
            call = (f"hf_gemv_bf16{'_res' if res is not None else ''}({p(w)}, {p(x)}, {p(b)}, {rp}{{y}}, {d}, {kk}, "
                    f"{int(wt)}, {native.ACT_CODES[act]}, {nt}, {part})")
        elif fn == "hf_rms_norm_bf16":
            call = (f"hf_rms_norm_bf16({p(x)}, {p(args['weight'])}, {{y}}, {rows}, {d}, {float(args['eps'])!r}, "
                    f"{nt})")
        elif fn == "hf_layer_norm_bf16":
            call = (f"hf_layer_norm_bf16({p(x)}, {p(args['weight'])}, {p(args['bias'])}, {{y}}, {rows}, {d}, "
                    f"{float(args['eps'])!r}, {nt})")
        elif fn == "hf_rotary_bf16":
            call = f"hf_rotary_bf16({p(x)}, {p(args['cos'])}, {p(args['sin'])}, {{y}}, {rows}, {d}, {nt})"
        elif fn == "hf_decode_attention_bf16":
            q, k, v, kc, vc = (args[n] for n in ("q", "k", "v", "k_cache", "v_cache"))
            sq, sk, sc = (self.p.values[a.id].shape for a in (q, k, kc))
            h, hd, hkv, s = sq[1], sq[3], sk[1], sc[2]
            scratch = self.const(torch.empty(native.attention_scratch_floats(h, s, hd), dtype=torch.float32), "scr")
            call = (f"hf_decode_attention_bf16({p(q)}, {p(k)}, {p(v)}, {p(kc)}, {p(vc)}, {p(args['cache_mask'])}, "
                    f"{p(args['new_mask'])}, {{y}}, {self.g[scratch].data_ptr()}, {h}, {hkv}, {s}, {hd}, "
                    f"{float(args['scale'])!r}, {nt})")
        elif fn == "hf_prefill_attention":  # q/k/v read with their strides (known at run time), in Python then C
            q, k, v, mask = (self.expr(args[n], dev) for n in ("q", "k", "v", "mask"))  # a register or a weight
            hl = self.heads_last(o)
            fn_obj = native.PrefillAttention(float(args["scale"]), bool(args["is_causal"]),
                                             None if hl is None else tuple(hl.stride()[:3]))
            call = f"{self.const(fn_obj, 'pa')}({q}, {k}, {v}, {mask}, {{y}})"
            if hl is not None:  # the result is the slice in [b, l, h, dv] order (see heads_last)
                self.stats.native_ops += 1
                self.static[o] = hl
                return call.format(y=hl.data_ptr()) + f"; r{o} = {self.const(hl, 'hl')}"
        else:  # hf_decode_attention: kv_attention, one new row
            q, k, v, kc, vc = (args[n] for n in ("q", "k", "v", "k_cache", "v_cache"))
            sq, sk, sc = (self.p.values[a.id].shape for a in (q, k, kc))
            h, hd, hkv, s = sq[1], sq[3], sk[1], sc[2]
            scratch = self.const(torch.empty((h, s + 1), dtype=torch.float32), "scr")
            call = (f"hf_decode_attention({p(q)}, {p(k)}, {p(v)}, {p(kc)}, {p(vc)}, {p(args['cache_mask'])}, "
                    f"{p(args['new_mask'])}, {{y}}, {self.g[scratch].data_ptr()}, {h}, {hkv}, {s}, {hd}, "
                    f"{float(args['scale'])!r}, {nt})")
        name, rest = call.split("(", 1)
        if fn not in ("hf_rotary_pos", "hf_rotary_pos_bf16", "hf_prefill_attention"):
            call = f"{self.const(getattr(lib, name), 'nk')}({rest}"
        if fn in ("hf_gemv_q8a", "hf_gemm_q8a"):  # -1: no scratch for the quantized rows (raises)
            call = f"{self.const(native.check_rc, 'f')}({call}, {fn!r})"
        elif fn in ("hf_gemv_q4a", "hf_gemm_q4a"):  # -1: no scratch, -2: shape (raises)
            call = f"{self.const(native.check_q4_rc, 'f')}({call}, {fn!r})"
        elif fn in ("hf_gemm_few", "hf_gemm_few_kn", "hf_gated_mlp_few"):  # -2: more rows than it takes (raises)
            call = f"{self.const(native.check_few_rc, 'f')}({call}, {fn!r})"
        self.stats.native_ops += 1
        if res is not None:
            buf = self.buffer(into)
            return call.format(y=self.g[buf].data_ptr()) + f"; r{into} = {buf}" + post
        if self.planned(o):
            buf = self.buffer(o)
            return call.format(y=self.g[buf].data_ptr()) + f"; r{o} = {buf}" + post
        fresh = self.const(torch.empty, "f")
        return f"r{o} = {fresh}({tuple(vo.shape)}, dtype={self.const(vo.dtype, 'dt')}); " + \
            call.format(y=f"r{o}.data_ptr()") + post

    def native_ewise(self, ins, o: int) -> str | None:
        """An add or mul of two same-shape dense rows (fp32 or bf16) in the arena or weights, into its slice, as one
        ``hf_ewise`` call with its pointers baked in (bit-equal to ATen's): a decode step's residual adds and gated
        products, which then join the native calls around them in one call list (executor.calllist). None where it
        does not fit (broadcasting, alpha, another dtype, a pointer known only per call, more than EWISE_MAX values:
        ATen's threaded kernel is faster there)."""
        lib = native.library()
        v = self.p.values[o]
        if self.mode == "fast" or lib is None or ins.kwargs.get("alpha", 1) != 1 \
                or len(ins.args) != 2 or v.dtype not in (torch.float32, torch.bfloat16) or not v.is_contiguous \
                or math.prod(v.shape) > EWISE_MAX or self.dm[ins.device].type != "cpu":
            return None
        ptrs = []
        for a in ins.args:
            t = self.static_tensor(a.id, self.dm[ins.device]) if isinstance(a, Reg) else None
            if t is None or tuple(t.shape) != v.shape or t.dtype != v.dtype or not t.is_contiguous():
                return None
            ptrs.append(t.data_ptr())
        buf = self.buffer(o)
        self.bound.add(o)
        self.stats.out_variant += 1  # its recorded kernel stays out-variant: the result written into its slice
        self.stats.native_ewise += 1
        fn = self.const(lib.hf_ewise, "nk")
        return (f"{fn}({ptrs[0]}, {ptrs[1]}, {self.g[buf].data_ptr()}, {math.prod(v.shape)}, "
                f"{native.EWISE_OPS[ins.op]}, {int(v.dtype == torch.bfloat16)}); r{o} = {buf}")

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

    def on_team(self) -> bool:
        """Whether this program's products of two rows or more run here (oneDNN, ATen and the native multi-row
        kernels all run on torch's OpenMP team). Then its one-row native kernels (an LM head's GEMV after a
        prefill) run on that team too (``hf_pool_team``): the team's threads spin a while after each of its
        regions, and the native pool's helpers woken in that window compete with them for the cores (measured:
        docs/arch/runtime.md, native kernels). A program of one-row products only (a decode step) keeps the
        pool, whose claims let a descheduled thread stall nobody."""
        for ins in self.p.instrs:
            if ins.op in _PRODUCT_OPS and len(ins.outputs) == 1 \
                    and self.dm[ins.device].type == "cpu":
                shape = self.p.values[ins.outputs[0]].shape
                if shape and math.prod(shape) // max(shape[-1], 1) >= 2:
                    return True
        return False

    def build(self, profile: bool, again: int = 0, again_ops: frozenset[str] = frozenset()) -> str:
        p = self.p
        self.need_views = self.needed_views()
        composed = self.composed_reads()  # a composed view reads its root, not its inputs (some never made)
        reads = {ins.id: composed[ins.id] if ins.id in composed else ins.input_regs() for ins in p.instrs}
        last_use: dict[int, int] = {}
        for k, ins in enumerate(p.instrs):
            for r in reads[ins.id]:
                last_use[r] = k
        keep = set(p.output_regs())
        params = ", ".join(f"r{v}" for v in p.inputs)
        body: list[str] = []
        sync = any(d.type == "cuda" for d in self.dm.values())
        if profile:
            body.append("_t = _pc()")
        for k, ins in enumerate(p.instrs):
            lines = self.emit(ins)
            body.extend(lines)
            if profile:
                if sync:
                    body.append("_sync()")
                body.append(f"_T[{k}] += _pc() - _t; _t = _pc()")
                # the same code again: the call hot; not for a panel group's later members, whose code only picks
                # its part of the group's result (which the first member computed; the last releases it)
                rerun = ins.op in again_ops and self.panel_group_of.get(ins.id, (None, 0))[1] == 0
                for _ in range(again if rerun else 0):
                    body.extend(lines)
                    if sync:
                        body.append("_sync()")
                    body.append(f"_H[{k}] = min(_H[{k}], _pc() - _t); _t = _pc()")
            dead = [r for r in reads[ins.id] if last_use.get(r) == k and r not in keep
                    and p.values[r].kind != WEIGHT]
            dead += [o for o in ins.outputs if o not in last_use and o not in keep]
            dead = [r for r in dead if not self.never_made(r)]
            if dead:
                body.append(f"{' = '.join(f'r{r}' for r in dead)} = None")
        if not profile and os.environ.get(CALL_LISTS_ENV, "1") != "0":  # profiling times each call on its own
            body, self.stats.call_lists, self.stats.listed_calls = batch_native_calls(body, self.g)
        if self.pinned:  # the code reads the pinned inputs' baked-in pointers: other tensors run the other code
            names = {r: self.const(t, "pin") for r, t in self.pinned.items()}
            other = self.const(self.unpinned, "unp")
            body.insert(0, f"if {' or '.join(f'r{r} is not {n}' for r, n in names.items())}: return {other}({params})")
        ret = []
        for o in p.outputs:
            ret.append(self.expr(o, self.dm[p.devices[0]]) if isinstance(o, Reg) else repr(o))
        body.append(f"return ({''.join(r + ', ' for r in ret)})")
        team = getattr(native.library(), "hf_pool_team", None)  # absent from an older native.c (a bench baseline)
        if team is not None and any(str(kn).startswith("native:") for kn in self.kernels.values()):
            name = self.const(team, "f")
            if self.on_team():  # on for this run only, also when it raises: later direct calls use the pool
                body = [f"{name}(1)", "try:", *("    " + ln for ln in body), "finally:", f"    {name}(0)"]
            else:
                body.insert(0, f"{name}(0)")
        return f"def run({params}):\n" + "\n".join("    " + ln for ln in body) + "\n"


class _Unpinned:
    """A pinned program's code without its pinned inputs, made on first need: what runs when a call passes other
    tensors there (a batch-of-one cache of a verify pass, a caller with its own cache)."""

    def __init__(self, make):
        self.make, self.fn = make, None

    def __call__(self, *inputs: torch.Tensor) -> tuple[Any, ...]:
        if self.fn is None:
            self.fn = self.make()
        return self.fn(*inputs)


class Executable:
    """A compiled program bound to arenas and weights; call it like the captured graph module."""

    def __init__(self, program: Program, plan: MemoryPlan, device_map: dict[str, torch.device] | None = None,
                 mode: str = "arena", soc=None, reuse_outputs: bool = False,
                 pinned: dict[int, torch.Tensor] | None = None):
        """``reuse_outputs``: the outputs live in this program's own memory, which its next call overwrites (a decode
        step's caller copies the K/V rows out and samples before the next step): no fresh tensor per output and
        call, and their pointers are known when the code is made. ``pinned``: input position → the tensor every
        call passes there (a decode step's KV cache buffers): its pointer is baked in like an arena slice's; a call
        given other tensors there runs code made without them (on first need)."""
        if mode not in MODES:
            raise UsageError(f"unknown executor mode '{mode}'; allowed: {', '.join(MODES)}")
        keep_freed_memory()  # fresh outputs reuse freed heap pages (hetforge.executor.allocator)
        self.device_map = dict(device_map or default_device_map(program, soc))
        missing = [d for d in program.devices if d not in self.device_map]
        if missing:
            raise UsageError(f"device map lacks {', '.join(missing)}")
        self.reuse_outputs = reuse_outputs
        self.pinned = dict(pinned or {})
        for pos, t in self.pinned.items():
            v = program.values[program.inputs[pos]] if 0 <= pos < len(program.inputs) else None
            if v is None or not isinstance(t, torch.Tensor) or not v.laid_out_as(t) \
                    or t.device != self.device_map[v.device]:
                raise UsageError(f"pinned input {pos} does not match the program's input "
                                 f"{'(none)' if v is None else repr(v.name)}")
        unpinned = _Unpinned(lambda: Executable(program, plan, self.device_map, mode, soc, reuse_outputs).run_flat) \
            if self.pinned else None
        # what the code runs on: the plan, plus the outputs' own slices when they are reused (self.plan stays the
        # plan as made: what the compile cache stores and checks)
        run_plan = with_output_slices(program, plan) if reuse_outputs else plan
        # the kernels recorded by lowering (hetforge.ir.kernel_choice); chosen again, on a copy, when they
        # were chosen for another host, device map, mode or set of planned values
        program = with_kernels(program, run_plan.offsets, self.device_map, mode)
        self.program, self.plan, self.run_plan, self.mode = program, plan, run_plan, mode
        self.arenas = {d: torch.empty(run_plan.devices[d].arena_bytes if d in run_plan.devices else 0,
                                      dtype=torch.uint8, device=self.device_map[d]) for d in program.devices}
        self._unpinned = unpinned
        cg = _Codegen(program, run_plan, self.device_map, mode, self.arenas, self.pinned, unpinned)
        self.source = cg.build(profile=False)
        self.stats = cg.stats
        self.kernels = cg.kernels  # instruction id → the kernel its code runs (oneDNN candidates decided)
        self._fn = self._compile(self.source, cg.g, "run")
        self._globals = cg.g
        self._profile_fn = None
        self._profile_key: tuple = (0, frozenset())
        self._inputs = [program.values[v] for v in program.inputs]
        spec = program.attrs.get("out_spec")
        self._out_spec = torch.utils._pytree.treespec_loads(spec) if spec else None

    @staticmethod
    def _compile(src: str, g: dict[str, Any], name: str):
        code = compile(src, f"<hetforge-program:{name}>", "exec")
        ns: dict[str, Any] = {}
        exec(code, g, ns)
        return ns["run"]

    def prepack(self) -> int:
        """Pack every weight of the program into its GEMM kernel's layout (the panel GEMM's, oneDNN's, MKL's:
        :class:`LazyPacked`) now instead of in its first call, and the weights ops pack for themselves
        (:data:`hetforge.ir.kernel_choice.PREPACK`: a prefill's MoE experts; ``PREPACK_ALL``: all of an op's calls
        at once, on every thread: w8a8's FBGEMM packings); returns how many were packed. It writes only the new
        packed copies, no arena or weight page."""
        from hetforge.kernels.onednn import LazyPacked, packing

        lazy = [v for v in self._globals.values() if isinstance(v, LazyPacked) and v.packed is None]
        own = 0
        every: dict[str, list[tuple[tuple, dict]]] = {}
        with packing():
            for v in lazy:
                v.get()
            for ins in self.program.instrs:
                if self.device_map[ins.device].type != "cpu":
                    continue
                fn = PREPACK.get(ins.op)
                if fn is not None:
                    own += fn(ins.args, ins.kwargs, self._arg_tensor)
                if ins.op in PREPACK_ALL:
                    every.setdefault(ins.op, []).append((ins.args, ins.kwargs))
            for op, calls in every.items():
                own += PREPACK_ALL[op](calls, self._arg_tensor, torch.get_num_threads())
        return len(lazy) + own

    def _arg_tensor(self, a: Any) -> torch.Tensor | None:
        """An instruction's argument for a :data:`hetforge.ir.kernel_choice.PREPACK` function: a weight's tensor, a
        meta stand-in of another register (its shape and dtype), None for anything else."""
        if not isinstance(a, Reg):
            return None
        v = self.program.values[a.id]
        if v.kind == WEIGHT:
            return self.program.tensors.get(a.id)
        return torch.empty(v.shape, dtype=v.dtype, device="meta")

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
                clock: Any = time.perf_counter, again: int = 0,
                again_ops: Collection[str] = ()) -> ProfileReport:
        """Run ``repeat`` times with a timer around every instruction (measured; synchronizes CUDA).

        ``clock`` times the instructions: wall time by default, or e.g. ``time.thread_time`` (the calling
        thread's CPU time, which leaves out time the thread spent preempted). The total is always wall time.
        ``again`` > 0 runs each instruction whose op is in ``again_ops`` that many more times right after its own
        run and reports the best of those as its ``hot_seconds``: the same call with its inputs and weights in
        cache, as a kernel timed alone would be (the program's own time, ``seconds``, is the first run's). The
        repeats recompute the same outputs, so they suit ops that only write their results (the products);
        the total then includes them. A panel group's later members (whose code only picks a part of the
        group's result, which the first member computed) are not repeated: their ``hot_seconds`` stay None."""
        self.check_inputs(inputs)
        n = len(self.program.instrs)
        key = (again, frozenset(again_ops) if again > 0 else frozenset())
        if self._profile_fn is None or self._profile_key != key:
            cg = _Codegen(self.program, self.run_plan, self.device_map, self.mode, self.arenas, self.pinned,
                          self._unpinned)
            src = cg.build(profile=True, again=key[0], again_ops=key[1])
            cg.g.update({"_pc": time.perf_counter, "_sync": torch.cuda.synchronize if torch.cuda.is_available()
                         else (lambda: None), "_T": [0.0] * n, "_H": [math.inf] * n})
            self._profile_fn = self._compile(src, cg.g, "profile")
            self._profile_globals, self._profile_key = cg.g, key
        self._profile_globals["_pc"] = clock
        times, hot = self._profile_globals["_T"], self._profile_globals["_H"]
        with torch.no_grad():
            for _ in range(warmup):
                self._profile_fn(*inputs)
            for k in range(n):
                times[k], hot[k] = 0.0, math.inf
            t0 = time.perf_counter()
            for _ in range(repeat):
                self._profile_fn(*inputs)
            total = (time.perf_counter() - t0) / repeat
        return ProfileReport([InstrTime(ins.id, ins.op, ins.device, ins.kind, times[k] / repeat,
                                        None if math.isinf(hot[k]) else hot[k])
                              for k, ins in enumerate(self.program.instrs)], total, repeat)

    def arena_bytes(self) -> dict[str, int]:
        return {d: int(a.numel()) for d, a in self.arenas.items()}
