"""The executor's use of oneDNN's prepacked linear (:mod:`hetforge.kernels.onednn`): the measured choice for a
candidate that kernel lowering recorded (:mod:`hetforge.ir.kernel_choice`, ``attrs["onednn"]``), and the
generated line."""

from __future__ import annotations

import math
import os

import torch

from hetforge.ir.kernel_choice import ONEDNN_ATTR, onednn_operands, plain_add, reshape_view
from hetforge.ir.program import INPLACE, Reg
from hetforge.kernels import native
from hetforge.kernels.onednn import ACT_ATTR, MKL_ACT, LazyPacked, gated_pick, pick, residual_pick


def chosen(cg, ins) -> bool:
    """Whether the candidate ``ins`` runs on a packed kernel rather than ATen's ``linear`` (oneDNN, MKL or a native
    one: :func:`hetforge.kernels.onednn.pick`, measured once per shape and process) when the executable is built;
    for a gated MLP on oneDNN, how its gate and up run is measured here too
    (:func:`hetforge.kernels.onednn.gated_pick`), so that code generation only reads those answers. (Who adds a
    residual after a oneDNN product is measured in :func:`takes_residual`, the one place that knows an add
    follows.) ``cg``: the executor's code generator."""
    rows, k, n = ins.attrs[ONEDNN_ATTR]
    x, w, _, wt, act, gate = onednn_operands(ins)
    dev, dtype = cg.dm[ins.device], cg.p.values[x.id].dtype
    wten = cg.g[cg.weight(w.id, dev)]
    kind = pick(rows, k, n, dtype, wten, wt, act)
    if kind == "onednn" and gate is not None and _panel_gated_allowed():
        gated_pick(rows, k, n, dtype, act, cg.g[cg.weight(gate[0].id, dev)], wten)  # measured here, not in codegen
    return kind != "aten"


def _panel_gated_allowed() -> bool:
    """Whether a gated MLP's gate and up may run as one native gated call (``HETFORGE_PANEL_GATED`` not "0")."""
    return os.environ.get(PANEL_GATED_ENV, "1") != "0"


RESIDUAL_ENV = "HETFORGE_RESIDUAL_FUSION"  # "0": every residual add runs as its own instruction


def takes_residual(cg, g) -> bool:
    """Whether oneDNN's product ``g`` can take the residual add after it as its ``add`` post-op
    (``_linear_pointwise.binary``): a plain product (no activation, or the down product of a gated MLP). fp32: the
    same bits as the add after the product (oneDNN rounds the product, then adds). Where the product runs on
    oneDNN itself (not on a kernel :func:`hetforge.kernels.onednn.pick` chose instead, whose store or in-place add
    takes the residual), only where that was measured faster than the add after it
    (:func:`hetforge.kernels.onednn.residual_pick`)."""
    if cg.kernels.get(g.id) != "onednn":
        return False
    ops = onednn_operands(g)
    if ops is None:
        return False
    x, w, b, wt, act, gate = ops
    if (gate is None and act != "none") or (gate is not None and gate[2] is None):
        return False
    rows, k, n = g.attrs[ONEDNN_ATTR]
    dev, dtype = cg.dm[g.device], cg.p.values[x.id].dtype
    if pick(rows, k, n, dtype, act=act) != "onednn":
        return True
    if gate is not None:  # the residual is the down product's: [rows, F] x [F, N]
        wd = cg.g[cg.weight(gate[2].id, dev)]
        return residual_pick(rows, int(wd.shape[1]), int(wd.shape[0]), dtype, gate[3] is not None, wd) == "onednn"
    wten = cg.g[cg.weight(w.id, dev)]
    return residual_pick(rows, k, n, dtype, b is not None, wten.t() if wt else wten) == "onednn"


def residual_adds(cg, takes, fits=None) -> tuple[dict[int, Reg], dict[int, int]]:
    """Residual adds that the product before them takes: ``y = product(...)`` whose only user is ``add(y, r)``
    (directly or through one reshape to the add's shape) becomes one call writing ``y + r``, and the add binds its
    register to that result. The add's pass over the rows and its call between two products are gone. Only where
    it is the same computation: a product ``takes(g)`` accepts, one output with no other reader, ``r`` contiguous,
    of the add's shape and dtype, on the same device, and ready before the product (made earlier, no in-place
    write in between); ``fits(g, add, r)`` may refuse more (None: nothing more).

    Returns (product instruction id → ``r``, add instruction id → the register the add takes)."""
    p = cg.p
    if os.environ.get(RESIDUAL_ENV, "1") == "0":
        return {}, {}
    pos = {ins.id: i for i, ins in enumerate(p.instrs)}  # program order
    made = {o: pos[ins.id] for ins in p.instrs for o in ins.outputs}
    outs = set(p.output_regs())
    inplace = [i for i, ins in enumerate(p.instrs) if ins.kind == INPLACE]

    def only_user(r: int) -> int | None:
        u = cg.readers.get(r, [])
        return pos[u[0]] if len(u) == 1 and r not in outs else None

    product, fused = {}, {}
    for gi, g in enumerate(p.instrs):
        if len(g.outputs) != 1:
            continue
        y = src = g.outputs[0]
        ai = only_user(y)
        if ai is not None and reshape_view(p.instrs[ai]) and len(p.instrs[ai].outputs) == 1:
            src = p.instrs[ai].outputs[0]  # a reshape keeps the element order (a transpose would not)
            ai = only_user(src)
        if ai is None:
            continue
        add = p.instrs[ai]
        regs = plain_add(add)
        if regs is None or src not in (regs[0].id, regs[1].id):
            continue
        other = regs[1] if regs[0].id == src else regs[0]
        vy, vr, va = p.values[y], p.values[other.id], p.values[add.outputs[0]]
        dev = cg.dm[g.device]
        if not (vr.shape == va.shape == p.values[src].shape and vr.dtype == vy.dtype == va.dtype and vr.is_contiguous
                and math.prod(vy.shape) == math.prod(va.shape)
                and cg.dm[vr.device] == dev == cg.dm[add.device]
                and made.get(other.id, -1) < gi and not any(gi < i < ai for i in inplace)):
            continue
        if (fits is not None and not fits(g, add, other)) or not takes(g):  # takes last: it may measure a choice
            continue
        product[g.id], fused[add.id] = other, src
    return product, fused


PANEL_MULTI_ENV = "HETFORGE_PANEL_MULTI"  # "0": every panel-GEMM product runs as its own call
# "0": a gated MLP's gate and up products run as two panel-GEMM calls, and where oneDNN runs its products as oneDNN's
# two calls (no measured gated_pick)
PANEL_GATED_ENV = "HETFORGE_PANEL_GATED"


def panel_groups(cg) -> dict[int, tuple[int, int, list]]:
    """Products on the native panel GEMM that read the same input register (a layer's q, k and v projections), with
    no activation, gated MLP or residual add of their own, in program order, cut into groups of
    2..:data:`hetforge.kernels.native.PANEL_SEG`: each group runs as one ``gemm_panel_multi`` call where its first
    product stands (X packed once, one fork of the team; every result bit-equal to its own call). Computing the
    later ones early is sound: their input is the same register, their weights and biases constants, their results
    fresh tensors. Not grouped: a group with an in-place instruction between its members. Returns member id →
    (first member's id, its index in the group, the group)."""
    p = cg.p
    if os.environ.get(PANEL_MULTI_ENV, "1") == "0":
        return {}
    pos = {ins.id: i for i, ins in enumerate(p.instrs)}
    inplace = [i for i, ins in enumerate(p.instrs) if ins.kind == INPLACE]
    by_x: dict[tuple[int, object], list] = {}
    for ins in p.instrs:
        if cg.kernels.get(ins.id) != "onednn" or len(ins.outputs) != 1 or ins.id in cg.residual:
            continue
        ops = onednn_operands(ins)
        if ops is None:
            continue
        x, _, _, _, act, gate = ops
        rows, k, n = ins.attrs[ONEDNN_ATTR]
        if act != "none" or gate is not None or not isinstance(x, Reg) \
                or pick(rows, k, n, p.values[x.id].dtype, act=act) != "panel":
            continue
        by_x.setdefault((x.id, cg.dm[ins.device]), []).append(ins)
    groups: dict[int, tuple[int, int, list]] = {}
    for members in by_x.values():
        for i in range(0, len(members), native.PANEL_SEG):
            g = members[i:i + native.PANEL_SEG]
            lo, hi = pos[g[0].id], pos[g[-1].id]
            if len(g) > 1 and not any(lo < j < hi for j in inplace):
                for idx, m in enumerate(g):
                    groups[m.id] = (g[0].id, idx, g)
    return groups


def _panel_group_line(cg, ins, o: int, weight) -> str:
    """The line of a grouped panel-GEMM product (:func:`panel_groups`): at the first member, the one call for the
    whole group (a :class:`hetforge.kernels.native.PanelMulti` made here, its pointer arrays made at its first
    call), its results held in a local tuple; at every member, its result bound from that tuple (dropped after the
    last)."""
    first, idx, group = cg.panel_group_of[ins.id]
    held = f"_pg{first}"
    bind = f"r{o} = {held}[{idx}]" + (f"; {held} = None" if idx == len(group) - 1 else "")
    cg.stats.panel_gemm += 1
    if idx:
        return bind
    rows = ins.attrs[ONEDNN_ATTR][0]
    pks, bs, ns = [], [], []
    for m in group:
        x, w, b, wt, _, _ = onednn_operands(m)
        wten = weight(w)
        lazy = LazyPacked(wten, wt, rows, "panel")
        cg.const(lazy, "pk")  # a global of the program too, so Executable.prepack packs it ahead as every other
        pks.append(lazy.get)
        bs.append(None if b is None else weight(b))
        ns.append(int(wten.shape[1] if wt else wten.shape[0]))
    call = cg.const(native.PanelMulti(pks, bs, ns), "gemm")
    cg.stats.panel_groups += 1
    return f"{held} = {call}(r{x.id}); {bind}"


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

    if ins.id in cg.panel_group_of:  # one call for the products of this input (panel_groups)
        return _panel_group_line(cg, ins, o, weight)
    xs, bs, wten = f"r{x.id}", bias(b), weight(w)
    res = cg.residual.get(ins.id)  # the residual add this product takes (residual_adds)
    if res is not None:
        res = cg.view_of(res.id, tuple(cg.p.values[o].shape))
        cg.stats.onednn_residual += 1
    _, k, n = ins.attrs[ONEDNN_ATTR]
    kind = pick(rows, k, n, cg.p.values[x.id].dtype, act=act)  # chosen() measured it: no timing here
    if kind in ("mkl", "panel", "amx", "bf16panel", "dnnact"):
        return _unfused_line(cg, kind, o, rows, xs, wten, wt, bs, act, gate, res, weight, bias)
    call = cg.const(torch.ops.mkldnn._linear_pointwise.default, "dnn")
    binary = cg.const(torch.ops.mkldnn._linear_pointwise.binary, "dnn")
    attr, sc, algo = ACT_ATTR[act]
    if gate is None:
        pk = cg.const(LazyPacked(wten, wt, rows), "pk") + ".get()"
        line = (f"r{o} = {call}({xs}, {pk}, {bs}, {attr!r}, {sc!r}, {algo!r})" if res is None else
                f"r{o} = {binary}({xs}, {res}, {pk}, {bs}, 'add')")
    else:  # gated MLP: act(x·Wgᵀ+bg) as one call, times (x·Wuᵀ+bu) fused into the up GEMM, then down
        wg, bg, wd, bd = gate
        if _panel_gated_allowed() and gated_pick(rows, k, n, cg.p.values[x.id].dtype, act) == "panel":
            # gate and up as one native gated call (a measured choice, kernels.onednn.gated_pick); down on oneDNN
            h = _panel_gated_call(cg, rows, xs, weight(wg), wten, bias(bg), bs, act)
            cg.stats.panel_gated += 1
        else:
            pg = cg.const(LazyPacked(weight(wg), False, rows), "pk") + ".get()"
            pu = cg.const(LazyPacked(wten, False, rows), "pk") + ".get()"
            h = f"{binary}({xs}, {call}({xs}, {pg}, {bias(bg)}, {attr!r}, {sc!r}, {algo!r}), {pu}, {bs}, 'mul')"
        if wd is None:
            line = f"r{o} = {h}"
        else:
            pd = cg.const(LazyPacked(weight(wd), False, rows), "pk") + ".get()"
            line = (f"r{o} = {call}({h}, {pd}, {bias(bd)}, 'none', [], '')" if res is None else
                    f"r{o} = {binary}({h}, {res}, {pd}, {bias(bd)}, 'add')")
    cg.stats.onednn_gemm += 1
    return line


def _panel_gated_call(cg, rows: int, xs: str, wg: torch.Tensor, wu: torch.Tensor, bg: str, bu: str, act: str,
                      res: str | None = None) -> str:
    """The expression of a gated MLP's gate and up products as one native gated panel call
    (:func:`hetforge.kernels.native.gemm_panel_gated`) on their ``[n, k]`` weights packed into panels, plus ``res``
    where given."""
    gated = cg.const(native.gemm_panel_gated, "gemm")
    qg, qu = (cg.const(LazyPacked(w, False, rows, "panel"), "pk") + ".get()" for w in (wg, wu))
    return f"{gated}({xs}, {qg}, {qu}, {bg}, {bu}, {wu.shape[0]}, {act!r}" + (f", res={res})" if res else ")")


def _unfused_line(cg, kind: str, o: int, rows: int, xs: str, wten: torch.Tensor, wt: bool, bs: str, act: str, gate,
                  res, weight, bias) -> str:
    """:func:`codegen_line` where MKL's packed sgemm, oneDNN's plain product followed by the native activation pass
    (``dnnact``), the native panel GEMM or a native bf16 kernel (AMX, AVX512-BF16) was chosen (``kind``,
    :func:`hetforge.kernels.onednn.pick`): each product on that kernel's packed weight. After MKL's or oneDNN's
    plain product: the activation in place on its fresh result (a gated MLP's: the activation and the product with
    up in one pass, :func:`hetforge.kernels.native.act_inplace`), a residual added in place (the graph's ops in its
    order). The
    native kernels take them into their store instead (``act``, ``mul``, ``res`` of
    :func:`hetforge.kernels.native.gemm_panel`, same order; what a kernel cannot apply it runs as those in-place
    ops itself): the activation on the product it follows, the gate's result into the up product, the residual
    into the last product."""
    native_kind = kind in ("panel", "amx", "bf16panel")
    act_fn = cg.const(MKL_ACT[act], "act") if act != "none" and not native_kind else ""
    call = cg.const({"mkl": torch.ops.mkl._mkl_linear.default, "panel": native.gemm_panel,
                     "amx": native.gemm_amx_bf16, "bf16panel": native.gemm_bf16_panel,
                     "dnnact": torch.ops.mkldnn._linear_pointwise.default}[kind],
                    {"mkl": "mkl", "dnnact": "dnn"}.get(kind, "gemm"))

    def packed(w: torch.Tensor, w_t: bool) -> str:
        return cg.const(LazyPacked(w, w_t, rows, "onednn" if kind == "dnnact" else kind), "pk") + ".get()"

    def product(x: str, w: torch.Tensor, w_t: bool, b: str, a: str = "none", mul: str | None = None,
                r: str | None = None) -> str:
        pk = packed(w, w_t)
        if native_kind:
            epi = (f", act={a!r}" if a != "none" else "") + (f", mul={mul}" if mul else "") + \
                (f", res={r}" if r else "")
            return f"{call}({x}, {pk}, {b}, {w.shape[1] if w_t else w.shape[0]}{epi})"
        if kind == "dnnact":
            return f"{call}({x}, {pk}, {b}, 'none', [], '')"
        ori = cg.const(w.t() if w_t else w, "ori")  # [N, K]: MKL's op reads its sizes
        return f"{call}({x}, {pk}, {ori}, {b}, {rows})"

    if native_kind:
        if gate is None:
            y = product(xs, wten, wt, bs, act, r=res)
        else:  # gated MLP: act(x·Wgᵀ+bg) into the up product's store, then the down product
            wg, bg, wd, bd = gate
            r_up = res if wd is None else None
            if kind == "panel" and native.epilogue_act(act) and _panel_gated_allowed():
                # gate and up as one call (native.gemm_panel_gated): the same bits
                y = _panel_gated_call(cg, rows, xs, weight(wg), wten, bias(bg), bs, act, r_up)
            else:
                g = product(xs, weight(wg), False, bias(bg), act)
                y = product(xs, wten, False, bs, mul=g, r=r_up)
            if wd is not None:
                y = product(y, weight(wd), False, bias(bd), r=res)
        res = None
    elif gate is None:
        y = product(xs, wten, wt, bs)
        y = f"{act_fn}({y})" if act_fn else y
    else:  # gated MLP: act(x·Wgᵀ+bg) * (x·Wuᵀ+bu) as one in-place pass on the gate's result, then the down product
        wg, bg, wd, bd = gate
        actmul = cg.const(native.act_inplace, "act")
        y = f"{actmul}({product(xs, weight(wg), False, bias(bg))}, {act!r}, {product(xs, wten, False, bs)})"
        if wd is not None:
            y = product(y, weight(wd), False, bias(bd))
    if res is not None:
        y = f"{y}.add_({res})"
    if kind == "mkl":
        cg.stats.mkl_gemm += 1
    elif kind == "dnnact":
        cg.stats.onednn_gemm += 1
    elif kind == "panel":
        cg.stats.panel_gemm += 1
    elif kind == "bf16panel":
        cg.stats.bf16_panel_gemm += 1
    else:
        cg.stats.amx_gemm += 1
    return f"r{o} = {y}"
