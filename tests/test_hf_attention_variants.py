"""Hugging Face architectures whose attention or head the zoo models do not exercise: sliding windows (Mistral,
Gemma 2's local layers), Gemma 2's attention and final-logit soft caps, Granite's logit scaling, and the runtime's
check of its generation modules against the model's own ``forward``.

Each model is a small seeded ``from_config`` model saved as a Hugging Face folder (the way a user brings one), and
every generated position's logits are compared with the model's own ``forward`` over the whole sequence (no KV
cache: Hugging Face's masks applied to every position)."""

import pytest
import torch
import transformers as T

from hetforge.errors import CaptureError
from hetforge.models.zoo import load_model
from hetforge.runtime import Engine, SamplingParams
from hetforge.runtime.model_check import check_against_model
from hetforge.runtime.sampling import Sampler

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256)
WINDOW = 8
PROMPT = [(7 * i + 3) % 300 for i in range(12)]
NEW = 30  # 12 + 30 positions: past the window of 8 in the prefill and in every decode step


def _config(arch: str, window: int = WINDOW, **kw):
    kw = {**COMMON, **kw}
    if arch == "mistral":
        return T.MistralConfig(num_key_value_heads=2, sliding_window=window, **kw)
    if arch == "gemma2":  # layer 0 local (sliding), layer 1 global; soft caps on
        return T.Gemma2Config(num_key_value_heads=2, head_dim=16, sliding_window=window, **kw)
    if arch == "granite":
        return T.GraniteConfig(num_key_value_heads=2, logits_scaling=4.0, **kw)
    raise ValueError(arch)


def _folder(tmp_path, arch: str, scale: float = 8.0, **kw):
    """A seeded model, its weights scaled up so that attention scores and logits are large enough for windows and
    soft caps to change them well above rounding."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(_config(arch, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "lm_head.weight", "embed_tokens.weight")):
                p.mul_(scale)
    path = tmp_path / arch
    model.save_pretrained(path)
    return path


def _steps(loaded, monkeypatch, prompt: list[int] = PROMPT, prefill: str = "fine", pieces: list | None = None
           ) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits each was picked from, through the runtime (prefill + decode programs)."""
    seen: list[torch.Tensor] = []
    real = Sampler.pick
    monkeypatch.setattr(Sampler, "pick", lambda self, x: seen.append(x.detach().reshape(-1).clone()) or real(self, x))
    r = Engine(loaded, executor="auto", prefill=prefill).generate(prompt, SamplingParams(max_new_tokens=NEW,
                                                                                          ignore_eos=True))
    if pieces is not None:
        pieces.extend(r.prefill_pieces)
    return r.tokens, seen


def _reference(model, tokens: list[int], prompt: list[int] = PROMPT) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:]


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_generation_past_the_sliding_window_gives_the_models_own_logits(tmp_path, monkeypatch, arch):
    monkeypatch.setenv("HETFORGE_COMPILE_CACHE", "0")
    loaded = load_model(str(_folder(tmp_path, arch)))
    tokens, logits = _steps(loaded, monkeypatch)
    ref = _reference(loaded.model, tokens)
    got = torch.stack(logits)
    assert got.shape == ref.shape and len(tokens) == NEW
    assert (got - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
    # the window matters here: the same weights attending to every position give other logits past it
    unwindowed = T.AutoModelForCausalLM.from_config(_config(arch, window=10_000))
    unwindowed.load_state_dict(loaded.model.state_dict())
    far = _reference(unwindowed.eval(), tokens)
    assert (far[WINDOW:] - ref[WINDOW:]).abs().max().item() > 1e-2


def test_gemma2_soft_caps_are_applied_in_prefill_decode_and_to_the_logits(tmp_path, monkeypatch):
    """Small caps (2 on attention scores, 3 on the logits) change every score and logit a lot: the runtime's logits
    must be the capped ones, within [-3, 3]."""
    monkeypatch.setenv("HETFORGE_COMPILE_CACHE", "0")
    loaded = load_model(str(_folder(tmp_path, "gemma2", attn_logit_softcapping=2.0, final_logit_softcapping=3.0)))
    tokens, logits = _steps(loaded, monkeypatch)
    ref = _reference(loaded.model, tokens)
    got = torch.stack(logits)
    assert got.abs().max().item() <= 3.0
    assert (got - ref).abs().max().item() < 1e-4
    uncapped = T.AutoModelForCausalLM.from_config(_config("gemma2", attn_logit_softcapping=None,
                                                          final_logit_softcapping=3.0))
    uncapped.load_state_dict(loaded.model.state_dict())
    assert (_reference(uncapped.eval(), tokens) - ref).abs().max().item() > 1e-2  # the attention cap matters


def test_granite_logits_are_divided_by_its_logits_scaling(tmp_path, monkeypatch):
    monkeypatch.setenv("HETFORGE_COMPILE_CACHE", "0")
    loaded = load_model(str(_folder(tmp_path, "granite")))
    tokens, logits = _steps(loaded, monkeypatch)
    ref = _reference(loaded.model, tokens)
    assert (torch.stack(logits) - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("layers", [2, 4])  # 4 alike layers: checked on the first two, then restored
def test_a_model_whose_head_the_modules_do_not_reproduce_is_refused_before_compiling(tmp_path, monkeypatch, layers):
    """A forward that changes the logits in a way the runtime's modules do not know (here: plus 1) is caught by the
    check against the model's own forward, with one readable error, before any capture."""
    monkeypatch.setenv("HETFORGE_COMPILE_CACHE", "0")
    loaded = load_model(str(_folder(tmp_path, "mistral", num_hidden_layers=layers)))
    forward = type(loaded.model).forward

    def shifted(self, *a, **kw):
        out = forward(self, *a, **kw)
        out.logits = out.logits + 1.0
        return out

    monkeypatch.setattr(type(loaded.model), "forward", shifted)
    captured = []
    from hetforge.runtime import programs

    monkeypatch.setattr(programs.ProgramCache, "_capture", lambda *a, **kw: captured.append(1))
    with pytest.raises(CaptureError, match=r"do not reproduce MistralForCausalLM's logits: max \|Δ\| .* 4-token"):
        Engine(loaded, executor="auto").generate(PROMPT, SamplingParams(max_new_tokens=2))
    assert not captured
    assert len(loaded.model.model.layers) == loaded.model.config.num_hidden_layers == layers


def test_the_check_passes_the_zoo_models_in_fp32_and_bf16():
    for name in ("gpt2-tiny", "llama-tiny", "mixtral-tiny"):
        for dtype in (torch.float32, torch.bfloat16):
            rel = check_against_model(load_model(name, dtype=dtype).model)
            assert rel < (1e-5 if dtype == torch.float32 else 2e-2), (name, dtype, rel)


def test_batched_candidates_past_the_sliding_window_decode_the_greedy_run(tmp_path, monkeypatch):
    """The batched decode program (candidates) masks the window per row as the one-row program does: its greedy
    row gives the plain greedy run's tokens past the window."""
    from hetforge.runtime.candidates import generate_candidates
    from hetforge.runtime.select import SelectParams

    monkeypatch.setenv("HETFORGE_COMPILE_CACHE", "0")
    loaded = load_model(str(_folder(tmp_path, "mistral")))
    e = Engine(loaded, executor="auto")
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=3, ignore_eos=True)
    greedy = e.generate(PROMPT, SamplingParams(max_new_tokens=NEW, ignore_eos=True)).tokens
    res = generate_candidates(e, PROMPT, params, SelectParams(k=2, mode="best-of", greedy_anchor=True))
    assert res.candidates[0].greedy and res.candidates[0].tokens == greedy
    tokens, _ = _steps(loaded, monkeypatch)
    assert tokens == greedy == _reference_greedy(loaded.model)
    unwindowed = T.AutoModelForCausalLM.from_config(_config("mistral", window=10_000))
    unwindowed.load_state_dict(loaded.model.state_dict())
    assert greedy != _reference_greedy(unwindowed.eval())  # the window changes these greedy tokens


def _reference_greedy(model) -> list[int]:
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_a_chunked_prefill_past_the_sliding_window_gives_the_models_own_logits(tmp_path, monkeypatch, arch):
    """A prompt prefilled as a tier and a chunk over the cache: each chunk row masks its own window of the cache."""
    monkeypatch.setenv("HETFORGE_COMPILE_CACHE", "0")
    loaded = load_model(str(_folder(tmp_path, arch)))
    prompt = [(5 * i + 1) % 300 for i in range(40)]
    pieces: list = []
    tokens, logits = _steps(loaded, monkeypatch, prompt, prefill="chunked", pieces=pieces)
    assert any(p.startswith("chunk-") for p in pieces), pieces
    ref = _reference(loaded.model, tokens, prompt)
    assert (torch.stack(logits) - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


def test_the_first_prompt_program_notes_the_check_and_later_ones_do_not_run_it(monkeypatch):
    monkeypatch.setenv("HETFORGE_COMPILE_CACHE", "0")
    programs = Engine(load_model("llama-tiny"), executor="auto").programs
    first, later = programs.prefill(32)[0], programs.prefill(64)[0]
    assert any(n.startswith("generation modules checked against LlamaForCausalLM's own forward") for n in first.notes)
    assert not any("checked against" in n for n in later.notes)


@pytest.mark.parametrize("arch", ["bloom", "falcon"])
def test_an_architecture_whose_attention_bypasses_the_interface_is_refused_in_one_line(tmp_path, monkeypatch, arch):
    """Bloom's attention (ALiBi in its own code) never reaches the runtime's attention; Falcon's wants a mask the
    runtime does not build: `hetforge run` says so in one line, exit 1, no traceback."""
    from typer.testing import CliRunner

    from hetforge.cli.common import app
    from hetforge.cli.main import _load_commands

    monkeypatch.setenv("HETFORGE_COMPILE_CACHE", "0")
    torch.manual_seed(0)
    config = (T.BloomConfig(vocab_size=300, hidden_size=64, n_layer=2, n_head=4) if arch == "bloom" else
              T.FalconConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4))
    T.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / arch)
    _load_commands()
    res = CliRunner().invoke(app, ["run", str(tmp_path / arch), "-p", "hello", "-n", "2"])
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "not supported for generation" in lines[0], lines
    assert "Traceback" not in res.output
