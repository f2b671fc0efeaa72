"""Chunked prefill (runtime.programs.prefill_pieces + static_kv.ChunkModule): a prompt between tiers is the
largest tier <= n plus chunks over the KV cache; greedy tokens equal Hugging Face ``generate`` and the
one-call tier path for many prompt lengths, and the plan of pieces never pads more than the tier would."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_runtime import engine, hf_greedy

from hetforge.runtime import SamplingParams
from hetforge.runtime.programs import CHUNK_MIN, prefill_pieces, tiers_for


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@given(n=st.integers(1, 2048))
@settings(max_examples=300, deadline=None)
def test_pieces_cover_the_prompt_once_and_never_pad_past_the_tier(n):
    tiers = tiers_for(2048)
    pieces = prefill_pieces(n, tiers)
    whole = next(t for t in tiers if t >= n)
    assert pieces[0].start == 0
    assert all(p.kind == "chunk" for p in pieces[1:])
    assert [p.start for p in pieces[1:]] == [p.start + p.size for p in pieces[:-1]]  # consecutive
    assert sum(p.real for p in pieces) == n and all(0 < p.real <= p.size for p in pieces)
    assert all(p.real == p.size for p in pieces[:-1])  # only the last piece is padded
    assert sum(p.size for p in pieces) <= whole  # never more work than the next tier
    assert pieces[-1].size - pieces[-1].real < max(CHUNK_MIN, whole - n + 1)
    if len(pieces) == 1 and pieces[0].kind == "prefill":
        assert pieces[0].size == whole


def test_an_84_token_prompt_is_64_plus_a_32_chunk_not_128():
    pieces = prefill_pieces(84, tiers_for(1024))
    assert [(p.kind, p.start, p.size, p.real) for p in pieces] == [("prefill", 0, 64, 64), ("chunk", 64, 32, 20)]
    assert [(p.kind, p.size) for p in prefill_pieces(16, tiers_for(1024))] == [("chunk", 16)]
    assert [(p.kind, p.size) for p in prefill_pieces(84, tiers_for(1024), chunked=False)] == [("prefill", 128)]


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("n", [1, 5, 16, 33, 47, 84, 150, 290])
def test_chunked_greedy_equals_hugging_face_and_the_tier_path(name, n):
    e = engine(name)
    prompt = [(11 * i + 5) % 250 + 1 for i in range(n)]
    r = e.generate(prompt, SamplingParams(max_new_tokens=6))
    assert r.tokens == hf_greedy(e.loaded, prompt, 6)
    want = [f"{p.kind}-{p.size}" for p in prefill_pieces(n, e.programs.tiers)]
    assert [s.split(" ")[0] for s in r.prefill_pieces] == want
    e.chunked_prefill = False
    try:
        t = e.generate(prompt, SamplingParams(max_new_tokens=6))
    finally:
        e.chunked_prefill = True
    assert t.tokens == r.tokens and len(t.prefill_pieces) == 1 and t.prefill_pieces[0].startswith("prefill-")


def test_chunk_programs_are_compiled_once_per_size_and_cache_length():
    e = engine("llama-tiny")
    prompt = [(3 * i + 1) % 200 + 1 for i in range(84)]
    e.generate(prompt, SamplingParams(max_new_tokens=4))
    r = e.generate(prompt[:90] + [7, 8, 9, 10], SamplingParams(max_new_tokens=4))  # 88 tokens: same pieces
    assert r.compile_s == {} and r.prefill_pieces == ["prefill-64", "chunk-32 (24 real)"]
    assert ("chunk-32", r.cache_length) in e.programs.programs
