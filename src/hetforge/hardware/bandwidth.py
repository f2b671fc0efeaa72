"""The read bandwidth β_read: the one memory-bandwidth definition hetforge measures on a host.

Method (docs/arch/hardware-cost.md#read-bandwidth): ``count`` distinct fp32 buffers of ``buffer_bytes`` each
(8 MiB: about one weight matrix of a small LLM), ``count`` chosen so that they total at least ``factor`` (8)
times the last-level cache read from sysfs — so every read comes from DRAM, as a decode step's weights do —
are read in turn, ``passes`` times, by the kernel hetforge's one-row products read with (``hf_read_stream``:
four streams per thread; ATen's ``sum`` when the native kernels are not built), at the calling torch thread
count. Per buffer the best (shortest) read over the passes is kept; β_read = the pool's bytes ÷ the sum of
those best times. That is the statistic ``bench/costmodel.py`` takes per instruction (the best over runs,
summed over the program) and ``hetforge calibrate`` takes per DRAM-streaming kernel (:func:`pooled_time`).

Why not the best single read: on this VM the same kernel reads one 9.4 MB buffer at 24–31 GB/s depending
on where it lies in memory (docs/bench/read_bandwidth.md); the best read over a rotating pool is the best
buffer, while a decode step reads all its weights, wherever they lie. The best single call over a pool is
what ``hetforge calibrate`` used to take, and it made every one-row product 10–15% faster in the model than
in a program on a loaded host.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from hetforge.kernels.native import llc_bytes

BUFFER_BYTES = 8 * 2**20
FACTOR = 8
PASSES = 10  # the profiled runs bench/costmodel.py takes its per-instruction best over (--runs 10)


@dataclass(frozen=True)
class ReadBandwidth:
    """A measured β_read and how it was measured."""

    bytes_per_s: float
    buffers: int
    buffer_bytes: int
    llc_bytes: int
    passes: int
    threads: int
    kernel: str

    @property
    def method(self) -> str:
        """One line naming every choice of the method (recorded with the figure in the profile)."""
        return (f"read bandwidth (docs/arch/hardware-cost.md#read-bandwidth): {self.buffers} distinct fp32 buffers "
                f"of {self.buffer_bytes / 2**20:.0f} MiB = {self.buffers * self.buffer_bytes / 2**20:.0f} MiB "
                f"(≥ {FACTOR}× the {self.llc_bytes / 2**20:.0f} MiB last-level cache), read in turn by "
                f"{self.kernel} with {self.threads} thread(s), {self.passes} passes; per buffer the best read, "
                f"β = bytes ÷ Σ best times")

    def to_dict(self) -> dict:
        return {**asdict(self), "method": self.method}


def pool_size(buffer_bytes: int = BUFFER_BYTES, factor: int = FACTOR, llc: int | None = None) -> int:
    """Buffers of ``buffer_bytes`` that total at least ``factor`` last-level caches (at least 2)."""
    if buffer_bytes <= 0 or factor <= 0:
        raise ValueError(f"buffer_bytes and factor must be > 0, got {buffer_bytes} and {factor}")
    cap = llc_bytes() if llc is None else llc
    return max(2, -(-factor * cap // buffer_bytes))


def pooled_time(fn: Callable[[], object], count: int, passes: int, clock: Callable[[], float] = time.perf_counter,
                before_pass: Callable[[], object] | None = None) -> float:
    """Mean over a pool of ``count`` buffers of each buffer's best time: ``fn`` reads the next buffer of the
    pool on every call (call ``i`` reads buffer ``i mod count``); it is called ``count·passes`` times after
    one warm-up pass (measured; ``clock`` times each call). ``before_pass`` (untimed) runs before each pass:
    :class:`ReadProbe.read_pass` there measures β_read in the same minute."""
    if count < 1 or passes < 1:
        raise ValueError(f"count and passes must be >= 1, got {count} and {passes}")
    for _ in range(count):
        fn()
    best = [float("inf")] * count
    for _ in range(passes):
        if before_pass is not None:
            before_pass()
        for i in range(count):
            t0 = clock()
            fn()
            best[i] = min(best[i], clock() - t0)
    return sum(best) / count


class ReadProbe:
    """β_read measured pass by pass, so its passes can be interleaved with other work (``bench/costmodel.py``
    reads one pass before each profiled run: the host's bandwidth drifts with other tenants' load, and a
    figure measured a minute earlier can be 10–20% off). Same pool, kernel and statistic as
    :func:`read_bandwidth`: per buffer the best read over the passes so far; the pool is read once on creation
    (warm-up, not counted)."""

    def __init__(self, buffer_bytes: int = BUFFER_BYTES, factor: int = FACTOR,
                 clock: Callable[[], float] = time.perf_counter):
        from hetforge.kernels import native

        self.count = pool_size(buffer_bytes, factor)
        self.n = max(1, buffer_bytes // 4)
        self.bufs = [torch.ones(self.n) for _ in range(self.count)]
        self.lib, self.threads, self.clock = native.library(), torch.get_num_threads(), clock
        self.best = [float("inf")] * self.count
        self.passes = 0
        for b in self.bufs:
            self._read(b)

    def _read(self, b: torch.Tensor) -> object:
        return self.lib.hf_read_stream(b.data_ptr(), self.n, self.threads) if self.lib is not None else b.sum()

    def reset(self) -> None:
        """Forget the passes read so far (a new measurement window on the same pool)."""
        self.best = [float("inf")] * self.count
        self.passes = 0

    def read_pass(self) -> None:
        """Read every buffer once, keeping each buffer's best time (measured)."""
        for i, b in enumerate(self.bufs):
            t0 = self.clock()
            self._read(b)
            self.best[i] = min(self.best[i], self.clock() - t0)
        self.passes += 1

    def result(self) -> ReadBandwidth:
        """β_read over the passes read so far (at least one)."""
        if self.passes < 1:
            raise ValueError("ReadProbe.result needs at least one read_pass")
        per_buffer = sum(self.best) / self.count
        return ReadBandwidth(bytes_per_s=self.n * 4 / per_buffer, buffers=self.count, buffer_bytes=self.n * 4,
                             llc_bytes=llc_bytes(), passes=self.passes, threads=self.threads,
                             kernel="hf_read_stream (native, 4 streams per thread)" if self.lib is not None
                             else "torch.sum")


def read_bandwidth(passes: int = PASSES, buffer_bytes: int = BUFFER_BYTES, factor: int = FACTOR,
                   clock: Callable[[], float] = time.perf_counter) -> ReadBandwidth:
    """Measure β_read as the module docstring defines it, at the current torch thread count (measured)."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    probe = ReadProbe(buffer_bytes, factor, clock)
    for _ in range(passes):
        probe.read_pass()
    return probe.result()
