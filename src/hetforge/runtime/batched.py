"""Batched decoding: one decode program over B rows, each with its own KV cache row, position and stop.

FORGE-UGC's programs are single-batch; these are not. :class:`BatchedDecodeModule` is the decode module
with a batch dimension: ``(input_ids[B, 1], pos[B, 1], k_cache_0 [B, Hkv, S, D], ...) -> (logits[B, V],
k_new_0 [B, Hkv, 1, D], ...)``. Each row masks its own cache positions ``>= pos[b]`` (the mask is built in
the graph from ``pos``, one ``[1, S]`` row per batch row and KV head, which ``hetforge::kv_attention``
broadcasts over the query heads), so rows may sit at different positions. It is captured and compiled like
every program (static shapes: one program per (cache length, batch size)) and runs on the placed path.

:class:`BatchKVCache` holds ``[B, Hkv, S, D]`` buffers. Candidates of one request share their prompt, so the
prompt is prefilled once (the batch-1 prefill program) and its K/V rows are copied into every row of the
cache (:meth:`BatchKVCache.fill_rows`); after that each row is written at its own position
(:meth:`BatchKVCache.write_rows`). :meth:`BatchKVCache.compact` keeps some rows in a smaller cache, so that
when candidates stop early the rest continue in a smaller (cheaper) batch program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetforge.runtime.kvcache import zeros
from hetforge.runtime.static_kv import _AttnContext, _Base, _Switch, cache_mask, model_dims

BATCH_TIERS = (1, 2, 4, 8, 16)  # batch sizes programs are compiled for (rows beyond the live ones are idle)


def batch_tier(n: int) -> int:
    """The smallest batch tier that holds ``n`` rows."""
    return next(b for b in BATCH_TIERS if b >= n)


class BatchedDecodeModule(_Base):
    """``(input_ids[B, 1], pos[B, 1], k_cache_0, v_cache_0, ...) -> (logits[B, V], k/v rows [B, Hkv, 1, D])``;
    caches ``[B, Hkv, S, D]``, row ``b`` attends to its cache positions ``< pos[b]`` and to itself."""

    def forward(self, input_ids: torch.Tensor, pos: torch.Tensor, *cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dtype = cache[0].dtype
        hkv, s = cache[0].shape[1], cache[0].shape[2]
        new_mask = torch.zeros((1, 1), dtype=dtype)

        def rows(window: int | None = None) -> torch.Tensor:
            # kv_attention views q as [B·Hkv, G·T, D]: one [1, S] mask row per (batch row, KV head)
            return cache_mask(s, pos, dtype, window).unsqueeze(1).repeat_interleave(hkv, dim=0)  # [B·Hkv, 1, S]

        pairs = [(cache[2 * i], cache[2 * i + 1]) for i in range(self.layers)]
        ctx = _AttnContext(new_mask=new_mask, cache=pairs, cache_mask=rows(), windowed=lambda w: (rows(w), new_mask))
        with _Switch(self.model, ctx):
            hidden = self._hidden(input_ids, pos)
            logits = self._logits(hidden)[:, 0, :]
            return (logits, *self._kv_outputs(ctx))


@dataclass
class BatchKVCache:
    """``layers`` pairs of ``[batch, kv_heads, length, head_dim]`` buffers."""

    layers: int
    kv_heads: int
    length: int
    head_dim: int
    batch: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        shape = (self.batch, self.kv_heads, self.length, self.head_dim)
        self.buffers: list[torch.Tensor] = [zeros(shape, self.dtype) for _ in range(2 * self.layers)]

    @classmethod
    def for_model(cls, model, length: int, batch: int) -> BatchKVCache:
        layers, kv, hd = model_dims(model)
        return cls(layers, kv, length, hd, batch, model.get_input_embeddings().weight.dtype)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def fill_rows(self, rows: tuple[torch.Tensor, ...] | list[torch.Tensor], start: int = 0) -> None:
        """Copy one sequence's rows ``[1, Hkv, n, D]`` (K/V interleaved) into every batch row at ``start``."""
        n = rows[0].shape[2]
        if start + n > self.length:
            raise ValueError(f"KV cache write {start}..{start + n} past its length {self.length}")
        for buf, row in zip(self.buffers, rows, strict=True):
            buf[:, :, start:start + n].copy_(row.expand(self.batch, -1, -1, -1))

    def write_row(self, b: int, rows: tuple[torch.Tensor, ...] | list[torch.Tensor], start: int = 0) -> None:
        """Copy one sequence's rows ``[1, Hkv, n, D]`` into batch row ``b`` at ``start`` (another prompt per row)."""
        n = rows[0].shape[2]
        if start + n > self.length:
            raise ValueError(f"KV cache write {start}..{start + n} past its length {self.length}")
        for buf, row in zip(self.buffers, rows, strict=True):
            buf[b:b + 1, :, start:start + n].copy_(row)

    def write_rows(self, rows: tuple[torch.Tensor, ...] | list[torch.Tensor], pos: list[int]) -> None:
        """Write batch row ``b`` of each new ``[B, Hkv, 1, D]`` row at position ``pos[b]`` (in place)."""
        if max(pos) >= self.length:
            raise ValueError(f"KV cache write at {max(pos)} past its length {self.length}")
        if all(p == pos[0] for p in pos):  # the common case: rows in lockstep, one copy per buffer
            for buf, row in zip(self.buffers, rows, strict=True):
                buf[:, :, pos[0]:pos[0] + 1].copy_(row)
            return
        for buf, row in zip(self.buffers, rows, strict=True):
            for b, p in enumerate(pos):
                buf[b, :, p:p + 1].copy_(row[b])

    def compact(self, keep: list[int], batch: int) -> BatchKVCache:
        """A new cache of ``batch`` rows whose first ``len(keep)`` rows are rows ``keep`` of this one."""
        out = BatchKVCache(self.layers, self.kv_heads, self.length, self.head_dim, batch, self.dtype)
        idx = torch.tensor(keep, dtype=torch.long)
        for dst, src in zip(out.buffers, self.buffers, strict=True):
            dst[: len(keep)].copy_(src.index_select(0, idx))
        return out
