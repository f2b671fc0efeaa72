"""hetforge's native CPU kernels: C sources in this folder, compiled by the host's C compiler on first use.

Why native code: a decode step is a chain of one-row products that must stream every weight at memory
speed, and neither ATen's single-threaded GEMV nor a threaded ``bmm`` over a chunked view gets there on
a small CPU (see ``native.c``). The kernels are plain C with OpenMP; they are built once per source and
CPU into a cache folder (``$HETFORGE_CACHE``, else ``$XDG_CACHE_HOME/hetforge``, else
``~/.cache/hetforge``) in about a second, then loaded with :mod:`ctypes`. torch is imported first, so the
library's ``libgomp.so.1`` resolves to the copy torch already loaded: one OpenMP thread pool, not two.

Everything here is optional: with no C compiler, a failed build, or ``HETFORGE_NATIVE=0``,
:func:`library` returns None, :func:`status` says why, and callers use their ATen path.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import math
import mmap
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from hetforge import cpuinfo

SOURCE = Path(__file__).with_name("native.c")
# -ffp-contract=off: no fused multiply-adds where the C has a*b + c*d, so elementwise kernels round like the
# separate ATen ops they replace (bit-equal); the memory-bound GEMVs do not need FMA for speed.
_BASE_FLAGS = (["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"], ["-O3", "-fopenmp", "-ffp-contract=off"])


def host_defines(fields: dict[str, str] | None = None) -> list[str]:
    """Compile-time choices measured per kind of CPU on its own calibration page. The one-row products' weight-stream
    prefetch distance (``bench/prefetch.py``, calibration shapes no evaluated model has): ``HF_PF_BYTES`` for every
    stream, ``HF_PF_BYTES_F32`` for the fp32 ones alone. native.c's default, 2048 bytes, was the best on an Intel
    Xeon; on AMD Zen 4 (x86 family 25 with AVX-512) two runs of the page found no prefetch best, so there it is 0;
    on AMD Zen 5 (family 26) two runs found the fp32 products fastest without it and the bf16 ones with it, so there
    only the fp32 streams go without (docs/arch/runtime.md, "Weight-stream prefetch")."""
    f = cpuinfo.fields() if fields is None else fields
    if f.get("vendor_id") != "AuthenticAMD" or "avx512f" not in cpuinfo.flag_text(f).split():
        return []
    return {"25": ["-DHF_PF_BYTES=0"], "26": ["-DHF_PF_BYTES_F32=0"]}.get(f.get("cpu family", ""), [])


FLAG_SETS = tuple([*flags, *host_defines()] for flags in _BASE_FLAGS)

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "hf_gemv_nk": [_P, _P, _P, _P, _L, _L, _I],
    "hf_gemv_kn": [_P, _P, _P, _P, _L, _L, _I, _P, _I],
    "hf_gemv_nk_multi": [_I, _P, _P, _P, _P, _P, _L, _I],
    "hf_gemv_res": [_P, _P, _P, _P, _P, _L, _L, _I, _I, _P, _I],
    "hf_gemv_bf16_res": [_P, _P, _P, _P, _P, _L, _L, _I, _I, _I, _P, _I],
    "hf_gated_mlp_res": [_P, _P, _P, _P, _P, _P, _P, _L, _L, _I, _I],
    "hf_gated_mlp_bf16_res": [_P, _P, _P, _P, _P, _P, _P, _L, _L, _I, _I],
    "hf_moe_token": [_P, _P, _P, _P, _L, _L, _L, _I, _I, _I, _P, _P, _P, _P, _P, _P, _I],
    "hf_gemv_bf16": [_P, _P, _P, _P, _L, _L, _I, _I, _I, _P, _I],
    "hf_gated_mlp_bf16": [_P, _P, _P, _P, _P, _P, _L, _L, _I, _I],
    "hf_rotary_bf16": [_P, _P, _P, _P, _L, _L, _I],
    "hf_rms_norm_bf16": [_P, _P, _P, _L, _L, _F, _I],
    "hf_layer_norm_bf16": [_P, _P, _P, _P, _L, _L, _F, _I],
    "hf_decode_attention_bf16": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _L, _L, _L, _L, _F, _I],
    "hf_bf16_path": [_I],
    "hf_rotary_pos_bf16": [_P, _P, _P, _P, _L, _L, _L, _L, _L, _L, _L, _L, _I],
    "hf_rotary": [_P, _P, _P, _P, _L, _L, _I],
    "hf_rotary_pos": [_P, _P, _P, _P, _L, _L, _L, _L, _L, _L, _L, _L, _I],
    "hf_rms_norm": [_P, _P, _P, _L, _L, _F, _I],
    "hf_row_span": [_P, _L, _L, _P, _P, _I],
    "hf_row_unspan": [_P, _P, _P, _P, _L, _L, _I],
    "hf_i8_row_sums": [_P, _L, _L, _P, _I],
    "hf_layer_norm": [_P, _P, _P, _P, _L, _L, _F, _I],
    "hf_decode_attention": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _L, _L, _L, _L, _F, _I],
    "hf_prefill_attention": [_P, _P, _P, _P, _P, _P, _P, _I, _I, _F, _I, _I],
    "hf_mask_is_causal": [_P, _L, _L, _L],
    "hf_read_stream": [_P, _L, _I],
    "hf_fma_peak": [_I, _L],
    "hf_linear_act": [_P, _P, _P, _P, _L, _L, _I, _I, _I, _P, _I],
    "hf_gated_mlp": [_P, _P, _P, _P, _P, _P, _L, _L, _I, _I],
    "hf_gemv_q8": [_P, _P, _P, _P, _P, _L, _L, _I, _I],
    "hf_gemv_q8a": [_P, _P, _P, _P, _P, _L, _L, _I, _I],
    "hf_gemm_q8a": [_P, _P, _P, _P, _P, _L, _L, _L, _I, _I],
    "hf_quantize_q8_blocks": [_P, _L, _P, _P, _P],
    "hf_q8a_path": [_I],
    "hf_gemv_q4a": [_P, _P, _P, _P, _P, _L, _L, _L, _I, _I],
    "hf_gemm_q4a": [_P, _P, _P, _P, _P, _L, _L, _L, _L, _I, _I],
    "hf_q4a_path": [_I],
    "hf_q4_block": [],
    "hf_pool_info": [_P],
    "hf_pool_config": [_I, _I, _I, _I],
    "hf_pool_team": [_I],
    "hf_quantize_i8_chunks": [_L],
    "hf_quantize_i8": [_P, _L, _L, _I, _P, _P, _P, _P, _I],
    "hf_transpose": [_P, _P, _L, _L, _I, _I],
    "hf_gemm_few": [_P, _P, _P, _P, _L, _L, _L, _I, _I],
    "hf_gemm_few_kn": [_P, _P, _P, _P, _L, _L, _L, _I, _I, _P, _I],
    "hf_gated_mlp_few": [_P, _P, _P, _P, _P, _P, _P, _L, _L, _L, _I, _I],
    "hf_panel_simd": [],
    "hf_gemm_amx_bf16": [_P, _P, _P, _P, _L, _L, _L, _I, _I, _P, _P],
    "hf_epilogue_act": [_I],
    "hf_act_inplace": [_P, _P, _L, _I, _I],
    "hf_amx_bf16_ok": [],
    "hf_pack_amx_bf16": [_P, _P, _L, _L, _I],
    "hf_pack_bf16_panels": [_P, _P, _L, _L, _I],
    "hf_bf16_panel_ok": [],
    "hf_gemm_bf16_panel": [_P, _P, _P, _P, _L, _L, _L, _I, _I, _P, _P],
    "hf_pack_panels": [_P, _P, _L, _L, _I, _I],
    "hf_gemm_panel": [_P, _P, _P, _P, _L, _L, _L, _I, _I, _P, _P],
    "hf_gemm_panel_multi": [_P, _I, _P, _P, _P, _P, _L, _L, _I],
    "hf_gemm_panel_gated": [_P, _P, _P, _P, _P, _P, _L, _L, _L, _I, _I, _P],
    "hf_ewise": [_P, _P, _P, _L, _I, _I],
    "hf_copy": [_P, _P, _L],
    "hf_rows_write": [_P, _L, _L],
    "hf_call_count": [],
    "hf_prefill_attention_bf16_products": [],
    "hf_prefill_attention_simd": [],
    "hf_call_name": [_I],
    "hf_call_sig": [_I],
    "hf_run_calls": [_P, ctypes.c_int64, _I, _P],
}
RESTYPES = {  # the functions that return a value (every other one returns void)
    "hf_fma_peak": ctypes.c_double,
    "hf_read_stream": _F, "hf_q8a_path": _I, "hf_bf16_path": _I, "hf_prefill_attention": _I, "hf_gemv_nk_multi": _I,
    "hf_prefill_attention_bf16_products": _I, "hf_mask_is_causal": _I, "hf_prefill_attention_simd": _I,
    "hf_gemv_q8a": _I, "hf_gemm_q8a": _I,  # 0, or -1: scratch not allocated
    "hf_gemv_q4a": _I, "hf_gemm_q4a": _I, "hf_q4a_path": _I, "hf_q4_block": _I, "hf_quantize_i8_chunks": _L,
    "hf_quantize_i8": _I,
    "hf_transpose": _I, "hf_gemm_few": _I, "hf_gemm_few_kn": _I, "hf_gated_mlp_few": _I, "hf_panel_simd": _I,
    "hf_gemm_amx_bf16": _I, "hf_amx_bf16_ok": _I, "hf_bf16_panel_ok": _I, "hf_gemm_bf16_panel": _I,
    "hf_gemm_panel": _I, "hf_gemm_panel_multi": _I,
    "hf_gemm_panel_gated": _I,
    "hf_epilogue_act": _I, "hf_act_inplace": _I,
    "hf_ewise": _I, "hf_call_count": _I, "hf_call_name": ctypes.c_char_p, "hf_call_sig": ctypes.c_char_p,
    "hf_run_calls": ctypes.c_int64,
}
FEW_KN_SLOTS = 4  # split-K parts of hf_gemm_few_kn (fixed, so a result does not depend on the thread count)
# most rows a product runs on hf_gemm_few / hf_gemm_few_kn / hf_gated_mlp_few (the C takes up to 32): at 12 and
# 16 rows oneDNN's packed GEMM was as fast or faster inside a prefill program (docs/arch/runtime.md)
FEW_MAX = 8
# fp32 row counts a product runs on the panel GEMM (gemm_panel) instead of a packed GEMM torch ships or, where the
# panel GEMM runs, the few-row kernels above: the run of row counts at which it was the fastest kernel from memory
# (the few-row kernel included) on bench/panel_gemm.py's calibration shapes, in every family
# (docs/bench/panel_gemm.md; session 34's three runs: 2..192 and 8..192 rows after the contiguous-scratch change,
# 2..128 after the 16-row fix, which the page holds — 160 rows 0.98-1.00 and 192 rows 1.02-1.04 of oneDNN's time
# there; session 32's: 4..128; 2-3 rows stay on the few-row kernels, docs/arch/runtime.md says why). The one Intel
# Xeon run (4..32) was of an earlier kernel. A CPU with AVX2 and FMA but no AVX-512 runs the kernel's AVX2 path
# (4 x 24 sums per pass): there the same page found 8..16 rows (session 54), and 2..48 after session 58 spread
# that path's prefetches over all its passes and sized its blocks to L1 (docs/bench/panel_gemm_avx2.md); as on
# AVX-512 the few-row kernels keep 2-3 rows (3 rows is not on the page).
PANEL_RANGE_AVX512, PANEL_RANGE_AVX2 = (4, 128), (4, 48)
PANEL_MIN, PANEL_MAX = PANEL_RANGE_AVX512 if "avx512f" in cpuinfo.flag_text(cpuinfo.fields()).split() \
    else PANEL_RANGE_AVX2
# bf16 products of 2..AMX_ROWS_MAX rows run on hf_gemm_amx_bf16 instead of oneDNN (where AMX runs): the row counts at
# which it was faster on every calibration shape, weights from memory (bench/bf16_rows.py, docs/bench/bf16_rows.md)
AMX_ROWS_MAX = 16
# bf16 products of BF16_PANEL_ROWS_MIN..BF16_PANEL_ROWS_MAX rows run on hf_gemm_bf16_panel instead of oneDNN where
# AVX512-BF16 runs and AMX does not. MIN: the prefill programs' smallest row count (their counts are multiples of
# runtime.programs.FINE_MIN); fewer rows (a batched decode, a verification) stay on oneDNN, which tied the kernel at 4
# rows. MAX: the row counts from MIN at which it was faster on every calibration shape, weights from memory
# (bench/bf16_rows.py --kernel panel, docs/bench/bf16_panel_rows.md)
BF16_PANEL_ROWS_MIN = 8
BF16_PANEL_ROWS_MAX = 48
PANEL_NB = 48  # native.c's HF_PNB: output columns per panel of a packed weight (pack_panels)
PANEL_SEG = 4  # native.c's HF_PSEG: the most products of one input one gemm_panel_multi call takes
ACT_CODES = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}  # native.c's ACT_* (linear_act, gated_mlp)


@dataclass
class NativeStatus:
    """Whether the native kernels are loaded, from where, and why not when they are not."""

    available: bool
    path: str | None = None
    reason: str = ""
    flags: tuple[str, ...] = ()
    rebuilt: str = ""  # set when a corrupt, empty or foreign cached library was replaced by a fresh build


_state: dict[str, object] = {}


def cache_dir() -> Path:
    env = os.environ.get("HETFORGE_CACHE")
    if env:
        return Path(env) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetforge" / "kernels"


def _cpu_tag() -> str:
    """What ``-march=native`` depends on: the machine and its CPU flags (so a shared cache stays correct)."""
    return platform.machine() + cpuinfo.flag_text(cpuinfo.fields())


def _build(cc: str, flags: list[str], out: Path, source: Path = SOURCE) -> str | None:
    """Compile ``source`` (this library's ``SOURCE``; another revision's for bench/kernel_ab.py) into ``out``
    atomically (temp file, then rename); the compiler's error or None."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
    except OSError as e:
        return f"cannot write the kernel cache {out.parent}: {e}"
    try:
        r = subprocess.run([cc, *flags, "-shared", "-fPIC", str(source), "-o", tmp, "-lm"], capture_output=True,
                           text=True, timeout=120)
        if r.returncode != 0:
            return (r.stderr.strip().splitlines() or ["failed"])[-1]
        os.replace(tmp, out)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def llc_bytes() -> int:
    """Last-level cache size from sysfs (the largest ``cpu0/cache/index*/size``; 32 MiB when unknown)."""
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


def library_path(cc: str, flags: list[str]) -> Path:
    """Where the library built from this source with ``cc flags`` for this CPU is cached."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *flags]).encode() + _cpu_tag().encode()).hexdigest()
    return cache_dir() / f"hetforge_native_{key[:16]}.so"


def elf_damage(path: Path) -> str:
    """Why an ELF file is cut short ("" when whole, or when it is not ELF at all: the loader judges those).
    ``dlopen`` maps a truncated library's segments past the end of the file and the process dies of SIGBUS
    on first touch, so the segment and section tables are checked against the file size first."""
    import struct

    data = path.read_bytes()
    if data[:4] != b"\x7fELF":
        return ""
    if len(data) < 64 or data[4] not in (1, 2) or data[5] not in (1, 2):
        return "its ELF header is cut short"
    bits64, end = data[4] == 2, "<" if data[5] == 1 else ">"
    try:
        if bits64:
            phoff, shoff = struct.unpack_from(end + "QQ", data, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(end + "HHHH", data, 0x36)
        else:
            phoff, shoff = struct.unpack_from(end + "II", data, 0x1C)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(end + "HHHH", data, 0x2A)
        if phoff + phnum * phentsize > len(data) or shoff + shnum * shentsize > len(data):
            return f"it is cut short ({len(data)} bytes; its headers point past the end)"
        for k in range(phnum):
            at = phoff + k * phentsize
            if bits64:
                _, _, off, _, _, filesz = struct.unpack_from(end + "IIQQQQ", data, at)
            else:
                _, off, _, _, filesz = struct.unpack_from(end + "IIIII", data, at)
            if off + filesz > len(data):
                return f"it is cut short ({len(data)} bytes; a segment ends at byte {off + filesz})"
    except struct.error:
        return "its ELF headers are cut short"
    return ""


def _open(path: Path, need: tuple[str, ...] | None = None) -> tuple[ctypes.CDLL | None, str]:
    """Load ``path`` and bind every kernel's signature; (None, why) when it is not a loadable library with all
    of hetforge's symbols (an empty, truncated or foreign file in the cache). ``need``: only these symbols must be
    there (bench/kernel_ab.py loading another revision's build, which may lack later kernels); the signatures of
    those present are bound."""
    try:
        damage = elf_damage(path)
    except OSError as e:
        return None, str(e)
    if damage:
        return None, damage
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, str(e).splitlines()[0]
    missing = [name for name in (SIGNATURES if need is None else need) if not hasattr(lib, name)]
    if missing:
        with contextlib.suppress(Exception):  # unload it so the rebuilt file at the same path is really read
            import _ctypes

            _ctypes.dlclose(lib._handle)
        return None, f"it lacks hetforge's symbol(s) {', '.join(missing[:3])}"
    for name, argtypes in SIGNATURES.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, RESTYPES.get(name)
    return lib, ""


def _load() -> tuple[ctypes.CDLL | None, NativeStatus]:
    if os.environ.get("HETFORGE_NATIVE", "1") == "0":
        return None, NativeStatus(False, reason="disabled by HETFORGE_NATIVE=0")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, NativeStatus(False, reason="no C compiler (cc/gcc) on PATH")
    errors = []
    for flags in FLAG_SETS:
        path = library_path(cc, flags)
        rebuilt = ""
        lib, why = _open(path) if path.exists() else (None, "")
        if lib is None:
            if path.exists():  # a cached file that does not load is rebuilt, never used (or skipped) forever
                rebuilt = f"rebuilt {path.name}: the cached file could not be used ({why})"
            err = _build(cc, flags, path)
            if err is None:
                lib, why = _open(path)
                err = None if lib is not None else f"built but not loadable: {why}"
        if lib is not None:
            return lib, NativeStatus(True, str(path), "", tuple(flags), rebuilt)
        errors.append(f"{cc} {' '.join(flags)}: {err}")
    return None, NativeStatus(False, reason="could not build the native kernels: " + "; ".join(errors))


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (built on first call), or None when unavailable."""
    if "lib" not in _state:
        _state["lib"], _state["status"] = _load()
    return _state["lib"]  # type: ignore[return-value]


@contextlib.contextmanager
def disabled(reason: str = "disabled in this block") -> Iterator[None]:
    """Within the block the kernels count as unavailable (callers take their ATen paths), as with
    ``HETFORGE_NATIVE=0``; for A/B runs and tests. Programs built inside keep the ATen path afterwards."""
    saved = dict(_state)
    _state.clear()
    _state.update({"lib": None, "status": NativeStatus(False, reason=reason)})
    try:
        yield
    finally:
        _state.clear()
        _state.update(saved)


def status() -> NativeStatus:
    library()
    return _state["status"]  # type: ignore[return-value]


def split_k_slots() -> int:
    """Rows of a ``[K, N]`` GEMV's split-K scratch: the number of K parts (fixed per host, so a result does
    not depend on the thread count), at least 16 so a part claimed by a descheduled thread is a small one."""
    return max(os.cpu_count() or 1, 16)


@dataclass
class PoolInfo:
    """The native kernels' thread pool, read back from the library (see ``native.c``)."""

    helpers: int  # helper threads started in this process
    spin_us: int  # how long an idle helper spins before it sleeps (and a waiting caller before it yields)
    jobs: int  # kernel calls split over the pool
    chunks: int  # their chunks
    chunks_by_helpers: int  # chunks that helper threads ran (the caller ran the rest)
    helper_sleeps: int  # times an idle helper went to sleep on its futex
    chunks_taken_over: int  # chunks a thread ran from another thread's run (its own run was done)
    team: bool  # pooled kernels run on torch's OpenMP team instead (set by pool_team)
    stall_us: int  # a longer wait for a chunk a helper claimed is a stall (0: the pool never goes solo)
    stalls: int  # such waits
    solo_jobs: int  # jobs (counted in ``jobs``) the caller ran alone: the pool was backing off after a stall
    steal_us: int  # a longer wait for a chunk a helper claimed: the caller takes the chunk over (0: never)
    steals: int  # chunks taken over from a helper (run by the caller; the helper left them)
    steal_signal: int  # the signal that stops a helper's taken-over chunk (0: none could be installed: no steals)
    steals_unanswered: int  # of those, the helper had not answered the signal in time (descheduled): it left the
    # chunk when it next ran, before running anything else
    quiet_periods: int  # periods begun in which idle helpers do not spin (two steals within 50 ms: a busy neighbour)
    moves: int  # times a helper found itself on the caller's CPU and moved to the process's other CPUs


SPIN_US = 50  # the pool's default spin (native.c HF_SPIN_US): idle helpers stay awake this long between kernels.
# A trade-off, measured with bench/contention.py (a same-day A/B, session 25): at 150 µs helpers also stay awake
# across an MoE layer's routing (mixtral-small idle 2-thread decode 6.8 -> 5.2 ms/token, llama-110m 18.3 -> 17.0),
# but with a busy neighbour pinned to one core their spinning took the caller's core (2-thread decode 32.1 -> 37.0
# ms/token on gpt2, 28.1 -> 32.5 on llama-110m: no better than 1 thread), so 50 µs stays.


STALL_US = 300  # native.c HF_STALL_US: a caller that waits longer than this for a chunk a helper claimed (a
# chunk takes microseconds), a wait no take-over (STEAL_US) ended, runs the next jobs alone for a while.
STEAL_US = 100  # native.c HF_STEAL_US: a caller that waits longer than this for a chunk a helper claimed takes it
# over (the helper, signalled, leaves it), so a helper descheduled mid-chunk costs the caller this wait, not the rest
# of the busy neighbour's time slice.
HOLDS = {"none": 0, "idle": 1, "stall": 2, "deaf": 3}  # pool_config's test hook


def pool_info() -> PoolInfo:
    """Read back the pool's state and counters; check :func:`library` first."""
    n = len(dataclasses.fields(PoolInfo))  # hf_pool_info fills one long per field, in field order
    out = (ctypes.c_long * n)()
    library().hf_pool_info(out)
    return PoolInfo(*out[:7], bool(out[7]), *out[8:n])


def pool_config(spin_us: int = SPIN_US, hold: bool | str = False, stall_us: int = STALL_US,
                steal_us: int = STEAL_US) -> None:
    """Set the pool's spin time (µs), its stall threshold (µs; 0: never run jobs alone after a stall), how long a
    caller waits for a helper's claimed chunk before it takes the chunk over (µs; 0: never), and its
    test hook ``hold``: ``True`` / ``"idle"`` helpers claim no work (as if descheduled), ``"stall"`` a helper
    holds each chunk it claims for twice the stall threshold before running it (as if descheduled while holding
    it), ``"deaf"`` as ``"stall"`` with the thief's signal blocked while it holds the chunk (as a descheduled
    helper, which takes the signal only when it runs again). Ends any solo or quiet period."""
    code = HOLDS[hold] if isinstance(hold, str) else int(bool(hold))
    library().hf_pool_config(spin_us, code, stall_us, steal_us)


def pool_team(on: bool) -> None:
    """Run the pooled (one-row) kernels on torch's OpenMP team (``on``) or on the pool; results are the same bits
    either way (chunks are fixed by the problem). The executor switches it on for the run of a program with
    multi-row products (``_Codegen.on_team``); a forked child starts with it off."""
    library().hf_pool_team(int(on))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def contiguous_ptr(t: torch.Tensor, keep: dict[int, torch.Tensor], site: int,
                   dtype: torch.dtype = torch.float32) -> int:
    """``t``'s data pointer, for a kernel that reads it as dense ``dtype`` rows (fp32, or bf16 for the ``_bf16``
    kernels) on the CPU. The executor reads an
    operand's pointer this way when its layout is only known at run time. A strided tensor (which the IR said
    would be contiguous) is copied into a contiguous one first, kept in ``keep[site]`` (the program's own
    dict) until that call site's next call, rather than let C read the wrong elements; a tensor that is not
    ``dtype`` on the CPU is refused (C would misread it or read another device's memory)."""
    if t.dtype != dtype or t.device.type != "cpu":
        raise ValueError(f"native kernel operand must be {str(dtype).removeprefix('torch.')} on the CPU, got "
                         f"{t.dtype} on {t.device}")
    if not t.is_contiguous():
        t = keep[site] = t.contiguous()
    return t.data_ptr()


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, weight_t: bool,
         threads: int | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``out = x·Wᵀ (+ b)`` (``x·W`` when ``weight_t``) for one fp32 row, on the native kernel.

    All tensors must be contiguous fp32 on the CPU (checked by :func:`fits`); ``scratch`` is the split-K
    partial-row buffer (``[slots, N]``, ``slots`` parts of K) for ``weight_t``, made here when not given."""
    lib = library()
    assert lib is not None, status().reason
    k_w, n_w = w.shape if weight_t else (w.shape[1], w.shape[0])
    if x.numel() != k_w or out.numel() != n_w or not (x.is_contiguous() and out.is_contiguous()):
        raise ValueError(f"one-row product: input {tuple(x.shape)} and output {tuple(out.shape)} do not fit a "
                         f"{'[K, N]' if weight_t else '[N, K]'} weight {tuple(w.shape)}")
    threads = torch.get_num_threads() if threads is None else threads
    threads = max(1, threads)
    if weight_t:
        k, n = w.shape
        if scratch is None:
            scratch = torch.empty((split_k_slots(), n), dtype=torch.float32)
        if (scratch.dtype != torch.float32 or not scratch.is_contiguous() or scratch.dim() != 2
                or scratch.shape[0] < 1 or scratch.shape[1] != n):
            raise ValueError(f"split-K scratch must be contiguous float32 [slots >= 1, {n}], got "
                             f"{scratch.dtype} {tuple(scratch.shape)}")
        lib.hf_gemv_kn(w.data_ptr(), x.data_ptr(), _ptr(bias), out.data_ptr(), n, k, threads, scratch.data_ptr(),
                       scratch.shape[0])
    else:
        n, k = w.shape
        lib.hf_gemv_nk(w.data_ptr(), x.data_ptr(), _ptr(bias), out.data_ptr(), n, k, threads)
    return out


def fma_peak(threads: int | None = None, seconds: float = 0.05, repeats: int = 5) -> float | None:
    """The FMA units' ceiling in GFLOP/s (measured): ``threads`` threads at once (torch's count by default), each
    running independent fused multiply-adds on registers only (``hf_fma_peak``: 512-bit with AVX-512, else 256-bit
    FMA3), best of ``repeats`` runs of about ``seconds`` each. A GEMM can at most reach it, so it tells how close
    a measured GEMM peak (the bound ``hetforge calibrate`` uses) sits to the hardware. None without the library
    or a build with neither instruction set."""
    lib = library()
    if lib is None:
        return None
    n = max(1, torch.get_num_threads() if threads is None else threads)
    iters = 1000
    first = lib.hf_fma_peak(n, iters)
    if first <= 0:
        return None
    while True:  # iterations for about ``seconds`` a run
        t0 = time.perf_counter()
        lib.hf_fma_peak(n, iters)
        took = time.perf_counter() - t0
        if took >= seconds / 4 or iters > 1 << 34:
            break
        iters *= 4
    iters = max(1, int(iters * seconds / max(took, 1e-6)))
    return max(lib.hf_fma_peak(n, iters) for _ in range(max(1, repeats)))


def panel_available() -> bool:
    """Whether the panel GEMM (:func:`gemm_panel`) runs vectorized here (the library built with AVX-512, or with AVX2
    and FMA: :data:`PANEL_MIN`..``PANEL_MAX`` differ between the two): where it does not, its plain C path is correct
    but slow, and products stay on the kernels torch ships."""
    lib = library()
    return lib is not None and bool(lib.hf_panel_simd())


HUGE_PAGE = 2 << 20  # the transparent huge page size asked for (x86-64's 2 MiB pages)
# Packing onto huge pages continues only while it runs at least this fast (bytes of packed panels per second, summed
# over the process's packings once HUGE_JUDGE_BYTES were packed): the rate packing into ordinary 4 KiB pages ran at
# (fault, zero and copy; measured: docs/arch/runtime.md, session 35). Slower means the system hands out huge pages it
# must first fetch (a VM whose host backs guest memory on first touch: about 1 GB/s there), and the 0-3% the
# products gain from huge pages does not pay for it.
HUGE_MIN_RATE = 4e9
HUGE_JUDGE_BYTES = 32 << 20
_huge_packing = {"bytes": 0, "seconds": 0.0, "slow": False}


def huge_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of ``numel`` elements on memory asked to be backed by transparent huge pages
    (a private anonymous mapping advised ``MADV_HUGEPAGE`` before its first touch, the tensor starting on a 2 MiB
    boundary); a plain ``torch.empty`` where the system has no such advice or the mapping fails. Why: a packed
    weight read from memory by the panel GEMM crosses a 4 KiB page every 21 k-rows of a panel, and the hardware
    prefetchers stop at page boundaries, so with 4 KiB pages the products ran below their in-cache speed; on
    huge pages they ran close to it (measured: docs/arch/runtime.md). The tensor keeps the mapping alive; the kernel
    may still hand out 4 KiB pages (THP off, or no free huge page): same values, only slower. The cost: fresh huge
    pages are zeroed on first touch, and on a VM whose host backs guest memory lazily that ran at about 1 GB/s, so
    :func:`pack_panels` stops asking for them once they prove slower than ordinary pages (:func:`huge_pages_wanted`)."""
    return _huge_alloc(numel, dtype)[0]


def _huge_alloc(numel: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, bool]:
    """:func:`huge_empty`'s tensor, and whether it is a mapping advised for huge pages (False: ``torch.empty``)."""
    size = numel * torch.empty(0, dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or size < HUGE_PAGE or not huge_pages_wanted():
        return torch.empty(numel, dtype=dtype), False
    try:
        mm = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(advice)
    except (OSError, ValueError):
        return torch.empty(numel, dtype=dtype), False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns about buffers it cannot see are writable
        flat = torch.frombuffer(mm, dtype=torch.uint8)
    skip = -flat.data_ptr() % HUGE_PAGE
    return flat[skip:skip + size].view(dtype), True


def pack_panels(w: torch.Tensor, weight_t: bool = False, threads: int | None = None) -> torch.Tensor:
    """``w`` (fp32 ``[N, K]``, or ``[K, N]`` when ``weight_t``) packed for :func:`gemm_panel`: ``ceil(N / 48)``
    panels of ``K × 48`` floats (columns past N zero), as one flat tensor. The packing does not depend on the row
    count: one copy serves every prompt length."""
    lib = library()
    assert lib is not None, status().reason
    if w.dtype != torch.float32 or w.dim() != 2 or not w.is_contiguous() or w.device.type != "cpu":
        raise ValueError(f"panel packing takes a contiguous 2-D float32 CPU weight, got {w.dtype} "
                         f"{tuple(w.shape)} on {w.device}")
    k, n = w.shape if weight_t else (w.shape[1], w.shape[0])
    numel = ((n + PANEL_NB - 1) // PANEL_NB) * PANEL_NB * k
    t0 = time.perf_counter()
    out, huge = _huge_alloc(numel)  # only a packing onto an advised mapping is judged below
    lib.hf_pack_panels(w.data_ptr(), out.data_ptr(), n, k, int(weight_t),
                       max(1, torch.get_num_threads() if threads is None else threads))
    if huge:
        _judge_huge_packing(numel * 4, time.perf_counter() - t0)
    return out


def huge_pages_wanted() -> bool:
    """Whether :func:`huge_empty` asks for huge pages now: not with ``HETFORGE_HUGE_PAGES=0``; with ``=1`` always;
    by default until this process's packings onto huge pages ran below :data:`HUGE_MIN_RATE`."""
    env = os.environ.get("HETFORGE_HUGE_PAGES", "")
    if env in ("0", "1"):
        return env == "1"
    return not _huge_packing["slow"]


def _judge_huge_packing(nbytes: int, seconds: float) -> None:
    """Count one packing onto huge pages; once :data:`HUGE_JUDGE_BYTES` were packed, a summed rate below
    :data:`HUGE_MIN_RATE` turns huge pages off for the rest of the process (see there why)."""
    h = _huge_packing
    h["bytes"] += nbytes
    h["seconds"] += seconds
    if h["bytes"] >= HUGE_JUDGE_BYTES and h["bytes"] < HUGE_MIN_RATE * h["seconds"]:
        h["slow"] = True


_ASKED: dict[tuple, int] = {}  # (function, args) -> the loaded library's answer (fixed for the library)


def _answer(fn: str, *args: int) -> int:
    """The library's answer of ``fn(*args)`` (a question about its build), asked once, not on every call of the
    caller; 0 without the library (not kept: a library loaded later is asked)."""
    lib = library()
    if lib is None:
        return 0
    key = (fn, *args)
    if key not in _ASKED:
        _ASKED[key] = int(getattr(lib, fn)(*args))
    return _ASKED[key]


def _asked(fn: str, *args: int) -> bool:
    """:func:`_answer` as yes or no."""
    return _answer(fn, *args) != 0


def epilogue_act(act: str) -> bool:
    """Whether the multi-row products' epilogue (:func:`gemm_panel`, :func:`gemm_amx_bf16`) applies ``act`` itself
    (native.c ``hf_epilogue_act``: none, relu, gelu_tanh, silu where the build has AVX-512 or AVX2 with FMA)."""
    return act in ACT_CODES and _asked("hf_epilogue_act", ACT_CODES[act])


_INPLACE_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu_, "gelu": lambda y: torch.ops.aten.gelu_(y),
    "gelu_tanh": lambda y: torch.ops.aten.gelu_(y, approximate="tanh"), "silu": lambda y: torch.ops.aten.silu_(y),
}


def _epilogue(out_shape: tuple, dtype: torch.dtype, act: str, mul: torch.Tensor | None,
              res: torch.Tensor | None) -> tuple[int, int, int, list[Callable[[torch.Tensor], torch.Tensor]]]:
    """How a product's epilogue runs: (act code, mul pointer, res pointer) for the kernel, and the steps left for
    after it, in the graph's order act → × mul → + res (a step the kernel cannot take, and every step after it,
    runs as ATen's in-place op on the result: an activation it does not have, an operand that is not a dense
    tensor of the result's shape and dtype)."""
    if act not in ACT_CODES:
        raise ValueError(f"unknown activation {act!r}; one of {sorted(ACT_CODES)}")

    def dense(t: torch.Tensor) -> bool:
        return t.dtype == dtype and t.is_contiguous() and tuple(t.shape) == tuple(out_shape) \
            and t.device.type == "cpu"

    steps: list[tuple[str, Any]] = [("act", act)] if act != "none" else []
    steps += [("mul", mul)] if mul is not None else []
    steps += [("res", res)] if res is not None else []
    code, mp, rp, after = 0, 0, 0, []
    for i, (kind, v) in enumerate(steps):
        fused = epilogue_act(v) if kind == "act" else dense(v)
        if not fused:
            for kind2, v2 in steps[i:]:
                after.append(_INPLACE_ACT[v2] if kind2 == "act" else
                             (lambda y, t=v2: y.mul_(t)) if kind2 == "mul" else (lambda y, t=v2: y.add_(t)))
            break
        if kind == "act":
            code = ACT_CODES[v]
        elif kind == "mul":
            mp = v.data_ptr()
        else:
            rp = v.data_ptr()
    return code, mp, rp, after


def act_inplace(y: torch.Tensor, act: str, mul: torch.Tensor | None = None) -> torch.Tensor:
    """``y = act(y)`` (then ``* mul``) in place, returning ``y``: on the native kernel (``hf_act_inplace``, the
    epilogue's vectorized activations) for dense fp32 CPU tensors of one shape and an activation it has
    (:func:`epilogue_act`), else as ATen's in-place ops. For a product whose kernel has no epilogue (MKL's)."""
    lib = library()
    if lib is not None and y.dtype == torch.float32 and y.is_contiguous() and y.device.type == "cpu" \
            and epilogue_act(act) and (mul is None or (mul.dtype == torch.float32 and mul.is_contiguous()
                                                       and mul.shape == y.shape and mul.device.type == "cpu")):
        lib.hf_act_inplace(y.data_ptr(), _ptr(mul), y.numel(), ACT_CODES[act], torch.get_num_threads())
        return y
    if act != "none":
        y = _INPLACE_ACT[act](y)
    return y if mul is None else y.mul_(mul)


def gemm_panel(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
               threads: int | None = None, act: str = "none", mul: torch.Tensor | None = None,
               res: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x·Wᵀ + b) * mul + res`` (fp32, ``x``: contiguous ``[..., K]``; ``act`` one of :data:`ACT_CODES`;
    ``mul`` and ``res`` optional tensors of the result's shape) on a weight packed by :func:`pack_panels` with
    ``n`` outputs; a fresh ``[..., n]`` tensor. Each product is one chain of fused multiply-adds from the bias
    (in a fixed K order, so the result does not depend on the thread count); the activation, the product with
    ``mul`` (a gated MLP's gate) and the residual ``res`` are applied as each output is stored, where the kernel
    has them (:func:`epilogue_act`; else as ATen's in-place ops after it)."""
    k = x.shape[-1]
    _check_panel(x, packed, bias, n)
    y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    code, mp, rp, after = _epilogue(tuple(y.shape), torch.float32, act, mul, res)
    rc = library().hf_gemm_panel(x.data_ptr(), packed.data_ptr(), _ptr(bias), y.data_ptr(),
                                 math.prod(x.shape[:-1]), n, k, max(1, torch.get_num_threads() if threads is None
                                                                   else threads), code, mp, rp)
    if rc != 0:
        raise (MemoryError if rc == -1 else ValueError)(
            "hf_gemm_panel: " + ("cannot allocate its scratch (the input's packed rows)"
                                 if rc == -1 else f"activation code {code} not in its epilogue"))
    for step in after:
        step(y)
    return y


def gemm_panel_gated(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, bias_gate: torch.Tensor | None,
                     bias_up: torch.Tensor | None, n: int, act: str, res: torch.Tensor | None = None,
                     threads: int | None = None) -> torch.Tensor:
    """A gated MLP's ``act(x·W_gᵀ + b_g) * (x·W_uᵀ + b_u)`` (``+ res``) on two weights packed by :func:`pack_panels`
    (``n`` outputs each), as one native call: X packed once, and the gate's result never written out. Bit-equal to
    ``gemm_panel(x, up, b_u, n, mul=gemm_panel(x, gate, b_g, n, act=act), res=res)``; ``act`` must be one the
    epilogue has (:func:`epilogue_act`)."""
    _check_panel(x, gate, bias_gate, n)
    _check_panel(x, up, bias_up, n)
    y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    if not epilogue_act(act) or res is not None and (res.dtype != torch.float32 or not res.is_contiguous()
                                                     or res.numel() != y.numel()):
        raise ValueError(f"gated panel GEMM: activation {act!r} or residual "
                         f"{None if res is None else (res.dtype, tuple(res.shape))} is not one it applies")
    rc = library().hf_gemm_panel_gated(x.data_ptr(), gate.data_ptr(), up.data_ptr(), _ptr(bias_gate), _ptr(bias_up),
                                       y.data_ptr(), math.prod(x.shape[:-1]), n, x.shape[-1],
                                       max(1, torch.get_num_threads() if threads is None else threads),
                                       ACT_CODES[act], _ptr(res))
    if rc != 0:
        raise MemoryError("hf_gemm_panel_gated: cannot allocate its scratch (the input's packed rows)")
    return y


def _check_panel(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> None:
    """Refuse (ValueError) an input and a weight packed by :func:`pack_panels` for ``n`` outputs that do not fit:
    ``x`` contiguous fp32 ``[..., K]``, ``packed`` of ``ceil(n / 48) * 48 * K`` floats, ``bias`` None or a
    contiguous fp32 ``[n]``."""
    k = x.shape[-1]
    if (x.dtype != torch.float32 or not x.is_contiguous() or packed.numel() != -(-n // PANEL_NB) * PANEL_NB * k
            or bias is not None and (bias.numel() != n or not bias.is_contiguous() or bias.dtype != torch.float32)):
        raise ValueError(f"panel GEMM: input {x.dtype} {tuple(x.shape)} (contiguous: {x.is_contiguous()}) does "
                         f"not fit a packed weight of {packed.numel()} floats for {n} outputs")


class PanelMulti:
    """One ``hf_gemm_panel_multi`` call's fixed operands — 1..:data:`PANEL_SEG` weights packed by
    :func:`pack_panels` (``ns[s]`` outputs each) and their biases — with their pointer arrays made once, at the
    first call (``packs`` may be callables that pack on first use: the executor's lazy packings), as
    :class:`MultiArgs` does for the one-row groups; a call checks only ``x`` and makes the outputs."""

    def __init__(self, packs: list, biases: list[torch.Tensor | None], ns: list[int]):
        if not 1 <= len(packs) <= PANEL_SEG or not len(packs) == len(biases) == len(ns):
            raise ValueError(f"gemm_panel_multi takes 1..{PANEL_SEG} weights with one bias and size each, got "
                             f"{len(packs)} / {len(biases)} / {len(ns)}")
        self.packs, self.biases, self.ns = packs, biases, [int(n) for n in ns]
        self.k: int | None = None  # K of the packed weights, once they are resolved

    def _resolve(self, x: torch.Tensor) -> None:
        packs = [p() if callable(p) else p for p in self.packs]
        for pk, b, n in zip(packs, self.biases, self.ns, strict=True):
            _check_panel(x, pk, b, n)
        self.packs, self.k = packs, x.shape[-1]  # the tensors, kept alive: their pointers are in the arrays
        m = len(packs)
        self.w = (ctypes.c_void_p * m)(*(pk.data_ptr() for pk in packs))
        self.b = (ctypes.c_void_p * m)(*(_ptr(b) for b in self.biases))
        self.n = (ctypes.c_long * m)(*self.ns)

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> tuple[torch.Tensor, ...]:
        if self.k is None:
            self._resolve(x)
        elif x.dtype != torch.float32 or not x.is_contiguous() or x.shape[-1] != self.k:
            raise ValueError(f"panel GEMM: input {x.dtype} {tuple(x.shape)} (contiguous: {x.is_contiguous()}) does "
                             f"not fit weights packed for K = {self.k}")
        ys = tuple(torch.empty((*x.shape[:-1], n), dtype=torch.float32) for n in self.ns)
        rc = library().hf_gemm_panel_multi(
            x.data_ptr(), len(ys), self.w, self.b, (ctypes.c_void_p * len(ys))(*(y.data_ptr() for y in ys)),
            self.n, math.prod(x.shape[:-1]), self.k, max(1, torch.get_num_threads() if threads is None else threads))
        if rc != 0:
            raise MemoryError("hf_gemm_panel_multi: cannot allocate its scratch (the input's packed rows)")
        return ys


def gemm_panel_multi(x: torch.Tensor, packs: list[torch.Tensor], biases: list[torch.Tensor | None], ns: list[int],
                     threads: int | None = None) -> tuple[torch.Tensor, ...]:
    """``x·W_sᵀ + b_s`` for 1..:data:`PANEL_SEG` weights packed by :func:`pack_panels` (``ns[s]`` outputs each) of
    the same fp32 input ``x`` ``[..., K]`` (contiguous), as one native call: X packed once, the products' panels
    split between the threads as one list. Fresh ``[..., n_s]`` tensors, each bit-equal to :func:`gemm_panel`'s for
    that weight alone (no activation or epilogue here). A call site that repeats it keeps a :class:`PanelMulti`."""
    return PanelMulti(packs, biases, ns)(x, threads)


MULTI_MAX = 4  # native.c's HF_MULTI_MAX: the most products one hf_gemv_nk_multi call takes
EWISE_OPS = {"aten.add.Tensor": 0, "aten.mul.Tensor": 1}  # hf_ewise's op codes


class MultiArgs:
    """The pointer arrays of one ``hf_gemv_nk_multi`` call (weights, biases, outputs, row counts), made once: the
    executor bakes one per fused group into its generated code (the pointers of arena slices never move)."""

    def __init__(self, weights: list[int], biases: list[int | None], outs: list[int], rows: list[int]):
        m = len(weights)
        if not 1 <= m <= MULTI_MAX or not len(biases) == len(outs) == len(rows) == m:
            raise ValueError(f"hf_gemv_nk_multi takes 1..{MULTI_MAX} products with one bias, output and row count "
                             f"each, got {m} weights, {len(biases)} biases, {len(outs)} outputs, {len(rows)} rows")
        self.m = m
        self.w = (ctypes.c_void_p * m)(*weights)
        self.b = (ctypes.c_void_p * m)(*biases)
        self.y = (ctypes.c_void_p * m)(*outs)
        self.n = (ctypes.c_long * m)(*rows)

    def call(self, x_ptr: int, k: int, threads: int) -> None:
        check_multi_rc(library().hf_gemv_nk_multi(self.m, self.w, self.b, self.y, self.n, x_ptr, k, threads),
                       "hf_gemv_nk_multi", self.m)

    def args(self, x_ptr: int, k: int, threads: Any) -> list[Any]:
        """The arguments of its ``hf_gemv_nk_multi`` call (for a :class:`CallList`)."""
        return [self.m, *(ctypes.addressof(a) for a in (self.w, self.b, self.y, self.n)), x_ptr, k, threads]


def check_multi_rc(rc: int, fn: str = "hf_gemv_nk_multi", m: int = 0) -> None:
    """Raise when ``hf_gemv_nk_multi`` refused its call (a product count outside 1..MULTI_MAX)."""
    if rc:
        raise ValueError(f"{fn} refused {m or 'its'} products (it takes 1..{MULTI_MAX})")


NT = object()  # a CallList argument that is the thread count given to CallList.run
_KIND = {_P: "P", _L: "L", _I: "I", _F: "F"}


def call_table(lib: ctypes.CDLL | None = None) -> dict[str, int]:
    """The kernels ``hf_run_calls`` runs (name → its index in native.c's table), each with the argument kinds of its
    ``SIGNATURES`` entry; a kernel whose C table entry lists other kinds is left out (never run from a list)."""
    lib = lib or library()
    if lib is None:
        return {}
    got = _state.get("calls")
    if got is None or got[0] is not lib:
        table = {}
        for i in range(lib.hf_call_count()):
            name, sig = lib.hf_call_name(i).decode(), lib.hf_call_sig(i).decode()
            if name in SIGNATURES and "".join(_KIND.get(t, "?") for t in SIGNATURES[name]) == sig:
                table[name] = i
        got = _state["calls"] = (lib, table)
    return got[1]


def _arg_word(kind: Any, a: Any) -> int:
    if kind is _F:
        if not isinstance(a, (int, float)) or isinstance(a, bool):
            raise TypeError(f"a float argument, got {a!r}")
        return int.from_bytes(struct.pack("<f", a), "little")
    if a is NT and kind is _I:
        return -(2 ** 63)  # native.c's HF_NT
    if a is None and kind is _P:
        return 0
    if not isinstance(a, int) or isinstance(a, bool):
        raise TypeError(f"an integer argument, got {a!r}")
    return a


class CallList:
    """Kernel calls run in order by one ``hf_run_calls`` call, as if called one by one: ``calls`` holds
    ``(kernel name, arguments, check)`` with the arguments as ctypes would take them (ints, floats, None for a
    null pointer, :data:`NT` for the thread count given to :meth:`run`), and ``check(rc, name)`` raising for a
    nonzero status (None: any nonzero status raises RuntimeError). The executor runs its programs' runs of native
    calls this way (hetforge.executor.calllist): their arguments are fixed when the program is built."""

    def __init__(self, calls: list[tuple[str, list[Any], Callable[[int, str], None] | None]]):
        lib = library()
        table = call_table(lib)
        words: list[int] = []
        for name, args, _ in calls:
            if name not in table:
                raise ValueError(f"{name} is not a kernel hf_run_calls runs")
            kinds = SIGNATURES[name]
            if len(args) != len(kinds):
                raise ValueError(f"{name} takes {len(kinds)} arguments, got {len(args)}")
            words += [table[name], len(args), *(_arg_word(k, a) for k, a in zip(kinds, args, strict=True))]
        self.calls = calls
        self.n = len(calls)
        self.rec = (ctypes.c_int64 * len(words))(*words)
        self.status = ctypes.c_int64(0)
        self._run, self._status = lib.hf_run_calls, ctypes.byref(self.status)

    def run(self, threads: int) -> None:
        i = self._run(self.rec, self.n, threads, self._status)
        if i >= 0:
            rc = self.status.value
            name, _, check = self.calls[i]
            if rc == -100:
                raise RuntimeError(f"hf_run_calls: call {i} ({name}) is not a record it can run")
            if check is not None:
                check(rc, name)
            raise RuntimeError(f"{name} returned {rc}")


class RowsWriter:
    """New K/V rows copied into KV-cache buffers at a row position by one ``hf_rows_write`` call: ``rows[i]``
    (``[1, heads, n, d]``, its last dim dense) into ``buffers[i]`` (``[1, heads, S, d]``, dense) at rows
    ``[pos, pos + n)``. The rows' and buffers' addresses are read when it is made (it holds both, so they stay
    valid): it serves only calls with these very tensors. Why: one ATen ``copy_`` per buffer cost a dispatch each,
    2 x layers of them per decode step."""

    def __init__(self, rows: tuple[torch.Tensor, ...], buffers: list[torch.Tensor]):
        words: list[int] = []
        for row, buf in zip(rows, buffers, strict=True):
            es = row.element_size()
            words += [row.data_ptr(), buf.data_ptr(), row.shape[1], row.shape[2], row.shape[3] * es,
                      row.stride(1) * es, row.stride(2) * es, buf.stride(1) * es]
        self.rows, self.buffers = rows, buffers
        self.n = rows[0].shape[2] if rows else 0
        self.length = min((b.shape[2] for b in buffers), default=0)
        self.rec = (ctypes.c_int64 * max(1, len(words)))(*words)
        self._fn, self._nb = library().hf_rows_write, len(rows)

    @staticmethod
    def fits(rows: tuple[torch.Tensor, ...], buffers: list[torch.Tensor]) -> bool:
        """Whether the native copy takes these rows: the library loaded, every row the buffer's dtype and CPU
        layout ``[1, heads, n, d]`` with its last dim dense, every buffer dense, the same n in every row."""
        if library() is None or len(rows) != len(buffers) or not rows:
            return False
        n = rows[0].shape[2] if rows[0].dim() == 4 else -1
        for row, buf in zip(rows, buffers, strict=True):
            if (row.dim() != 4 or buf.dim() != 4 or row.device.type != "cpu" or buf.device.type != "cpu"
                    or row.dtype != buf.dtype or not buf.is_contiguous() or row.shape[0] != 1 or buf.shape[0] != 1
                    or row.shape[1] != buf.shape[1] or row.shape[3] != buf.shape[3] or row.shape[2] != n
                    or (row.stride(3) != 1 and row.shape[3] > 1)):
                return False
        return True

    def run(self, pos: int) -> None:
        """Copy the rows to rows ``[pos, pos + n)`` of every buffer."""
        if pos < 0 or pos + self.n > self.length:
            raise ValueError(f"rows {pos}..{pos + self.n} are not inside the buffers' {self.length} rows")
        self._fn(self.rec, self._nb, pos)


def amx_bf16_available() -> bool:
    """Whether :func:`gemm_amx_bf16` runs here: the library built with AMX (AMX-TILE, AMX-BF16) and the OS lets this
    process use the tile data."""
    lib = library()
    return lib is not None and bool(lib.hf_amx_bf16_ok())


def pack_amx_bf16(w: torch.Tensor, weight_t: bool = False) -> torch.Tensor:
    """``w`` (bf16 ``[N, K]``, or ``[K, N]`` when ``weight_t``) in the AMX tile layout :func:`gemm_amx_bf16` reads:
    ``ceil(N / 16) * ceil(K / 32)`` tiles of 512 bf16 (past N and K zero), as one flat tensor."""
    return _pack_bf16("hf_pack_amx_bf16", "AMX packing", w, weight_t,
                      lambda n, k: ((n + 15) // 16) * ((k + 31) // 32) * 512)


def _pack_bf16(fn: str, what: str, w: torch.Tensor, weight_t: bool, numel: Callable[[int, int], int]) -> torch.Tensor:
    """:func:`pack_amx_bf16` and :func:`pack_bf16_panels`: ``w`` checked (2-D bf16 on the CPU, the library built),
    packed by the kernel ``fn`` into a fresh flat tensor of ``numel(N, K)`` elements."""
    lib = library()
    w = w.contiguous()
    if lib is None or w.dim() != 2 or w.dtype != torch.bfloat16 or w.device.type != "cpu":
        raise ValueError(f"{what} takes a 2-D bf16 CPU weight and the native library, got {w.dtype} "
                         f"{tuple(w.shape)} on {w.device}")
    k, n = (w.shape if weight_t else (w.shape[1], w.shape[0]))
    out = torch.empty(numel(n, k), dtype=torch.bfloat16)
    getattr(lib, fn)(w.data_ptr(), out.data_ptr(), n, k, int(weight_t))
    return out


def gemm_amx_bf16(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, act: str = "none",
                  mul: torch.Tensor | None = None, res: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x·Wᵀ + b) * mul + res`` for bf16 rows ``x`` ``[..., K]`` (made contiguous) on AMX tiles, W packed by
    :func:`pack_amx_bf16` with ``n`` outputs; ``bias`` a contiguous bf16 ``[N]`` or None; a fresh bf16 ``[..., N]``
    (each product the fp32 sum plus bias, rounded once; then, as ATen's bf16 ops after a product would, the
    activation, the product with ``mul`` and the residual ``res``, each rounded: in the kernel's store where it
    has them, :func:`gemm_panel`'s rule)."""
    k = x.shape[-1]
    return _bf16_packed_gemm("hf_gemm_amx_bf16", x, packed, bias, n, ((n + 15) // 16) * ((k + 31) // 32) * 512,
                             act, mul, res, {-1: "cannot allocate its row scratch", -3: "AMX is not usable here"})


def bf16_panel_available() -> bool:
    """Whether :func:`gemm_bf16_panel` runs here: the library built with AVX512-BF16."""
    lib = library()
    return lib is not None and bool(lib.hf_bf16_panel_ok())


BF16_PANEL_NB = 48  # native.c's HF_BNB: output columns per panel of pack_bf16_panels


def _bf16_panel_numel(n: int, k: int) -> int:
    return -(-n // BF16_PANEL_NB) * -(-k // 2) * BF16_PANEL_NB * 2


def pack_bf16_panels(w: torch.Tensor, weight_t: bool = False) -> torch.Tensor:
    """``w`` (bf16 ``[N, K]``, or ``[K, N]`` when ``weight_t``) in the panel layout :func:`gemm_bf16_panel` reads:
    ``ceil(N / 48)`` panels of ``ceil(K / 2)`` k-pairs of 48 columns (past N and K zero), as one flat tensor."""
    return _pack_bf16("hf_pack_bf16_panels", "bf16 panel packing", w, weight_t, _bf16_panel_numel)


def gemm_bf16_panel(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, act: str = "none",
                    mul: torch.Tensor | None = None, res: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x·Wᵀ + b) * mul + res`` for bf16 rows ``x`` ``[..., K]`` (made contiguous; K even) on AVX512-BF16, W
    packed by :func:`pack_bf16_panels` with ``n`` outputs; ``bias`` a contiguous bf16 ``[N]`` or None; a fresh bf16
    ``[..., N]``. Each product is one fp32 sum over K's pairs (in the kernel's stream-interleaved order, the same for
    any thread count), plus bias, rounded once; then, as ATen's bf16
    ops after a product would, the activation, the product with ``mul`` and the residual ``res``, each rounded (in
    the kernel's store where it has them, :func:`gemm_amx_bf16`'s rule)."""
    k = x.shape[-1]
    if k % 2:
        raise ValueError(f"hf_gemm_bf16_panel takes bf16 x [..., K] with K even, got x {tuple(x.shape)}")
    return _bf16_packed_gemm("hf_gemm_bf16_panel", x, packed, bias, n, _bf16_panel_numel(n, k), act, mul, res,
                             {-1: "cannot allocate the scratch for x's packed pairs",
                              -3: "no AVX512-BF16 in this build"})


def _bf16_packed_gemm(fn: str, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, numel: int,
                      act: str, mul: torch.Tensor | None, res: torch.Tensor | None,
                      errors: dict[int, str]) -> torch.Tensor:
    """:func:`gemm_amx_bf16` and :func:`gemm_bf16_panel`: the operands checked (``numel``: the packing's size for
    ``[n, K]``), the kernel ``fn`` called with the epilogue it applies, the rest of the epilogue after it; its return
    codes -1 (MemoryError), -2 (no rows), -4 (an activation its store lacks) and ``errors``' own."""
    x = x.contiguous()
    k = x.shape[-1]
    rows = x.numel() // max(k, 1)
    bad_bias = bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous() or bias.numel() != n)
    if x.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16 or bad_bias or packed.numel() != numel:
        raise ValueError(f"{fn} takes bf16 x [..., {k}] and a weight packed for [{n}, {k}], got x {x.dtype} "
                         f"{tuple(x.shape)}, packed {packed.dtype} {packed.numel()} elements")
    y = torch.empty((*x.shape[:-1], n), dtype=torch.bfloat16)
    code, mp, rp, after = _epilogue(tuple(y.shape), torch.bfloat16, act, mul, res)
    rc = getattr(library(), fn)(packed.data_ptr(), x.data_ptr(), _ptr(bias), y.data_ptr(), rows, n, k,
                                torch.get_num_threads(), code, mp, rp)
    if rc:
        msg = {-2: "no rows", -4: "activation not in its epilogue", **errors}[rc]
        raise (MemoryError if rc == -1 else ValueError)(f"{fn}: {msg}")
    for step in after:
        step(y)
    return y


def gemv_multi(x: torch.Tensor, ws: list[torch.Tensor], biases: list[torch.Tensor | None],
               outs: list[torch.Tensor], threads: int | None = None) -> list[torch.Tensor]:
    """``outs[j] = x·ws[j]ᵀ (+ biases[j])`` for one fp32 row and up to :data:`MULTI_MAX` ``[N_j, K]`` weights, in
    one call of the native pool (each result bit-equal to its own :func:`gemv`). Operands as :func:`fits` checks
    them; ``x`` and every output contiguous fp32 (the kernel reads and writes 4-byte floats)."""
    k = x.numel()
    for w, b, o in zip(ws, biases, outs, strict=True):
        if not fits(w, b) or w.shape[1] != k or o.numel() != w.shape[0] or not o.is_contiguous() \
                or o.dtype != torch.float32:
            raise ValueError(f"one-row products: input {tuple(x.shape)}, weight {tuple(w.shape)} and output "
                             f"{tuple(o.shape)} {o.dtype} do not fit")
    if not x.is_contiguous() or x.dtype != torch.float32:
        raise ValueError(f"one-row products: the input row must be contiguous float32, got {x.dtype}")
    args = MultiArgs([w.data_ptr() for w in ws], [_ptr(b) for b in biases], [o.data_ptr() for o in outs],
                     [w.shape[0] for w in ws])
    args.call(x.data_ptr(), k, max(1, torch.get_num_threads() if threads is None else threads))
    return outs


def fits(w: torch.Tensor, bias: torch.Tensor | None = None, weight_t: bool = False,
         dtype: torch.dtype = torch.float32) -> bool:
    """Whether a one-row product with weight ``w`` (and ``bias``) and a ``dtype`` input can run on the native
    kernel: everything fp32, contiguous and on the CPU (it reads raw pointers), and the library built.
    The caller checks that the input is one contiguous row of length ``K``."""
    ok = w.dim() == 2 and dtype == torch.float32 and _f32(w, bias)
    if ok and bias is not None:
        ok = bias.numel() == w.shape[1 if weight_t else 0]
    return ok and library() is not None


def _f32(*ts: torch.Tensor | None) -> bool:
    """Real (not fake, not traced) contiguous fp32 CPU tensors: a kernel that reads raw pointers can only
    run eagerly; under export/tracing the op must stay an op (its ATen path is traced instead)."""
    if torch._C._len_torch_dispatch_stack() or torch.compiler.is_compiling():
        return False
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                             and not is_fake(t)) for t in ts)


def row_op_fits(x: torch.Tensor, *per_row: torch.Tensor | None) -> bool:
    """Whether a row op (norm, rotary) over ``x``'s last dim can run natively: fp32 contiguous CPU tensors,
    each of ``per_row`` (weight, bias, cos, sin; None allowed) one row of that width, library built."""
    d = x.shape[-1] if x.dim() else 0
    return (d > 0 and _f32(x, *per_row) and all(t is None or (t.numel() == d and t.shape[-1] == d) for t in per_row)
            and library() is not None)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face rotary with one position's ``cos``/``sin`` row for all of ``x``'s rows (bit-equal to the
    ATen chain); check :func:`row_op_fits` first (and an even width, and ``cos.dim() <= x.dim()``)."""
    y = torch.empty(x.shape, dtype=x.dtype)  # the broadcast shape: cos/sin are one row, no more dims than x
    d = x.shape[-1]
    library().hf_rotary(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), x.numel() // d, d,
                        torch.get_num_threads())
    return y


def rotary_positions(x: torch.Tensor, cos_ptr: int, sin_ptr: int, y_ptr: int, cos_stride: int,
                     dtype: torch.dtype = torch.float32) -> None:
    """Hugging Face rotary of a 4-D fp32 ``x`` ``[b, h, s, d]`` over many positions (``hf_rotary_pos``: read with
    ``x``'s own strides, e.g. a transposed projection output, no copy) into the dense ``[b, h, s, d]`` at
    ``y_ptr``; ``cos``/``sin`` hold one row of ``d`` floats per position (``cos_stride = d``) or one row for all
    (``0``). The executor calls it with pointers it checked at lowering; ``x`` is checked here (its layout is
    known only at run time): a last dim that is not dense, or not ``dtype`` (fp32; bf16: ``hf_rotary_pos_bf16``) on
    the CPU, is refused."""
    if x.dtype != dtype or x.device.type != "cpu" or x.dim() != 4 or x.stride(3) != 1:
        raise ValueError(f"hf_rotary_pos needs a 4-D {str(dtype).removeprefix('torch.')} CPU tensor with a dense "
                         f"last dim, got {x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}")
    b, h, s, d = x.shape
    fn = library().hf_rotary_pos if dtype == torch.float32 else library().hf_rotary_pos_bf16
    fn(x.data_ptr(), cos_ptr, sin_ptr, y_ptr, b, h, s, d, x.stride(0), x.stride(1),
                            x.stride(2), cos_stride, torch.get_num_threads())


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (equal to ATen's to rounding); check :func:`row_op_fits` first."""
    y = torch.empty_like(x)
    d = x.shape[-1]
    library().hf_rms_norm(x.data_ptr(), _ptr(weight), y.data_ptr(), x.numel() // d, d, eps, torch.get_num_threads())
    return y


SPAN_SCRATCH_ROWS = 16  # row_span's outputs for at most this many rows are per-thread scratch (see there)
_SPAN_SCRATCH = threading.local()


def row_span(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of the dense fp32 ``[m, k]`` ``x`` (k ≥ 2) as ``c + h·xn``, ``xn`` spanning exactly [-1, 1]:
    ``(xn, ch)``, ``ch[:, 0] = c``, ``ch[:, 1] = h`` (``hf_row_span``; the library must be loaded). For a few rows
    (a decode step) both are this thread's scratch, valid until its next call: making two tensors cost several
    times the kernel itself there, once per product of every step."""
    m, k = x.shape
    if m <= SPAN_SCRATCH_ROWS:
        scratch = _SPAN_SCRATCH.__dict__.setdefault("bufs", {})
        hit = scratch.get((m, k))
        if hit is None:
            xn, ch = torch.empty((m, k), dtype=torch.float32), torch.empty((m, 2), dtype=torch.float32)
            hit = scratch[(m, k)] = (xn, ch, xn.data_ptr(), ch.data_ptr())
        xn, ch, pxn, pch = hit
    else:
        xn, ch = torch.empty((m, k), dtype=torch.float32), torch.empty((m, 2), dtype=torch.float32)
        pxn, pch = xn.data_ptr(), ch.data_ptr()
    library().hf_row_span(x.data_ptr(), m, k, pxn, pch, torch.get_num_threads())
    return xn, ch


def row_unspan_(y: torch.Tensor, ch: torch.Tensor, wsum: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y = h·y + c·wsum + bias`` in place on the dense fp32 ``[m, n]`` product of :func:`row_span`'s ``xn``
    (``hf_row_unspan``), returning ``y``."""
    m, n = y.shape
    library().hf_row_unspan(y.data_ptr(), ch.data_ptr(), wsum.data_ptr(), _ptr(bias), m, n, torch.get_num_threads())
    return y


def i8_row_sums(q: torch.Tensor) -> torch.Tensor:
    """The int32 sums of the rows of a dense int8 ``[n, k]`` ``q`` (``hf_i8_row_sums``; the library must be loaded)."""
    n, k = q.shape
    out = torch.empty(n, dtype=torch.int32)
    library().hf_i8_row_sums(q.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim (equal to ATen's to rounding); check :func:`row_op_fits` first."""
    y = torch.empty_like(x)
    d = x.shape[-1]
    library().hf_layer_norm(x.data_ptr(), _ptr(weight), _ptr(bias), y.data_ptr(), x.numel() // d, d, eps,
                            torch.get_num_threads())
    return y


def transpose_into(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """``dst[n, k] = src[k, n]`` on the native tiled kernel, for a dense 2-D fp32 or bf16 ``src`` on the CPU and a
    dense ``dst`` of the transposed shape; False (nothing written) where the library is not loaded or the tensors
    do not fit, and the caller copies with ATen."""
    lib = library()
    if lib is None or src.dim() != 2 or src.dtype not in (torch.float32, torch.bfloat16) \
            or src.device.type != "cpu" or not src.is_contiguous() or not dst.is_contiguous() \
            or dst.dtype != src.dtype or tuple(dst.shape) != (src.shape[1], src.shape[0]) or is_fake(src):
        return False
    k, n = src.shape
    return lib.hf_transpose(src.data_ptr(), dst.data_ptr(), k, n, src.element_size(), torch.get_num_threads()) == 0


def decode_attention_fits(q, k, v, k_cache, v_cache, cache_mask, new_mask) -> bool:
    """Whether ``kv_attention`` is one new row (batch 1) of fp32 contiguous tensors the kernel can read."""
    if q.dim() != 4 or q.shape[0] != 1 or q.shape[2] != 1 or library() is None:
        return False
    if k.dim() != 4 or k_cache.dim() != 4:
        return False
    hkv, s, d = k.shape[1], k_cache.shape[2], q.shape[3]
    return (_f32(q, k, v, k_cache, v_cache, cache_mask, new_mask) and cache_mask.numel() == s
            and (new_mask is None or new_mask.numel() == 1) and tuple(k.shape) == (1, hkv, 1, d)
            and v.shape == k.shape and tuple(k_cache.shape) == (1, hkv, s, d) and v_cache.shape == k_cache.shape
            and q.shape[1] % hkv == 0)


def decode_attention(q, k, v, k_cache, v_cache, cache_mask, new_mask, scale: float) -> torch.Tensor:
    """``kv_attention`` for one new row: softmax(scale·q·[Kc; k]ᵀ + mask)·[Vc; v], per head, heads in
    parallel (equal to the ATen chain to rounding); check :func:`decode_attention_fits` first."""
    _, h, _, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    scratch = torch.empty((h, s + 1), dtype=q.dtype)
    library().hf_decode_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                  cache_mask.data_ptr(), _ptr(new_mask), out.data_ptr(), scratch.data_ptr(), h, hkv,
                                  s, d, scale, torch.get_num_threads())
    return out


PREFILL_ATTENTION_DMAX = 256  # native.c's PA_DMAX: the widest head the prefill attention kernel takes


def prefill_attention_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           is_causal: bool) -> bool:
    """Whether ``hetforge::attention`` can run on ``hf_prefill_attention``: 4-D CPU q/k/v of one dtype, fp32 or
    bf16 (any strides), ``q`` heads a multiple of ``k``'s, heads of at most :data:`PREFILL_ATTENTION_DMAX`, at least
    one query row and one key, and no mask or a mask broadcastable to ``[b, h, l, s]`` — bool, or additive in q's
    dtype — (not together with ``is_causal``, which SDPA refuses too); real tensors only (not under tracing),
    library built."""
    if torch._C._len_torch_dispatch_stack() or torch.compiler.is_compiling() or library() is None:
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    b, h, ell, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if not (k.shape[0] == b and tuple(v.shape[:3]) == (b, hkv, s) and k.shape[3] == d and hkv > 0 and h % hkv == 0
            and ell > 0 and s > 0 and 0 < d <= PREFILL_ATTENTION_DMAX and 0 < v.shape[3] <= PREFILL_ATTENTION_DMAX):
        return False
    if q.dtype not in (torch.float32, torch.bfloat16) or any(
            t.dtype != q.dtype or t.device.type != "cpu" or is_fake(t) or t.requires_grad for t in (q, k, v)):
        return False
    if mask is None:
        return True
    kind_ok = mask.dtype in (torch.bool, q.dtype)  # additive masks in q's dtype (a bf16 one is widened, exactly)
    if is_causal or not kind_ok or mask.device.type != "cpu" or is_fake(mask) \
            or mask.dim() > 4:
        return False
    return all(m in (1, w) for m, w in zip(mask.shape[::-1], (s, ell, h, b), strict=False))


# dtype -> the query row count from which a prefill's attention runs on ATen's SDPA instead of
# hf_prefill_attention (absent: the native kernel at every count): where SDPA was faster on every calibration head
# layout at that count and every larger one (bench/prefill_attention.py, docs/bench/prefill_attention.md). Empty
# since the bf16 products run on AMX tiles (session 29; before, the native kernel widened bf16 to fp32 FMAs and
# SDPA's flash kernel, multiplying in bf16, ran bf16 prompts from 128 rows), and on AVX512-BF16 dot products where
# the CPU has no AMX (session 41).
SDPA_MIN_ROWS: dict[str, int] = {}
# The same where the library's attention has AVX2 and FMA but no AVX-512 (its products, softmax and transposition on
# 8 lanes since session 56): the native kernel at every count, where bench/prefill_attention.py found it faster than
# SDPA on every calibration layout from 32 to 1024 rows and on two of three at 16 (a call of about 100 µs there;
# docs/bench/prefill_attention_avx2.md).
SDPA_MIN_ROWS_AVX2: dict[str, int] = {}
# The same where the library's attention has neither (plain C products and expf): SDPA from 512 fp32 rows, where
# bench/prefill_attention.py found it faster on every calibration layout at that count and above (an AVX2 CPU before
# session 56 built its attention this way; docs/arch/runtime.md, session 54).
SDPA_MIN_ROWS_PLAIN: dict[str, int] = {"float32": 512}


def prefill_attention_native(dtype: torch.dtype, rows: int) -> bool:
    """Whether a prefill attention of ``rows`` query rows in ``dtype`` runs on ``hf_prefill_attention`` (else on
    SDPA: :func:`sdpa_min_rows`); ``HETFORGE_PREFILL_ATTENTION=native`` or ``=sdpa`` forces one."""
    pol = os.environ.get("HETFORGE_PREFILL_ATTENTION", "auto").strip().lower()
    if pol in ("native", "sdpa"):
        return pol == "native"
    start = sdpa_min_rows().get(str(dtype).removeprefix("torch."))
    return start is None or rows < start


def prefill_attention_simd() -> str:
    """Which code ``hf_prefill_attention``'s fp32 products run here: ``"avx512"``, ``"avx2"`` or ``"plain"`` (C loops
    and expf); asked once (the rule reads it on every prefill attention call)."""
    return {1: "avx512", 2: "avx2"}.get(_answer("hf_prefill_attention_simd"), "plain")


def sdpa_min_rows() -> dict[str, int]:
    """The rule of this build's attention code: :data:`SDPA_MIN_ROWS` (AVX-512), :data:`SDPA_MIN_ROWS_AVX2` or
    :data:`SDPA_MIN_ROWS_PLAIN`."""
    return {"avx512": SDPA_MIN_ROWS, "avx2": SDPA_MIN_ROWS_AVX2}.get(prefill_attention_simd(), SDPA_MIN_ROWS_PLAIN)


AMX_ATTENTION_ENV = "HETFORGE_PREFILL_ATTENTION_AMX"


def amx_attention() -> bool:
    """Whether a bf16 prefill attention without a mask may run its products in bf16 (``hf_prefill_attention`` takes
    that path where the head dims are multiples of 32 / 16: AMX tiles where AMX runs, else AVX512-BF16 dot products
    where the CPU has them, :func:`prefill_attention_bf16_products`; p is rounded to bf16 before p·v, as SDPA's bf16
    kernel does); ``HETFORGE_PREFILL_ATTENTION_AMX=0`` keeps the widened fp32 FMA path."""
    return os.environ.get(AMX_ATTENTION_ENV, "1").strip() != "0"


def prefill_attention_bf16_products() -> str:
    """The products a bf16 prefill attention without a mask runs on here (when :func:`amx_attention` allows them):
    ``amx``, ``avx512-bf16`` or ``fp32-fma`` (widened; also without the library)."""
    lib = library()
    got = lib.hf_prefill_attention_bf16_products() if lib is not None else 0
    return {2: "amx", 1: "avx512-bf16"}.get(got, "fp32-fma")


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(3) == 1 else t.contiguous()


def _prefill_attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                            is_causal: bool, out_strides: tuple[int, int, int] | None = None) -> tuple:
    """The operands (rows made dense, a bf16 mask widened) and the dims / strides / mask kind that
    ``hf_prefill_attention`` takes (``out_strides``: the output's batch, head and row strides in elements; None =
    a dense ``[b, h, l, dv]``); ValueError for what :func:`prefill_attention_fits` refuses."""
    if not prefill_attention_fits(q, k, v, mask, is_causal):
        raise ValueError(f"hf_prefill_attention cannot run q {q.dtype} {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, mask {None if mask is None else (mask.dtype, tuple(mask.shape))}")
    q, k, v = _dense_rows(q), _dense_rows(k), _dense_rows(v)
    if mask is not None and mask.dtype == torch.bfloat16:
        mask = mask.float()  # every bf16 value is an fp32 value: the kernel adds the same numbers
    b, h, ell, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    kind, ms = 0, (0, 0, 0, 0)
    if mask is not None:
        kind = 1 if mask.dtype == torch.bool else 2
        ms = mask.expand(b, h, ell, s).stride()
    dv = v.shape[3]
    dims = (ctypes.c_long * 7)(b, h, hkv, ell, s, d, dv)
    os_ = out_strides if out_strides is not None else (h * ell * dv, ell * dv, dv)
    strides = (ctypes.c_long * 16)(*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *ms, *os_)
    return q, k, v, mask, dims, strides, kind


def _prefill_attention_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                            y_ptr: int, dims, strides, kind: int, scale: float, is_causal: bool) -> None:
    bf16 = (2 if amx_attention() else 1) if q.dtype == torch.bfloat16 else 0
    rc = library().hf_prefill_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), _ptr(mask), y_ptr, dims, strides,
                                        kind, int(is_causal), scale, torch.get_num_threads(), bf16)
    if rc:
        raise (MemoryError if rc == -1 else ValueError)(
            "hf_prefill_attention: " + ("cannot allocate its key/value scratch" if rc == -1 else
                                        f"shape outside its limits (head dims {dims[5]}/{dims[6]}, heads "
                                        f"{dims[1]}/{dims[2]})"))


def prefill_attention_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           y_ptr: int, scale: float, is_causal: bool) -> None:
    """``softmax(scale·q·kᵀ + mask)·v`` into the dense ``[b, h, l, dv]`` buffer of q's dtype at ``y_ptr``, on
    ``hf_prefill_attention`` (q/k/v read with their strides: a transposed view of a fused projection is not
    copied; a last dim that is not dense is). The operands are checked here (their layouts are known only at run
    time): what :func:`prefill_attention_fits` refuses raises ValueError."""
    q, k, v, mask, dims, strides, kind = _prefill_attention_args(q, k, v, mask, is_causal)
    _prefill_attention_call(q, k, v, mask, y_ptr, dims, strides, kind, scale, is_causal)


def mask_is_causal(mask: torch.Tensor) -> bool:
    """Whether a 2-D bool mask ``[l, s]`` (dense columns) shows key j to query i exactly when j <= i, as
    ``hf_prefill_attention`` checks it (``hf_mask_is_causal``) before running a bool mask shared by every head as
    ``is_causal``."""
    lib = library()
    if lib is None:
        raise RuntimeError("the native library is not built")
    if mask.dtype != torch.bool or mask.dim() != 2 or mask.stride(1) != 1:
        raise ValueError(f"mask_is_causal takes a 2-D bool mask with dense columns, not {mask.dtype} "
                         f"{tuple(mask.shape)} strides {mask.stride()}")
    return bool(lib.hf_mask_is_causal(mask.data_ptr(), mask.shape[0], mask.shape[1], mask.stride(0)))


class PrefillAttention:
    """One attention instruction of a program on ``hf_prefill_attention``: called as
    :func:`prefill_attention_into` without scale and causality, writing the output at ``out_strides`` (batch,
    head, row element strides; None = dense ``[b, h, l, dv]``). A program hands it operands of the same layout
    on every call, so the checks and the kernel's dims / strides are made once per layout and kept; a call
    whose shapes, strides or dtypes differ from the kept ones is checked again (operands that need a copy are
    never kept). Why: the checks are Python work between two GEMMs that evict its data from cache, each call."""

    def __init__(self, scale: float, is_causal: bool, out_strides: tuple[int, int, int] | None = None):
        self.scale, self.is_causal, self.out_strides = scale, is_causal, out_strides
        self._key: tuple | None = None
        self._args: tuple = ()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 y_ptr: int) -> None:
        key = (q.shape, q.stride(), q.dtype, k.shape, k.stride(), k.dtype, v.shape, v.stride(), v.dtype,
               None if mask is None else (mask.shape, mask.stride(), mask.dtype))
        if key != self._key:
            q2, k2, v2, m2, dims, strides, kind = _prefill_attention_args(q, k, v, mask, self.is_causal,
                                                                          self.out_strides)
            if q2 is not q or k2 is not k or v2 is not v or m2 is not mask:  # copies: checked on every call
                self._key = None
                _prefill_attention_call(q2, k2, v2, m2, y_ptr, dims, strides, kind, self.scale, self.is_causal)
                return
            self._key, self._args = key, (dims, strides, kind)
        dims, strides, kind = self._args
        _prefill_attention_call(q, k, v, mask, y_ptr, dims, strides, kind, self.scale, self.is_causal)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                      is_causal: bool) -> torch.Tensor:
    """``hetforge::attention`` on the native kernel, into a fresh dense ``[b, h, l, dv]`` tensor (equal to SDPA to
    rounding; bf16 in, the fp32 result rounded once to bf16 out); check :func:`prefill_attention_fits` first."""
    out = torch.empty((*q.shape[:3], v.shape[3]), dtype=q.dtype)
    prefill_attention_into(q, k, v, mask, out.data_ptr(), scale, is_causal)
    return out


def q8_fits(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, act: str) -> bool:
    """Whether ``hetforge::linear_w8`` is one fp32 row the int8 kernel can read: int8 ``[N, K]`` weights, fp32
    ``[N]`` scales (and bias), all contiguous CPU tensors, a known activation, the library built (the operands of
    :func:`q8_rows_fit`, one row)."""
    return x.dim() >= 1 and x.numel() == x.shape[-1] and q8_rows_fit(x, qweight, scales, bias, act)


W8_ACT_MODES = ("weight-only", "q8")
W8_ACT_ALIASES = {"float": "weight-only"}  # the earlier name of weight-only (HETFORGE_W8_ACT=float)
W8_ACT_DEFAULT = "q8"
W8_ACT_ENV = "HETFORGE_W8_ACT"


def _check_act(mode: str, scheme: str, env: str) -> str:
    """``mode`` as one of :data:`W8_ACT_MODES` (``float`` is accepted for weight-only), else a UsageError naming
    ``scheme``'s option and environment variable."""
    mode = W8_ACT_ALIASES.get(mode, mode)
    if mode not in W8_ACT_MODES:
        from hetforge.errors import UsageError

        raise UsageError(f"the {scheme} activation mode (--{scheme}-act / {env}) must be one of "
                         f"{', '.join(W8_ACT_MODES)} (or float, the same as weight-only), got {mode!r}")
    return mode


def check_w8_act(mode: str) -> str:
    """``mode`` as one of :data:`W8_ACT_MODES` (``float`` is accepted for weight-only), else a UsageError."""
    return _check_act(mode, "w8", W8_ACT_ENV)


def set_w8_act(mode: str | None) -> None:
    """Set the w8 activation mode for this process and the processes it starts (``hetforge bench peers`` runs
    each system in its own): the CLI's ``--w8-act``. It travels as ``HETFORGE_W8_ACT``, which the compile cache
    key, the kernel context and the benchmark harness's command line already record. None: leave as is."""
    if mode is not None:
        os.environ[W8_ACT_ENV] = check_w8_act(mode)


def w8_act_mode() -> str:
    """How a w8 (int8 weight-only storage) product takes its activation, decode and prefill alike:

    * ``q8`` (default): x quantized per block of 32 (one fp32 scale per block, round-half-even to [-127, 127],
      as llama.cpp's Q8_0 does) and int8·int8 products with exact int32 block sums — ``hf_gemv_q8a`` for one
      row, ``hf_gemm_q8a`` for several (row r of a prefill has the bits a decode step gives for that row);
    * ``weight-only``: fp32 x — ``hf_gemv_q8`` for one row (equal to ``_weight_int8pack_mm`` to rounding), the
      weight dequantized per call and one float GEMM for several.

    Set by ``--w8-act`` or ``HETFORGE_W8_ACT``. Without the native kernels every product takes the ATen path
    (weight-only arithmetic) whatever the mode."""
    return check_w8_act(os.environ.get(W8_ACT_ENV) or W8_ACT_DEFAULT)


def q8_kernel(rows: int = 1) -> str | None:
    """The native function a w8 product of ``rows`` rows runs under :func:`w8_act_mode` (None: no native kernel,
    the several-row weight-only product is a float GEMM)."""
    q8 = w8_act_mode() == "q8"
    if rows == 1:
        return "hf_gemv_q8a" if q8 else "hf_gemv_q8"
    return "hf_gemm_q8a" if q8 else None


def quantize_i8(w_nk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """Per-channel symmetric int8 of a float32 ``[N, K]`` weight (contiguous, or the transpose of a contiguous
    ``[K, N]`` one): ``(q int8 [N, K], scales fp32 [N], ‖w − q·s‖ / ‖w‖)`` with the bits of
    :func:`hetforge.quant.schemes.quantize_int8` in two passes over the weight (``hf_quantize_i8``); None when
    the native kernels are not built, the layout or dtype is another, or the weight holds a NaN or ±Inf."""
    lib = library()
    if lib is None or w_nk.dtype != torch.float32 or w_nk.dim() != 2 or w_nk.device.type != "cpu":
        return None
    n, k = w_nk.shape
    if w_nk.is_contiguous():
        kn = 0
    elif w_nk.t().is_contiguous():
        kn = 1
    else:
        return None
    chunks = lib.hf_quantize_i8_chunks(n)
    q, s = torch.empty((n, k), dtype=torch.int8), torch.empty(n)
    err, nrm = torch.zeros(chunks, dtype=torch.float64), torch.zeros(chunks, dtype=torch.float64)
    if lib.hf_quantize_i8(w_nk.data_ptr(), n, k, kn, q.data_ptr(), s.data_ptr(), err.data_ptr(), nrm.data_ptr(),
                          torch.get_num_threads()):
        return None
    denom = float(nrm.sum()) ** 0.5
    return q, s, (float(err.sum()) ** 0.5 / denom if denom > 0 else 0.0)


def check_rc(rc: int, fn: str = "hf_gemm_q8a") -> None:
    """Raise when a native int8 kernel could not allocate its scratch (it returned -1, output untouched)."""
    if rc:
        raise MemoryError(f"{fn}: could not allocate the scratch for the quantized activations")


def gemv_q8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
            act: str) -> torch.Tensor:
    """``act(x·(q·s)ᵀ + b)`` for one fp32 row (fp32 x, equal to ``_weight_int8pack_mm`` to rounding, or x quantized
    per block of 32 under ``q8``, :func:`w8_act_mode`); check :func:`q8_fits` first."""
    n, k = qweight.shape
    y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    fn = q8_kernel()
    rc = getattr(library(), fn)(qweight.data_ptr(), scales.data_ptr(), x.data_ptr(), _ptr(bias), y.data_ptr(), n, k,
                                ACT_CODES[act], torch.get_num_threads())
    if fn == "hf_gemv_q8a":
        check_rc(rc, fn)
    return y


# ---------------------------------------------------------------- bfloat16 one-row kernels (--precision bf16)

BF16_PATHS = ("portable", "avx512", "avx512_bf16")  # native.c's BF16_* (hf_bf16_path): lowest to best


def bf16_path(force: str | None = None) -> str:
    """The best bf16 dot-product path this build has (``avx512_bf16``: ``vdpbf16ps``; ``avx512``: shift to fp32
    and FMA; ``portable``: plain C); ``force`` makes the kernels use a lower one (a test hook; None: the best).
    Every path gives the same bits on normal numbers (native.c)."""
    lib = library()
    assert lib is not None, status().reason
    best = lib.hf_bf16_path(-1 if force is None else BF16_PATHS.index(force))
    return BF16_PATHS[best]


def bf16_fits(*ts: torch.Tensor | None) -> bool:
    """Real contiguous bf16 CPU tensors (None allowed) and the library built: what the ``_bf16`` kernels read."""
    if torch._C._len_torch_dispatch_stack() or torch.compiler.is_compiling():
        return False
    return library() is not None and all(
        t is None or (t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() and not is_fake(t))
        for t in ts)


def gemv_bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, weight_t: bool = False,
              act: str = "none", threads: int | None = None) -> torch.Tensor:
    """``act(x·Wᵀ + b)`` (``x·W`` when ``weight_t``) for one bf16 row on ``hf_gemv_bf16``: fp32 sums, one
    round-to-nearest-even to bf16 (then the activation from the rounded value, rounded again, as ATen's bf16
    chain); check :func:`bf16_fits` and the shapes first."""
    k, n = w.shape if weight_t else (w.shape[1], w.shape[0])
    if x.numel() != k or (bias is not None and bias.numel() != n):
        raise ValueError(f"one-row bf16 product: input {tuple(x.shape)} does not fit weight {tuple(w.shape)}")
    y = torch.empty((*x.shape[:-1], n), dtype=torch.bfloat16)
    part = torch.empty((split_k_slots(), n), dtype=torch.float32) if weight_t else None
    library().hf_gemv_bf16(w.data_ptr(), x.data_ptr(), _ptr(bias), y.data_ptr(), n, k, int(weight_t),
                           ACT_CODES[act], torch.get_num_threads() if threads is None else threads, _ptr(part),
                           0 if part is None else part.shape[0])
    return y


def gated_mlp(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor | None,
              act: str = "silu") -> torch.Tensor:
    """One fp32 row of ``act(x·Wgᵀ) * (x·Wuᵀ)`` (then ``·Wdᵀ``) on ``hf_gated_mlp``: gate and up in one pool call,
    each row summed as ``hf_gemv_nk`` sums it; check :func:`gated_mlp_fits` first."""
    f, d = wg.shape
    h = torch.empty(f, dtype=torch.float32)
    y = h if wd is None else torch.empty(d, dtype=torch.float32)
    library().hf_gated_mlp(x.data_ptr(), wg.data_ptr(), wu.data_ptr(), _ptr(wd), h.data_ptr(), y.data_ptr(), f, d,
                           ACT_CODES[act], torch.get_num_threads())
    return y.reshape(*x.shape[:-1], -1)


def gated_mlp_fits(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor | None, act: str) -> bool:
    """Whether :func:`gated_mlp` (fp32) or :func:`gated_mlp_bf16` can run one row ``x``: real contiguous CPU
    tensors of one dtype, ``Wg``/``Wu`` ``[F, D]``, ``Wd`` ``[D, F]``, an activation the kernel has."""
    if act not in ACT_CODES or wg.dim() != 2 or wg.shape != wu.shape or x.numel() != wg.shape[1] \
            or (wd is not None and tuple(wd.shape) != (wg.shape[1], wg.shape[0])):
        return False
    if x.dtype == torch.bfloat16:
        return bf16_fits(x, wg, wu, wd) and library() is not None
    return row_op_fits(x) and _f32(wg, wu, wd) and library() is not None


MOE_EMAX = 256  # native.c HF_MOE_EMAX: the most experts hf_moe_token routes over


def moe_token_fits(x: torch.Tensor, router_w: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   act: str, top_k: int) -> bool:
    """Whether :func:`moe_token` can take one token ``x`` ([1, D]) through experts stacked ``[E, 2F, D]`` /
    ``[E, D, F]`` with router ``[E, D]``: real contiguous fp32 CPU tensors, an activation the kernel has, 1 ≤ k ≤
    E ≤ :data:`MOE_EMAX`, library built."""
    if act not in ACT_CODES or x.numel() == 0 or w_gate_up.dim() != 3 or w_down.dim() != 3 or router_w.dim() != 2:
        return False
    e, f2, d = w_gate_up.shape
    return (x.numel() == d and f2 % 2 == 0 and tuple(w_down.shape) == (e, d, f2 // 2)
            and tuple(router_w.shape) == (e, d) and 1 <= top_k <= e <= MOE_EMAX
            and row_op_fits(x) and _f32(router_w, w_gate_up, w_down) and library() is not None)


def moe_token(x: torch.Tensor, router_w: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
              norm_topk: bool, act: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token through an MoE block on ``hf_moe_token`` (router, softmax, top-k, the k gated-MLP experts in
    ascending order, the weighted sum): (out [1, D], weights [1, k], expert ids [1, k], probabilities [1, E]);
    check :func:`moe_token_fits` first."""
    e, f2, d = w_gate_up.shape
    out = torch.empty((1, d), dtype=torch.float32)
    idx = torch.empty((1, top_k), dtype=torch.long)
    w = torch.empty((1, top_k), dtype=torch.float32)
    probs = torch.empty((1, e), dtype=torch.float32)
    h, y = torch.empty(f2 // 2, dtype=torch.float32), torch.empty(d, dtype=torch.float32)
    rc = library().hf_moe_token(x.data_ptr(), router_w.data_ptr(), w_gate_up.data_ptr(), w_down.data_ptr(), e, d,
                                f2 // 2, top_k, int(norm_topk), ACT_CODES[act], h.data_ptr(), y.data_ptr(),
                                out.data_ptr(), idx.data_ptr(), w.data_ptr(), probs.data_ptr(),
                                torch.get_num_threads())
    if rc:
        raise ValueError(f"hf_moe_token: top_k {top_k} with {e} experts is outside 1..E <= {MOE_EMAX}")
    return out, w, idx, probs


def gated_mlp_bf16(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor | None,
                   act: str = "silu") -> torch.Tensor:
    """One bf16 row of ``act(x·Wgᵀ) * (x·Wuᵀ)`` (then ``·Wdᵀ``) on ``hf_gated_mlp_bf16``."""
    f, d = wg.shape
    h = torch.empty(f, dtype=torch.bfloat16)
    y = h if wd is None else torch.empty(d, dtype=torch.bfloat16)
    library().hf_gated_mlp_bf16(x.data_ptr(), wg.data_ptr(), wu.data_ptr(), _ptr(wd), h.data_ptr(), y.data_ptr(),
                                f, d, ACT_CODES[act], torch.get_num_threads())
    return y.reshape(*x.shape[:-1], -1)


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Hugging Face RMSNorm of bf16 rows (fp32 statistics, ATen's two roundings)."""
    y = torch.empty_like(x)
    d = x.shape[-1]
    library().hf_rms_norm_bf16(x.data_ptr(), _ptr(weight), y.data_ptr(), x.numel() // d, d, eps,
                                torch.get_num_threads())
    return y


def layer_norm_bf16(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    eps: float) -> torch.Tensor:
    """LayerNorm of bf16 rows over the last dim (fp32 inside, one rounding)."""
    y = torch.empty_like(x)
    d = x.shape[-1]
    library().hf_layer_norm_bf16(x.data_ptr(), _ptr(weight), _ptr(bias), y.data_ptr(), x.numel() // d, d, eps,
                                  torch.get_num_threads())
    return y


def rotary_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face rotary of bf16 rows with one position's ``cos``/``sin`` row (bit-equal to ATen's bf16 chain)."""
    y = torch.empty(x.shape, dtype=x.dtype)
    d = x.shape[-1]
    library().hf_rotary_bf16(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), x.numel() // d, d,
                             torch.get_num_threads())
    return y


def attention_scratch_floats(h: int, s: int, d: int) -> int:
    """fp32 scratch of ``hf_decode_attention_bf16``: per head ``s + 1`` scores, ``d`` of q and ``d`` of output."""
    return h * (s + 1 + 2 * d)


def decode_attention_bf16(q, k, v, k_cache, v_cache, cache_mask, new_mask, scale: float) -> torch.Tensor:
    """``kv_attention`` for one new bf16 row (fp32 inside, the output rounded once); shapes as
    :func:`decode_attention_fits` checks them for fp32, every tensor bf16."""
    _, h, _, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    scratch = torch.empty(attention_scratch_floats(h, s, d), dtype=torch.float32)
    library().hf_decode_attention_bf16(q.data_ptr(), k.data_ptr(), v.data_ptr(), k_cache.data_ptr(),
                                       v_cache.data_ptr(), cache_mask.data_ptr(), _ptr(new_mask), out.data_ptr(),
                                       scratch.data_ptr(), h, hkv, s, d, scale, torch.get_num_threads())
    return out


def q8_rows_fit(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                act: str) -> bool:
    """Whether a w8 product of fp32 rows (``x [.., K]``, contiguous, any number of rows) can run on the native int8
    kernels: int8 ``[N, K]`` weights, fp32 ``[N]`` scales (and bias), contiguous CPU tensors, a known activation,
    the library built."""
    if qweight.dim() != 2 or act not in ACT_CODES or x.dim() < 1 or x.shape[-1] != qweight.shape[1]:
        return False
    n = qweight.shape[0]
    return (qweight.dtype == torch.int8 and qweight.is_contiguous() and qweight.device.type == "cpu"
            and not is_fake(qweight) and _f32(x, scales, bias) and scales.numel() == n
            and (bias is None or bias.numel() == n) and library() is not None)


def gemm_act_split(act: str) -> tuple[int, str]:
    """How a several-row ``hf_gemm_q8a`` applies ``act``: (the code passed to C, the activation applied after it
    in place: :func:`act_inplace`). ReLU runs in C; GELU and SiLU run as a vectorized pass on the result
    (:func:`act_inplace`: the native one for the tanh GELU and SiLU, ATen's for the erf GELU), because C's
    per-element libm calls (erff, tanhf, expf) cost more than the product itself at prefill sizes (measured:
    gelu_tanh made a [128, 768]×[3072, 768] product 3.6× slower). Results equal the fused op to rounding."""
    return (ACT_CODES[act], "none") if act in ("none", "relu") else (0, act)


def gemm_q8a(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
             act: str) -> torch.Tensor:
    """``act(x·(q·s)ᵀ + b)`` for the rows of ``x`` ``[.., K]``, each quantized per block of 32 (``hf_gemm_q8a``:
    before the activation row r equals :func:`gemv_q8` of row r under ``q8``); check :func:`q8_rows_fit` first."""
    n, k = qweight.shape
    m = x.numel() // k if k else 0
    y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    code, after = gemm_act_split(act)
    check_rc(library().hf_gemm_q8a(qweight.data_ptr(), scales.data_ptr(), x.data_ptr(), _ptr(bias), y.data_ptr(),
                                   m, n, k, code, torch.get_num_threads()))
    return act_inplace(y, after)


# ---------------------------------------------------------------- int4 weights × int8 activation blocks (w4)

W4_ACT_MODES = W8_ACT_MODES
W4_ACT_DEFAULT = "q8"
W4_ACT_ENV = "HETFORGE_W4_ACT"
Q4A_PATHS = ("portable", "vnni", "avx2")  # native.c's Q4A_* (hf_q4a_path), by their codes
Q4_ROW_BLOCK_DEFAULT = 64  # the block a build without the library would read (AVX-512 torch builds' layout)


def q4_row_block() -> int:
    """Rows per block of ATen's packed int4 layout that this build's ``hf_gemv_q4a`` / ``hf_gemm_q4a`` read
    (native.c ``hf_q4_block``): 64 on the AVX512-VNNI build, 32 on the AVX2 one, as torch's AVX-512 and AVX2
    builds pack them."""
    return _answer("hf_q4_block") or Q4_ROW_BLOCK_DEFAULT


def check_w4_act(mode: str) -> str:
    """``mode`` as one of :data:`W4_ACT_MODES` (the w8 modes), else a UsageError."""
    return _check_act(mode, "w4", W4_ACT_ENV)


def set_w4_act(mode: str | None) -> None:
    """Set the w4 activation mode for this process and the processes it starts (the CLI's ``--w4-act``), as
    ``HETFORGE_W4_ACT`` (recorded by the compile cache key, the kernel context and the benchmark harness)."""
    if mode is not None:
        os.environ[W4_ACT_ENV] = check_w4_act(mode)


def w4_act_mode() -> str:
    """How a w4 (group-wise int4 weight) product takes its activation, decode and prefill alike:

    * ``q8`` (default): x quantized per block of 32 as under w8's ``q8`` and int4·int8 products with exact int32
      block sums — ``hf_gemv_q4a`` for one row, ``hf_gemm_q4a`` for several (row r of a prefill has the bits a
      decode step gives for that row), where the build has their AVX512-VNNI + VBMI or AVX2 + FMA path and the
      weight is in the layout those kernels read (:func:`hetforge.ops.quant.w4_native_fits`);
    * ``weight-only``: fp32 x — ATen's ``_weight_int4pack_mm_for_cpu`` for one row, the weight dequantized per
      call and one float GEMM for several.

    Set by ``--w4-act`` or ``HETFORGE_W4_ACT``. Where the native kernels cannot run, products take the
    weight-only path whatever the mode."""
    return check_w4_act(os.environ.get(W4_ACT_ENV) or W4_ACT_DEFAULT)


def q4a_path(force: str | None | bool = False) -> str:
    """The best int4·int8 path this build has (``vnni``: AVX512-VNNI + VBMI; ``avx2``: AVX2 + FMA; ``portable``:
    plain C, the same bits); ``force="portable"`` makes the kernels run plain C, None resets (test hooks); False
    only asks (the build's answer, asked once: :func:`_answer`)."""
    lib = library()
    assert lib is not None, status().reason
    if force is False:
        return Q4A_PATHS[_answer("hf_q4a_path", -2)]
    return Q4A_PATHS[lib.hf_q4a_path(-1 if force is None else Q4A_PATHS.index(force))]


def q4_kernel(rows: int = 1) -> str | None:
    """The native function a w4 product of ``rows`` rows runs under :func:`w4_act_mode` (None: the ATen path):
    only under ``q8``, with the library built and its VNNI or AVX2 path compiled (the portable C path is there for
    checking; on hosts with neither ATen's kernels are faster)."""
    if w4_act_mode() != "q8" or rows < 1 or library() is None or q4a_path() == "portable":
        return None
    return "hf_gemv_q4a" if rows == 1 else "hf_gemm_q4a"


def check_few_rc(rc: int, fn: str = "hf_gemm_few") -> None:
    """Raise when a few-row product refused its call (-2: a row count outside 1..32; output untouched)."""
    if rc:
        raise ValueError(f"{fn}: row count outside 1..32")


def check_q4_rc(rc: int, fn: str = "hf_gemm_q4a") -> None:
    """Raise when a native int4 kernel refused its call (-1: no scratch; -2: a shape outside the kernel)."""
    if rc == -1:
        raise MemoryError(f"{fn}: could not allocate the scratch for the quantized activations")
    if rc:
        raise ValueError(f"{fn}: shape outside the kernel (N a multiple of {q4_row_block()}, G a multiple of 32 "
                         "dividing K)")


def q4a(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
        bias: torch.Tensor | None, act: str) -> torch.Tensor:
    """``act(x·Wᵀ + b)`` for the rows of fp32 ``x`` ``[.., K]`` on ``hf_gemv_q4a`` (one row) or ``hf_gemm_q4a``
    (several; GELU/SiLU then applied by ATen in place, :func:`gemm_act_split`), each row quantized per block of
    32; check :func:`hetforge.ops.quant.w4_native_fits` first."""
    n, k = packed.shape[0], packed.shape[1] * 2
    m = x.numel() // k if k else 0
    y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    lib, nt = library(), torch.get_num_threads()
    if m == 1:
        check_q4_rc(lib.hf_gemv_q4a(packed.data_ptr(), scales_zeros.data_ptr(), x.data_ptr(), _ptr(bias),
                                    y.data_ptr(), n, k, group_size, ACT_CODES[act], nt), "hf_gemv_q4a")
        return y
    code, after = gemm_act_split(act)
    check_q4_rc(lib.hf_gemm_q4a(packed.data_ptr(), scales_zeros.data_ptr(), x.data_ptr(), _ptr(bias), y.data_ptr(),
                                m, n, k, group_size, code, nt))
    return act_inplace(y, after)
