"""Named models built offline from ``transformers`` configs with seeded random weights.

No hub access exists on the machines hetforge is built on, so every zoo entry is a config plus a seed:
fine for speed, memory and numerical-fidelity work. Real weights come from a local Hugging Face folder
(:func:`load_model` accepts a path) or the demo model the project trains and ships itself.
"""

from __future__ import annotations

import functools
import json
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from hetforge.errors import ModelFolderError, UsageError
from hetforge.files import read_json

ATTN_IMPLS = ("eager", "sdpa")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "olmoe")


@dataclass(frozen=True)
class ModelSpec:
    """One zoo entry: how to build the config, and what kind of model it is."""

    name: str
    family: str
    kind: str  # "causal-lm" or "masked-lm"
    make_config: Callable[[], object]
    description: str
    tiny: bool = False
    attn_impls: tuple[str, ...] = ATTN_IMPLS


def _gpt2(**kw):
    from transformers import GPT2Config

    return GPT2Config(**kw)


def _llama(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**kw)


def _mixtral(**kw):
    from transformers import MixtralConfig

    return MixtralConfig(**kw)


def _qwen2(**kw):
    from transformers import Qwen2Config

    return Qwen2Config(**kw)


def _qwen2_moe(**kw):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**kw)


def _olmoe(**kw):
    from transformers import OlmoeConfig

    return OlmoeConfig(**kw)


def _bert(**kw):
    from transformers import BertConfig

    return BertConfig(**kw)


_TINY_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
)

ZOO: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("gpt2", "gpt2", "causal-lm", lambda: _gpt2(), "GPT-2 124M (GPT2Config defaults)"),
        ModelSpec(
            "llama-110m", "llama", "causal-lm",
            lambda: _llama(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                           num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                           max_position_embeddings=2048),
            "Llama-style, hidden 768, 12 layers, 12 heads, ffn 2048, vocab 32000",
        ),
        # out-of-sample shapes for the cost-model accuracy bench: no width, FFN or head size of these is
        # among the shapes `hetforge calibrate` measures (K = 768; heads 12 × 64; FFN 2048 / 3072)
        ModelSpec(
            "llama-oos-1536", "llama", "causal-lm",
            lambda: _llama(hidden_size=1536, intermediate_size=4096, num_hidden_layers=4,
                           num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                           max_position_embeddings=2048),
            "Llama-style, hidden 1536, 4 layers, 16 heads of 96 (GQA 16/4), ffn 4096 (cost-model bench)",
        ),
        ModelSpec(
            "gpt2-oos-1024", "gpt2", "causal-lm",
            lambda: _gpt2(n_embd=1024, n_layer=4, n_head=16),
            "GPT-2 family, hidden 1024, 4 layers, 16 heads of 64, ffn 4096 (cost-model bench)",
        ),
        ModelSpec(
            "mixtral-small", "mixtral", "causal-lm",
            lambda: _mixtral(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                             num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=2048),
            "Mixtral-style MoE, hidden 512, 4 layers, 8 experts, top-2",
        ),
        ModelSpec(
            "gpt2-tiny", "gpt2", "causal-lm",
            lambda: _gpt2(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=512,
                          bos_token_id=255, eos_token_id=255),
            "GPT-2 family, 2 layers, hidden 64 (tests)", tiny=True,
        ),
        ModelSpec("llama-tiny", "llama", "causal-lm", lambda: _llama(**_TINY_LLAMA),
                  "Llama family, 2 layers, hidden 64, GQA 4/2 (tests)", tiny=True),
        ModelSpec(
            "mixtral-tiny", "mixtral", "causal-lm",
            lambda: _mixtral(**_TINY_LLAMA, num_local_experts=4, num_experts_per_tok=2),
            "Mixtral family MoE, 2 layers, 4 experts, top-2 (tests)", tiny=True,
        ),
        ModelSpec(
            "qwen2-moe-tiny", "qwen2_moe", "causal-lm",
            lambda: _qwen2_moe(**_TINY_LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                               shared_expert_intermediate_size=128, norm_topk_prob=False),
            "Qwen2-MoE family: 4 experts top-2 (no renormalisation) + gated shared expert (tests)", tiny=True,
        ),
        ModelSpec(
            "olmoe-tiny", "olmoe", "causal-lm",
            lambda: _olmoe(**_TINY_LLAMA, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0),
            "OLMoE family: 8 experts top-2, q/k norms (tests)", tiny=True,
        ),
        ModelSpec("qwen2-tiny", "qwen2", "causal-lm", lambda: _qwen2(**_TINY_LLAMA),
                  "Qwen2 family (q/k/v bias), 2 layers, hidden 64 (tests)", tiny=True),
        ModelSpec(
            "bert-tiny", "bert", "masked-lm",
            lambda: _bert(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=128, vocab_size=256, max_position_embeddings=512),
            "BERT encoder, 2 layers, hidden 64 (tests)", tiny=True,
        ),
    ]
}


class LogitsModule(nn.Module):
    """Wraps a HF model as ``(input_ids, attention_mask) -> logits`` with no cache.

    The attention mask is always passed: without it transformers 5 calls ``torch.diff`` in its
    packed-sequence detection, which other compilers cannot convert.
    """

    def __init__(self, model: nn.Module, causal: bool = True):
        super().__init__()
        self.model = model
        self.causal = causal

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.causal:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


@dataclass
class LoadedModel:
    """A built model ready to capture: the HF module, its config and where its weights came from."""

    name: str
    family: str
    kind: str
    model: nn.Module
    config: object
    attn: str
    weights: str  # "seeded random (seed N)" or the folder path
    tokenizer: object | None = None
    extra: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_positions(self) -> int:
        c = self.config
        return int(getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", 1024))

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def logits_module(self) -> LogitsModule:
        return LogitsModule(self.model, causal=self.kind == "causal-lm")


def list_models() -> list[ModelSpec]:
    return list(ZOO.values())


def count_parameters(spec: ModelSpec) -> int:
    """Parameter count without allocating weights (built on the meta device)."""
    with torch.device("meta"):
        model = _build(spec, spec.make_config(), "sdpa")
    return sum(p.numel() for p in model.parameters())


def _build(spec: ModelSpec, config, attn: str) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    config._attn_implementation = attn
    if spec.family in MOE_FAMILIES:
        # transformers' default CPU expert path is an opaque custom op (grouped_mm_fallback) that
        # hides the expert matmuls from torch.export; batched_mm exposes them as bmm.
        config._experts_implementation = "batched_mm"
    auto = AutoModelForMaskedLM if spec.kind == "masked-lm" else AutoModelForCausalLM
    return auto.from_config(config)


def resolve(name: str) -> ModelSpec:
    """Find a zoo entry, or explain which names exist."""
    if name in ZOO:
        return ZOO[name]
    register_shipped()
    if name in ZOO:
        return ZOO[name]
    known = ", ".join(ZOO)
    raise UsageError(f"unknown model '{name}'; known models: {known} (or a path to a local Hugging Face folder)")


def load_model(name: str, attn: str = "sdpa", seed: int = 0, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Build a zoo model with seeded random weights, or load a local Hugging Face folder."""
    if attn not in ATTN_IMPLS:
        raise UsageError(f"unknown attention implementation '{attn}'; allowed: {', '.join(ATTN_IMPLS)}")
    path = Path(name)
    if name not in ZOO and (path.exists() or "/" in name or name.startswith(".")):
        return load_folder(path, attn=attn, dtype=dtype)
    spec = resolve(name)
    if attn not in spec.attn_impls:
        raise UsageError(f"model '{name}' has no '{attn}' attention; allowed: {', '.join(spec.attn_impls)}")
    loader = spec_loaders.get(spec.name)
    if loader is not None:
        return loader(attn=attn, dtype=dtype)
    torch.manual_seed(seed)
    model = _build(spec, spec.make_config(), attn).to(dtype).eval()
    _note_recipe(model, f"zoo {spec.name}, seed {seed}, {dtype}, attn {attn}")
    return LoadedModel(spec.name, spec.family, spec.kind, model, model.config, attn, f"seeded random (seed {seed})")


_recipes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weight_versions(model: nn.Module) -> tuple:
    """(name, version counter, data pointer) of every parameter and buffer: changes when any tensor is modified
    in place or replaced."""
    return tuple((n, t._version, t.data_ptr()) for n, t in sorted(model.state_dict(keep_vars=True).items()))


def _note_recipe(model: nn.Module, recipe: str) -> None:
    import transformers

    _recipes[model] = (f"{recipe}, torch {torch.__version__}, transformers {transformers.__version__}",
                       weight_versions(model))


def weights_recipe(model: nn.Module, versions: tuple | None = None) -> str | None:
    """How a zoo model's seeded weights were made (name, seed, dtype, torch and transformers versions), while no
    tensor has been modified or replaced since :func:`load_model` made them; else None. The same recipe makes the
    same bytes (seeded CPU initialisation is deterministic), so it identifies the weights without reading them."""
    got = _recipes.get(model)
    if got is None:
        return None
    return got[0] if (versions if versions is not None else weight_versions(model)) == got[1] else None


# Entries whose weights come from files rather than a seed (the demo model) register a loader here.
spec_loaders: dict[str, Callable[..., LoadedModel]] = {}

log = logging.getLogger("hetforge")

# encoder-only families: a folder of one of these is a masked LM (never generated from as if causal)
MASKED_LM_TYPES = frozenset({"bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
                             "xlm-roberta", "camembert", "mpnet", "modernbert", "megatron-bert", "ernie"})


def folder_kind(cfg: dict) -> str:
    """``masked-lm`` for an encoder-only checkpoint (by architecture name or model type), else ``causal-lm``."""
    archs = cfg.get("architectures") or []
    if any(isinstance(a, str) and a.endswith("ForMaskedLM") for a in archs):
        return "masked-lm"
    if any(isinstance(a, str) and a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "causal-lm"
    return "masked-lm" if cfg.get("model_type") in MASKED_LM_TYPES else "causal-lm"


def _no_sdpa(e: Exception) -> bool:
    return isinstance(e, ValueError) and "scaled_dot_product_attention" in str(e)


def _from_pretrained(auto, path: Path, attn: str, dtype: torch.dtype):
    """``auto.from_pretrained`` with the loading report (missing/unexpected/mismatched tensors) and no
    progress bars (hetforge prints its own measured timings; stdout/stderr stay clean under ``--json``)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # its multi-line load report: hetforge checks the same facts below, in one line
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        config._attn_implementation = attn
        if config.model_type in MOE_FAMILIES:  # expert matmuls visible to torch.export (see _build)
            config._experts_implementation = "batched_mm"
        return auto.from_pretrained(str(path), config=config, local_files_only=True, dtype=dtype,
                                    output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _names(keys, limit: int = 5) -> str:
    keys = sorted(str(k[0] if isinstance(k, tuple) else k) for k in keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def load_folder(path: Path, attn: str = "sdpa", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a local Hugging Face folder (config.json + safetensors), naming any bad file.

    Every tensor the architecture expects must be in the checkpoint and every checkpoint tensor must be used:
    a missing one would otherwise run with random weights. An architecture whose transformers code has no
    SDPA attention is loaded with eager attention, and a warning says so."""
    if path.is_file():
        raise UsageError(f"'{path}' is a file; give a model folder (config.json + weights) or a zoo name")
    if not path.is_dir():
        raise ModelFolderError(f"model folder '{path}' does not exist")
    cfg_file = path / "config.json"
    if cfg_file.is_dir():
        raise ModelFolderError(f"'{cfg_file}' is a folder, not a file: a model folder needs config.json and weights")
    if not cfg_file.is_file():
        raise ModelFolderError(f"'{cfg_file}' is missing: a model folder needs config.json and weights")
    cfg_dict = read_json(cfg_file, lambda e: ModelFolderError(f"'{cfg_file}' is not valid JSON: {e}"))
    if not isinstance(cfg_dict, dict):
        raise ModelFolderError(f"'{cfg_file}' holds {type(cfg_dict).__name__ if cfg_dict is not None else 'null'}, "
                               "not a JSON object of model settings")
    if not isinstance(cfg_dict.get("model_type"), str):
        raise ModelFolderError(f"'{cfg_file}' has no 'model_type' field, so its architecture is unknown")
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("pytorch_model*.bin"))
    if not weights:
        raise ModelFolderError(f"'{path}' has no weights: expected model.safetensors (or sharded *.safetensors)")
    from safetensors import safe_open

    for w in weights:
        if w.suffix == ".safetensors":
            try:
                with safe_open(str(w), framework="pt") as f:
                    list(f.keys())
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ModelFolderError(f"'{w}' is corrupt or truncated: {str(e).splitlines()[0]}") from None
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    kind = folder_kind(cfg_dict)
    auto = AutoModelForMaskedLM if kind == "masked-lm" else AutoModelForCausalLM
    try:
        try:
            model, info = _from_pretrained(auto, path, attn, dtype)
        except Exception as e:
            if not (attn == "sdpa" and _no_sdpa(e)):
                raise
            log.warning("note: %s has no SDPA attention in transformers; loading it with eager attention",
                        cfg_dict["model_type"])
            attn = "eager"
            model, info = _from_pretrained(auto, path, attn, dtype)
    except Exception as e:
        raise ModelFolderError(f"could not load '{path}': {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
            from None
    bad = []
    if info.get("missing_keys"):
        bad.append(f"missing {len(info['missing_keys'])} tensor(s) the model needs: {_names(info['missing_keys'])}")
    if info.get("unexpected_keys"):
        bad.append(f"{len(info['unexpected_keys'])} tensor(s) the model does not use: "
                   f"{_names(info['unexpected_keys'])}")
    if info.get("mismatched_keys"):
        bad.append(f"{len(info['mismatched_keys'])} tensor(s) of the wrong shape: {_names(info['mismatched_keys'])}")
    if bad:
        why = " (refusing to run with randomly initialised weights)" if info.get("missing_keys") else ""
        raise ModelFolderError(f"checkpoint in '{path}' does not match its config ({cfg_dict['model_type']}): "
                               + "; ".join(bad) + why)
    config = model.config
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:
            raise ModelFolderError(f"tokenizer in '{path}' could not be loaded: {str(e).splitlines()[0]}") from None
    loaded = LoadedModel(path.name, config.model_type, kind, model.eval(), config, attn, str(path), tokenizer)
    vf = path / "verifier.json"  # a self-verification template the model was trained for (runtime.verify)
    if vf.is_file():
        try:
            loaded.extra["verifier"] = json.loads(vf.read_text())
        except json.JSONDecodeError as e:
            raise ModelFolderError(f"'{vf}' is not valid JSON ({e.msg} at line {e.lineno})") from None
    return loaded


def example_inputs(loaded: LoadedModel, seq: int = 16, batch: int = 1, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Deterministic token ids and an all-ones attention mask of shape [batch, seq]."""
    if seq < 1 or seq > loaded.max_positions:
        raise UsageError(f"--seq {seq} is outside 1..{loaded.max_positions} (the model's maximum context)")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, loaded.vocab_size, (batch, seq), generator=g)
    return ids, torch.ones_like(ids)


# Models whose weights ship with the package (``hetforge/assets/<name>``, trained by ``scripts/``): name →
# (family, description, where the weights come from). They join the zoo on first lookup (:func:`resolve`)
# or when :mod:`hetforge.models.demo` is imported, and only when their files are present.
SHIPPED_ASSETS = Path(__file__).resolve().parents[1] / "assets"
SHIPPED = {
    "moe-demo": ("mixtral", "Mixtral-style MoE demo trained on CPython's docs (8 experts, top-2; shipped weights)",
                 "trained MoE demo weights (hetforge/assets/moe-demo, scripts/train_moe.py)"),
    "demo": ("llama", "Llama-style demo model trained on CPython's docs (shipped weights, GQA 8/2)",
             "trained demo weights (hetforge/assets/demo, scripts/train_demo.py)"),
    "arith-demo": ("llama", "tiny Llama-style model trained on two-number addition (shipped weights; "
                   "candidate-selection benchmark)",
                   "trained arithmetic demo weights (hetforge/assets/arith-demo, scripts/train_arith.py)"),
}
# The files a shipped model needs; arith-demo is byte-level (no tokenizer file) and its training.json holds the
# held-out test problems the selection benchmark uses.
_SHIPPED_FILES = {"arith-demo": ("config.json", "model.safetensors", "training.json")}


def shipped_available(name: str) -> bool:
    """Whether the shipped model's weights, config and tokenizer (or other required files) are all present."""
    files = _SHIPPED_FILES.get(name, ("config.json", "model.safetensors", "tokenizer.json"))
    return all((SHIPPED_ASSETS / name / f).is_file() for f in files)


def shipped_training_record(name: str) -> dict:
    """What the training script recorded (losses, split, seed) for a shipped model; {} when absent."""
    f = SHIPPED_ASSETS / name / "training.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _shipped_config(name: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(SHIPPED_ASSETS / name), local_files_only=True)


def load_shipped(name: str, attn: str = "sdpa", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A shipped model with its tokenizer, as the zoo entry ``name``."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a few-M-parameter load needs no progress bar on stderr
    try:
        loaded = load_folder(SHIPPED_ASSETS / name, attn=attn, dtype=dtype)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    loaded.name = name
    loaded.weights = SHIPPED[name][2]
    loaded.extra["training"] = shipped_training_record(name)
    return loaded


def register_shipped() -> None:
    """Add the shipped models whose files are present to :data:`ZOO` (once)."""
    for name, (family, description, _) in SHIPPED.items():
        if shipped_available(name) and name not in ZOO:
            ZOO[name] = ModelSpec(name, family, "causal-lm", functools.partial(_shipped_config, name), description)
            spec_loaders[name] = functools.partial(load_shipped, name)
