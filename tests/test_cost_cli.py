import json
from dataclasses import fields

import pytest
from typer.testing import CliRunner

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands
from hetforge.cost import OpCost

_load_commands()
runner = CliRunner()


@pytest.fixture(scope="module")
def profile_json(tmp_path_factory):
    plot = tmp_path_factory.mktemp("plot") / "roof.png"
    r = runner.invoke(app, ["profile", "llama-tiny", "--soc", "jetson-agx-orin", "--seq", "8", "--json",
                            "--plot", str(plot)])
    assert r.exit_code == 0, r.output
    return json.loads(r.output), plot


def test_profile_json_per_node_fields_match_python_api(profile_json):
    d, _ = profile_json
    assert d["label"] == "modeled" and d["devices"] == ["cpu", "gpu", "npu"] and d["unknown_ops"] == []
    names = {f.name for f in fields(OpCost)}
    assert d["nodes"]
    for n in d["nodes"]:
        for dev in d["devices"]:
            assert set(n["costs"][dev]) == names
    for dev in d["devices"]:
        total = sum(n["costs"][dev]["time_s"] for n in d["nodes"])
        assert d["totals"][dev]["time_s"] == pytest.approx(total)
        assert sum(r["time_s"][dev] for r in d["layers"]) == pytest.approx(total)
    assert d["totals"]["npu"]["unsupported_nodes"] > 0 and d["totals"]["cpu"]["unsupported_nodes"] == 0
    layers = [r["layer"] for r in d["layers"]]
    assert "layers.0" in layers and "layers.1" in layers and "lm_head" in layers


def test_profile_plot_is_written(profile_json):
    _, plot = profile_json
    data = plot.read_bytes()
    assert data[:4] == b"\x89PNG" and len(data) > 5000
    assert not list(plot.parent.glob("*.tmp*"))


def test_profile_table_and_bad_inputs(tmp_path):
    r = runner.invoke(app, ["profile", "llama-tiny", "--soc", "test-npu-gaps", "--seq", "4"])
    assert r.exit_code == 0, r.output
    assert "modeled" in r.output
    r = runner.invoke(app, ["profile", "llama-tiny", "--soc", "test-npu-gaps", "--plot", str(tmp_path / "x.gif")])
    assert r.exit_code == 2 and ".png or .svg" in r.output
    r = runner.invoke(app, ["profile", "llama-tiny", "--seq", "0"])
    assert r.exit_code == 2
