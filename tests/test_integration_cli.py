"""End-to-end CLI paths that cross several stages: passes → quantize → placement → backend."""

import json

from typer.testing import CliRunner

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands

_load_commands()
runner = CliRunner()


def test_compile_with_quantize_and_objective_reports_smaller_weights():
    r = runner.invoke(app, ["compile", "llama-tiny", "--soc", "intel-core-ultra-155h", "--strategy", "greedy",
                            "--objective", "latency", "--quantize", "w8", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    q = d["quantize"]
    assert q["scheme"] == "w8" and q["quantized"] > 0
    assert q["graph_bytes_after"] < q["graph_bytes_before"]
    assert d["objective"] == "latency" and d["strategy"] == "greedy"


def test_run_graph_quantized_matches_eager_within_quantization_tolerance():
    r = runner.invoke(app, ["run-graph", "llama-tiny", "--quantize", "w8", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert 0 < d["fidelity"]["kl_max"] < 1e-2


def test_optimize_quantize_report_and_bad_scheme():
    r = runner.invoke(app, ["optimize", "gpt2-tiny", "--quantize", "w4", "--group-size", "32", "--skip", "lm_head",
                            "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["fused"]["attention"] == 2
    entries = {e["path"]: e for e in d["quantize"]["entries"]}
    assert entries["lm_head"]["scheme"] == "fp32"
    assert any(e["scheme"] == "w4" for e in entries.values())
    r = runner.invoke(app, ["optimize", "gpt2-tiny", "--quantize", "w3"])
    assert r.exit_code == 2 and "w8, w4, w8a8, none" in r.output
    r = runner.invoke(app, ["compile", "gpt2-tiny", "--strategy", "greedy", "--objective", "speed"])
    assert r.exit_code == 2 and "energy, latency, balanced" in r.output


def test_run_error_mid_stream_starts_its_own_line(monkeypatch):
    """An error raised after the prompt was echoed ends the echoed line first: stdout 'prompt+pieces\\n', then the
    one-line error on stderr (not 'hi there error: ...' glued to the text)."""
    from typer.testing import CliRunner

    from hetforge.cli.common import app
    from hetforge.cli.main import _load_commands
    from hetforge.errors import UsageError
    from hetforge.runtime import Engine

    def failing_stream(self, prompt, params):
        def gen():
            yield " there"
            raise UsageError("the KV cache is full")
        return gen()

    _load_commands()
    monkeypatch.setattr(Engine, "stream", failing_stream)
    r = CliRunner().invoke(app, ["run", "gpt2-tiny", "-p", "hi", "-n", "3"])
    assert r.exit_code == 2, r.output
    assert r.stdout.endswith(" there\n"), repr(r.stdout)
    assert r.stderr.strip().startswith("error: the KV cache is full")


def test_run_says_which_thread_counts_the_request_ran_on():
    """The text output names the prefill's thread count and why, and the decode steps per count; --json carries the
    same under ``threads_used`` (its top-level ``threads`` stays torch's count)."""
    r = runner.invoke(app, ["run", "gpt2-tiny", "-p", "hi", "-n", "5"])
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("threads: prefill on "))
    assert "decode steps on " in line
    r = runner.invoke(app, ["run", "gpt2-tiny", "-p", "hi", "-n", "5", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    used = d["threads_used"]
    assert used["prefill"] >= 1 and used["prefill_reason"]
    assert sum(used["decode_steps"].values()) == len(d["tokens"]) - 1  # every decode step, once
