"""Heterogeneous execution: partitioning, the partitioned runner, transfers, traces, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from fx_partition import partition_graph
from typer.testing import CliRunner

from hetforge.backends import resolve
from hetforge.errors import UsageError
from hetforge.frontend import capture
from hetforge.hardware import load_soc
from hetforge.hetero.layouts import layer_assignment
from hetforge.hetero.pipeline import partitions_from_placement
from hetforge.hetero.runner import build
from hetforge.hetero.session import execute
from hetforge.models.zoo import example_inputs, load_model
from hetforge.trace import Trace
from hetforge.verify import compare_logits

SOC = "intel-core-ultra-155h"


@pytest.fixture(scope="module")
def gpt2():
    lm = load_model("gpt2-tiny")
    inputs = example_inputs(lm, seq=8)
    cg = capture(lm.logits_module(), inputs)
    with torch.no_grad():
        ref = lm.logits_module()(*inputs)
    return cg, inputs, ref


@pytest.fixture(scope="module")
def llama():
    lm = load_model("llama-tiny")
    inputs = example_inputs(lm, seq=8)
    cg = capture(lm.logits_module(), inputs)
    with torch.no_grad():
        ref = lm.logits_module()(*inputs)
    return cg, inputs, ref


def _devices(pg):
    return [p.device for p in pg.partitions]


def test_alternate_layout_cuts_one_partition_per_device_run(gpt2):
    cg, _, _ = gpt2
    soc = load_soc(SOC)
    pg = partition_graph(cg.gm, layer_assignment(cg.gm, "alternate:cpu,gpu", soc.device_names))
    # gpt2-tiny: embed + layer0 on cpu, layer1 on gpu, head on cpu
    assert _devices(pg) == ["cpu", "gpu", "cpu"]
    assert pg.switches == 2
    producer = pg.producer()
    for p in pg.partitions:  # every input is a graph input or made by an earlier partition
        for name in p.inputs:
            assert name in pg.graph_inputs or producer[name] < p.index
        assert len(p.outputs) == len([n for n in p.gm.graph.nodes if n.op == "output"][0].args[0])


def test_non_topological_order_is_refused(gpt2):
    cg, _, _ = gpt2
    names = [n.name for n in cg.gm.graph.nodes if n.op == "call_function"]
    with pytest.raises(UsageError, match="not topological"):
        partition_graph(cg.gm, {n: "cpu" for n in names}, order=list(reversed(names)))


@pytest.mark.parametrize("layout", ["alternate:cpu,gpu", "stages:cpu,gpu"])
def test_torch_only_partitions_match_eager_exactly(llama, layout):
    cg, inputs, ref = llama
    soc = load_soc(SOC)
    pp = partitions_from_placement(cg.gm, layer_assignment(cg.gm, layout, soc.device_names), soc)
    exe, _ = build(pp.partitions, soc, resolve(soc))  # gpu → emulated:torch-cpu here
    out, rep = exe.run(inputs)
    rep2 = compare_logits(ref, out, kl_threshold=1e-8)
    assert rep2.passed and rep2.kl_max < 1e-8
    # one transfer per (value, destination), as lowering counted them; the 155H links are not unified: copies
    assert len(rep.transfers) == pp.lowered_transfers > 0
    assert all(t.mode == "copy" and t.nbytes > 0 and t.measured_s > 0 for t in rep.transfers)
    assert rep.switches == len(pp.partitions.partitions) - 1


def test_unified_links_hand_over_zero_copy(gpt2):
    """Two devices of a unified-memory SoC whose backends share one memory hand values over without a copy (the
    gpu bound to a CPU stand-in explicitly: on a CUDA host the default binding is a real, separate GPU memory)."""
    cg, inputs, ref = gpt2
    soc = load_soc("apple-m2-max")
    pg = partition_graph(cg.gm, layer_assignment(cg.gm, "alternate:cpu,gpu", soc.device_names))
    exe, _ = build(pg, soc, resolve(soc, {"gpu": "emulated:torch-cpu"}))
    out, rep = exe.run(inputs)
    assert compare_logits(ref, out).kl_max < 1e-8
    assert rep.transfers and all(t.mode == "zero-copy" for t in rep.transfers)
    assert all(t.modeled_s == 0 for t in rep.transfers)  # unified: the cost model charges nothing


def test_mixed_torch_and_openvino_matches_eager_and_traces(llama, tmp_path):
    pytest.importorskip("openvino", reason="OpenVINO is the optional peers extra: pip install -e .[peers]")
    cg, inputs, _ = llama
    soc = load_soc(SOC)
    pp = partitions_from_placement(cg.gm, layer_assignment(cg.gm, "alternate:cpu,npu", soc.device_names), soc)
    bindings = resolve(soc)
    assert bindings["npu"].spec == "emulated:openvino:CPU"
    res = execute(pp.partitions, soc, bindings, inputs, cg.gm, repeat=2, warmup=1, trace_path=tmp_path / "t.json")
    assert res.fidelity.kl_threshold == 1e-6 and res.fidelity.passed
    backends = {r["device"]: r["backend"] for r in res.build.partitions}
    assert backends == {"cpu": "torch-cpu", "npu": "emulated:openvino:CPU"}
    med = res.median
    assert all(c.modeled_s > 0 and c.modeled_j > 0 for c in med.calls)
    doc = json.loads((tmp_path / "t.json").read_text())
    events = doc["traceEvents"]
    procs = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert set(procs) == {"measured (this host)", f"modeled ({SOC} cost model)"}
    spans = [e for e in events if e["ph"] == "X"]
    for figure, pid in (("measured", procs["measured (this host)"]), ("modeled", procs[f"modeled ({SOC} cost model)"])):
        mine = [e for e in spans if e["pid"] == pid]
        assert all(e["args"]["figure"] == figure for e in mine)
        assert sum(e["cat"] == "call" for e in mine) == len(med.calls)
        assert sum(e["cat"] == "transfer" for e in mine) == len(med.transfers)
    switches = [e for e in events if e["ph"] == "i"]
    assert len(switches) == 2 * med.switches
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"cpu [torch-cpu]", "npu [emulated:openvino:CPU]", "cpu", "npu", "transfers", "switches"} <= lanes


def test_trace_write_is_atomic_and_valid(tmp_path):
    tr = Trace()
    tr.span("measured (this host)", "cpu", "p0", 0.0, 0.001, "measured")
    path = tr.write(tmp_path / "sub" / "x.json")
    assert json.loads(path.read_text())["traceEvents"][-1]["dur"] == 1000.0
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]


def test_cli_hetero_runs_and_reports(tmp_path):
    from hetforge.cli.main import _load_commands, app

    _load_commands()
    r = CliRunner().invoke(app, ["hetero", "gpt2-tiny", "--layout", "stages:cpu,gpu", "--seq", "8", "--repeat", "2",
                                 "--json", "--trace", str(tmp_path / "tr.json")])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["fidelity"]["passed"] and doc["switches"] == 1
    assert doc["median_run"]["summary"]["transfers"] >= 1
    assert (tmp_path / "tr.json").is_file()


@pytest.mark.parametrize("args, code, needle", [
    (["--layout", "alternate:cpu,tpu"], 2, "unknown device"),
    (["--layout", "zigzag:cpu"], 2, "unknown layout"),
    (["--layout", "all:cpu", "--backend", "gpu"], 2, "DEVICE=BACKEND"),
    (["--layout", "all:cpu", "--backend", "cpu=tpu-backend"], 2, "unknown backend"),
    (["--layout", "all:cpu", "--repeat", "0"], 2, "--repeat"),
    (["--layout", "all:cpu", "--trace", "/"], 2, "is a folder"),
    (["--strategy", "nope"], 2, "unknown strategy"),
    (["--layout", "all:cpu", "--strategy", "greedy"], 2, "exactly one of"),
    (["--layout", "all:npu"], 1, "op not supported by npu 'npu'"),
])
def test_cli_hetero_bad_input(args, code, needle):
    from hetforge.cli.main import _load_commands, app

    _load_commands()
    r = CliRunner().invoke(app, ["hetero", "gpt2-tiny", "--seq", "8", "--repeat", "1", *args])
    assert r.exit_code == code, r.output
    assert needle in r.output
