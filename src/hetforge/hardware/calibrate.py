"""``hetforge calibrate``: measure this host and write its ``host`` profile.

Micro-benchmarks (each timed as the best of several runs after a warm-up, on the wall clock or, with
``clock="thread"``, the calling thread's CPU time — the minimum, as STREAM reports, because load from other
processes only adds time):

* GEMM throughput per dtype — ``2·M·N·K / t`` for square fp32 and bf16 ``torch.mm`` at several sizes, int8 via
  ``torch._int_mm`` and ``aten._weight_int8pack_mm`` (best of both); the peak is the best size. The fp32 peak's
  source also names the FMA units' ceiling (:func:`hetforge.kernels.native.fma_peak`: register-only FMAs on every
  thread) and the share of it the peak reached, so a GEMM bound can be read against the hardware.
* memory bandwidth — the profile's ``mem_bandwidth`` is the read bandwidth β_read, measured by the one
  documented method of :mod:`hetforge.hardware.bandwidth` (distinct buffers totalling ≥ 8× the last-level
  cache, read in turn as the GEMVs read, per buffer the best of the passes). Copy (``b.copy_(a)``, ``2·n·s``
  bytes) and triad (``a = b + α·c``, ``3·n·s``) are still measured and named in its source, for reference.
* dispatch overhead — one ``aten.add`` on one-element tensors.
* efficiency factors and fixed overheads — representative ops of each cost group (matmul, attention,
  elementwise, transcendental — also per function —, softmax, norm, reduction, gather, movement, view,
  control, creation) at LLM-like shapes; per key, ``m ≈ dispatch + o + r / e`` is fitted by least squares on
  the error relative to the whole measured time ``m`` (:func:`fit_group`), where ``r`` is the plain-roofline
  time at the measured π and β. ``e > 1`` means the ops beat the DRAM roof. Keys: the cost group (matmul and
  attention per roof class, ``group:compute``/``group:memory``), the GEMM row band (``matmul:rows<8``,
  ``matmul:rows<64``, ``matmul:rows>=64``), op names (``aten.tanh.default`` …, ``aten.cat.default`` with a
  wide and a rotary ``rotate_half`` concatenation, ``aten.copy_.default`` for the executor's copy into an
  arena slice) and op variants (``aten.gelu.default:tanh``). Operands are cold: each call takes the next of
  several copies totalling 8× the last-level cache, as in a real graph run where every weight streams from
  DRAM once per pass and evicts the caches; elementwise ops write into a cold slice too (``out=``, as the arena
  executor runs them). A memory-bound benchmark whose copies are at least 1 MiB (a DRAM stream: one-row
  products, native row kernels, large elementwise ops) is timed with β_read's statistic
  (:func:`~hetforge.hardware.bandwidth.pooled_time`: per copy the best of the passes, averaged over the pool),
  not the best single call: the best call over a pool is the copy that happens to lie in the fastest memory.
* in-program terms (:mod:`hetforge.cost.context`) — ``cache-hit``: the cost of a cache-resident input byte
  relative to a DRAM byte (an add with hot inputs against the same add with cold ones, :func:`_cache_hit`);
  ``seq:warm``/``seq:cold``: how much larger the fixed cost of an op is in a cycle of distinct tiny ops than in
  a tight loop, without and with a flush of twice the last-level cache before each cycle (:func:`_sequence`);
  ``seq:first`` and ``seq:first-tau``: the extra time of the first op after a long one, ``p·min(1, t_prev/τ)``,
  from a ``view`` timed right after GEMMs of 2–20 ms (:func:`_first_after`); ``matmul:per-row``: the cost per
  weight row of a one-row product (:func:`fit_rows`). The profile also records the last-level cache size
  (``cache_bytes``, from sysfs).

Power cannot be measured here (no RAPL/NVML readable): TDP and idle power stay labelled estimates.
"""

from __future__ import annotations

import datetime as _dt
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import psutil
import torch
import torch.nn.functional as F

from hetforge.hardware.bandwidth import PASSES, ReadBandwidth, ReadProbe, pooled_time
from hetforge.hardware.host import POWER_SRC, TDP_PER_CORE_W, cpu_count, cpu_name
from hetforge.hardware.profile import row_band
from hetforge.hardware.schema import DeviceSpec, Figure, PositiveFigure, SocSpec
from hetforge.kernels import native, onednn
from hetforge.kernels.native import llc_bytes

Progress = Callable[[str], None]
EFF_MIN, EFF_MAX = 0.01, 100.0
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}
_clock: list[Callable[[], float]] = [time.perf_counter]  # the clock in use (set by measure)
_probe: list[ReadProbe | None] = [None]  # β_read read beside each DRAM-stream benchmark (set by _measure)
_beta: list[float] = [0.0]  # calibration's β_read, the figure those benchmarks are reported at
_cold_cap = [100_000]  # most copies _cold makes (quick mode: 64, so small tensors stay partly cached)


@dataclass
class Measured:
    """Raw calibration results (rates in FLOP/s or B/s, times in s)."""

    gemm: dict[str, dict[int, float]]
    bw_copy: float
    bw_triad: float
    dispatch_s: float
    efficiency: dict[str, float]
    samples: dict[str, list[tuple[float, float]]]  # key -> [(roofline s, measured s)]
    seconds: float
    threads: int = 1
    overhead_s: dict[str, float] = field(default_factory=dict)
    clock: str = "wall"
    bw_read: float = 0.0  # β_read (hetforge.hardware.bandwidth): the profile's mem_bandwidth
    read: ReadBandwidth | None = None  # how β_read was measured (method, buffers, passes, threads)
    fma_flops: float = 0.0  # the FMA units' ceiling (native.fma_peak, FLOP/s; 0: not measured)


def _best_time(fn: Callable[[], object], min_reps: int, budget_s: float,
               flush: Callable[[], object] | None = None) -> float:
    """Best (minimum) wall time of ``fn`` over at least ``min_reps`` runs within ``budget_s``, after a warm-up.

    The minimum, as STREAM reports, because a shared host's load only ever adds time. ``flush`` (not timed)
    runs before every timed call, to measure with cold caches.
    """
    fn()  # warm-up
    times = []
    t_end = time.perf_counter() + budget_s
    clock = _clock[0]
    while len(times) < min_reps or (time.perf_counter() < t_end and len(times) < 200):
        if flush is not None:
            flush()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def _once(fn: Callable[[], object]) -> float:
    t0 = _clock[0]()
    fn()
    return _clock[0]() - t0


def _gemm_fns(dtype: str, n: int) -> list[Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    if dtype == "int8":
        a = torch.randint(-100, 100, (n, n), dtype=torch.int8, generator=g)
        b = torch.randint(-100, 100, (n, n), dtype=torch.int8, generator=g)
        x = torch.randn(n, n, generator=g)
        s = torch.rand(n, generator=g)
        fns = []
        for fn in (lambda: torch._int_mm(a, b), lambda: torch.ops.aten._weight_int8pack_mm(x, a, s)):
            try:
                fn()
            except (RuntimeError, AttributeError):
                continue
            fns.append(fn)
        return fns
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a = torch.randn(n, n, generator=g).to(dt)
    b = torch.randn(n, n, generator=g).to(dt)
    return [lambda: torch.mm(a, b), *onednn.gemm_fns(a, b)]  # the bound is the fastest kernel's, not ATen's


def _gemm(dtype: str, n: int, budget: float) -> float:
    """Best ``2·n³ / t`` over the kernels for ``dtype``; kernels slower than the budget per call are skipped."""
    best = 0.0
    for fn in _gemm_fns(dtype, n):
        if _once(fn) > budget:  # a slow fallback kernel (e.g. reference int8): one run is enough
            best = max(best, 2 * n ** 3 / _once(fn))
            continue
        best = max(best, 2 * n ** 3 / _best_time(fn, 3, budget))
    return best


def _bandwidth(n_bytes: int, budget: float) -> tuple[float, float]:
    n = n_bytes // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    t_copy = _best_time(lambda: a.copy_(b), 3, budget)
    t_triad = _best_time(lambda: torch.add(b, c, alpha=1.5, out=a), 3, budget)
    return 2 * n * 4 / t_copy, 3 * n * 4 / t_triad


def _dispatch(budget: float) -> float:
    x, y = torch.ones(1), torch.ones(1)
    add = torch.ops.aten.add.Tensor
    return _best_time(lambda: add(x, y), 50, budget)


# (keys, make_fn, FLOPs, bytes, weight rows in memory order — GEMMs only, else 0)
Bench = tuple[tuple[str, ...], Callable[[], Callable[[], object]], float, float, int]


COLD_FACTOR = 8  # cold pools span this many last-level caches
STREAM_COPY_BYTES = 2**20  # a memory-bound benchmark whose pool copies are this large is a DRAM stream
_pools: list[tuple[int, int]] = []  # (copies, bytes per copy) of the pools made since the last clear


def _pool_count(size: int) -> int:
    """How many copies of ``size`` bytes make a cold pool (≥ 8× the last-level cache, at least 2)."""
    return max(2, min(_cold_cap[0], -(-COLD_FACTOR * llc_bytes() // max(1, size))))


def _cold(*ts: torch.Tensor) -> Callable[[], tuple[torch.Tensor, ...]]:
    """Copies of ``ts`` totalling ≥ 8× the last-level cache, handed out in turn, so each call reads cold data.

    In a real graph run every weight streams from DRAM once per pass and evicts the caches; a
    micro-benchmark that reuses one tensor would measure it cache-hot. With a pool of only 2× the LLC the
    best of many calls still found part of its data cached (elementwise ops beat the DRAM roof by ~1.6×,
    while the same ops inside a graph run at it); 8× removes that.
    """
    size = sum(t.numel() * t.element_size() for t in ts)
    k = _pool_count(size)
    _pools.append((k, size))
    pool = [ts] + [tuple(t.clone() for t in ts) for _ in range(k - 1)]
    state = [0]

    def nxt() -> tuple[torch.Tensor, ...]:
        state[0] = (state[0] + 1) % k
        return pool[state[0]]

    return nxt


def _streamed(n: int, k: int) -> Callable[[], torch.Tensor]:
    """``[n, k]`` weights handed out as consecutive slices of one buffer of ≥ 8× the last-level cache, so each
    call reads cold data that *continues* the previous call's stream — as a decode step reads a model's
    weights, which the model allocated in the order the step uses them. (A pool of scattered copies, as
    :func:`_cold` gives, makes every small one-row product pay a stream start-up that it does not pay in a
    program: 100 µs vs 80 µs for a 768×768 one-row product on the build host, 1 thread.)"""
    count = max(2, -(-COLD_FACTOR * llc_bytes() // (n * k * 4)))
    _pools.append((count, n * k * 4))
    buf = _rn(count * n, k)
    state = [0]

    def nxt() -> torch.Tensor:
        state[0] = (state[0] + 1) % count
        return buf[state[0] * n:(state[0] + 1) * n]

    return nxt


def _native_row(n: int, k: int, weight_t: bool) -> Callable[[], object] | None:
    """A one-row product as the executor runs it on the native GEMV (a ctypes call on raw pointers, no Python
    wrapper: the wrapper's ~20 µs would otherwise be fitted as the GEMV's overhead), weights streamed as by
    :func:`_streamed`; None when the native kernels are not built."""
    lib = native.library()
    if lib is None:
        return None
    rows, cols = (k, n) if weight_t else (n, k)
    count = max(2, -(-COLD_FACTOR * llc_bytes() // (n * k * 4)))
    _pools.append((count, n * k * 4))
    buf = _rn(count * rows, cols)
    ptrs = [buf[i * rows:(i + 1) * rows].data_ptr() for i in range(count)]
    x, y, bias = _rn(k), torch.empty(n), _rn(n)
    part = torch.empty(native.split_k_slots(), n)
    state, nt = [0], torch.get_num_threads
    keep = buf  # the raw pointers above point into it: it must live as long as the closure

    def run() -> object:
        assert keep.numel()
        state[0] = (state[0] + 1) % count
        if weight_t:
            return lib.hf_gemv_kn(ptrs[state[0]], x.data_ptr(), bias.data_ptr(), y.data_ptr(), n, k, nt(),
                                  part.data_ptr(), part.shape[0])
        return lib.hf_gemv_nk(ptrs[state[0]], x.data_ptr(), None, y.data_ptr(), n, k, nt())

    return run


def _rn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def _linear_kernel() -> Callable[..., torch.Tensor]:
    """The linear hetforge runs: ``hetforge.ops.gemv.linear`` (a one-row product on the native GEMV, or split
    over the threads without it; plain ``F.linear`` otherwise), or ``F.linear`` where that module is absent."""
    try:
        from hetforge.ops.gemv import linear
    except ImportError:
        return F.linear
    return linear


def _packed_product(m: int, n: int, k: int, bias: bool) -> Callable[[], object] | None:
    """A multi-row product on the packed kernel the executor runs it on (:mod:`hetforge.executor.onednn`): oneDNN's,
    MKL's or the native panel GEMM, whichever :func:`hetforge.kernels.onednn.pick` takes for this ``(m, K, N)`` here;
    None where the executor keeps ATen's. Cold: each call takes the next of several packed copies totalling ≥ 8×
    the last-level cache. (Calibrating ATen's ``linear`` while the executor runs oneDNN's made every prefill
    product ~1.4× slower in the model than measured.)"""
    kind = onednn.pick(m, k, n, torch.float32)
    if kind == "aten":
        return None
    x, b = _rn(m, k), (_rn(n) if bias else None)
    count = _pool_count(n * k * 4)
    _pools.append((count, n * k * 4))

    def packed(w: torch.Tensor) -> Callable[[torch.Tensor], object]:  # one weight at a time: no second pool
        pk = onednn.pack(w, False, m, kind)
        if kind == "onednn":
            return onednn.linear_fn(pk, b)
        if kind == "panel":
            return lambda x: native.gemm_panel(x, pk, b, n)
        ori = torch.zeros(1).expand(n, k)  # MKL reads its sizes
        return lambda x: onednn.mkl_linear(x, pk, ori, b, m)

    fns = [packed(_rn(n, k) + i) for i in range(count)]
    state = [0]

    def run() -> object:
        state[0] = (state[0] + 1) % len(fns)
        return fns[state[0]](x)

    return run


def _mk_linear(m: int, n: int, k: int = 768, aten: bool = False) -> Callable[[], object]:
    """``x[m, k] · W[n, k]ᵀ`` (``F.linear`` layout: ``n`` weight rows of ``k``); one-row products read their
    weights as a continued stream (:func:`_streamed`), others from scattered cold copies, on the kernel the
    executor picks (:func:`_packed_product`) or, with ``aten``, on ATen's ``linear`` whatever it picks."""
    x, lin = _rn(m, k), _linear_kernel()
    if m == 1:
        fn = _native_row(n, k, False)
        if fn is not None:
            return fn
        nxt1 = _streamed(n, k)
        return lambda: lin(x, nxt1())
    packed = None if aten else _packed_product(m, n, k, bias=False)
    if packed is not None:
        return packed
    nxt = _cold(_rn(n, k))
    return lambda: lin(x, nxt()[0])


def _mk_addmm(m: int, n: int, k: int) -> Callable[[], object]:
    """``b + x[m, k] · W[k, n]`` (GPT-2 ``Conv1D`` layout: ``k`` weight rows of ``n``), through the linear
    hetforge runs (:func:`_linear_kernel` with ``weight_t``: the native GEMV for one row) or ``addmm``."""
    x, b, lin = _rn(m, k), _rn(n), _linear_kernel()
    fn = _native_row(n, k, True) if m == 1 else _packed_product(m, n, k, bias=True)
    if fn is not None:
        return fn
    nxt = _streamed(k, n) if m == 1 else (lambda pool: lambda: pool()[0])(_cold(_rn(k, n)))
    if lin is F.linear:
        return lambda: torch.addmm(b, x, nxt())
    return lambda: lin(x, nxt(), b, weight_t=True)


def _mk_strided_copy(h: int, L: int, d: int) -> Callable[[], object]:
    """``slice.copy_(src.transpose(1, 2))``: a just-computed (hot) ``[1, h, L, d]`` head-major result copied,
    heads interleaved, into a cold ``[1, L, h, d]`` slice — the executor's copy of a ``transpose`` view that
    lowering gave its own storage (the attention output going back to ``[L, h·d]``)."""
    src, nxt = _rn(1, h, L, d), _cold(torch.empty(1, L, h, d))
    return lambda: nxt()[0].copy_(src.transpose(1, 2))


def _mk_sdpa(L: int, S: int) -> Callable[[], object]:
    """SDPA with an additive float mask: the fused CPU kernel alone (a boolean mask, as Hugging Face passes it,
    is first turned into a float mask by ``where`` ops, which the cost model costs on their own)."""
    nxt = _cold(_rn(1, 12, L, 64), _rn(1, 12, S, 64), _rn(1, 12, S, 64))
    mask = torch.zeros(1, 1, L, S).masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(S - L), float("-inf"))
    return lambda: F.scaled_dot_product_attention(*nxt(), mask)


def _mk_apply(fn: Callable, *shapes: tuple[int, ...]) -> Callable[[], object]:
    nxt = _cold(*(_rn(*s) for s in shapes))
    return lambda: fn(*nxt())


def _mk_binary_out(fn: Callable, n: int) -> Callable[[], object]:
    """``fn(a, b, out=o)`` with cold inputs *and* a cold output slice, as the arena executor runs it."""
    nxt = _cold(_rn(n), _rn(n) + 1, torch.empty(n))

    def run() -> object:
        a, b, o = nxt()
        return fn(a, b, out=o)

    return run


def _mk_copy(n: int) -> Callable[[], object]:
    """``slice.copy_(result)``: a just-computed (cache-hot) result copied into a cold arena slice."""
    src, nxt = _rn(n), _cold(torch.empty(n))
    return lambda: nxt()[0].copy_(src)


def _mk_rotate_half_cat(n: int) -> Callable[[], object]:
    """``cat((-x2, x1), -1)`` as rotary embeddings run it: ``x1``/``x2`` the halves of the head dim of a
    ``[1, 12, L, 64]`` view of a ``[1, L, 768]`` activation (strided), ``-x2`` contiguous; ``n = 768·L``."""
    L = max(1, n // 768)
    nxt = _cold(_rn(1, L, 768), _rn(1, 12, L, 32))

    def run() -> object:
        a, neg = nxt()
        q = a.view(1, L, 12, 64).transpose(1, 2)
        return torch.cat((neg, q[..., :32]), -1)

    return run


def _mk_embedding(m: int) -> Callable[[], object]:
    idx, nxt = torch.randint(0, 8192, (1, m)), _cold(_rn(8192, 768))
    return lambda: F.embedding(idx, nxt()[0])


UNARY = {"aten.tanh.default": torch.tanh, "aten.silu.default": F.silu, "aten.gelu.default": F.gelu,
         "aten.gelu.default:tanh": partial(F.gelu, approximate="tanh"),
         "aten.rsqrt.default": torch.rsqrt, "aten.sin.default": torch.sin, "aten.cos.default": torch.cos,
         "aten.exp.default": torch.exp, "aten.pow.Tensor_Scalar": lambda a: torch.pow(a, 3.0)}
def _native_specs(quick: bool) -> list[tuple[str, tuple, dict]]:
    """(hetforge op, argument shapes/values, options) of the native-kernel benchmarks: two shapes per op, so
    each op's key gets its own efficiency and overhead (one point would fit only an overhead); empty when the
    native kernels are not built here. ``quick`` does not shorten the list (the kernels take microseconds)."""
    if native.library() is None:
        return []
    return [
        ("rms_norm", ((1, 1, 768), (768,)), {}), ("rms_norm", ((1, 128, 768), (768,)), {}),
        ("layer_norm", ((1, 1, 768), (768,), (768,)), {}), ("layer_norm", ((1, 128, 768), (768,), (768,)), {}),
        ("rotary", ((1, 12, 1, 64),), {}), ("rotary", ((1, 32, 1, 128),), {}),
        ("kv_attention", (128,), {}), ("kv_attention", (512,), {}),
        ("attention", (128,), {}), ("attention", (512,), {}),  # prefill, as the graphs carry it: bool causal mask
        ("linear_act", ((1, 1, 768), (3072, 768)), {"act": "none"}),  # the activation: _native_act_costs
        ("linear_act", ((1, 1, 3072), (3072, 768)), {"act": "none"}),
        ("gated_mlp", ((1, 1, 768), (2048, 768), (2048, 768), (768, 2048)), {}),
        ("gated_mlp", ((1, 1, 512), (1024, 512), (1024, 512), (512, 1024)), {}),
        ("linear_w8", ((1, 1, 768), (3072, 768)), {}), ("linear_w8", ((1, 1, 768), (768, 768)), {}),
    ]


def _native_bench(op: str, shapes: tuple, opts: dict) -> Bench:
    """One native kernel called as the executor calls it (ctypes, raw pointers, result into a slice), cold
    operands; F and B from the op's registered formulas, as the cost model computes them."""
    from hetforge.ops.registry import OpCall, TensorMeta, lookup

    lib, nt = native.library(), torch.get_num_threads
    meta = lambda *ss: tuple(TensorMeta(tuple(sh), torch.float32) for sh in ss)  # noqa: E731
    if op == "kv_attention":
        s = shapes[0]
        q, kv, cache, mask = (1, 12, 1, 64), (1, 12, 1, 64), (1, 12, s, 64), (1, s)
        args = (*meta(q, kv, kv, cache, cache, mask), None, 0.125)
        out = meta(q)
        scratch = torch.empty(12, s + 1)

        def make() -> Callable[[], object]:
            nxt = _cold(_rn(*q), _rn(*kv), _rn(*kv), _rn(*cache), _rn(*cache), torch.zeros(mask), torch.empty(q))

            def run() -> object:
                t = [a.data_ptr() for a in nxt()]
                return lib.hf_decode_attention(*t[:6], None, t[6], scratch.data_ptr(), 12, 12, s, 64, 0.125, nt())

            return run
    elif op == "attention":  # prefill: q/k/v transposed views of a fused qkv output, bool causal mask [1, 1, s, s]
        s = shapes[0]
        hd = (1, 12, s, 64)
        args = (*meta(hd, hd, hd), TensorMeta((1, 1, s, s), torch.bool), 0.125, False)
        out = meta(hd)
        mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None]

        def make() -> Callable[[], object]:
            nxt = _cold(_rn(1, s, 3 * 768), torch.empty(hd))

            def run() -> object:
                x, y = nxt()
                q, k, v = (x[..., i * 768:(i + 1) * 768].view(1, s, 12, 64).transpose(1, 2) for i in range(3))
                return native.prefill_attention_into(q, k, v, mask, y.data_ptr(), 0.125, False)

            return run
    elif op in ("rms_norm", "layer_norm", "rotary"):
        x = shapes[0]
        d, rows = x[-1], math.prod(x) // x[-1]
        extra = [(d,)] * (len(shapes) - 1) if op != "rotary" else [(1, 1, 1, d), (1, 1, 1, d)]
        args = (*meta(x, *extra), 1e-5) if op == "rms_norm" else \
            ((meta(x)[0], [d], *meta(*extra), 1e-5) if op == "layer_norm" else meta(x, *extra))
        out = meta(x)

        def make() -> Callable[[], object]:
            nxt = _cold(_rn(*x), *(_rn(*e) for e in extra), torch.empty(x))

            def run() -> object:
                t = [a.data_ptr() for a in nxt()]
                if op == "rms_norm":
                    return lib.hf_rms_norm(t[0], t[1], t[2], rows, d, 1e-5, nt())
                if op == "layer_norm":
                    return lib.hf_layer_norm(t[0], t[1], t[2], t[3], rows, d, 1e-5, nt())
                return lib.hf_rotary(t[0], t[1], t[2], t[3], rows, d, nt())

            return run
    elif op == "linear_act":
        x, w = shapes
        wt = w[0] == x[-1]  # [K, N]
        n = w[1] if wt else w[0]
        args = (*meta(x, w), None, opts["act"], wt)
        out = meta((1, 1, n))
        part = torch.empty(native.split_k_slots(), n)

        def make() -> Callable[[], object]:
            xx, y, nxt = _rn(*x), torch.empty(n), _cold(_rn(*w))
            return lambda: lib.hf_linear_act(nxt()[0].data_ptr(), xx.data_ptr(), None, y.data_ptr(), n, x[-1],
                                             int(wt), native.ACT_CODES[opts["act"]], nt(), part.data_ptr(),
                                             part.shape[0])
    elif op == "linear_w8":
        x, w = shapes
        n, k = w
        args = (meta(x)[0], TensorMeta(tuple(w), torch.int8), meta((n,))[0], None, "none")
        out = meta((1, 1, n))

        def make() -> Callable[[], object]:
            xx, y, sc = _rn(*x), torch.empty(n), torch.rand(n)
            nxt = _cold(torch.randint(-127, 128, tuple(w), dtype=torch.int8))
            return lambda: lib.hf_gemv_q8(nxt()[0].data_ptr(), sc.data_ptr(), xx.data_ptr(), None, y.data_ptr(), n, k,
                                          0, nt())
    else:  # gated_mlp
        x, wg, wu, wd = shapes
        args = (*meta(x, wg, wu, wd), None, None, None, "silu")
        out = meta(x)

        def make() -> Callable[[], object]:
            xx, h, y, nxt = _rn(*x), torch.empty(wg[0]), torch.empty(x), _cold(_rn(*wg), _rn(*wu), _rn(*wd))

            def run() -> object:
                g, u, dn = nxt()
                return lib.hf_gated_mlp(xx.data_ptr(), g.data_ptr(), u.data_ptr(), dn.data_ptr(), h.data_ptr(),
                                        y.data_ptr(), wg[0], x[-1], native.ACT_CODES["silu"], nt())

            return run
    name = f"hetforge.{op}.default"
    info = lookup(name)
    call = OpCall(name, args, {}, out)
    return (("native", f"native:{name}"), make, float(info.flops(call)), float(info.nbytes(call)), 0)


def _group_benchmarks(quick: bool) -> list[Bench]:
    """(keys, make_fn, FLOPs, bytes) for representative ops; FLOPs/bytes use the same formulas as aten_costs.

    ``make_fn()`` allocates the operands (cold copies, see :func:`_cold`) and returns the function to time,
    so only one benchmark's tensors are alive at a time. ``keys`` are the efficiency/overhead keys the sample
    is fitted under: a cost group (matmul and attention get ``:compute``/``:memory`` appended), and more
    specific keys — the GEMM row band (``matmul:rows<8`` …), an op name (``aten.tanh.default``) or an op
    variant (``aten.gelu.default:tanh``).
    """
    out: list[Bench] = []

    def mm(m: int, n: int, k: int, make, rows: int) -> Bench:
        return (("matmul", f"matmul:{row_band(m)}"), make, 2.0 * m * n * k, 4.0 * (m * k + n * k + m * n), rows)

    for n in [768, 3072] if quick else [768, 3072, 8192, 32000]:
        for m in [1, 32] if quick else [1, 16, 128]:
            out.append(mm(m, n, 768, partial(_mk_linear, m, n), n))
            if m > 1:  # the same product on ATen's linear, for the shapes where the executor keeps it
                band = row_band(m)
                out.append((("aten:matmul", f"aten:matmul:{band}"), partial(_mk_linear, m, n, 768, True),
                            2.0 * m * n * 768, 4.0 * (m * 768 + n * 768 + m * n), 0))
    # one-row products whose weight rows are longer or in the other layout: separates the per-row cost
    out.append(mm(1, 768, 3072, partial(_mk_linear, 1, 768, 3072), 768))
    out.append(mm(1, 3072, 768, partial(_mk_addmm, 1, 3072, 768), 768))
    out.append(mm(1, 768, 3072, partial(_mk_addmm, 1, 768, 3072), 3072))
    for L, S in ([(16, 16), (1, 32)] if quick else [(128, 128), (32, 32), (1, 128), (1, 16)]):
        out.append((("attention",), partial(_mk_sdpa, L, S), 12.0 * L * S * (2 * 64 + 2 * 64 + 5),
                    4.0 * (2 * 12 * L * 64 + 2 * 12 * S * 64 + L * S), 0))
    for n in ([768, 128 * 768] if quick else [768, 16 * 768, 128 * 768, 128 * 3072]):
        r = max(1, n // 768)
        for fn2 in (torch.add, torch.mul):
            out.append((("elementwise",), partial(_mk_binary_out, fn2, n), float(n), 12.0 * n, 0))
        out.append((("aten.copy_.default",), partial(_mk_copy, n), float(n), 8.0 * n, 0))
        for name, fn1 in UNARY.items():
            keys = ("transcendental", name) if ":" not in name else (name,)
            out.append((keys, partial(_mk_apply, fn1, (n,)), 4.0 * n, 8.0 * n, 0))
        rowwise = [(("softmax",), partial(torch.softmax, dim=-1), 5.0 * n, 8.0 * n),
                   (("norm",), partial(F.layer_norm, normalized_shape=(768,)), 8.0 * n, 8.0 * n + 8 * 768),
                   (("reduction",), partial(torch.mean, dim=-1, keepdim=True), float(n), 4.0 * n + 4 * r),
                   (("movement", "aten.cat.default"), lambda t: torch.cat([t, t], -1), 0.0, 16.0 * n)]
        for keys, fnr, fl, by in rowwise:
            out.append((keys, partial(_mk_apply, fnr, (r, 768)), fl, by, 0))
        out.append((("aten.cat.default",), partial(_mk_rotate_half_cat, n), 0.0, 8.0 * n, 0))
    for h, L, d in ([(12, 32, 64)] if quick else [(12, 32, 64), (12, 256, 64), (24, 128, 32)]):
        n = h * L * d  # head shapes of the in-sample models (12 × 64) or none (24 × 32); never 16 heads
        out.append((("aten.copy_.default:strided",), partial(_mk_strided_copy, h, L, d), float(n), 8.0 * n, 0))
    for m in [1, 128] if quick else [1, 16, 128]:
        out.append((("gather",), partial(_mk_embedding, m), 0.0, 8.0 * m + 2 * 4.0 * m * 768, 0))
    x = _rn(1, 128, 768)
    aten = torch.ops.aten
    tiny = [("view", lambda: aten.view.default(x, [128, 768])),
            ("view", lambda: aten.reshape.default(x, [1, 128, 12, 64])),
            ("view", lambda: aten.transpose.int(x, 1, 2)), ("view", lambda: aten.split.Tensor(x, 256, 2)),
            ("view", lambda: aten.unsqueeze.default(x, 1)), ("view", lambda: aten.expand.default(x, [2, 128, 768])),
            ("control", lambda: aten._assert_tensor_metadata.default(x, dtype=torch.float32)),
            ("control", lambda: aten.to.device(x, torch.device("cpu"), torch.float32))]
    for key, fn in tiny:
        out.append(((key,), partial(lambda f: f, fn), 0.0, 0.0, 0))
    out.append((("creation",), partial(lambda: (lambda: aten.arange.default(128))), 0.0, 128 * 8.0, 0))
    out += [_native_bench(*spec) for spec in _native_specs(quick)]
    return out


def fit_group(pts: list[tuple[float, float]], dispatch: float = 0.0) -> tuple[float | None, float]:
    """Fit ``measured ≈ dispatch + o + r / e`` minimizing the squared *relative* error; returns ``(e or None, o)``.

    ``pts`` are ``(r, measured)``: ``r`` the plain-roofline time, ``measured`` the whole measured time. The
    error is relative to the whole measured time, so a small op measured at or below ``dispatch`` (its
    net time ≤ 0) is just a point the model over-predicts a little, not one that dominates the fit. With no
    roofline time (views, control), or fewer than two points with one, only
    ``o = median(measured − dispatch − r)`` is fitted. ``o`` is kept ≥ 0
    and ``e`` is clipped to [0.01, 100].
    """
    pts = [(r, max(m, 1e-9)) for r, m in pts]
    if sum(1 for r, _ in pts if r > 0) < 2:  # no roofline time, or one point: e is not identifiable
        return None, max(0.0, float(statistics.median(m - dispatch - r for r, m in pts)))
    # weighted least squares on rows [1/m, r/m] · [o, k] ≈ 1 − dispatch/m   (k = 1/e)
    a11 = sum(1 / m ** 2 for _, m in pts)
    a12 = sum(r / m ** 2 for r, m in pts)
    a22 = sum((r / m) ** 2 for r, m in pts)
    b1 = sum((1 - dispatch / m) / m for _, m in pts)
    b2 = sum((1 - dispatch / m) * r / m for r, m in pts)
    det = a11 * a22 - a12 * a12
    o, k = (0.0, 0.0)
    if len(pts) >= 2 and det > a11 * a22 * 1e-12:
        o = (b1 * a22 - a12 * b2) / det
        k = (a11 * b2 - a12 * b1) / det
    if not (o >= 0 and k > 0):
        o, k = 0.0, (b2 / a22 if a22 > 0 else 1.0)
    e = 1.0 / k if k > 0 else EFF_MAX
    return min(EFF_MAX, max(EFF_MIN, e)), o


ACT_SHAPE = (8, 2048)  # [K, N] of the activation benchmark: 8 weight rows (hot, a negligible product), 2048 outputs


def _native_act_costs(quick: bool) -> dict[str, float]:
    """``native:hetforge.linear_act.default:act:<act>``: seconds per output element that ``hf_linear_act`` spends on
    its activation, measured directly — a one-row product over 8 weight rows (so the product itself is a few µs) with
    the activation and with ``none``, each the best of many calls, interleaved in rounds: ``(t_act − t_none)/N``,
    ≥ 0, median over the rounds. Measured this way rather than as the difference of two cold products, whose
    noise on a loaded host (±10 ns per output) is larger than the term. Empty without the native kernels."""
    lib = native.library()
    if lib is None:
        return {}
    k, n = ACT_SHAPE
    nt = torch.get_num_threads
    w, x, y, part = _rn(k, n), _rn(k), torch.empty(n), torch.empty(native.split_k_slots(), n)

    def runner(code: int) -> Callable[[], object]:
        return lambda: lib.hf_linear_act(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), n, k, 1, code, nt(),
                                         part.data_ptr(), part.shape[0])

    out, base = {}, runner(native.ACT_CODES["none"])
    for act, code in native.ACT_CODES.items():
        if act == "none":
            continue
        fn = runner(code)
        diffs = [_best_time(fn, 20, 0.005 if quick else 0.02) - _best_time(base, 20, 0.005 if quick else 0.02)
                 for _ in range(3 if quick else 5)]
        out[f"native:hetforge.linear_act.default:act:{act}"] = float(f"{max(0.0, statistics.median(diffs)) / n:.4g}")
    return out


def _passes(quick: bool) -> int:
    """Passes of β_read and of the DRAM-stream benchmarks (full: bandwidth.PASSES, the runs bench/costmodel.py
    takes its per-instruction best over; quick: 3)."""
    return 3 if quick else PASSES


def _time_bench(fn: Callable[[], object], memory: bool, quick: bool, budget: float) -> float:
    """A benchmark's time: β_read's statistic for a memory-bound one whose pool copies are DRAM streams (≥ 1 MiB,
    at most 256 of them), else the best call (:func:`_best_time`).

    A DRAM stream is timed with one β_read pass before each of its passes (:data:`_probe`) and reported at
    calibration's β_read: ``t · β_window / β`` — so the fitted efficiency is the kernel's speed relative to the
    bandwidth of the same minute. On a shared host the bandwidth drifts by 10–20% within a minute; without
    this, a stream kernel's efficiency absorbed the drift between the β_read measurement and its own."""
    count, size = _pools[-1] if _pools else (1, 0)
    if memory and size >= STREAM_COPY_BYTES and 2 <= count <= 256:
        probe, beta = _probe[0], _beta[0]
        if probe is None or beta <= 0:
            return pooled_time(fn, count, _passes(quick), _clock[0])
        probe.reset()
        t = pooled_time(fn, count, _passes(quick), _clock[0], before_pass=probe.read_pass)
        return t * probe.result().bytes_per_s / beta
    return _best_time(fn, 5, budget)


def _fit_efficiency(peak: float, bw: float, dispatch: float, quick: bool, budget: float,
                    tick: Progress) -> tuple[dict[str, float], dict[str, float], dict[str, list[tuple[float, float]]]]:
    samples: dict[str, list[tuple[float, float]]] = {}
    one_row: list[tuple[float, float, float]] = []  # (roofline s, weight rows, measured s) of one-row GEMMs
    benches = _group_benchmarks(quick)
    if len(benches) != _n_group_benchmarks(quick):
        raise RuntimeError("internal: _n_group_benchmarks is out of date")
    for keys, make, fl, by, rows in benches:
        t_c, t_m = fl / peak, by / bw
        cls = "compute" if t_c >= t_m and t_c > 0 else "memory"
        _pools.clear()
        fn = make()
        m = _time_bench(fn, cls == "memory", quick, budget)
        del fn
        for key in keys:
            key = f"{key}:{cls}" if key in ("matmul", "attention") else key
            samples.setdefault(key, []).append((max(t_c, t_m), m))
        if rows and f"matmul:{row_band(1)}" in keys:
            one_row.append((max(t_c, t_m), float(rows), m))
        tick(f"op group {keys[-1]}")
    eff, over = {}, {}
    for key, pts in samples.items():
        e, o = fit_group(pts, dispatch)
        if e is not None:
            eff[key] = round(e, 4)
        over[key] = float(f"{o:.4g}")
    if one_row:  # one-row products: streaming bytes plus a cost per weight row (see fit_rows)
        e, o, c = fit_rows(one_row, dispatch)
        key = f"matmul:{row_band(1)}"
        eff[key], over[key], over["matmul:per-row"] = round(e, 4), float(f"{o:.4g}"), float(f"{c:.4g}")
    return eff, over, samples


def _tiny_ops() -> list[Callable[[], object]]:
    """Distinct small ops on one-token-sized tensors (each runs its own framework and kernel code)."""
    aten = torch.ops.aten
    x, q, w = _rn(1, 1, 768), _rn(1, 12, 1, 64), _rn(768)
    o4, o3 = torch.empty(1, 12, 1, 64), torch.empty(1, 1, 768)
    a, b = q[..., :32], q[..., 32:]
    return [lambda: aten.view.default(x, [1, 1, 12, 64]), lambda: aten.transpose.int(q, 1, 2),
            lambda: aten.slice.Tensor(q, 3, 0, 32), lambda: aten.neg.out(q, out=o4),
            lambda: aten.cat.default([a, b], -1), lambda: aten.mul.out(q, q, out=o4),
            lambda: aten.add.out(x, x, out=o3), lambda: aten.rsqrt.default(x),
            lambda: aten.mean.dim(x, [-1], True), lambda: aten.pow.Tensor_Scalar(x, 2),
            lambda: F.layer_norm(x, (768,), w), lambda: F.scaled_dot_product_attention(q, q, q),
            lambda: aten.unsqueeze.default(x, 1), lambda: o3.copy_(x), lambda: torch.softmax(x, -1),
            lambda: F.silu(x)]


def _sequence(cycles: int) -> tuple[float, float]:
    """``(s_warm, s_cold)``: the in-program fixed-cost factors of :mod:`hetforge.cost.context`.

    Each of :func:`_tiny_ops` is timed alone (best of a tight loop: ``t``), then in turn in a cycle of all of
    them (best per op over ``cycles`` cycles: ``w``), then again with a write of twice the last-level cache
    before every cycle (``c``). ``s_warm = median(w/t)``, ``s_cold = median((c − w)/t)`` over all but the
    first op (the first op after the stream pays more: :func:`_first_after`).
    """
    ops = _tiny_ops()
    iso = [_best_time(f, 30, 0.02) for f in ops]
    flush = torch.empty(2 * llc_bytes() // 4)
    clock = _clock[0]
    warm: list[list[float]] = [[] for _ in ops]
    cold: list[list[float]] = [[] for _ in ops]
    for evict, out in ((False, warm), (True, cold)):
        for _ in range(cycles):
            if evict:
                flush.fill_(1.0)
            for i, f in enumerate(ops):
                t0 = clock()
                f()
                out[i].append(clock() - t0)
    w, c = [min(x) for x in warm], [min(x) for x in cold]
    s_warm = max(1.0, statistics.median(wi / ti for wi, ti in zip(w, iso, strict=True)))
    s_cold = max(0.0, statistics.median((ci - wi) / ti for ci, wi, ti in zip(c[1:], w[1:], iso[1:], strict=True)))
    return s_warm, s_cold


def fit_rows(pts: list[tuple[float, float, float]], dispatch: float = 0.0) -> tuple[float, float, float]:
    """Fit ``measured ≈ dispatch + o + r / e + R·c`` (least squares on the relative error); ``(e, o, c)``.

    ``pts`` are ``(r, R, measured)``: ``r`` the plain-roofline time, ``R`` the rows of the weight in memory
    order. One-row products (GEMVs) stream their weight a row at a time; each row costs a fixed ``c`` on top of
    its bytes (here ~70 ns: a 768-float row streams at 17 GB/s, a 3072-float row at 25 GB/s). ``o, c ≥ 0``;
    without a valid three-term fit, ``c = 0`` and :func:`fit_group` decides ``e`` and ``o``.
    """
    rows = [(1.0 / m, r / m, n / m, 1.0 - dispatch / m) for r, n, m in ((r, n, max(m, 1e-9)) for r, n, m in pts)]
    a = np.array([x[:3] for x in rows], dtype=float)
    b = np.array([x[3] for x in rows], dtype=float)
    for cols in ((0, 1, 2), (1, 2)):
        if len(pts) < len(cols) + 1:
            continue
        sub = a[:, cols]
        scale = np.linalg.norm(sub, axis=0)
        if not np.all(scale > 0):
            continue
        sol, _, rank, _ = np.linalg.lstsq(sub / scale, b, rcond=1e-9)
        if rank < len(cols):  # rows proportional to bytes (one layout, one row length): not separable
            continue
        full = dict(zip(cols, sol / scale, strict=True))
        o, k, c = full.get(0, 0.0), full.get(1, 0.0), full.get(2, 0.0)
        if o >= 0 and k > 0 and c >= 0:
            return min(EFF_MAX, max(EFF_MIN, 1.0 / k)), float(o), float(c)
    e, o = fit_group([(r, m) for r, _, m in pts], dispatch)
    return (e if e is not None else 1.0), o, 0.0


def fit_saturating(pts: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit ``y ≈ p·min(1, t/τ)`` (least squares over a geometric grid of τ); returns ``(p, τ)``, ``p ≥ 0``."""
    best = (float("inf"), 0.0, 1.0)
    for i in range(61):
        tau = 1e-5 * 10 ** (i / 15)  # 10 µs … 10 s
        xs = [min(1.0, t / tau) for t, _ in pts]
        den = sum(x * x for x in xs)
        p = max(0.0, sum(x * y for x, (_, y) in zip(xs, pts, strict=True)) / den) if den > 0 else 0.0
        err = sum((p * x - y) ** 2 for x, (_, y) in zip(xs, pts, strict=True))
        if err < best[0] - 1e-18:
            best = (err, p, tau)
    return best[1], best[2]


def _first_after(s_cold: float, quick: bool) -> tuple[float, float]:
    """``(p_first, τ)``: the extra time of the first op after a long one, ``p_first·min(1, t_prev/τ)``.

    A GEMM with cold weights (``[128, 768] × [N, 768]ᵀ``, N = 768 … 8192: 2 … 25 MB, ~2 … 20 ms) runs, then
    a ``view`` twice; the extra of the first view (best first − best second, less the cold-code term
    ``s_cold·t_view·min(1, B/2C)`` the model adds on its own) against the GEMM's time is fitted by
    :func:`fit_saturating`. Long ops leave the caches cold through their own streams, their own code and —
    on a shared host — the other processes that ran meanwhile.
    """
    aten = torch.ops.aten
    y = torch.empty(128, 2304)

    def view() -> object:
        return aten.view.default(y, [1, 128, 2304])

    t_view = _best_time(view, 30, 0.02)
    clock, cap = _clock[0], llc_bytes()
    pts = []
    for n in [768, 3072] if quick else [768, 3072, 8192]:
        x, nxt = _rn(128, 768), _cold(_rn(n, 768))
        gemm = partial(lambda x, nxt: F.linear(x, nxt()[0]), x, nxt)
        gemm()
        durs, first, second = [], [], []
        for _ in range(4 if quick else 8):
            t0 = clock()
            gemm()
            t1 = clock()
            view()
            t2 = clock()
            view()
            t3 = clock()
            durs.append(t1 - t0)
            first.append(t2 - t1)
            second.append(t3 - t2)
        nbytes = 4.0 * (128 * 768 + n * 768 + 128 * n)
        extra = min(first) - min(second) - s_cold * t_view * min(1.0, nbytes / (2 * cap))
        pts.append((statistics.median(durs), max(0.0, extra)))
        del nxt, gemm
    return fit_saturating(pts)


def _evict_after(quick: bool) -> tuple[float, float]:
    """``(p, τ)``: the share of the cache-resident data an op of ``t`` seconds leaves cold, ``p·min(1, t/τ)``.

    ``add(a, b, out=slice)`` (``a``, ``b``: 128 × 768) is timed right after an add that touched ``a`` and ``b``
    (``m_hot``), after a write of 2× the last-level cache (``m_cold``), and after a product of ``t`` = 0.3 … 10 ms
    whose operands total under a quarter of the last-level cache (``[M, 768] × [768, 768]``, M = 32 … 1024: by
    bytes alone ``a`` and ``b`` would stay cached). The share lost is ``(m_after − m_hot)/(m_cold − m_hot)``,
    clipped to [0, 1], fitted by :func:`fit_saturating`. Here a 3 ms product left the inputs as cold as the
    flush did: a long op loses the caches (to its own packing buffers and code and, on a shared host, to the
    processes that ran meanwhile) whatever its bytes."""
    n, clock = 128 * 768, _clock[0]
    a, b, nxt = _rn(n), _rn(n) + 1, _cold(torch.empty(n))
    flush = torch.empty(2 * llc_bytes() // 4)
    w = _rn(768, 768)
    reps = 6 if quick else 12

    def timed(before: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(reps):
            torch.add(a, b, out=nxt()[0])  # a and b just touched
            before()
            o = nxt()[0]
            t0 = clock()
            torch.add(a, b, out=o)
            best = min(best, clock() - t0)
        return best

    m_hot = timed(lambda: None)
    m_cold = timed(lambda: flush.fill_(1.0))
    pts = []
    for m in [32, 256] if quick else [32, 128, 512, 1024]:
        x = _rn(m, 768)
        F.linear(x, w)
        t_op = _best_time(lambda x=x: F.linear(x, w), 3, 0.02)
        m_after = timed(lambda x=x: F.linear(x, w))
        lost = (m_after - m_hot) / (m_cold - m_hot) if m_cold > m_hot else 0.0
        pts.append((t_op, min(1.0, max(0.0, lost))))
    return fit_saturating(pts)


def _cache_hit(dispatch: float, sizes: list[int], budget: float) -> float:
    """Cost of a cache-resident byte relative to a DRAM byte, ``h``.

    ``add(a, b, out=slice)`` with the slice cold, timed with ``a``, ``b`` cold (``m_c``) and hot (reused every
    call, well inside the last-level cache: ``m_h``), back to back at each size. With ``m − dispatch``
    proportional to the bytes' cost, ``(m_h − d)/(m_c − d) = (8n·h + 4n)/(12n)``, so
    ``h = 1.5·(m_h − d)/(m_c − d) − 0.5``; median over ``sizes``, clipped to [0.05, 1].
    """
    hs = []
    for n in sizes:
        cold = _mk_binary_out(torch.add, n)
        m_c = _best_time(cold, 5, budget)
        del cold
        a, b, nxt = _rn(n), _rn(n) + 1, _cold(torch.empty(n))
        m_h = _best_time(lambda a=a, b=b, nxt=nxt: torch.add(a, b, out=nxt()[0]), 5, budget)
        del nxt
        hs.append(1.5 * (m_h - dispatch) / max(m_c - dispatch, 1e-9) - 0.5)
    return min(1.0, max(0.05, statistics.median(hs)))


def measure(quick: bool = False, tick: Progress | None = None, threads: int | None = None,
            clock: str = "wall") -> Measured:
    """Run all micro-benchmarks; ``quick`` uses small sizes and short budgets (a few seconds in all).

    ``threads`` sets ``torch.set_num_threads`` for the measurement (restored afterwards); the profile is
    only valid for programs run with the same thread count. ``clock="thread"`` times with the calling
    thread's CPU time (``time.thread_time``), which excludes time the thread spends preempted by other
    processes; it is only meaningful with one torch thread (ops then run on the calling thread).
    """
    tick = tick or (lambda _msg: None)
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}")
    old = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise ValueError("threads must be >= 1")
        torch.set_num_threads(threads)
    if clock == "thread" and torch.get_num_threads() != 1:
        torch.set_num_threads(old)
        raise ValueError("clock 'thread' needs one torch thread (--threads 1)")
    _clock[0] = CLOCKS[clock]
    _cold_cap[0] = 64 if quick else 100_000
    try:
        m = _measure(quick, tick)
        m.clock = clock
        return m
    finally:
        torch.set_num_threads(old)
        _clock[0] = time.perf_counter


def _measure(quick: bool, tick: Progress) -> Measured:
    t0 = time.perf_counter()
    sizes = [128, 256] if quick else [256, 512, 1024]
    budget = 0.05 if quick else 0.4
    gemm: dict[str, dict[int, float]] = {}
    for dt in ("fp32", "bf16", "int8"):
        slow = False
        for n in sizes:
            if not slow:
                r = _gemm(dt, n, budget)
                if r > 0:
                    gemm.setdefault(dt, {})[n] = r
                    slow = 2 * n ** 3 / r > budget  # larger sizes would take too long
            tick(f"GEMM {dt} {n}")
    bw_copy, bw_triad = _bandwidth((16 if quick else 128) * 2 ** 20, budget * 2)
    _probe[0] = ReadProbe(clock=_clock[0])
    for _ in range(_passes(quick)):
        _probe[0].read_pass()
    read = _probe[0].result()
    _beta[0] = read.bytes_per_s
    tick("memory bandwidth")
    disp = _dispatch(budget)
    tick("dispatch overhead")
    peak = max(gemm["fp32"].values())
    fma = native.fma_peak(seconds=0.01 if quick else 0.05, repeats=3 if quick else 5)
    try:
        eff, over, samples = _fit_efficiency(peak, read.bytes_per_s, disp, quick, budget / 2, tick)
    finally:
        _probe[0], _beta[0] = None, 0.0
    sizes = [128 * 768] if quick else [128 * 768, 256 * 768, 128 * 3072]
    eff["cache-hit"] = round(_cache_hit(disp, sizes, budget / 2), 4)
    tick("cache-hit bytes")
    s_warm, s_cold = _sequence(5 if quick else 15)
    eff["seq:warm"] = round(s_warm, 4)
    if s_cold > 0:
        eff["seq:cold"] = round(s_cold, 4)
    tick("fixed costs in a program")
    p_first, tau = _first_after(s_cold, quick)
    over["seq:first"], over["seq:first-tau"] = float(f"{p_first:.4g}"), float(f"{tau:.4g}")
    tick("first op after a long one")
    p_evict, tau_evict = _evict_after(quick)
    if p_evict > 0:
        eff["seq:evict"], over["seq:evict-tau"] = round(min(1.0, p_evict), 4), float(f"{tau_evict:.4g}")
    tick("caches lost over a long op")
    over.update(_native_act_costs(quick))
    tick("native activations")
    return Measured(gemm, bw_copy, bw_triad, disp, eff, samples, time.perf_counter() - t0, torch.get_num_threads(),
                    over, bw_read=read.bytes_per_s, read=read, fma_flops=(fma or 0.0) * 1e9)


def n_steps(quick: bool) -> int:
    """Number of ``tick`` calls :func:`measure` makes (for a progress bar)."""
    return 3 * (2 if quick else 3) + 7 + _n_group_benchmarks(quick)


def _n_group_benchmarks(quick: bool) -> int:
    """``len(_group_benchmarks(quick))`` without allocating the benchmark tensors (checked in ``_fit_efficiency``)."""
    n_mm, n_attn, n_sizes, n_gather = (4 + 2 + 3, 2, 2, 2) if quick else (12 + 8 + 3, 4, 4, 3)
    n_strided = 1 if quick else 3
    return n_mm + n_attn + n_sizes * (8 + len(UNARY)) + n_strided + n_gather + 8 + 1 + len(_native_specs(quick))


def host_spec(m: Measured, quick: bool) -> SocSpec:
    """The ``host`` profile from measurements (power figures stay labelled estimates)."""
    when = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    n = cpu_count()
    tag = (f"measured by `hetforge calibrate{' --quick' if quick else ''}` on {when} with {m.threads} torch threads, "
           f"{'thread CPU time' if m.clock == 'thread' else 'wall clock'}")

    def meas(v: float, what: str) -> PositiveFigure:
        return PositiveFigure(value=v, source=f"{tag}: {what}")

    fma = (f"; the FMA units' ceiling (register-only FMAs on every thread, native.fma_peak) {m.fma_flops / 1e9:.1f} "
           f"GFLOP/s, this peak {max(m.gemm['fp32'].values()) / m.fma_flops:.0%} of it"
           if m.fma_flops > 0 and "fp32" in m.gemm else "")
    peak = {dt: meas(max(r.values()), "fastest kernel (ATen; oneDNN prepacked for fp32/bf16) per n×n×n, "
                     "best of " + ", ".join(f"{k}: {v / 1e9:.1f} GFLOP/s" for k, v in r.items())
                     + (fma if dt == "fp32" else ""))
            for dt, r in m.gemm.items()}
    dev = DeviceSpec(
        name="cpu", kind="cpu", peak_flops=peak,
        mem_bandwidth=(meas(m.bw_read, f"{m.read.method} (copy {m.bw_copy / 1e9:.2f} GB/s, triad "
                            f"{m.bw_triad / 1e9:.2f} GB/s, for reference)") if m.read is not None and m.bw_read > 0
                       else meas(max(m.bw_copy, m.bw_triad),
                                 f"max of copy {m.bw_copy / 1e9:.2f} GB/s and triad {m.bw_triad / 1e9:.2f} GB/s")),
        mem_capacity=PositiveFigure(value=float(psutil.virtual_memory().total), source="psutil total RAM (measured)"),
        tdp_w=PositiveFigure(value=TDP_PER_CORE_W * n, source=POWER_SRC, estimate=True),
        idle_w=Figure(value=TDP_PER_CORE_W * n * 0.1, source=POWER_SRC, estimate=True),
        dispatch_s=Figure(value=m.dispatch_s, source=f"{tag}: best time of aten.add on 1-element tensors"),
        efficiency=m.efficiency, overhead_s=m.overhead_s,
        efficiency_source=f"{tag}: per op group, fit of measured = dispatch + overhead + roofline / efficiency "
                          "(least squares on relative error) over micro-benchmarks with cold operands; seq:* from "
                          "a cycle of distinct tiny ops with and without a cache flush and from a view after GEMMs; "
                          "cache-hit from an add with cache-resident inputs",
        cache_bytes=PositiveFigure(value=float(llc_bytes()), source="last-level cache size from sysfs "
                                   "(/sys/devices/system/cpu/cpu0/cache; 32 MiB when unreadable)"),
    )
    desc = f"this machine: {cpu_name()}, {n} cores, calibrated with {m.threads} torch threads"
    return SocSpec(name="host", description=desc,
                   source=tag, calibrated=True, devices=[dev], links=[])
