"""The generation modules (``runtime.static_kv``) against the model's own ``forward``, once before compiling.

The runtime's prefill, chunk and decode modules rebuild a Hugging Face model's attention (their own masks, sliding
windows and soft caps around a KV cache) and what its causal-LM ``forward`` does after the LM head (soft caps,
scalings). An architecture with something else in either place would otherwise generate from other logits without
a word: greedy tokens often survive a monotonic change of the logits, sampling and log-probabilities do not.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from hetforge.errors import CaptureError
from hetforge.runtime.stamp import StampRefused, _cut, find_stack
from hetforge.runtime.static_kv import PrefillModule

CHECK_TOKENS = 4  # the check prompt's length
CHECK_LAYERS = 2  # a model whose layers are all alike is checked on its first two (what stamping captures)
CHECK_TOLERANCE = {torch.float32: 1e-4}  # max |Δ| ÷ max(1, max |logit|); other dtypes: CHECK_TOLERANCE_LOW
CHECK_TOLERANCE_LOW = 5e-2  # bf16 / fp16: their own rounding differs by up to about 1e-2 between orders of ops


def check_against_model(model: nn.Module) -> float:
    """Run :class:`~hetforge.runtime.static_kv.PrefillModule` eagerly and the model's own ``forward`` on one short
    prompt and compare the last row's logits; returns max |Δ| ÷ max(1, max |logit|) (NaN where the model's own
    logits are not finite: not compared). Raises :class:`~hetforge.errors.CaptureError` above the tolerance of the
    model's dtype. A model whose layers are all alike (``runtime.stamp.find_stack``) runs its first
    :data:`CHECK_LAYERS` layers only: its other layers run the same code, and the whole model's two eager passes
    cost about a tenth of a second on a 100M-parameter model."""
    vocab = model.get_input_embeddings().weight.shape[0]
    t = max(2, min(CHECK_TOKENS, int(getattr(model.config, "max_position_embeddings", CHECK_TOKENS) or CHECK_TOKENS)))
    ids = (torch.arange(t, dtype=torch.long).unsqueeze(0) * 7 + 3) % vocab
    try:
        cut = _cut(find_stack(model), model, CHECK_LAYERS)
    except StampRefused:  # layers that differ (e.g. local and global attention): all of them
        cut = contextlib.nullcontext()
    name = type(model).__name__
    with torch.no_grad(), cut:
        try:
            ours = PrefillModule(model)(ids, torch.tensor([t - 1]))[0][0].float()
        except CaptureError:
            raise
        except Exception as e:  # the model's code around our attention wants what the runtime does not give it
            first = (str(e).splitlines() or [""])[0][:200]
            raise CaptureError(f"hetforge's generation modules cannot run {name} ({type(e).__name__}: {first}): "
                               "its attention or masks do not go through transformers' attention interface the "
                               "way the runtime needs; this architecture is not supported for generation") from None
        ref = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
    if not bool(torch.isfinite(ref).all()):  # the model's own logits are not numbers (e.g. NaN weights): nothing
        return float("nan")                  # to compare; generation reports such logits when it samples them
    rel = (ours - ref).abs().max().item() / max(1.0, ref.abs().max().item())
    dtype = model.get_input_embeddings().weight.dtype
    tol = CHECK_TOLERANCE.get(dtype, CHECK_TOLERANCE_LOW)
    if not rel <= tol:
        raise CaptureError(f"hetforge's generation modules do not reproduce {name}'s logits: "
                           f"max |Δ| {rel:.2e} of the largest logit on a {t}-token check prompt (allowed {tol:g} "
                           f"at {str(dtype).removeprefix('torch.')}); the architecture does something in its attention "
                           "or after its LM head that the runtime does not implement")
    return rel
