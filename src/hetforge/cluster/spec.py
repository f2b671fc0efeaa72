"""Cluster profiles: which nodes (each an SoC profile) and which network links between them.

A cluster file is YAML (or JSON, a subset)::

    name: orin-nano-x2-gbe
    description: two Jetson Orin Nano 8GB boards on a gigabit Ethernet switch
    home: a                     # the node that holds the embedding and LM head (default: the first node)
    nodes:
      - {name: a, soc: jetson-orin-nano}    # a shipped SoC name, ``host``, or a profile .json path
      - name: b                             #   (a relative path is read from the cluster file's folder)
        soc: jetson-orin-nano
        reserved_bytes: {value: 1.5e9, source: "...", estimate: true}   # kept by the OS/runtime (default 0)
    links:                      # every pair of nodes needs a link, or ``default_link`` covers the rest
      - a: a
        b: b
        bandwidth: {value: 1.17e8, source: "..."}               # bytes/s
        latency_s: {value: 1.0e-4, source: "...", estimate: true}
        energy_per_byte_j: {value: 1.0e-8, source: "...", estimate: true}

Every number carries its source (``estimate: true`` marks an assumed or derived figure), as in SoC profiles.
A node naming an unknown SoC, or a link naming an unknown node, is a usage error naming it (exit 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetforge.errors import UsageError
from hetforge.hardware.profile import LinkProfile, SocProfile, by_name
from hetforge.hardware.schema import Figure, PositiveFigure, format_validation_error

NAME = r"^[a-z][a-z0-9_-]*$"


class NodeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, pattern=NAME)
    soc: str = Field(min_length=1)
    description: str = ""
    reserved_bytes: Figure | None = None  # memory the node's OS and runtime keep (not available to the model)
    memory_bytes: PositiveFigure | None = None  # this machine's DRAM when smaller than its SoC profile's maximum


class DefaultLinkSpec(BaseModel):
    """A network path's figures: the link between every pair of nodes the file does not name."""

    model_config = ConfigDict(extra="forbid")

    kind: str = "network"
    bandwidth: PositiveFigure
    latency_s: Figure
    energy_per_byte_j: Figure


class NetLinkSpec(DefaultLinkSpec):
    """A network path between two nodes."""

    a: str
    b: str


class ClusterSpec(BaseModel):
    """A whole cluster file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    description: str = ""
    source: str = ""
    home: str | None = None
    nodes: list[NodeSpec] = Field(min_length=1)
    links: list[NetLinkSpec] = Field(default_factory=list)
    default_link: DefaultLinkSpec | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ClusterSpec:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be unique, got {names}")
        if self.home is not None and self.home not in names:
            raise ValueError(f"home node '{self.home}' is not a node; nodes are {names}")
        return self


@dataclass(frozen=True)
class Node:
    name: str
    soc: SocProfile
    soc_ref: str  # what the file said (a shipped name, host, or a path)
    reserved: int = 0  # bytes the OS/runtime keep
    installed: int | None = None  # the machine's DRAM (bytes) when the file gives it

    @property
    def memory(self) -> int:
        """Bytes the model may use on this node: its DRAM (the file's ``memory_bytes``, else the SoC profile's)
        less what the OS and runtime keep."""
        total = node_memory(self.soc) if self.installed is None else min(self.installed, node_memory(self.soc))
        return max(0, total - self.reserved)

    @property
    def label(self) -> str:
        """The Ray custom resource that marks this node's process."""
        return resource_label(self.name)


def resource_label(node: str) -> str:
    return f"hetforge-node-{node}"


@dataclass
class Cluster:
    """Validated nodes (SoC profiles loaded) and node-to-node links (as :class:`LinkProfile`, with sources)."""

    name: str
    nodes: list[Node]
    links: list[LinkProfile]
    home: str
    description: str = ""
    path: str = ""
    link_sources: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def node(self, name: str) -> Node:
        return by_name(self.nodes, name, f"cluster '{self.name}'", "node")

    def link(self, a: str, b: str) -> LinkProfile:
        if a == b:
            return LinkProfile(a, b, float("inf"), 0.0, True, 0.0)
        for ln in self.links:
            if {ln.a, ln.b} == {a, b}:
                return ln
        raise UsageError(f"cluster '{self.name}' has no link between '{a}' and '{b}'")

    def without(self, dead: set[str]) -> Cluster:
        """The cluster of the surviving nodes (home moves to the first survivor when it died)."""
        nodes = [n for n in self.nodes if n.name not in dead]
        if not nodes:
            raise UsageError(f"cluster '{self.name}': no node survives")
        home = self.home if self.home not in dead else nodes[0].name
        links = [ln for ln in self.links if ln.a not in dead and ln.b not in dead]
        return Cluster(self.name, nodes, links, home, self.description, self.path, self.link_sources)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "path": self.path, "home": self.home,
                "nodes": [{"name": n.name, "soc": n.soc.name, "soc_ref": n.soc_ref,
                           "devices": n.soc.device_names, "memory_bytes": node_memory(n.soc),
                           "reserved_bytes": n.reserved, "model_bytes": n.memory} for n in self.nodes],
                "links": [{"a": ln.a, "b": ln.b, "bandwidth": ln.bandwidth, "latency_s": ln.latency_s,
                           "energy_per_byte_j": ln.energy_per_byte_j,
                           "sources": self.link_sources.get((ln.a, ln.b), {})} for ln in self.links]}


def node_memory(soc: SocProfile) -> int:
    """Bytes of memory an SoC has: its largest memory pool (devices joined by a unified link share one pool; the
    shipped SoCs' devices all sit on the package's one DRAM, so pools are not added up)."""
    pool = {d.name: d.name for d in soc.devices}
    for ln in soc.links:
        if ln.unified:
            a, b = pool[ln.a], pool[ln.b]
            for k, v in list(pool.items()):
                if v == b:
                    pool[k] = a
    cap: dict[str, int] = {}
    for d in soc.devices:
        p = pool[d.name]
        cap[p] = min(cap.get(p, d.mem_capacity), d.mem_capacity)
    return int(max(cap.values()))


def shipped_clusters() -> dict[str, Any]:
    root = resources.files("hetforge.cluster") / "profiles"
    return dict(sorted((f.name.rsplit(".", 1)[0], f) for f in root.iterdir() if f.name.endswith(".yaml")))


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A shipped cluster by name, or a cluster file by path; validated, every node's SoC profile loaded."""
    shipped = shipped_clusters()
    key = str(name_or_path)
    if key in shipped:
        return _parse(shipped[key].read_text(), f"{key} (shipped)", None)
    p = Path(name_or_path)
    if not p.exists() and p.suffix not in (".yaml", ".yml", ".json"):
        raise UsageError(f"unknown cluster '{key}'; shipped: {', '.join(shipped)} (or a path to a cluster .yaml)")
    from hetforge.files import check_input_file

    check_input_file(p, "cluster file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or "not UTF-8 text"
        raise UsageError(f"cannot read cluster file '{p}': {why}") from None
    return _parse(text, str(p), p.parent)


def _parse(text: str, label: str, base: Path | None) -> Cluster:
    import yaml

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"invalid cluster file '{label}': not valid YAML{where}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"invalid cluster file '{label}': expected a mapping with 'name', 'nodes' and 'links'")
    try:
        spec = ClusterSpec.model_validate(raw)
    except ValidationError as e:
        raise UsageError(format_validation_error(label, e).replace("invalid SoC profile", "invalid cluster file",
                                                                   1)) from None
    return build_cluster(spec, label, base)


def _soc(ref: str, base: Path | None, node: str, label: str) -> SocProfile:
    from hetforge.hardware import load_soc
    from hetforge.hardware.loader import list_socs

    if ref not in list_socs() and base is not None and not Path(ref).is_absolute() and (base / ref).exists():
        ref = str(base / ref)
    try:
        return load_soc(ref)
    except UsageError as e:
        raise UsageError(f"cluster file '{label}': node '{node}' names SoC '{ref}': {e}") from None


def build_cluster(spec: ClusterSpec, label: str, base: Path | None = None) -> Cluster:
    names = [n.name for n in spec.nodes]
    nodes = [Node(n.name, _soc(n.soc, base, n.name, label), n.soc,
                  int(n.reserved_bytes.value) if n.reserved_bytes is not None else 0,
                  int(n.memory_bytes.value) if n.memory_bytes is not None else None) for n in spec.nodes]
    links: list[LinkProfile] = []
    sources: dict[tuple[str, str], dict[str, Any]] = {}
    seen: set[frozenset[str]] = set()
    for ln in spec.links:
        for end in (ln.a, ln.b):
            if end not in names:
                raise UsageError(f"cluster file '{label}': link {ln.a}<->{ln.b} names unknown node '{end}'; "
                                 f"nodes are {', '.join(names)}")
        if ln.a == ln.b:
            raise UsageError(f"cluster file '{label}': link {ln.a}<->{ln.b} joins a node to itself")
        pair = frozenset((ln.a, ln.b))
        if pair in seen:
            raise UsageError(f"cluster file '{label}': two links between '{ln.a}' and '{ln.b}'")
        seen.add(pair)
        links.append(LinkProfile(ln.a, ln.b, ln.bandwidth.value, ln.latency_s.value, False, ln.energy_per_byte_j.value))
        sources[(ln.a, ln.b)] = {k: getattr(ln, k).model_dump() for k in ("bandwidth", "latency_s",
                                                                          "energy_per_byte_j")}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if frozenset((a, b)) in seen:
                continue
            d = spec.default_link
            if d is None:
                raise UsageError(f"cluster file '{label}': no link between nodes '{a}' and '{b}' (give one, or a "
                                 "default_link for every pair not listed)")
            links.append(LinkProfile(a, b, d.bandwidth.value, d.latency_s.value, False, d.energy_per_byte_j.value))
            sources[(a, b)] = {k: getattr(d, k).model_dump() for k in ("bandwidth", "latency_s", "energy_per_byte_j")}
    return Cluster(spec.name, nodes, links, spec.home or names[0], spec.description, label, sources)


def cluster_json(cluster: Cluster) -> str:
    return json.dumps(cluster.to_dict(), indent=1)
