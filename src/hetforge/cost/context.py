"""Cache context: what an op costs *inside a program*, after the ops before it ran on the same device.

:func:`~hetforge.cost.estimate` costs an op as calibration measured it: warm, in a tight loop of the same
op, with cold operands. Inside a program two things differ, and both depend on the ops that ran before
(measured on the 2-core build host; the numbers below are from that CPU):

* **fixed costs are larger.** An op's fixed part (dispatch + its fitted overhead) runs the framework's and the
  kernel's own code; between two calls of the same op other ops run, so that code is partly out of the
  L1/L2 caches: in a cycle of distinct tiny ops each costs ``s_warm`` ≈ 1.9× its tight-loop time. After
  an op that streamed about a last-level cache of data (a GEMM's weights), the code is in DRAM: each op
  whose code was evicted since it last ran costs another ``s_cold·c`` of its fixed part, and the op right
  after a long one pays ``p_first·min(1, t_prev/τ)`` more (~50 µs after a 5 ms GEMM here: the interpreter's
  own state is gone too, through the long op's streams and code and, on a shared host, the other processes
  that ran meanwhile). ``c = min(1, S/2C)`` where ``S`` is the bytes streamed since the same op last ran and
  ``C`` the last-level cache (``DeviceProfile.cache_bytes``): calibration flushes with ``2C`` and the
  factor grows about linearly with ``S`` up to there (measured here: 0.08 of it after 2 MB, 0.25 after
  16 MB, 0.64 after 32 MB); ``t_prev`` is the previous op's modeled time;
* **recently touched data is in the cache.** An input whose storage was read or written within the last
  ``C`` streamed bytes is *hot*: its bytes cost ``efficiency['cache-hit']`` of a DRAM byte (passed to
  :func:`~hetforge.cost.estimate` as ``hot_bytes``).

* **a long op loses the caches** (``efficiency['seq:evict']`` = ``p``, ``overhead_s['seq:evict-tau']`` = ``τ_e``,
  both optional): an op of modeled time ``t`` counts as ``p·C·min(1, t/τ_e)`` more streamed bytes for data
  hotness, applied after its own inputs and outputs are marked — so after a product of a few milliseconds
  the data it read and wrote, and everything before it, is cold even when its bytes were far below ``C``.
  Measured here: an add's inputs touched before a 0.4–1.5 ms product stayed cached (1–5% lost), before a
  6.7–14 ms one they were as cold as after a flush (97–98% lost): on a shared host a long op is preempted and
  other processes use its caches. Under this term a view (an instruction that moves no bytes) does not mark
  its storage as touched. A profile without ``seq:evict`` keeps the bytes-only rule.

``s_warm`` is applied by :func:`~hetforge.cost.estimate` itself (``efficiency['seq:warm']``); this module adds
the terms that need the order of ops. ``s_cold`` (``efficiency['seq:cold']``), ``p_first`` and ``τ``
(``overhead_s['seq:first']``, ``overhead_s['seq:first-tau']``) and ``cache-hit`` are fitted by
``hetforge calibrate``; a profile without
them, or without ``cache_bytes``, gets no context terms. "Streamed bytes" are the modeled bytes ``B`` of
each op (for a GEMM: weights + activations).
"""

from __future__ import annotations

from dataclasses import replace

from hetforge.cost.model import OpCost
from hetforge.hardware.profile import DeviceProfile

FLUSH_CACHES = 2  # the code of an op is fully evicted after this many last-level caches streamed (as calibrated)


class CacheContext:
    """The running state of one device's program: bytes streamed so far, and when each storage and each op's
    code were last touched (in streamed bytes)."""

    def __init__(self, device: DeviceProfile):
        self.device = device
        self.cap = float(device.cache_bytes)
        self.s_cold = device.efficiency.get("seq:cold", 0.0) if self.cap > 0 else 0.0
        self.p_first = device.overhead_s.get("seq:first", 0.0) if self.cap > 0 else 0.0
        self.tau = device.overhead_s.get("seq:first-tau", 0.0)
        self.evict = device.efficiency.get("seq:evict", 0.0) if self.cap > 0 else 0.0
        self.evict_tau = device.overhead_s.get("seq:evict-tau", 0.0)
        self.lost = 0.0  # data-cache bytes lost by long ops since the last touch (not yet applied)
        self.data_clock = 0.0  # streamed bytes plus the bytes long ops lost: the clock data hotness is read on
        self.streamed = 0.0
        self.code: dict[str, float] = {}
        self.data: dict[object, float] = {}
        self.prev_time = 0.0

    @property
    def active(self) -> bool:
        return self.cap > 0

    def hot(self, key: object) -> bool:
        """True when the storage ``key`` was touched within the last ``cache_bytes`` streamed bytes."""
        last = self.data.get(key)
        return self.cap > 0 and last is not None and self.data_clock - last < self.cap

    def touch(self, keys, moved: bool = True) -> None:
        """Mark the storages ``keys`` as just touched (the instruction that ran read or wrote them); then apply
        what a long instruction lost: its inputs and outputs too are cold afterwards. With the lost-cache term
        (``seq:evict``), an instruction that moved no bytes (``moved=False``: a view) touches nothing: a view
        of a GEMM's output does not bring it back into the cache."""
        if moved or self.evict <= 0:
            for k in keys:
                self.data[k] = self.data_clock
        self.data_clock += self.lost
        self.lost = 0.0

    def run(self, op: str, cost: OpCost) -> OpCost:
        """``cost`` (of ``op``, from :func:`~hetforge.cost.estimate`) with the cold-code terms added; advances
        the state past it."""
        if cost.time_s <= 0 and cost.fixed_s <= 0:  # nothing runs (an elided view)
            return cost
        extra = 0.0
        if self.cap > 0 and (self.s_cold or self.p_first):
            last = self.code.get(op)
            c = 1.0 if last is None else min(1.0, (self.streamed - last) / (FLUSH_CACHES * self.cap))
            first = min(1.0, self.prev_time / self.tau) if self.tau > 0 else 0.0
            extra = self.s_cold * cost.fixed_s * c + self.p_first * first
        self.streamed += cost.bytes
        self.data_clock += cost.bytes
        if self.evict > 0 and self.evict_tau > 0:  # a long op loses the data caches (applied at the next touch)
            self.lost += self.evict * self.cap * min(1.0, cost.time_s / self.evict_tau)
        self.code[op] = self.streamed
        self.prev_time = cost.time_s + extra
        if extra <= 0:
            return cost
        scale = (cost.time_s + extra) / cost.time_s if cost.time_s > 0 else 1.0
        return replace(cost, time_s=cost.time_s + extra, energy_j=cost.energy_j * scale)

    def run_all(self, parts: list[tuple[str, OpCost]]) -> OpCost:
        """The result of :func:`~hetforge.cost.estimate_parts` run in order through the context, as one cost."""
        if len(parts) == 1:
            return self.run(*parts[0])
        done = [self.run(op, c) for op, c in parts[1:]]
        main = max(done, key=lambda c: c.time_s)
        return replace(parts[0][1], time_s=sum(c.time_s for c in done), energy_j=sum(c.energy_j for c in done),
                       bound=main.bound, fixed_s=sum(c.fixed_s for c in done))
