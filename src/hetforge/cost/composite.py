"""What a composite op runs on the CPU: the ATen ops of its implementation, traced once per shape.

On a CPU the executor calls a ``hetforge::`` op's Python reference (``hetforge.ops.fused``), and an ATen
``CompositeImplicitAutograd`` op such as ``scaled_dot_product_attention`` runs as the ATen ops it
decomposes into. So the CPU time of such an op is the sum of the times of those ops, not one roofline over
the op's total FLOPs and bytes: ``rms_norm`` is six eager kernels with their own dispatches and
intermediate tensors, ``linear_act(…, 'gelu_tanh')`` is a GEMM plus a tanh-GELU that runs at its own
(transcendental) speed.

:func:`decompose` runs the implementation on fake CPU tensors of the call's shapes under a dispatch mode
that records every ATen op reaching the dispatcher (after the CompositeImplicit decompositions, so the
same ops a real CPU call runs) and returns them as :class:`OpCall`, each with the bytes of its inputs that an
earlier op of the same implementation wrote (intermediates: cache-hot). Results are cached per op and
argument shapes (and the torch thread count: some implementations pick their kernels by it).
"""

from __future__ import annotations

from typing import Any

import torch

from hetforge.ops.registry import OpCall, OpInfo, TensorMeta, _meta_of, _target_name, lookup

_CACHE: dict[str, tuple[tuple[OpCall, float], ...] | None] = {}
_SKIP = {"prim.device.default"}


def _aten_target(name: str) -> Any:
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def implementation(info: OpInfo) -> Any:
    """The callable a CPU runs for ``info``: a hetforge op's Python reference, or an ATen composite's overload
    (``attrs['composite']``); None for an op that runs as one kernel."""
    if info.name.startswith("hetforge.") and info.reference is not None:
        return info.reference
    if info.attrs.get("composite"):
        try:
            return _aten_target(info.name)
        except (AttributeError, ValueError):
            return None
    return None


def _fake_args(obj: Any, mode) -> Any:
    """``obj`` with every :class:`TensorMeta` replaced by a contiguous fake CPU tensor (no memory)."""
    if isinstance(obj, TensorMeta):
        with mode:
            return torch.empty(obj.shape, dtype=obj.dtype)
    if isinstance(obj, list):
        return [_fake_args(a, mode) for a in obj]
    if isinstance(obj, tuple):
        return tuple(_fake_args(a, mode) for a in obj)
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for a in obj for t in _tensors(a)]
    if isinstance(obj, dict):
        return [t for a in obj.values() for t in _tensors(a)]
    return []


def _arg_meta(a: Any) -> Any:
    """:class:`TensorMeta` of an argument; a transposed 2-D view (a weight's ``t()``) is given in memory order,
    so the cost model sees the rows the kernel streams (:func:`hetforge.cost.model.weight_rows`)."""
    if isinstance(a, torch.Tensor) and a.dim() == 2 and a.stride(0) == 1 and a.stride(1) != 1:
        return TensorMeta((int(a.shape[1]), int(a.shape[0])), a.dtype)
    return _meta_of(a)


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records ``(OpCall, hot input bytes)`` per ATen op; an input an earlier op wrote or read (or a view of
    one) was just touched, so it counts as cache-hot."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[OpCall, float]] = []
        self.made: set[int] = set()  # ids of intermediate tensors (outputs of recorded ops, and views of them)
        self.keep: list[torch.Tensor] = []  # keeps them alive so ids stay unique

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _target_name(func)
        if name in _SKIP:
            return out
        ins = _tensors((args, kwargs))
        hot_in = [t for t in ins if id(t) in self.made]
        hot = float(sum(t.numel() * t.element_size() for t in hot_in))
        outs = _tensors(out)
        info = lookup(name)
        # what this op wrote, and what it read (now in cache), is hot for the ops after it; a view of a cold
        # tensor (a weight's transpose) stays cold
        if info is None or not info.is_view or hot_in:
            for t in outs + ins:
                self.made.add(id(t))
                self.keep.append(t)
        self.calls.append((OpCall(name, tuple(_arg_meta(a) for a in args), {k: _meta_of(v) for k, v in kwargs.items()},
                                  tuple(_meta_of(o) for o in outs)), hot))
        return out


def decompose(call: OpCall, info: OpInfo) -> tuple[tuple[OpCall, float], ...] | None:
    """The ATen calls ``call`` runs on a CPU, each with the bytes of its inputs that earlier calls wrote
    (cache-hot intermediates); None when ``call`` is one kernel or cannot be traced."""
    fn = implementation(info)
    if fn is None:
        return None
    key = repr((call.op, call.args, sorted(call.kwargs.items()), torch.get_num_threads()))
    if key in _CACHE:
        return _CACHE[key]
    from torch._subclasses.fake_tensor import FakeTensorMode

    res: tuple[OpCall, ...] | None
    try:
        mode = FakeTensorMode()
        args = _fake_args(call.args, mode)
        kwargs = {k: _fake_args(v, mode) for k, v in call.kwargs.items()}
        rec = _Recorder()
        with mode, rec, torch.no_grad():
            fn(*args, **kwargs)
        res = tuple(rec.calls) or None
        if res is not None and any(c.op == call.op for c, _ in res):  # not a decomposition after all
            res = None
    except Exception:  # noqa: BLE001 - an untraceable implementation is costed as one op
        res = None
    _CACHE[key] = res
    return res
