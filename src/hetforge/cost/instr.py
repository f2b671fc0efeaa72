"""Cost of one IR instruction as the arena executor runs it (the unit ``Executable.profile`` measures).

An instruction is its op (:func:`hetforge.cost.estimate` on the shapes of its registers) plus what the
arena executor does around it to put the result in its planned arena slice. The cost model does not decide
that: it reads the kernel that lowering recorded on the instruction (``attrs["kernel"]``, see
:mod:`hetforge.ir.kernel_choice`; oneDNN candidates resolved by the choice measured in this process,
:func:`hetforge.ir.kernel_choice.resolved_kernels`) and prices it (:func:`cost_mode`):

* ``native:<fn>`` of a ``hetforge::`` row op: one native kernel writing its slice — one roofline under the
  calibrated ``native`` efficiency and overhead (:func:`hetforge.cost.estimate_parts`); the bf16 kernels
  (``native:<fn>_bf16``, and ``native:hf_gemv_bf16`` of a ``linear_act``) the same way, over bf16 bytes; the
  several-row int8 GEMMs ``native:hf_gemm_q8a`` (w8 prefill) and ``native:hf_gemm_q4a`` (w4 prefill) look up their
  own key first (a compute-bound kernel at the int8 rate, not a GEMV's streaming efficiency) and fall back to the
  op's native keys;
* ``elided`` (a view that returns its input) and ``static-view`` (made once at build time): free;
* views and in-place ops: the op's cost (a view costs one dispatch and its fitted overhead);
* an unplanned result (``fresh``: a graph output), ``onednn``, and every kernel that writes the slice itself
  (``gemm-out``, ``split-gemv``, the native GEMVs — fp32, and ``native:hf_gemv_bf16`` of a
  ``linear``/``addmm``/``mm`` —, ``copy-into``, ``out-variant``; ``unplanned`` in mode
  ``fast``): the op's cost only;
* ``functional-copy``: the functional op, then ``slice.copy_(result)`` — the op's cost plus one
  ``aten.copy_.default`` of every planned output (``F = n``, ``B = 2·bytes(out)``, the ``aten.copy_.default``
  key fitted by calibration on a hot source and a cold slice);
* a view op that lowering gave fresh storage (its input's storage was not recognised): a copy of the output
  (no op cost besides one dispatch).
* ``onednn`` (a multi-row product the executor measured faster on oneDNN's packed kernel,
  ``hetforge.executor.onednn``; bias, activation and a gated MLP's product fused in, the result bound to its
  register): one roofline over the op's F and B under its ordinary keys (``estimate_parts(..., fused=True)``),
  not the GEMM, activation and copy of the Python implementation;
* a multi-row ``linear``/``addmm``/``mm`` whose kernel is known not to be oneDNN (not a candidate, or a candidate
  measured slower in this process) ran on ATen's kernel: its ``aten:matmul:<row band>`` / ``aten:matmul`` keys
  first (calibration times every multi-row shape on ATen too); a candidate not measured yet gets the plain
  ``matmul`` keys, fitted on the kernel the executor picks for each calibrated shape;
* a ``view-copy`` of a permuting view (``transpose``, ``permute``, ``t``) reads its source with strides: the
  ``aten.copy_.default:strided`` key first.

Transfers cost :func:`hetforge.cost.transfer_cost` over the SoC's link (0 on one device).
:func:`estimate_instr` costs one instruction on its own; :func:`estimate_program` costs a whole program in
order, with the cache context of :mod:`hetforge.cost.context` (hot inputs, cold code after big streams).
The op itself is costed from its registers' shapes and dtypes (:class:`OpCall`), the same formulas as for
the FX node it came from.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hetforge.cost.context import CacheContext
from hetforge.cost.model import OpCost, estimate_parts
from hetforge.hardware.profile import DeviceProfile, row_band
from hetforge.ir.kernel_choice import (
    ATEN_PRODUCTS,
    NATIVE_GEMV,
    NATIVE_GEMV_BF16,
    PERMUTING_VIEWS,
    onednn_known,
    program_kernels,
)
from hetforge.ir.program import INPLACE, KERNEL, TRANSFER, VIEW, Instr, Program, Reg, map_regs
from hetforge.ops.registry import OpCall, TensorMeta, lookup

COPY_OP = "aten.copy_.default"


def op_call_from_instr(ins: Instr, program: Program) -> OpCall:
    """The :class:`OpCall` of an instruction: registers replaced by their shape and dtype."""

    def meta(r: Reg) -> TensorMeta:
        v = program.values[r.id]
        return TensorMeta(tuple(v.shape), v.dtype)

    args = map_regs(ins.args, meta)
    kwargs = map_regs(ins.kwargs, meta)
    outs = tuple(TensorMeta(tuple(program.values[o].shape), program.values[o].dtype) for o in ins.outputs)
    return OpCall(ins.op, tuple(args), dict(kwargs), outs)




def _copy_cost(out: TensorMeta, device: DeviceProfile, strided: bool = False) -> OpCost:
    """One ``slice.copy_(x)`` of ``out``; ``strided``: ``x`` is a permuted view (a transpose), whose copy reads
    with strides (key ``aten.copy_.default:strided``, calibrated on a transposed head-major tensor)."""
    first = (f"{COPY_OP}:strided",) if strided else ()
    return estimate_parts(OpCall(COPY_OP, (out,), {}, (out,)), device, first_keys=first)[0][1]


def _kernel_keys(call: OpCall, device: DeviceProfile, mode: str | None, recorded: bool) -> tuple[str, ...]:
    """Keys of the kernel the executor runs, when it is known (``recorded``): a multi-row product not run on
    oneDNN (``mode`` other than ``onednn``) runs on ATen's ``linear``/``addmm`` — ``aten:matmul:<row band>``,
    ``aten:matmul`` (calibration times both kernels; the plain ``matmul`` keys are fitted on the one the executor
    picks for each calibrated shape)."""
    if not recorded or mode == "onednn" or device.kind != "cpu" or call.op not in ATEN_PRODUCTS or not call.outputs:
        return ()
    out = call.outputs[0]
    rows = out.numel // max(1, out.shape[-1]) if out.shape else 1
    return (f"aten:matmul:{row_band(rows)}", "aten:matmul") if rows > 1 else ()


def cost_mode(ins: Instr, planned, kernel: str) -> str:
    """How the recorded ``kernel`` of ``ins`` is priced: ``native``, ``free``, ``view``, ``inplace``,
    ``transfer``, ``fresh``, ``view-copy``, ``copy`` or ``out`` (see the module docstring)."""
    if kernel.startswith("native:") and kernel not in NATIVE_GEMV \
            and not (kernel == NATIVE_GEMV_BF16 and ins.op in ATEN_PRODUCTS):
        return "native"
    if kernel in ("elided", "static-view"):
        return "free"
    if ins.kind in (VIEW, INPLACE, TRANSFER):
        return ins.kind
    if kernel == "onednn" or not any(o in planned for o in ins.outputs):
        return "fresh"
    info = lookup(ins.op)
    if info is not None and info.is_view:
        return "view-copy"
    return "copy" if kernel == "functional-copy" else "out"


def _seq(ins: Instr, program: Program, device: DeviceProfile, planned, hot_bytes: float,
         soc, kernel: str) -> tuple[OpCost, list[tuple[str, OpCost]]]:
    """The instruction's reported cost (F, B, class, group) and the ops it runs, in order (op, cost)."""
    if ins.kind == TRANSFER:
        from hetforge.cost.transfer import transfer_cost

        nbytes = int(ins.attrs.get("bytes", 0))
        t, e = (0.0, 0.0) if soc is None else transfer_cost(nbytes, soc.link(ins.attrs["src"], ins.attrs["dst"]))
        c = OpCost(ins.op, device.name, 0.0, float(nbytes), 0.0, "memory", t, e, 0.0, "memory", True, "transfer")
        return c, [(ins.op, c)]
    call = op_call_from_instr(ins, program)
    mode = cost_mode(ins, planned, kernel)
    first = _kernel_keys(call, device, kernel, onednn_known(ins, program))
    if mode == "native" or kernel == "onednn":
        parts = estimate_parts(call, device, hot_bytes=hot_bytes, native=mode == "native", fused=kernel == "onednn",
                               first_keys=(kernel,) if kernel in ("native:hf_gemm_q8a", "native:hf_gemm_q4a") else ())
        return parts[0][1], parts
    if mode == "free":
        c = OpCost(ins.op, device.name, 0.0, 0.0, 0.0, "memory", 0.0, 0.0, 0.0, "dispatch", True, "view")
        return c, [(ins.op, c)]
    if mode == "view-copy":
        c = replace(_copy_cost(call.outputs[0], device, ins.op in PERMUTING_VIEWS), op=ins.op, group="movement")
        return c, [(COPY_OP, c)]
    parts = estimate_parts(call, device, hot_bytes=hot_bytes, first_keys=first)
    head, seq = (parts[0][1], parts) if len(parts) == 1 else (parts[0][1], parts[1:])
    if mode == "copy" and ins.kind == KERNEL:
        seq = seq + [(COPY_OP, _copy_cost(m, device)) for o, m in zip(ins.outputs, call.outputs, strict=True)
                     if o in planned]
    return head, seq


def _total(head: OpCost, done: list[OpCost]) -> OpCost:
    if len(done) == 1 and done[0] is head:
        return head
    main = max(done, key=lambda c: c.time_s)
    return replace(head, time_s=sum(c.time_s for c in done), energy_j=sum(c.energy_j for c in done),
                   bound=main.bound, fixed_s=sum(c.fixed_s for c in done))


def estimate_instr(ins: Instr, program: Program, device: DeviceProfile, planned: set[int] | dict[int, Any],
                   soc=None) -> OpCost:
    """Modeled time and energy of ``ins`` on ``device`` as the arena executor runs it, on its own (no cache
    context: see :func:`estimate_program`)."""
    head, seq = _seq(ins, program, device, planned, 0.0, soc, program_kernels(program, planned)[ins.id])
    return _total(head, [c for _, c in seq])


def estimate_program(program: Program, soc, planned: set[int] | dict[int, Any]) -> list[OpCost]:
    """Modeled cost of every instruction of ``program`` in order, each on its device of ``soc``, with the
    cache context of the instructions before it on that device (:mod:`hetforge.cost.context`): inputs touched
    recently are cache-hot, and fixed costs grow after code was evicted. The program is walked twice and the
    second pass is returned: a steady-state run, whose first instructions follow the previous run's last ones
    (as when a model is called again, and as ``Executable.profile`` measures after its warm-up run).
    Each instruction is priced by its recorded kernel (:func:`cost_mode`)."""
    kernels = program_kernels(program, planned)
    ctxs: dict[str, CacheContext] = {}
    out: list[OpCost] = []
    for _ in range(2):
        out = []
        for ins in program.instrs:
            device = soc.device(ins.device)
            ctx = ctxs.setdefault(ins.device, CacheContext(device))
            ins_roots: dict[int, int] = {}
            for r in ins.input_regs():
                ins_roots.setdefault(program.root(r), r)
            hot = 0.0
            if ctx.active:
                for root, r in ins_roots.items():
                    if ctx.hot(root):
                        v = program.values[r]
                        hot += v.numel * v.itemsize
            head, seq = _seq(ins, program, device, planned, hot, soc, kernels[ins.id])
            out.append(_total(head, [ctx.run(op, c) for op, c in seq]))
            ctx.touch(list(ins_roots) + [program.root(o) for o in ins.outputs], moved=out[-1].bytes > 0)
        if not any(c.active for c in ctxs.values()):
            break
    return out
