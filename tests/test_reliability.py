"""Regression tests for issue 17's silent or crashing cases: checkpoints, configs, profiles, sampling, ranges."""

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands
from hetforge.errors import HetforgeError, ModelFolderError, UsageError
from hetforge.models.zoo import load_model
from hetforge.runtime.sampling import Sampler, SamplingParams

_load_commands()
runner = CliRunner()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Real HF folders written by save_pretrained, then damaged in one way each."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("ckpt")
    good = root / "good"
    load_model("llama-tiny").model.save_pretrained(good)
    out = {"good": good}

    def variant(name, edit):
        d = root / name
        shutil.copytree(good, d)
        sd = load_file(d / "model.safetensors")
        edit(sd)
        save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
        out[name] = d

    variant("missing", lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    variant("extra", lambda sd: sd.__setitem__("extra.weight", torch.zeros(3)))
    variant("nan", lambda sd: sd["model.norm.weight"].fill_(float("nan")))
    nullcfg = root / "nullcfg"
    shutil.copytree(good, nullcfg)
    (nullcfg / "config.json").write_text("null")
    out["nullcfg"] = nullcfg
    cfgdir = root / "cfgdir"
    shutil.copytree(good, cfgdir)
    (cfgdir / "config.json").unlink()
    (cfgdir / "config.json").mkdir()
    out["cfgdir"] = cfgdir
    bert = root / "bert"
    load_model("bert-tiny").model.save_pretrained(bert)
    out["bert"] = bert
    return out


def test_good_folder_loads_with_no_loading_noise_under_json(folders):
    r = runner.invoke(app, ["capture", str(folders["good"]), "--seq", "4", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["model"] == "good"
    assert r.stderr == ""  # no progress bars, no transformers load report


def test_checkpoint_missing_a_tensor_is_an_error_naming_it(folders):
    with pytest.raises(ModelFolderError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(folders["missing"]))


def test_checkpoint_with_an_unused_tensor_is_an_error_naming_it(folders):
    with pytest.raises(ModelFolderError, match=r"does not use: extra\.weight"):
        load_model(str(folders["extra"]))


def test_config_json_null_or_folder_is_one_line(folders):
    with pytest.raises(ModelFolderError, match="holds null, not a JSON object"):
        load_model(str(folders["nullcfg"]))
    with pytest.raises(ModelFolderError, match="is a folder, not a file"):
        load_model(str(folders["cfgdir"]))


def test_a_file_given_as_model_folder_says_so(folders):
    with pytest.raises(UsageError, match="is a file; give a model folder"):
        load_model(str(folders["good"] / "config.json"))


def test_bert_folder_is_a_masked_lm_and_generation_refuses_it(folders):
    lm = load_model(str(folders["bert"]))
    assert lm.kind == "masked-lm"
    r = runner.invoke(app, ["run", str(folders["bert"]), "-p", "hi", "-n", "2"])
    assert r.exit_code == 2 and "masked-lm" in r.stderr, r.output


def test_architecture_without_sdpa_falls_back_to_eager_and_says_so(tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("granite_swa", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256, bos_token_id=0,
                               eos_token_id=0, pad_token_id=0)
    AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").save_pretrained(tmp_path / "g")
    capsys.readouterr()
    lm = load_model(str(tmp_path / "g"), attn="sdpa")
    assert lm.attn == "eager"
    assert "granite_swa has no SDPA attention in transformers; loading it with eager attention" in \
        capsys.readouterr().err
    ids = torch.tensor([[1, 2, 3]])
    assert lm.logits_module()(ids, torch.ones_like(ids)).shape == (1, 3, 256)


def test_binary_soc_profile_and_host_profile_env(tmp_path, monkeypatch):
    from hetforge.hardware import load_soc

    b = tmp_path / "bin.json"
    b.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(UsageError, match="not a text"):
        load_soc(str(b))
    with pytest.raises(UsageError, match="is a folder, not a file"):
        load_soc(str(tmp_path))
    monkeypatch.setenv("HETFORGE_HOST_PROFILE", str(b))
    with pytest.raises(UsageError, match="not a text"):
        load_soc("host")
    monkeypatch.setenv("HETFORGE_HOST_PROFILE", str(tmp_path))
    with pytest.raises(UsageError, match="HETFORGE_HOST_PROFILE.*is a folder"):
        load_soc("host")


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seed_outside_what_torch_accepts_is_a_usage_error(seed):
    with pytest.raises(UsageError, match="--seed"):
        SamplingParams(temperature=1.0, seed=seed)
    Sampler(SamplingParams(temperature=1.0, seed=2**64 - 1), 4)  # the largest one works


@pytest.mark.parametrize("temperature", [1e-39, 1e-300, 1e-320])
def test_tiny_temperature_is_greedy_not_a_crash(temperature):
    logits = torch.tensor([0.5, 0.7, 0.69, -3.0])
    assert Sampler(SamplingParams(temperature=temperature, seed=1), 4).pick(logits) == 1
    # top-k decided at the tiny temperature still applies
    assert Sampler(SamplingParams(temperature=temperature, top_k=2), 4).pick(torch.tensor([0.9, 0.1, 0.8, 0.0])) == 0


def test_nan_logits_are_a_clear_failure():
    s = Sampler(SamplingParams(temperature=0.8), 4)
    with pytest.raises(HetforgeError, match="NaN logits"):
        s.pick(torch.tensor([0.1, float("nan"), 0.2, 0.3]))


def test_nan_weights_with_sampling_exit_1_one_line(folders):
    r = runner.invoke(app, ["run", str(folders["nan"]), "-p", "hello", "-n", "3", "--temperature", "0.8", "--json"])
    assert r.exit_code == 1, r.output
    assert "NaN logits" in r.stderr and len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


@pytest.mark.parametrize("cmd", [["verify", "llama-tiny"], ["run-graph", "llama-tiny"], ["optimize", "llama-tiny"]])
@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_kl_threshold_must_be_finite_and_non_negative(cmd, value):
    r = runner.invoke(app, [*cmd, "--kl-threshold", value, "--json"])
    assert r.exit_code == 2 and "--kl-threshold must be a finite number" in r.stderr and r.stdout == ""


@pytest.mark.parametrize("value", ["nan", "-300", "1000"])
def test_profile_temp_range(value):
    r = runner.invoke(app, ["profile", "llama-tiny", "--temp", value, "--json"])
    assert r.exit_code == 2 and "--temp must be a device temperature in -40..150" in r.stderr and r.stdout == ""
