"""The process's malloc policy while hetforge runs programs: freed memory is kept for the next allocation.

A program's graph outputs are fresh tensors on every call (callers may keep them), and a prefill's logits are large
(``[1, 512, 50257]`` fp32 is 103 MB). glibc serves every block above its mmap threshold (at most 32 MiB) with a
fresh ``mmap`` and returns it with ``munmap`` on free, so each call pays a page fault per 4 KiB page of its output
(~25,000 for those logits) before the GEMM can write it. With ``M_MMAP_MAX = 0`` every block comes from the heap,
and with a high ``M_TRIM_THRESHOLD`` the heap keeps what was freed: the next call's output reuses pages that are
already mapped (docs/bench: the prefill page; docs/arch/runtime.md). The cost is that memory freed by the process
stays in it (its peak is unchanged). PyTorch's own huge-page allocation (``THP_MEM_ALLOC_ENABLE``) was measured
too and made short prefills slower (a huge-page fault per reused 2 MiB block), so it is not used.

Applied once per process by :func:`keep_freed_memory` (the executor calls it); ``HETFORGE_MALLOC=default`` leaves
glibc's policy alone. A C library other than glibc (no ``mallopt``) is left alone too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
TRIM_BYTES = 1 << 30  # heap top kept after frees, at most (glibc takes an int)

_state: str | None = None


def _libc() -> ctypes.CDLL | None:
    """The C library (None where it cannot be loaded)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> str:
    """Set the policy once; returns what this process runs with: ``kept`` (set here), ``default`` (turned off by
    ``HETFORGE_MALLOC=default``) or ``unavailable`` (no glibc ``mallopt``)."""
    global _state
    if _state is not None:
        return _state
    if os.environ.get("HETFORGE_MALLOC", "").strip().lower() == "default":
        _state = "default"
        return _state
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        _state = "unavailable"
        return _state
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_BYTES) == 1
    _state = "kept" if ok else "unavailable"
    return _state


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel once (glibc ``malloc_trim(0)``); False where there is no glibc.

    Why: after ``fork()`` every page of the process is copy-on-write until written, also the free ones the heap
    keeps (:func:`keep_freed_memory`); an allocation reusing them pays a write fault per 4 KiB page (and a copy
    while the child lives) where a released page costs one zero-fill. :mod:`hetforge.runtime.ahead` calls this
    before it forks and after the child is gone; the kept-memory policy applies again from the next free on."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
