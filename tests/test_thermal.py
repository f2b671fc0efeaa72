"""The lumped RC thermal model, the profile's thermal section, Φ(T) in the cost model and placement, and the
thermal simulation (fixed placement vs Φ-guided re-placement; every figure modeled)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands
from hetforge.cost.thermal import phi
from hetforge.cost.thermal_rc import DeviceThermal, ThermalParams, ThermalState, thermal_params
from hetforge.errors import UsageError
from hetforge.hardware import list_socs, load_soc
from hetforge.hardware.situation import Situation, situated_soc
from hetforge.thermal.simulate import PlanFigures, ThermalSimulation

_load_commands()
SOCS = [s for s in list_socs() if s != "host"]


def _dev(name="gpu", r=10.0, c=3.0, throttle=95.0, idle=0.5, tdp=10.0):
    return DeviceThermal(name, r, c, throttle, 5.0, 0.6, 60.0, 25.0, idle, tdp)


@pytest.fixture
def cli():
    from typer.testing import CliRunner

    return CliRunner()


@given(t0=st.floats(-20, 120), p=st.floats(0, 50), dt=st.floats(0.01, 500))
@settings(max_examples=60, deadline=None)
def test_rc_step_is_the_exact_solution_and_moves_monotonically_to_steady_state(t0, p, dt):
    d = _dev()
    t1 = d.advance(t0, 25.0, p, dt)
    ss = 25.0 + d.r_k_per_w * p
    assert t1 == pytest.approx(ss + (t0 - ss) * math.exp(-dt / (d.r_k_per_w * d.c_j_per_k)))
    assert min(t0, ss) - 1e-9 <= t1 <= max(t0, ss) + 1e-9
    # two half steps equal one whole step (constant power): the solution does not depend on the step size
    assert d.advance(d.advance(t0, 25.0, p, dt / 2), 25.0, p, dt / 2) == pytest.approx(t1, abs=1e-9)


def test_throttling_counts_onsets_with_hysteresis():
    p = ThermalParams("t", 25.0, {"gpu": _dev()})
    s = ThermalState(p)
    for _ in range(300):  # 20 W -> steady state 225 °C: throttles once and stays throttled
        s.step({"gpu": 20.0}, 1.0)
    assert len(s.events) == 1 and s.throttled["gpu"] and s.clock("gpu") == 0.6
    for _ in range(300):  # cools to ambient: released below 90 °C
        s.step({"gpu": 0.0}, 1.0)
    assert not s.throttled["gpu"]
    for _ in range(300):
        s.step({"gpu": 20.0}, 1.0)
    assert len(s.events) == 2


@pytest.mark.parametrize("soc", SOCS)
def test_shipped_profiles_carry_thermal_figures_with_sources(soc):
    tp = thermal_params(load_soc(soc))
    assert set(tp.devices) == set(load_soc(soc).device_names)
    for name, d in tp.devices.items():
        assert d.r_k_per_w > 0 and d.c_j_per_k > 0 and d.throttle_c > tp.ambient_c and 0 < d.throttled_clock <= 1
        for field in ("r_k_per_w", "c_j_per_k", "throttle_c", "hysteresis_c", "throttled_clock"):
            src = tp.sources[name][field]
            assert src["source"] and src["estimate"] is True  # no vendor publishes these: labelled estimates


def test_profile_without_thermal_section_gets_labelled_default():
    tp = thermal_params(load_soc("host"))
    assert tp.sources["cpu"]["estimate"] is True and "default rule" in tp.sources["cpu"]["source"]


def _profile_with(tmp_path, edit):
    from hetforge.hardware.loader import _shipped

    d = json.loads(_shipped()["jetson-orin-nano"].read_text())
    edit(d["thermal"])
    p = tmp_path / "p.json"
    p.write_text(json.dumps(d))
    return p


@pytest.mark.parametrize("edit, needle", [
    (lambda t: t["devices"]["gpu"]["r_k_per_w"].update(value=-1.0),
     "field 'thermal.devices.gpu.r_k_per_w.value': got -1.0; allowed range: (0, 50] (K/W)"),
    (lambda t: t["devices"]["cpu"]["throttled_clock"].update(value=1.5), "allowed range: (0, 1]"),
    (lambda t: t["ambient_c"].update(value=300), "thermal.ambient_c.value': got 300; allowed range: [-40, 60] (°C)"),
    (lambda t: t["devices"]["gpu"]["throttle_c"].update(value=200), "allowed range: [40, 125] (°C)"),
    (lambda t: t["devices"]["gpu"]["c_j_per_k"].update(value=0), "allowed range: (0, 10000] (J/K)"),
    (lambda t: t["ambient_c"].update(value=50) or t["devices"]["gpu"]["throttle_c"].update(value=45),
     "throttle_c (45.0) must be above thermal.ambient_c (50.0)"),
    (lambda t: t["devices"].update(tpu=t["devices"]["gpu"]), "thermal.devices: unknown device 'tpu'"),
])
def test_thermal_parameters_out_of_range_name_field_and_range(tmp_path, edit, needle):
    with pytest.raises(UsageError) as ei:
        load_soc(str(_profile_with(tmp_path, edit)))
    assert needle in str(ei.value)


def test_simulate_cli_bad_thermal_profile_exits_2(cli, tmp_path):
    p = _profile_with(tmp_path, lambda t: t["devices"]["gpu"]["r_k_per_w"].update(value=99))
    r = cli.invoke(app, ["simulate", "thermal", "--soc", str(p), "--out", str(tmp_path / "x.png")])
    assert r.exit_code == 2 and "r_k_per_w" in r.stderr and "(0, 50] (K/W)" in r.stderr
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("args, needle", [
    (["--minutes", "0"], "--minutes must be in (0, 1440]"),
    (["--ambient", "99"], "--ambient must be in [-40, 60]"),
    (["--duty", "2"], "--duty must be in (0, 1]"),
    (["--workload", "llama-tiny:train"], "the phase must be decode or prefill"),
    (["--out", "x.txt"], ".png"),
    (["--min-dwell", "-1"], "--min-dwell must be in [0, 3600] s"),
    (["--min-gain", "1"], "--min-gain must be in [0, 1)"),
])
def test_simulate_cli_bad_options_exit_2(cli, tmp_path, args, needle):
    r = cli.invoke(app, ["simulate", "thermal", "--soc", "jetson-orin-nano", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_situated_profile_applies_phi_to_every_estimate_and_throttle_to_peaks():
    import torch

    from hetforge.cost import estimate
    from hetforge.frontend import capture

    soc = load_soc("jetson-orin-nano")
    hot = situated_soc(soc, Situation.make(temps={"gpu": 90.0}, clocks={"gpu": 0.6}, failed=()))
    gpu, hgpu = soc.device("gpu"), hot.device("gpu")
    assert hgpu.peak("fp32") == pytest.approx(0.6 * gpu.peak("fp32"))
    lin = torch.nn.Linear(256, 256)
    cg = capture(lin, (torch.randn(4, 256),))
    node = next(n for n in cg.gm.graph.nodes if n.op == "call_function")
    base = estimate(node, gpu)
    cool = estimate(node, situated_soc(soc, Situation.make(temps={"gpu": 90.0})).device("gpu"))
    assert cool.energy_j == pytest.approx(base.energy_j / phi(90.0, gpu.t_ref_c, gpu.thermal_sigma_c))
    assert estimate(node, hgpu).time_s >= base.time_s
    failed = situated_soc(soc, Situation.make(failed={"gpu"}))
    assert failed.device_names == ["cpu"] and failed.links == []


class _Synthetic(ThermalSimulation):
    """The policies over given plan figures (no compilation): what the controller decides, tested alone."""

    def __init__(self, params, plans):
        self.params, self.plans, self.duty, self.log = params, plans, 1.0, (lambda s: None)

    def plan(self, sit):
        return self.plans.get(sit, self.plans[Situation()])


def test_phi_policy_moves_work_before_throttling_where_a_cooler_plan_exists():
    params = ThermalParams("t", 25.0, {"gpu": _dev("gpu", r=10.0), "npu": _dev("npu", r=4.0, tdp=15.0)})
    hot = Situation.make(temps={"gpu": 95.0})
    plans = {Situation(): PlanFigures("nominal", 1e-3, {"gpu": 1e-3}, {"gpu": 20e-3}, {"gpu": 10}),  # 20 W on gpu
             hot: PlanFigures(hot.key(), 2e-3, {"npu": 2e-3}, {"npu": 25e-3}, {"npu": 10})}  # 12.5 W on npu
    sim = _Synthetic(params, plans)
    fixed = sim.run("fixed", 600.0)
    guided = sim.run("phi", 600.0)
    assert len(fixed.events) >= 1 and fixed.peak_c["gpu"] >= 95.0
    assert len(guided.events) == 0 and max(guided.peak_c.values()) < 95.0
    assert guided.switches and "gpu predicted" in guided.switches[0]["reason"]
    assert guided.plans_used == {hot.key(): 600.0}


def test_simulation_compares_policies_over_real_plans_and_plots(cli, tmp_path):
    out = tmp_path / "t.png"
    r = cli.invoke(app, ["simulate", "thermal", "--soc", "jetson-orin-nano", "--workload", "llama-tiny:prefill",
                         "--minutes", "3", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["labels"]["all"].startswith("modeled")
    keys = {p["situation"] for p in doc["plans"]}
    assert {"nominal", "cpu@95C", "gpu@95C"} <= keys  # plans for each device hot, placed with Φ at 95 °C
    for pol in ("fixed", "phi"):
        d = doc[pol]
        assert d["figure"] == "modeled" and d["energy_j"] > 0 and d["tokens"] > 0
        assert len(d["series"]) == 18  # every 10 s over 3 minutes
        assert d["throttling_events"] == sum(d["throttling_events_by_device"].values())
        assert sum(d["plans_used_s"].values()) == pytest.approx(180.0)
    assert doc["fixed"]["plans_used_s"] == {"nominal": 180.0}


def test_compile_cache_key_tells_situations_apart():
    """A device's temperature changes Φ(T) and so the placement: the compile cache must not hand the nominal
    program to a hot-device situation (the profile's JSON form, soc_hash, leaves temp_c out)."""
    from hetforge.runtime.compile_cache import executor_options
    from hetforge.runtime.executors import PlacedExecutor

    soc = load_soc("intel-core-ultra-155h")
    nominal = executor_options(PlacedExecutor(soc=soc, strategy="greedy"))
    hot = executor_options(PlacedExecutor(soc=situated_soc(soc, Situation.make(temps={"npu": 90.0})),
                                          strategy="greedy"))
    again = executor_options(PlacedExecutor(soc=situated_soc(soc, Situation.make(temps={"npu": 90.0})),
                                            strategy="greedy"))
    assert nominal["soc_hash"] == hot["soc_hash"]  # what the key held before: the two were one entry
    assert nominal != hot and hot == again
    assert hot["device_terms"]["npu"]["temp_c"] == 90.0


def _two_plan_case(e_a: float, e_b: float):
    """Two devices alike; plan A runs everything on ``a``, plan B on ``b``. A alone would throttle ``a`` in the
    long run; as ``a`` warms, Φ(T) makes A dearer than B, and the other way round: the controller without dwell
    swaps plans every few control periods (as on the Intel profiles)."""
    params = ThermalParams("t", 25.0, {"a": _dev("a", r=12.0, c=2.5), "b": _dev("b", r=12.0, c=2.5)})
    hot = Situation.make(temps={"a": 95.0})
    return params, {Situation(): PlanFigures("nominal", 1e-3, {"a": 1e-3}, {"a": e_a}, {"a": 10}),
                    hot: PlanFigures(hot.key(), 1e-3, {"b": 1e-3}, {"b": e_b}, {"b": 10})}


def test_dwell_and_gain_threshold_stop_flapping_and_keep_zero_throttling():
    params, plans = _two_plan_case(4e-3, 4.6e-3)
    fixed = _Synthetic(params, dict(plans)).run("fixed", 1800.0)
    before = _Synthetic(params, dict(plans)).run("phi-nodwell", 1800.0)
    after = _Synthetic(params, dict(plans)).run("phi", 1800.0)
    assert len(fixed.events) >= 1  # the case needs re-placement at all
    assert len(before.events) == 0 and len(after.events) == 0
    assert len(before.switches) >= 100  # the flapping
    assert len(after.switches) <= 40
    last = 0.0
    for s in after.switches:
        if s["kind"] == "energy":  # only past the dwell, and only for a 10% gain
            assert s["t_s"] - last >= 60.0 and "≥ 10% less" in s["reason"]
        last = s["t_s"]
    # the price of switching less: within a few percent of the flapping controller's energy per token (modeled)
    assert after.energy_j / after.tokens <= 1.05 * before.energy_j / before.tokens


def test_dwell_parameters_zero_reproduce_the_controller_without_dwell():
    params, plans = _two_plan_case(4e-3, 4.6e-3)
    a = _Synthetic(params, dict(plans)).run("phi-nodwell", 600.0)
    b = _Synthetic(params, dict(plans)).run("phi", 600.0, min_dwell_s=0.0, min_gain=0.05)
    assert [(s["t_s"], s["to"]) for s in a.switches] == [(s["t_s"], s["to"]) for s in b.switches]
    assert a.energy_j == pytest.approx(b.energy_j)
