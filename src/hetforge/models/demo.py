"""The demo model: a small Llama-style model trained by ``scripts/train_demo.py`` and shipped with the package.

It is trained on the Python documentation that comes with CPython (``pydoc_data.topics``); its weights
(fp16 storage, loaded as fp32), byte-level BPE tokenizer and training record (``training.json``: seed,
losses, train/validation split) live in ``hetforge/assets/demo/`` as a standard Hugging Face folder.
Importing this module registers it in the zoo as ``demo`` when those files are present.
"""

from __future__ import annotations

import torch

from hetforge.models.zoo import (
    SHIPPED_ASSETS,
    LoadedModel,
    load_shipped,
    register_shipped,
    shipped_available,
    shipped_training_record,
)

NAME = "demo"
MOE_NAME = "moe-demo"
ASSETS = SHIPPED_ASSETS / NAME
MOE_ASSETS = SHIPPED_ASSETS / MOE_NAME
EOT = "<|endoftext|>"


def available() -> bool:
    """Whether the shipped weights, config and tokenizer are all present."""
    return shipped_available(NAME)


def moe_available() -> bool:
    """Whether the MoE demo model (``scripts/train_moe.py``) is shipped."""
    return shipped_available(MOE_NAME)


def training_record() -> dict:
    """What ``scripts/train_demo.py`` recorded (losses, split, seed); {} when absent."""
    return shipped_training_record(NAME)


def load(attn: str = "sdpa", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The demo model with its tokenizer, as a zoo entry named ``demo``."""
    return load_shipped(NAME, attn=attn, dtype=dtype)


def load_moe(attn: str = "sdpa", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The MoE demo model (8 experts, top-2, trained routing) as the zoo entry ``moe-demo``."""
    return load_shipped(MOE_NAME, attn=attn, dtype=dtype)


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


register_shipped()  # importing this module registers the shipped models (as before)
