"""The KV cache's write (``KVCache.write``, ``native.RowsWriter``, ``hf_rows_write``): new rows land where one
``copy_`` per buffer puts them, for any row layout a program hands back (strided views of a fused projection,
partial pieces, bf16), the native writer is kept only for the very tensors it was made for, and a write outside
the buffers is refused before anything is written."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetforge.kernels import native
from hetforge.runtime.kvcache import KVCache


def _require_native() -> None:
    assert native.library() is not None, f"the native kernels did not build here: {native.status().reason}"


def _rows(layers: int, heads: int, n: int, d: int, dtype: torch.dtype, layout: str, seed: int) -> list[torch.Tensor]:
    """2 * layers rows [1, heads, n, d]: dense, or heads-last views of a projection output [1, n, 2 * heads * d]
    (K and V side by side, as a fused projection's transposed views are)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        if layout == "dense":
            out += [torch.randn(1, heads, n, d, generator=g).to(dtype) for _ in range(2)]
        else:
            proj = torch.randn(1, n, 2 * heads * d, generator=g).to(dtype)
            kv = proj.view(1, n, 2, heads, d)
            out += [kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)]
    return out


def _reference(cache: KVCache, rows: list[torch.Tensor], start: int) -> list[torch.Tensor]:
    bufs = [b.clone() for b in cache.buffers]
    for b, r in zip(bufs, rows, strict=True):
        b[:, :, start:start + r.shape[2]].copy_(r)
    return bufs


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 3), heads=st.integers(1, 5), n=st.integers(1, 6), d=st.sampled_from([1, 8, 64, 80]),
       length=st.integers(6, 24), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       layout=st.sampled_from(["dense", "projection"]), seed=st.integers(0, 10_000), data=st.data())
def test_native_write_puts_every_row_where_copy_puts_it(layers, heads, n, d, length, dtype, layout, seed, data):
    _require_native()
    n = min(n, length)
    start = data.draw(st.integers(0, length - n))
    cache = KVCache(layers, heads, length, d, dtype)
    for b in cache.buffers:  # stale rows around the target stay as they are
        b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype))
    rows = _rows(layers, heads, n, d, dtype, layout, seed)
    want = _reference(cache, rows, start)
    calls = []
    real = native.RowsWriter.run
    native.RowsWriter.run = lambda self, pos: calls.append(pos) or real(self, pos)
    try:
        cache.write(rows, start)
    finally:
        native.RowsWriter.run = real
    assert calls == [start]  # the native path ran
    assert (cache._writer is not None) == (n == 1)  # kept for a decode step's rows only
    for got, exp in zip(cache.buffers, want, strict=True):
        assert torch.equal(got, exp)


def test_the_writer_is_kept_for_the_same_tensors_and_reads_their_values_at_each_write():
    _require_native()
    cache = KVCache(2, 3, 10, 16)
    rows = _rows(2, 3, 1, 16, torch.float32, "projection", 0)
    cache.write(rows, 4)
    writer = cache._writer[1]
    for r in rows:  # a program's next call overwrites its outputs in place
        r.mul_(-2.0)
    cache.write(list(rows), 5)  # a new list of the same tensors: the same writer
    assert cache._writer[1] is writer
    for b, r in zip(cache.buffers, rows, strict=True):
        assert torch.equal(b[:, :, 5:6], r) and torch.equal(b[:, :, 4:5], r / -2.0)
    other = _rows(2, 3, 1, 16, torch.float32, "dense", 1)
    cache.write(other, 6)  # other tensors: a writer of their own, their values
    assert cache._writer[1] is not writer
    for b, r in zip(cache.buffers, other, strict=True):
        assert torch.equal(b[:, :, 6:7], r)


def test_a_partial_piece_of_the_rows_is_written_as_its_view():
    _require_native()
    cache = KVCache(1, 2, 12, 8)
    full = _rows(1, 2, 8, 8, torch.float32, "projection", 2)
    piece = [t[:, :, :5] for t in full]  # a chunk's real rows (runtime.engine._prefill_all)
    want = _reference(cache, piece, 3)
    cache.write(piece, 3)
    assert cache._writer is None  # not kept: it would hold the prompt's rows
    for got, exp in zip(cache.buffers, want, strict=True):
        assert torch.equal(got, exp)


def test_rows_of_another_dtype_are_converted_by_copy():
    cache = KVCache(1, 2, 8, 4, torch.bfloat16)
    rows = _rows(1, 2, 1, 4, torch.float32, "dense", 3)
    want = _reference(cache, rows, 2)
    cache.write(rows, 2)
    assert cache._writer is not None and cache._writer[1] is None  # not the native copy: it does not convert
    for got, exp in zip(cache.buffers, want, strict=True):
        assert torch.equal(got, exp)


@pytest.mark.parametrize("start", [-1, 7, 100])
def test_a_write_outside_the_buffers_is_refused_and_writes_nothing(start):
    cache = KVCache(1, 2, 8, 4)
    rows = _rows(1, 2, 2, 4, torch.float32, "dense", 4)
    before = [b.clone() for b in cache.buffers]
    with pytest.raises(ValueError, match="KV cache write"):
        cache.write(rows, start)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.buffers, strict=True))


def test_the_native_writer_itself_refuses_rows_past_its_buffers():
    _require_native()
    bufs = [torch.zeros(1, 2, 8, 4)]
    rows = (torch.ones(1, 2, 3, 4),)
    w = native.RowsWriter(rows, bufs)
    with pytest.raises(ValueError, match="not inside the buffers"):
        w.run(6)
    w.run(5)
    assert torch.equal(bufs[0][:, :, 5:], rows[0]) and not bufs[0][:, :, :5].any()
