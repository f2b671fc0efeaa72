"""OpenVINO's stateful KV-cache peer (made without optimum-intel) and the hetforge --quantize w8 row."""

import numpy as np
import pytest
import torch

from hetforge.benchmarks.harness import Row, Stat, compare
from hetforge.benchmarks.systems import SYSTEMS
from hetforge.models.zoo import example_inputs, load_model


def _stat(x: float) -> Stat:
    return Stat(x, x, x, 1)


def test_decode_peers_are_registered():
    assert {"ov-stateful-f32", "ov-stateful", "llamacpp-f32", "llamacpp-q8", "llamacpp-q4", "hetforge-w8",
            "hetforge-w4"} <= set(SYSTEMS)
    assert SYSTEMS["ov-stateful"].requires == ("openvino",)


def test_compare_checks_w8_and_w4_decode_against_llamacpp_q8_and_q4_and_keeps_them_out_of_the_peers():
    mk = lambda s, dec, prec="f32": Row("m", s, s, "ok", runs_ok=1, runs=1, precision=prec, prep_s=_stat(1.0),
                                        decode_ms_per_token=_stat(dec))
    rows = [mk("hetforge", 10.0), mk("hetforge-w8", 6.0, "w8"), mk("llamacpp-q8", 5.0, "q8_0"),
            mk("hetforge-w4", 3.0, "w4"), mk("llamacpp-q4", 4.0, "q4_0"),
            mk("llamacpp-f32", 9.0), mk("ov-stateful-f32", 12.0)]
    cmp = compare(rows)[0]
    t = cmp["targets"]
    assert "hetforge-w8" not in cmp["ratios"] and "hetforge-w4" not in cmp["ratios"]
    w4 = t["w4_decode_at_or_below_llamacpp_q4"]
    assert w4["best_peer"] == "llamacpp-q4" and w4["ratio"] == pytest.approx(0.75) and w4["met"]
    assert t["decode_ms_per_token_at_or_below_best_f32_peer"]["best_peer"] == "llamacpp-f32"  # Q8_0 is not f32
    assert not t["decode_ms_per_token_at_or_below_best_f32_peer"]["met"]
    w8 = t["w8_decode_at_or_below_llamacpp_q8"]
    assert w8["ratio"] == pytest.approx(1.2) and not w8["met"]


# openvino comes with the peers extra (`make install` and CI's `make test` install it).
@pytest.mark.parametrize("name", ["llama-tiny"])
def test_ov_stateful_greedy_tokens_equal_hf_generate(name, tmp_path):
    # OpenVINO is a peer, not a dependency of hetforge itself: `make install` adds it with the peers extra.
    pytest.importorskip("openvino", reason="openvino is not installed: it comes with the peers extra "
                                           "(`make install`, or pip install -e '.[peers]')")
    from hetforge.benchmarks.ov_stateful_system import StatefulRunner, compile_stateful, stateful_ov_model

    lm = load_model(name)
    stages: dict[str, float] = {}
    ov_model = stateful_ov_model(lm.model, lm.vocab_size, stages)
    assert {"torch.export", "convert_model", "make_stateful"} <= set(stages)
    # the cache is inside the model: no past/present tensors left as inputs or outputs
    assert {n for i in ov_model.inputs for n in i.get_names()} == {"input_ids", "attention_mask", "position_ids"}
    assert [o.get_any_name() for o in ov_model.outputs] == ["logits"]
    compiled, precision = compile_stateful(ov_model, threads=2, force_f32=True)
    assert precision in ("f32", "float32")
    assert len(compiled.create_infer_request().query_state()) == 2 * lm.config.num_hidden_layers
    runner = StatefulRunner(compiled)
    prompt = example_inputs(lm, seq=12)[0]
    n = 10
    got, _ = runner.greedy(prompt.numpy(), n)
    with torch.no_grad():
        want = lm.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    assert got == want
    assert len(set(want)) > 1  # a sequence of one repeated token would not show the cache being used
    # the logits of one cached step equal eager's over the whole sequence at that position
    seq = torch.cat([prompt, torch.tensor([want[:3]])], dim=1)
    runner.reset()
    runner.step(prompt.numpy())
    runner.step(np.array([want[:2]], np.int64))
    last = np.array(runner.step(np.array([[want[2]]], np.int64)))[0, -1]
    with torch.no_grad():
        ref = lm.model(seq).logits[0, -1].numpy()
    np.testing.assert_allclose(last, ref, atol=1e-4, rtol=1e-4)


def test_cli_name_that_is_not_a_file_stem_is_usage_error(tmp_path):
    from typer.testing import CliRunner

    import hetforge.cli.commands.bench  # noqa: F401  (registers `bench` on the app)
    from hetforge.cli.common import app

    res = CliRunner().invoke(app, ["bench", "peers", "-m", "gpt2-tiny", "-s", "eager", "--quick", "--in-process",
                                   "--out-dir", str(tmp_path), "--name", "../elsewhere"])
    assert res.exit_code == 2 and "--name" in res.output
    assert not any(tmp_path.iterdir())  # nothing half-written
