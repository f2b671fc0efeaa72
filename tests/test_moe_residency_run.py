"""Residency executed: moe-demo's MoE blocks expanded into expert groups, each pinned to the device the residency
model chose, compiled into placed programs and run by the generation runtime (real torch.export, real partitions,
the emulated NPU enforcing its op set and static shapes)."""

from __future__ import annotations

import json

import pytest
import torch
from fx_partition import partition_graph

from hetforge.backends.base import ConstraintViolation
from hetforge.backends.emulated import EmulatedBackend, check_constraints
from hetforge.backends.torch_cpu import TorchCpuBackend
from hetforge.cli.common import app
from hetforge.cli.main import _load_commands
from hetforge.frontend import capture
from hetforge.hardware import load_soc
from hetforge.models.zoo import load_model
from hetforge.moe import apply_tiers, calibrate, choose_tiers, moe_graph
from hetforge.moe.expand import expand_moe
from hetforge.moe.residency import expert_dims
from hetforge.ops.moe import recording
from hetforge.passes import copy_gm
from hetforge.runtime import Engine, SamplingParams
from hetforge.runtime.moe_exec import MoeOptions, MoePlacedExecutor, TieredReference

_load_commands()
TEXT = ("The with statement is used to wrap the execution of a block with methods defined by a context manager. "
        "This allows common try, except and finally usage patterns to be encapsulated for convenient reuse. ") * 6
PROMPT = "The with statement is used to wrap the"
NEW = 12
# the second SoC is the slow pass's (`make test` runs it): each SoC compiles its own prefill and decode programs
TWO_SOCS = ["jetson-agx-orin", pytest.param("apple-m2-max", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe-run")
    (d / "data.txt").write_text(TEXT)
    lm = load_model("moe-demo")
    cal = calibrate(lm, d / "data.txt", seq=32, max_chunks=4)
    (d / "cal.json").write_text(json.dumps(cal))
    return lm, cal, d


def _engine(lm, cal, soc, **kw):
    ex = MoePlacedExecutor(soc=soc, moe=MoeOptions(cal, **kw), dims=expert_dims(lm.model))
    return Engine(lm, executor=ex), ex


def _hf_tokens(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_expanded_groups_compute_what_the_tiered_moe_op_computes(demo):
    lm, cal, _ = demo
    g = moe_graph(lm, 32)
    plan = choose_tiers(cal, 32, share=0.9, group_size=2, capacity_factor=1.0)
    tiered = apply_tiers(copy_gm(g), plan)
    expanded, exp = expand_moe(copy_gm(g), plan)
    names = {str(n.target) for n in expanded.graph.nodes}
    assert "hetforge.moe.default" not in names and len(exp.groups) == 8  # 2 layers × 4 groups of 2
    ids = torch.tensor([lm_ids(lm, TEXT)[:32]])
    with recording() as r1, torch.no_grad():
        a = tiered(ids, torch.ones_like(ids))
    with recording() as r2, torch.no_grad():
        b = expanded(ids, torch.ones_like(ids))
    assert torch.equal(a, b)
    d1, d2 = r1.per_layer(), r2.per_layer()
    assert [d1[k]["dropped"] for k in d1] == [d2[k]["dropped"] for k in d2]
    assert sum(d["dropped"] for d in d2.values()) > 0  # capacity factor 1.0 really drops


def lm_ids(lm, text):
    from hetforge.tokenizers import for_model

    return for_model(lm).encode(text)


@pytest.mark.parametrize("soc", TWO_SOCS)
def test_unlimited_groups_on_placed_programs_generate_hf_tokens(demo, soc):
    lm, cal, _ = demo
    eng, ex = _engine(lm, cal, soc, unlimited=True, objective="energy")
    r = eng.generate(PROMPT, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert r.tokens == _hf_tokens(lm.model, eng.encode(PROMPT), NEW)
    for kind, n in (("prefill", 32), ("decode", r.cache_length)):
        prog = eng.programs.programs[(kind, n)]
        exp = ex.expansions[f"{kind}-{n}"]
        assert len(exp.groups) == 8 and all(g.capacity == exp.tokens for g in exp.groups)  # T slots: no drop
        for g in exp.groups:  # each group runs where the residency model put it, with its reason
            assert prog.placed.compiled.placement.assignment[g.node] == g.device
            assert prog.placed.compiled.placement.reasons[g.node].startswith("MoE residency")


@pytest.fixture(scope="module")
def tiered_ref(demo):
    lm, cal, _ = demo
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    return Engine(lm, executor=TieredReference(cal)).generate(PROMPT, params)


@pytest.mark.parametrize("soc", TWO_SOCS)
def test_tiered_groups_generate_the_unexpanded_tiered_models_tokens_and_the_npu_holds_the_hot_groups(
        demo, tiered_ref, soc):
    lm, cal, _ = demo
    eng, ex = _engine(lm, cal, soc, objective="energy")
    with recording() as rec:
        r = eng.generate(PROMPT, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert sum(d["dropped"] for d in rec.per_layer().values()) > 0  # the static capacities dropped tokens
    assert r.tokens == tiered_ref.tokens
    assert r.placed["prefill"]["by_device"]["npu"]["modeled_ms"] > 0  # the ledger saw the NPU calls
    prog = eng.programs.programs[("prefill", 32)]
    pg, res = prog.placed.partitions, prog.placed.compiled
    exp = ex.expansions["prefill-32"]
    npu_groups = [g for g in exp.groups if g.device == "npu"]
    host_groups = [g for g in exp.groups if g.device != "npu"]
    assert npu_groups and host_groups
    # on jetson-agx-orin the NPU groups are per layer the calibrated hottest (the model decides per group: on
    # apple-m2-max its GPU is as cheap as the NPU for the hottest group, which stays there)
    for lay in {g.layer for g in exp.groups} if soc == "jetson-agx-orin" else ():
        share = cal["layers"][lay]["share"]
        hot = min(sum(share[e] for e in g.experts) for g in npu_groups if g.layer == lay)
        cold = [sum(share[e] for e in g.experts) for g in host_groups if g.layer == lay]
        assert all(c <= hot for c in cold)
    npu_parts = [p for p in pg.partitions if p.device == "npu"]
    npu_nodes = {n for p in npu_parts for n in p.nodes}
    npu_weights = {w for p in npu_parts for w in p.weights}
    for g in npu_groups:
        assert g.node in npu_nodes and res.placement.assignment[g.node] == "npu"
        assert f"_moe_l{g.layer}_g{g.group}_w_gate_up" in npu_weights
    for g in host_groups:
        assert g.node not in npu_nodes and f"_moe_l{g.layer}_g{g.group}_w_gate_up" not in npu_weights
    assert prog.placed.exe.bindings["npu"].emulated
    # what the NPU partitions hold is only expert-group work (router, dispatch, combine are CPU control work)
    ops = {str(n.target) for p in npu_parts for n in p.gm.graph.nodes if n.op == "call_function"}
    assert "hetforge.moe_group.default" in ops and not ops & {"hetforge.moe_route.default",
                                                              "hetforge.moe_scatter.default"}


class _Group(torch.nn.Module):
    def __init__(self, g=2, d=16, f=8):
        super().__init__()
        self.wgu = torch.nn.Parameter(torch.randn(g, 2 * f, d))
        self.wd = torch.nn.Parameter(torch.randn(g, d, f))

    def forward(self, xs):
        return torch.ops.hetforge.moe_group(xs, self.wgu, self.wd, "silu", False)


def test_emulated_npu_runs_a_static_group_and_refuses_a_dynamic_shape_group():
    npu = load_soc("jetson-agx-orin").device("npu")
    m = _Group()
    xs = torch.randn(2, 4, 16)
    static = capture(m, (xs,)).gm
    pg = partition_graph(static, {n.name: "npu" for n in static.graph.nodes})
    compiled = EmulatedBackend(npu, TorchCpuBackend()).compile(pg.partitions[0])
    out, _ = compiled.run([xs])
    torch.testing.assert_close(out[0], m(xs))
    dyn = capture(m, (xs,), dynamic_dims={0: {1: ("slots", 2, 64)}}).gm
    dpg = partition_graph(dyn, {n.name: "npu" for n in dyn.graph.nodes})
    violations, _ = check_constraints(dpg.partitions[0], npu)
    assert any(v.op == "hetforge.moe_group.default" and "needs static shapes" in v.constraint for v in violations)
    with pytest.raises(ConstraintViolation, match="needs static shapes"):
        EmulatedBackend(npu, TorchCpuBackend()).compile(dpg.partitions[0])


def test_cli_run_and_explain_show_each_groups_device_and_residency_reason(demo):
    from typer.testing import CliRunner

    lm, cal, d = demo
    runner = CliRunner()
    r = runner.invoke(app, ["run", "moe-demo", "--prompt", PROMPT, "-n", "4", "--soc", "jetson-agx-orin",
                            "--moe-calibration", str(d / "cal.json"), "--moe-objective", "energy", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    groups = doc["moe"]["prefill-32"]["groups"]
    assert {g["device"] for g in groups} >= {"npu"} and all("MoE residency" in g["reason"] for g in groups)
    assert doc["executor"] == "backend+moe-groups"
    r = runner.invoke(app, ["explain", "moe-demo", "--soc", "jetson-agx-orin", "--moe-calib", str(d / "cal.json"),
                            "--node", "moe_l0_g0", "--seq", "32", "--objective", "energy", "--json"])
    assert r.exit_code == 0, r.output
    ex = json.loads(r.stdout)
    g0 = next(g for g in ex["moe_groups"]["groups"] if g["node"] == "moe_l0_g0")
    assert ex["device"] == g0["device"] and ex["reason"] == g0["reason"] and "MoE residency" in ex["reason"]


def test_run_moe_bad_input_is_one_line_exit_2(demo, tmp_path):
    from typer.testing import CliRunner

    _, cal, d = demo
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**cal, "model": "mixtral-tiny"}))
    runner = CliRunner()
    base = ["run", "moe-demo", "--prompt", PROMPT, "-n", "2", "--soc", "jetson-agx-orin"]
    for extra, msg in (([ "--moe-calibration", str(other)], "recorded for model 'mixtral-tiny'"),
                       (["--moe-calibration", str(d / "cal.json"), "--moe-group-size", "3"], "does not divide"),
                       (["--moe-calibration", str(d / "cal.json"), "--moe-capacity-factor", "0"], "must be > 0"),
                       (["--moe-calibration", str(d / "cal.json"), "--strategy", "support"], "takes no pins")):
        r = runner.invoke(app, base + extra)
        assert r.exit_code == 2, (extra, r.output)
        assert msg in r.output and "Traceback" not in r.output


def test_residency_pins_are_the_models_choices_and_the_baselines_pin_all_groups_one_way(demo):
    from hetforge.moe.expand import residency_pins
    from hetforge.moe.residency import plan_residency

    lm, cal, _ = demo
    soc = load_soc("jetson-agx-orin")
    plan = choose_tiers(cal, 32, share=0.9, group_size=2, capacity_factor=1.25)
    _, exp = expand_moe(moe_graph(lm, 32), plan)
    d, f, nb = expert_dims(lm.model)
    pins = residency_pins(exp, soc, cal, d, f, nb, "energy")
    model = {(c.layer, c.group): c.device for c in plan_residency(soc, cal, plan, d, f, 32, nb, objective="energy")}
    assert {g.node: soc.device(pins[g.node]).kind for g in exp.groups} == {
        g.node: model[(g.layer, g.group)] for g in exp.groups}
    assert {soc.device(v).kind for v in residency_pins(exp, soc, cal, d, f, nb, "energy", force="host").values()} \
        <= {"cpu", "gpu"}
    assert set(residency_pins(exp, soc, cal, d, f, nb, "energy", force="npu").values()) == {"npu"}
