"""``hetforge explain`` and ``hetforge pareto`` end to end on llama-tiny."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands

_load_commands()
runner = CliRunner()


def test_explain_json_on_llama_tiny():
    r = runner.invoke(app, ["explain", "llama-tiny", "--soc", "jetson-agx-orin", "--node", "linear",
                            "--strategy", "greedy", "--objective", "latency", "--no-passes", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["node"] == "linear" and rep["op"] == "aten.linear.default" and rep["label"] == "modeled"
    assert [d["device"] for d in rep["devices"]] == ["cpu", "gpu", "npu"]
    chosen = [d for d in rep["devices"] if d["chosen"]]
    assert len(chosen) == 1 and chosen[0]["device"] == rep["device"]
    # greedy by latency: the chosen device has the lowest time including input transfers
    assert chosen[0]["time_s"] + chosen[0]["transfer_in_s"] == min(
        d["time_s"] + d["transfer_in_s"] for d in rep["devices"] if d["supported"])
    assert rep["reason"].startswith("greedy latency") and rep["stage"] == "layer.0"
    assert all(d["time_s"] > 0 and d["energy_j"] > 0 for d in rep["devices"])


def test_explain_bad_input_exit_codes():
    r = runner.invoke(app, ["explain", "llama-tiny", "--soc", "jetson-agx-orin", "--node", "nope", "--no-passes"])
    assert r.exit_code == 2 and "no call_function node 'nope'" in r.output
    r = runner.invoke(app, ["explain", "llama-tiny", "--soc", "jetson-agx-orin", "--node", "linear",
                            "--strategy", "magic"])
    assert r.exit_code == 2 and "valid strategies" in r.output
    r = runner.invoke(app, ["explain", "llama-tiny", "--soc", "jetson-agx-orin", "--node", "linear",
                            "--objective", "cheap"])
    assert r.exit_code == 2 and "valid objectives: energy, latency, balanced" in r.output


def test_pareto_json_and_plot(tmp_path):
    png = tmp_path / "front.png"
    r = runner.invoke(app, ["pareto", "llama-tiny", "--soc", "intel-core-ultra-155h", "--plot", str(png), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    front = rep["front"]
    assert front and rep["label"] == "modeled" and sum(p["chosen"] for p in front) == 1
    pts = [(p["energy_j"], p["latency_s"], -p["min_dasi"]) for p in front]
    for i, a in enumerate(pts):  # the printed front is non-dominated
        assert not any(all(x <= y for x, y in zip(b, a, strict=True)) and b != a for j, b in enumerate(pts) if j != i)
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_pareto_uses_the_exact_front_and_refuses_a_budget_below_any_plan():
    r = runner.invoke(app, ["pareto", "llama-tiny", "--soc", "intel-core-ultra-155h", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)["search"]
    assert s["method"] == "exact" and s["plans"] == 9  # 2 layers × 3 devices
    r = runner.invoke(app, ["pareto", "llama-tiny", "--soc", "intel-core-ultra-155h", "--budget", "2"])
    assert r.exit_code == 2
    assert "search budget 2 is too small for any plan" in r.output and "9 possible stage plans" in r.output
