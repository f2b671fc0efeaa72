"""Static-shape prefill and decode modules around a Hugging Face causal LM.

Both are plain ``nn.Module`` s that ``torch.export`` captures at one static shape:

* :class:`PrefillModule` — ``(input_ids[1, T], last[1]) -> (logits[1, V], k_0, v_0, ..., k_L-1, v_L-1)``.
  The prompt is right-padded to the tier length ``T``; under the causal mask a real token never sees a
  pad token after it, so the real rows are exact. ``last`` selects the row whose logits are returned
  (only one row goes through the LM head). The K/V rows of all ``T`` positions are returned.
* :class:`DecodeModule` — ``(input_ids[1, 1], pos[1, 1], k_cache_0, v_cache_0, ...) -> (logits[1, V],
  k_new_0, v_new_0, ...)``. Each cache is ``[1, kv_heads, S, head_dim]`` (``S`` static); cache positions
  ``>= pos`` are masked.

Neither graph writes the cache: it returns the new K/V rows and the CPU runtime copies them into the
preallocated cache in place (``runtime.kvcache``). Why: an in-place cache write survives
``torch.export``'s training IR as ``index_copy_``, but ``run_decompositions()`` (core ATen, what other
backends consume) turns it into a functional ``index_put`` that builds a whole new cache each step — a
full cache copy per token — and a side-effecting graph is harder for every pass, placement and memory
plan to reason about. Returning rows keeps the graphs pure (see docs/arch/runtime.md).

The attention is plugged into the HF model through transformers' ``AttentionInterface`` under the name
``hetforge_kv``: the model computes q/k/v (with its own rotary / biases / scaling) and calls us. In
decode we call ``hetforge::kv_attention`` (ops/fused.py), so each layer's attention is one graph node: it
attends over the cache and the new rows as two score blocks joined before one softmax, so the cache is
only read, never concatenated or repeated, and grouped-query heads are handled by viewing q as
``[kv_heads, groups * T]`` rows instead of repeating K/V. Prefill writes the same math out in ATen ops,
which the attention pass fuses into ``hetforge::attention``.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import hetforge.ops  # noqa: F401  (registers hetforge::kv_attention)
from hetforge.errors import CaptureError
from hetforge.ops.fused import kv_attention_aten

ATTN_NAME = "hetforge_kv"
_state = threading.local()


@dataclass
class _AttnContext:
    """What one forward call of a wrapper passes to the attention function of every layer."""

    new_mask: torch.Tensor  # additive [T, T] causal mask over the new rows
    cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    cache_mask: torch.Tensor | None = None  # additive [1, S] over cache positions
    new_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # (cache_mask, new_mask) for a layer that sees only the last ``window`` positions (a sliding window); None: this
    # module cannot mask one, so such a layer is refused when its window is shorter than what it attends over
    windowed: Callable[[int], tuple[torch.Tensor | None, torch.Tensor]] | None = None
    _windows: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)

    def masks(self, window: int | None, span: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(cache_mask, new_mask) for a layer with this sliding ``window`` over ``span`` positions (the cache and
        the new rows): the plain masks when there is no window or it holds the whole span (a query then sees every
        position before it either way), else the windowed ones, made once per window for all its layers."""
        if window is None or window >= span:
            return self.cache_mask, self.new_mask
        if self.windowed is None:
            raise CaptureError(f"sliding-window attention (window {window} < {span} positions) is not supported "
                               "by this hetforge runtime module")
        if window not in self._windows:
            self._windows[window] = self.windowed(window)
        return self._windows[window]


def band_mask(t: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[t, t]`` mask of causal attention over the last ``window`` positions: row ``i`` sees the rows
    ``j`` with ``i - window < j <= i`` (Hugging Face's sliding window)."""
    i, j = torch.arange(t).unsqueeze(1), torch.arange(t).unsqueeze(0)
    return torch.zeros((t, t), dtype=dtype).masked_fill(~((j <= i) & (j > i - window)), float("-inf"))


def cache_mask(s: int, pos: torch.Tensor, dtype: torch.dtype, window: int | None = None,
               at: torch.Tensor | None = None) -> torch.Tensor:
    """Additive mask over ``s`` cache positions: the positions ``< pos`` (``[B, 1]``) are written, and with a
    sliding ``window`` a new row at position ``at`` (``[R, 1]``; default ``pos``: one new row) sees only those
    ``> at - window`` (the row itself is the window's last position). ``[B or R, S]``, built in the graph."""
    ar = torch.arange(s, dtype=torch.long).unsqueeze(0)
    keep = ar < pos
    if window is not None:
        keep = keep & (ar > (pos if at is None else at) - window)
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))


def _softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's attention-logit soft cap, as Hugging Face applies it (before the mask): ``tanh(s / c) · c``
    (a decode step's: :func:`hetforge.ops.fused.kv_attention_aten`)."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


_UNSUPPORTED_KWARGS = ("s_aux", "sinks")  # attention sinks (gpt-oss): a term these masks and softmaxes do not have


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
               sliding_window: int | None = None, softcap: float | None = None,
               **kwargs) -> tuple[torch.Tensor, None]:
    """Attention over (read-only cache) + (new rows). Shapes: q [B, H, T, D], k/v [B, Hkv, T, D].

    ``sliding_window``: the layer sees its last ``window`` positions (Mistral, Gemma 2's local layers): masked in
    the graph (:meth:`_AttnContext.masks`); the cache still holds every position. ``softcap``: Gemma 2's
    ``tanh(s / c) · c`` on the scores before the mask, written out in ATen ops (no fused kernel has it)."""
    ctx: _AttnContext | None = getattr(_state, "ctx", None)
    if ctx is None:
        raise RuntimeError("hetforge_kv attention called outside a hetforge runtime module")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise CaptureError(f"attention with '{name}' (attention sinks, {type(module).__name__}) is not supported "
                               "by the hetforge runtime")
    layer = module.layer_idx
    span = key.shape[2] + (ctx.cache[layer][0].shape[2] if ctx.cache is not None else 0)
    cache_mask_, new_mask_ = ctx.masks(sliding_window, span)
    ctx.new_kv[layer] = (key, value)
    b, h, t, d = query.shape
    hkv = key.shape[1]
    g = h // hkv
    scale = d**-0.5 if scaling is None else scaling
    if ctx.cache is None:  # prefill: plain attention over the new rows (the attention pass fuses it)
        qg = query.reshape(b, hkv, g * t, d)  # head = kv_head * g + i, row = i * t + position
        s_new = _softcapped(torch.matmul(qg, key.transpose(-1, -2)) * scale, softcap) + new_mask_.repeat(g, 1)
        out = torch.matmul(torch.softmax(s_new, dim=-1), value)
    else:  # decode: one hetforge::kv_attention node per layer (ops/fused.py); a soft cap written out in ATen ops
        kc, vc = ctx.cache[layer]
        new_mask = new_mask_ if t > 1 else None  # one new row sees itself: nothing to mask
        if softcap is None:
            out = torch.ops.hetforge.kv_attention(query, key, value, kc, vc, cache_mask_, new_mask, scale)
        else:
            out = kv_attention_aten(query, key, value, kc, vc, cache_mask_, new_mask, scale, softcap)
    out = out.reshape(b, h, t, value.shape[-1]).transpose(1, 2)
    return out, None


def register_attention() -> None:
    """Register ``hetforge_kv`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)


class _Switch:
    """Run the HF model with our attention and context, restoring its attention implementation."""

    def __init__(self, model: nn.Module, ctx: _AttnContext):
        self.model, self.ctx = model, ctx

    def __enter__(self):
        register_attention()
        self.saved = self.model.config._attn_implementation
        self.model.config._attn_implementation = ATTN_NAME
        _state.ctx = self.ctx
        return self.ctx

    def __exit__(self, *exc):
        _state.ctx = None
        self.model.config._attn_implementation = self.saved
        return False


def _causal(t: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((t, t), float("-inf"), dtype=dtype).triu(1)


def model_dims(model: nn.Module) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a HF causal LM config."""
    c = model.config
    layers = int(getattr(c, "num_hidden_layers", None) or c.n_layer)
    heads = int(getattr(c, "num_attention_heads", None) or c.n_head)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    hidden = int(getattr(c, "hidden_size", None) or c.n_embd)
    head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
    return layers, kv, head_dim


def head_transform(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What ``model``'s causal-LM ``forward`` applies to the LM head's output, as a function of the logits."""
    c, source = model.config, _forward_source(model)
    cap = getattr(c, "final_logit_softcapping", None)
    div = getattr(c, "logits_scaling", None) if "logits_scaling" in source else None
    mul = getattr(model, "logit_scale", None) if "self.logit_scale" in source else None

    def apply(logits: torch.Tensor) -> torch.Tensor:
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if div is not None:
            logits = logits / div
        if mul is not None:
            logits = logits * mul
        return logits

    return apply


def _forward_source(model: nn.Module) -> str:
    """The source of the model class's ``forward`` (what it does to the logits is read from it), or ""."""
    return _class_forward_source(type(model))


@functools.cache
def _class_forward_source(cls: type) -> str:  # read once per class, not in every module's trace
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


class _Base(nn.Module):
    LAYER_INPUTS = 2  # inputs per layer, the last among the inputs: its K and V cache (runtime.stamp reads this)

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @property
    def layers(self) -> int:
        """The model's layer count, read from its config at each call (``runtime.stamp`` cuts the model to two)."""
        return model_dims(self.model)[0]

    def _hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        base = self.model.base_model
        out = base(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return out.last_hidden_state

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on ``hidden`` and what the model's own ``forward`` does to its logits after it (Gemma 2 / 3's
        final soft cap, Granite's division by ``logits_scaling``, Cohere's ``logit_scale``), in the same ops."""
        logits = self.model.get_output_embeddings()(hidden)
        return head_transform(self.model)(logits)

    def _kv_outputs(self, ctx: _AttnContext) -> list[torch.Tensor]:
        outs: list[torch.Tensor] = []
        for i in range(self.layers):
            if i not in ctx.new_kv:
                raise CaptureError(f"{type(self.model).__name__}'s attention (layer {i}) does not go through "
                                   "transformers' attention interface, where the hetforge runtime puts its KV-cache "
                                   "attention: this architecture is not supported for generation")
            k, v = ctx.new_kv[i]
            outs += [k, v]
        return outs


class PrefillModule(_Base):
    """``(input_ids[1, T], last[1]) -> (logits[1, V], k/v rows [1, Hkv, T, D] per layer)``."""

    LAYER_INPUTS = 0

    def forward(self, input_ids: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = input_ids.shape[1]
        dtype = self.model.get_input_embeddings().weight.dtype
        ctx = _AttnContext(new_mask=_causal(t, dtype), windowed=lambda w: (None, band_mask(t, w, dtype)))
        with _Switch(self.model, ctx):
            pos = torch.arange(t, dtype=torch.long).unsqueeze(0)
            hidden = self._hidden(input_ids, pos)
            row = hidden.index_select(1, last)
            logits = self._logits(row)[:, 0, :]
            return (logits, *self._kv_outputs(ctx))


class DecodeModule(_Base):
    """``(input_ids[1, 1], pos[1, 1], k_cache_0, v_cache_0, ...) -> (logits[1, V], k/v rows [1, Hkv, 1, D])``."""

    def forward(self, input_ids: torch.Tensor, pos: torch.Tensor, *cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dtype = cache[0].dtype
        s = cache[0].shape[2]
        new_mask = torch.zeros((1, 1), dtype=dtype)
        pairs = [(cache[2 * i], cache[2 * i + 1]) for i in range(self.layers)]
        ctx = _AttnContext(new_mask=new_mask, cache=pairs, cache_mask=cache_mask(s, pos, dtype),  # [1, S]
                           windowed=lambda w: (cache_mask(s, pos, dtype, w), new_mask))
        with _Switch(self.model, ctx):
            hidden = self._hidden(input_ids, pos)
            logits = self._logits(hidden)[:, 0, :]
            return (logits, *self._kv_outputs(ctx))


class ChunkModule(_Base):
    """``(input_ids[1, C], pos[1, C], last[1], k_cache_0, v_cache_0, ...) -> (logits[1, V], k/v rows [1, Hkv, C, D])``.

    Chunked prefill: ``C`` prompt tokens at positions ``pos`` (consecutive, starting at ``pos[0, 0]``) attend to
    the cache positions ``< pos[0, 0]`` (written by the earlier pieces of the prompt) and causally to each other,
    through the same ``hetforge::kv_attention`` node as decode (with a ``[C, C]`` causal mask). A short last
    chunk is right-padded: a real row never sees a pad row after it, and only the real rows are written to the
    cache. ``last`` selects the row whose logits are returned (one row through the LM head, as in prefill).
    """

    def forward(self, input_ids: torch.Tensor, pos: torch.Tensor, last: torch.Tensor,
                *cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dtype = cache[0].dtype
        s, c = cache[0].shape[2], input_ids.shape[1]
        pairs = [(cache[2 * i], cache[2 * i + 1]) for i in range(self.layers)]

        ctx = _AttnContext(new_mask=_causal(c, dtype), cache=pairs,
                           cache_mask=cache_mask(s, pos[:, :1], dtype),  # [1, S]: the earlier pieces
                           # row r (at pos[0, r]) sees its last w positions: a [C, S] cache mask and a band
                           windowed=lambda w: (cache_mask(s, pos[:, :1], dtype, w, at=pos.reshape(c, 1)),
                                               band_mask(c, w, dtype)))
        with _Switch(self.model, ctx):
            hidden = self._hidden(input_ids, pos)
            row = hidden.index_select(1, last)
            logits = self._logits(row)[:, 0, :]
            return (logits, *self._kv_outputs(ctx))
