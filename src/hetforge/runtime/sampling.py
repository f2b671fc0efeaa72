"""Sampling on the CPU: greedy, temperature, top-k, top-p, repetition penalty; seeded per request.

The logits go through Hugging Face's own logits processors, in Hugging Face's order: repetition penalty
(divide positive / multiply negative logits of seen tokens), then temperature, top-k, top-p (keep the smallest
set whose probability reaches ``top_p``, always at least one token); then one draw from a ``torch.Generator``
owned by the request.

A greedy pick that no processor changes reads the row through numpy, on the calling thread. Why: ATen splits an
element-wise loop or a reduction over more than ``at::internal::GRAIN_SIZE`` (32,768) elements across its OpenMP
team (``ATen/native/cpu/Loops.h``, ``Reduce.h``), and a vocabulary such as GPT-2's 50,257 is larger; the team's
workers then took a core from the native decode kernels' own pool in the next step (``OMP_WAIT_POLICY=PASSIVE``,
which puts them to sleep at once, gave the same speed-up; measured: docs/arch/runtime.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hetforge.errors import HetforgeError, UsageError


def argmax(x: torch.Tensor) -> int:
    """``torch.argmax`` of a 1-D CPU row (the first maximum; a NaN counts as the largest), computed by numpy on the
    calling thread (see the module docstring); bf16 is widened exactly (its bits are an fp32's upper half)."""
    x = x.detach()
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64) \
            or not x.is_contiguous():
        return int(torch.argmax(x))
    if x.dtype == torch.bfloat16:
        return int(np.argmax((x.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)))
    return int(np.argmax(x.numpy()))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise UsageError(f"--max-new-tokens must be at least 1 (got {self.max_new_tokens})")
        if not self.temperature >= 0:  # also rejects NaN
            raise UsageError(f"--temperature must be >= 0 (got {self.temperature}); 0 means greedy")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0 (got {self.top_k}); 0 turns it off")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if not self.repetition_penalty > 0:
            raise UsageError(f"--repetition-penalty must be > 0 (got {self.repetition_penalty}); 1 turns it off")
        if any(s == "" for s in self.stop):
            raise UsageError("--stop strings must not be empty")
        if not -(2**63) <= self.seed < 2**64:  # what torch.Generator.manual_seed accepts
            raise UsageError(f"--seed must be in -2**63..2**64-1 (got {self.seed})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Sampler:
    """Picks tokens for one request; owns its random generator so a seed reproduces the request."""

    params: SamplingParams
    vocab_size: int
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(self.params.seed)
        self._seen = torch.zeros(self.vocab_size, dtype=torch.bool)

    def observe(self, ids: list[int] | int) -> None:
        """Record tokens (prompt and generated) for the repetition penalty."""
        if self.params.repetition_penalty != 1.0:
            idx = torch.as_tensor(ids if isinstance(ids, list) else [ids], dtype=torch.long)
            self._seen[idx[(idx >= 0) & (idx < self.vocab_size)]] = True

    def _penalizes(self) -> bool:
        """Whether the repetition penalty changes any logit now (a penalty, and a token seen)."""
        return self.params.repetition_penalty != 1.0 and bool(self._seen.any())

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed 1-D float logits (penalty, temperature, top-k, top-p); -inf marks removed tokens."""
        p = self.params
        x = logits.reshape(-1)[: self.vocab_size].float()
        steps = []
        if self._penalizes():
            steps.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
        if not p.greedy:
            steps.append(TemperatureLogitsWarper(p.temperature))
            if 0 < p.top_k < x.numel():
                steps.append(TopKLogitsWarper(p.top_k))
            if p.top_p < 1.0:
                steps.append(TopPLogitsWarper(p.top_p))
        if not steps:
            return x
        seen = self._seen.nonzero().reshape(1, -1)
        return LogitsProcessorList(steps)(seen, x.unsqueeze(0)).reshape(-1)

    def pick(self, logits: torch.Tensor) -> int:
        """The next token id."""
        p = self.params
        if p.greedy and not self._penalizes():
            return argmax(logits.reshape(-1)[: self.vocab_size])  # no processor would change the logits
        x = self.process(logits)
        if p.greedy:
            return int(torch.argmax(x))
        probs = torch.softmax(x, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            return self._non_finite(logits, x)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _non_finite(self, logits: torch.Tensor, x: torch.Tensor) -> int:
        """Softmax overflowed: NaN logits are the model's fault (an error); +inf logits come from a tiny
        temperature, whose limit is greedy decoding among the largest values."""
        if bool(torch.isnan(logits.reshape(-1)[: self.vocab_size]).any()):
            raise HetforgeError("the model produced NaN logits, so no token can be sampled (are its weights "
                                "finite? try the same prompt with --temperature 0 to see whether it runs at all)")
        saved = self.params
        self.params = replace(saved, temperature=1.0)  # same order of tokens, no overflow
        try:
            y = self.process(logits)
        finally:
            self.params = saved
        return int(torch.argmax(y.masked_fill(x == float("-inf"), float("-inf"))))
