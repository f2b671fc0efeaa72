"""Group graph nodes into stages: the embedding stage, decoder layers 0..L-1, and the LM-head stage.

A node's decoder layer comes from the innermost ``nn_module_stack`` entry naming ``…layers.N`` (Llama,
Mixtral, Qwen2), ``…h.N`` (GPT-2) or ``…blocks.N``/``…layer.N``. A node without one (passes may create
nodes without a module stack) takes the highest layer among its inputs. Nodes with no layer that come
before every layer node are the *embedding* stage (token embedding, positions, masks, rotary tables);
those after are the *head* stage (final norm, LM head). ``get_attr`` nodes (weights) belong to the
stage of their first user; placeholders to the embedding stage and the output node to the head.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

EMBED = "embed"
HEAD = "head"
_LAYER = re.compile(r"\.(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")


def layer_index(node: torch.fx.Node) -> int | None:
    """The decoder-layer index recorded in the node's ``nn_module_stack``, or None."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        m = _LAYER.search("." + str(path))
        if m:
            return int(m.group(1))
    return None


@dataclass
class Stages:
    """node name → stage name (``embed``, ``layer.N``, ``head``) and the node lists per stage, in graph order."""

    of: dict[str, str]
    members: dict[str, list[str]] = field(default_factory=dict)
    num_layers: int = 0

    def layer(self, i: int) -> list[str]:
        return self.members.get(f"layer.{i}", [])


def stage_key(i: int) -> str:
    return f"layer.{i}"


def group_stages(gm: torch.fx.GraphModule) -> Stages:
    """Assign every node of ``gm`` to a stage (see module docstring)."""
    nodes = list(gm.graph.nodes)
    idx: dict[str, int | None] = {}
    for n in nodes:
        if n.op != "call_function":
            continue
        li = layer_index(n)
        if li is None:
            ins = [idx.get(a.name) for a in n.all_input_nodes]
            known = [i for i in ins if i is not None]
            li = max(known) if known and n.meta.get("nn_module_stack") is None else None
        idx[n.name] = li
    positions = [i for i, n in enumerate(nodes) if idx.get(n.name) is not None]
    first, last = (positions[0], positions[-1]) if positions else (len(nodes), -1)
    of: dict[str, str] = {}
    for i, n in enumerate(nodes):
        if n.op == "call_function":
            li = idx[n.name]
            if li is not None:
                of[n.name] = stage_key(li)
            elif i < first:
                of[n.name] = EMBED
            elif i > last:
                of[n.name] = HEAD
            else:  # unlabelled node between layers: the stage of its latest input, else of its first user
                srcs = [of[a.name] for a in n.all_input_nodes if a.name in of and of[a.name].startswith("layer.")]
                of[n.name] = srcs[-1] if srcs else EMBED
        elif n.op == "placeholder":
            of[n.name] = EMBED
        elif n.op == "output":
            of[n.name] = HEAD
    for n in nodes:
        if n.op in ("get_attr", "call_module"):
            users = [u for u in n.users if u.name in of]
            of[n.name] = of[users[0].name] if users else EMBED
    members: dict[str, list[str]] = {}
    for n in nodes:
        members.setdefault(of[n.name], []).append(n.name)
    layers = sorted({int(s.split(".")[1]) for s in of.values() if s.startswith("layer.")})
    return Stages(of, members, (layers[-1] + 1) if layers else 0)
