"""Pass: the Mixture-of-Experts block → one ``hetforge::moe`` op.

Anchored on every ``topk``: its input must be ``softmax(linear(h, W_router))`` over the last dim (an optional
float cast between). The block is the innermost module on the ``topk``'s module stack whose nodes read
stacked expert weights (3-D parameters with ``E`` = the router's output size first). Its nodes (every
node with that module on its stack) must read exactly one value from outside (the hidden states) besides
parameters, and exactly one of them may be used outside (the block's output, of the input's shape).
Parameters are classified: router ``[E, D]``; ``gate_up [E, 2F, D]`` and ``down [E, D, F]`` (or the
transposed layout); an optional shared expert (``gate_proj``/``up_proj``/``down_proj`` linears) and its
sigmoid gate ``[1, D]``. Top-k renormalisation is recognised from a ``sum`` of the top-k values.

A wrong fusion would be a silent wrong answer, so the candidate is then *checked on numbers*: the block's
own nodes are extracted as a standalone graph and run on a random input with the real weights, next to
the fused op; only an equal result (max |Δ| ≤ 1e-4·(1 + max|ref|) in fp32, two rounding steps of the dtype
in bf16/fp16) is rewritten. Anything else — sigmoid
or grouped routing, expert biases, a non-gated expert, an extra output such as returned router logits —
stays unfused and is reported as a near-miss with the reason.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate

from hetforge.passes.common import (
    Miss,
    NearMiss,
    PassLog,
    Rewrite,
    aten,
    const_tensor,
    fake_mode_of,
    graph_pass,
    inherit_meta,
    is_call,
    set_val,
    tval,
)

_ACTS = {aten.silu.default: "silu", aten.relu.default: "relu", aten.gelu.default: "gelu"}
_SOFTMAX = (aten.softmax.int, aten._softmax.default)
_CASTS = (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout)


def _stack(n: Node) -> list[tuple[str, str]]:
    """``[(key, module path), ...]`` outermost first."""
    return [(k, v[0]) for k, v in (n.meta.get("nn_module_stack") or {}).items()]


def _router(tk: Node) -> tuple[Node, Node, Node]:
    """``(softmax, linear, router input)`` feeding a ``topk``, or raise :class:`Miss`."""
    dim = tk.args[2] if len(tk.args) > 2 else tk.kwargs.get("dim", -1)
    largest = tk.args[3] if len(tk.args) > 3 else tk.kwargs.get("largest", True)
    src = tk.args[0]
    if not largest:
        raise Miss("topk takes the smallest values")
    if not is_call(src, *_SOFTMAX):
        raise Miss(f"topk input is not a softmax (router scores from {getattr(src, 'target', src)}; "
                    "e.g. sigmoid routing is not recognised)")
    sv = tval(src)
    if sv is None or dim not in (-1, sv.dim() - 1) or src.args[1] not in (-1, sv.dim() - 1):
        raise Miss("router softmax/topk not over the last dim")
    lin = src.args[0]
    while is_call(lin, *_CASTS):
        lin = lin.args[0]
    if not is_call(lin, aten.linear.default) or len(lin.args) > 2 and lin.args[2] is not None:
        raise Miss("router scores are not a bias-free linear")
    return src, lin, lin.args[0]


def _region(gm: GraphModule, tk: Node, n_exp: int) -> tuple[str, list[Node]]:
    """The innermost module on the topk's stack whose nodes read ``[E, *, *]`` parameters, and its nodes."""
    nodes = list(gm.graph.nodes)
    for key, path in reversed(_stack(tk)):
        region = [n for n in nodes if n.op == "call_function" and key in (n.meta.get("nn_module_stack") or {})]
        for n in region:
            for a in n.all_input_nodes:
                t = const_tensor(gm, a)
                if t is not None and t.dim() == 3 and t.shape[0] == n_exp:
                    return path, region
    raise Miss(f"no module around the router reads stacked [{n_exp}, *, *] expert weights")


def _classify(gm: GraphModule, region: list[Node], lin: Node, d: int, n_exp: int) -> dict:
    """Sort the block's parameters into router, stacked experts and shared expert, or raise :class:`Miss`."""
    rset = set(region)
    found: dict = {"experts": [], "x": []}
    for n in region:
        for a in n.all_input_nodes:
            if a in rset:
                continue
            t = const_tensor(gm, a)
            if t is None:
                if a not in found["x"]:
                    found["x"].append(a)
                continue
            path = _stack(n)[-1][1] if _stack(n) else ""
            if n is lin and a is lin.args[1]:
                found["router"] = a
            elif t.dim() == 3 and t.shape[0] == n_exp:
                if a not in found["experts"]:
                    found["experts"].append(a)
            elif t.dim() == 2 and tuple(t.shape) == (1, d):
                found["s_router"] = a
            elif t.dim() == 2 and path.endswith("gate_proj"):
                found["s_gate"] = a
            elif t.dim() == 2 and path.endswith("up_proj"):
                found["s_up"] = a
            elif t.dim() == 2 and path.endswith("down_proj"):
                found["s_down"] = a
            else:
                raise Miss(f"unrecognised parameter {a.target} {tuple(t.shape)} in the block ({path})")
    if len(found["x"]) != 1:
        raise Miss(f"block reads {len(found['x'])} values from outside ({', '.join(x.name for x in found['x'])}), "
                    "expected only the hidden states")
    if len(found["experts"]) != 2:
        raise Miss(f"{len(found['experts'])} stacked expert tensors (expected gate_up and down; expert biases or "
                    "separate gate/up stacks are not recognised)")
    if ("s_up" in found) != ("s_down" in found):
        raise Miss("shared expert without both up and down projections")
    return found


def _layouts(gm: GraphModule, experts: list[Node], d: int) -> list[tuple[Node, Node, bool]]:
    """Candidate ``(gate_up, down, transposed)`` assignments consistent with the shapes."""
    out = []
    for a, b in (experts, experts[::-1]):
        ta, tb = const_tensor(gm, a), const_tensor(gm, b)
        if ta.shape[2] == d and tb.shape[1] == d and ta.shape[1] == 2 * tb.shape[2]:
            out.append((a, b, False))
        if ta.shape[1] == d and tb.shape[2] == d and ta.shape[2] == 2 * tb.shape[1]:
            out.append((a, b, True))
    return out


def _subgraph(gm: GraphModule, region: list[Node], x: Node, out: Node) -> GraphModule:
    """The block's nodes as a standalone graph ``x -> out`` over ``gm``'s parameters."""
    g = torch.fx.Graph()
    env: dict[Node, Node] = {x: g.placeholder("x")}
    rset = set(region)
    for n in region:
        for a in n.all_input_nodes:
            if a not in env and a not in rset:
                env[a] = g.get_attr(a.target)
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[out])
    return GraphModule(gm, g)


def _example(v: torch.Tensor) -> torch.Tensor:
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint
    except ImportError:  # a torch older than the pinned one: the same hint under its former name
        from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint

    shape = [s if isinstance(s, int) else optimization_hint(s, fallback=8) for s in v.shape]
    return torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=v.dtype)


@graph_pass("moe")
def fuse_moe(gm: GraphModule, log: PassLog) -> None:
    """Replace every recognised MoE block by one ``hetforge::moe`` node (numerically checked)."""
    fm = fake_mode_of(gm)
    layer = 0
    checked: dict[str, tuple[int, float, str]] = {}  # block structure → (layout index, max |Δ|, first layer's name)
    for tk in [n for n in gm.graph.nodes if is_call(n, aten.topk.default)]:
        if getattr(tk, "_erased", False):
            continue
        try:
            new, region, path, detail = _fuse_one(gm, tk, layer, fm, checked)
        except Miss as e:
            log.near_misses.append(NearMiss("moe", tk.name, str(e)))
            continue
        log.rewrites.append(Rewrite("moe", [n.name for n in region], new.name, f"{path}: {detail}"))
        layer += 1


def _signature(region: list[Node], x: Node) -> str:
    """The block's structure: every node's op and arguments, with nodes as positions in the block, the hidden
    states as ``x`` and parameters as their shape and dtype (not their names or values)."""
    pos = {n: i for i, n in enumerate(region)}

    def enc(a: Any) -> Any:
        if not isinstance(a, Node):
            return a
        if a in pos:
            return f"n{pos[a]}"
        if a is x:
            return "x"
        v = tval(a)
        return f"p{tuple(v.shape)}{v.dtype}" if v is not None else f"?{a.op}"

    return repr([(str(n.target), map_aggregate(n.args, enc), map_aggregate(dict(n.kwargs), enc)) for n in region])


def _fuse_one(gm: GraphModule, tk: Node, layer: int, fm,
              checked: dict[str, tuple[int, float, str]]) -> tuple[Node, list[Node], str, str]:
    _, lin, _ = _router(tk)
    rw = const_tensor(gm, lin.args[1])
    if rw is None or rw.dim() != 2:
        raise Miss("router weight is not a 2-D parameter")
    n_exp, d = rw.shape
    path, region = _region(gm, tk, n_exp)
    p = _classify(gm, region, lin, d, n_exp)
    x = p["x"][0]
    rset = set(region)
    outs = [n for n in region if any(u not in rset for u in n.users)]
    if len(outs) != 1:
        raise Miss(f"block has {len(outs)} outputs used outside it ({', '.join(o.name for o in outs)}); expected one")
    out = outs[0]
    xv, ov = tval(x), tval(out)
    if xv is None or ov is None or tuple(xv.shape) != tuple(ov.shape) or xv.dtype != ov.dtype:
        raise Miss("block output does not have the hidden states' shape and dtype")
    acts = {_ACTS[n.target] if n.target is not aten.gelu.default or n.kwargs.get("approximate", "none") == "none"
            else "gelu_tanh" for n in region if n.target in _ACTS}
    if len(acts) != 1:
        raise Miss(f"expected one expert activation (silu/gelu/relu), found {sorted(acts) or 'none'}")
    act = acts.pop()
    top_k = int(tk.args[1])
    values = [u for u in tk.users if u.target is operator.getitem and u.args[1] == 0]
    norm = any(is_call(u, aten.sum.dim_IntList, aten.sum.default) for v in values for u in v.users)
    layouts = _layouts(gm, p["experts"], d)
    if not layouts:
        raise Miss("stacked expert shapes are not gate_up [E, 2F, D] + down [E, D, F] (or transposed)")
    # The numerical check runs the block (HF's expert path gathers every token's expert weights) and the
    # candidate op on a random input of the block's real shape: ~90% of mixtral-small's prefill passes when it
    # ran for every layer. It checks the mapping from a block's structure to the op's arguments, which does not
    # depend on weight values: a block with the same structure as one already checked in this graph (every
    # decoder layer of a model) takes the same layout without running again, and says so.
    sig = _signature(region, x)
    if sig in checked:
        k, worst, first = checked[sig]
        gu, dn, tr = layouts[k]
        how = f"same block structure as {first}, checked there max |Δ| {worst:.2g}"
    else:
        k, worst, on = _check(gm, region, x, out, xv, rw, p, layouts, top_k, norm, act)
        gu, dn, tr = layouts[k]
        checked[sig] = (k, worst, tk.name)
        how = f"checked max |Δ| {worst:.2g}{on}"
    # every schema argument positionally, as torch.export writes a direct call of the op
    args = (x, lin.args[1], gu, dn, p.get("s_gate"), p.get("s_up"), p.get("s_down"), p.get("s_router"), top_k, norm,
            act, tr, 0, [], [], layer)
    last = _last(gm, rset)
    with gm.graph.inserting_after(last):
        new = gm.graph.call_function(torch.ops.hetforge.moe.default, args)
    set_val(new, fm)
    inherit_meta(new, out)
    out.replace_all_uses_with(new)
    for n in reversed(_ordered(gm, rset)):
        gm.graph.erase_node(n)
    shared = "shared expert, " if "s_up" in p else ""
    detail = f"{n_exp} experts, top-{top_k}{' renormalised' if norm else ''}, {shared}{act}, {how}"
    return new, region, path, detail


NARROW_F = 16  # expert width of the small instance :func:`_check` tries first


def _check(gm: GraphModule, region: list[Node], x: Node, out: Node, xv: torch.Tensor, rw: torch.Tensor, p: dict,
           layouts: list, top_k: int, norm: bool, act: str) -> tuple[int, float, str]:
    """Run the block and the candidate op (each expert layout in turn) on one random input; the first layout
    that matches, with its max |Δ| and how it was run, or :class:`Miss`.

    First on a narrow instance (:func:`_check_narrow`), then, where no layout matched there, on the real one.
    """
    sub = _subgraph(gm, region, x, out)
    xe = _example(xv)
    from hetforge.ops.moe import moe_forward

    def real(k):
        return const_tensor(gm, p[k]) if k in p else None

    got = _check_narrow(gm, sub, xe, rw, layouts, real, top_k, norm, act)
    if got is not None:
        return got
    with torch.no_grad():
        ref = sub(xe)
    worst = float("inf")
    for i, (gu, dn, tr) in enumerate(layouts):
        with torch.no_grad():
            got_t = moe_forward(xe, rw, const_tensor(gm, gu), const_tensor(gm, dn), real("s_gate"), real("s_up"),
                                real("s_down"), real("s_router"), top_k, norm, act, tr)
        err = float((got_t - ref).abs().max())
        worst = min(worst, err)
        if err <= _tolerance(ref):
            return i, err, ""
    raise Miss(f"candidate MoE op differs from the block on a random input (max |Δ| = {worst:.3g}); "
               "variant not recognised")


def _tolerance(ref: torch.Tensor) -> float:
    """How far the candidate op may be from the block: ``1e-4·(1 + max|ref|)`` in fp32; in a narrower float dtype
    (bf16, fp16) two of its rounding steps, ``2·eps·(1 + max|ref|)`` — the op and HF's block round their
    intermediates at different points — still far below what a wrong variant (a scale, the routing, the
    activation) changes."""
    eps = torch.finfo(ref.dtype).eps if ref.dtype.is_floating_point else 0.0
    return max(1e-4, 2.0 * eps) * (1.0 + float(ref.abs().max()))


def _check_narrow(gm: GraphModule, sub: GraphModule, xe: torch.Tensor, rw: torch.Tensor, layouts: list, real,
                  top_k: int, norm: bool, act: str) -> tuple[int, float, str] | None:
    """:func:`_check` with the stacked expert weights cut to their first :data:`NARROW_F` columns of the expert
    width ``F`` (per candidate layout, in the subgraph and the op alike): the first layout whose op matches the
    block on that instance, or None (then the real instance decides).

    Why: HF's expert path gathers each token's expert weights (``[tokens·k, 2F, D]``, over a GB on mixtral-small
    at 128 tokens), most of a cold compile of that model; what is checked, the mapping from the block's
    structure to the op's arguments, depends on neither the weights' values nor ``F`` (a block that bakes ``F``
    into its graph fails here, and is checked at full size)."""
    if NARROW_F <= 0:
        return None
    from hetforge.ops.moe import moe_forward

    attrs = {str(n.target): const_tensor(gm, n) for n in sub.graph.nodes if n.op == "get_attr"}
    for i, (gu, dn, tr) in enumerate(layouts):
        wg, wd = const_tensor(gm, gu), const_tensor(gm, dn)
        f = wd.shape[1] if tr else wd.shape[2]
        if f <= NARROW_F:
            return None
        # gate_up [E, 2F, D] (transposed: [E, D, 2F]) keeps the first NARROW_F rows of each half; down [E, D, F]
        # (transposed: [E, F, D]) its first NARROW_F
        gdim, ddim = (2, 1) if tr else (1, 2)
        small_g = torch.cat([wg.narrow(gdim, 0, NARROW_F), wg.narrow(gdim, f, NARROW_F)], dim=gdim).contiguous()
        small_d = wd.narrow(ddim, 0, NARROW_F).contiguous()
        small = GraphModule({**attrs, str(gu.target): small_g, str(dn.target): small_d}, sub.graph)
        try:
            with torch.no_grad():
                ref = small(xe)
                got = moe_forward(xe, rw, small_g, small_d, real("s_gate"), real("s_up"), real("s_down"),
                                  real("s_router"), top_k, norm, act, tr)
        except (RuntimeError, IndexError, ValueError):  # F baked into the block, or the wrong layout
            continue
        if got.shape != ref.shape:
            continue
        err = float((got - ref).abs().max())
        if err <= _tolerance(ref):
            return i, err, f" on a {NARROW_F}-wide slice of the experts"
    return None


def _ordered(gm: GraphModule, nodes: set[Node]) -> list[Node]:
    return [n for n in gm.graph.nodes if n in nodes]


def _last(gm: GraphModule, nodes: set[Node]) -> Node:
    return _ordered(gm, nodes)[-1]
