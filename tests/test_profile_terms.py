"""Per-device efficiency and switch-overhead terms of SoC profiles: validation, use in the cost model, reporting."""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch
from typer.testing import CliRunner

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands
from hetforge.cost import estimate, switch_cost_s
from hetforge.cost.model import model_terms
from hetforge.errors import UsageError
from hetforge.hardware import list_socs, load_soc
from hetforge.ops.registry import OpCall, TensorMeta

_load_commands()
runner = CliRunner()
TERMS = ("compute_efficiency", "bandwidth_efficiency", "switch_overhead_us")


def _shipped(name: str) -> dict:
    return json.loads((resources.files("hetforge") / "profiles" / f"{name}.json").read_text())


@pytest.mark.parametrize("name", [s for s in list_socs() if s != "host"])
def test_every_shipped_device_has_sourced_terms_in_range(name):
    for dev in _shipped(name)["devices"]:
        for k in TERMS:
            fig = dev[k]
            assert fig["source"].strip() and isinstance(fig["estimate"], bool)
            assert fig["estimate"] == fig["source"].startswith("estimate"), (name, dev["name"], k)
        assert 0 < dev["compute_efficiency"]["value"] <= 1 and 0 < dev["bandwidth_efficiency"]["value"] <= 1
        assert dev["switch_overhead_us"]["value"] >= 0
    soc = load_soc(name)
    for d in soc.devices:
        t = model_terms(d)
        assert t["compute_efficiency"]["value"] == d.compute_efficiency < 1.0
        assert t["compute_efficiency"]["estimate"] is not None  # read from the file, not the default


@pytest.mark.parametrize("field, value, allowed", [
    ("compute_efficiency", 1.5, "(0, 1]"), ("compute_efficiency", 0.0, "(0, 1]"),
    ("bandwidth_efficiency", -0.2, "(0, 1]"), ("switch_overhead_us", -3.0, ">= 0"),
])
def test_out_of_range_term_names_file_field_and_range(tmp_path, field, value, allowed):
    d = _shipped("jetson-agx-orin")
    d["devices"][1][field]["value"] = value
    p = tmp_path / "bad-terms.json"
    p.write_text(json.dumps(d))
    with pytest.raises(UsageError) as e:
        load_soc(str(p))
    msg = str(e.value)
    assert str(p) in msg and f"devices.1.{field}.value" in msg and f"allowed range: {allowed}" in msg, msg
    r = runner.invoke(app, ["profile", "llama-tiny", "--soc", str(p), "--seq", "4"])
    assert r.exit_code == 2 and "allowed range" in r.output


def test_cost_model_applies_compute_and_bandwidth_efficiency():
    soc = load_soc("jetson-agx-orin")
    gpu = soc.device("gpu")
    h = TensorMeta((2048, 2048), torch.float16)
    big = OpCall("aten.mm.default", (h, h), {}, (h,))
    c = estimate(big, gpu)
    flops = 2 * 2048**3
    assert c.bound == "compute"
    assert c.time_s == pytest.approx(flops / (gpu.peak("fp16") * gpu.compute_efficiency) + gpu.dispatch_s, rel=1e-9)
    f = TensorMeta((4096, 4096), torch.float32)
    add = OpCall("aten.add.Tensor", (f, f), {}, (f,))
    a = estimate(add, gpu)
    assert a.bound == "memory"
    assert a.time_s == pytest.approx(a.bytes / (gpu.mem_bandwidth * gpu.bandwidth_efficiency) + gpu.dispatch_s,
                                     rel=1e-9)


def test_switch_cost_reads_the_destination_device():
    soc = load_soc("jetson-agx-orin")
    assert switch_cost_s(soc, "cpu", "npu") == pytest.approx(soc.device("npu").switch_overhead_us * 1e-6)
    assert switch_cost_s(soc, "npu", "cpu") == pytest.approx(soc.device("cpu").switch_overhead_us * 1e-6)
    assert switch_cost_s(soc, "gpu", "gpu") == 0.0 and switch_cost_s(soc, None, "gpu") == 0.0
    with pytest.raises(UsageError, match="no device 'dsp'"):
        switch_cost_s(soc, "dsp", "gpu")


def test_profile_reports_which_terms_it_used():
    r = runner.invoke(app, ["profile", "llama-tiny", "--soc", "jetson-agx-orin", "--seq", "4", "--json"])
    assert r.exit_code == 0, r.output
    terms = json.loads(r.stdout)["terms"]
    assert set(terms) == {"cpu", "gpu", "npu"}
    assert terms["npu"]["switch_overhead_us"]["value"] == load_soc("jetson-agx-orin").device("npu").switch_overhead_us
    r = runner.invoke(app, ["profile", "llama-tiny", "--soc", "jetson-agx-orin", "--seq", "4"])
    assert r.exit_code == 0 and "terms used per device" in r.output and "compute eff 0.75 (estimate)" in r.output
