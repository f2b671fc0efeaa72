"""Cut a captured graph into per-stage graph modules at layer boundaries (``torch.fx`` ``split_module``).

Each graph node goes to the stage that holds its decoder layer (the embedding stage's nodes to the stage
marked ``embed``, the head's to the one marked ``head``). ``split_module`` turns each stage into a
``GraphModule`` holding only its own weights, whose inputs are graph inputs (token ids, positions, the
stage's own KV cache buffers) and values made by earlier stages, and whose outputs are what later stages or
the caller read. :class:`StageGraph` records that wiring by name, so a node actor can be handed its stage
alone and fed activations from the previous one through Ray.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx.passes.split_module import split_module

from hetforge.placement.layers import EMBED, HEAD, group_stages


@dataclass
class StageGraph:
    """One stage's graph module and its wiring (names of the split graph's values)."""

    index: int
    gm: torch.fx.GraphModule
    inputs: list[str]  # each a graph placeholder name or "s{j}.{k}" (output k of stage j)
    outputs: int  # how many values it returns (a tuple)
    nodes: int = 0
    out_names: list[str] = field(default_factory=list)  # the name of each returned value ("s{j}.{k}")


@dataclass
class SplitGraph:
    """The stages in run order and where each final output of the whole graph comes from."""

    stages: list[StageGraph]
    placeholders: list[str]
    results: list[str]  # per graph output: a placeholder name or "s{j}.{k}"
    crossing: dict[str, int] = field(default_factory=dict)  # value "s{j}.{k}" → bytes (from example run)


def stage_of_nodes(gm: torch.fx.GraphModule, layer_stage: dict[int, int], embed_stage: int,
                   head_stage: int) -> dict[str, int]:
    groups = group_stages(gm)
    out: dict[str, int] = {}
    for name, st in groups.of.items():
        if st == EMBED:
            out[name] = embed_stage
        elif st == HEAD:
            out[name] = head_stage
        else:
            out[name] = layer_stage[int(st.split(".")[1])]
    return out


def split_stages(gm: torch.fx.GraphModule, layer_stage: dict[int, int], embed_stage: int,
                 head_stage: int) -> SplitGraph:
    """Split ``gm`` so that stage ``k`` holds the nodes of the layers ``layer_stage`` maps to ``k``."""
    for n in list(gm.graph.nodes):  # torch.export's input-guard call reads every input: not part of any stage
        if n.op == "call_module" and str(n.target).startswith("_guards") and not n.users:
            gm.graph.erase_node(n)
    gm.recompile()
    where = stage_of_nodes(gm, layer_stage, embed_stage, head_stage)
    parent = split_module(gm, None, lambda n: where.get(n.name, embed_stage), keep_original_order=True)
    env: dict[str, str] = {}
    stages: list[StageGraph] = []
    placeholders: list[str] = []
    results: list[str] = []
    consts: set[str] = set()
    for n in parent.graph.nodes:
        if n.op == "get_attr":  # a weight the parent kept (e.g. one used by two stages): each stage owns a copy
            consts.add(n.name)
        elif n.op == "placeholder":
            env[n.name] = n.name
            placeholders.append(n.name)
        elif n.op == "call_module":
            j = len(stages)
            sub = getattr(parent, n.target)
            _own_constants(parent, sub, n, consts)
            ins = [env[a.name] for a in n.args if a.name not in consts]
            out_node = next(x for x in sub.graph.nodes if x.op == "output")
            ret = out_node.args[0]
            multi = isinstance(ret, (tuple, list))
            if not multi:  # make every stage return a tuple
                out_node.args = ((ret,),)
                sub.recompile()
            k = len(ret) if multi else 1
            stages.append(StageGraph(j, sub, ins, k, sum(1 for x in sub.graph.nodes if x.op == "call_function"),
                                     [f"s{j}.{i}" for i in range(k)]))
            env[n.name] = f"s{j}"
            if not multi:
                env[n.name] = f"s{j}.0"
        elif n.op == "call_function" and n.target is operator.getitem:
            env[n.name] = f"{env[n.args[0].name]}.{n.args[1]}"
        elif n.op == "output":
            outs = n.args[0]
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            results = [env[o.name] for o in outs]
    return SplitGraph(stages, placeholders, results)


def _own_constants(parent: torch.fx.GraphModule, sub: torch.fx.GraphModule, call: torch.fx.Node,
                   consts: set[str]) -> None:
    """Turn the stage's placeholders fed by parent ``get_attr`` nodes into the stage's own attributes."""
    phs = [x for x in sub.graph.nodes if x.op == "placeholder"]
    changed = False
    for ph, a in zip(phs, call.args, strict=True):
        if a.name not in consts:
            continue
        t = parent
        for part in a.target.split("."):
            t = getattr(t, part)
        attr = "const_" + a.target.replace(".", "_")
        if isinstance(t, torch.nn.Parameter):
            sub.register_parameter(attr, t)
        else:
            sub.register_buffer(attr, t)
        with sub.graph.inserting_before(ph):
            g = sub.graph.get_attr(attr)
        g.meta = dict(ph.meta)
        ph.replace_all_uses_with(g)
        sub.graph.erase_node(ph)
        changed = True
    if changed:
        sub.recompile()


def fold_constant_outputs(sg: SplitGraph, vals: dict[str, torch.Tensor]) -> list[str]:
    """Stage outputs that depend on no input (e.g. a prefill's rotary tables and causal mask) become constants
    of the stages that read them: they never cross the network, and no stage returns a value that constant
    folding would leave without a producer. ``vals`` holds their values (from :func:`run_split`)."""
    const: dict[str, torch.Tensor] = {}
    for st in sg.stages:
        out_node = next(x for x in st.gm.graph.nodes if x.op == "output")
        rets = list(out_node.args[0])
        keep = []
        for name, r in zip(st.out_names, rets, strict=True):
            if isinstance(r, torch.fx.Node) and not _reads_input(r) and name not in sg.results:
                const[name] = vals[name]
            else:
                keep.append((name, r))
        if len(keep) < len(rets):
            out_node.args = (tuple(r for _, r in keep),)
            st.gm.graph.eliminate_dead_code()
            st.gm.recompile()
            st.out_names = [n for n, _ in keep]
            st.outputs = len(keep)
    for st in sg.stages:
        phs = {x.name: x for x in st.gm.graph.nodes if x.op == "placeholder"}
        new_inputs = []
        changed = False
        for ph_name, src in zip(list(phs), list(st.inputs), strict=True):
            if src not in const:
                new_inputs.append(src)
                continue
            attr = "const_" + src.replace(".", "_")
            st.gm.register_buffer(attr, const[src].detach().clone())
            ph = phs[ph_name]
            with st.gm.graph.inserting_before(ph):
                g = st.gm.graph.get_attr(attr)
            g.meta = dict(ph.meta)
            ph.replace_all_uses_with(g)
            st.gm.graph.erase_node(ph)
            changed = True
        if changed:
            st.gm.recompile()
            st.inputs = new_inputs
    return sorted(const)


def _reads_input(node: torch.fx.Node) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            return True
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return False


def run_split(sg: SplitGraph, args: tuple) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Run every stage in one process (the reference, and how example inputs of each stage are found)."""
    vals: dict[str, torch.Tensor] = dict(zip(sg.placeholders, args, strict=True))
    for st in sg.stages:
        with torch.no_grad():
            out = st.gm(*[vals[i] for i in st.inputs])
        for name, v in zip(st.out_names, out, strict=True):
            vals[name] = v
    return [vals[r] for r in sg.results], vals
