"""Lowering: an (optimized) FX graph plus a placement → a :class:`~hetforge.ir.Program`.

Every FX node becomes at most one instruction on the device the placement chose:

* ``placeholder`` → an input register on the first (host) device; ``get_attr`` → a weight register
  that references the tensor by its module path (weights are resident on every device that reads
  them, copied there once by the executor, so they never need transfer instructions);
* ``call_function`` → an instruction; multi-output ops (``split``, ``topk``, ``native_layer_norm``)
  get one register per element and ``getitem`` nodes fold into those registers (no instruction);
  calls whose value is a static Python number fold into constants; shape assertions
  (``_assert_tensor_metadata`` ...) and export's ``_guards_fn`` are dropped and counted;
* storage sharing comes from the fake tensors torch.export left on every node: an output whose
  storage is one seen before is an alias of that storage's first owner (its root). That is how views,
  in-place results and ``split`` pieces are recognised, op by op, without a hand-kept list of view ops;
* an argument produced on another device is moved by an explicit ``transfer`` instruction on the
  consuming device (one per value and destination, shared by all its readers). On a unified-memory
  link the transfer is zero-copy: recorded, 0 bytes moved, its output aliases the source;
* graph outputs are moved to the host device if needed, and their root storage is marked ``output``
  (allocated fresh per call, never in the reused arena, so a caller can keep them).
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hetforge.errors import HetforgeError, UsageError
from hetforge.frontend import op_name
from hetforge.ir.program import (
    INPLACE,
    INPUT,
    KERNEL,
    OUTPUT,
    TEMP,
    TRANSFER,
    VIEW,
    WEIGHT,
    Instr,
    Program,
    Reg,
    Value,
    WeightRef,
    iter_regs,
)
from hetforge.ops import lookup

DROPPED_OPS = {
    "aten._assert_tensor_metadata.default", "aten._assert_scalar.default", "aten._assert_async.msg",
    "aten._assert_async.default", "aten.sym_constrain_range_for_size.default", "aten.sym_constrain_range.default",
    "aten._functional_assert_async.msg",
}


class LoweringError(HetforgeError):
    """The graph contains something the backend cannot lower (exit code 1)."""


@dataclass
class LowerReport:
    """What lowering made: instruction counts, transfers, and what it dropped."""

    instructions: int
    by_device: dict[str, int]
    by_kind: dict[str, int]
    transfers: int
    zero_copy_transfers: int
    transfer_bytes: int  # bytes actually moved (zero-copy transfers move none)
    dropped: dict[str, int] = field(default_factory=dict)
    views_rehomed: int = 0  # views run where their base lives instead of the placed device
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class LowerResult:
    program: Program
    report: LowerReport


def _storage_key(t: torch.Tensor) -> Any:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


class _Lowerer:
    def __init__(self, gm: torch.fx.GraphModule, assignment: dict[str, str], soc, name: str,
                 rehome_views: bool = True):
        self.rehome_views = rehome_views
        self.rehomed: dict[str, tuple[str, str]] = {}
        self.gm = gm
        self.soc = soc
        self.devices = list(soc.device_names) if soc is not None else sorted(set(assignment.values()) | {"cpu"})
        self.host = self.devices[0]
        self.assignment = assignment
        bad = sorted({d for d in assignment.values() if d not in self.devices})
        if bad:
            raise UsageError(f"placement uses device(s) {', '.join(bad)} that SoC '{getattr(soc, 'name', '?')}' "
                             f"does not have; devices: {', '.join(self.devices)}")
        self.p = Program(name, getattr(soc, "name", "none"), self.devices, soc_spec=getattr(soc, "spec", None))
        self.env: dict[torch.fx.Node, Any] = {}
        self.storage_root: dict[Any, int] = {}
        self.transfer_cache: dict[tuple[int, str], int] = {}
        self.transfer_src: dict[int, int] = {}
        self.dropped: dict[str, int] = {}
        self.next_value = 0
        self.params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}

    # --- helpers -------------------------------------------------------------------------------
    def new_value(self, t: torch.Tensor, kind: str, device: str, producer: int | None, name: str,
                  alias_ok: bool = True) -> int:
        vid = self.next_value
        self.next_value += 1
        key = _storage_key(t) if alias_ok else None
        alias = self.storage_root.get(key) if key is not None else None
        v = Value(vid, tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()), t.dtype, kind, device,
                  producer, alias, int(t.storage_offset()), name)
        self.p.values[vid] = v
        if key is not None and alias is None:
            self.storage_root[key] = vid
        return vid

    def link_unified(self, a: str, b: str) -> bool:
        if self.soc is None:
            return False
        return bool(self.soc.link(a, b).unified)

    def home(self, vid: int) -> str:
        return self.p.values[vid].device

    def on_device(self, vid: int, device: str) -> int:
        """``vid`` itself if it is on ``device`` (or a weight), else the output of a transfer to ``device``."""
        v = self.p.values[vid]
        if v.kind == WEIGHT or v.device == device:
            return vid
        key = (vid, device)
        if key in self.transfer_cache:
            return self.transfer_cache[key]
        zero = self.link_unified(v.device, device)
        iid = len(self.p.instrs)
        out = self.next_value
        self.next_value += 1
        if zero:
            nv = Value(out, v.shape, v.stride, v.dtype, TEMP, device, iid, self.p.root(vid), v.storage_offset,
                       f"{v.name}@{device}")
        else:
            stride = tuple(torch.empty(v.shape, device="meta").stride()) if v.shape else ()
            nv = Value(out, v.shape, stride, v.dtype, TEMP, device, iid, None, 0, f"{v.name}@{device}")
        self.p.values[out] = nv
        moved = 0 if zero else nv.nbytes
        self.p.instrs.append(Instr(iid, "transfer", (Reg(vid),), {}, (out,), device, TRANSFER,
                                   {"src": v.device, "dst": device, "zero_copy": zero, "bytes": moved}))
        self.transfer_cache[key] = out
        self.transfer_src[out] = vid
        return out

    def map_arg(self, a: Any, device: str) -> Any:
        if isinstance(a, torch.fx.Node):
            got = self.env[a]
            if isinstance(got, Reg):
                return Reg(self.on_device(got.id, device))
            if isinstance(got, tuple) and got and isinstance(got[0], Reg):  # a multi-output value passed whole
                return [Reg(self.on_device(r.id, device)) for r in got]
            return got
        if isinstance(a, (list, tuple)):
            mapped = [self.map_arg(x, device) for x in a]
            return mapped if isinstance(a, list) else tuple(mapped)
        if isinstance(a, dict):
            return {k: self.map_arg(v, device) for k, v in a.items()}
        return a

    def view_home(self, n: torch.fx.Node, outs_meta: list[torch.Tensor], placed: str) -> str | None:
        """The device holding the bytes a pure view reads (None when ``n`` is not a view of an activation).

        A view is a metadata operation on its base's buffer: running it where the base lives moves no
        data, whereas running it elsewhere first copies the whole base there (unless an earlier reader
        already did, in which case the placed device is kept).
        """
        schema = getattr(n.target, "_schema", None)
        if schema is not None and any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns):
            return None
        regs = [r for a in (n.args, n.kwargs) for r in _node_regs(a, self.env)]
        homes = set()
        for t in outs_meta:
            key = _storage_key(t)
            root = self.storage_root.get(key) if key is not None else None
            if root is None or self.p.values[root].kind == WEIGHT:
                return None
            match = [r for r in regs if self.p.root(r) == root]
            if not match:
                return None
            if (match[0], placed) in self.transfer_cache:
                return None  # the base is already on the placed device: the view costs nothing there
            homes.add(self.p.values[match[0]].device)
        home = homes.pop() if len(homes) == 1 else None
        if home is not None and self.soc is not None and not self.soc.device(home).supports(op_name(n)):
            return None  # the base's device cannot run this view op (e.g. an NPU without slice): keep the placement
        return home

    # --- node kinds ----------------------------------------------------------------------------
    def placeholder(self, n: torch.fx.Node) -> None:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise LoweringError(f"graph input '{n.name}' is not a tensor ({type(val).__name__}); only tensor "
                                "inputs are supported")
        vid = self.new_value(val, INPUT, self.host, None, n.name)
        self.p.inputs.append(vid)
        self.env[n] = Reg(vid)

    def get_attr(self, n: torch.fx.Node) -> None:
        target = str(n.target)
        obj: Any = self.gm
        for part in target.split("."):
            obj = getattr(obj, part)
        if not isinstance(obj, torch.Tensor):
            raise LoweringError(f"get_attr '{target}' is a {type(obj).__name__}, not a tensor; higher-order ops "
                                "(torch.cond, while_loop) are not supported by the backend")
        val = n.meta.get("val", obj)
        vid = self.new_value(val, WEIGHT, self.host, None, n.name, alias_ok=False)
        key = _storage_key(val)
        if key is not None:
            self.storage_root.setdefault(key, vid)
        # parameters are referenced; buffers and graph constants also travel inline when saved
        self.p.weights[vid] = WeightRef(target, tuple(obj.shape), obj.dtype, "", None, target in self.params)
        self.p.tensors[vid] = obj.detach()
        self.env[n] = Reg(vid)

    def call_function(self, n: torch.fx.Node) -> None:
        name = op_name(n)
        val = n.meta.get("val")
        if name in DROPPED_OPS:
            self.dropped[name] = self.dropped.get(name, 0) + 1
            self.env[n] = None
            return
        if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node):
            src = self.env[n.args[0]]
            if isinstance(src, tuple):
                self.env[n] = src[n.args[1]]
                return
        if isinstance(val, (int, float, bool)) and not isinstance(val, torch.SymInt):
            self.env[n] = val  # a static number (a size read): fold it
            self.dropped["folded-constant"] = self.dropped.get("folded-constant", 0) + 1
            return
        if val is None and not n.users:
            self.dropped[name] = self.dropped.get(name, 0) + 1
            self.env[n] = None
            return
        if isinstance(val, torch.SymInt) or (isinstance(val, torch.Tensor) and any(
                isinstance(s, torch.SymInt) for s in val.shape)):
            raise LoweringError(f"node '{n.name}' ({name}) has a symbolic shape; the backend compiles static "
                                "shapes only (capture without dynamic_dims)")
        if isinstance(val, torch.Tensor):
            outs_meta = [val]
            multi = False
        elif isinstance(val, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in val):
            outs_meta = list(val)
            multi = True
        else:
            raise LoweringError(f"node '{n.name}' ({name}) has no tensor shape metadata (meta['val'] is "
                                f"{type(val).__name__}); run FakeTensorProp on the graph after rewriting it")
        device = self.assignment.get(n.name, self.host)
        if self.rehome_views:
            home = self.view_home(n, outs_meta, device)
            if home is not None and home != device:
                self.rehomed[n.name] = (device, home)
                device = home
        args = tuple(self.map_arg(a, device) for a in n.args)
        kwargs = {k: self.map_arg(v, device) for k, v in n.kwargs.items()}
        iid = len(self.p.instrs)
        # storage roots the inputs live in, keyed by the root the fake tensors know (before any transfer)
        origin: dict[int, int] = {}
        for r in _regs(args, kwargs):
            src = self.transfer_src.get(r, r)
            origin.setdefault(self.p.root(src), self.p.root(r))
        outs = tuple(self.new_value(t, TEMP, device, iid, n.name if not multi else f"{n.name}[{i}]")
                     for i, t in enumerate(outs_meta))
        for o in outs:  # re-point aliases of a transferred input at the copy this device reads
            v = self.p.values[o]
            if v.alias_of is not None:
                a = self.p.root(v.alias_of)
                if a in origin:
                    v.alias_of = origin[a]
                elif self.p.values[a].kind != WEIGHT:
                    v.alias_of = None  # aliases nothing this instruction reads: treat it as fresh storage
        if any(self.p.values[o].alias_of is None for o in outs):
            self.recover_view(n, args, kwargs, outs)
        kind = KERNEL
        schema = getattr(n.target, "_schema", None)
        if schema is not None and any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns):
            kind = INPLACE
        elif outs and all(self.p.values[o].alias_of is not None for o in outs):
            kind = VIEW
        self.p.instrs.append(Instr(iid, name, args, kwargs, outs, device, kind, {"node": n.name}, n.target))
        self.env[n] = tuple(Reg(o) for o in outs) if multi else Reg(outs[0])

    def recover_view(self, n: torch.fx.Node, args: tuple, kwargs: dict, outs: tuple[int, ...]) -> None:
        """Make the outputs of a view op aliases of its input where their fake storage was not recognised: after
        a fusion pass the fused op's output carries a fresh fake tensor while the views after it keep the
        storage of the tensor it replaced, and a layer copied by ``runtime.stamp`` keeps the fake tensors of the
        layer it copies, so such views looked like fresh results (copies). The view is replayed on a meta tensor
        with the input's layout; an output becomes an alias where the replay has its shape and offset and the
        same stride on every dimension longer than one (a length-1 dimension's stride addresses nothing), and
        it takes the replay's strides (what the op returns when the executor runs it)."""
        info = lookup(n.target) if isinstance(n.target, torch._ops.OpOverload) else None
        if info is None or not info.is_view or not args or not isinstance(args[0], Reg):
            return
        src = self.p.values[args[0].id]
        root = self.p.values[self.p.root(args[0].id)]
        if root.kind == WEIGHT or any(self.p.values[o].device != src.device for o in outs):
            return
        try:
            base = torch.empty(max(1, root.numel + root.storage_offset), dtype=src.dtype, device="meta")
            x = base.as_strided(src.shape, src.stride, src.storage_offset)
            got = n.target(x, *args[1:], **kwargs)
        except Exception:  # an argument that is not a plain value (a register), or a view the layout refuses
            return
        got = list(got) if isinstance(got, (list, tuple)) else [got]
        if len(got) != len(outs):
            return
        for o, t in zip(outs, got, strict=True):
            v = self.p.values[o]
            if v.alias_of is None and isinstance(t, torch.Tensor) and v.laid_out_as(t) and \
                    int(t.storage_offset()) == v.storage_offset:
                v.alias_of, v.stride = root.id, tuple(t.stride())

    def output(self, n: torch.fx.Node) -> None:
        flat = n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]]
        outs: list[Any] = []
        for a in flat:
            got = self.map_arg(a, self.host)
            outs.append(got)
        for r in _regs(outs, {}):
            root = self.p.values[self.p.root(r)]
            if root.kind == TEMP:
                root.kind = OUTPUT
        self.p.outputs = outs

    def run(self) -> Program:
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                self.placeholder(n)
            elif n.op == "get_attr":
                self.get_attr(n)
            elif n.op == "call_function":
                self.call_function(n)
            elif n.op == "call_module":
                if str(n.target) == "_guards_fn" or not n.users:
                    self.dropped[f"call_module:{n.target}"] = self.dropped.get(f"call_module:{n.target}", 0) + 1
                    self.env[n] = None
                else:
                    raise LoweringError(f"node '{n.name}' calls submodule '{n.target}'; the backend lowers flat "
                                        "ATen graphs only")
            elif n.op == "output":
                self.output(n)
            else:
                raise LoweringError(f"node '{n.name}' has unsupported op kind '{n.op}'")
        spec = getattr(self.gm, "_out_spec", None)
        if spec is not None:
            try:
                self.p.attrs["out_spec"] = torch.utils._pytree.treespec_dumps(spec)
            except Exception:  # a spec torch cannot serialize just means outputs come back as a flat list
                pass
        self.p.attrs["dropped"] = dict(sorted(self.dropped.items()))
        self.p.attrs["views_rehomed"] = len(self.rehomed)
        return self.p


def _node_regs(a: Any, env: dict) -> list[int]:
    if isinstance(a, torch.fx.Node):
        got = env.get(a)
        if isinstance(got, Reg):
            return [got.id]
        if isinstance(got, tuple):
            return [r.id for r in got if isinstance(r, Reg)]
        return []
    if isinstance(a, (list, tuple)):
        return [r for x in a for r in _node_regs(x, env)]
    if isinstance(a, dict):
        return [r for x in a.values() for r in _node_regs(x, env)]
    return []


def _regs(args: Any, kwargs: Any) -> list[int]:
    return list(iter_regs((args, kwargs)))


def lower(gm: torch.fx.GraphModule, placement=None, soc=None, name: str = "model",
          rehome_views: bool = True) -> LowerResult:
    """Lower ``gm`` under ``placement`` (a :class:`~hetforge.placement.Placement`, a dict node → device, or
    None for everything on the host) for ``soc`` (a SocProfile; None means a lone ``cpu``).

    ``rehome_views``: run a pure view (no bytes written) on the device that holds its base instead of
    the placed one, which would need the whole base copied over first; each such move is counted.
    """
    t0 = time.perf_counter()
    assignment = placement.assignment if hasattr(placement, "assignment") else dict(placement or {})
    low = _Lowerer(gm, assignment, soc, name, rehome_views)
    prog = low.run()
    by_kind: dict[str, int] = {}
    for i in prog.instrs:
        by_kind[i.kind] = by_kind.get(i.kind, 0) + 1
    tr = prog.transfers()
    rep = LowerReport(
        instructions=len(prog.instrs), by_device=prog.count_by_device(), by_kind=by_kind, transfers=len(tr),
        zero_copy_transfers=sum(1 for i in tr if i.attrs.get("zero_copy")),
        transfer_bytes=sum(int(i.attrs.get("bytes", 0)) for i in tr), dropped=dict(prog.attrs["dropped"]),
        views_rehomed=len(low.rehomed), seconds=time.perf_counter() - t0,
    )
    return LowerResult(prog, rep)


__all__ = ["INPLACE", "LowerReport", "LowerResult", "LoweringError", "lower"]
