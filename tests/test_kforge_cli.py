"""`hetforge kforge` on the command line: the offline loop end to end on two shipped problems (kept small for CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HETFORGE = [sys.executable, "-m", "hetforge.cli.main", "kforge"]


def _run(args, tmp_path, timeout=900):
    env = dict(os.environ, HETFORGE_KFORGE_CACHE=str(tmp_path / "cache"), XDG_CONFIG_HOME=str(tmp_path))
    return subprocess.run([*HETFORGE, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_offline_loop_runs_two_problems_and_keeps_every_attempt(tmp_path):
    out = tmp_path / "run"
    r = _run(["run", "relu,linear_relu", "--rounds", "2", "--no-compile-baseline", "--out", str(out), "--json"],
             tmp_path)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    m = rep["metrics"]
    assert m["problems"] == 2 and m["compiled"] == 2 and m["correct"] == 2 and m["label"] == "measured"
    # fast_0 counts the correct attempts the roofline guardrail did not flag; a cache-resident kernel can time below
    # the host profile's DRAM bound on a quiet host and be flagged (harness.py), so the count is checked, not 1.0
    assert m["fast_0"] == (m["correct"] - m["flagged"]) / m["problems"] and m["flagged"] <= 1
    assert 0 <= m["fast_1"] <= m["fast_0"] and m["geomean_speedup_correct"] > 0
    for p in rep["problems"]:
        assert p["correct"] and p["speedup"] > 0 and len(p["rounds"]) == 2
        assert p["rounds"][1]["phase"] == "optimization"
        for rd in (1, 2):
            d = out / p["name"] / f"round_{rd}"
            for f in ("prompt.md", "reply.md", "candidate.py", "candidate.log", "result.json", "attempt.json"):
                assert (d / f).is_file(), d / f
        assert (out / p["name"] / "round_1" / "advice.md").read_text().startswith("achieved")
    assert json.loads((out / "summary.json").read_text())["metrics"] == m


def test_problem_file_missing_a_name_is_exit_2(tmp_path):
    f = tmp_path / "p.py"
    f.write_text("def get_inputs():\n    return []\n")
    r = _run(["run", str(f)], tmp_path, timeout=120)
    assert r.returncode == 2 and "lacks Model, get_init_inputs" in r.stderr and "Traceback" not in r.stderr


def test_unavailable_platform_says_so(tmp_path):
    r = _run(["run", "relu", "--platform", "metal"], tmp_path, timeout=120)
    assert r.returncode == 2 and "not available on this host" in r.stderr


def test_problems_and_platforms_list(tmp_path):
    r = _run(["problems", "--json"], tmp_path, timeout=120)
    assert r.returncode == 0 and len(json.loads(r.stdout)["problems"]) >= 30
    r = _run(["platforms", "--json"], tmp_path, timeout=120)
    rows = {p["platform"]: p for p in json.loads(r.stdout)["platforms"]}
    assert rows["cpp"]["available"] and not rows["sycl"]["available"]


def test_shipped_problems_are_package_data():
    import hetforge.kforge.problems as P

    assert Path(P.SHIPPED_DIR).is_dir() and len(P.shipped_names()) >= 30
