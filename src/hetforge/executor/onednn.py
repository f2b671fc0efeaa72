"""The executor's use of oneDNN's prepacked linear (:mod:`hetforge.kernels.onednn`): which instructions run
on it, and the generated line."""

from __future__ import annotations

import math

import torch

from hetforge.kernels.onednn import ACT_ATTR, DTYPES, LazyPacked, choose

GEMM_OPS = ("aten.linear.default", "aten.addmm.default", "aten.mm.default", "hetforge.linear_act.default",
            "hetforge.gated_mlp.default")


def codegen_line(cg, ins, o: int, dev: torch.device) -> str | None:
    """The executor's line for a multi-row linear-type instruction on the packed oneDNN kernel, or None.

    ``cg`` is the executor's code generator (:class:`hetforge.executor.runtime._Codegen`). Applies to
    ``aten.linear`` / ``addmm`` / ``mm`` and ``hetforge::linear_act`` / ``gated_mlp`` with weights that are
    program weights, a contiguous fp32/bf16 input of at least two rows on this CPU, where :func:`choose`
    measured oneDNN faster. The result is oneDNN's fresh tensor, bound to the register (no copy into the
    arena slice: its slice stays unused)."""
    from hetforge.ir.kernel_choice import bind_args
    from hetforge.ir.program import WEIGHT, Reg

    if dev.type != "cpu" or ins.op not in GEMM_OPS or ins.kwargs and not ins.op.startswith("hetforge."):
        return None
    p = cg.p

    def weight(a) -> torch.Tensor | None:
        if isinstance(a, Reg) and p.values[a.id].kind == WEIGHT:
            return cg.g[cg.weight(a.id, dev)]
        return None

    def bias(a) -> str | None:
        if a is None:
            return "None"
        t = weight(a)
        if t is not None and t.dim() == 1 and t.is_contiguous():
            return cg.const(t, "bias")
        return None

    if ins.op == "aten.linear.default":
        x, w, b, wt, act = ins.args[0], ins.args[1], (ins.args[2] if len(ins.args) > 2 else None), False, "none"
        gate = None
    elif ins.op == "aten.addmm.default":
        if len(ins.args) != 3:
            return None
        b, x, w, wt, act, gate = ins.args[0], ins.args[1], ins.args[2], True, "none", None
    elif ins.op == "aten.mm.default":
        x, w, b, wt, act, gate = ins.args[0], ins.args[1], None, True, "none", None
    else:
        args = bind_args(ins)
        if args is None:
            return None
        x = args["x"]
        if ins.op == "hetforge.linear_act.default":
            w, b, wt, act, gate = args["weight"], args["bias"], bool(args["weight_t"]), args["act"], None
        else:
            w, b, wt, act = args["w_up"], args["b_up"], False, args["act"]
            gate = (args["w_gate"], args["b_gate"], args["w_down"], args["b_down"])
    if act not in ACT_ATTR or not isinstance(x, Reg):
        return None
    vx, vo = p.values[x.id], p.values[o]
    wten = weight(w)
    if wten is None or wten.dim() != 2 or not vx.is_contiguous or cg.dm[vx.device] != dev or vx.dtype != vo.dtype \
            or vx.dtype not in DTYPES or wten.dtype != vx.dtype or not vx.shape:
        return None
    k = vx.shape[-1]
    n = wten.shape[1] if wt else wten.shape[0]
    if (wten.shape[0] if wt else wten.shape[1]) != k:
        return None
    rows = math.prod(vx.shape) // k if k else 0
    bs = bias(b)
    if bs is None or not choose(rows, k, n, vx.dtype, wten, wt):
        return None
    xs = f"r{x.id}"
    call = cg.const(torch.ops.mkldnn._linear_pointwise.default, "dnn")
    if gate is None:
        pk = cg.const(LazyPacked(wten, wt, rows), "pk") + ".get()"
        attr, sc, algo = ACT_ATTR[act]
        line = f"r{o} = {call}({xs}, {pk}, {bs}, {attr!r}, {sc!r}, {algo!r})"
    else:  # gated MLP: act(x·Wgᵀ+bg) as one call, times (x·Wuᵀ+bu) fused into the up GEMM, then down
        wg, bg, wd, bd = gate
        wgt, wdt = weight(wg), (weight(wd) if wd is not None else None)
        bgs, bds = bias(bg), bias(bd)
        if wgt is None or tuple(wgt.shape) != tuple(wten.shape) or bgs is None or bds is None \
                or (wd is not None and (wdt is None or wdt.dim() != 2 or wdt.shape[1] != n)):
            return None
        binary = cg.const(torch.ops.mkldnn._linear_pointwise.binary, "dnn")
        attr, sc, algo = ACT_ATTR[act]
        pg = cg.const(LazyPacked(wgt, False, rows), "pk") + ".get()"
        pu = cg.const(LazyPacked(wten, False, rows), "pk") + ".get()"
        h = f"{binary}({xs}, {call}({xs}, {pg}, {bgs}, {attr!r}, {sc!r}, {algo!r}), {pu}, {bs}, 'mul')"
        if wd is None:
            line = f"r{o} = {h}"
        else:
            pd = cg.const(LazyPacked(wdt, False, rows), "pk") + ".get()"
            line = f"r{o} = {call}({h}, {pd}, {bds}, 'none', [], '')"
    cg.stats.onednn_gemm += 1
    cg.modes[ins.id] = "onednn"
    return line
