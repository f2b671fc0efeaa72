"""Device failure during generation and run-time re-placement, on real compiled placed programs (llama-tiny on
jetson-orin-nano: CPU + an emulated GPU): a device fails mid-request, the runtime re-plans onto the survivors,
carries the KV cache over and produces the tokens of the run without the fault; load/temperature changes and
prompt-tier changes switch plans, each switch logged with its reason. Recovery times are printed (measured on this
loaded host), not asserted."""

from __future__ import annotations

import json

import pytest

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands
from hetforge.models.zoo import load_model
from hetforge.runtime import Engine, SamplingParams
from hetforge.runtime.failover import FailoverError, FaultSpec, parse_fault
from hetforge.runtime.replan import Adaptive, Change, parse_change

_load_commands()
SOC = "jetson-orin-nano"
PROMPT = "The quick brown fox"
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def lm():
    return load_model("llama-tiny")


@pytest.fixture(scope="module")
def reference(lm):
    """The no-fault run (greedy plan over CPU + GPU) and its engine."""
    eng = Engine(lm, soc=SOC, strategy="greedy")
    res = eng.generate(PROMPT, PARAMS)
    return res.tokens, eng


@pytest.fixture
def cli():
    from typer.testing import CliRunner

    return CliRunner()


def test_nominal_decode_plan_uses_the_gpu(reference):
    """The precondition of the fault tests: the GPU really runs part of the decode program."""
    _, eng = reference
    dec = next(p for (k, _), p in eng.programs.programs.items() if k == "decode")
    assert dec.placed.compiled.program.count_by_device().get("gpu", 0) > 0


def test_gpu_failure_mid_decode_recovers_on_cached_plan_with_no_fault_tokens(lm, reference):
    tokens, _ = reference
    a = Adaptive(Engine(lm, soc=SOC, strategy="greedy"), fault=FaultSpec("gpu", 3), prepare_failover=["gpu"])
    res = a.generate(PROMPT, PARAMS)
    assert res.tokens == tokens
    [rec] = a.recoveries
    assert rec.device == "gpu" and rec.token == 3 and rec.kind == "decode"
    assert rec.plan_was_cached and rec.survivors == ["cpu"]
    assert a.failed == {"gpu"}
    assert any(s.reason == "device gpu failed" and s.after == "failed=gpu" for s in a.switches)
    # the steps after the fault ran on the survivors' program: no GPU partition in them
    last = a.situated.programs(a.situation()).programs[("decode", res.cache_length)]
    assert set(last.placed.compiled.program.count_by_device()) == {"cpu"}
    print(f"\nrecovery after gpu failure at token 3 (measured, loaded host): {1e3 * rec.recovery_s:.2f} ms "
          f"(re-plan {1e3 * rec.replan_s:.3f} ms)")


def test_gpu_failure_during_prefill_with_plans_compiled_on_demand(lm, reference):
    tokens, _ = reference
    a = Adaptive(Engine(lm, soc=SOC, strategy="greedy"), fault=FaultSpec("gpu", 1), prepare_failover=False)
    res = a.generate(PROMPT, PARAMS)
    assert res.tokens == tokens
    [rec] = a.recoveries
    assert rec.kind == "prefill" and not rec.plan_was_cached
    print(f"\nrecovery with the plan compiled after the fault (measured): {1e3 * rec.recovery_s:.0f} ms")


def _gpu_without_embedding(tmp_path):
    """jetson-orin-nano whose GPU cannot run the embedding lookup: only the CPU can."""
    from hetforge.hardware.loader import _shipped

    d = json.loads(_shipped()[SOC].read_text())
    for dev in d["devices"]:
        if dev["name"] == "gpu":
            dev["unsupported_ops"] = ["aten.embedding.default"]
            dev["unsupported_ops_source"] = "test: the GPU cannot gather"
    d["name"] = "orin-nano-no-gpu-embedding"
    p = tmp_path / "soc.json"
    p.write_text(json.dumps(d))
    return p


def test_failure_of_the_only_device_able_to_run_an_op_names_it_and_keeps_tokens(lm, tmp_path, reference):
    soc = str(_gpu_without_embedding(tmp_path))
    a = Adaptive(Engine(lm, soc=soc, strategy="greedy"), fault=FaultSpec("cpu", 3), prepare_failover=False)
    gen = a.stream(PROMPT, PARAMS)
    got = []
    with pytest.raises(FailoverError) as ei:
        for tok, _ in gen.steps():
            got.append(tok)
    msg = str(ei.value)
    assert "aten.embedding.default" in msg and "cpu" in msg
    assert got == reference[0][:2]  # tokens 1 and 2 were made before the fault at token 3
    assert ei.value.result.tokens == got and ei.value.result.stop_reason == "device failure"


def test_load_and_temperature_changes_switch_plans_with_reasons_and_same_tokens(lm, reference):
    tokens, _ = reference
    changes = [Change(3, "gpu", "load", 0.75), Change(5, "gpu", "temp", 99.0)]
    a = Adaptive(Engine(lm, soc=SOC, strategy="greedy"), changes=changes, prepare_failover=False)
    res = a.generate(PROMPT, PARAMS)
    assert res.tokens == tokens
    reasons = [(s.token, s.after, s.reason) for s in a.switches]
    assert (3, "gpu:load0.75", "gpu load 0.75 at token 3") in reasons
    # 99 °C is past the throttle point (95 °C): Φ at 95 °C bin and the throttled clock are in the new situation
    assert (5, "gpu@95C,gpu:clock0.6,gpu:load0.75", "gpu temp 99 °C at token 5") in reasons


def test_prompt_moving_to_another_tier_is_logged_as_a_switch(lm):
    a = Adaptive(Engine(lm, soc=SOC, strategy="greedy"), prepare_failover=False)
    a.generate(PROMPT, SamplingParams(max_new_tokens=2))
    a.generate("a" * 40, SamplingParams(max_new_tokens=2))  # 40 byte tokens: tier 64
    [s] = a.switches
    assert (s.request, s.before, s.after) == (2, "tier 32", "tier 64") and "moved from prefill tier 32" in s.reason


def test_run_cli_with_injected_fault_prints_recovery(cli, reference):
    r = cli.invoke(app, ["run", "llama-tiny", "--soc", SOC, "--strategy", "greedy", "-p", PROMPT, "-n", "6",
                         "--ignore-eos", "--inject-fault", "gpu@3", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["tokens"] == reference[0]
    [rec] = doc["adaptive"]["recoveries"]
    assert rec["device"] == "gpu" and rec["plan_was_cached"] and rec["timing"] == "measured"


def test_run_cli_unrecoverable_fault_exits_1_naming_the_op_and_prints_text_so_far(cli, tmp_path):
    soc = str(_gpu_without_embedding(tmp_path))
    r = cli.invoke(app, ["run", "llama-tiny", "--soc", soc, "--strategy", "greedy", "-p", PROMPT, "-n", "6",
                         "--ignore-eos", "--inject-fault", "cpu@3"])
    assert r.exit_code == 1
    assert "aten.embedding.default" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout.startswith(PROMPT) and "2 tokens (device failure)" in r.stdout


@pytest.mark.parametrize("args, needle", [
    (["--inject-fault", "gpu"], "expected DEVICE@TOKEN"),
    (["--inject-fault", "tpu@3"], "unknown device 'tpu'"),
    (["--inject-fault", "gpu@0"], "TOKEN must be >= 1"),
    (["--set-load", "gpu=1.5"], "allowed: [0, 1)"),
    (["--set-temp", "gpu=900@2"], "allowed: [-40, 150] °C"),
    (["--set-load", "npu=0.5"], "unknown device 'npu'"),
    (["--inject-fault", "gpu@2", "--failover-plans", "later"], "ahead or on-demand"),
])
def test_run_cli_bad_fault_and_situation_options_exit_2(cli, args, needle):
    r = cli.invoke(app, ["run", "llama-tiny", "--soc", SOC, "-p", "hi", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_parsers_accept_the_documented_forms():
    assert parse_fault("gpu@3", ["cpu", "gpu"]) == FaultSpec("gpu", 3)
    assert parse_change("gpu=0.5@10", "load", ["cpu", "gpu"]) == Change(10, "gpu", "load", 0.5)
    assert parse_change("cpu=80", "temp", ["cpu", "gpu"]) == Change(1, "cpu", "temp", 80.0)


def test_recovery_reruns_the_step_on_the_survivors_plan_cached_before_the_fault(lm, reference):
    """Two requests share one set of situated programs: the first (no fault) compiles the failover plans ahead;
    the second's recovery runs the failed step on that very program object (no compile), and a third request
    after the device is revived recovers again the same way; tokens equal the no-fault run every time."""
    from hetforge.hardware.situation import Situation
    from hetforge.runtime.failover import revive
    from hetforge.runtime.replan import SituatedPrograms

    tokens, _ = reference
    eng = Engine(lm, soc=SOC, strategy="greedy")
    sit = SituatedPrograms(eng)
    Adaptive(eng, situated=sit, prepare_failover=["gpu"]).generate(PROMPT, PARAMS)
    failed = Situation.make(failed={"gpu"})
    [(key, survivor)] = [(k, p) for k, p in sit.caches[failed].programs.items() if k[0] == "decode"]
    for _ in range(2):
        survivor.placed.last = None  # forget its last run: a report below comes from the recovery's steps
        a = Adaptive(eng, fault=FaultSpec("gpu", 3), situated=sit, prepare_failover=["gpu"])
        res = a.generate(PROMPT, PARAMS)
        assert res.tokens == tokens
        [rec] = a.recoveries
        assert rec.plan_was_cached and rec.kind == "decode"
        assert sit.caches[failed].programs[key] is survivor  # the cached object ran, nothing was recompiled
        assert {c.device for c in survivor.placed.last.calls} == {"cpu"}
        assert 0 < rec.replan_s < rec.recovery_s and rec.rerun_s > 0 and rec.lost_s >= 0
        assert rec.recovery_s == pytest.approx(rec.replan_s + rec.rerun_s, abs=1e-3)
        revived = sum(revive(p) for p in sit.all_programs())
        assert revived > 0
    nominal = eng.programs.programs[key]
    assert {c.device for c in nominal.placed.partitions.partitions} == {"cpu", "gpu"}
    assert eng.generate(PROMPT, PARAMS).tokens == tokens  # revived: the nominal plan runs on the GPU again


def test_adaptive_steps_use_the_engines_thread_tuner(lm):
    """Every decode step of an adaptive request is timed by the engine's thread tuner (as a plain request's),
    so a loaded host's thread contention is handled the same way (runtime/threads.py)."""
    eng = Engine(lm, soc=SOC, strategy="greedy")
    gen = Adaptive(eng, prepare_failover=False).stream(PROMPT, PARAMS)
    for _ in gen:
        pass
    assert gen.tuner is eng.thread_tuner()
    assert sum(gen.tuner.counts.values()) == len(gen.result.decode_s) == PARAMS.max_new_tokens - 1
