"""Cost of one IR instruction as the arena executor runs it (the unit ``Executable.profile`` measures).

An instruction is its op (:func:`hetforge.cost.estimate` on the shapes of its registers) plus what the
arena executor (``hetforge.executor``, mode ``arena``) does around it to put the result in its planned
arena slice (:func:`hetforge.ir.kernel_choice.write_mode`):

* ``out``: the op writes the slice itself (a GEMM on 2-D views, an ATen ``out=`` overload, or a copy-like
  op done as ``slice.copy_(input)``) — the op's cost only;
* ``copy``: the functional op runs, then ``slice.copy_(result)`` — the op's cost plus one
  ``aten.copy_.default`` of every planned output (``F = n``, ``B = 2·bytes(out)``, the ``aten.copy_.default``
  key fitted by calibration on a hot source and a cold slice);
* ``view-copy``: a view op that lowering gave fresh storage (its input's storage was not recognised) —
  a copy of the output (as ``copy`` but with no op cost besides one dispatch);
* ``fresh``: the result is not planned (a graph output) — the op's cost only;
* ``view``/``inplace``: the op's cost (a view costs one dispatch and its fitted overhead);
* ``elided``: a view that returns its input unchanged (same shape, strides, offset and dtype, an op of the
  executor's ``IDENTITY_VIEW_OPS``): the executor binds the register without a call — free.

Two modes depend on what the executor could prove while generating code, so it records them
(``Executable.write_modes``) and :func:`estimate_program` takes them as ``modes``:

* ``static``: a view of an arena slice or a weight, made once at build time — free at run time;
* ``native``: a ``hetforge::`` op run as one native kernel (``hetforge.kernels.native``) writing its slice —
  one roofline under the calibrated ``native`` efficiency and overhead (:func:`hetforge.cost.estimate_parts`);
* ``onednn``: a multi-row product run on oneDNN's packed kernel (``hetforge.executor.onednn``), bias and
  activation fused in, its result bound to the register (no copy) — one roofline over the op's F and B under
  its ordinary keys (``estimate_parts(..., fused=True)``), not the ATen parts of a ``hetforge::`` op.

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
from hetforge.ir.kernel_choice import write_mode  # noqa: F401  (re-exported: hetforge.cost.write_mode)
from hetforge.ir.program import KERNEL, TRANSFER, Instr, Program, Reg, map_regs
from hetforge.ops.registry import OpCall, TensorMeta

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


ATEN_PRODUCTS = ("aten.linear.default", "aten.addmm.default", "aten.mm.default")
PERMUTING_VIEWS = ("aten.transpose.int", "aten.permute.default", "aten.t.default", "aten.swapaxes.default")


def _copy_cost(out: TensorMeta, device: DeviceProfile, strided: bool = False) -> OpCost:
    """One ``slice.copy_(x)`` of ``out``; ``strided``: ``x`` is a permuted view (a transpose), whose copy reads
    with strides (key ``aten.copy_.default:strided``, calibrated on a transposed head-major tensor)."""
    first = (f"{COPY_OP}:strided",) if strided else ()
    return estimate_parts(OpCall(COPY_OP, (out,), {}, (out,)), device, first_keys=first)[0][1]


def _kernel_keys(call: OpCall, device: DeviceProfile, mode: str | None, recorded: bool) -> tuple[str, ...]:
    """Keys of the kernel the executor ran, when its recorded modes say: a multi-row product it did not run on
    oneDNN (``recorded`` and no ``onednn`` mode) ran on ATen's ``linear``/``addmm`` — ``aten:matmul:<row
    band>``, ``aten:matmul`` (calibration times both kernels; the plain ``matmul`` keys are fitted on the one
    the executor picks for each calibrated shape)."""
    if not recorded or mode == "onednn" or device.kind != "cpu" or call.op not in ATEN_PRODUCTS or not call.outputs:
        return ()
    out = call.outputs[0]
    rows = out.numel // max(1, out.shape[-1]) if out.shape else 1
    return (f"aten:matmul:{row_band(rows)}", "aten:matmul") if rows > 1 else ()


def _seq(ins: Instr, program: Program, device: DeviceProfile, planned, hot_bytes: float,
         soc, modes: dict[int, str] | None = None) -> tuple[OpCost, list[tuple[str, OpCost]]]:
    """The instruction's reported cost (F, B, class, group) and the ops it runs, in order (op, cost)."""
    if ins.kind == TRANSFER:
        from hetforge.cost.transfer import transfer_cost

        nbytes = int(ins.attrs.get("bytes", 0))
        t, e = (0.0, 0.0) if soc is None else transfer_cost(nbytes, soc.link(ins.attrs["src"], ins.attrs["dst"]))
        c = OpCost(ins.op, device.name, 0.0, float(nbytes), 0.0, "memory", t, e, 0.0, "memory", True, "transfer")
        return c, [(ins.op, c)]
    call = op_call_from_instr(ins, program)
    first = _kernel_keys(call, device, (modes or {}).get(ins.id), modes is not None)
    mode = (modes or {}).get(ins.id) or write_mode(ins, program, planned)
    if mode in ("native", "onednn"):
        parts = estimate_parts(call, device, hot_bytes=hot_bytes, native=mode == "native", fused=mode == "onednn")
        return parts[0][1], parts
    if mode in ("elided", "static"):
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
    head, seq = _seq(ins, program, device, planned, 0.0, soc)
    return _total(head, [c for _, c in seq])


def estimate_program(program: Program, soc, planned: set[int] | dict[int, Any],
                     modes: dict[int, str] | None = None) -> list[OpCost]:
    """Modeled cost of every instruction of ``program`` in order, each on its device of ``soc``, with the
    cache context of the instructions before it on that device (:mod:`hetforge.cost.context`): inputs touched
    recently are cache-hot, and fixed costs grow after code was evicted. The program is walked twice and the
    second pass is returned: a steady-state run, whose first instructions follow the previous run's last ones
    (as when a model is called again, and as ``Executable.profile`` measures after its warm-up run).
    ``modes``: the executor's recorded write modes (``Executable.write_modes``), which override
    :func:`write_mode` where given."""
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
            head, seq = _seq(ins, program, device, planned, hot, soc, modes)
            out.append(_total(head, [ctx.run(op, c) for op, c in seq]))
            ctx.touch(list(ins_roots) + [program.root(o) for o in ins.outputs], moved=out[-1].bytes > 0)
        if not any(c.active for c in ctxs.values()):
            break
    return out
