"""Pass 6, norm fusion: decomposed RMSNorm → ``hetforge::rms_norm``; LayerNorm → ``hetforge::layer_norm``.

RMSNorm is matched from each ``rsqrt`` node, in Hugging Face's form (casts optional when they are no-ops)::

    h = x.to(float32)            (absent when x is already float32)
    r = rsqrt(mean(h ** 2, [-1], keepdim=True) + eps)
    n = (h * r).to(x.dtype)      (cast absent when x is float32)
    y = weight * n               (optional; a parameter of shape [hidden])

The math must run in float32 and come back in ``x``'s dtype (what ``hetforge::rms_norm`` does); a chain that
computes in another dtype, reduces another dim or has intermediates used elsewhere is a near-miss.
``aten.layer_norm`` and ``aten.native_layer_norm`` (when only its first output is used) become
``hetforge::layer_norm``.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

import hetforge.ops.fused  # noqa: F401  (registers the fused ops)
from hetforge.passes.common import (
    Miss,
    NearMiss,
    PassLog,
    Rewrite,
    aten,
    describe,
    erase_unused,
    fake_mode_of,
    graph_pass,
    is_call,
    is_getitem,
    new_call,
    norm_dim,
    only_user,
    scalar,
    tval,
)

RMS_NORM = torch.ops.hetforge.rms_norm.default
LAYER_NORM = torch.ops.hetforge.layer_norm.default
_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default)


def _uncast(n: Node) -> Node:
    return n.args[0] if is_call(n, *_CASTS) and isinstance(n.args[0], Node) else n


def _match_rms(gm: GraphModule, r: Node) -> tuple[Node, tuple, list[Node]] | None:
    """(output, op args, matched) for an rsqrt at the heart of an RMSNorm; None if it is not one at all."""
    add = r.args[0]
    if not is_call(add, aten.add.Tensor, aten.add.Scalar):
        return None
    mean = add.args[0] if isinstance(add.args[0], Node) else add.args[1]
    eps = scalar(add.args[1] if mean is add.args[0] else add.args[0])
    if not is_call(mean, aten.mean.dim) or eps is None:
        return None
    pw = mean.args[0]
    if not (is_call(pw, aten.pow.Tensor_Scalar) and scalar(pw.args[1]) == 2.0):
        return None
    h = pw.args[0]
    th = tval(h)
    if th is None:
        raise Miss("RMSNorm input has no shape metadata")
    dims = mean.args[1] if len(mean.args) > 1 else None
    keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if [norm_dim(d, th.dim()) for d in (dims or [])] != [th.dim() - 1] or not keep:
        raise Miss(f"mean over dims {dims} (keepdim={keep}); RMSNorm reduces the last dim with keepdim")
    if mean.kwargs.get("dtype") is not None:
        raise Miss("mean with an explicit dtype")
    if th.dtype != torch.float32:
        raise Miss(f"RMSNorm computed in {th.dtype}; hetforge::rms_norm computes in float32")
    mul = only_user(r)
    if not is_call(mul, aten.mul.Tensor) or {mul.args[0], mul.args[1]} != {h, r}:
        raise Miss(f"rsqrt result is used by {describe(mul) if mul else 'several nodes'}, not by h * rsqrt")
    x = _uncast(h)
    tx = tval(x)
    matched = [pw, mean, add, r, mul]
    out = mul
    cast = only_user(mul)
    if is_call(cast, *_CASTS) and tval(cast) is not None:
        if tval(cast).dtype != tx.dtype:
            raise Miss(f"the result is cast to {tval(cast).dtype}, not back to the input dtype {tx.dtype}")
        out = cast
        matched.append(cast)
    elif tval(mul).dtype != tx.dtype:
        raise Miss(f"the result stays {tval(mul).dtype} but the input is {tx.dtype}")
    weight = None
    wm = only_user(out)
    if is_call(wm, aten.mul.Tensor) and out in wm.args[:2]:
        w = wm.args[1] if wm.args[0] is out else wm.args[0]
        tw = tval(w)
        if isinstance(w, Node) and w.op == "get_attr" and tw is not None and tuple(tw.shape) == (tx.shape[-1],):
            weight = w
            out = wm
            matched.append(wm)
    inside = set(matched)
    for m in matched:
        if m is not out and any(u not in inside for u in m.users):
            raise Miss(f"intermediate {m.name} is also used outside the RMSNorm")
    if x is not h and all(u in inside for u in h.users):
        matched.insert(0, h)  # the float32 copy goes too (when used elsewhere it stays; the norm reads x)
    return out, (x, weight, float(eps)), matched


def _layer_norm(n: Node) -> tuple[Node, tuple] | None:
    if is_call(n, aten.layer_norm.default):
        a = list(n.args) + [None] * (5 - len(n.args))
        eps = a[4] if a[4] is not None else n.kwargs.get("eps", 1e-5)
        return n, (a[0], list(a[1]), a[2] or n.kwargs.get("weight"), a[3] or n.kwargs.get("bias"), float(eps))
    if is_call(n, aten.native_layer_norm.default):
        if not n.users or any(not is_getitem(u, 0) for u in n.users):
            raise Miss("native_layer_norm's mean/rstd outputs are used; only the normalized output can be fused")
        return n, (n.args[0], list(n.args[1]), n.args[2], n.args[3], float(n.args[4]))
    return None


@graph_pass("norm_fusion")
def fuse_norms(gm: GraphModule, log: PassLog) -> None:
    """Fuse RMSNorm chains and LayerNorms; returns a new GraphModule in the result."""
    fake = fake_mode_of(gm)
    for n in list(gm.graph.nodes):
        if getattr(n, "_erased", False) or n.op != "call_function":
            continue
        try:
            if n.target is aten.rsqrt.default:
                m = _match_rms(gm, n)
                if m is None:
                    continue
                out, args, matched = m
                new = new_call(gm, out, RMS_NORM, args, like=out, fake_mode=fake)
                if not _same(out, new):
                    raise Miss(_differs(out, new))
                out.replace_all_uses_with(new)
                log.rewrites.append(Rewrite("rms_norm", [x.name for x in matched], new.name,
                                        f"eps={args[2]:g} weight={'yes' if args[1] is not None else 'no'}"))
                erase_unused(gm, matched[::-1])
            else:
                ln = _layer_norm(n)
                if ln is None:
                    continue
                src, args = ln
                new = new_call(gm, src, LAYER_NORM, args, like=src, fake_mode=fake)
                dead = [src]
                if src.target is aten.native_layer_norm.default:
                    dead = [*src.users, src]
                    for u in dead[:-1]:
                        u.replace_all_uses_with(new)
                else:
                    src.replace_all_uses_with(new)
                log.rewrites.append(Rewrite("layer_norm", [src.name], new.name, f"eps={args[4]:g}"))
                erase_unused(gm, dead)
        except Miss as e:
            log.near_misses.append(NearMiss("norm", n.name, str(e)))


def _same(a: Node, b: Node) -> bool:
    ta, tb = tval(a), tval(b)
    return ta is None or tb is None or (tuple(ta.shape) == tuple(tb.shape) and ta.dtype == tb.dtype)


def _differs(a: Node, b: Node) -> str:
    ta, tb = tval(a), tval(b)
    return f"fused result {tuple(tb.shape)} {tb.dtype} differs from {tuple(ta.shape)} {ta.dtype}"
