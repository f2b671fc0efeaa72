"""``hetforge calibrate``: measure this host and write its ``host`` profile.

Micro-benchmarks (each timed as the best of several runs after a warm-up, wall clock — the minimum, as STREAM
reports, because load from other processes only adds time):

* GEMM throughput per dtype — ``2·M·N·K / t`` for square fp32 and bf16 ``torch.mm`` at several sizes, int8 via
  ``torch._int_mm`` and ``aten._weight_int8pack_mm`` (best of both); the peak is the best size.
* memory bandwidth — copy ``b.copy_(a)`` moves ``2·n·s`` bytes; triad ``a = b + α·c`` moves ``3·n·s``;
  the profile's bandwidth is the better of the two.
* dispatch overhead — one ``aten.add`` on one-element tensors.
* efficiency factors and fixed overheads — representative ops of each cost group (matmul, attention,
  elementwise, transcendental — also per function —, softmax, norm, reduction, gather, movement, view,
  control, creation) at LLM-like shapes; per key, ``m − dispatch ≈ o + r / e`` is fitted by least squares on
  the relative error (:func:`fit_group`), where ``r`` is the plain-roofline time at the measured π and β and
  ``m`` the measured time. ``e > 1`` means the ops beat the DRAM roof (cache-resident working set). Matmul
  and attention are fitted separately for their compute-bound and memory-bound points (``group:class``).
  Operands are cold: each call takes the next of several copies totalling twice the last-level cache, as in
  a real graph run where every weight streams from DRAM once per pass and evicts the caches.

Power cannot be measured here (no RAPL/NVML readable): TDP and idle power stay labelled estimates.
"""

from __future__ import annotations

import datetime as _dt
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import psutil
import torch
import torch.nn.functional as F

from hetforge.hardware.host import POWER_SRC, TDP_PER_CORE_W, cpu_count, cpu_name
from hetforge.hardware.schema import DeviceSpec, Figure, PositiveFigure, SocSpec

Progress = Callable[[str], None]
EFF_MIN, EFF_MAX = 0.01, 100.0
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}
_clock: list[Callable[[], float]] = [time.perf_counter]  # the clock in use (set by measure)
_cold_cap = [100_000]  # most copies _cold makes (quick mode: 64, so small tensors stay partly cached)


@dataclass
class Measured:
    """Raw calibration results (rates in FLOP/s or B/s, times in s)."""

    gemm: dict[str, dict[int, float]]
    bw_copy: float
    bw_triad: float
    dispatch_s: float
    efficiency: dict[str, float]
    samples: dict[str, list[tuple[float, float]]]  # group -> [(roofline s, measured net s)]
    seconds: float
    threads: int = 1
    overhead_s: dict[str, float] = field(default_factory=dict)
    clock: str = "wall"


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


def llc_bytes() -> int:
    """Last-level cache size from sysfs (32 MiB when unknown)."""
    best = 0
    for idx in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{idx}/size") as f:
                txt = f.read().strip()
        except OSError:
            continue
        mult = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}.get(txt[-1:], 1)
        try:
            best = max(best, int(txt.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best or 32 * 1024 ** 2



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
    return [lambda: torch.mm(a, b)]


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


Bench = tuple[tuple[str, ...], Callable[[], Callable[[], object]], float, float]


def _cold(*ts: torch.Tensor) -> Callable[[], tuple[torch.Tensor, ...]]:
    """Copies of ``ts`` totalling ≥ 2× the last-level cache, handed out in turn, so each call reads cold data.

    In a real graph run every weight streams from DRAM once per pass and evicts the caches; a
    micro-benchmark that reuses one tensor would measure it cache-hot.
    """
    size = max(1, sum(t.numel() * t.element_size() for t in ts))
    k = max(2, min(_cold_cap[0], -(-2 * llc_bytes() // size)))
    pool = [ts] + [tuple(t.clone() for t in ts) for _ in range(k - 1)]
    state = [0]

    def nxt() -> tuple[torch.Tensor, ...]:
        state[0] = (state[0] + 1) % k
        return pool[state[0]]

    return nxt


def _rn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def _mk_linear(m: int, n: int) -> Callable[[], object]:
    x, nxt = _rn(m, 768), _cold(_rn(n, 768))
    return lambda: F.linear(x, nxt()[0])


def _mk_sdpa(L: int, S: int) -> Callable[[], object]:
    nxt = _cold(_rn(1, 12, L, 64), _rn(1, 12, S, 64), _rn(1, 12, S, 64))
    mask = torch.ones(1, 1, L, S, dtype=torch.bool).tril(S - L)
    return lambda: F.scaled_dot_product_attention(*nxt(), mask)


def _mk_apply(fn: Callable, *shapes: tuple[int, ...]) -> Callable[[], object]:
    nxt = _cold(*(_rn(*s) for s in shapes))
    return lambda: fn(*nxt())


def _mk_embedding(m: int) -> Callable[[], object]:
    idx, nxt = torch.randint(0, 8192, (1, m)), _cold(_rn(8192, 768))
    return lambda: F.embedding(idx, nxt()[0])


UNARY = {"aten.tanh.default": torch.tanh, "aten.silu.default": F.silu, "aten.gelu.default": F.gelu,
         "aten.rsqrt.default": torch.rsqrt, "aten.sin.default": torch.sin, "aten.cos.default": torch.cos,
         "aten.exp.default": torch.exp, "aten.pow.Tensor_Scalar": lambda a: torch.pow(a, 3.0)}


def _group_benchmarks(quick: bool) -> list[Bench]:
    """(keys, make_fn, FLOPs, bytes) for representative ops; FLOPs/bytes use the same formulas as aten_costs.

    ``make_fn()`` allocates the operands (cold copies, see :func:`_cold`) and returns the function to time,
    so only one benchmark's tensors are alive at a time. ``keys`` are the efficiency/overhead keys the sample
    is fitted under (a cost group, and for transcendental functions also the op name). Matmul and attention
    get ``:compute``/``:memory`` appended.
    """
    out: list[Bench] = []
    for n in [768, 3072] if quick else [768, 3072, 8192, 32000]:
        for m in [1, 32] if quick else [1, 16, 128]:
            out.append((("matmul",), partial(_mk_linear, m, n), 2.0 * m * n * 768,
                        4.0 * (m * 768 + n * 768 + m * n)))
    for L, S in ([(16, 16), (1, 32)] if quick else [(128, 128), (32, 32), (1, 128), (1, 16)]):
        out.append((("attention",), partial(_mk_sdpa, L, S), 12.0 * L * S * (2 * 64 + 2 * 64 + 5),
                    4.0 * (2 * 12 * L * 64 + 2 * 12 * S * 64) + L * S))
    for n in ([768, 128 * 768] if quick else [768, 16 * 768, 128 * 768, 128 * 3072]):
        r = max(1, n // 768)
        for fn2 in (torch.add, torch.mul):
            out.append((("elementwise",), partial(_mk_apply, fn2, (n,), (n,)), float(n), 12.0 * n))
        for name, fn1 in UNARY.items():
            out.append((("transcendental", name), partial(_mk_apply, fn1, (n,)), 4.0 * n, 8.0 * n))
        rowwise = [("softmax", partial(torch.softmax, dim=-1), 5.0 * n, 8.0 * n),
                   ("norm", partial(F.layer_norm, normalized_shape=(768,)), 8.0 * n, 8.0 * n + 8 * 768),
                   ("reduction", partial(torch.mean, dim=-1, keepdim=True), float(n), 4.0 * n + 4 * r),
                   ("movement", lambda t: torch.cat([t, t], -1), 0.0, 16.0 * n)]
        for key, fnr, fl, by in rowwise:
            out.append(((key,), partial(_mk_apply, fnr, (r, 768)), fl, by))
    for m in [1, 128] if quick else [1, 16, 128]:
        out.append((("gather",), partial(_mk_embedding, m), 0.0, 8.0 * m + 2 * 4.0 * m * 768))
    x = _rn(1, 128, 768)
    aten = torch.ops.aten
    tiny = [("view", lambda: aten.view.default(x, [128, 768])),
            ("view", lambda: aten.reshape.default(x, [1, 128, 12, 64])),
            ("view", lambda: aten.transpose.int(x, 1, 2)), ("view", lambda: aten.split.Tensor(x, 256, 2)),
            ("view", lambda: aten.unsqueeze.default(x, 1)), ("view", lambda: aten.expand.default(x, [2, 128, 768])),
            ("control", lambda: aten._assert_tensor_metadata.default(x, dtype=torch.float32)),
            ("control", lambda: aten.to.device(x, torch.device("cpu"), torch.float32))]
    for key, fn in tiny:
        out.append(((key,), partial(lambda f: f, fn), 0.0, 0.0))
    out.append((("creation",), partial(lambda: (lambda: aten.arange.default(128))), 0.0, 128 * 8.0))
    return out


def fit_group(pts: list[tuple[float, float]]) -> tuple[float | None, float]:
    """Fit ``net ≈ o + r / e`` minimizing the squared *relative* error; returns ``(e or None, o)``.

    ``r`` = plain-roofline time, ``net`` = measured − dispatch. With no roofline time (views, control) only
    ``o = median(net)`` is fitted. ``o`` is kept ≥ 0 and ``e`` is clipped to [0.01, 100].
    """
    pts = [(r, max(net, 1e-7)) for r, net in pts]
    if all(r == 0 for r, _ in pts):
        return None, max(0.0, float(statistics.median(net for _, net in pts)))
    # weighted least squares on rows [1/net, r/net] · [o, k] ≈ 1
    a11 = sum(1 / n ** 2 for _, n in pts)
    a12 = sum(r / n ** 2 for r, n in pts)
    a22 = sum((r / n) ** 2 for r, n in pts)
    b1 = sum(1 / n for _, n in pts)
    b2 = sum(r / n for r, n in pts)
    det = a11 * a22 - a12 * a12
    o, k = (0.0, 0.0)
    if len(pts) >= 2 and det > 0:
        o = (b1 * a22 - a12 * b2) / det
        k = (a11 * b2 - a12 * b1) / det
    if not (o >= 0 and k > 0):
        o, k = 0.0, (b2 / a22 if a22 > 0 else 1.0)
    e = 1.0 / k if k > 0 else 1.0
    return min(EFF_MAX, max(EFF_MIN, e)), o


def _fit_efficiency(peak: float, bw: float, dispatch: float, quick: bool, budget: float,
                    tick: Progress) -> tuple[dict[str, float], dict[str, float], dict[str, list[tuple[float, float]]]]:
    samples: dict[str, list[tuple[float, float]]] = {}
    benches = _group_benchmarks(quick)
    if len(benches) != _n_group_benchmarks(quick):
        raise RuntimeError("internal: _n_group_benchmarks is out of date")
    for keys, make, fl, by in benches:
        t_c, t_m = fl / peak, by / bw
        cls = "compute" if t_c >= t_m and t_c > 0 else "memory"
        fn = make()
        m = _best_time(fn, 5, budget)
        del fn
        for key in keys:
            key = f"{key}:{cls}" if key in ("matmul", "attention") else key
            samples.setdefault(key, []).append((max(t_c, t_m), m - dispatch))
        tick(f"op group {keys[-1]}")
    eff, over = {}, {}
    for key, pts in samples.items():
        e, o = fit_group(pts)
        if e is not None:
            eff[key] = round(e, 4)
        over[key] = float(f"{o:.4g}")
    return eff, over, samples


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
    tick("memory bandwidth")
    disp = _dispatch(budget)
    tick("dispatch overhead")
    peak = max(gemm["fp32"].values())
    eff, over, samples = _fit_efficiency(peak, max(bw_copy, bw_triad), disp, quick, budget / 2, tick)
    return Measured(gemm, bw_copy, bw_triad, disp, eff, samples, time.perf_counter() - t0, torch.get_num_threads(),
                    over)


def n_steps(quick: bool) -> int:
    """Number of ``tick`` calls :func:`measure` makes (for a progress bar)."""
    return 3 * (2 if quick else 3) + 2 + _n_group_benchmarks(quick)


def _n_group_benchmarks(quick: bool) -> int:
    """``len(_group_benchmarks(quick))`` without allocating the benchmark tensors (checked in ``_fit_efficiency``)."""
    n_mm, n_attn, n_sizes, n_gather = (4, 2, 2, 2) if quick else (12, 4, 4, 3)
    return n_mm + n_attn + n_sizes * 14 + n_gather + 8 + 1


def host_spec(m: Measured, quick: bool) -> SocSpec:
    """The ``host`` profile from measurements (power figures stay labelled estimates)."""
    when = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    n = cpu_count()
    tag = (f"measured by `hetforge calibrate{' --quick' if quick else ''}` on {when} with {m.threads} torch threads, "
           f"{'thread CPU time' if m.clock == 'thread' else 'wall clock'}")

    def meas(v: float, what: str) -> PositiveFigure:
        return PositiveFigure(value=v, source=f"{tag}: {what}")

    peak = {dt: meas(max(r.values()), "best of " + ", ".join(f"{k}: {v / 1e9:.1f} GFLOP/s" for k, v in r.items()))
            for dt, r in m.gemm.items()}
    dev = DeviceSpec(
        name="cpu", kind="cpu", peak_flops=peak,
        mem_bandwidth=meas(max(m.bw_copy, m.bw_triad),
                           f"max of copy {m.bw_copy / 1e9:.2f} GB/s and triad {m.bw_triad / 1e9:.2f} GB/s"),
        mem_capacity=PositiveFigure(value=float(psutil.virtual_memory().total), source="psutil total RAM (measured)"),
        tdp_w=PositiveFigure(value=TDP_PER_CORE_W * n, source=POWER_SRC, estimate=True),
        idle_w=Figure(value=TDP_PER_CORE_W * n * 0.1, source=POWER_SRC, estimate=True),
        dispatch_s=Figure(value=m.dispatch_s, source=f"{tag}: best time of aten.add on 1-element tensors"),
        efficiency=m.efficiency, overhead_s=m.overhead_s,
        efficiency_source=f"{tag}: per op group, fit of measured - dispatch = overhead + roofline / efficiency "
                          "(least squares on relative error) over micro-benchmarks",
    )
    desc = f"this machine: {cpu_name()}, {n} cores, calibrated with {m.threads} torch threads"
    return SocSpec(name="host", description=desc,
                   source=tag, calibrated=True, devices=[dev], links=[])
