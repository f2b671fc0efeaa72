"""Shape-only models: a Llama-3.1-8B-shaped graph built on the meta device and captured with torch.export.

Placement, cost and scheduling need shapes and dtypes, not 8 B weights: the model is built from its
published config under ``torch.device("meta")`` (no memory, no download), cast to fp16, and exported
on meta-device inputs (:func:`hetforge.frontend.capture_shaped`), so every node carries fake tensors with
the real shapes. The graph cannot be *run*, only analysed.

Config (Meta's Llama-3.1-8B ``config.json``): hidden 4096, 32 layers, 32 heads / 8 KV heads, FFN 14336,
vocab 128256, RoPE θ 500000 with llama3 scaling, RMSNorm ε 1e-5, untied embeddings.
"""

from __future__ import annotations

import torch

from hetforge.errors import UsageError

LLAMA31_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
)

SHAPED = {"llama-3.1-8b-shape": LLAMA31_8B}


def is_shaped(name: str) -> bool:
    return name in SHAPED


def shaped_module(name: str = "llama-3.1-8b-shape", seq: int = 16, layers: int | None = None,
                  dtype: torch.dtype = torch.float16, attn: str = "sdpa", overrides: dict | None = None):
    """A shape-only model on the meta device and its example inputs ``(input_ids, attention_mask)``;
    ``layers`` (and any config ``overrides``) shrink it for quick tests. Captured by
    :func:`hetforge.frontend.capture_shaped`."""
    from transformers import LlamaConfig

    from hetforge.models.zoo import ZOO, LogitsModule, _build

    if name not in SHAPED:
        raise UsageError(f"unknown shape-only model '{name}'; known: {', '.join(SHAPED)}")
    cfg_kw = {**SHAPED[name], **(overrides or {})}
    if layers is not None:
        if layers < 1:
            raise UsageError(f"layers must be >= 1, got {layers}")
        cfg_kw["num_hidden_layers"] = layers
    if not 1 <= seq <= cfg_kw["max_position_embeddings"]:
        raise UsageError(f"--seq {seq} is outside 1..{cfg_kw['max_position_embeddings']}")
    config = LlamaConfig(**cfg_kw)
    with torch.device("meta"):
        model = _build(ZOO["llama-tiny"], config, attn).to(dtype)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return LogitsModule(model).eval(), (ids, torch.ones_like(ids))
