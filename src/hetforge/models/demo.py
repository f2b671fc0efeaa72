"""The demo model: a small Llama-style model trained by ``scripts/train_demo.py`` and shipped with the package.

It is trained on the Python documentation that comes with CPython (``pydoc_data.topics``); its weights
(fp16 storage, loaded as fp32), byte-level BPE tokenizer and training record (``training.json``: seed,
losses, train/validation split) live in ``hetforge/assets/demo/`` as a standard Hugging Face folder.
Importing this module registers it in the zoo as ``demo`` when those files are present.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hetforge.models.zoo import ZOO, LoadedModel, ModelSpec, load_folder, spec_loaders

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "demo"
NAME = "demo"
EOT = "<|endoftext|>"


def available() -> bool:
    """Whether the shipped weights, config and tokenizer are all present."""
    return all((ASSETS / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def training_record() -> dict:
    """What ``scripts/train_demo.py`` recorded (losses, split, seed); {} when absent."""
    f = ASSETS / "training.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(ASSETS), local_files_only=True)


def load(attn: str = "sdpa", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The demo model with its tokenizer, as a zoo entry named ``demo``."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a 4 M-parameter load needs no progress bar on stderr
    try:
        loaded = load_folder(ASSETS, attn=attn, dtype=dtype)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    loaded.name = NAME
    loaded.weights = "trained demo weights (hetforge/assets/demo, scripts/train_demo.py)"
    loaded.extra["training"] = training_record()
    return loaded


def corpus() -> tuple[list[str], str]:
    """The training corpus: topic names (sorted) and the text, topics joined by the end-of-text token."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    return names, EOT.join(topics[n].strip() + "\n" for n in names)


def split_text(text: str, val_frac: float) -> tuple[str, str, int]:
    """Cut at the last topic boundary before ``1 - val_frac`` of the characters (val gets >= val_frac)."""
    cut = int(len(text) * (1 - val_frac))
    prev = text.rfind(EOT, 0, cut)
    cut = prev + len(EOT) if prev >= 0 else cut
    return text[:cut], text[cut:], cut


def validation_text() -> str:
    """The held-back validation text: the corpus after the split point recorded in ``training.json``."""
    rec = training_record().get("split", {})
    if "val_start_char" not in rec:
        return ""
    return corpus()[1][rec["val_start_char"]:]


MOE_ASSETS = ASSETS.parent / "moe-demo"
MOE_NAME = "moe-demo"


def moe_available() -> bool:
    """Whether the MoE demo model (``scripts/train_moe.py``) is shipped."""
    return all((MOE_ASSETS / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def load_moe(attn: str = "sdpa", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The MoE demo model (8 experts, top-2, trained routing) as the zoo entry ``moe-demo``."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        loaded = load_folder(MOE_ASSETS, attn=attn, dtype=dtype)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    loaded.name = MOE_NAME
    loaded.weights = "trained MoE demo weights (hetforge/assets/moe-demo, scripts/train_moe.py)"
    f = MOE_ASSETS / "training.json"
    loaded.extra["training"] = json.loads(f.read_text()) if f.is_file() else {}
    return loaded


def _moe_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(MOE_ASSETS), local_files_only=True)


if moe_available() and MOE_NAME not in ZOO:
    ZOO[MOE_NAME] = ModelSpec(MOE_NAME, "mixtral", "causal-lm", _moe_config,
                              "Mixtral-style MoE demo trained on CPython's docs (8 experts, top-2; shipped weights)")
    spec_loaders[MOE_NAME] = load_moe

if available() and NAME not in ZOO:
    ZOO[NAME] = ModelSpec(NAME, "llama", "causal-lm", _config,
                          "Llama-style demo model trained on CPython's docs (shipped weights, GQA 8/2)")
    spec_loaders[NAME] = load


ARITH_ASSETS = ASSETS.parent / "arith-demo"
ARITH_NAME = "arith-demo"


def arith_available() -> bool:
    """Whether the arithmetic demo model (``scripts/train_arith.py``) is shipped."""
    return all((ARITH_ASSETS / f).is_file() for f in ("config.json", "model.safetensors", "training.json"))


def arith_record() -> dict:
    """What ``scripts/train_arith.py`` recorded (task, seed, the held-out test problems); {} when absent."""
    f = ARITH_ASSETS / "training.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def load_arith(attn: str = "sdpa", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The arithmetic demo model (``a+b=`` → the sum and a newline; byte-level, no tokenizer file)."""
    loaded = load_folder(ARITH_ASSETS, attn=attn, dtype=dtype)
    loaded.name = ARITH_NAME
    loaded.weights = "trained arithmetic demo weights (hetforge/assets/arith-demo, scripts/train_arith.py)"
    loaded.extra["training"] = arith_record()
    return loaded


def _arith_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(ARITH_ASSETS), local_files_only=True)


if arith_available() and ARITH_NAME not in ZOO:
    ZOO[ARITH_NAME] = ModelSpec(ARITH_NAME, "llama", "causal-lm", _arith_config,
                                "tiny Llama-style model trained on two-number addition (shipped weights; "
                                "candidate-selection benchmark)")
    spec_loaders[ARITH_NAME] = load_arith
