"""``hetforge moe calibrate`` / ``tiers`` end to end on mixtral-tiny: real files, real runs, and every refusal."""

import json

import pytest
from typer.testing import CliRunner

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands

_load_commands()
runner = CliRunner()

TEXT = ("Mixture-of-Experts models route every token to a few experts. " * 40
        + "The router learns which expert suits which token; popular experts are hot, rare ones cold. " * 20)


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    data = d / "data.txt"
    data.write_text(TEXT)
    out, plot = d / "cal.json", d / "cal.png"
    r = runner.invoke(app, ["moe", "calibrate", "mixtral-tiny", "--data", str(data), "--seq", "32",
                            "--max-chunks", "4", "--out", str(out), "--plot", str(plot), "--json"])
    assert r.exit_code == 0, r.output
    return data, out, plot, json.loads(r.stdout)


def test_calibrate_records_per_layer_popularity_tied_to_the_model(calib):
    data, out, plot, doc = calib
    cal = json.loads(out.read_text())
    assert cal["model"] == "mixtral-tiny" and len(cal["fingerprint"]) == 32 and cal["tokens"] == 4 * 32
    assert [lay["layer"] for lay in cal["layers"]] == [0, 1]
    for lay in cal["layers"]:
        assert lay["experts"] == 4 and lay["top_k"] == 2
        assert sum(lay["routed"]) == 2 * 128  # every token routed to two experts
        assert abs(sum(lay["mass"]) - 128) < 1e-3 and abs(sum(lay["share"]) - 1) < 1e-9
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert doc["file"] == str(out)


def test_tiers_json_reports_drop_rate_and_padding_per_layer(calib):
    data, out, _, _ = calib
    r = runner.invoke(app, ["moe", "tiers", "mixtral-tiny", "--calib", str(out), "--data", str(data), "--seq", "32",
                            "--share", "0.5", "--group-size", "2", "--max-chunks", "2", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["tokens"] == 2 * 31 and d["ppl_unlimited"] > 1 and d["ppl_tiered"] > 1
    for lay in d["layers"]:
        assert lay["assignments"] == 2 * 2 * 32 and 0 <= lay["drop_rate"] <= 1 and 0 <= lay["padding_waste"] < 1
        assert lay["dropped"] == round(lay["drop_rate"] * lay["assignments"]) and lay["group_size"] == 2
        assert len(lay["hot"]) == 2  # hot set rounded up to a whole group
    # a tiny capacity drops, a huge one does not (and then only pads)
    r = runner.invoke(app, ["moe", "tiers", "mixtral-tiny", "--calib", str(out), "--data", str(data), "--seq", "32",
                            "--capacity", "64,64", "--max-chunks", "1", "--json"])
    d = json.loads(r.stdout)
    assert all(lay["drop_rate"] == 0 and lay["padding_waste"] > 0.5 for lay in d["layers"])
    assert abs(d["ppl_tiered"] / d["ppl_unlimited"] - 1) < 1e-6


@pytest.mark.parametrize("args, msg", [
    (["--capacity", "0,4"], "a capacity of 0"),
    (["--capacity-factor", "0"], "must be > 0"),
    (["--group-size", "3"], "does not divide the 4 experts of layer 0"),
    (["--capacity", "1,1", "--max-drop", "0.1"], "of layer"),
])
def test_tiers_refusals_exit_2_with_one_line(calib, args, msg):
    data, out, _, _ = calib
    r = runner.invoke(app, ["moe", "tiers", "mixtral-tiny", "--calib", str(out), "--data", str(data), "--seq", "32",
                            "--max-chunks", "1", *args])
    assert r.exit_code == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


def test_calibration_of_another_model_is_refused_naming_both(calib):
    data, out, _, _ = calib
    r = runner.invoke(app, ["moe", "tiers", "olmoe-tiny", "--calib", str(out), "--data", str(data)])
    assert r.exit_code == 2 and "'mixtral-tiny'" in r.stderr and "'olmoe-tiny'" in r.stderr


def test_calibrate_a_dense_model_is_refused_and_writes_nothing(calib, tmp_path):
    data = calib[0]
    r = runner.invoke(app, ["moe", "calibrate", "llama-tiny", "--data", str(data), "--out", str(tmp_path / "c.json")])
    assert r.exit_code == 2 and "no MoE block" in r.stderr and not (tmp_path / "c.json").exists()


def test_residency_json_and_explain_show_each_group(calib):
    _, out, _, _ = calib
    r = runner.invoke(app, ["moe", "residency", "mixtral-tiny", "--calib", str(out), "--soc", "snapdragon-x-elite",
                            "--seq", "512", "--group-size", "2", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert len(d["groups"]) == 2 * 2 and all(g["reason"] and g["device"] in ("cpu", "gpu", "npu") for g in d["groups"])
    assert set(d["modeled"]) == {"residency", "host_only", "all_groups_on_npu", "npu_per_expert_calls"}
    best = min(d["modeled"]["host_only"]["time_per_token_s"], d["modeled"]["all_groups_on_npu"]["time_per_token_s"])
    assert d["modeled"]["residency"]["time_per_token_s"] <= best * (1 + 1e-9)
    r = runner.invoke(app, ["explain", "mixtral-tiny", "--soc", "snapdragon-x-elite", "--node", "moe_default",
                            "--moe-calib", str(out), "--json"])
    assert r.exit_code == 0, r.output
    e = json.loads(r.stdout)
    assert e["op"] == "hetforge.moe.default" and {g["layer"] for g in e["moe_residency"]["groups"]} == {0}
