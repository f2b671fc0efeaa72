"""Test helper: cut a placed FX graph into per-device partitions, in execution order.

The product path builds partitions from a lowered program (:func:`hetforge.hetero.program.partition_program`);
this partitioner of FX graphs is what the backend and runner tests use to make partitions directly.

A *partition* is a maximal run of consecutive nodes (in the given order: the scheduler's, or the graph's
own) that share one device. Each becomes its own ``torch.fx.GraphModule``: its placeholders are the values
it reads from graph inputs or earlier partitions, its output is the tuple of values that later partitions
or the graph's output read. Weights (``get_attr``) are not values that travel: every partition that reads
a weight gets its own ``get_attr`` to the same tensor (resident on that device, moved at most once).

Correctness argument: the order is checked to be topological, so a partition's inputs are all produced
by graph inputs or by earlier partitions; running partitions in order and handing each its inputs computes
every node exactly once on the inputs the original graph gives it.

Normalization before cutting (reported in ``PartitionedGraph.fixups``):

* ``operator.getitem`` follows its producer (tuples never cross a device boundary);
* a node the placement does not name follows the producer of its first input (else the default device);
* ``call_module _guards_fn`` (torch.export's input-shape guard) is dropped: it returns nothing.
"""

from __future__ import annotations

import operator

from torch import fx

# The partition types live with the backends that compile them (imports point down the pipeline).
from hetforge.backends.partition import Partition, PartitionedGraph
from hetforge.errors import UsageError

SKIP_MODULES = ("_guards_fn",)


def _is_compute(n: fx.Node) -> bool:
    if n.op == "call_function":
        return True
    if n.op == "call_module":
        if n.target in SKIP_MODULES:
            return False
        raise UsageError(f"node '{n.name}' calls module '{n.target}': hetero partitions take ATen graphs only")
    return False


def normalize_assignment(gm: fx.GraphModule, assignment: dict[str, str],
                         default: str) -> tuple[dict[str, str], list[str]]:
    """Give every compute node a device: getitem follows its producer, unplaced nodes their first input."""
    out: dict[str, str] = {}
    fixups: list[str] = []
    for n in gm.graph.nodes:
        if not _is_compute(n):
            continue
        producers = [a for a in n.all_input_nodes if a.name in out]
        if n.target is operator.getitem and producers:
            dev = out[producers[0].name]
            if assignment.get(n.name, dev) != dev:
                fixups.append(f"{n.name}: getitem moved to {dev} with its producer {producers[0].name}")
        elif n.name in assignment:
            dev = assignment[n.name]
        else:
            dev = out[producers[0].name] if producers else default
            fixups.append(f"{n.name}: not placed, follows {'input ' + producers[0].name if producers else 'default'}"
                          f" on {dev}")
        out[n.name] = dev
    return out, fixups


def partition_graph(
    gm: fx.GraphModule,
    assignment: dict[str, str],
    order: list[str] | None = None,
    default_device: str = "cpu",
) -> PartitionedGraph:
    """Cut ``gm`` into consecutive same-device partitions following ``order`` (default: graph order).

    ``assignment`` maps node name → device name (a :class:`~hetforge.placement.Placement`'s ``assignment``).
    ``order`` lists compute-node names in execution order (e.g. from the scheduled Program); it must be a
    topological order of those nodes, else a UsageError names the first node read before it is computed.
    """
    devices, fixups = normalize_assignment(gm, assignment, default_device)
    by_name = {n.name: n for n in gm.graph.nodes}
    compute = [n.name for n in gm.graph.nodes if _is_compute(n)]
    if order is None:
        order = compute
    else:
        missing = set(compute) - set(order)
        unknown = [o for o in order if o not in devices]
        if unknown:
            raise UsageError(f"execution order names {len(unknown)} node(s) not in the graph, e.g. '{unknown[0]}'")
        # nodes the order omits (e.g. no-op asserts) run where their graph position puts them: after the
        # last of their inputs in ``order``; we append them right after their latest input.
        order = _merge_missing(order, [c for c in compute if c in missing], by_name)
    _check_topological(order, by_name)

    runs: list[tuple[str, list[str]]] = []
    for name in order:
        dev = devices[name]
        if runs and runs[-1][0] == dev:
            runs[-1][1].append(name)
        else:
            runs.append((dev, [name]))

    owner = {name: i for i, (_, names) in enumerate(runs) for name in names}
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    graph_out = {a.name for a in output_node.all_input_nodes}
    partitions = []
    for i, (dev, names) in enumerate(runs):
        partitions.append(_build_partition(gm, i, dev, names, by_name, owner, graph_out))
    output_args = fx.node.map_arg(output_node.args[0], lambda a: a.name)
    graph_inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    out_spec = getattr(gm, "_out_spec", None)
    return PartitionedGraph(partitions, graph_inputs, output_args, out_spec, gm, fixups)


def _merge_missing(order: list[str], missing: list[str], by_name: dict[str, fx.Node]) -> list[str]:
    result = list(order)
    for name in missing:  # graph order, so each missing node's missing inputs are already placed
        pos = {n: i for i, n in enumerate(result)}
        deps = [pos[a.name] for a in by_name[name].all_input_nodes if a.name in pos]
        result.insert(max(deps) + 1 if deps else 0, name)
    return result


def _check_topological(order: list[str], by_name: dict[str, fx.Node]) -> None:
    done: set[str] = set()
    for name in order:
        for a in by_name[name].all_input_nodes:
            if a.op in ("placeholder", "get_attr"):
                continue
            if a.op == "call_module" and a.target in SKIP_MODULES:
                continue
            if a.name not in done:
                raise UsageError(f"execution order is not topological: '{name}' reads '{a.name}' before it is computed")
        done.add(name)


def _build_partition(
    gm: fx.GraphModule, index: int, device: str, names: list[str], by_name: dict[str, fx.Node],
    owner: dict[str, int], graph_out: set[str],
) -> Partition:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    members = set(names)
    inputs: list[str] = []
    weights: list[str] = []
    for name in names:  # placeholders first, in first-use order
        for a in by_name[name].all_input_nodes:
            if a.op == "get_attr" or a.name in members or a in env:
                continue
            ph = g.placeholder(a.name)
            ph.meta = dict(a.meta)
            env[a] = ph
            inputs.append(a.name)
    for name in names:
        n = by_name[name]
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                ga = g.get_attr(str(a.target))
                ga.meta = dict(a.meta)
                env[a] = ga
                weights.append(str(a.target))
        env[n] = g.node_copy(n, lambda a: env[a])
    outputs = [
        name for name in names
        if name in graph_out or any(u.op != "output" and owner.get(u.name, index) != index for u in by_name[name].users)
    ]
    g.output(tuple(env[by_name[o]] for o in outputs))
    sub = fx.GraphModule(gm, g, class_name=f"Partition{index}")
    return Partition(index, device, list(names), sub, inputs, outputs, weights)
