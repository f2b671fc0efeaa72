"""Text generation through placed, partitioned programs: tokens equal Hugging Face's for every strategy × every
shipped SoC profile × {fp32, w8}; per-token modeled figures, whole-generation traces, generation plans."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands
from hetforge.cost.transfer import switch_cost_s
from hetforge.hardware import list_socs, load_soc
from hetforge.hetero.timeline import schedule_run
from hetforge.models.zoo import load_model
from hetforge.quant.schemes import dequantize_int8, quantize_int8
from hetforge.runtime import Engine, SamplingParams

_load_commands()
SOCS = [s for s in list_socs() if s != "host"]
STRATEGIES = ("rules", "greedy", "pgsam", "support", "single")
PROMPT = "The quick brown fox"
NEW = 5


@pytest.fixture
def cli():
    from typer.testing import CliRunner

    return CliRunner()


def _hf_tokens(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _w8_model(model):
    """The model with every Linear's weight replaced by its per-channel int8 round trip: what w8 computes."""
    m = copy.deepcopy(model)
    for mod in m.modules():
        if isinstance(mod, torch.nn.Linear):
            q, s = quantize_int8(mod.weight)
            # a new Parameter: a tied input embedding keeps its fp32 values (w8 quantizes linears only)
            mod.weight = torch.nn.Parameter(dequantize_int8(q, s).to(mod.weight.dtype), requires_grad=False)
    return m


@pytest.fixture(scope="module")
def tiny():
    lm = load_model("llama-tiny")
    ids = Engine(lm, soc="host", strategy="single").encode(PROMPT)
    refs = {"none": _hf_tokens(lm.model, ids, NEW), "w8": _hf_tokens(_w8_model(lm.model), ids, NEW)}
    return lm, refs, {}


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["none", "w8"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("soc", SOCS)
def test_greedy_tokens_equal_hugging_face_for_every_soc_strategy_and_scheme(tiny, soc, strategy, quantize,
                                                                            monkeypatch):
    # the w8 reference is HF with int8 round-trip weights: weight-only arithmetic (--w8-act weight-only); the
    # default q8 mode also quantizes the host CPU's activations, while emulated devices stay weight-only
    monkeypatch.setenv("HETFORGE_W8_ACT", "weight-only")
    lm, refs, seen = tiny
    e = Engine(lm, soc=soc, strategy=strategy, quantize=quantize)
    r = e.generate(PROMPT, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert r.tokens == refs[quantize], f"{soc}/{strategy}/{quantize}"
    parts = r.placed["partitions"]["decode"]["partitions"]
    seen[(soc, strategy, quantize)] = {p["device"] for p in parts}


@pytest.mark.slow
def test_the_matrix_really_ran_on_several_devices(tiny):
    """Runs after the matrix (same module): a matrix where everything stayed on the CPU would prove nothing."""
    seen = tiny[2]
    if len(seen) < len(SOCS) * len(STRATEGIES) * 2:
        pytest.skip("the matrix was deselected (-m 'not slow'); nothing to check")
    multi = [k for k, devs in seen.items() if len(devs) > 1]
    assert len(multi) >= len(seen) // 3
    assert any("npu" in devs for devs in seen.values())
    assert any("gpu" in devs for devs in seen.values())


@pytest.mark.parametrize(("name", "soc", "strategy"), [
    *[(n, s, st) for n in ("gpt2-tiny", "qwen2-tiny") for s, st in (
        ("jetson-agx-orin", "rules"), ("intel-core-ultra-155h", "pgsam"), ("apple-m2-max", "greedy"))],
    ("demo", "jetson-orin-nano", "rules"), ("demo", "snapdragon-x-elite", "greedy")])
def test_other_families_generate_hugging_face_tokens_on_placed_programs(name, soc, strategy):
    lm = load_model(name)
    e = Engine(lm, soc=soc, strategy=strategy)
    r = e.generate(PROMPT, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert r.tokens == _hf_tokens(lm.model, e.encode(PROMPT), NEW)


def test_per_token_figures_count_switches_and_bytes_and_say_modeled_or_measured():
    lm = load_model("llama-tiny")
    r155 = Engine(lm, soc="intel-core-ultra-155h", strategy="greedy").generate(
        PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
    pl = r155.placed
    dec = pl["decode_per_token"]
    assert pl["decode_tokens"] == 3
    parts = pl["partitions"]["decode"]
    assert dec["switches"] == parts["switches"] > 0
    assert dec["bytes_moved"] > 0  # the 155H's links are not unified: values are copied
    assert dec["modeled_ms"] > 0 and dec["modeled_mj"] > 0
    assert set(dec["by_device"]) == {p["device"] for p in parts["partitions"]}
    assert "modeled" in pl["labels"]["modeled_*"] and "measured" in pl["labels"]["measured_*"]
    orin = Engine(lm, soc="jetson-agx-orin", strategy="greedy").generate(
        PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True)).placed["decode_per_token"]
    assert orin["transfers"] > 0 and orin["zero_copy"] == orin["transfers"] and orin["bytes_moved"] == 0


def test_host_plan_is_one_partition_on_the_cpu_executor():
    lm = load_model("llama-tiny")
    e = Engine(lm, soc="host")
    r = e.generate(PROMPT, SamplingParams(max_new_tokens=3, ignore_eos=True))
    parts = r.placed["partitions"]["decode"]["partitions"]
    assert [(p["device"], p["backend"]) for p in parts] == [("cpu", "torch-cpu")]
    assert r.placed["decode_per_token"]["switches"] == 0


def _fake_run(devices_inputs, costs, transfers=()):
    """A PartitionedGraph/RunReport pair by hand: partition k on devices_inputs[k][0] reads [1] and writes 'o{k}'."""
    parts = [SimpleNamespace(index=k, device=d, inputs=list(ins), outputs=[f"o{k}"], nodes=[f"n{k}"])
             for k, (d, ins) in enumerate(devices_inputs)]
    pg = SimpleNamespace(partitions=parts, producer=lambda: {f"o{p.index}": p.index for p in parts})
    calls = [SimpleNamespace(partition=k, modeled_s=c, modeled_j=c, backend="b") for k, c in enumerate(costs)]
    trs = [SimpleNamespace(value=v, dst=dst, modeled_s=t, modeled_j=0.0, nbytes=8, mode="copy")
           for v, dst, t in transfers]
    return pg, SimpleNamespace(calls=calls, transfers=trs)


def test_timeline_overlaps_independent_partitions_and_charges_switches():
    soc = load_soc("intel-core-ultra-155h")
    sw_gpu, sw_cpu = switch_cost_s(soc, "cpu", "gpu"), switch_cost_s(soc, "gpu", "cpu")
    # p0 (cpu) and p1 (gpu) both read only the graph input: they can run at once; p2 (cpu) joins them.
    pg, rep = _fake_run([("cpu", ["x"]), ("gpu", ["x"]), ("cpu", ["o0", "o1"])], [3e-3, 5e-3, 1e-3],
                        [("x", "gpu", 1e-4), ("o1", "cpu", 2e-4)])
    tl = schedule_run(pg, rep, soc)
    gpu_end = 1e-4 + sw_gpu + 5e-3
    want = max(3e-3, gpu_end + 2e-4) + sw_cpu + 1e-3
    assert tl.makespan_s == pytest.approx(want)
    assert tl.makespan_s < tl.serial_s  # a schedule, not a sum
    assert tl.switches == 2 and tl.switch_s == pytest.approx(sw_gpu + sw_cpu)
    # a chain cannot overlap: the makespan is the sum
    pg, rep = _fake_run([("cpu", ["x"]), ("gpu", ["o0"])], [1e-3, 2e-3], [("o0", "gpu", 5e-4)])
    tl = schedule_run(pg, rep, soc)
    assert tl.makespan_s == pytest.approx(tl.serial_s) == pytest.approx(1e-3 + 5e-4 + sw_gpu + 2e-3)


def test_cli_run_on_an_soc_prints_modeled_per_device_figures_and_writes_a_trace(cli, tmp_path):
    trace = tmp_path / "gen.json"
    res = cli.invoke(app, ["run", "llama-tiny", "-p", PROMPT, "-n", "4", "--soc", "intel-core-ultra-155h",
                           "--strategy", "greedy", "--trace", str(trace), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["soc"] == "intel-core-ultra-155h" and d["strategy"] == "greedy"
    assert d["placed"]["decode_per_token"]["modeled_mj"] > 0
    ev = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in ev if e.get("name") == "thread_name"}
    assert {"cpu", "gpu", "transfers"} <= lanes
    assert any(e["ph"] == "s" for e in ev) and any(e["ph"] == "f" for e in ev)
    assert {e["args"]["figure"] for e in ev if e["ph"] == "X"} == {"measured", "modeled"}
    text = cli.invoke(app, ["run", "llama-tiny", "-p", PROMPT, "-n", "3", "--soc", "jetson-agx-orin"])
    assert text.exit_code == 0 and "(modeled;" in text.stdout and "(measured)" in text.stdout


def test_generation_plan_round_trip_gives_the_same_tokens(cli, tmp_path):
    plan = tmp_path / "gen.hfp"
    res = cli.invoke(app, ["compile", "llama-tiny", "--soc", "intel-core-ultra-155h", "--strategy", "greedy",
                           "--generate", "--tiers", "32", "--cache", "32", "--out", str(plan), "--json"])
    assert res.exit_code == 0, res.output
    direct = json.loads(cli.invoke(app, ["run", "llama-tiny", "-p", PROMPT, "-n", "4", "--soc",
                                         "intel-core-ultra-155h", "--strategy", "greedy", "--json"]).stdout)
    via = cli.invoke(app, ["run", "llama-tiny", "-p", PROMPT, "-n", "4", "--plan", str(plan), "--json"])
    assert via.exit_code == 0, via.output
    got = json.loads(via.stdout)
    assert got["tokens"] == direct["tokens"]
    assert got["placed"]["partitions"]["decode"]["instructions_by_device"] == \
        direct["placed"]["partitions"]["decode"]["instructions_by_device"]


def test_generation_plan_made_from_a_profile_file_runs_without_the_file(cli, tmp_path):
    src = load_soc("jetson-orin-nano")
    prof = tmp_path / "board.json"
    from hetforge.hardware.loader import _shipped

    prof.write_text(_shipped()["jetson-orin-nano"].read_text().replace('"jetson-orin-nano"', '"my-board"', 1))
    plan = tmp_path / "p.hfp"
    assert cli.invoke(app, ["compile", "llama-tiny", "--soc", str(prof), "--strategy", "rules", "--generate",
                            "--tiers", "32", "--cache", "32", "--out", str(plan)]).exit_code == 0
    prof.unlink()
    res = cli.invoke(app, ["run", "llama-tiny", "-p", PROMPT, "-n", "3", "--plan", str(plan), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["soc"] == "my-board" != src.name


def test_compile_generate_builds_its_first_decode_program_in_a_forked_child_with_the_same_plan(tmp_path,
                                                                                                  monkeypatch):
    """``compile --generate`` builds its first decode program in a forked child while the prefill tiers are built
    here (as a cold request does); the plan it writes equals the one built in turn (HETFORGE_PARALLEL_COMPILE=0)."""
    from hetforge.cli.commands.run import make_engine
    from hetforge.runtime import ahead
    from hetforge.runtime.genplan import save_genplan

    monkeypatch.setenv(ahead.ENV, "1")  # a user's HETFORGE_PARALLEL_COMPILE=0 must not skip it
    why = ahead.process_refusal()
    if why:
        # acceptable to skip: without fork() or a second core no program is ever built in a child (the plan is built
        # in turn, which the other generation-plan tests check), so the path under test does not exist here
        pytest.skip(f"no program is built in a forked child on this host ({why}), so there is no child to check")
    docs, child_s = {}, {}
    for parallel in ("0", "1"):
        monkeypatch.setenv("HETFORGE_PARALLEL_COMPILE", parallel)
        monkeypatch.setenv("HETFORGE_COMPILE_CACHE_DIR", str(tmp_path / f"cache-{parallel}"))  # both cold
        # the NPU on the torch stand-in, not OpenVINO's: a process that has made its OpenVINO Core (earlier tests)
        # builds an OpenVINO-bound executor's programs in turn (Backend.fork_refusal), and this test is about
        # the child
        engine = make_engine("llama-tiny", "jetson-agx-orin", "backend", strategy="rules",
                             backend=["npu=emulated:torch-cpu"])
        docs[parallel] = save_genplan(engine, [32], [32], tmp_path / f"p{parallel}.hfp")
        child_s[parallel] = engine.programs.programs[("decode", 32)].child_s  # set when a child's entry was used
        assert not engine.programs.ahead  # no child left behind
    assert child_s["0"] is None and child_s["1"] is not None and child_s["1"] > 0
    assert docs["1"]["programs"] == docs["0"]["programs"]


@pytest.mark.parametrize(("args", "needle"), [
    (["run", "gpt2-tiny", "-p", "x", "--plan", "{plan}"], "compiled for model 'llama-tiny', not 'gpt2-tiny'"),
    (["run", "llama-tiny", "-p", "x" * 40, "-n", "2", "--plan", "{plan}"], "holds prefill tiers [32]"),
    (["run", "llama-tiny", "-p", "x", "-n", "40", "--plan", "{plan}"], "needs decode KV cache length 64"),
    (["run", "llama-tiny", "-p", "x", "--strategy", "fastest"], "unknown strategy 'fastest'"),
    (["run", "llama-tiny", "-p", "x", "--soc", "jetson-agx-orin", "--objective", "speed"], "unknown objective"),
    (["run", "llama-tiny", "-p", "x", "--soc", "nope"], "unknown SoC 'nope'"),
    (["run", "llama-tiny", "-p", "x", "--soc", "jetson-agx-orin", "--backend", "tpu=torch-cpu"], "unknown device"),
    (["run", "llama-tiny", "-p", "x", "--trace", "/nonexistent-dir/t.json"], "does not exist"),
    (["compile", "llama-tiny", "--generate", "--tiers", "33", "--out", "{tmp}/x.hfp"], "not a prompt tier"),
    (["compile", "llama-tiny", "--generate"], "give --out FILE"),
])
def test_bad_generation_input_exits_2_naming_what_is_wrong(cli, tmp_path, args, needle):
    plan = tmp_path / "p.hfp"
    if any("{plan}" in a for a in args):
        assert cli.invoke(app, ["compile", "llama-tiny", "--soc", "jetson-agx-orin", "--generate", "--tiers", "32",
                                "--cache", "32", "--out", str(plan)]).exit_code == 0
    argv = [a.replace("{plan}", str(plan)).replace("{tmp}", str(tmp_path)) for a in args]
    res = cli.invoke(app, argv)
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and "Traceback" not in res.output
    assert not list(tmp_path.glob("x.hfp*")) and not list(tmp_path.glob(".*tmp"))


def test_a_partition_needing_an_op_its_device_lacks_is_refused_naming_op_and_device():
    from hetforge.backends.base import ConstraintViolation
    from hetforge.frontend import capture
    from hetforge.placement import Placement
    from hetforge.runtime.executors import PlacedExecutor

    lm = load_model("llama-tiny")
    inputs = (torch.zeros((1, 8), dtype=torch.long), torch.tensor([7]))
    from hetforge.runtime.static_kv import PrefillModule

    cg = capture(PrefillModule(lm.model), inputs)
    ex = PlacedExecutor(soc="test-npu-gaps", strategy="support")
    res = ex.place(cg.gm, inputs, "prefill-8", True)
    everything_on_npu = Placement("forced", dict.fromkeys(res.placement.assignment, "npu"))
    res = ex.place(cg.gm, inputs, "prefill-8", True, placement=everything_on_npu)
    with pytest.raises(ConstraintViolation, match=r"op not supported by npu 'npu'"):
        ex.build_program(res)
