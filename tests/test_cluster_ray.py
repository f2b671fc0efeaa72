"""Generation across nodes on a real local Ray cluster (three node processes on loopback, one resource label each).

One module-scoped cluster serves every test (CI has two cores): it is started here and stopped at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cluster_plan import LINK, small_soc

from hetforge.cluster.spec import load_cluster

# Ray is an optional extra: `make install` (and CI) installs it; a user who installed hetforge without it has no
# cluster commands to test.
pytest.importorskip("ray", reason="Ray is not installed: it comes with the cluster extra (`make install`, or "
                                  "pip install -e '.[cluster]')")

MAX_NEW = 6
PROMPT = "Once upon a time"


def cluster_file(tmp: Path, name: str, nodes: list[str], soc: str = "host") -> Path:
    text = f"name: {name}\nnodes:\n" + "".join(f"  - {{name: {n}, soc: {soc}}}\n" for n in nodes)
    text += "links: []\ndefault_link:\n" + "\n".join("  " + x.strip() for x in LINK.splitlines()[2:]) + "\n"
    p = tmp / f"{name}.yaml"
    p.write_text(text)
    return p


@pytest.fixture(scope="module")
def demo():
    from hetforge.models.zoo import load_model

    return load_model("demo")


@pytest.fixture(scope="module")
def single(demo):
    from hetforge.runtime import Engine

    return Engine(demo, soc="host")


@pytest.fixture(scope="module")
def reference(single) -> list[int]:
    """Greedy tokens of the single-node run (one process, placed programs on the host profile)."""
    from hetforge.runtime import SamplingParams

    return single.generate(PROMPT, SamplingParams(max_new_tokens=MAX_NEW)).tokens


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    from hetforge.cluster.ray_runtime import RaySession

    d = tmp_path_factory.mktemp("ray")
    s = RaySession(load_cluster(cluster_file(d, "three", ["a", "b", "c"])))
    yield s
    s.close()


def _engine(demo, path, session, spread=False):
    from hetforge.cluster.ray_runtime import ClusterEngine

    return ClusterEngine(demo, load_cluster(path), spread=spread, session=session)


def test_two_nodes_on_ray_generate_the_single_node_tokens_alone_and_pipelined(tmp_path, demo, single, reference,
                                                                                 ray_session):
    from hetforge.cluster.throughput import generate_many
    from hetforge.runtime import SamplingParams

    params = SamplingParams(max_new_tokens=MAX_NEW)
    others = ["The little girl", "He looked at"]
    want = [reference] + [single.generate(p, params).tokens for p in others]
    eng = _engine(demo, cluster_file(tmp_path, "two", ["a", "b"]), ray_session, spread=True)
    try:
        assert {s.node for s in eng.plan.stages} == {"a", "b"}
        r = eng.generate(PROMPT, params)
        batch = generate_many(eng, [PROMPT, *others], params)  # three requests in flight, one KV slot each
    finally:
        eng.close()
    assert batch.tokens == want
    assert r.tokens == reference
    assert r.failovers == [] and r.stop_reason == "length"
    assert len(r.decode_s) == MAX_NEW - 1 and all(w > 0 for w in r.wire_bytes)  # activations crossed nodes
    assert r.overhead_ms_per_token is not None and r.overhead_ms_per_token > 0


def test_a_node_dies_the_plan_moves_to_the_survivors_and_tokens_stay_identical(tmp_path, demo, reference,
                                                                                 ray_session):
    from hetforge.runtime import SamplingParams

    need = sum(p.numel() * p.element_size() for p in demo.model.parameters())
    soc = small_soc(tmp_path, int(need * 0.7))  # no node holds the model; any two do
    eng = _engine(demo, cluster_file(tmp_path, "three-small", ["a", "b", "c"], soc), ray_session)
    victim = next(s.node for s in eng.plan.stages if s.node != eng.cluster.home)
    killed = []

    def kill(e, k, token):
        if k == 3:
            e.kill_node(victim)
            killed.append(victim)

    try:
        r = eng.generate(PROMPT, SamplingParams(max_new_tokens=MAX_NEW), on_token=kill)
    finally:
        eng.close()
    assert killed == [victim]
    assert r.tokens == reference
    assert len(r.failovers) == 1 and r.failovers[0]["dead"] == [victim] and r.failovers[0]["replanned"]
    assert victim not in {s["node"] for s in r.plans[-1]["stages"]}
    assert len({s["node"] for s in r.plans[-1]["stages"]}) == 2


def test_a_node_dies_and_the_rest_cannot_hold_the_model_stops_with_what_was_generated(tmp_path, demo, reference,
                                                                                       ray_session):
    from hetforge.runtime import SamplingParams

    need = sum(p.numel() * p.element_size() for p in demo.model.parameters())
    soc = small_soc(tmp_path, int(need * 0.7))
    eng = _engine(demo, cluster_file(tmp_path, "two-small", ["a", "b"], soc), ray_session)

    def kill(e, k, token):
        if k == 3:
            e.kill_node("b")

    try:
        r = eng.generate(PROMPT, SamplingParams(max_new_tokens=MAX_NEW), on_token=kill)
    finally:
        eng.close()
    assert r.tokens == reference[:3]
    assert r.stop_reason.startswith("stopped: node(s) b died and the survivors cannot hold the model")
    assert "bytes" in r.stop_reason
    assert r.failovers[0]["replanned"] is False


def test_cli_run_joins_the_running_cluster_with_address(tmp_path, reference, ray_session):
    import ray

    address = ray.get_runtime_context().gcs_address
    path = cluster_file(tmp_path, "two", ["b", "c"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_ADDRESS": ""}
    out = subprocess.run([sys.executable, "-m", "hetforge.cli.main", "run", "demo", "--prompt", PROMPT, "-n",
                          str(MAX_NEW), "--cluster", str(path), "--address", address, "--spread", "--json"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert doc["tokens"] == reference
    assert [s["node"] for s in doc["plans"][0]["stages"]][:2] == ["b", "c"]
