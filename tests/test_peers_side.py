"""The peer suite's side-by-side phase: hetforge and its closest peers loaded at once, timed in turns."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hetforge.benchmarks import side
from hetforge.benchmarks.harness import Row, Stat, SuiteConfig, _env_for, compare, run_suite, worker_env
from hetforge.benchmarks.report import render_markdown, side_lines, target_lines
from hetforge.benchmarks.worker import WorkerSpec, serve
from hetforge.cli.common import app
from hetforge.cli.main import _load_commands

_load_commands()
MODEL = "gpt2-tiny"


def _stat(x: float) -> Stat:
    return Stat(x, x, x, 1)


def _row(system: str, pre: float, step: float, prec: str = "f32", rss: float = 1000.0) -> Row:
    return Row(MODEL, system, system, "ok", runs_ok=1, runs=1, precision=prec, prefill_ms=_stat(pre),
               step_ms=_stat(step), rss_peak_mb=_stat(rss))


def test_groups_take_the_two_fastest_f32_peers_per_metric_and_openvino_bf16_for_bf16():
    rows = [_row("hetforge", 90, 9), _row("ort", 100, 12), _row("ov-f32", 95, 14), _row("eager", 300, 11),
            _row("export", 400, 30), _row("hetforge-bf16", 50, 5, "bf16"), _row("ov-default", 55, 7, "bfloat16")]
    groups = {m: p for m, p, _ in side.pick_groups(rows, MODEL)}
    # prefill: ov-f32, ort; one token: eager, ort — three peers, fastest first per metric, no bf16 row among them
    assert groups["hetforge"] == ["ov-f32", "ort", "eager"]
    assert groups["hetforge-bf16"] == ["ov-default"]
    assert "hetforge-bf16" not in {m for m, _, _ in side.pick_groups([r for r in rows if r.system != "ov-default"],
                                                                      MODEL)}
    assert all(metrics == ["prefill_ms", "step_ms"] for _, _, metrics in side.pick_groups(rows, MODEL))


def _dec(row: Row, ms: float) -> Row:
    row.decode_ms_per_token = _stat(ms)
    return row


def test_decode_is_timed_with_the_decode_peers_and_w8_w4_against_llamacpp_q8_q4():
    """Decode joins a group where the suite ran a decode peer (llama.cpp, OpenVINO stateful), never HF eager's
    generate; hetforge-w8 / hetforge-w4 get a decode-only group against llama.cpp Q8_0 / Q4_0."""
    rows = [_dec(_row("hetforge", 90, 9), 12), _dec(_row("eager", 300, 11), 30), _row("ort", 100, 12),
            _dec(_row("llamacpp-f32", 95, 14), 11), _dec(_row("ov-stateful-f32", 97, 15), 13),
            _dec(_row("hetforge-w8", 80, 8, "w8"), 6), _dec(_row("llamacpp-q8", 70, 9, "q8_0"), 6.5),
            _dec(_row("hetforge-w4", 75, 7, "w4"), 4), _dec(_row("llamacpp-q4", 65, 8, "q4_0"), 4.5)]
    groups = {m: (p, metrics) for m, p, metrics in side.pick_groups(rows, MODEL)}
    # prefill: llamacpp-f32, ov-stateful-f32; one token: eager, ort; decode: llamacpp-f32, ov-stateful-f32 (not eager)
    assert groups["hetforge"] == (["llamacpp-f32", "ov-stateful-f32", "eager"],
                                  ["prefill_ms", "step_ms", "decode_ms_per_token"])
    assert groups["hetforge-w8"] == (["llamacpp-q8"], ["decode_ms_per_token"])
    assert groups["hetforge-w4"] == (["llamacpp-q4"], ["decode_ms_per_token"])
    no_peer = [r for r in rows if not r.system.startswith(("llamacpp", "ov-stateful"))]
    assert {m: metrics for m, _, metrics in side.pick_groups(no_peer, MODEL)} == {"hetforge": ["prefill_ms", "step_ms"]}


def test_decode_targets_are_judged_on_the_side_by_side_requests():
    rows = [_dec(_row("hetforge", 90, 9), 12), _dec(_row("llamacpp-f32", 95, 14), 11),
            _dec(_row("hetforge-w8", 80, 8, "w8"), 7), _dec(_row("llamacpp-q8", 70, 9, "q8_0"), 6.5)]
    f32 = {"model": MODEL, "mine": "hetforge", "systems": ["hetforge", "llamacpp-f32"], "rounds": 3,
           "metrics": ["prefill_ms", "step_ms", "decode_ms_per_token"],
           "prefill_ms": {"hetforge": [90] * 3, "llamacpp-f32": [95] * 3}, "step_ms": {"hetforge": [9] * 3,
                                                                                      "llamacpp-f32": [14] * 3},
           "decode_ms_per_token": {"hetforge": [10.0, 12.0, 11.0], "llamacpp-f32": [10.5, 12.5, 11.5]},
           "calls": {"prefill": 2, "step": 5, "decode": 128}, "loadavg": [1.0] * 3, "notes": []}
    w8 = {"model": MODEL, "mine": "hetforge-w8", "systems": ["hetforge-w8", "llamacpp-q8"], "rounds": 2,
          "metrics": ["decode_ms_per_token"], "decode_ms_per_token": {"hetforge-w8": [6.0, 6.2],
                                                                      "llamacpp-q8": [6.5, 6.4]},
          "calls": {"prefill": 2, "step": 5, "decode": 128}, "loadavg": [1.0] * 3, "notes": []}
    t = compare(rows, None, [f32, w8])[0]["targets"]
    dec = t["decode_ms_per_token_at_or_below_best_f32_peer"]
    assert dec["judged"] == "side by side" and dec["met"] and not dec["serial"]["met"]  # 12 > 11 serially
    assert dec["per_round"] == pytest.approx([10 / 10.5, 12 / 12.5, 11 / 11.5])
    q8 = t["w8_decode_at_or_below_llamacpp_q8"]
    assert q8["judged"] == "side by side" and q8["met"] and q8["serial"]["ratio"] == pytest.approx(7 / 6.5)
    lines = target_lines(compare(rows, None, [f32, w8])[0])
    assert any(ln.startswith("- decode per token with 8-bit") and "side by side over 2 rounds" in ln for ln in lines)


def test_a_group_that_does_not_fit_in_memory_is_cut_from_its_slowest_peer_and_says_so():
    rows = [_row("hetforge", 90, 9, rss=3000), _row("ort", 100, 12, rss=4000), _row("ov-f32", 95, 14, rss=5000)]
    keep, why = side.fit_memory(["hetforge", "ov-f32", "ort"], rows, MODEL, available_mb=11000)
    assert keep == ["hetforge", "ov-f32"] and "ort left out" in why
    keep, why = side.fit_memory(["hetforge", "ov-f32", "ort"], rows, MODEL, available_mb=50000)
    assert keep == ["hetforge", "ov-f32", "ort"] and why == ""
    keep, why = side.fit_memory(["hetforge", "ov-f32"], rows, MODEL, available_mb=5000)
    assert keep == [] and "not run" in why


def test_targets_are_judged_on_the_rounds_against_the_peer_fastest_over_them():
    """The serial medians say hetforge loses to ort (96 > 0.95 × 100); side by side, round by round, it is at 0.90 of
    ov-f32 (the peer with the lowest median over the rounds): the target is judged on that, the serial figures kept."""
    rows = [_row("hetforge", 96, 9), _row("ort", 100, 12), _row("ov-f32", 105, 14)]
    group = {"model": MODEL, "mine": "hetforge", "systems": ["hetforge", "ort", "ov-f32"], "rounds": 3,
             "prefill_ms": {"hetforge": [90, 180, 91], "ort": [110, 210, 100], "ov-f32": [100, 200, 101]},
             "step_ms": {"hetforge": [10, 10, 10], "ort": [9, 9, 9], "ov-f32": [20, 20, 20]},
             "calls": {"prefill": 5, "step": 20}, "loadavg": [1.0, 1.0, 1.0], "notes": []}
    t = compare(rows, None, [group])[0]["targets"]
    pre = t["prefill_ms_at_or_below_best_f32_peer"]
    assert pre["judged"] == "side by side" and pre["best_peer"] == "ov-f32"
    assert pre["per_round"] == pytest.approx([0.9, 0.9, 91 / 101]) and pre["met"]
    assert pre["serial"]["best_peer"] == "ort" and not pre["serial"]["met"]
    step = t["step_ms_at_or_below_best_f32_peer"]
    assert step["best_peer"] == "ort" and step["ratio"] == pytest.approx(10 / 9) and not step["met"]
    assert "judged" in t["prefill_ms_at_or_below_best_f32_peer"]
    assert compare(rows)[0]["targets"]["prefill_ms_at_or_below_best_f32_peer"]["judged"] == "serial"
    line = next(ln for ln in target_lines(compare(rows, None, [group])[0]) if ln.startswith("- prefill"))
    assert "side by side over 3 rounds (per round 0.90, 0.90, 0.90)" in line
    assert "serial rows 96.0 ms against ort 100.0 ms (0.96×)" in line and line.endswith("**met**")
    # a group with no completed round judges nothing
    assert side.verdict([{**group, "rounds": 0}], MODEL, "hetforge", "prefill_ms") is None


def test_a_serving_worker_says_ready_then_times_one_batch_per_command():
    got: list[dict] = []
    spec = WorkerSpec(system="eager", model=MODEL, seq=8, threads=1)
    cmds = [json.dumps({"shape": "prefill", "warmup": 1, "calls": 3}), json.dumps({"shape": "step", "calls": 4}),
            json.dumps({"quit": True}), json.dumps({"shape": "step", "calls": 99})]
    assert serve(spec, iter(cmds), got.append) == 0
    assert got[0]["ready"] is True and len(got) == 3  # nothing after quit
    assert len(got[1]["ms"]) == 3 and len(got[2]["ms"]) == 4 and all(x > 0 for x in got[1]["ms"] + got[2]["ms"])
    dec: list[dict] = []  # a system that decodes answers a decode command with one request's mean ms per token
    spec = WorkerSpec(system="eager", model=MODEL, seq=8, threads=1, decode_tokens=4)
    assert serve(spec, iter([json.dumps({"shape": "decode", "tokens": 4})]), dec.append) == 0
    assert dec[0]["ready"] is True and dec[0]["decode"] is True
    assert len(dec[1]["ms"]) == 1 and dec[1]["ms"][0] > 0 and dec[1]["ttft_ms"] > 0
    failed: list[dict] = []
    assert serve(WorkerSpec(system="eager", model="no-such-model"), iter([]), failed.append) == 1
    assert failed[0]["ready"] is False and "no-such-model" in failed[0]["error"]


def test_the_suite_times_hetforge_and_its_peer_side_by_side_in_their_own_processes(tmp_path):
    cfg = SuiteConfig(models=[MODEL], systems=["eager", "hetforge"], repeats=1, quick=True, seq=16, isolate=True,
                      warm=False, workdir=str(tmp_path / "work"), timeout_s=300, side_rounds=2)
    res = run_suite(cfg, command="pytest")
    (g,) = res.side
    assert g["mine"] == "hetforge" and g["systems"] == ["hetforge", "eager"] and g["rounds"] == 2, g["notes"]
    for metric in ("prefill_ms", "step_ms"):
        assert all(len(g[metric][s]) == 2 and min(g[metric][s]) > 0 for s in g["systems"])
    t = res.comparisons[0]["targets"]["step_ms_at_or_below_best_f32_peer"]
    assert t["judged"] == "side by side" and len(t["per_round"]) == 2
    page = render_markdown(res, None)
    assert "Side by side (" in page and "| HF eager |" in page
    assert not list((tmp_path / "work").glob("side-*"))  # the group's folder went with the suite's


def test_a_group_that_times_decode_runs_whole_requests_in_turns_in_their_own_processes(tmp_path):
    """hetforge's runtime (compiled once, before the rounds) and OpenVINO's stateful model, each in a serving worker:
    every round one decode request each, besides the prefill and one-token batches; HF eager in the same group is
    timed for its batches but not for decode (it is no decode peer)."""
    pytest.importorskip("openvino")
    model = "llama-tiny"
    cfg = SuiteConfig(models=[model], systems=["eager", "hetforge", "ov-stateful-f32"], repeats=1, quick=True, seq=16,
                      isolate=True, warm=False, workdir=str(tmp_path / "work"), timeout_s=300, side_rounds=2)
    (tmp_path / "work").mkdir()
    g = side.run_group(cfg, model, "hetforge", ["ov-stateful-f32", "eager"], tmp_path / "work", lambda _: None, None,
                       worker_env, _env_for, list(side.METRICS))
    assert g.rounds == 2 and g.systems == ["hetforge", "ov-stateful-f32", "eager"], g.notes
    assert g.calls["decode"] == 8  # quick mode's decode tokens
    assert sorted(g.decode_ms_per_token) == ["hetforge", "ov-stateful-f32"]
    for s in g.systems:
        assert len(g.prefill_ms[s]) == 2 and len(g.step_ms[s]) == 2
    for xs in g.decode_ms_per_token.values():
        assert len(xs) == 2 and min(xs) > 0
    page = "\n".join(side_lines([g.to_dict()], model, {}))
    assert "decode ms/token" in page and "one decode request of 8 new tokens" in page


def test_side_rounds_out_of_range_is_a_usage_error():
    res = CliRunner().invoke(app, ["bench", "peers", "-m", MODEL, "-s", "eager", "--quick", "--side-rounds", "-1"])
    assert res.exit_code == 2 and "--side-rounds must be in 0..50" in res.output
