"""The row-selection pass (passes/rowprune.py): a prefill's last layer computed for the selected row only."""

from __future__ import annotations

import functools

import pytest
import torch

from hetforge.frontend import capture
from hetforge.models.zoo import example_inputs, load_model
from hetforge.passes import optimize
from hetforge.passes.common import tval
from hetforge.passes.rowprune import prune_rows
from hetforge.runtime import Engine, SamplingParams
from hetforge.runtime.compile_cache import key_document, key_of
from hetforge.runtime.static_kv import PrefillModule
from hetforge.verify import compare_logits

T = 12
MODELS = ["gpt2-tiny", "llama-tiny", "qwen2-tiny", "mixtral-tiny"]
aten = torch.ops.aten


@functools.cache
def _prefill(name: str):
    model = load_model(name).model.eval()
    module = PrefillModule(model)
    inputs = (torch.randint(0, 200, (1, T), generator=torch.Generator().manual_seed(0)), torch.tensor([T - 4]))
    gm = optimize(capture(module, inputs, name=name).gm, inputs).gm
    return module, inputs, gm


def _rows(n) -> int | None:
    v = tval(n)
    return None if v is None or v.dim() < 2 else int(v.shape[-2])


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_before_the_last_layers_products_run_on_every_row_after_on_the_selected_one(name):
    """Before: the last layer's MLP and output products have all T rows. Expected after: the same products on one
    row (the MLP, the output projection and the attention's query), the K/V outputs untouched, one rewrite."""
    _, _, gm = _prefill(name)
    mlp = (torch.ops.hetforge.linear_act.default, torch.ops.hetforge.gated_mlp.default)

    def last_mlp(g):
        return [n for n in g.graph.nodes if n.op == "call_function" and n.target in mlp][-1]

    def last_attention(g):
        return [n for n in g.graph.nodes if n.target is torch.ops.hetforge.attention.default][-1]

    assert _rows(last_mlp(gm)) in (T, None) and tval(last_mlp(gm)).numel() % T == 0
    # heads that share K/V (llama-tiny: 4 over 2) reach the attention as [kv heads, groups x T] rows, which the
    # pass does not split: there the attention keeps its rows and the products after it are pruned
    mha = tval(last_attention(gm).args[0]).shape[-2] == T
    res = prune_rows(gm)
    assert len(res.rewrites) == 1 and res.rewrites[0].kind == "row_prune"
    after = res.gm
    assert tval(last_mlp(after)).numel() * T == tval(last_mlp(gm)).numel()  # one row of T
    att = last_attention(after)
    if mha:
        assert tval(att.args[0]).shape[-2] == 1 and tval(att).shape[-2] == 1
        assert tval(att.args[3]).dtype == torch.bool  # is_causal became a mask of the keys up to `last`
    else:
        assert tval(att.args[0]).shape[-2] == tval(last_attention(gm).args[0]).shape[-2]
    outs_before = [tval(o).shape for o in gm.graph.output_node().args[0]]
    outs_after = [tval(o).shape for o in after.graph.output_node().args[0]]
    assert outs_before == outs_after
    # the layers before the last are untouched: every MLP product but the last keeps its T rows
    mlps = [n for n in after.graph.nodes if n.op == "call_function" and n.target in mlp]
    assert all(tval(n).numel() == tval(mlps[0]).numel() for n in mlps[:-1]) and len(mlps) >= 2


@pytest.mark.parametrize("name", MODELS)
def test_the_pruned_prefill_equals_eager_logits_and_kv_rows(name):
    """The pruned graph's logits (row ``last``, with pad rows after it) and every K/V row against the eager module:
    K/V rows as the unpruned graph gives them, logits within fp32 rounding (KL ≤ 1e-8)."""
    module, inputs, gm = _prefill(name)
    res = prune_rows(gm)
    with torch.no_grad():
        want, full, got = module(*inputs), gm(*inputs), res.gm(*inputs)
    rep = compare_logits(want[0], got[0], 1e-8)
    assert rep.passed and rep.max_abs_err < 1e-4, rep
    for a, b in zip(full[1:], got[1:], strict=True):
        assert torch.equal(a, b)


def test_a_selected_value_read_elsewhere_is_left_whole():
    """The logits module returns every row: no one-row selection, nothing to prune."""
    loaded = load_model("llama-tiny")
    inputs = example_inputs(loaded, seq=T)
    gm = optimize(capture(loaded.logits_module(), inputs, name="l").gm, inputs).gm
    res = prune_rows(gm)
    assert res.rewrites == [] and res.nodes_after == res.nodes_before


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_generation_gives_the_same_tokens_with_and_without_the_pass(name, monkeypatch, tmp_path):
    """Greedy tokens of a fine-length prefill and decode, the pass on and off (HETFORGE_ROW_PRUNE=0); the compile
    cache keys on the switch (a program built with the pass is not loaded without it)."""
    monkeypatch.setenv("HETFORGE_COMPILE_CACHE_DIR", str(tmp_path))
    tokens, keys = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv("HETFORGE_ROW_PRUNE", flag)
        eng = Engine(load_model(name))
        out = eng.generate(list(range(3, 3 + 21)), SamplingParams(max_new_tokens=8, ignore_eos=True))
        tokens[flag] = out.tokens
        keys[flag] = key_of(key_document(eng.loaded.model, {}, True, "prefill", 24))
    assert tokens["1"] == tokens["0"]
    assert keys["1"] != keys["0"]
