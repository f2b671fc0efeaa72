import json

import pytest
import torch
from typer.testing import CliRunner

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands
from hetforge.errors import CaptureError, ModelFolderError, UsageError
from hetforge.frontend import capture
from hetforge.models.zoo import ZOO, example_inputs, load_model
from hetforge.verify import compare_logits, verify

_load_commands()
runner = CliRunner()

TINY = [n for n, s in ZOO.items() if s.tiny]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", TINY)
def test_tiny_models_capture_and_match_eager(name, attn):
    loaded = load_model(name, attn=attn)
    inputs = example_inputs(loaded, seq=12)
    cg = capture(loaded.logits_module(), inputs, name=name)
    rep = verify(loaded.logits_module(), cg.gm, inputs, kl_threshold=1e-9)
    assert rep.passed, rep
    assert rep.top1_agree == 1.0
    # every node carries shape/dtype metadata
    for n in cg.gm.graph.nodes:
        if n.op == "call_function":
            assert "val" in n.meta, n
    # parameters are traceable to their module path
    assert any(p.endswith(".weight") and not p.startswith("model.model.") for p in cg.param_paths.values())


def test_param_paths_name_modules():
    loaded = load_model("llama-tiny")
    cg = capture(loaded.logits_module(), example_inputs(loaded, seq=8))
    assert "model.layers.1.self_attn.q_proj.weight" in cg.param_paths.values()


def test_dynamic_seq_capture_runs_other_lengths():
    loaded = load_model("llama-tiny")
    cg = capture(loaded.logits_module(), example_inputs(loaded, seq=8),
                 dynamic_dims={0: {1: ("seq", 2, 64)}, 1: {1: ("seq", 2, 64)}})
    other = example_inputs(loaded, seq=20)
    rep = verify(loaded.logits_module(), cg.gm, other)
    assert rep.passed


def test_compare_logits_detects_differences():
    a = torch.randn(4, 10)
    b = a.clone()
    b[0, 3] += 5.0
    rep = compare_logits(a, b, kl_threshold=1e-9)
    assert not rep.passed and rep.max_abs_err == pytest.approx(5.0) and rep.kl_max > 1e-3
    assert compare_logits(a, a).passed


def test_unknown_model_is_usage_error():
    with pytest.raises(UsageError, match="known models: gpt2"):
        load_model("no-such-model")


class DataDependent(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


def test_data_dependent_model_gives_short_capture_error():
    with pytest.raises(CaptureError) as ei:
        capture(DataDependent(), (torch.randn(4),))
    msg = str(ei.value)
    assert "DataDependent" in msg and "data-dependent" in msg and "Fix:" in msg
    assert len(msg.splitlines()) == 1


def test_local_folder_roundtrip_and_bad_files(tmp_path):
    loaded = load_model("llama-tiny")
    folder = tmp_path / "m"
    loaded.model.save_pretrained(folder)
    real = load_model(str(folder))
    ids = example_inputs(loaded, seq=6)
    with torch.no_grad():
        assert torch.equal(real.logits_module()(*ids), loaded.logits_module()(*ids))
    # corrupt weights -> names the file
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelFolderError, match="model.safetensors"):
        load_model(str(folder))
    (folder / "config.json").unlink()
    with pytest.raises(ModelFolderError, match="config.json"):
        load_model(str(folder))


def test_cli_models_json():
    r = runner.invoke(app, ["models", "--json"])
    assert r.exit_code == 0, r.output
    names = {m["name"]: m for m in json.loads(r.stdout)["models"]}
    assert names["gpt2"]["parameters"] == 124439808
    assert names["llama-110m"]["family"] == "llama"


def test_cli_capture_and_verify():
    r = runner.invoke(app, ["capture", "gpt2-tiny", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["nodes"] > 10
    assert d["ops"].get("aten.linear.default", 0) + d["ops"].get("aten.addmm.default", 0) >= 1
    r = runner.invoke(app, ["verify", "llama-tiny", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["kl_max"] < 1e-9 and {"max_abs_err", "kl_mean", "kl_max", "top1_agree"} <= set(d)


def test_cli_bad_inputs_exit_codes(tmp_path):
    r = runner.invoke(app, ["capture", "nope"])
    assert r.exit_code == 2 and "unknown model 'nope'" in r.output
    r = runner.invoke(app, ["capture", "gpt2-tiny", "--attn", "flash"])
    assert r.exit_code == 2 and "eager, sdpa" in r.output
    r = runner.invoke(app, ["capture", str(tmp_path)])
    assert r.exit_code == 1 and "config.json" in r.output
    r = runner.invoke(app, ["capture", "gpt2-tiny", "--dump", str(tmp_path / "no" / "g.txt")])
    assert r.exit_code == 2 and not (tmp_path / "no").exists()
