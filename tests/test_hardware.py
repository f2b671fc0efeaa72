import json

import pytest
from typer.testing import CliRunner

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands
from hetforge.cost import transfer_cost
from hetforge.errors import UsageError
from hetforge.hardware import list_socs, load_soc

_load_commands()
runner = CliRunner()

REQUIRED = ["jetson-agx-orin", "jetson-orin-nano", "apple-m2-max", "apple-m2-ultra", "intel-core-ultra-155h",
            "intel-core-ultra-200v", "snapdragon-x-elite", "test-npu-gaps", "host"]
SHIPPED = [s for s in REQUIRED if s != "host"]


def test_list_socs_has_every_required_profile():
    assert set(REQUIRED) <= set(list_socs())


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_validate_with_sources(name):
    soc = load_soc(name)
    assert soc.name == name
    assert soc.devices[0].kind == "cpu"
    kinds = [d.kind for d in soc.devices]
    assert kinds == sorted(kinds, key=["cpu", "gpu", "npu"].index)
    for d in soc.devices:
        assert d.mem_bandwidth > 0 and d.mem_capacity > 0 and d.tdp_w > 0 and 0 <= d.idle_w <= d.tdp_w
        assert all(v > 0 for v in d.peak_flops.values())
        assert d.dtypes and d.peak("fp32") > 0
        for key, src in d.sources.items():
            assert src["source"].strip(), (name, d.name, key)
        # no vendor publishes per-unit power: it must be labelled an estimate
        assert d.sources["tdp_w"]["estimate"] is True
        if d.kind == "npu":
            assert d.static_shapes
            assert not d.supports("aten.embedding.default")
            assert not d.supports("aten.index.Tensor")
            assert d.supports("aten.linear.default")
    for i, a in enumerate(soc.device_names):
        for b in soc.device_names[i:]:
            ln = soc.link(a, b)
            assert ln.bandwidth > 0


def test_test_npu_gaps_lacks_rotary_and_softmax():
    npu = load_soc("test-npu-gaps").device("npu")
    for op in ("aten.slice.Tensor", "aten.cat.default", "aten.neg.default", "aten.softmax.int"):
        assert not npu.supports(op)
    assert load_soc("test-npu-gaps").device("cpu").supports("aten.slice.Tensor")


def test_unknown_soc_lists_known_ones():
    with pytest.raises(UsageError) as e:
        load_soc("pentium-4")
    for n in REQUIRED:
        assert n in str(e.value)
    r = runner.invoke(app, ["profile", "llama-tiny", "--soc", "pentium-4"])
    assert r.exit_code == 2 and "jetson-agx-orin" in r.output


def test_link_same_device_is_unified_and_free():
    soc = load_soc("intel-core-ultra-155h")
    assert soc.link("npu", "npu").unified
    assert transfer_cost(1e6, soc.link("gpu", "gpu")) == (0.0, 0.0)
    ln = soc.link("cpu", "npu")
    assert soc.link("npu", "cpu") == ln and not ln.unified
    with pytest.raises(UsageError, match="no device 'dsp'"):
        soc.link("cpu", "dsp")


def _profile_dict(name="test-npu-gaps"):
    from importlib import resources

    return json.loads((resources.files("hetforge") / "profiles" / f"{name}.json").read_text())


def test_user_file_loads_by_path(tmp_path):
    d = _profile_dict()
    d["name"] = "my-board"
    d["devices"][1]["unsupported_ops"] = []
    p = tmp_path / "my-board.json"
    p.write_text(json.dumps(d))
    soc = load_soc(str(p))
    assert soc.name == "my-board"
    npu = soc.device("npu")
    # the registry still forbids data-dependent ops on NPUs even when the file lists no gaps
    assert not npu.supports("aten.nonzero.default")
    assert npu.supports("aten.slice.Tensor")


@pytest.mark.parametrize(
    "mutate, expect",
    [
        (lambda d: d["devices"][0].pop("mem_bandwidth"), ["devices.0.mem_bandwidth", "missing"]),
        (lambda d: d["devices"][0]["tdp_w"].__setitem__("value", -5), ["devices.0.tdp_w.value", "greater than 0"]),
        (lambda d: d["devices"][0].__setitem__("kind", "dsp"), ["devices.0.kind", "'cpu', 'gpu' or 'npu'"]),
        (lambda d: d["devices"][1]["peak_flops"].__setitem__("fp64", {"value": 1, "source": "x"}),
         ["peak_flops.fp64", "'fp32', 'fp16', 'bf16', 'int8' or 'int4'"]),
        (lambda d: d["devices"][0]["mem_capacity"].pop("source"), ["devices.0.mem_capacity.source", "missing"]),
        (lambda d: d.__setitem__("links", []), ["no link between 'cpu' and 'npu'"]),
        (lambda d: d["devices"][0].__setitem__("turbo", True), ["devices.0.turbo", "unknown field"]),
    ],
)
def test_bad_profile_names_file_field_and_problem(tmp_path, mutate, expect):
    d = _profile_dict()
    mutate(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(UsageError) as e:
        load_soc(str(p))
    msg = str(e.value)
    assert str(p) in msg
    for frag in expect:
        assert frag in msg, msg


def test_bad_profile_not_json_and_missing_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{nope")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_soc(str(p))
    with pytest.raises(UsageError, match="does not exist"):
        load_soc(str(tmp_path / "missing.json"))
    r = runner.invoke(app, ["profile", "llama-tiny", "--soc", str(p)])
    assert r.exit_code == 2


def test_host_default_is_labelled_uncalibrated(tmp_path, monkeypatch):
    monkeypatch.setenv("HETFORGE_HOST_PROFILE", str(tmp_path / "none.json"))
    soc = load_soc("host")
    assert not soc.calibrated
    cpu = soc.device("cpu")
    assert all(s.get("estimate") for k, s in cpu.sources.items() if k != "mem_capacity")
    assert "NOT calibrated" in cpu.sources["peak_flops.fp32"]["source"]


def test_calibrate_quick_writes_valid_profile(tmp_path, monkeypatch):
    out = tmp_path / "sub" / "host.json"
    r = runner.invoke(app, ["calibrate", "--quick", "--out", str(out), "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["label"] == "measured" and rep["threads"] == 1
    assert not list(out.parent.glob("*.tmp"))
    soc = load_soc(str(out))
    cpu = soc.device("cpu")
    assert soc.calibrated and soc.name == "host"
    assert cpu.peak_flops["fp32"] > 1e6 and cpu.mem_bandwidth > 1e6 and 0 < cpu.dispatch_s < 1e-2
    assert rep["gemm_flops"]["fp32"] and rep["bandwidth_copy"] > 0 and rep["bandwidth_triad"] > 0
    assert rep["bandwidth_read"] > 1e6 and "read bandwidth" in cpu.sources["mem_bandwidth"]["source"]
    # the profile's bandwidth is β_read, read from a pool of distinct buffers beyond the last-level cache
    rb = rep["bandwidth_read_method"]
    assert cpu.mem_bandwidth == pytest.approx(rep["bandwidth_read"]) and rb["passes"] == 3
    assert rb["buffers"] * rb["buffer_bytes"] >= 8 * rb["llc_bytes"] > 0 and rb["method"] in cpu.sources[
        "mem_bandwidth"]["source"]
    assert "matmul:compute" in cpu.efficiency or "matmul:memory" in cpu.efficiency
    # the per-op and in-program terms of the cost model, and the cache size they need
    for key in ("matmul:rows<8", "aten.tanh.default", "aten.gelu.default:tanh", "aten.copy_.default", "cache-hit",
                "seq:warm"):
        assert key in cpu.efficiency, key
    assert {"seq:first", "seq:first-tau", "matmul:per-row"} <= set(cpu.overhead_s)
    assert cpu.cache_bytes > 0 and "sysfs" in cpu.sources["cache_bytes"]["source"]
    # the fp32 peak names the FMA units' ceiling where the native probe runs, and the share of it reached
    from hetforge.kernels import native

    fp32_src = cpu.sources["peak_flops.fp32"]["source"]
    assert ("FMA units' ceiling" in fp32_src) == (native.fma_peak(1, seconds=0.002, repeats=1) is not None)
    assert "measured" in cpu.sources["mem_bandwidth"]["source"]
    monkeypatch.setenv("HETFORGE_HOST_PROFILE", str(out))
    assert load_soc("host").calibrated
    bad = runner.invoke(app, ["calibrate", "--quick", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "folder" in bad.output
    bad = runner.invoke(app, ["calibrate", "--quick", "--clock", "thread", "--out", str(out)])
    assert bad.exit_code == 2 and "--threads 1" in bad.output
    bad = runner.invoke(app, ["calibrate", "--quick", "--threads", "0", "--out", str(out)])
    assert bad.exit_code == 2


def test_socs_cli_json():
    r = runner.invoke(app, ["socs", "--json"])
    assert r.exit_code == 0, r.output
    names = [s["name"] for s in json.loads(r.output)["socs"]]
    assert set(REQUIRED) <= set(names)


@pytest.mark.parametrize("name", SHIPPED)
def test_weight_only_quantized_ops_run_on_every_cpu_and_gpu_integer_activations_need_int8(name):
    """Weight-only int4/int8 is unpacked inside the kernel on a CPU or GPU (no integer compute rate needed);
    int8 activations need the unit to list int8; an NPU must list the weight type too."""
    for d in load_soc(name).devices:
        gaps4 = d.quant_gaps("hetforge.linear_w4.default")
        gaps8a8 = d.quant_gaps("hetforge.linear_w8a8.default")
        if d.kind in ("cpu", "gpu"):
            assert gaps4 == [] and d.supports("hetforge.linear_w4.default")
        else:
            assert (gaps4 == []) == ("int4" in d.dtypes)
        assert (gaps8a8 == []) == ("int8" in d.dtypes), (name, d.name, gaps8a8)
        assert d.supports("hetforge.linear_w8a8.default") == ("int8" in d.dtypes)


def test_quantized_placement_refusal_names_the_missing_integer_type():
    from hetforge.frontend import capture
    from hetforge.models.zoo import example_inputs, load_model
    from hetforge.placement.costs import NodeCosts
    from hetforge.quant import quantize_graph

    soc = load_soc("apple-m2-max")  # cpu and gpu list no int8 compute; the npu does
    lm = load_model("llama-tiny")
    gm = quantize_graph(capture(lm.logits_module(), example_inputs(lm, seq=8)).gm, "w8a8").gm
    costs = NodeCosts.build(gm, soc)
    node = next(n for n in costs.nodes if costs.ops[n.name] == "hetforge.linear_w8a8.default").name
    assert costs.why_not(node, "npu") is None
    why = costs.why_not(node, "cpu")
    assert why is not None and "activations in int8" in why and "fp16, fp32" in why
