"""Partitions from a scheduled :class:`~hetforge.ir.Program` (what ``hetforge compile`` saves in a plan).

The Program's instruction order is the execution order the scheduler chose (device affinity first). Each
maximal run of consecutive non-transfer instructions on one device becomes one partition; each partition is
rebuilt as its own ``torch.fx`` GraphModule from the instructions (op target, register arguments, constants),
so any backend — the executor, OpenVINO, CUDA — can compile it. Transfer instructions mark the boundaries:
the runner performs them (one per value and destination, as lowering counted them), so a transfer's output
register is read as its source register here.

Every rebuilt node carries ``meta['val']`` as a ``meta``-device tensor with the register's shape, stride and
dtype, a view into one meta storage per storage root of the Program — also for roots made by an earlier
partition — so lowering a partition again recognises every view, including views of its inputs. Node names
are the FX names lowering recorded (``attrs['node']``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from hetforge.backends.partition import Partition, PartitionedGraph
from hetforge.ir.program import TRANSFER, Program, map_regs


def _vname(vid: int) -> str:
    return f"v{vid}"


def partition_program(p: Program) -> PartitionedGraph:
    """Cut ``p`` (in its current order) into consecutive same-device partitions, each an FX GraphModule."""
    source: dict[int, int] = {}

    def resolve(r: int) -> int:
        while r in source:
            r = source[r]
        return r

    runs: list[tuple[str, list[Any]]] = []
    for ins in p.instrs:
        if ins.kind == TRANSFER:
            source[ins.outputs[0]] = ins.input_regs()[0]
            continue
        if runs and runs[-1][0] == ins.device:
            runs[-1][1].append(ins)
        else:
            runs.append((ins.device, [ins]))
    owner = {o: k for k, (_, instrs) in enumerate(runs) for ins in instrs for o in ins.outputs}
    graph_out = {resolve(r) for r in p.output_regs()}
    read_by: dict[int, set[int]] = {}
    for k, (_, instrs) in enumerate(runs):
        for ins in instrs:
            for r in ins.input_regs():
                read_by.setdefault(resolve(r), set()).add(k)
    parts = [_build(p, k, dev, instrs, resolve, owner, graph_out, read_by) for k, (dev, instrs) in enumerate(runs)]
    out_args = map_regs(list(p.outputs), lambda r: _vname(resolve(r.id)))
    spec = p.attrs.get("out_spec")
    out_spec = torch.utils._pytree.treespec_loads(spec) if spec else None
    return PartitionedGraph(parts, [_vname(v) for v in p.inputs], out_args, out_spec, None,
                            [f"from program '{p.name}' ({len(p.instrs)} instructions, "
                             f"{len(p.transfers())} transfers)"])


def _meta(p: Program, vid: int, bases: dict[int, torch.Tensor]) -> torch.Tensor:
    """A meta tensor for register ``vid``: a view into one meta storage per root, so aliases share storage."""
    v = p.values[vid]
    root = p.root(vid)
    r = p.values[root]
    key = root if r.dtype == v.dtype else -1 - vid  # a dtype-reinterpreting view gets its own storage
    if key not in bases:
        src = r if key == root else v
        bases[key] = torch.empty(max(src.nbytes // max(src.itemsize, 1), 1), dtype=src.dtype, device="meta")
    return bases[key].as_strided(v.shape, v.stride, v.storage_offset)


def _build(p: Program, index: int, device: str, instrs: list[Any], resolve, owner: dict[int, int],
           graph_out: set[int], read_by: dict[int, set[int]]) -> Partition:
    g = fx.Graph()
    env: dict[int, fx.Node] = {}
    metas: dict[int, torch.Tensor] = {}  # root id → meta storage
    weights: dict[str, torch.Tensor] = {}
    inputs: list[str] = []
    defined = {o for ins in instrs for o in ins.outputs}
    for ins in instrs:  # placeholders first, in first-use order
        for r in ins.input_regs():
            src = resolve(r)
            if src in env or src in defined or src in p.weights:
                continue
            node = g.placeholder(_vname(src))
            node.meta["val"] = _meta(p, src, metas)
            env[src] = node
            inputs.append(_vname(src))
    for ins in instrs:
        for r in ins.input_regs():
            src = resolve(r)
            if src in p.weights and src not in env:
                path = p.weights[src].path
                weights[path] = p.tensors[src]
                node = g.get_attr(path)
                node.meta["val"] = _meta(p, src, metas)
                env[src] = node
    node_names: list[str] = []
    for ins in instrs:
        args = map_regs(ins.args, lambda r: env[resolve(r.id)])
        kwargs = map_regs(ins.kwargs, lambda r: env[resolve(r.id)])
        name = str(ins.attrs.get("node") or f"i{ins.id}")
        node = g.create_node("call_function", ins.target, tuple(args), kwargs, name=name)
        node_names.append(node.name)
        outs = [_meta(p, o, metas) for o in ins.outputs]
        multi = len(ins.outputs) > 1 or _returns_sequence(ins.target)
        node.meta["val"] = outs if multi else outs[0]
        if multi:
            for i, o in enumerate(ins.outputs):
                item = g.call_function(operator.getitem, (node, i))
                item.meta["val"] = outs[i]
                env[o] = item
        else:
            env[ins.outputs[0]] = node
    outputs = [o for ins in instrs for o in ins.outputs
               if o in graph_out or any(k != index for k in read_by.get(o, ()))]
    g.output(tuple(env[o] for o in outputs))
    gm = _graph_module(weights, g, f"Partition{index}")
    return Partition(index, device, node_names, gm, inputs, [_vname(o) for o in outputs], list(weights))


def _graph_module(weights: dict[str, torch.Tensor], g: fx.Graph, name: str) -> fx.GraphModule:
    """The partition's GraphModule, its Python code generated on first use only: the CPU executor lowers the
    graph itself and never calls it (generating the code was ~10% of building a cached program)."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # an older torch: generate now
        return fx.GraphModule(weights, g, class_name=name)
    return _LazyGraphModule(weights, g, class_name=name)


def _returns_sequence(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    rets = schema.returns
    return len(rets) > 1 or (len(rets) == 1 and str(rets[0].type).endswith("[]"))

