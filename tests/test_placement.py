"""Placement strategies on captured graphs: rules, support respected, strict, memory, pins, stages, explain."""

from __future__ import annotations

import json

import pytest
import torch

from hetforge.errors import HetforgeError, UsageError
from hetforge.frontend import capture, op_name
from hetforge.hardware import load_soc
from hetforge.models.zoo import example_inputs, load_model
from hetforge.placement import get_strategy, list_strategies
from hetforge.placement.layers import EMBED, HEAD, group_stages

STRATEGIES = ("rules", "greedy", "pgsam", "stages", "single")


@pytest.fixture(scope="module")
def tiny():
    lm = load_model("llama-tiny")
    return capture(lm.logits_module(), example_inputs(lm, seq=8)).gm


@pytest.fixture(scope="module")
def shaped():
    """A 1-layer Llama-3.1-shaped graph (narrowed), eager attention so softmax is its own node."""
    from hetforge.frontend import capture_shaped

    small = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4,
                 vocab_size=16384, bos_token_id=1, eos_token_id=2)
    return capture_shaped(layers=1, seq=64, attn="eager", overrides=small).gm


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_strategies_registered():
    assert set(STRATEGIES) <= set(list_strategies())


def test_unknown_strategy_and_objective_list_valid_names(tiny):
    with pytest.raises(UsageError, match="valid strategies: .*greedy.*pgsam.*rules"):
        get_strategy("fastest")
    with pytest.raises(UsageError, match="valid objectives: energy, latency, balanced"):
        get_strategy("greedy")(tiny, "jetson-agx-orin", objective="speed")


def test_rules_route_attention_to_gpu_and_control_to_cpu(shaped):
    soc = load_soc("jetson-agx-orin")  # CPU + GPU + NPU (DLA)
    pl = get_strategy("rules")(shaped, soc)
    ops = {n.name: op_name(n) for n in _calls(shaped)}
    soft = [n for n, o in ops.items() if "softmax" in o]
    assert soft and all(pl.assignment[n] == "gpu" for n in soft)
    mm = [n for n, o in ops.items() if o in ("aten.linear.default", "aten.matmul.default")]
    assert mm and all(pl.assignment[n] == "gpu" for n in mm)
    control = [n for n, o in ops.items() if o in ("aten.embedding.default", "aten.arange.default",
                                                   "aten.index.Tensor", "aten.le.Tensor")]
    assert len(control) >= 3 and all(pl.assignment[n] == "cpu" for n in control)
    assert all(pl.reasons[n] for n in ops)  # a reason for every node


def test_rules_stay_when_copy_costs_more_than_gain(tiny):
    # tiny matmuls on a non-unified SoC: the GPU is no faster than the copy there, so they stay on the CPU
    pl = get_strategy("rules")(tiny, "intel-core-ultra-155h")
    lin = [n.name for n in _calls(tiny) if op_name(n) == "aten.linear.default"]
    assert all(pl.assignment[n] == "cpu" for n in lin)
    assert any(pl.reasons[n].startswith("stays on cpu") for n in lin)


@pytest.mark.parametrize("soc", ["test-npu-gaps", "intel-core-ultra-155h", "jetson-agx-orin"])
def test_no_strategy_assigns_an_unsupported_op(tiny, soc):
    prof = load_soc(soc)
    for s in STRATEGIES:
        opts = [{"device": d} for d in prof.device_names] if s == "single" else [{"objective": o} for o in
                                                                                ("energy", "latency")]
        for kw in opts:
            pl = get_strategy(s)(tiny, prof, **kw)
            for n in _calls(tiny):
                assert prof.device(pl.assignment[n.name]).supports(op_name(n)), (s, kw, n.name)
            assert {n.name for n in tiny.graph.nodes} <= set(pl.assignment)


def test_fallbacks_are_explained_and_strict_refuses(tiny, shaped):
    soc = load_soc("test-npu-gaps")  # NPU lacks slice/cat/neg (rotary) and index ops
    pl = get_strategy("single")(tiny, soc, device="npu")
    assert pl.extra["fallbacks"] and pl.rejections
    r = pl.rejections[0]
    assert r.device == "npu" and "unsupported" in r.why and r.op in soc.device("npu").unsupported_ops
    with pytest.raises(HetforgeError, match=r"(?s)strict placement 'single' is infeasible.*node.*why not"):
        get_strategy("single")(tiny, soc, device="npu", strict=True)
    pg = get_strategy("pgsam")(shaped, soc, objective="energy")  # big matmuls: the layer goes to the NPU ...
    assert pg.extra["plan"] == "npu[0-0]" and pg.extra["fallbacks"]  # ... and its rotary slices split off
    assert all(pg.assignment[n] == "cpu" for n in pg.extra["fallbacks"])
    with pytest.raises(HetforgeError, match="strict placement 'pgsam'"):
        get_strategy("pgsam")(shaped, soc, objective="energy", strict=True)


def test_pin_to_incapable_device_is_refused(tiny):
    cat = next(n.name for n in _calls(tiny) if op_name(n) == "aten.cat.default")
    with pytest.raises(HetforgeError, match=rf"refused: node '{cat}' \(aten.cat.default\) cannot run on device 'npu'"):
        get_strategy("greedy")(tiny, "test-npu-gaps", pin={cat: "npu"})
    with pytest.raises(UsageError, match="no device 'tpu'"):
        get_strategy("rules")(tiny, "test-npu-gaps", pin={cat: "tpu"})


def test_memory_capacity_exceeded_names_bytes_and_tensors(tiny, tmp_path):
    from importlib.resources import files

    spec = json.loads((files("hetforge") / "profiles" / "test-npu-gaps.json").read_text())
    spec["name"] = "small-memory"
    for d in spec["devices"]:
        d["mem_capacity"]["value"] = 200_000  # 200 kB: llama-tiny's fp32 weights do not fit
    f = tmp_path / "small.json"
    f.write_text(json.dumps(spec))
    for s in ("greedy", "rules", "single"):
        with pytest.raises(HetforgeError, match=r"memory capacity exceeded.*GiB needed.*available.*largest tensors"):
            get_strategy(s)(tiny, load_soc(str(f)))
    with pytest.raises(HetforgeError, match=r"no stage plan fits in memory: .*GiB.*largest tensors"):
        get_strategy("pgsam")(tiny, load_soc(str(f)))


def test_stage_grouping(tiny):
    st = group_stages(tiny)
    assert st.num_layers == 2
    emb = next(n.name for n in _calls(tiny) if op_name(n) == "aten.embedding.default")
    lm_head = [n.name for n in _calls(tiny) if op_name(n) == "aten.linear.default"][-1]
    assert st.of[emb] == EMBED and st.of[lm_head] == HEAD
    q0 = next(n.name for n in _calls(tiny) if "layers.0.self_attn.q_proj" in str(n.meta.get("nn_module_stack")))
    assert st.of[q0] == "layer.0"


def test_pgsam_strategy_front_and_aux_routing(tiny):
    soc = load_soc("jetson-agx-orin")
    pl = get_strategy("pgsam")(tiny, soc, objective="energy")
    front = pl.extra["front"]
    assert front and sum(p["chosen"] for p in front) == 1
    chosen = next(p for p in front if p["chosen"])
    assert chosen["energy_j"] == min(p["energy_j"] for p in front)
    # auxiliary stages: the lowest-TDP device that can run their weight-bearing ops
    head_dev = soc.device(pl.extra["aux"]["head"])
    assert head_dev.tdp_w == min(d.tdp_w for d in soc.devices if d.supports("aten.linear.default"))
    st = group_stages(tiny)
    emb = next(n.name for n in _calls(tiny) if op_name(n) == "aten.embedding.default")
    assert pl.assignment[emb] == pl.extra["aux"]["embed"] and st.of[emb] == EMBED
    other = get_strategy("pgsam")(tiny, soc, objective="energy", point=len(front) - 1)
    assert next(p for p in other.extra["front"] if p["chosen"])["plan"] == front[-1]["plan"]


def test_shaped_graph_has_llama31_shapes():
    from hetforge.frontend import capture_shaped
    from hetforge.models.shapes import LLAMA31_8B

    gm = capture_shaped(layers=1, seq=4).gm
    w = {str(n.target).split("layers.0.")[-1]: n for n in gm.graph.nodes if n.op == "get_attr"}
    q, k = w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"]
    assert tuple(q.meta["val"].shape) == (4096, 4096) and tuple(k.meta["val"].shape) == (1024, 4096)
    assert q.meta["val"].dtype == torch.float16 and q.meta["val"].device.type == "meta"
    assert LLAMA31_8B["num_hidden_layers"] == 32


def test_rules_route_large_quantized_linears_to_npu():
    from transformers import LlamaConfig

    from hetforge.models.zoo import ZOO, LogitsModule, _build
    from hetforge.quant import quantize_graph

    cfg = LlamaConfig(hidden_size=1024, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=256, max_position_embeddings=512)
    torch.manual_seed(0)
    model = _build(ZOO["llama-tiny"], cfg, "sdpa").eval()
    ids = torch.randint(0, 256, (1, 128))
    gm = quantize_graph(capture(LogitsModule(model), (ids, torch.ones_like(ids))).gm, "w8").gm
    pl = get_strategy("rules")(gm, "jetson-agx-orin")
    q = {n.name: n for n in _calls(gm) if op_name(n).startswith("hetforge.linear_w8")}
    big = [k for k, n in q.items() if n.args[1].meta["val"].numel() >= 1_000_000]
    small = [k for k in q if k not in big]
    assert big and small  # q/o/mlp projections are 1 M weights, k/v are 0.5 M
    # Orin's links are unified (zero-copy), so the rules apply as written: large int8 linears → NPU,
    # small ones are plain matmuls → GPU
    assert all(pl.assignment[k] == "npu" and pl.reasons[k].startswith("rule quantized-linear: int8 linear")
               for k in big)
    assert all(pl.assignment[k] == "gpu" and "but small" in pl.reasons[k] for k in small)
