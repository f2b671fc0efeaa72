"""Where a running program's CPU time goes, by Linux ``perf`` sampling of this process (measured).

``perf_shares(fn)`` calls ``fn`` in a loop while ``perf record -p <this process>`` samples every thread of it
(CPU-clock samples at ``freq`` Hz), then sorts the samples into the categories of :func:`category`: oneDNN's
JIT-compiled GEMM code, the native kernels by kind, the OpenMP runtime (a thread waiting at a barrier or for the
next parallel region spins there, so its samples are time the thread did no work), Python, ATen and the rest.
Why: a program's per-instruction profile times each instruction from Python, so a product's time there includes
the OpenMP waits and the dispatch around its kernel; sampling shows how much of the wall time the GEMM code itself
takes. A sleeping thread takes no samples, so the shares are of the threads' running time (about the wall time
when every thread spins between regions, as torch's OpenMP threads do).
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

GEMM_CATEGORIES = ("GEMM: oneDNN JIT code", "GEMM: native kernels")
_LINE = re.compile(r"^\s*(\d+)\s+([0-9a-f]+)\s+(.*?)\s+\((.*)\)\s*$")


def category(sym: str, dso: str) -> str:
    """The category of one sample: its symbol and the file (DSO) it lies in, as ``perf script`` names them."""
    base = dso.rsplit("/", 1)[-1]
    if base.startswith("perf-") and base.endswith(".map") or dso.startswith("[JIT]"):
        return "GEMM: oneDNN JIT code"  # the only JIT code in an fp32 prefill is oneDNN's products and epilogues
    if base.startswith("hetforge_native"):
        s = sym.split(".", 1)[0]
        if s.startswith("panel_pack"):
            return "GEMM: packing X (native)"
        if s.startswith(("panel_chunk", "bpanel_chunk", "hf_gemm", "amx_", "few_")):
            return "GEMM: native kernels"
        if s.startswith(("pa_", "hf_prefill_attention")):
            return "attention (native)"
        if s.startswith(("hf_rms_norm", "hf_layer_norm", "hf_rotary", "hf_ewise", "hf_act")):
            return "norms, rotary, elementwise (native)"
        return "other native code"
    if base.startswith("libgomp"):
        return "OpenMP runtime (waits, fork/join)"
    if base.startswith(("libpython", "python")) or ".cpython-" in base:  # the interpreter and extension modules
        return "Python"
    if base.startswith(("libtorch", "libc10")):  # oneDNN is linked into libtorch_cpu: its C++ driver code lies there
        if any(t in sym for t in ("dnnl", "brgemm", "Xbyak", "ideep")):
            return "oneDNN driver code, primitive setup"
        return "ATen / torch dispatch"
    if "kernel" in base:
        return "OS kernel"
    return "other (libc, allocator, …)"


def perf_shares(fn: Callable[[], object], seconds: float = 4.0, freq: int = 999) -> dict:
    """Sample this process with ``perf record`` for ``seconds`` while calling ``fn`` in a loop. Returns
    ``{"shares": {category: fraction}, "samples": n, "calls": c, "ms_per_call": t, "seconds": s, "freq": f}``, or
    ``{"error": reason}`` where perf is missing or may not sample this process (``perf_event_paranoid``)."""
    perf = shutil.which("perf")
    if perf is None:
        return {"error": "perf is not installed (Debian: apt-get install linux-perf)"}
    with tempfile.TemporaryDirectory(prefix="hetforge-perf-") as tmp:
        data = Path(tmp) / "perf.data"
        proc = subprocess.Popen([perf, "record", "-q", "-F", str(freq), "-p", str(os.getpid()), "-o", str(data),
                                 "--", "sleep", str(seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        calls, t0 = 0, time.perf_counter()
        while proc.poll() is None:
            fn()
            calls += 1
        wall = time.perf_counter() - t0
        err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
        if proc.returncode != 0 or not data.exists():
            return {"error": f"perf record failed (exit {proc.returncode}): {err.splitlines()[-1] if err else ''}"}
        out = subprocess.run([perf, "script", "-i", str(data), "-F", "tid,ip,sym,dso"], capture_output=True,
                             text=True, errors="replace")
    counts: collections.Counter[str] = collections.Counter()
    for line in out.stdout.splitlines():
        m = _LINE.match(line)
        if m:
            counts[category(m.group(3), m.group(4))] += 1
    total = sum(counts.values())
    if total == 0:
        return {"error": "perf recorded no samples of this process"}
    return {"shares": {k: round(v / total, 4) for k, v in counts.most_common()}, "samples": total, "calls": calls,
            "ms_per_call": round(wall / max(1, calls) * 1e3, 2), "seconds": seconds, "freq": freq}


def gemm_share(perf: dict) -> float:
    """The share of the samples in GEMM code (oneDNN's JIT products and the native product kernels; not packing)."""
    return sum(perf["shares"].get(k, 0.0) for k in GEMM_CATEGORIES)


def derived(perf: dict, ratio: float) -> tuple[float, float, float]:
    """(g, rate, floor) from a sampled record and the prefill ÷ bound ``ratio``: g the GEMM code's share, rate = 1/(g·r)
    the GEMM code's speed as a share of the bound's peak, floor = 1 + (1 − g)·r the ratio left if every GEMM ran at the
    peak with the rest unchanged (both assume the timed call had the sampled window's shares)."""
    g = gemm_share(perf)
    return g, (1 / (g * ratio) if g > 0 and ratio > 0 else float("nan")), 1 + (1 - g) * ratio
