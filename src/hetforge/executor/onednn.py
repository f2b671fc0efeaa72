"""The executor's use of oneDNN's prepacked linear (:mod:`hetforge.kernels.onednn`): the measured choice for a
candidate that kernel lowering recorded (:mod:`hetforge.ir.kernel_choice`, ``attrs["onednn"]``), and the
generated line."""

from __future__ import annotations

import torch

from hetforge.ir.kernel_choice import ONEDNN_ATTR, onednn_operands
from hetforge.kernels.onednn import ACT_ATTR, LazyPacked, choose


def chosen(cg, ins) -> bool:
    """Whether the candidate ``ins`` runs on oneDNN: measured (:func:`hetforge.kernels.onednn.choose`, once per
    shape and process) when the executable is built. ``cg``: the executor's code generator."""
    rows, k, n = ins.attrs[ONEDNN_ATTR]
    x, w, _, wt, act, _ = onednn_operands(ins)
    dev = cg.dm[ins.device]
    return choose(rows, k, n, cg.p.values[x.id].dtype, cg.g[cg.weight(w.id, dev)], wt, act)


def codegen_line(cg, ins, o: int, dev: torch.device) -> str:
    """The executor's line for an instruction lowering made a oneDNN candidate and :func:`chosen` took.

    The result is oneDNN's fresh tensor, bound to the register (no copy into the arena slice: its slice stays
    unused). ``cg`` is the executor's code generator (:class:`hetforge.executor.runtime._Codegen`)."""
    rows = ins.attrs[ONEDNN_ATTR][0]
    x, w, b, wt, act, gate = onednn_operands(ins)

    def weight(a) -> torch.Tensor:
        return cg.g[cg.weight(a.id, dev)]

    def bias(a) -> str:
        return "None" if a is None else cg.const(weight(a), "bias")

    xs, bs, wten = f"r{x.id}", bias(b), weight(w)
    call = cg.const(torch.ops.mkldnn._linear_pointwise.default, "dnn")
    attr, sc, algo = ACT_ATTR[act]
    if gate is None:
        pk = cg.const(LazyPacked(wten, wt, rows), "pk") + ".get()"
        line = f"r{o} = {call}({xs}, {pk}, {bs}, {attr!r}, {sc!r}, {algo!r})"
    else:  # gated MLP: act(x·Wgᵀ+bg) as one call, times (x·Wuᵀ+bu) fused into the up GEMM, then down
        wg, bg, wd, bd = gate
        binary = cg.const(torch.ops.mkldnn._linear_pointwise.binary, "dnn")
        pg = cg.const(LazyPacked(weight(wg), False, rows), "pk") + ".get()"
        pu = cg.const(LazyPacked(wten, False, rows), "pk") + ".get()"
        h = f"{binary}({xs}, {call}({xs}, {pg}, {bias(bg)}, {attr!r}, {sc!r}, {algo!r}), {pu}, {bs}, 'mul')"
        if wd is None:
            line = f"r{o} = {h}"
        else:
            pd = cg.const(LazyPacked(weight(wd), False, rows), "pk") + ".get()"
            line = f"r{o} = {call}({h}, {pd}, {bias(bd)}, 'none', [], '')"
    cg.stats.onednn_gemm += 1
    return line
