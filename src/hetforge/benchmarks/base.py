"""What the peer benchmark's parts share: the system record, what ``prepare`` gets and returns, and the
one-line error form. Below :mod:`~hetforge.benchmarks.systems`, :mod:`~hetforge.benchmarks.hetforge_system`
and :mod:`~hetforge.benchmarks.worker`, so none of them imports another in a circle."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from hetforge.models.zoo import LoadedModel

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DecodeTiming:
    """Time to first token and steady decode time per token, both measured (ms)."""

    ttft_ms: float
    decode_ms_per_token: float
    new_tokens: int
    prep_s: float = 0.0  # one-time preparation of the decode path (e.g. hetforge's runtime programs)


@dataclass
class PrepContext:
    """What a system's ``prepare`` gets."""

    loaded: LoadedModel
    module: nn.Module  # (input_ids, attention_mask) -> logits, no cache
    prefill_inputs: tuple[torch.Tensor, torch.Tensor]
    step_inputs: tuple[torch.Tensor, torch.Tensor]
    workdir: Path
    cache_dir: Path
    threads: int = 2


@dataclass
class Prepared:
    """A ready-to-run system: its forward, how long each preparation stage took, and extras."""

    forward: Forward
    stages: dict[str, float] = field(default_factory=dict)  # stage name -> seconds (measured)
    step_forward: Forward | None = None  # one-token forward when it differs from ``forward``
    decode: Callable[[tuple[torch.Tensor, torch.Tensor], int], DecodeTiming] | None = None
    label: str | None = None  # overrides the system's label (e.g. says which hetforge stages ran)
    notes: list[str] = field(default_factory=list)
    precision: str = "f32"


@dataclass(frozen=True)
class System:
    """One row family of the benchmark."""

    key: str
    label: str
    prepare: Callable[[PrepContext], Prepared]
    requires: tuple[str, ...] = ()  # importable modules it needs
    has_cache: bool = False  # a warm (cached) preparation is measured in a second, fresh process
    is_hetforge: bool = False
    max_model_note: str = ""
    install: str = "pip install -e .[peers]"  # how to get what ``requires`` names


def first_line(err: BaseException | str) -> str:
    """The first non-empty line of an error, prefixed with its type, at most 240 characters."""
    if isinstance(err, BaseException):
        text = str(err)
        line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
        line = f"{type(err).__name__}: {line}" if line else type(err).__name__
    else:
        line = next((ln.strip() for ln in err.splitlines() if ln.strip()), "")
    return line[:240]


def is_f32(precision: str | None) -> bool:
    """Whether a row's recorded precision is fp32 (an empty one is: systems that do not report it run fp32)."""
    return (precision or "").lower() in ("f32", "float32", "fp32", "")


def is_bf16(precision: str | None) -> bool:
    """Whether a row's recorded precision is bf16 (OpenVINO reports its hint as "bfloat16")."""
    return (precision or "").lower() in ("bf16", "bfloat16")


# hetforge's quantized systems and the llama.cpp row each decodes against (decode only), with the target's key
QUANT_DECODE_PAIRS: dict[str, tuple[str, str]] = {
    "hetforge-w8": ("llamacpp-q8", "w8_decode_at_or_below_llamacpp_q8"),
    "hetforge-w4": ("llamacpp-q4", "w4_decode_at_or_below_llamacpp_q4"),
}
