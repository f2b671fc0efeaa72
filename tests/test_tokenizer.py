"""Tokenizers: byte-level round trips, out-of-range ids, streaming pieces, the demo model's HF tokenizer."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetforge.errors import UsageError
from hetforge.tokenizers import ByteTokenizer, HFTokenizer, StreamDecoder


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40))
def test_byte_round_trip(text):
    tok = ByteTokenizer(256)
    assert tok.decode(tok.encode(text)) == text


def test_ids_past_the_byte_range_are_shown():
    tok = ByteTokenizer(50257)
    assert tok.decode([72, 105, 300, 33]) == "Hi<300>!"


def test_bytes_outside_a_small_vocabulary_are_refused():
    with pytest.raises(UsageError, match="vocabulary has only 128"):
        ByteTokenizer(128).encode("café")


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=30))
def test_stream_pieces_join_to_the_text(text):
    tok = ByteTokenizer(256)
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in tok.encode(text)] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_stream_holds_back_half_a_character():
    dec = StreamDecoder(ByteTokenizer(256))
    first, second = "é".encode()
    assert dec.push(ord("a")) == "a"
    assert dec.push(first) == ""
    assert dec.push(second) == "é"


def test_demo_tokenizer_round_trips():
    from hetforge.models.zoo import load_model

    loaded = load_model("demo")  # shipped with the package: a missing asset must fail, not skip
    tok = HFTokenizer(loaded.tokenizer)
    text = "The for statement iterates over the items of a sequence.\n    x = [1, 2]"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 2  # BPE merges, not bytes
    assert max(ids) < loaded.vocab_size
