"""One-row linear layers (the GEMVs of a decode step) split across the CPU's threads, with no weight copy.

Why: a decode step multiplies one activation row by every weight matrix, so it is bound by reading the
weights. ATen runs a one-row ``linear``/``addmm`` as a single-threaded GEMV on this kind of host, so one
core streams the weights while the others wait (measured on the 2-core build host: gpt2's LM head
``F.linear`` 8.9 ms; the same product split in two halves on two threads 5.4 ms). ``torch.bmm`` runs
its batch in parallel, so viewing the weight as ``c`` chunks of output features and multiplying all of
them by the same row in one ``bmm`` uses every thread — and it is a *view* of the weight, so no memory
is added:

* ``[N, K]`` weight (``F.linear`` layout), split over outputs: ``x[1, K] @ w.view(c, N/c, K).transpose(1, 2)``
  → ``[c, 1, N/c]``, which read in order is the ``[1, N]`` row (measured 11.0 ms for llama-110m's 84 layer
  GEMVs, vs 12.1 ms for the same split as ``w.view(c, N/c, K) @ x[K, 1]`` and 19.0 ms for ``F.linear``);
* ``[K, N]`` weight (GPT-2 Conv1D / ``addmm`` layout), split over the reduction: ``x.view(c, 1, K/c) @
  w.view(c, K/c, N)`` → ``c`` partial rows ``[c, 1, N]``, summed (a contiguous view of both operands;
  measured 10.3 ms for gpt2's 48 layer GEMVs vs 13.0 ms splitting ``N`` through a permuted view and
  16.2 ms for ``addmm``).

It is used only when there is exactly one row and more than one torch thread (on one thread the split
kernel is slower than plain ``linear``). ``c`` is the smallest divisor of the split dimension (``N``,
or ``K`` for ``[K, N]``) that is at least the thread count (up to 64); without one the plain kernel runs.

Where the native kernels of :mod:`hetforge.kernels.native` are built (a C compiler is on the host), an
fp32 row runs on them instead, on any thread count: each thread streams one contiguous block of the weight
as four streams — 35 GB/s on a 768 MiB weight with 2 threads on the build host against 25-29 GB/s for the
``bmm`` split, and 28 GB/s on one thread against 18 GB/s for ATen's ``mm`` (llama-110m's layer GEMVs). The
``bmm`` split stays as the fallback (no compiler, other float dtypes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetforge.kernels import native

MAX_CHUNKS = 64


def chunks_for(n: int, threads: int | None = None) -> int | None:
    """How many output chunks to split ``n`` features into, or None when the split should not be used."""
    threads = torch.get_num_threads() if threads is None else threads
    if threads < 2:
        return None
    return next((c for c in range(threads, min(MAX_CHUNKS, n) + 1) if n % c == 0), None)


def split_weight(w: torch.Tensor, c: int, weight_t: bool) -> torch.Tensor:
    """The chunked view of ``w``: ``[c, K, N/c]`` (transposed chunks) for ``[N, K]``; ``[c, K/c, N]`` for
    ``[K, N]`` (weight_t)."""
    if weight_t:
        k, n = w.shape
        return w.view(c, k // c, n)
    n, k = w.shape
    return w.view(c, n // c, k).transpose(1, 2)


def split_gemv(x: torch.Tensor, wc: torch.Tensor, weight_t: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x[1, K]`` times the chunked weight ``wc`` (from :func:`split_weight`) as one threaded ``bmm``.

    Returns the ``[1, N]`` row (written into ``out``, a contiguous ``[1, N]`` tensor, when given). The
    executor's codegen (``executor/runtime.py``) emits the same ``bmm`` with views and buffers made once."""
    c = wc.shape[0]
    if weight_t:
        kc = wc.shape[1]
        p = torch.bmm(x.reshape(c, 1, kc), wc)
        return torch.sum(p, 0, out=out) if out is not None else p.sum(0)
    k, m = wc.shape[1], wc.shape[2]
    row = x.reshape(1, 1, k).expand(c, 1, k)
    if out is None:
        return torch.bmm(row, wc).view(1, c * m)
    torch.bmm(row, wc, out=out.view(c, 1, m))
    return out


def usable(x: torch.Tensor, w: torch.Tensor) -> int | None:
    """The chunk count when ``x @ w`` is a one-row product the split kernel should run, else None."""
    if w.dim() != 2 or not w.is_contiguous() or x.device.type != "cpu" or x.numel() != x.shape[-1]:
        return None
    if x.dtype != w.dtype or not x.dtype.is_floating_point:
        return None
    return chunks_for(w.shape[0])  # K for a [K, N] weight (split-K), N for [N, K] (split-N)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, weight_t: bool = False) -> torch.Tensor:
    """``x·Wᵀ + b`` (``x·W + b`` when ``weight_t``). One fp32 row runs on the native kernel
    (:mod:`hetforge.kernels.native`) when it is built, else (several threads) through the split GEMV; otherwise
    ``F.linear``, or for a ``[K, N]`` weight ``addmm`` (2-D input with bias) / ``matmul``."""
    if x.numel() == x.shape[-1] and native.fits(w, bias, weight_t, x.dtype) and native.row_op_fits(x):
        out = torch.empty((*x.shape[:-1], w.shape[1 if weight_t else 0]), dtype=x.dtype)
        return native.gemv(x, w, bias, out, weight_t)
    c = usable(x, w)
    if c is None:
        if not weight_t:
            return F.linear(x, w, bias)
        if x.dim() == 2 and bias is not None:
            return torch.addmm(bias, x, w)
        y = torch.matmul(x, w)
        return y + bias if bias is not None else y
    y = split_gemv(x, split_weight(w, c, weight_t), weight_t)
    if bias is not None:
        y.add_(bias)
    return y.view(*x.shape[:-1], y.shape[-1])
