"""``hetforge quantize`` on the command line: JSON report, readable errors with exit code 2."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands

_load_commands()
runner = CliRunner()


def test_quantize_json_reports_every_tensor_and_fidelity():
    r = runner.invoke(app, ["quantize", "llama-tiny", "--scheme", "w4", "--group-size", "64", "--skip", "lm_head",
                            "--seq", "4", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["scheme"] == "w4" and d["group_size"] == 64
    entries = {e["path"]: e for e in d["entries"]}
    assert len(entries) == 15  # 2 layers × 7 linears + lm_head
    assert entries["lm_head"]["scheme"] == "fp32" and "skip pattern" in entries["lm_head"]["reason"]
    q = entries["model.layers.0.mlp.up_proj"]
    assert q["scheme"] == "w4" and q["bytes_after"] < q["bytes_before"] / 4 and 0 < q["rel_error"] < 0.2
    fid = d["fidelity_vs_eager_measured"]
    assert 0 < fid["kl_mean"] < 1e-2 and 0 <= fid["top1_agree"] <= 1
    assert d["summary"]["graph_bytes_after"] < d["summary"]["graph_bytes_before"]


def test_quantize_table_output():
    r = runner.invoke(app, ["quantize", "llama-tiny", "--scheme", "w8a8", "--seq", "4", "--report"])
    assert r.exit_code == 0, r.output
    assert "per-tensor report" in r.output and "measured" in r.output


def test_unknown_scheme_exits_2_with_valid_schemes():
    r = runner.invoke(app, ["quantize", "gpt2-tiny", "--scheme", "int3"])
    assert r.exit_code == 2
    assert "w8, w4, w8a8, none" in r.output
    assert "Traceback" not in r.output


def test_unsupported_group_size_exits_2():
    r = runner.invoke(app, ["quantize", "gpt2-tiny", "--scheme", "w4", "--group-size", "48"])
    assert r.exit_code == 2 and "32, 64, 128, 256" in r.output
