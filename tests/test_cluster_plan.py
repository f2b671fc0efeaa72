"""Cluster profiles and placement across nodes (no Ray): validation, memory per node, the network in the cost."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hetforge.cluster.spec import load_cluster, node_memory, shipped_clusters
from hetforge.errors import HetforgeError, UsageError

LINK = ("  - a: a\n    b: b\n    bandwidth: {value: 1.0e8, source: test}\n"
        "    latency_s: {value: 1.0e-4, source: test}\n"
        "    energy_per_byte_j: {value: 1.0e-8, source: test, estimate: true}\n")


def _write(tmp_path, text: str, name: str = "c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def two(soc: str, link: str = LINK) -> str:
    """A two-node cluster file (nodes a and b on ``soc``)."""
    return f"name: two\nnodes:\n  - {{name: a, soc: {soc}}}\n  - {{name: b, soc: {soc}}}\nlinks:\n" + link


def small_soc(tmp_path, capacity: int, name: str = "tiny-host") -> str:
    """A user SoC profile: the built-in host profile with ``capacity`` bytes of memory per device."""
    from hetforge.hardware import load_soc

    spec = json.loads(json.dumps(load_soc("host").spec))
    spec["name"] = name
    for d in spec["devices"]:
        d["mem_capacity"] = {"value": capacity, "source": "test: a node too small for the whole model"}
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(spec))
    return str(p)


def test_shipped_clusters_load_with_a_source_for_every_link_figure():
    names = list(shipped_clusters())
    assert {"orin-nano-x2-gbe", "orin-nano-x4-gbe", "laptop-orin-wifi"} <= set(names)
    for n in names:
        c = load_cluster(n)
        assert len(c.nodes) >= 2
        for ln in c.links:
            src = c.link_sources[(ln.a, ln.b)]
            assert set(src) == {"bandwidth", "latency_s", "energy_per_byte_j"}
            assert all(v["source"] for v in src.values())
        # every pair of nodes has a link
        for i, a in enumerate(c.node_names):
            for b in c.node_names[i + 1:]:
                assert c.link(a, b).bandwidth > 0
    four = load_cluster("orin-nano-x4-gbe")
    assert len(four.links) == 6 and node_memory(four.nodes[0].soc) == 8 * 2**30


def test_unknown_soc_and_unknown_link_node_are_usage_errors_naming_them(tmp_path):
    p = _write(tmp_path, "name: x\nnodes:\n  - {name: a, soc: jetson-orin-nano}\n  - {name: b, soc: orin-9000}\n"
               "links:\n" + LINK)
    with pytest.raises(UsageError, match="node 'b' names SoC 'orin-9000'"):
        load_cluster(p)
    p = _write(tmp_path, "name: x\nnodes:\n  - {name: a, soc: host}\n  - {name: b, soc: host}\nlinks:\n"
               + LINK.replace("b: b", "b: z"))
    with pytest.raises(UsageError, match="unknown node 'z'"):
        load_cluster(p)
    p = _write(tmp_path, "name: x\nnodes:\n  - {name: a, soc: host}\n  - {name: b, soc: host}\n")
    with pytest.raises(UsageError, match="no link between nodes 'a' and 'b'"):
        load_cluster(p)
    p = _write(tmp_path, "name: x\nnodes:\n  - {name: a, soc: host}\nlinks: []\nbogus: 1\n")
    with pytest.raises(UsageError, match="bogus"):
        load_cluster(p)


def test_relative_soc_path_is_read_from_the_cluster_files_folder(tmp_path):
    soc = small_soc(tmp_path, 2**30)
    p = _write(tmp_path, f"name: x\nnodes:\n  - {{name: a, soc: {tmp_path.name and 'tiny-host.json'}}}\n"
               "  - {name: b, soc: host}\nlinks:\n" + LINK)
    c = load_cluster(p)
    assert c.node("a").soc.name == "tiny-host" and c.node("a").soc.path == soc


@pytest.fixture(scope="module")
def demo():
    from hetforge.models.zoo import load_model

    return load_model("demo")


def test_split_stages_run_equals_the_whole_graph(demo):
    from hetforge.cluster.models import decode_graph
    from hetforge.cluster.split import run_split, split_stages

    gm, resident = decode_graph(demo, 32)
    args = [torch.tensor([[7]]), torch.tensor([[3]])]
    args += [torch.randn(tuple(n.meta["val"].shape)) for n in gm.graph.nodes if n.name in resident]
    ref = gm(*args)
    sg = split_stages(gm, {0: 0, 1: 0, 2: 1, 3: 1, 4: 1}, 0, 2)
    assert len(sg.stages) == 3
    # the second stage reads activations of the first and only its own layers' cache buffers
    assert any(i.startswith("s0.") for i in sg.stages[1].inputs)
    assert {i for i in sg.stages[1].inputs if i.startswith("cache_")} == {f"cache_{k}" for k in range(4, 10)}
    out, _ = run_split(sg, tuple(args))
    for a, b in zip(ref, out, strict=True):
        assert torch.equal(a, b)


def test_model_that_fits_no_node_is_split_and_memory_per_node_holds(tmp_path, demo):
    from hetforge.cluster.models import plan_loaded

    need = sum(p.numel() * p.element_size() for p in demo.model.parameters())
    soc = small_soc(tmp_path, int(need * 0.7))
    p = _write(tmp_path, two(soc))
    plan = plan_loaded(demo, load_cluster(p), "latency", context=64)
    assert len({s.node for s in plan.stages}) == 2
    for n, m in plan.memory.items():
        assert 0 < m["used"] <= m["capacity"], n
    assert plan.hops and plan.wire_bytes > 0
    assert any("does not fit" in e for e in plan.explain)  # one node alone cannot hold it
    assert any(e.startswith("cut before layer") for e in plan.explain)
    # the network hop is costed as latency + bytes / bandwidth and bytes x energy per byte
    h = plan.hops[0]
    assert h.modeled_s == pytest.approx(1e-4 + h.nbytes / 1e8)
    assert h.modeled_j == pytest.approx(h.nbytes * 1e-8)
    assert plan.modeled_s == pytest.approx(sum(s.modeled_s for s in plan.stages) + sum(x.modeled_s for x in plan.hops))


def test_model_larger_than_the_whole_cluster_names_bytes_needed_and_available(tmp_path, demo):
    from hetforge.cluster.models import plan_loaded

    soc = small_soc(tmp_path, 2**20)
    p = _write(tmp_path, two(soc))
    with pytest.raises(HetforgeError, match=r"needs [\d,]+ bytes .* have 2,097,152 bytes"):
        plan_loaded(demo, load_cluster(p), "latency", context=64)


def test_slower_network_costs_more_per_token_for_the_same_split(tmp_path, demo):
    from hetforge.cluster.models import plan_loaded

    fast = _write(tmp_path, two("host"), "f.yaml")
    slow = _write(tmp_path, "name: s\nnodes:\n  - {name: a, soc: host}\n  - {name: b, soc: host}\nlinks:\n"
                  + LINK.replace("1.0e8", "1.0e6").replace("latency_s: {value: 1.0e-4", "latency_s: {value: 5.0e-3"),
                  "s.yaml")
    pf = plan_loaded(demo, load_cluster(fast), "latency", context=64, spread=True)
    ps = plan_loaded(demo, load_cluster(slow), "latency", context=64, spread=True)
    assert pf.describe() == ps.describe() and pf.wire_bytes == ps.wire_bytes > 0
    assert ps.modeled_s > pf.modeled_s
    # without --spread, the search keeps a model that fits one node on one node (the network only costs)
    assert len({s.node for s in plan_loaded(demo, load_cluster(slow), "latency", context=64).stages}) == 1


def test_llama_8b_shape_is_split_across_orin_nano_boards_that_cannot_hold_it_alone():
    from hetforge.cluster.models import plan_model
    from hetforge.cluster.timeline import token_timeline

    plan = plan_model("llama-3.1-8b-shape", load_cluster("orin-nano-x4-gbe"), "latency", context=4096)
    used = {n: m["used"] for n, m in plan.memory.items() if m["used"] > 0}
    assert len(used) >= 2 and sum(used.values()) > 8 * 2**30  # more than one board holds
    assert all(m["used"] <= m["capacity"] for m in plan.memory.values())
    assert any("does not fit" in e for e in plan.explain)
    tl = token_timeline(plan)
    assert tl.makespan_s == pytest.approx(plan.modeled_s)
    lanes = {s.lane for s in tl.spans if s.kind == "transfer"}
    assert lanes and all("->" in x for x in lanes)
    assert np.isfinite(plan.modeled_j) and plan.wire_bytes > 0


def test_cluster_cli_list_show_and_plan_print_one_json_document_with_modeled_figures():
    from typer.testing import CliRunner

    from hetforge.cli.common import app
    from hetforge.cli.main import _load_commands

    _load_commands()
    run = CliRunner()
    r = run.invoke(app, ["cluster", "list", "--json"])
    assert r.exit_code == 0 and {c["name"] for c in json.loads(r.stdout)} >= {"orin-nano-x2-gbe", "laptop-orin-wifi"}
    r = run.invoke(app, ["cluster", "show", "laptop-orin-wifi", "--json"])
    d = json.loads(r.stdout)
    assert [n["soc"] for n in d["nodes"]] == ["intel-core-ultra-155h", "jetson-orin-nano"]
    assert d["nodes"][0]["model_bytes"] == 16 * 2**30 - 6 * 10**9  # the laptop's 16 GB less what its OS keeps
    r = run.invoke(app, ["cluster", "plan", "demo", "--cluster", "orin-nano-x2-gbe", "--spread", "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["figures"] == "modeled" and d["timeline"]["figure"] == "modeled"
    assert d["timeline"]["makespan_s"] * 1e3 == pytest.approx(d["per_token"]["modeled_ms"])
    assert [s["node"] for s in d["stages"]] == ["a", "b", "a"] and len(d["hops"]) == 2
    r = run.invoke(app, ["cluster", "plan", "demo", "--cluster", "orin-nano-x2-gbe"])
    assert r.exit_code == 0 and "why: one node runs every layer" in r.stdout and "(modeled)" in r.stdout


def test_modeled_pipeline_rate_is_set_by_the_busiest_node_or_link(tmp_path, demo):
    from hetforge.cluster.models import plan_loaded
    from hetforge.cluster.throughput import modeled_pipeline

    plan = plan_loaded(demo, load_cluster(_write(tmp_path, two("host"))), "latency", context=64, spread=True)
    m = modeled_pipeline(plan)
    busy_a = sum(s.modeled_s for s in plan.stages if s.node == "a")
    busy_b = sum(s.modeled_s for s in plan.stages if s.node == "b")
    link = sum(h.modeled_s for h in plan.hops)
    assert m["bottleneck_ms"] == pytest.approx(1e3 * max(busy_a, busy_b, link))
    assert m["pipelined_tokens_per_s"] > m["single_tokens_per_s"]
