"""docs/benchmarks.md is generated from the committed JSON (bench/summary.py) and cannot drift from it; every
extractor names the file and key when the JSON lacks what it reads."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import summary  # noqa: E402


def test_committed_page_is_the_generated_page() -> None:
    committed = (ROOT / "docs" / "benchmarks.md").read_text()
    assert summary.render() == committed, (
        "docs/benchmarks.md differs from what bench/summary.py generates from docs/bench/*.json; "
        "run `python bench/summary.py` and commit the result")


def test_check_flag_reports_drift(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text(summary.render().replace("| met |", "| not met |", 1))
    assert summary.main(["--out", str(page), "--check"]) == 1
    assert summary.main(["--out", str(page)]) == 0
    assert summary.main(["--out", str(page), "--check"]) == 0


def _extractors() -> list[summary.Extractor]:
    return [ex for ex in summary.HEADLINE + summary.CPU if ex.files]


@pytest.mark.parametrize("ex", _extractors(), ids=lambda ex: ex.fn.__name__)
def test_extractor_names_file_and_key_on_empty_json(ex: summary.Extractor) -> None:
    """Each file the extractor reads, emptied in turn (the others intact): the error names that file and a key."""
    for i, name in enumerate(ex.files):
        args = [summary.load(f) for f in ex.files]
        args[i] = summary.J(name, {})
        with pytest.raises(summary.SummaryError) as err:
            ex.fn(*args)
        msg = str(err.value)
        assert f"docs/bench/{name}" in msg and "missing key [" in msg, msg


@pytest.mark.parametrize("ex", _extractors(), ids=lambda ex: ex.fn.__name__)
def test_extractor_fails_loudly_on_a_missing_key(ex: summary.Extractor) -> None:
    """Every top-level key an extractor reads, removed in turn: it raises SummaryError naming file and key, or (a key
    it does not read) gives the same row; never a bare KeyError/TypeError or a silently different row."""
    base = ex.fn(*(summary.load(f) for f in ex.files))
    for i, name in enumerate(ex.files):
        data = json.loads((summary.BENCH / name).read_text())
        for key in list(data):
            cut = {k: v for k, v in data.items() if k != key}
            args = [summary.load(f) for f in ex.files]
            args[i] = summary.J(name, cut)
            try:
                got = ex.fn(*args)
            except summary.SummaryError as e:
                assert f"docs/bench/{name}" in str(e) and repr(key) in str(e), str(e)
                continue
            assert got == base, f"{ex.fn.__name__}: dropping {name}[{key!r}] changed the row without an error"


def test_nested_missing_key_is_named() -> None:
    data = json.loads((summary.BENCH / "costmodel.json").read_text())
    del data["cases"][3]["after"]["program_error"]
    with pytest.raises(summary.SummaryError, match=re.escape("docs/bench/costmodel.json: missing key "
                                                             "['cases'][3]['after']['program_error']")):
        summary.costmodel_program(summary.J("costmodel.json", data))


def test_wrong_type_is_named() -> None:
    data = json.loads((summary.BENCH / "report.json").read_text())
    data["result"]["load_ms_max"] = "fast"
    with pytest.raises(summary.SummaryError, match=r"report\.json: \['result'\]\['load_ms_max'\] is 'fast'"):
        summary.report(summary.J("report.json", data))


def test_status_follows_the_figures() -> None:
    """met / not met is computed: pushing a figure over its target flips the row."""
    data = json.loads((summary.BENCH / "report.json").read_text())
    assert summary.report(summary.J("report.json", data)).status.startswith("met")
    data["result"]["load_ms_max"] = 2500.0
    assert summary.report(summary.J("report.json", data)).status.startswith("not met")
    cm = json.loads((summary.BENCH / "costmodel.json").read_text())
    cm["cases"][0]["after"]["program_error"] = 0.2
    assert summary.costmodel_program(summary.J("costmodel.json", cm)).status == "not met"


def test_missing_file_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(summary, "BENCH", tmp_path)
    assert summary.main(["--out", str(tmp_path / "x.md")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "docs/bench/" in err[0] and "file missing" in err[0]


def test_unwritable_out_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert summary.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write" in err[0]


def test_pending_rows_have_no_committed_json() -> None:
    """A row without figures is only for a page whose JSON is not committed yet; capture, passes, backend and
    generate have JSON (issue 18) and are read by extractors."""
    for ex in summary.HEADLINE:
        if not ex.files:
            for name in re.findall(r"docs/bench/(\w+\.json)", ex.fn().result):
                assert not (summary.BENCH / name).exists(), f"{name} is committed: give its row an extractor"
    read = {f for ex in summary.HEADLINE for f in ex.files}
    assert {"backend.json", "capture.json", "generate.json", "passes.json"} <= read


def test_passes_and_generate_verdicts_follow_the_json() -> None:
    d = json.loads((summary.BENCH / "passes.json").read_text())
    for r in d["rows"]:
        r["passes"] = [0.05 * r["capture"][0], 0.0]
    assert summary.passes_time(summary.J("passes.json", d)).status == "met"
    d["rows"][0]["passes"][0] = 0.5 * d["rows"][0]["capture"][0]
    assert summary.passes_time(summary.J("passes.json", d)).status == "partial"
    g = json.loads((summary.BENCH / "generate.json").read_text())
    g["results"][0]["hetforge"]["none"]["decode_ratio_vs_hf"] = 0.9
    assert summary.runtime_decode_vs_hf(summary.J("generate.json", g)).status == "not met"
    o = g["results"][0]["hetforge"]["none"]
    o["decode_ratio_vs_round_bound"]["median"] = 1.6  # the verdict follows the per-round ratio where it is recorded
    assert summary.runtime_decode_bound(summary.J("generate.json", g)).status == "not met"
    o["decode_ratio_vs_round_bound"]["median"] = 1.2
    assert summary.runtime_decode_bound(summary.J("generate.json", g)).status == "met"
    for r in g["results"]:  # a run with one β_read reading is judged on it, as before
        for x in (r["hf"], *r["hetforge"].values()):
            del x["decode_ratio_vs_round_bound"]
    o["decode_ratio_vs_bound"] = 1.6
    assert summary.runtime_decode_bound(summary.J("generate.json", g)).status == "not met"
    del o["decode_ratio_vs_bound"]
    with pytest.raises(summary.SummaryError, match="generate.json.*decode_ratio_vs_bound"):
        summary.runtime_decode_bound(summary.J("generate.json", g))


def test_readme_links_the_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "docs/benchmarks.md" in readme and (ROOT / "docs" / "benchmarks.md").exists()
    for target in re.findall(r"\]\((bench/[^)#]+)", (ROOT / "docs" / "benchmarks.md").read_text()):
        assert (ROOT / "docs" / target).exists(), target
