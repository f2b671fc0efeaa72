"""Plan files end to end: ``hetforge compile --out`` → ``hetforge run-plan``, and the plan-file refusals."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from hetforge.cli.main import _load_commands, app
from hetforge.compile import compile_model
from hetforge.ir import save_program

_load_commands()


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """gpt2-tiny compiled for the 155H with the `support` strategy (NPU first): a cpu/gpu/npu program."""
    res = compile_model("gpt2-tiny", seq=8, soc="intel-core-ultra-155h", strategy="support", build=False)
    path = tmp_path_factory.mktemp("plan") / "gpt2-tiny.hfp"
    save_program(res.program, path)
    return path, res


def _invoke(*args):
    return CliRunner().invoke(app, ["run-plan", *args])


def test_run_plan_executes_partitions_and_matches_eager(plan, tmp_path):
    pytest.importorskip("openvino", reason="OpenVINO is the optional peers extra: pip install -e .[peers]")
    path, res = plan
    devices = {i.device for i in res.program.instrs if i.kind != "transfer"}
    assert len(devices) >= 2, "the support strategy should use more than one device on the 155H"
    r = _invoke("gpt2-tiny", "--plan", str(path), "--repeat", "2", "--json", "--trace", str(tmp_path / "t.json"))
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["fidelity"]["passed"] and doc["fidelity"]["kl_max"] < 1e-6
    used = {p["device"] for p in doc["build"]["partitions"]}
    assert used == devices
    # transfers the runner made = the program's transfer instructions
    assert doc["median_run"]["summary"]["transfers"] == len(res.program.transfers())
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_torch_only_run_of_the_same_plan_is_exact(plan):
    path, _ = plan
    r = _invoke("gpt2-tiny", "--plan", str(path), "--repeat", "1", "--json",
                "--backend", "npu=emulated:torch-cpu", "--backend", "gpu=emulated:torch-cpu")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["fidelity"]["kl_threshold"] == 1e-8 and doc["fidelity"]["kl_max"] < 1e-8


def test_plan_of_another_model_names_both(plan):
    path, _ = plan
    r = _invoke("llama-tiny", "--plan", str(path))
    assert r.exit_code == 1
    assert "compiled for model 'gpt2-tiny', not 'llama-tiny'" in r.output


def test_newer_format_names_both(plan, tmp_path):
    path, _ = plan
    d = json.loads(path.read_text())
    d["format"] = "hetforge-program/99"
    newer = tmp_path / "newer.hfp"
    newer.write_text(json.dumps(d))
    r = _invoke("gpt2-tiny", "--plan", str(newer))
    assert r.exit_code == 1
    assert "hetforge-program/99" in r.output and "newer than the hetforge-program/1" in r.output


@pytest.mark.parametrize("content, needle", [(None, "does not exist"), ("{not json", "not a hetforge plan file")])
def test_missing_or_garbage_plan_is_a_usage_error(tmp_path, content, needle):
    f = tmp_path / "p.hfp"
    if content is not None:
        f.write_text(content)
    r = _invoke("gpt2-tiny", "--plan", str(f))
    assert r.exit_code == 2 and needle in r.output


def test_missing_openvino_names_the_device_and_the_install(plan, monkeypatch):
    path, res = plan
    assert "npu" in {i.device for i in res.program.instrs}, "the fixture plan must put work on the NPU"
    monkeypatch.setitem(sys.modules, "openvino", None)  # as if OpenVINO were not installed
    r = _invoke("gpt2-tiny", "--plan", str(path))
    assert r.exit_code == 1
    assert "device 'npu'" in r.output and "pip install -e .[peers]" in r.output
