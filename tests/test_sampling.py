"""CPU sampling: each processor agrees with Hugging Face's, draws are seeded and follow the distribution."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hetforge.errors import UsageError
from hetforge.runtime.sampling import Sampler, SamplingParams


def _hf_process(logits: torch.Tensor, seen: list[int], p: SamplingParams) -> torch.Tensor:
    ids = torch.tensor([seen], dtype=torch.long)
    x = logits[None].clone()
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    return x[0]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    temperature=st.floats(0.2, 2.0),
    top_k=st.integers(0, 40),
    top_p=st.floats(0.05, 1.0),
    penalty=st.sampled_from([1.0, 1.3, 0.8]),
)
def test_processing_matches_hugging_face(seed, temperature, top_k, top_p, penalty):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(64, generator=g) * 3
    seen = torch.randint(0, 64, (10,), generator=g).tolist()
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty)
    s = Sampler(p, 64)
    s.observe(seen)
    ours = s.process(logits)
    ref = _hf_process(logits, seen, p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = ~torch.isinf(ref)
    torch.testing.assert_close(ours[finite], ref[finite], rtol=1e-5, atol=1e-5)


def test_greedy_is_argmax_and_penalty_changes_it():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams(), 4).pick(logits) == 1
    s = Sampler(SamplingParams(repetition_penalty=1.5), 4)
    s.observe([1])
    assert s.pick(logits) == 2  # 3.0 / 1.5 = 2.0 < 2.9


def test_seeded_draws_reproduce_and_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    p = SamplingParams(temperature=1.0, seed=7)
    a = Sampler(p, 4)
    draws = [a.pick(logits) for _ in range(4000)]
    b = Sampler(p, 4)
    assert draws[:200] == [b.pick(logits) for _ in range(200)]
    other = Sampler(SamplingParams(temperature=1.0, seed=8), 4)
    assert draws[:200] != [other.pick(logits) for _ in range(200)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_top_k_one_and_tiny_top_p_are_greedy():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(50, generator=g)
        want = int(logits.argmax())
        assert Sampler(SamplingParams(temperature=1.5, top_k=1, seed=1), 50).pick(logits) == want
        assert Sampler(SamplingParams(temperature=1.5, top_p=1e-6, seed=1), 50).pick(logits) == want


@pytest.mark.parametrize("kw, msg", [
    ({"max_new_tokens": 0}, "max-new-tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top-p"),
    ({"top_p": 1.01}, "top-p"),
    ({"top_k": -1}, "top-k"),
    ({"repetition_penalty": 0.0}, "repetition-penalty"),
    ({"stop": ("",)}, "stop"),
])
def test_bad_parameters_are_usage_errors(kw, msg):
    with pytest.raises(UsageError, match=msg):
        SamplingParams(**kw)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       special=st.sampled_from(["none", "ties", "nan", "all -inf", "+inf"]))
def test_numpy_argmax_equals_torch_argmax(seed, dtype, special):
    """The greedy pick's numpy argmax (no ATen OpenMP region) gives torch.argmax's index: the first maximum, a NaN
    counting as the largest, bf16 widened exactly; a 50,257-entry row, above ATen's grain."""
    from hetforge.runtime.sampling import argmax

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(50257, generator=g) * 4).to(dtype)
    at = torch.randint(0, 50257, (3,), generator=g)
    if special == "ties":
        x[at] = x.max()
    elif special == "nan":
        x[at] = float("nan")
    elif special == "all -inf":
        x[:] = float("-inf")
    elif special == "+inf":
        x[at] = float("inf")
    assert argmax(x) == int(torch.argmax(x))


def test_greedy_pick_reads_a_large_row_without_an_aten_reduction(monkeypatch):
    """Greedy with no processor picks through numpy (torch.argmax never called) and gives the same token; with a
    repetition penalty on a seen token it still runs the processors."""
    x = torch.randn(50257, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    want = int(torch.argmax(x.float()))
    calls = []
    real = torch.argmax
    monkeypatch.setattr(torch, "argmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert Sampler(SamplingParams(), 50257).pick(x) == want and calls == []
    s = Sampler(SamplingParams(repetition_penalty=1.5), 50257)
    s.observe([want])
    s.pick(x)
    assert calls == [1]
