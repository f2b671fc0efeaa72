"""The KV cache: per-layer K/V buffers preallocated once, written in place by the CPU runtime.

The cache lives outside every compiled program (it is a graph *input*, never an activation), so it is
not part of any activation arena. A decode step's program returns the new K/V rows and
:meth:`KVCache.write` copies them into position ``pos``: no allocation. Where the native kernels load, all rows go
in one native call (``native.RowsWriter``, kept while the program hands back the same output tensors, as a
decode program bound as a step does); else with one ``Tensor.copy_`` per buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetforge.kernels import native


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor, zeroed by one thread (a memset through a byte view): ``torch.zeros`` fills a cache
    buffer in a parallel region, and with the other core busy each such region waits for a scheduler slice
    (tens of regions per model, measured up to ~0.2 s in all before a warm compile-cache hit's first token)."""
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).numpy().fill(0)
    return t


@dataclass
class KVCache:
    """``layers`` pairs of ``[1, kv_heads, length, head_dim]`` buffers."""

    layers: int
    kv_heads: int
    length: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        shape = (1, self.kv_heads, self.length, self.head_dim)
        self.buffers: list[torch.Tensor] = [zeros(shape, self.dtype) for _ in range(2 * self.layers)]
        self._writer: tuple[tuple[torch.Tensor, ...], native.RowsWriter | None] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held by all K and V buffers."""
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def data_ptrs(self) -> list[int]:
        return [b.data_ptr() for b in self.buffers]

    def write(self, rows: tuple[torch.Tensor, ...] | list[torch.Tensor], start: int) -> None:
        """Copy new rows (``[1, kv_heads, n, head_dim]`` per buffer, K/V interleaved) to positions ``start:start+n``."""
        n = rows[0].shape[2]
        if start + n > self.length:
            raise ValueError(f"KV cache write {start}..{start + n} past its length {self.length}")
        if start < 0:
            raise ValueError(f"KV cache write at {start}: positions start at 0")
        w = self._writer
        if w is None or len(w[0]) != len(rows) or any(a is not b for a, b in zip(w[0], rows, strict=True)):
            rows = tuple(rows)
            w = (rows, native.RowsWriter(rows, self.buffers) if native.RowsWriter.fits(rows, self.buffers) else None)
            if n == 1:  # a decode step's rows: the next step hands back the same tensors (a prompt's never do, and
                self._writer = w  # keeping their writer would hold the prompt's rows)
        if w[1] is not None:
            w[1].run(start)
            return
        for buf, row in zip(self.buffers, rows, strict=True):
            buf[:, :, start:start + n].copy_(row)

    def clear(self) -> None:
        for b in self.buffers:
            b.zero_()
