"""Quantized linear operators: real low-bit matmuls on the CPU, registered like every other op.

The quantization pass (:mod:`hetforge.quant`) replaces float linears with these. Under the default ``q8``
activation modes (``--w8-act``, ``--w4-act``) ``w8`` and ``w4`` run hetforge's native kernels with the activation
quantized per block of 32, one row (decode) and several (prefill) with the same arithmetic: int8·int8
(``hf_gemv_q8a``/``hf_gemm_q8a``) and int4·int8 (``hf_gemv_q4a``/``hf_gemm_q4a``, reading ATen's packed int4 in
place). Under ``weight-only`` (or without the native kernels) one row runs an integer kernel (PyTorch's, or
hetforge's native int8 GEMV) and several rows dequantize the weight once per call and run one float GEMM, because
ATen's weight-only kernels are 10–65× slower than that there (:func:`dequant_rows`); ``w8a8`` stays on FBGEMM's
int8 GEMM:

* ``hetforge::linear_w8(x, qweight int8 [N,K], scales [N], bias?, act)`` — weight-only int8, per output
  channel symmetric: ``aten._weight_int8pack_mm`` (fp32 activations × int8 weights).
* ``hetforge::linear_w4(x, packed uint8 [N,K/2], scales_zeros [K/G,N,2], group_size, bias?, act)`` —
  weight-only int4, group-wise symmetric (zero = 0): ``aten._weight_int4pack_mm_for_cpu`` on the tile layout
  made by ``aten._convert_weight_to_int4pack_for_cpu``. The kernel requires N % 16 == 0, K % G == 0 and
  G in {32, 64, 128, 256}; the pass skips (and reports) layers that do not fit.
* ``hetforge::linear_w8a8(x, qweight int8 [N,K], scales [N], bias?, act)`` — int8 weights and dynamic int8
  activations, each row quantized by its own range (7-bit (``reduce_range``) so AVX2's 16-bit pair sums cannot
  saturate; int32 accumulation) on FBGEMM's ``quantized::linear_dynamic``. FBGEMM measures one range over
  its whole input, so a row's result would depend on the other rows — a prompt's pad rows, another request in
  the batch; each row is therefore given to it as ``c + h·xn`` with ``xn`` spanning exactly [-1, 1]
  (:func:`row_span`) and the product put back as ``h·(xn·Wᵀ) + c·Σ_k W + b``. FBGEMM needs its own packed
  copy of the weight; it is made when a program is built (:func:`prepack_w8a8`, all of a program's weights on
  every thread at once) or else on first use, and cached against the int8 tensor (weakly: it dies with the
  graph).

``act`` is ``none`` or one of :data:`hetforge.ops.fused.ACTIVATIONS`, so fused ``linear_act`` nodes keep their
activation. Every op's ``attrs`` say ``weight_dtype`` (``int8``/``int4``) and ``group: matmul``, which is what
the cost model and the ``rules`` placement read; byte formulas count the int8/packed-int4 weight bytes and
the scales, not an fp32 weight.
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import is_fake

from hetforge.kernels import native
from hetforge.ops.fused import apply_act
from hetforge.ops.registry import OpCall, TensorMeta, register_op

QUANT_ACTS = ("none", "relu", "gelu", "gelu_tanh", "silu")
INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_N_MULTIPLE = 16
_ACT_FLOPS = {"none": 0, "relu": 1, "gelu": 8, "gelu_tanh": 8, "silu": 4}


def _act(y: torch.Tensor, act: str) -> torch.Tensor:
    return y if act == "none" else apply_act(y, act)


def _arg(call: OpCall, i: int, name: str):
    a = call.args[i] if i < len(call.args) else call.kwargs.get(name)
    return a


def _qlinear_flops(call: OpCall) -> float:
    """``2·M·N·K`` + ``M·N`` (bias) + activation (relu 1, silu 4, gelu 8 per output)."""
    x = _arg(call, 0, "x")
    if not isinstance(x, TensorMeta) or not call.outputs:
        return 0.0
    n_out = call.outputs[0].numel
    names = {"hetforge.linear_w4.default": (4, 5)}.get(call.op, (3, 4))
    bias = isinstance(_arg(call, names[0], "bias"), TensorMeta)
    act = _arg(call, names[1], "act") or "none"
    return float(2 * n_out * x.shape[-1] + (n_out if bias else 0) + _ACT_FLOPS.get(str(act), 4) * n_out)


def _qlinear_nbytes(call: OpCall) -> float:
    """Activations in and out at their dtype; weights at int8 (or packed int4, 2 per byte) plus fp32 scales.

    For ``w8a8`` the int8 copy of the activations is written and read once more (``2·M·K`` bytes).
    """
    total = call.bytes_in() + call.bytes_out()  # the weight's TensorMeta is already int8 / uint8-packed
    if call.op == "hetforge.linear_w8a8.default":
        x = _arg(call, 0, "x")
        if isinstance(x, TensorMeta):
            total += 2 * x.numel
    return float(total)


def _out_like(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


# ---------------------------------------------------------------- several rows: dequantize once, float GEMM

DEQUANT_MIN_ROWS = 2  # from this many rows on, w8/w4 dequantize the weight and run one float GEMM


def dequant_rows(x: torch.Tensor) -> bool:
    """Whether a w8/w4 product of ``x`` runs as dequantize + float GEMM: several float rows (a prefill or chunk).

    Why: PyTorch's weight-only int8/int4 CPU kernels are 10–50× slower than the float GEMM for more than one
    row on the hosts measured (docs/bench/quant.md, docs/bench/ttft.md), while dequantizing the weight costs
    one pass over it — small next to ``rows`` passes of a GEMM. The weight stays int8/int4 in memory."""
    return x.is_floating_point() and x.dtype != torch.float16 and x.numel() // max(x.shape[-1], 1) >= DEQUANT_MIN_ROWS


_INT4_LAYOUT: dict[tuple[int, int], tuple[str, object]] = {}  # (N, K) -> ("block", B) or ("gather", index)
_INT4_CHECKED: set[tuple[int, int]] = set()  # shapes whose layout agreed with the kernel on a real weight


def _packed_positions(n: int, k: int) -> torch.Tensor:
    """For each int4 slot of ``_convert_weight_to_int4pack_for_cpu``'s output (low nibble, then high, per byte),
    the flat index of the ``[n, k]`` element it holds: found by packing the base-16 digits of every index."""
    idx = torch.arange(n * k, dtype=torch.long).view(n, k)
    src = torch.zeros(n * k, dtype=torch.long)
    for d in range(max(1, math.ceil(math.log2(max(n * k, 2)) / 4))):
        p = torch.ops.aten._convert_weight_to_int4pack_for_cpu(((idx >> (4 * d)) & 15).to(torch.int32), 1)
        src |= torch.stack([p & 15, p >> 4], dim=-1).reshape(-1).long() << (4 * d)
    return src


def _int4_layout(n: int, k: int) -> tuple[str, object]:
    """Where each int4 value of an ``[n, k]`` weight sits in the packed bytes of this torch build, once per shape:
    ``("block", B)`` when byte ``(b, k, i)`` holds rows ``b·B+i`` (low nibble) and ``b·B+B/2+i`` (high) of column
    ``k`` (what AVX2 builds do with ``B`` = 32 and AVX-512 builds with 64; found on a ``B``-row probe, the sizes
    dividing ``n`` tried from the largest; :func:`dequantize_w4` checks it against the
    kernel on the first weight of each shape), else ``("gather", index)`` from the full shape's positions."""
    key = (n, k)
    if key not in _INT4_LAYOUT:
        found: tuple[str, object] | None = None
        for b in (64, 32, 16):  # every size that divides n, largest first: a build packs blocks of one size
            if n % b == 0:
                probe = _packed_positions(b, k)
                if torch.equal(_block_unpack(probe, b, b, k), torch.arange(b * k).view(b, k)):
                    found = ("block", b)
                    break
        if found is None:
            src = _packed_positions(n, k)
            found = ("gather", torch.argsort(src))
        _INT4_LAYOUT[key] = found
    return _INT4_LAYOUT[key]


def _block_unpack(packed_or_lo: torch.Tensor, b: int, n: int, k: int, hi: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, k]`` from the block layout: the low/high halves as ``[n/b, k, b/2]`` joined and transposed."""
    if hi is None:  # an index tensor (layout check): digit pairs are (low, high) elements of a [n, k/2, 2] view
        v = packed_or_lo.reshape(-1)
        lo, hi = v[0::2], v[1::2]
    else:
        lo = packed_or_lo
    lo = lo.reshape(n // b, k, b // 2)
    hi = hi.reshape(n // b, k, b // 2)
    return torch.cat([lo, hi], dim=2).transpose(1, 2).reshape(n, k)


def dequantize_w4(packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float ``[N, K]`` weight of a ``linear_w4`` (``(q - 8)·scale + zero`` per group, as the kernel computes)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    kind, how = _int4_layout(n, k)
    lo, hi = packed & 15, packed >> 4
    if kind == "block":
        q = _block_unpack(lo, int(how), n, k, hi)
    else:
        q = torch.stack([lo, hi], dim=-1).reshape(-1)[how].view(n, k)
    sz = scales_zeros.to(dtype).transpose(0, 1)  # [N, K/G, 2]: one (scale, zero) per row and group
    w = q.to(dtype).sub_(8).view(n, k // group_size, group_size)
    w.mul_(sz[..., 0:1])
    if bool(scales_zeros[..., 1].any()):  # hetforge's int4 is symmetric (zeros 0): no add then
        w.add_(sz[..., 1:2])
    w = w.view(n, k)
    if (n, k) not in _INT4_CHECKED:  # the probe's layout must hold for the whole weight: one kernel row agrees
        x = torch.randn(1, k, dtype=dtype)
        want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_zeros.to(dtype))
        if not torch.allclose(x @ w.t(), want, rtol=1e-3, atol=1e-3 * float(want.abs().max()) + 1e-6):
            _INT4_LAYOUT[(n, k)] = ("gather", torch.argsort(_packed_positions(n, k)))
            _INT4_CHECKED.add((n, k))
            return dequantize_w4(packed, scales_zeros, group_size, dtype)
        _INT4_CHECKED.add((n, k))
    return w


# ---------------------------------------------------------------- int8 weight-only


def _w8_fake(x, qweight, scales, bias=None, act="none"):
    return _out_like(x, qweight.shape[0])


@register_op(
    "hetforge::linear_w8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias=None, str act='none') -> Tensor",
    flops=_qlinear_flops,
    nbytes=_qlinear_nbytes,
    fake=_w8_fake,
)
def linear_w8(x, qweight, scales, bias=None, act="none"):
    """``act(x·(q·s)ᵀ + b)`` with int8 ``q`` [N,K] and per-channel ``s`` [N]: for one fp32 row the native int8
    GEMV (:mod:`hetforge.kernels.native`: a quarter of the fp32 bytes); for several rows (prefill) under the
    ``q8`` activation mode (:func:`native.w8_act_mode`, the default) the native int8·int8 GEMM with x quantized
    per block of 32, as the decode GEMV does; under ``weight-only`` the weight dequantized once per call and one
    float GEMM (:func:`dequant_rows`); else (no native kernels) ``aten._weight_int8pack_mm``."""
    if native.q8_fits(x, qweight, scales, bias, act):
        return native.gemv_q8(x, qweight, scales, bias, act)
    if x.numel() > x.shape[-1] and native.q8_rows_fit(x, qweight, scales, bias, act) \
            and native.q8_kernel(2) == "hf_gemm_q8a":
        return native.gemm_q8a(x, qweight, scales, bias, act)
    if dequant_rows(x):
        w = qweight.to(x.dtype).mul_(scales.to(x.dtype)[:, None])
        return _act(torch.nn.functional.linear(x, w, bias), act)
    y = torch.ops.aten._weight_int8pack_mm(_flat(x), qweight, scales.to(x.dtype))
    if bias is not None:
        y = y + bias
    return _act(y, act).reshape(*x.shape[:-1], qweight.shape[0])


# ---------------------------------------------------------------- int4 weight-only, group-wise

_W4_WEIGHTS: dict[int, tuple[weakref.ref, tuple, bool]] = {}  # id(packed) -> (ref, versions, native kernels fit)
_W4_LAYOUT_OK: dict[tuple[int, int, int], bool] = {}  # (N, K, G) -> the native kernel agreed with ATen's on a weight


def _w4_layout_agrees(packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> bool:
    """Whether ``hf_gemv_q4a`` reads this build's packed layout as ATen's int4 kernel does, once per shape: on a
    row of x that the q8 blocks hold exactly (integers with ±127 in every block: scale 1), both compute the same
    sums, so they must agree to float rounding; a misread layout gives unrelated numbers."""
    n, k = packed.shape[0], packed.shape[1] * 2
    key = (n, k, group_size)
    if key not in _W4_LAYOUT_OK:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(-127, 128, (1, k), generator=g).float()
        x.view(-1, 32)[:, 0] = 127.0
        sz = scales_zeros.float()
        want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, sz)
        got = native.q4a(x, packed, sz, group_size, None, "none")
        tol = 1e-4 * float(want.abs().max()) + 1e-6
        _W4_LAYOUT_OK[key] = bool(torch.allclose(got, want, rtol=1e-4, atol=tol))
    return _W4_LAYOUT_OK[key]


def w4_weight_fits(packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> bool:
    """Whether a w4 weight can run on hetforge's native int4 kernels (``hf_gemv_q4a``/``hf_gemm_q4a``): packed
    uint8 ``[N, K/2]`` and fp32 ``[K/G, N, 2]`` with zeros 0 (symmetric, as hetforge quantizes), contiguous real
    CPU tensors, N a multiple of the kernels' row block (:func:`native.q4_row_block`), G a multiple of 32, this
    torch build's layout the block layout the kernels read (:func:`_int4_layout`, then checked against ATen's
    kernel once per shape). Cached per weight."""
    if not isinstance(group_size, int) or group_size < 32 or group_size % 32 or packed.dim() != 2 \
            or packed.dtype != torch.uint8 or not native._f32(scales_zeros) or not packed.is_contiguous() \
            or packed.device.type != "cpu" or is_fake(packed):
        return False
    n, k, block = packed.shape[0], packed.shape[1] * 2, native.q4_row_block()
    if n % block or k % group_size or tuple(scales_zeros.shape) != (k // group_size, n, 2):
        return False
    versions = (packed._version, scales_zeros._version, id(scales_zeros))
    hit = _W4_WEIGHTS.get(id(packed))
    if hit is not None and hit[0]() is packed and hit[1] == versions:
        return hit[2]
    ok = _int4_layout(n, k) == ("block", block) and not bool(scales_zeros[..., 1].any()) \
        and _w4_layout_agrees(packed, scales_zeros, group_size)

    def forget(ref: weakref.ref, i: int = id(packed)) -> None:
        if _W4_WEIGHTS.get(i, (None,))[0] is ref:
            del _W4_WEIGHTS[i]

    _W4_WEIGHTS[id(packed)] = (weakref.ref(packed, forget), versions, ok)
    return ok


def w4_native_fits(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
                   bias: torch.Tensor | None, act: str) -> bool:
    """Whether ``hetforge::linear_w4`` of fp32 rows ``x`` runs on the native int4·int8 kernels: the ``q8``
    activation mode on a build with their VNNI or AVX2 path (:func:`native.q4_kernel`), a known activation,
    contiguous fp32 x (and bias), and a weight they read (:func:`w4_weight_fits`)."""
    if x.dim() < 1 or act not in native.ACT_CODES or packed.dim() != 2 or x.shape[-1] != packed.shape[1] * 2:
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (native.q4_kernel(rows) is not None and native._f32(x, bias)
            and (bias is None or bias.numel() == packed.shape[0]) and w4_weight_fits(packed, scales_zeros, group_size))



def _w4_fake(x, packed, scales_zeros, group_size, bias=None, act="none"):
    return _out_like(x, packed.shape[0])


@register_op(
    "hetforge::linear_w4(Tensor x, Tensor packed, Tensor scales_zeros, int group_size, Tensor? bias=None, "
    "str act='none') -> Tensor",
    flops=_qlinear_flops,
    nbytes=_qlinear_nbytes,
    fake=_w4_fake,
)
def linear_w4(x, packed, scales_zeros, group_size, bias=None, act="none"):
    """``act(x·Wᵀ + b)`` with ``W`` group-wise int4 (packed): under the ``q8`` activation mode
    (:func:`native.w4_act_mode`, the default) hetforge's native int4·int8 kernels with x quantized per block of 32
    (one row and several alike, :func:`w4_native_fits`); else ``aten._weight_int4pack_mm_for_cpu`` for one row,
    and for several rows (prefill) the weight unpacked and dequantized once per call and one float GEMM
    (:func:`dequant_rows`)."""
    if w4_native_fits(x, packed, scales_zeros, group_size, bias, act):
        return native.q4a(x, packed, scales_zeros, group_size, bias, act)
    if dequant_rows(x):
        w = dequantize_w4(packed, scales_zeros, group_size, x.dtype)
        return _act(torch.nn.functional.linear(x, w, bias), act)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(_flat(x), packed, group_size, scales_zeros.to(x.dtype))
    if bias is not None:
        y = y + bias
    return _act(y, act).reshape(*x.shape[:-1], packed.shape[0])


# ---------------------------------------------------------------- int8 weights, dynamic int8 activations


@dataclass
class _FbgemmPack:
    """One FBGEMM packing of an int8 weight, and the scale and bias tensors it serves (see :func:`_fbgemm_packed`)."""

    ref: weakref.ref  # the int8 weight, weakly held (its death drops the entry)
    version: int  # the weight's version when packed
    packed: object  # packed without the bias (linear_w8a8 adds it after putting each row's range back)
    wsum: torch.Tensor  # Σ_k of each dequantized weight row [N]: what a row's centre c adds (c·wsum)
    scales: torch.Tensor  # a copy of the values packed in
    seen: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (scales, its version) of each caller's
    # tensors known to hold those values; held, so no id is reused


_FBGEMM_PACKS: dict[int, _FbgemmPack] = {}  # id(qweight) -> its packing
FBGEMM_CALLERS = 8  # callers' tensors known per packing (a caller passing fresh equal tensors each call is compared)


def _fbgemm_packed(qweight: torch.Tensor, scales: torch.Tensor) -> _FbgemmPack:
    """FBGEMM's packed weight for ``qweight`` (and its row sums): made on first need, cached until the int8 tensor
    dies or changes.

    The scales are matched by value, not by identity: two programs of one model (a prefill and a decode
    program, each bound from its own compile-cache entry) hold equal scales as separate small tensors with one
    shared int8 weight, and a cache keyed by their identity re-packed every linear on every call as the
    programs took turns (a cached w8a8 program's prefill ran about 20 times slower). A caller's tensor is
    compared with the packed values once, and then known by identity and version; a changed value packs again."""
    hit = _FBGEMM_PACKS.get(id(qweight))
    if hit is not None and hit.ref() is qweight and hit.version == qweight._version:
        for s, sv in hit.seen:
            if s is scales and sv == scales._version:
                return hit
        if torch.equal(scales, hit.scales):
            hit.seen = [*hit.seen[-(FBGEMM_CALLERS - 1):], (scales, scales._version)]  # the latest few
            return hit
    zeros = torch.zeros(qweight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch deprecates quantized tensors; FBGEMM's prepack still needs one
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        qw = torch._make_per_channel_quantized_tensor(qweight, scales.double(), zeros, 0)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    lib = native.library() is not None and qweight.is_contiguous() and qweight.dim() == 2
    sums = native.i8_row_sums(qweight) if lib else qweight.sum(1, dtype=torch.int64)  # exact either way
    wsum = (sums.double() * scales.double()).float()

    def forget(ref: weakref.ref, i: int = id(qweight)) -> None:
        got = _FBGEMM_PACKS.get(i)
        if got is not None and got.ref is ref:
            del _FBGEMM_PACKS[i]

    entry = _FbgemmPack(weakref.ref(qweight, forget), qweight._version, packed, wsum, scales.clone(),
                        [(scales, scales._version)])
    _FBGEMM_PACKS[id(qweight)] = entry
    return entry


def prepack_w8a8(calls: list[tuple[tuple, dict]], tensor, threads: int) -> int:
    """FBGEMM's packings for a program's ``hetforge::linear_w8a8`` calls (``calls``: each call's args and kwargs;
    ``tensor`` maps an argument to its weight tensor, None when it is not one), made now instead of in the first
    request: returns how many were packed. Several weights are packed on ``threads`` threads at once: FBGEMM's
    prepacking of one weight uses one thread, and two Python threads packing at once took less time than one
    (docs/arch/quant.md has the figures)."""
    todo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for args, kwargs in calls:
        q = tensor(args[1] if len(args) > 1 else kwargs.get("qweight"))
        s = tensor(args[2] if len(args) > 2 else kwargs.get("scales"))
        if isinstance(q, torch.Tensor) and isinstance(s, torch.Tensor) and q.device.type == "cpu" \
                and q.dtype == torch.int8 and q.dim() == 2 and not is_fake(q):
            hit = _FBGEMM_PACKS.get(id(q))
            if hit is None or hit.ref() is not q or hit.version != q._version:
                todo.setdefault(id(q), (q, s))
    work = sorted(todo.values(), key=lambda qs: -qs[0].numel())  # the largest first: the threads end together
    if len(work) > 1 and threads > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(threads, len(work))) as pool:
            list(pool.map(lambda qs: _fbgemm_packed(*qs), work))
    else:
        for q, s in work:
            _fbgemm_packed(q, s)
    return len(work)


def row_span(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` [m, k] (k ≥ 2) as ``c + h·xn``, ``xn`` spanning exactly [-1, 1] (1 at the row's first
    maximum, -1 at its first minimum): ``(xn, ch = [c, h] per row)``. The ATen form of ``hf_row_span`` (same
    arithmetic, :func:`native.row_span`), for hosts without the native kernels. A constant row has ``h = 0``, a
    row with NaN/±Inf ``c = h = NaN``; either gets ``xn = 0`` but for ``1, -1`` at its start."""
    mx, imx = x.max(1, keepdim=True)
    mn, imn = x.min(1, keepdim=True)
    c, h = mx * 0.5 + mn * 0.5, mx * 0.5 - mn * 0.5
    bad = ~x.isfinite().all(1, keepdim=True)
    flat = bad | ~(h > 0)
    xn = ((x - c) * (1.0 / torch.where(flat, 1.0, h))).clamp_(-1.0, 1.0)
    xn = xn.scatter_(1, imx, 1.0).scatter_(1, imn, -1.0).masked_fill_(flat, 0.0)
    xn[:, :2] = torch.where(flat, torch.tensor([1.0, -1.0]), xn[:, :2])
    return xn, torch.where(bad, float("nan"), torch.cat([c, torch.where(flat, 0.0, h)], 1))


@register_op(
    "hetforge::linear_w8a8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias=None, str act='none') -> Tensor",
    flops=_qlinear_flops,
    nbytes=_qlinear_nbytes,
    fake=_w8_fake,  # same output as w8
)
def linear_w8a8(x, qweight, scales, bias=None, act="none"):
    """int8 × int8 → int32 matmul with dynamic int8 activations, each row by its own range: FBGEMM
    ``quantized::linear_dynamic`` on the rows spanned onto [-1, 1] (:func:`row_span`, ``hf_row_span``), then
    ``h·y + c·Σ_k W + b`` per row."""
    pack = _fbgemm_packed(qweight, scales)
    xf = _flat(x).float()
    b = None if bias is None else bias.float().contiguous()
    if xf.shape[1] < 2:  # a row of one value cannot hold both ends: FBGEMM gets one row at a time
        y = torch.cat([torch.ops.quantized.linear_dynamic(r, pack.packed, True) for r in xf.split(1)])
        y = y if b is None else y + b
    elif native.library() is not None and not torch._C._len_torch_dispatch_stack():  # xf: dense fp32, real
        xn, ch = native.row_span(xf)
        y = native.row_unspan_(torch.ops.quantized.linear_dynamic(xn, pack.packed, True), ch, pack.wsum, b)
    else:
        xn, ch = row_span(xf)
        y = torch.addcmul(torch.ops.quantized.linear_dynamic(xn, pack.packed, True) * ch[:, 1:], ch[:, :1], pack.wsum)
        y = y if b is None else y + b
    return _act(y, act).to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


QUANT_OPS = {"w8": linear_w8, "w4": linear_w4, "w8a8": linear_w8a8}


def int8_decomposition(x, qweight, scales, bias=None, act="none"):
    """``w8``/``w8a8`` as ATen for backends with their own int8 handling (OpenVINO): ``Convert(i8)·scale → linear``.

    This is the pattern OpenVINO's CPU plugin executes with compressed int8 weights; hetforge's own CPU kernel
    is the registered one above. (``w4``'s packed tile layout has no ATen unpacking op, so it has none.)
    """
    w = qweight.to(x.dtype) * scales.to(x.dtype)[:, None]
    return _act(torch.nn.functional.linear(x, w, bias), act)


def q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its last dimension quantized per block of 32 and dequantized, in ATen ops: the activation the
    native ``q8`` kernels multiply (``hf_quantize_q8_blocks``: scale ``amax/127``, ``round(x/scale)`` half to even,
    clamped to ±127, a zero block stays zero, a block with NaN/±Inf becomes NaN)."""
    k = x.shape[-1]
    pad = -k % 32
    xb = torch.nn.functional.pad(x, (0, pad)) if pad else x
    xb = xb.reshape(*x.shape[:-1], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.round(xb * inv).clamp(-127.0, 127.0)
    y = (q * d).reshape(*x.shape[:-1], -1)
    return y[..., :k] if pad else y


def w8_decomposition(x, qweight, scales, bias=None, act="none"):
    """``w8`` as ATen for OpenVINO, with the activation arithmetic of hetforge's own CPU kernels: under the ``q8``
    activation mode (:func:`native.w8_act_mode`, read when the partition is compiled) x quantized per block of 32
    (:func:`q8_blocks`) before ``Convert(i8)·scale → linear``, so a placed program computes one w8 arithmetic on
    every backend (to float rounding); under ``weight-only`` x stays float."""
    if native.w8_act_mode() == "q8":
        x = q8_blocks(x)
    return int8_decomposition(x, qweight, scales, bias, act)


OPENVINO_DECOMPOSITIONS = {"hetforge.linear_w8.default": w8_decomposition,
                           "hetforge.linear_w8a8.default": int8_decomposition}

for _info, _wdt, _adt, _kernel in (
    (linear_w8, "int8", "float", "aten._weight_int8pack_mm"),
    (linear_w4, "int4", "float", "aten._weight_int4pack_mm_for_cpu"),
    (linear_w8a8, "int8", "int8", "quantized::linear_dynamic (FBGEMM)"),
):
    _info.attrs.update({"group": "matmul", "weight_dtype": _wdt, "act_dtype": _adt, "cpu_kernel": _kernel,
                        "quantized": True})


def weight_bytes(scheme: str, n: int, k: int, group_size: int = 128) -> int:
    """Bytes a quantized ``[n, k]`` weight takes in the graph (int8 or packed int4, plus fp32 scales)."""
    if scheme in ("w8", "w8a8"):
        return n * k + 4 * n
    if scheme == "w4":
        return n * math.ceil(k / 2) + 4 * 2 * n * (k // group_size)
    raise ValueError(f"unknown scheme '{scheme}'")
