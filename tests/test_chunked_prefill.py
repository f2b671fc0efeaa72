"""Prefill modes (runtime.programs.prefill_pieces): ``fine`` (one program of about the prompt's length, the
default), ``chunked`` (the largest tier <= n plus chunks over the KV cache, static_kv.ChunkModule) and ``tier``;
greedy tokens equal Hugging Face ``generate`` in every mode for many prompt lengths, a fine length pads by at
most 1/8 and stays within the tier, and the plan of pieces never pads more than the tier would."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_runtime import engine, hf_greedy

from hetforge.errors import UsageError
from hetforge.runtime import Engine, SamplingParams
from hetforge.runtime.programs import CHUNK_MIN, FINE_MIN, FINE_PER_OCTAVE, fine_length, prefill_pieces, tiers_for


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
    pieces = prefill_pieces(n, tiers, mode="chunked")
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


@given(n=st.integers(1, 2048))
@settings(max_examples=300, deadline=None)
def test_a_fine_length_holds_the_prompt_pads_at_most_an_eighth_and_stays_within_the_tier(n):
    tiers = tiers_for(2048)
    length = fine_length(n, tiers)
    assert n <= length <= next(t for t in tiers if t >= n)
    assert length - n < max(FINE_MIN, n / FINE_PER_OCTAVE)
    assert [(p.kind, p.size, p.real) for p in prefill_pieces(n, tiers, mode="fine")] == [("prefill", length, n)]


def test_fine_lengths_are_few_per_octave():
    tiers = tiers_for(4096)
    for lo in (8, 64, 256, 1024):
        got = {fine_length(n, tiers) for n in range(lo + 1, 2 * lo + 1)}
        assert len(got) <= FINE_PER_OCTAVE, (lo, sorted(got))
    assert [fine_length(n, tiers_for(1024)) for n in (1, 8, 16, 84, 500)] == [8, 8, 16, 88, 512]


def test_an_unknown_prefill_mode_is_a_usage_error_naming_the_modes():
    loaded = engine("llama-tiny").loaded
    with pytest.raises(UsageError, match="fine, chunked, tier"):
        Engine(loaded, prefill="exact")
    with pytest.raises(UsageError, match="prefill mode 'exact': allowed fine, chunked, tier"):
        prefill_pieces(84, tiers_for(1024), mode="exact")  # a direct caller too (it used to act as chunked)


def test_an_84_token_prompt_is_64_plus_a_32_chunk_chunked_128_by_tier_and_88_fine():
    pieces = prefill_pieces(84, tiers_for(1024), mode="chunked")
    assert [(p.kind, p.start, p.size, p.real) for p in pieces] == [("prefill", 0, 64, 64), ("chunk", 64, 32, 20)]
    assert [(p.kind, p.size) for p in prefill_pieces(16, tiers_for(1024), mode="chunked")] == [("chunk", 16)]
    assert [(p.kind, p.size) for p in prefill_pieces(84, tiers_for(1024), mode="tier")] == [("prefill", 128)]
    assert [(p.kind, p.size) for p in prefill_pieces(84, tiers_for(1024))] == [("prefill", 88)]


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("n", [1, 5, 16, 33, 47, 84, 150, 290])
def test_every_prefill_mode_gives_hugging_face_greedy_tokens(name, n):
    e = engine(name)
    prompt = [(11 * i + 5) % 250 + 1 for i in range(n)]
    want = hf_greedy(e.loaded, prompt, 6)
    try:
        for mode in ("chunked", "fine", "tier"):
            e.prefill_mode = mode
            r = e.generate(prompt, SamplingParams(max_new_tokens=6))
            assert r.tokens == want, mode
            pieces = [f"{p.kind}-{p.size}" for p in prefill_pieces(n, e.programs.tiers, mode=mode)]
            assert [s.split(" ")[0] for s in r.prefill_pieces] == pieces, mode
    finally:
        e.prefill_mode = "fine"


def test_chunk_programs_are_compiled_once_per_size_and_cache_length():
    e = Engine(engine("llama-tiny").loaded, prefill="chunked")
    prompt = [(3 * i + 1) % 200 + 1 for i in range(84)]
    e.generate(prompt, SamplingParams(max_new_tokens=4))
    r = e.generate(prompt[:90] + [7, 8, 9, 10], SamplingParams(max_new_tokens=4))  # 88 tokens: same pieces
    assert r.compile_s == {} and r.prefill_pieces == ["prefill-64", "chunk-32 (24 real)"]
    assert ("chunk-32", r.cache_length) in e.programs.programs


def test_an_engine_keeps_the_most_recently_used_prefill_programs_only(tmp_path, monkeypatch):
    """Fine prefill makes a program per prompt length: an engine holds at most KEEP_PREFILL of them, drops the least
    recently used, and a dropped length comes back from the compile cache with the same tokens."""
    from hetforge.runtime.programs import KEEP_PREFILL

    monkeypatch.setenv("HETFORGE_COMPILE_CACHE_DIR", str(tmp_path / "cache"))
    e = Engine(engine("gpt2-tiny").loaded)
    first = [(5 * i + 2) % 200 + 1 for i in range(8)]
    want = e.generate(first, SamplingParams(max_new_tokens=3)).tokens
    lengths = [8 * (i + 2) for i in range(KEEP_PREFILL)]  # KEEP_PREFILL more lengths: 16, 24, ...
    for n in lengths:
        e.generate(first + list(range(1, n - 7)), SamplingParams(max_new_tokens=2))
        e.generate(first + list(range(1, 9)), SamplingParams(max_new_tokens=2))  # 16 stays recently used
    held = sorted(n for kind, n in e.programs.programs if kind == "prefill")
    assert len(held) == KEEP_PREFILL and 8 not in held and 16 in held, held
    again = e.generate(first, SamplingParams(max_new_tokens=3))
    assert again.compile_s  # made again (a compile-cache hit on disk), and computes the same
    assert again.tokens == want
