"""GGUF export of the zoo's seeded weights (read back with gguf's own reader) and the llama.cpp decode peer."""

import importlib.util

import numpy as np
import pytest
import torch

# gguf comes with the peers extra (`make install` and CI install it); without it no GGUF file can be written.
gguf = pytest.importorskip("gguf", reason="the gguf package is not installed: it comes with the peers extra "
                                          "(`make install`, or pip install -e '.[peers]')")

from hetforge.benchmarks.gguf_export import write_gguf  # noqa: E402
from hetforge.benchmarks.systems import SYSTEMS, missing_requirement  # noqa: E402
from hetforge.errors import UsageError  # noqa: E402
from hetforge.models.zoo import load_model  # noqa: E402


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_gguf_f32_holds_every_weight(name, tmp_path):
    lm = load_model(name)
    r = gguf.GGUFReader(str(write_gguf(lm, tmp_path / "m.gguf", "f32")))
    names = {t.name for t in r.tensors}
    assert {"token_embd.weight", "output.weight", "output_norm.weight", "blk.0.ffn_up.weight"} <= names
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    key = "model.embed_tokens.weight" if lm.family == "llama" else "transformer.wte.weight"
    np.testing.assert_array_equal(np.asarray(emb.data).reshape(-1), lm.model.state_dict()[key].numpy().reshape(-1))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    assert arch == lm.family


def test_gguf_llama_q_rows_are_permuted_to_llamacpp_rope_layout(tmp_path):
    lm = load_model("llama-tiny")
    r = gguf.GGUFReader(str(write_gguf(lm, tmp_path / "m.gguf", "f32")))
    q = lm.model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    got = np.asarray(next(t for t in r.tensors if t.name == "blk.0.attn_q.weight").data).reshape(q.shape)
    h = lm.config.num_attention_heads
    d = q.shape[0] // h
    # llama.cpp's rotary pairs (2i, 2i+1) are HF's (i, i + d/2) of each head
    for i in range(d // 2):
        np.testing.assert_array_equal(got[2 * i], q[i])
        np.testing.assert_array_equal(got[2 * i + 1], q[i + d // 2])


@pytest.mark.parametrize(("qtype", "kind", "steps"), [("q8_0", "Q8_0", 127), ("q4_0", "Q4_0", 8)])
def test_gguf_quantized_types_dequantize_close_to_the_weights(tmp_path, qtype, kind, steps):
    """Q8_0: one step is amax/127 of a block of 32; Q4_0: amax/8 (the top value may clamp by one step)."""
    lm = load_model("llama-tiny")
    r = gguf.GGUFReader(str(write_gguf(lm, tmp_path / "m.gguf", qtype)))
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_down.weight")
    assert t.tensor_type == getattr(gguf.GGMLQuantizationType, kind)
    w = lm.model.state_dict()["model.layers.0.mlp.down_proj.weight"].numpy()
    deq = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
    assert 0 < np.abs(deq - w).max() <= np.abs(w).max() / steps + 1e-6


def test_gguf_refuses_other_families_and_types(tmp_path):
    with pytest.raises(UsageError, match="q8_0"):
        write_gguf(load_model("llama-tiny"), tmp_path / "m.gguf", "q4")
    with pytest.raises(UsageError, match="llama and gpt2"):
        write_gguf(load_model("qwen2-tiny"), tmp_path / "m.gguf", "f32")


# This checks the message a user without llama-cpp-python sees; where it is installed there is no such message.
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None,
                    reason="llama-cpp-python is installed, so the 'how to install it' message cannot appear")
def test_llamacpp_peer_without_the_package_says_how_to_install_it():
    msg = missing_requirement(SYSTEMS["llamacpp-f32"])
    assert "llama_cpp" in msg and "[llamacpp]" in msg and "source" in msg


# llama-cpp-python has no wheel on PyPI: pip builds llama.cpp from source (CMake, C++, many minutes on 2 cores), so
# `make install` leaves it out; `pip install -e '.[llamacpp]'` adds it and this test then runs.
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed (no PyPI wheel; pip install -e '.[llamacpp]' builds it "
                           "from source)")
@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_llamacpp_runs_the_same_weights_as_eager(name, tmp_path):
    from hetforge.benchmarks.systems import PrepContext
    from hetforge.models.zoo import example_inputs
    from hetforge.verify import compare_logits

    lm = load_model(name)
    inputs = example_inputs(lm, seq=12)
    ctx = PrepContext(lm, lm.logits_module().eval(), inputs, example_inputs(lm, seq=1, seed=1), tmp_path, tmp_path)
    prep = SYSTEMS["llamacpp-f32"].prepare(ctx)
    with torch.no_grad():
        want = ctx.module(*inputs)
    rep = compare_logits(want, prep.forward(*inputs).reshape(want.shape))
    assert rep.top1_agree == 1.0 and rep.kl_mean < 1e-4, rep
    d = prep.decode(inputs, 4)
    assert d.new_tokens == 4 and d.decode_ms_per_token > 0
