"""hetforge's native CPU kernels: C sources in this folder, compiled by the host's C compiler on first use.

Why native code: a decode step is a chain of one-row products that must stream every weight at memory
speed, and neither ATen's single-threaded GEMV nor a threaded ``bmm`` over a chunked view gets there on
a small CPU (see ``gemv.c``). The kernels are plain C with OpenMP; they are built once per source and
CPU into a cache folder (``$HETFORGE_CACHE``, else ``$XDG_CACHE_HOME/hetforge``, else
``~/.cache/hetforge``) in about a second, then loaded with :mod:`ctypes`. torch is imported first, so the
library's ``libgomp.so.1`` resolves to the copy torch already loaded: one OpenMP thread pool, not two.

Everything here is optional: with no C compiler, a failed build, or ``HETFORGE_NATIVE=0``,
:func:`library` returns None, :func:`status` says why, and callers use their ATen path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("gemv.c")
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"])

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


@dataclass
class NativeStatus:
    """Whether the native kernels are loaded, from where, and why not when they are not."""

    available: bool
    path: str | None = None
    reason: str = ""
    flags: tuple[str, ...] = ()


_state: dict[str, object] = {}


def cache_dir() -> Path:
    env = os.environ.get("HETFORGE_CACHE")
    if env:
        return Path(env) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetforge" / "kernels"


def _cpu_tag() -> str:
    """What ``-march=native`` depends on: the machine and its CPU flags (so a shared cache stays correct)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


def _build(cc: str, flags: list[str], out: Path) -> str | None:
    """Compile ``SOURCE`` into ``out`` atomically (temp file, then rename); the compiler's error or None."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, "-shared", "-fPIC", str(SOURCE), "-o", tmp], capture_output=True,
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


def _load() -> tuple[ctypes.CDLL | None, NativeStatus]:
    if os.environ.get("HETFORGE_NATIVE", "1") == "0":
        return None, NativeStatus(False, reason="disabled by HETFORGE_NATIVE=0")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, NativeStatus(False, reason="no C compiler (cc/gcc) on PATH")
    src = SOURCE.read_bytes()
    errors = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(src + " ".join([cc, *flags]).encode() + _cpu_tag().encode()).hexdigest()[:16]
        path = cache_dir() / f"hetforge_native_{key}.so"
        err = None if path.exists() else _build(cc, flags, path)
        if err is None:
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:
                errors.append(str(e))
                continue
            lib.hf_gemv_nk.argtypes = [_P, _P, _P, _P, _L, _L, _I]
            lib.hf_gemv_nk.restype = None
            lib.hf_gemv_kn.argtypes = [_P, _P, _P, _P, _L, _L, _I, _P, _I]
            lib.hf_gemv_kn.restype = None
            return lib, NativeStatus(True, str(path), "", tuple(flags))
        errors.append(f"{cc} {' '.join(flags)}: {err}")
    return None, NativeStatus(False, reason="could not build the native kernels: " + "; ".join(errors))


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (built on first call), or None when unavailable."""
    if "lib" not in _state:
        _state["lib"], _state["status"] = _load()
    return _state["lib"]  # type: ignore[return-value]


def status() -> NativeStatus:
    library()
    return _state["status"]  # type: ignore[return-value]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, weight_t: bool,
         threads: int | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``out = x·Wᵀ (+ b)`` (``x·W`` when ``weight_t``) for one fp32 row, on the native kernel.

    All tensors must be contiguous fp32 on the CPU (checked by :func:`fits`); ``scratch`` is the split-K
    partial-row buffer (``[slots, N]``) for ``weight_t``, made here when not given."""
    lib = library()
    assert lib is not None, status().reason
    threads = torch.get_num_threads() if threads is None else threads
    if weight_t:
        k, n = w.shape
        if scratch is None:
            scratch = torch.empty((threads, n), dtype=torch.float32)
        lib.hf_gemv_kn(w.data_ptr(), x.data_ptr(), _ptr(bias), out.data_ptr(), n, k, threads, scratch.data_ptr(),
                       scratch.shape[0])
    else:
        n, k = w.shape
        lib.hf_gemv_nk(w.data_ptr(), x.data_ptr(), _ptr(bias), out.data_ptr(), n, k, threads)
    return out


def fits(w: torch.Tensor, bias: torch.Tensor | None = None, weight_t: bool = False,
         dtype: torch.dtype = torch.float32) -> bool:
    """Whether a one-row product with weight ``w`` (and ``bias``) and a ``dtype`` input can run on the native
    kernel: everything fp32, contiguous and on the CPU (it reads raw pointers), and the library built.
    The caller checks that the input is one contiguous row of length ``K``."""
    ok = (w.dim() == 2 and dtype == w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous())
    if ok and bias is not None:
        ok = (bias.dtype == torch.float32 and bias.is_contiguous() and bias.device.type == "cpu"
              and bias.numel() == w.shape[1 if weight_t else 0])
    return ok and library() is not None
