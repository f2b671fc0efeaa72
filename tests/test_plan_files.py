"""Plan files: malformed ones are refused in one line (exit 2); a plan carries its SoC profile and uses it."""

from __future__ import annotations

import copy
import json

import pytest
from typer.testing import CliRunner

from hetforge.cli.main import _load_commands, app
from hetforge.ir import load_program, save_program
from hetforge.ir.serialize import MalformedProgramError

_load_commands()
runner = CliRunner()


@pytest.fixture(scope="module")
def custom_plan(tmp_path_factory):
    """gpt2-tiny compiled with `--soc FILE.json`: a copy of the 155H profile, same name, half the GPU bandwidth."""
    from importlib import resources

    root = tmp_path_factory.mktemp("plans")
    spec = json.loads((resources.files("hetforge") / "profiles" / "intel-core-ultra-155h.json").read_text())
    spec["devices"][1]["mem_bandwidth"]["value"] *= 0.5
    soc = root / "my-soc.json"
    soc.write_text(json.dumps(spec))
    plan = root / "plan.json"
    r = runner.invoke(app, ["compile", "gpt2-tiny", "--seq", "8", "--soc", str(soc), "--strategy", "greedy",
                            "--out", str(plan), "--json"])
    assert r.exit_code == 0, r.output
    return root, soc, plan


def test_plan_embeds_the_profile_it_was_compiled_for_and_its_memory_plan(custom_plan):
    _, soc, plan = custom_plan
    d = json.loads(plan.read_text())
    assert d["soc_profile"]["name"] == "intel-core-ultra-155h"
    assert d["soc_profile"]["spec"]["devices"][1]["mem_bandwidth"]["value"] == pytest.approx(
        json.loads(soc.read_text())["devices"][1]["mem_bandwidth"]["value"])
    assert d["memory"]["offsets"] and set(d["memory"]["arena_bytes"]) == set(d["devices"])


def test_run_plan_uses_the_embedded_profile_not_the_shipped_one_of_that_name(custom_plan):
    from hetforge.hardware import load_soc
    from hetforge.hetero.plan import plan_soc, read_header

    _, soc, plan = custom_plan
    prof = plan_soc(plan, read_header(plan))
    shipped = load_soc("intel-core-ultra-155h")
    assert prof.device("gpu").mem_bandwidth == pytest.approx(0.5 * shipped.device("gpu").mem_bandwidth)
    assert plan_soc(plan, read_header(plan), str(soc)).device("gpu").mem_bandwidth == prof.device("gpu").mem_bandwidth


def test_run_plan_refuses_a_different_soc_profile(custom_plan):
    _, _, plan = custom_plan
    r = runner.invoke(app, ["run-plan", "gpt2-tiny", "--plan", str(plan), "--soc", "intel-core-ultra-155h", "--json"])
    assert r.exit_code == 2 and r.stdout == ""
    assert "was compiled for SoC profile 'intel-core-ultra-155h'" in r.stderr and "different profile" in r.stderr


def test_run_plan_with_a_plan_from_a_soc_file_runs(custom_plan):
    pytest.importorskip("openvino", reason="OpenVINO is the optional peers extra: pip install -e .[peers]")
    _, soc, plan = custom_plan
    r = runner.invoke(app, ["run-plan", "gpt2-tiny", "--plan", str(plan), "--soc", str(soc), "--repeat", "1",
                            "--warmup", "0", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["fidelity"]["passed"]


def _overlap(e):
    offs = e["memory"]["offsets"]
    a, b = list(offs)[:2]
    offs[b] = offs[a]


MALFORMED = {
    "header only": (lambda e: [e.pop(k) for k in list(e) if k != "format"], "field 'name': missing"),
    "wrong type": (lambda e: e["values"][0].__setitem__("shape", "abc"), "values[0].shape"),
    "negative id": (lambda e: e["instrs"][0].__setitem__("id", -1), "instrs[0].id"),
    "null instruction": (lambda e: e["instrs"].__setitem__(2, None), "instrs[2]"),
    "instructions cut off": (lambda e: e.__setitem__("instrs", e["instrs"][:5]), "program verifier"),
    "unknown dtype": (lambda e: e["values"][3].__setitem__("dtype", "f99"), "'f99' is not a dtype"),
    "unknown kind": (lambda e: e["instrs"][0].__setitem__("kind", "magic"), "instrs[0].kind"),
    "dangling alias": (lambda e: e["values"][3].__setitem__("alias_of", 99999), "%99999, which is not declared"),
    "bad encoded argument": (lambda e: e["instrs"][3].__setitem__("args", [{"r": 5, "x": 1}]),
                             "unknown encoded argument"),
    "shape/stride mismatch": (lambda e: e["values"][0].__setitem__("stride", []), "strides"),
    "overlapping arena offsets": (_overlap, "overlap"),
    "input inside an arena": (lambda e: e["memory"]["offsets"].__setitem__(str(e["inputs"][0]), 0),
                              "is placed inside the"),
    "offsets not numbers": (lambda e: e["memory"].__setitem__("offsets", {"1": "x"}), "where a byte count belongs"),
    "edited embedded profile": (lambda e: e["soc_profile"]["spec"].__setitem__("name", "other"), "sha256"),
    "not an object": (lambda e: None, "not a hetforge plan file"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_plan_is_exit_2_with_one_line(custom_plan, case):
    root, _, plan = custom_plan
    edit, msg = MALFORMED[case]
    d = json.loads(plan.read_text())
    e = copy.deepcopy(d)
    edit(e)
    bad = root / f"bad-{case.replace(' ', '-').replace('/', '-')}.json"
    bad.write_text(json.dumps([1, 2] if case == "not an object" else e))
    r = runner.invoke(app, ["run-plan", "gpt2-tiny", "--plan", str(bad), "--json"])
    assert r.exit_code == 2, r.output
    assert r.stdout == "" and msg in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_load_program_refuses_a_cut_program_as_malformed(custom_plan, tmp_path):
    _, _, plan = custom_plan
    d = json.loads(plan.read_text())
    d["instrs"] = d["instrs"][:-3]
    bad = tmp_path / "cut.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(MalformedProgramError, match="program verifier"):
        load_program(bad)


def test_plan_folder_and_missing_plan_are_told_apart(tmp_path):
    r = runner.invoke(app, ["run-plan", "gpt2-tiny", "--plan", str(tmp_path)])
    assert r.exit_code == 2 and "is a folder, not a file" in r.stderr
    r = runner.invoke(app, ["run-plan", "gpt2-tiny", "--plan", str(tmp_path / "none.json")])
    assert r.exit_code == 2 and "does not exist" in r.stderr


def test_saved_and_reloaded_plan_round_trips_with_memory(custom_plan, tmp_path):
    from hetforge.models.zoo import load_model

    _, _, plan = custom_plan
    module = load_model("gpt2-tiny").logits_module()
    p = load_program(plan, module)
    assert p.memory is not None and p.soc_spec is not None
    q = load_program(save_program(p, tmp_path / "again.json"), module)
    assert str(q) == str(p) and q.memory == p.memory and q.soc_spec == p.soc_spec
