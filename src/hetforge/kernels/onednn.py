"""Packed linears for multi-row CPU products (the prefill GEMMs): oneDNN's, and MKL's packed sgemm.

ATen's fp32 ``linear`` on the CPU runs MKL's ``sgemm`` on the weight as stored; oneDNN (inside every torch
CPU wheel) runs the same product on a weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``), with the bias and an activation fused into the GEMM
(``torch.ops.mkldnn._linear_pointwise``), and a SwiGLU's product fused into the up projection
(``_linear_pointwise.binary(..., "mul")``). The issue this came from measured the [128,768]×[768,3072]
product at 186–192 GFLOP/s through ATen and 417–431 GFLOP/s through the packed oneDNN kernel (2 threads,
AVX-512 EPYC).

oneDNN is asked for a layout per number of rows, and packing copies the weight, so one copy per prefill length
(tiers, and the default ``fine`` lengths: up to eight per power of two) would add one model of memory per length
for as long as the weight lives. Where this oneDNN packs a weight byte for byte alike for every row count from 2
(checked once per dtype, shape and layout, when a second row count asks for a weight: :func:`_alike`), one packed
copy serves them all; elsewhere a weight is packed once per row count. A program with one prefill length never
pays the check. Decode uses the native GEMV on the original weight.

MKL's packed sgemm (``torch.ops.mkl._mkl_linear`` on ``_mkl_reorder_linear_weight``, fp32 where torch was built
with MKL) runs the product on a weight packed once, where ATen's ``linear`` takes the weight as stored; it fuses
nothing, so the executor runs the activation, a gated MLP's product and a residual add in place after it.

Which kernel runs is a measured choice (:func:`pick`): for every ``(rows, K, N, dtype, threads, activation)`` the
executor meets, oneDNN and the other side (MKL's packed sgemm where :func:`mkl_available` and fp32, else ATen's
``linear``) are timed interleaved once per process (:data:`ROUNDS` rounds of one call each, after two warm-up
calls each), and oneDNN is used where the median over rounds of the per-round ratio other side ÷ oneDNN time is
above 1 — against MKL's packed sgemm, above 1 + :data:`MKL_MARGIN` (measuring stops once a majority of the rounds
agree: the median is decided).
A round's ratio compares two calls made back to back, so a round in which
another process took the core spoils that round only, and the median leaves it out; the best of each kernel's
times, which an earlier version compared, flipped choices on a loaded 2-core host (a 2× slower ATen chosen
for a third of the shapes). fp32 products of :func:`panel_rows` rows (a short prompt's) run on the native panel
GEMM by rule instead (from memory it was faster there; the timing above reads one weight from cache).
``HETFORGE_GEMM=aten``, ``=onednn``, ``=mkl`` or ``=panel`` forces one kernel (``auto``, the default, measures).
Where a gated MLP's products run on oneDNN, its gate and up products run either as oneDNN's two calls or as one
native gated panel call, a second measured choice (:func:`gated_pick`) kept with these. For an fp32 product with an
activation the native epilogue has, oneDNN is timed both ways, its post-op and its plain product followed by the
native activation pass (``dnnact``), and the faster one is the oneDNN side of the choice.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from hetforge.errors import HetforgeError
from hetforge.files import write_json
from hetforge.kernels import native

POLICIES = ("auto", "aten", "onednn", "mkl", "panel")
KERNELS = ("aten", "onednn", "mkl", "panel", "amx", "bf16panel", "dnnact")  # what a choice names (:func:`pick`)
# hetforge activation name → (oneDNN post-op attr, scalars, algorithm)
ACT_ATTR: dict[str, tuple[str, list, str]] = {
    "none": ("none", [], ""), "relu": ("relu", [], ""), "gelu": ("gelu", [], "none"),
    "gelu_tanh": ("gelu", [], "tanh"), "silu": ("swish", [], ""),
}
DTYPES = (torch.float32, torch.bfloat16)
PROBE_N = 4096  # most output columns :func:`choose` times
ROUNDS = 5  # interleaved rounds of :func:`pick`
# How much faster oneDNN must be than MKL's packed sgemm in pick's timing (median ratio MKL ÷ oneDNN above
# 1 + MKL_MARGIN) to run an fp32 product, on a host where MKL wins in programs (:func:`mkl_margin` decides per host).
# Why: that timing reuses one weight from cache, a program reads each weight from memory, and there the two did not
# rank as timed. Calibrated on models no benchmark evaluates (llama-oos-1536, gpt2-oos-1024, prefill programs of 128
# and 512 rows, 2 threads, session 29, a Zen 5 host): every product on oneDNN took 4-12% more time per program than
# every product on MKL, while pick's per-shape ratios sent some shapes to oneDNN at 1.02-1.08 (by the draw: the same
# shape went either way in two processes, and a program with those shapes on oneDNN was no faster, or slower, than
# all-MKL). A shape oneDNN runs clearly faster even from cache still goes to oneDNN.
MKL_MARGIN = 0.15
# The calibration sequence :func:`mkl_margin` times: (K, N) products of MARGIN_ROWS rows, no zoo model's shapes
MARGIN_ROWS = 256
MARGIN_SHAPES = ((1280, 3456), (3456, 1280), (1280, 1280))
MARGIN_ROUNDS = 3
_margins: dict[int, float] = {}  # thread count -> this host's margin (mkl_margin)


def _decide(ratio: float, other: str) -> str:
    """The kernel for a measured ratio (``other`` ÷ oneDNN time): oneDNN where it is faster, by more than this
    host's :func:`mkl_margin` against MKL."""
    return "onednn" if ratio > 1.0 + (mkl_margin() if other == "mkl" else 0.0) else other


def mkl_margin() -> float:
    """The margin :func:`pick` asks of oneDNN against MKL's packed sgemm on this host at :func:`threads`:
    :data:`MKL_MARGIN` where a calibration sequence ran at least as fast all on MKL as all on oneDNN, else 0.

    The sequence: :data:`MARGIN_SHAPES` products of :data:`MARGIN_ROWS` rows (no zoo model has these shapes), each
    over copies of its weight totalling twice the last-level cache, so that every weight comes from memory as in a
    program; all on MKL and all on oneDNN, :data:`MARGIN_ROUNDS` interleaved rounds, the median per-round ratio.
    Why per host: the margin was calibrated on a CPU where programs ran faster on MKL than pick's hot timing said;
    on another, pick's timing and the programs both had oneDNN faster, and the margin only moved shapes onto the
    slower kernel (docs/arch/runtime.md has both measurements). Measured once per host (the native library's CPU
    tag), torch build and thread count, and kept on disk next to the native library (a file that cannot be read
    back is measured again; one that cannot be written costs a measurement per process). A process that must not
    measure (:func:`pin_threads`) and finds no measurement on disk keeps :data:`MKL_MARGIN`."""
    n = threads()
    if n not in _margins:
        ratio = _sequence_ratio(n)
        _margins[n] = MKL_MARGIN if ratio is None or ratio <= 1.0 else 0.0
    return _margins[n]


def margin_record() -> dict[str, float | int | None]:
    """This host's margin at :func:`threads` and the calibration sequence's MKL ÷ oneDNN ratio it came from (for
    benchmark pages; None where it was not measured)."""
    n = threads()
    return {"threads": n, "margin": mkl_margin(), "mkl_over_onednn": _sequence_ratio(n)}


def _margin_file(n: int) -> Path:
    tag = hashlib.sha256(f"{native._cpu_tag()}|{torch.__version__}|{n}".encode()).hexdigest()[:16]
    return native.cache_dir().parent / "gemm" / f"mkl-margin-{tag}.json"


def _sequence_ratio(n: int) -> float | None:
    """This host's MKL ÷ oneDNN time on the calibration sequence (:func:`mkl_margin`), from disk where it was
    measured before; None in a process that must not measure (:func:`pin_threads`) when it was not."""
    path = _margin_file(n)
    try:
        ratio = float(json.loads(path.read_text())["mkl_over_onednn"])
        if math.isfinite(ratio) and ratio > 0:
            return ratio
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if _pinned:
        return None
    g = torch.Generator().manual_seed(0)
    rows = MARGIN_ROWS
    per_copy = sum(k * m * 4 for k, m in MARGIN_SHAPES)
    copies = min(6, max(2, -(-2 * native.llc_bytes() // per_copy)))  # 6: a bound on the memory it takes (~0.75 GB)
    xs = {k: torch.randn(rows, k, generator=g) for k, _ in MARGIN_SHAPES}
    dnn: list[Callable[[], object]] = []
    mkl: list[Callable[[], object]] = []
    for _ in range(copies):
        for k, m in MARGIN_SHAPES:
            w = torch.randn(m, k, generator=g) * k ** -0.5
            b = torch.zeros(m)
            dnn.append(functools.partial(linear_fn(torch.ops.mkldnn._reorder_linear_weight(w, rows), b), xs[k]))
            mkl.append(functools.partial(mkl_linear, xs[k], torch.ops.mkl._mkl_reorder_linear_weight(w, rows), w, b,
                                         rows))
    t_mkl, t_dnn, ratio = _bench_pair(lambda: [f() for f in mkl], lambda: [f() for f in dnn], rounds=MARGIN_ROUNDS)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"mkl_over_onednn": ratio, "mkl_s": t_mkl, "onednn_s": t_dnn, "threads": n,
                          "rows": rows, "shapes": [list(s) for s in MARGIN_SHAPES], "copies": copies,
                          "torch": torch.__version__}, "the GEMM margin calibration")
    except (HetforgeError, OSError):
        pass
    return ratio

PACK_ROWS = 512  # the widest row count _alike compares a 2-row packing with

_packed: dict[tuple, dict[int, torch.Tensor]] = {}  # (the weight's memory, weight_t, kind) -> rows -> packed copy
_hint_free: dict[tuple, bool] = {}  # (dtype, shape, weight_t, kind) -> whether packing ignores the row count >= 2
_choices: dict[tuple, str] = {}  # choice key -> the kernel that runs it (KERNELS)
_choice_times: dict[tuple, tuple[float, float, float, str]] = {}
_scratch: list[torch.Tensor] = []  # packing(): the buffer a burst copies transposed weights through
_pinned: list[int] = []  # pin_threads: the thread count choices are made for, instead of this process's


class ChoiceRefused(RuntimeError):
    """A kernel choice would have to be measured where measuring is refused (:func:`pin_threads`)."""


def threads() -> int:
    """The thread count kernel choices are keyed by: :func:`pin_threads`'s, else torch's."""
    return _pinned[0] if _pinned else torch.get_num_threads()


def pin_threads(n: int) -> None:
    """Make choices (and everything keyed by :func:`threads`) for ``n`` threads while this process runs another
    count, and refuse to measure: a process building a program for another one (:mod:`hetforge.runtime.ahead`'s
    child, on one thread) takes the choices it inherited, and raises :class:`ChoiceRefused` where one is missing
    (the other process then builds that program itself)."""
    _pinned[:] = [n]


def available() -> bool:
    """Whether this torch has oneDNN's packed linear (every x86/ARM CPU wheel does)."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


def dtype_ok(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs ``dtype`` on this CPU: fp32 everywhere; bf16 only where oneDNN has its
    bf16 kernels (x86: AVX512BW/VL/DQ or AVX-NE-CONVERT), since elsewhere packing a bf16 weight raises."""
    return dtype in DTYPES and available() and (dtype != torch.bfloat16 or _bf16_kernels())


@functools.cache
def _bf16_kernels() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def mkl_available() -> bool:
    """Whether this torch has MKL's packed sgemm as an op (``torch.ops.mkl._mkl_linear``; torch built with MKL)."""
    try:
        return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_linear") \
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


def policy() -> str:
    """The kernel policy from ``HETFORGE_GEMM`` (``auto`` when unset or unknown)."""
    p = os.environ.get("HETFORGE_GEMM", "auto").strip().lower()
    return p if p in POLICIES else "auto"


def _drop(key: tuple) -> None:
    _packed.pop(key, None)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a packed (mkldnn-layout) tensor as a uint8 view (no copy); valid while ``t`` lives."""
    import ctypes

    n = torch.ops.mkldnn._nbytes(t)
    return torch.frombuffer((ctypes.c_uint8 * n).from_address(torch.ops.mkldnn.data_ptr(t)), dtype=torch.uint8)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bytes(a), _bytes(b))


def _reorder(w: torch.Tensor, weight_t: bool, rows: int, kind: str = "onednn") -> torch.Tensor:
    if kind == "panel":  # the native panel layout, made from either layout directly (no transpose first)
        return native.pack_panels(w.contiguous(), weight_t)
    if kind == "amx":  # the AMX tile layout, made from either layout directly
        return native.pack_amx_bf16(w, weight_t)
    if kind == "bf16panel":  # the bf16 panel layout, likewise
        return native.pack_bf16_panels(w, weight_t)
    src = w.t() if weight_t else w
    if not src.is_contiguous() and (_scratch or weight_t and native.library() is not None or kind == "mkl"):
        if _scratch:
            buf = _scratch[0]
            if buf.numel() < src.numel() or buf.dtype != src.dtype:
                buf = _scratch[0] = torch.empty(src.numel(), dtype=src.dtype)
            dst = buf[:src.numel()].view(src.shape)
        else:
            dst = torch.empty(src.shape, dtype=src.dtype)
        src = dst if weight_t and native.transpose_into(w, dst) else dst.copy_(src)
    if kind == "mkl":  # MKL's packed B of ``cblas_sgemm_pack`` (an opaque tensor of the weight's size), packed for
        # at least PACK_ROWS rows whatever row count asks first: the products are the same bits for any hint, but a
        # packing for a few rows ran 128 rows up to 2x slower, while one for 512 ran every count from 16 to 512
        # within ~10% of its own best (measured; docs/arch/runtime.md)
        return torch.ops.mkl._mkl_reorder_linear_weight(src, max(rows, PACK_ROWS))
    return torch.ops.mkldnn._reorder_linear_weight(src, rows)  # reads any strides


def pack(w: torch.Tensor, weight_t: bool, rows: int, kind: str) -> torch.Tensor:
    """A fresh packing of ``w`` for ``kind`` (:data:`KERNELS` but ``aten``), made as the executor's are (calibration
    times kernels on such copies), without :func:`packed_weight`'s sharing."""
    return _reorder(w, weight_t, rows, kind)


@contextlib.contextmanager
def packing() -> Iterator[None]:
    """A burst of packing (:meth:`hetforge.executor.Executable.prepack`): a ``[K, N]`` weight packed as its
    transpose is first copied to contiguous rows through one buffer, reused for the whole burst and freed after
    it. Why: the reorder read the transposed view slower than contiguous rows, and a fresh ``contiguous()`` copy
    per weight gained nothing in a fresh process (both measured in an earlier session), where the reused buffer
    did (measured on gpt2's Conv1D weights; docs/arch/runtime.md). The copy is the native tiled transpose where the C
    library is loaded (:func:`hetforge.kernels.native.transpose_into`); outside a burst a ``[K, N]`` weight is
    transposed into a fresh buffer by it, and read as a strided view by the reorder only without the library."""
    _scratch[:] = [torch.empty(0)]
    try:
        yield
    finally:
        _scratch.clear()


def _alike(w: torch.Tensor, weight_t: bool, mine: dict[int, torch.Tensor], kind: str = "onednn") -> bool:
    """Whether a weight of ``w``'s dtype, shape and layout packed for 2 and for :data:`PACK_ROWS` rows is the same
    (then, taken as alike for every count between, one packed copy serves every count >= 2); checked once per
    kernel, dtype, shape and layout, reusing the packings of ``w`` already made (``mine``). oneDNN: the packed
    bytes are equal. MKL (whose opaque packed tensor's bytes are not comparable): the product of :data:`PACK_ROWS` rows
    on either packing gives the same bits."""
    key = (w.dtype, tuple(w.shape), weight_t, kind)
    if kind in ("panel", "amx", "bf16panel"):  # their layouts do not depend on the row count
        return True
    if key not in _hint_free:
        try:
            lo, hi = (mine.get(r) if r in mine else _reorder(w, weight_t, r, kind) for r in (2, PACK_ROWS))
            if kind == "mkl":
                k = int(w.shape[0] if weight_t else w.shape[1])
                x = torch.randn(PACK_ROWS, k, generator=torch.Generator().manual_seed(0)).to(w.dtype)
                ori = w.t() if weight_t else w
                lo_y, hi_y = (mkl_linear(x, p, ori, None, PACK_ROWS) for p in (lo, hi))
                _hint_free[key] = torch.equal(lo_y, hi_y)
            else:
                _hint_free[key] = _same_bytes(lo, hi)
        except (AttributeError, RuntimeError):  # no way to compare the packings here: one pack per row count
            _hint_free[key] = False
    return _hint_free[key]


def mkl_linear(x: torch.Tensor, packed: torch.Tensor, ori: torch.Tensor, bias: torch.Tensor | None,
               rows: int) -> torch.Tensor:
    """``x·Wᵀ + b`` on MKL's packed sgemm (``ori``: the ``[N, K]`` weight, whose sizes it reads); ``rows`` must be
    ``x``'s row count, else the op falls back to ATen's ``linear`` on ``ori``."""
    return torch.ops.mkl._mkl_linear(x, packed, ori, bias, rows)


def _memory_key(w: torch.Tensor, weight_t: bool, kind: str) -> tuple:
    """What a packed copy is made of: the weight's memory (storage address, offset, sizes, strides, dtype and
    version counter), its layout and the packing. Why not ``id(w)``: each prefill length's program holds its own
    tensor objects over the model's one storage, so keying by object packed every weight once per prompt length
    (one more model of memory each). An entry is dropped when the tensor that made it dies (:func:`packed_weight`),
    so its address cannot be taken over by another weight while the entry lives; an in-place write to the weight
    bumps its version, so a packing of the old values is never used."""
    try:
        version = w._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot be written in place outside
        version = -1      # inference mode)
    return (w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape), tuple(w.stride()), w.dtype,
            version, weight_t, kind)


def packed_weight(w: torch.Tensor, weight_t: bool, rows: int, kind: str = "onednn") -> torch.Tensor:
    """``w`` (``[N, K]``, or ``[K, N]`` when ``weight_t``) packed for ``rows`` rows (``kind``); made
    once per weight and packing, freed with the weight. The first row count >= 2 a weight is packed for is packed
    as asked, without a check: a program with one prefill length packs each weight once. A second count >= 2
    takes the first one's copy where every count packs alike (:func:`_alike`), else its own. Why: each prefill
    length (fine mode: up to 8 per power of two) would otherwise keep its own packed copy of every weight, for as
    long as the model lives. Programs of several prompt lengths over one model share the copies (:func:`_memory_key`).
    ``kind``: ``onednn`` (oneDNN's blocked layout), ``mkl`` (MKL's packed sgemm) or ``panel`` (the native panel
    GEMM's, :func:`hetforge.kernels.native.pack_panels`)."""
    key = _memory_key(w, weight_t, kind)
    mine = _packed.get(key)
    if mine is None:
        mine = _packed[key] = {}
        weakref.finalize(w, _drop, key)
    got = mine.get(rows)
    if got is None:
        made = next((p for r, p in mine.items() if r >= 2), None) if rows >= 2 else None
        got = made if made is not None and _alike(w, weight_t, mine, kind) else _reorder(w, weight_t, rows, kind)
        mine[rows] = got
    return got


class LazyPacked:
    """A weight packed on first use (the first call of the program), not when the program is built: a
    program from the compile cache is runnable without paying the reorder; its first call pays it once."""

    __slots__ = ("kind", "packed", "rows", "w", "weight_t")

    def __init__(self, w: torch.Tensor, weight_t: bool, rows: int, kind: str = "onednn"):
        self.w, self.weight_t, self.rows, self.kind, self.packed = w, weight_t, rows, kind, None

    def get(self) -> torch.Tensor:
        if self.packed is None:
            self.packed = packed_weight(self.w, self.weight_t, self.rows, self.kind)
        return self.packed


def linear_fn(packed: torch.Tensor, bias: torch.Tensor | None,
              act: str = "none") -> Callable[[torch.Tensor], torch.Tensor]:
    """``act(x·Wᵀ + b)`` on the packed weight, as one oneDNN call."""
    attr, scalars, algo = ACT_ATTR[act]
    lp = torch.ops.mkldnn._linear_pointwise.default
    return lambda x: lp(x, packed, bias, attr, scalars, algo)


def _bench_pair(fa: Callable[[], object], fb: Callable[[], object],
                rounds: int = ROUNDS, decide: float | None = None) -> tuple[float, float, float]:
    """``(median time of fa, median time of fb, median of the per-round ratios fa ÷ fb)`` over ``rounds``
    interleaved calls each (wall clock, after two warm-up calls each).

    ``decide``: stop as soon as a majority of ``rounds`` ratios lies on one side of it (above, or at/below): the
    median of all ``rounds`` would then be on that side too whatever the other rounds measure, so the answer to
    "median ratio > decide" is the one the full run gives, at 3 rounds of 5 where the kernels clearly differ."""
    for _ in range(2):
        fa()
        fb()
    ta, tb, ratio = [], [], []
    majority = rounds // 2 + 1
    for _ in range(rounds):
        t0 = time.perf_counter()
        fa()
        t1 = time.perf_counter()
        fb()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
        ratio.append((t1 - t0) / max(t2 - t1, 1e-9))
        if decide is not None:
            above = sum(r > decide for r in ratio)
            if above >= majority or len(ratio) - above >= majority:
                break
    return statistics.median(ta), statistics.median(tb), statistics.median(ratio)


# what ATen runs after its ``linear`` for an activation oneDNN fuses as a post-op (hetforge::linear_act's path)
ATEN_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda y: y, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "silu": F.silu,
}


# the activation run in place on MKL's fresh product (no second tensor per call): native.act_inplace (the native
# vectorized pass where it has the activation, else ATen's in-place op)
MKL_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    act: (lambda y: y) if act == "none" else functools.partial(native.act_inplace, act=act)
    for act in ("none", "relu", "gelu", "gelu_tanh", "silu")
}


def _candidate(rows: int, dtype: torch.dtype) -> bool:
    """Whether a product of ``rows`` rows in ``dtype`` may run packed at all (one fp32 row: the native GEMV's)."""
    return rows >= 1 and not (rows < 2 and dtype == torch.float32) and dtype_ok(dtype)


def pick(rows: int, k: int, n: int, dtype: torch.dtype, w: torch.Tensor | None = None,
         weight_t: bool = False, act: str = "none") -> str:
    """Which kernel runs ``act([rows, k] × [k, n] + b)`` on this host (:data:`KERNELS`): ``onednn`` (the packed
    oneDNN kernel, the activation fused as a post-op), ``mkl`` (MKL's packed sgemm, then the activation),
    ``panel`` (the native panel GEMM, then the activation: fp32 row counts :func:`panel_rows` takes, by rule),
    ``amx`` (the native AMX bf16 kernel, then the activation: :func:`amx_rows`, by rule), ``bf16panel`` (the
    native AVX512-BF16 kernel where AMX is absent: :func:`bf16_panel_rows`, by rule) or
    ``aten`` (ATen's ``linear``, then the activation), ``dnnact`` (oneDNN's plain product, then the native
    activation pass :func:`hetforge.kernels.native.act_inplace`: where oneDNN's own post-op for it was the slower of
    the two in the same timing). Otherwise measured once per shape, dtype, activation and
    thread count (see the module docstring): oneDNN against the other side, which is MKL's packed sgemm for fp32
    where this torch has it (:func:`mkl_available`; not timed against ATen's ``linear``, which takes the weight as
    stored), else ATen. The activation is part of what is timed: in bf16
    ATen's plain product is about as fast as oneDNN's, and comparing products alone let a noisy round pick the
    ATen path whose separate activation pass then cost more than the product. One fp32 row is the native GEMV's
    (:mod:`hetforge.kernels.native`); one bf16 row is measured here only where the native bf16 GEMV cannot run it
    (lowering tries that first: :func:`hetforge.ir.kernel_choice._native_gemv_fits`)."""
    if not _candidate(rows, dtype):
        return "aten"
    other = "mkl" if dtype == torch.float32 and mkl_available() else "aten"
    pol = policy()
    if pol == "panel":
        return "panel" if dtype == torch.float32 and native.panel_available() else "aten"
    if pol != "auto":
        return "onednn" if pol == "onednn" else other if pol == "mkl" else "aten"
    if panel_rows(rows, dtype):
        return "panel"
    if amx_rows(rows, dtype):
        return "amx"
    if bf16_panel_rows(rows, k, dtype):
        return "bf16panel"

    def measure() -> tuple[str, tuple[float, float, float, str]]:
        x, (wt,) = _probe(rows, k, n, dtype, [None if w is None else w.t() if weight_t else w])
        wc, m = wt.contiguous(), wt.shape[0]
        b = torch.zeros(m, dtype=dtype)
        pk = torch.ops.mkldnn._reorder_linear_weight(wc, rows)
        fused = linear_fn(pk, b, act if act in ACT_ATTR else "none")
        dnn, dnn_call = "onednn", lambda: fused(x)
        if act != "none" and dtype == torch.float32 and native.epilogue_act(act):
            plain, after = linear_fn(pk, b), MKL_ACT[act]
            passed = lambda: after(plain(x))  # noqa: E731
            if _bench_pair(passed, dnn_call, decide=1.0)[2] < 1.0:  # the post-op was the slower
                dnn, dnn_call = "dnnact", passed
        if other == "mkl":  # as the executor runs it: the activation in place on MKL's result
            mk, post = torch.ops.mkl._mkl_reorder_linear_weight(wc, rows), MKL_ACT.get(act, MKL_ACT["none"])
            side = lambda: post(mkl_linear(x, mk, wc, b, rows))  # noqa: E731
        else:
            post = ATEN_ACT.get(act, ATEN_ACT["none"])
            side = lambda: post(F.linear(x, wt, b))  # noqa: E731
        t_side, t_dnn, ratio = _bench_pair(side, dnn_call, decide=1.0)
        won = _decide(ratio, other)
        return (dnn if won == "onednn" else won), (t_side, t_dnn, ratio, "mkl-packed" if other == "mkl" else "aten")

    return _measured((rows, k, n, dtype, threads(), act),
                     f"the kernel choice for [{rows}, {k}] x [{k}, {n}] {dtype}", measure)


def _measured(key: tuple, what: str, measure: Callable[[], tuple[str, tuple[float, float, float, str]]]) -> str:
    """The kernel choice ``key`` names (:func:`pick`'s and :func:`gated_pick`'s): measured once per process by
    ``measure`` (the kernel, and the timing :func:`measured_choices` reports: the other side's and oneDNN's median
    seconds, the median ratio and the other side's name), taken from an earlier process (:func:`seed_choices`), or
    refused where this process builds for another (:func:`pin_threads`: :class:`ChoiceRefused`, ``what`` naming
    it)."""
    if key not in _choices:
        if _pinned:
            raise ChoiceRefused(f"{what} at {threads()} threads is not measured in this process, and measuring here "
                                "is refused")
        _choices[key], _choice_times[key] = measure()
    return _choices[key]


def _probe(rows: int, k: int, n: int, dtype: torch.dtype,
           weights: list[torch.Tensor | None]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A choice's timing operands: a seeded random X ``[rows, k]`` in ``dtype`` and each ``[n, k]`` weight's first
    :data:`PROBE_N` rows (a seeded random one in its place where None): a wide product (an LM head) is timed on its
    first PROBE_N outputs, the same kernel."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g).to(dtype)
    m = min(n, PROBE_N)
    return x, [torch.randn(m, k, generator=g).to(dtype) if w is None else w[:m] for w in weights]


GATED = "gated:"  # the activation slot of a gated MLP's gate-and-up choice: GATED + its activation (gated_pick)


def gated_pick(rows: int, k: int, n: int, dtype: torch.dtype, act: str, wg: torch.Tensor | None = None,
               wu: torch.Tensor | None = None) -> str:
    """How a gated MLP's gate and up products, ``act(x·Wgᵀ) * (x·Wuᵀ)`` over ``[rows, k]`` × ``[k, n]``, run where
    :func:`pick` put its products on oneDNN: ``onednn`` (the gate with the activation as a post-op, then the up
    product with the gate's result as a ``mul`` post-op: two calls) or ``panel`` (the native panel GEMM's gated
    kernel, :func:`hetforge.kernels.native.gemm_panel_gated`: both products in one call, the activation and the
    product applied as the sums are stored). Measured as :func:`pick` measures, once per shape, activation and
    thread count (interleaved rounds, the median per-round ratio panel ÷ oneDNN, above 1: oneDNN), and kept with
    :func:`pick`'s choices under the activation ``GATED + act`` (so a compile-cache entry carries it,
    :func:`seed_choices`). fp32 only, where the library's panel kernel runs and its epilogue has ``act``; the
    down product stays on oneDNN either way. Why: oneDNN's ``mul`` post-op reads the gate's whole result back
    while the up product runs, where the gated kernel multiplies the two sums while both are in registers."""
    if dtype != torch.float32 or policy() != "auto" or not native.panel_available() \
            or not native.epilogue_act(act) or act not in ACT_ATTR:
        return "onednn"

    def measure() -> tuple[str, tuple[float, float, float, str]]:
        x, ws = _probe(rows, k, n, dtype, [wg, wu])
        ws = [w.contiguous() for w in ws]
        pg, pu = (torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws)
        qg, qu = (native.pack_panels(w) for w in ws)
        lp, lb = torch.ops.mkldnn._linear_pointwise.default, torch.ops.mkldnn._linear_pointwise.binary
        attr, sc, algo = ACT_ATTR[act]
        t_side, t_dnn, ratio = _bench_pair(lambda: native.gemm_panel_gated(x, qg, qu, None, None, len(ws[0]), act),
                                           lambda: lb(x, lp(x, pg, None, attr, sc, algo), pu, None, "mul"),
                                           decide=1.0)
        return ("onednn" if ratio > 1.0 else "panel"), (t_side, t_dnn, ratio, "panel-gated")

    return _measured((rows, k, n, dtype, threads(), GATED + act),
                     f"the gated-MLP choice for [{rows}, {k}] x [{k}, {n}]", measure)


def panel_rows(rows: int, dtype: torch.dtype) -> bool:
    """Whether an fp32 product of ``rows`` rows runs on the native panel GEMM without measuring: ``rows`` within
    :data:`hetforge.kernels.native.PANEL_MIN`..``PANEL_MAX``, where it was the fastest kernel with the weights read
    from memory (bench/panel_gemm.py, on shapes no evaluated model has), and the library vectorized here. Not
    timed by :func:`pick`: its timing reuses one weight from cache, where the panel GEMM's prefetch of the next
    panel buys nothing, while a prefill reads each weight from memory once."""
    return dtype == torch.float32 and native.PANEL_MIN <= rows <= native.PANEL_MAX and native.panel_available()


def amx_rows(rows: int, dtype: torch.dtype) -> bool:
    """Whether a bf16 product of ``rows`` rows runs on the native AMX kernel (:func:`native.gemm_amx_bf16`) without
    measuring: 2..:data:`hetforge.kernels.native.AMX_ROWS_MAX` rows, where it was faster than oneDNN on every
    calibration shape with the weights read from memory (bench/bf16_rows.py), and AMX runs here.
    Not timed by :func:`pick`, for :func:`panel_rows`'s reason: that timing reads one weight from cache."""
    return dtype == torch.bfloat16 and 2 <= rows <= native.AMX_ROWS_MAX and native.amx_bf16_available()


def bf16_panel_rows(rows: int, k: int, dtype: torch.dtype) -> bool:
    """Whether a bf16 product of ``rows`` rows runs on the native AVX512-BF16 panel kernel
    (:func:`native.gemm_bf16_panel`) without measuring: :data:`hetforge.kernels.native.BF16_PANEL_ROWS_MIN`..
    :data:`hetforge.kernels.native.BF16_PANEL_ROWS_MAX` rows,
    where it was faster than oneDNN on every calibration shape with the weights read from memory
    (bench/bf16_rows.py --kernel panel), K even, and AVX512-BF16 runs here but AMX does not (:func:`amx_rows` first).
    Not timed by :func:`pick`, for :func:`panel_rows`'s reason."""
    return dtype == torch.bfloat16 and native.BF16_PANEL_ROWS_MIN <= rows <= native.BF16_PANEL_ROWS_MAX \
        and k % 2 == 0 \
        and native.bf16_panel_available() and not native.amx_bf16_available()


def choose(rows: int, k: int, n: int, dtype: torch.dtype, w: torch.Tensor | None = None,
           weight_t: bool = False, act: str = "none") -> bool:
    """Whether a packed kernel (oneDNN, MKL, the panel GEMM, AMX or the bf16 panel kernel: :func:`pick`) runs this
    product, not ATen's ``linear``."""
    return pick(rows, k, n, dtype, w, weight_t, act) != "aten"


def decided(rows: int, k: int, n: int, dtype: torch.dtype, act: str = "none") -> bool | None:
    """What :func:`choose` answers for this product without measuring: None when it has not been measured in
    this process (nor seeded, :func:`seed_choices`) and the policy is ``auto``; a kernel chosen by rule (the
    panel GEMM, AMX, the bf16 panel kernel) is answered."""
    by_rule = panel_rows(rows, dtype) or amx_rows(rows, dtype) or bf16_panel_rows(rows, k, dtype)
    if policy() == "auto" and _candidate(rows, dtype) and not by_rule \
            and (rows, k, n, dtype, threads(), act) not in _choices:
        return None
    return pick(rows, k, n, dtype, act=act) != "aten"  # answered without measuring: forced, no candidate, or known


RESIDUAL = "residual:"  # the activation slot of a residual-add choice: RESIDUAL + "bias" or "none" (residual_pick)


def residual_pick(rows: int, k: int, n: int, dtype: torch.dtype, bias: bool, w: torch.Tensor | None = None) -> str:
    """Who adds the residual after a oneDNN product ``x·Wᵀ (+ b)`` of ``[rows, k]`` × ``[k, n]``: ``onednn`` (its
    ``add`` post-op, ``_linear_pointwise.binary``, one call) or ``aten`` (the product alone, then ATen's add of the
    residual: the program's own add instruction). The same bits either way (oneDNN rounds the product, then adds).
    Measured as :func:`pick` measures (interleaved rounds, the median per-round ratio separate ÷ post-op, above 1:
    the post-op), once per shape, bias or not, dtype and thread count, and kept with :func:`pick`'s choices under
    the activation ``RESIDUAL + "bias" | "none"``; each round reads another of four residuals, so the add reads
    one the previous call did not. Outside ``auto`` (:func:`policy`): the post-op, as before this choice. Why:
    the post-op reads the residual's tiles as each block of the product is stored, and which of the two is faster
    differs by shape and host (the measurements are in docs/arch/runtime.md, session 50)."""
    if policy() != "auto":
        return "onednn"

    def measure() -> tuple[str, tuple[float, float, float, str]]:
        x, (wp,) = _probe(rows, k, n, dtype, [w])
        m = wp.shape[0]
        pk = torch.ops.mkldnn._reorder_linear_weight(wp.contiguous(), rows)
        g = torch.Generator().manual_seed(1)
        b = torch.randn(m, generator=g).to(dtype) if bias else None
        res = [torch.randn(rows, m, generator=g).to(dtype) for _ in range(4)]
        out, turn = torch.empty(rows, m, dtype=dtype), itertools.cycle(res)
        lp, lb = torch.ops.mkldnn._linear_pointwise.default, torch.ops.mkldnn._linear_pointwise.binary
        t_side, t_dnn, ratio = _bench_pair(lambda: torch.add(lp(x, pk, b, "none", [], ""), next(turn), out=out),
                                           lambda: lb(x, next(turn), pk, b, "add"), decide=1.0)
        return ("onednn" if ratio > 1.0 else "aten"), (t_side, t_dnn, ratio, "aten-add")

    return _measured((rows, k, n, dtype, threads(), RESIDUAL + ("bias" if bias else "none")),
                     f"the residual-add choice for [{rows}, {k}] x [{k}, {n}]", measure)


def measured_choices() -> list[dict]:
    """The choices :func:`pick` measured in this process: rows, K, N, dtype, threads, activation, median seconds
    of each side (``aten_s``: the side oneDNN is timed against, ``aten_side`` names it: MKL's packed sgemm or
    ATen's ``linear``), ``ratio`` (median per-round that side ÷ oneDNN time, what decided), ``kernel`` (what
    runs) and ``onednn`` (whether oneDNN does)."""
    return [{"rows": k[0], "k": k[1], "n": k[2], "dtype": str(k[3]).removeprefix("torch."), "threads": k[4],
             "act": k[5], "aten_s": t[0], "onednn_s": t[1], "ratio": t[2], "kernel": _choices[k],
             "aten_side": t[3], "onednn": _choices[k] in ("onednn", "dnnact")}
            for k, t in _choice_times.items()]


def gemm_fn(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``a @ b`` (square, ``a`` rows × ``b`` columns) through the packed oneDNN kernel, for calibration: the
    weight is packed once, outside the timed call."""
    pk = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), a.shape[0])
    fn = linear_fn(pk, None)
    return lambda: fn(a)


def mkl_gemm_fn(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``a @ b`` through MKL's packed sgemm (fp32), packed once outside the timed call, as :func:`gemm_fn`."""
    ori = b.t().contiguous()
    pk = torch.ops.mkl._mkl_reorder_linear_weight(ori, a.shape[0])
    return lambda: mkl_linear(a, pk, ori, None, a.shape[0])


def gemm_fns(a: torch.Tensor, b: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
    """The packed kernels the executor may run ``a @ b`` on (:func:`gemm_fn`, and :func:`mkl_gemm_fn` for fp32
    where this torch has it), each where it runs on this CPU and dtype: what calibration times besides ATen."""
    makers = [gemm_fn] if available() else []
    if a.dtype == torch.float32 and mkl_available():
        makers.append(mkl_gemm_fn)
    out = []
    for make in makers:
        try:
            fn = make(a, b)
            fn()
        except RuntimeError:
            continue
        out.append(fn)
    return out


def seed_choices(rows: list[dict]) -> None:
    """Take choices measured by an earlier process (:func:`measured_choices` rows, e.g. from a compile-cache
    entry) for shapes not measured in this one. Rows without an activation (entries written before it was part of
    the choice) are skipped: their product-only timing is what misled the choice."""
    for r in rows:
        try:
            key = (int(r["rows"]), int(r["k"]), int(r["n"]), getattr(torch, r["dtype"]), int(r["threads"]),
                   str(r["act"]))
            kernel = str(r.get("kernel") or ("onednn" if r["onednn"] else "aten"))
            if kernel == "mkl" and not mkl_available() or kernel not in KERNELS:
                continue  # measured where MKL's packed sgemm ran: not a choice this torch can take
            side = str(r.get("aten_side", "aten"))
            if kernel in ("onednn", "mkl", "dnnact") and side == "mkl-packed" and "ratio" in r:
                # the rule of this code, not the one that recorded it (oneDNN's side keeps its recorded way)
                if _decide(float(r["ratio"]), "mkl") == "mkl":
                    kernel = "mkl"
                elif kernel == "mkl":
                    kernel = "onednn"
            if kernel == "dnnact" and not native.epilogue_act(str(r["act"])):
                continue  # oneDNN then the native activation pass: not a choice this library can take
            if key not in _choices and isinstance(key[3], torch.dtype):
                _choices[key] = kernel
                t_aten, t_dnn = float(r["aten_s"]), float(r["onednn_s"])
                _choice_times[key] = (t_aten, t_dnn, float(r.get("ratio", t_aten / max(t_dnn, 1e-12))),
                                      str(r.get("aten_side", "aten")))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
