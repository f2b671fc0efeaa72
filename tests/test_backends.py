"""Backends: torch-cpu (executor and fx), OpenVINO for real, torch-cuda's clear refusal without CUDA,
emulated devices' constraints, and the default mapping."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from fx_partition import partition_graph

from hetforge.backends import BackendUnavailable, ConstraintViolation, make_backend, parse_overrides, resolve
from hetforge.backends.emulated import EmulatedBackend, check_constraints
from hetforge.backends.inventory import inventory
from hetforge.backends.torch_cpu import TorchCpuBackend
from hetforge.backends.torch_cuda import TorchCudaBackend
from hetforge.errors import UsageError
from hetforge.frontend import capture
from hetforge.hardware import load_soc
from hetforge.hetero.layouts import layer_assignment
from hetforge.models.zoo import example_inputs, load_model


def _run(backend, part, args):
    comp = backend.compile(part)
    outs, seconds = comp.run(args)
    assert seconds > 0
    return outs


def test_torch_cpu_engines_match_the_partition_graph(parts):
    """The fx engine runs the partition's own ops (bit-equal); the executor may run a product on a native kernel
    that sums in another order (8 rows: ``hf_gemm_few``), so it matches to fp32 rounding."""
    pg, args, *_ = parts
    part = pg.partitions[1]
    with torch.no_grad():
        ref = part.gm(*args[1])
    for engine in ("executor", "fx"):
        outs = _run(TorchCpuBackend(engine), part, args[1])
        assert len(outs) == len(ref)
        for a, b in zip(outs, ref, strict=True):
            if engine == "fx":
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(UsageError, match="engine"):
        TorchCpuBackend("jit")


def test_openvino_missing_says_which_device_and_how_to_install(parts, monkeypatch):
    pg, _, soc, _ = parts
    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` now fails as if not installed
    from hetforge.hetero.runner import build

    bindings = resolve(soc, {"gpu": "emulated:openvino:CPU"})
    with pytest.raises(BackendUnavailable) as e:
        build(pg, soc, bindings)
    assert "device 'gpu'" in str(e.value) and "pip install -e .[peers]" in str(e.value)
    rows = {r["backend"]: r for r in inventory()}
    assert not rows["openvino"]["available"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: the refusal path cannot be reached")
def test_torch_cuda_without_cuda_is_a_clear_error(parts):
    pg, *_ = parts
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU"):
        TorchCudaBackend().compile(pg.partitions[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_cuda_runs_partitions_on_the_gpu(parts):
    pg, args, *_ = parts
    be = TorchCudaBackend()
    for part, a in zip(pg.partitions, args, strict=True):
        with torch.no_grad():
            ref = part.gm(*a)
        outs = _run(be, part, [be.to_memory(x) for x in a])
        assert all(o.device.type == "cuda" for o in outs)
        for o, r in zip(outs, ref, strict=True):
            assert torch.allclose(o.cpu().double(), r.double(), atol=1e-4, rtol=1e-4)


def test_emulated_npu_refuses_unsupported_ops_naming_node_and_constraint(parts):
    pg, _, soc, _ = parts
    npu = soc.device("npu")
    be = EmulatedBackend(npu, TorchCpuBackend())
    with pytest.raises(ConstraintViolation) as e:
        be.compile(pg.partitions[0])  # the embedding stage: aten.embedding is not an NPU op
    assert "aten.embedding.default" in str(e.value) and "op not supported by npu 'npu'" in str(e.value)


def test_emulated_dtype_policy(parts):
    pg, _, soc, _ = parts
    npu = soc.device("npu")  # dtypes fp16/int8, no fp32
    part = pg.partitions[1]
    violations, notes = check_constraints(part, npu, "exact")
    assert not [v for v in violations if "dtype" in v.constraint]
    assert notes and "fp32 computed exactly" in notes[0]
    strict, _ = check_constraints(part, npu, "strict")
    assert any("dtype fp32 not in npu's dtypes" in v.constraint for v in strict)


def test_emulated_devices_need_the_integer_types_of_quantized_ops(parts):
    from hetforge.quant import quantize_graph

    *_, soc, cg = parts
    npu = soc.device("npu")  # int8 but no int4
    for scheme, ok in (("w8", True), ("w4", False)):
        gm = quantize_graph(cg.gm, scheme).gm
        pg = partition_graph(gm, layer_assignment(gm, "stages:cpu,npu", soc.device_names))
        violations, _ = check_constraints(pg.partitions[1], npu)
        bad = [v for v in violations if "weights in" in v.constraint]
        assert (not bad) == ok, (scheme, violations)
    assert "weights in int4, not in npu's dtypes" in bad[0].constraint


def test_emulated_memory_and_static_shape_constraints(parts, tmp_path):
    pg, *_ = parts
    from importlib import resources

    prof = json.loads((resources.files("hetforge") / "profiles" / "test-npu-gaps.json").read_text())
    prof["name"] = "tiny-mem"
    for d in prof["devices"]:
        d["mem_capacity"]["value"] = 4096  # 4 KiB: nothing fits
    f = tmp_path / "tiny-mem.json"
    f.write_text(json.dumps(prof))
    tiny = load_soc(str(f)).device("cpu")
    violations, _ = check_constraints(pg.partitions[1], tiny)
    assert any("MiB" in v.constraint and "has 0.0 MiB" in v.constraint for v in violations)
    # a dynamically captured graph has symbolic sizes: a static-shape device refuses them
    lm = load_model("gpt2-tiny")
    inputs = example_inputs(lm, seq=8)
    dyn = capture(lm.logits_module(), inputs, dynamic_dims={0: {1: ("seq", 2, 64)}, 1: {1: ("seq", 2, 64)}})
    npu = load_soc("intel-core-ultra-155h").device("npu")
    dpg = partition_graph(dyn.gm, {n.name: "npu" for n in dyn.gm.graph.nodes})
    violations, _ = check_constraints(dpg.partitions[0], npu)
    assert any("needs static shapes" in v.constraint for v in violations)


def test_default_mapping_and_overrides():
    soc = load_soc("intel-core-ultra-155h")
    b = resolve(soc)
    assert b["cpu"].spec == "torch-cpu" and not b["cpu"].emulated
    if not torch.cuda.is_available():
        assert b["gpu"].emulated
    assert b["npu"].spec in ("openvino:NPU", "emulated:openvino:CPU")
    assert parse_overrides(["npu=emulated:torch-cpu"], soc.device_names) == {"npu": "emulated:torch-cpu"}
    with pytest.raises(UsageError, match="unknown device 'tpu'"):
        parse_overrides(["tpu=torch-cpu"], soc.device_names)
    with pytest.raises(UsageError, match="unknown backend"):
        make_backend("tensorrt")
    with pytest.raises(UsageError, match="unknown OpenVINO plugin"):
        make_backend("openvino:FPGA")


def test_cli_backends_prints_the_mapping():
    from typer.testing import CliRunner

    from hetforge.cli.main import _load_commands, app

    _load_commands()
    r = CliRunner().invoke(app, ["backends", "--soc", "intel-core-ultra-155h", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [m["device"] for m in doc["mapping"]] == ["cpu", "gpu", "npu"]
    assert {b["backend"] for b in doc["installed"]} >= {"torch-cpu", "torch-cuda"}
    npu = doc["mapping"][2]
    assert npu["emulated"] == (npu["backend"] != "openvino:NPU") and "static shapes" in npu["constraints"]
    r = CliRunner().invoke(app, ["backends", "--soc", "no-such-soc"])
    assert r.exit_code == 2
