"""Build a program in a forked child process, into the compile cache, while this process builds another.

A cold request needs two programs before its first token: the prefill program and the decode program. Most of
their cost is Python on one core (``torch.export`` capture, the passes, lowering), so on a machine with two or more
cores the decode program is built at the same time in a ``fork()``-ed child: the child captures, optimizes,
places and lowers it exactly as this process would, stores the result in the on-disk compile cache
(:mod:`hetforge.runtime.compile_cache`) and exits. This process waits for the child before the prefill program's
first call (a quantized program's warm-up call, else the request's own prefill, which comes after the decode
program is taken; see below), then takes the decode program's entry as an ordinary cache hit (checked like any other:
a missing, cut-off or stale one is rebuilt here). The wait is counted in the decode program's compile time, so
``compile_s`` still sums to what the user waited. The child keys its entry, its kernel context and its kernel
choices for the parent's thread count (:func:`hetforge.kernels.onednn.pin_threads`) and measures no choice: one it
did not inherit from the parent makes it fail, and the parent builds that program itself.

Why a child process and not a thread: the work holds the GIL. Why the child is safe to fork: it runs its torch
ops on one thread (libgomp's thread team does not survive ``fork``; one thread never enters it), hetforge's
native pool runs inline in a forked child (``native.c``), and the child leaves with ``os._exit`` (no atexit
handlers, no flush of the parent's buffers). It runs at a lower priority (``nice``), so the parent's
multi-threaded work (kernel-choice timings while it builds the prefill program) keeps both cores. After ``fork``
every page is
copy-on-write, also the free pages glibc's heap keeps: an allocation reusing one pays a write fault
(docs/arch/runtime.md has the measurement), so the heap's free pages are handed back to the kernel before the fork
and after the child is gone (:func:`hetforge.executor.allocator.release_freed_memory`), and the parent waits for the
child before the prefill program's first call (``ProgramCache._make``, ``Engine``), which writes the most pages.

Not done (this process builds the program itself, as before) where: ``fork`` is missing (not Linux), the process
may use fewer than two cores, the compile cache is off or its folder is not writable, the executor's programs are
not cached (``fx``, plans), the executor quantizes (:func:`quantize_refusal`), CUDA was started in this process
(CUDA does not survive ``fork``), or ``HETFORGE_PARALLEL_COMPILE=0``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from hetforge.executor.allocator import release_freed_memory
from hetforge.hardware.host import cpu_count as _cores

ENV = "HETFORGE_PARALLEL_COMPILE"
NICE = 10  # the child's priority below the parent's
TIMEOUT_S = 600.0  # a child not done by then is stopped and the program built here (a bound, not an estimate)


def process_refusal() -> str | None:
    """Why no program is built in a forked child in this process (``HETFORGE_PARALLEL_COMPILE=0``, no ``fork``,
    fewer than two cores, CUDA already started here), or None."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "off", "no", "false"):
        return f"{ENV}=0"
    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return "no fork() on this platform"
    if _cores() < 2:
        return "fewer than two cores"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was started in this process, and a fork()-ed child cannot use it"
    return None


def _backend_refusal(executor: Any) -> str | None:
    """Why a child may not build ``executor``'s programs here: a backend a device is bound to refuses compiling in
    a forked child (:meth:`hetforge.backends.base.Backend.fork_refusal`, e.g. OpenVINO once this process made its
    ``Core``); None otherwise."""
    for b in (getattr(executor, "bindings", None) or {}).values():
        why = b.backend.fork_refusal()
        if why:
            return why
    return None


def quantize_refusal(quantize: str | None) -> str | None:
    """Why programs quantized with ``quantize`` are not built in a forked child, or None. A child quantizes every
    weight again on its one core (this process quantizes each weight once for all its programs,
    ``quant.rewrite.shared_quantized``). For w8 / w8a8 the native kernel makes that cheap (``native.quantize_i8``,
    two passes over each weight), and the program the child returns binds this process's own quantized
    tensors where they are equal (``compile_cache._twin``), so a child pays (docs/arch/runtime.md: a cold w8
    request on gpt2 3.02–3.63 s in turn against 2.29–2.56 s with a child). Refused where quantizing takes ATen's
    many passes: w4 (group-wise, then packed by ATen: 2.91–2.92 s in turn against 3.88–4.48 s with a child), or
    w8 / w8a8 on a host without the native kernels."""
    if quantize in (None, "none"):
        return None
    from hetforge.kernels import native

    if quantize in ("w8", "w8a8") and native.library() is not None:
        return None
    why = "ATen quantizes and packs its weights" if quantize == "w4" else "its weights are quantized on ATen's path"
    return f"--quantize {quantize}: {why}, so this process quantizes each weight once for all its programs"


def spare_cores() -> int:
    """How many children may build beside this process at once: the cores it may use, less its own."""
    return max(0, _cores() - 1)


def refusal(programs: Any) -> str | None:
    """Why a program of ``programs`` (a :class:`~hetforge.runtime.programs.ProgramCache`) is not built ahead in a
    child here, or None when it may be."""
    from hetforge.runtime import compile_cache

    why = process_refusal()
    if why:
        return why
    if programs.fixed is not None:
        return "a generation plan's programs are rebuilt from the plan"
    why = quantize_refusal(getattr(programs.executor, "quantize", None)) or _backend_refusal(programs.executor)
    if why:
        return why
    if not compile_cache.holds(programs):
        return "the compile cache does not hold this executor's programs"
    compile_cache.max_bytes()  # a bad size bound is the parent's usage error, before any child exists
    d = compile_cache.cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return f"compile cache folder '{d}' cannot be made"
    if not os.access(d, os.W_OK):
        return f"compile cache folder '{d}' is not writable"
    return None


@dataclass
class Ahead:
    """A child building one program; :meth:`join` waits for it (at most :data:`TIMEOUT_S`), :meth:`cancel` stops
    it."""

    pid: int
    fd: int
    started: float
    done: bool = False
    start_s: float = 0.0  # what starting it took in the parent (checks, freeing, fork): the caller sets it
    imports_s: float = 0.0  # of that, the capture machinery's imports made before the fork (preload_capture)

    def join(self) -> tuple[bool, float, str, float]:
        """Wait for the child: (stored, the child's own seconds, its error line, seconds waited here). A child
        still running after :data:`TIMEOUT_S` from its start is stopped and reported; an interruption while
        waiting (Ctrl-C) stops it too, then propagates."""
        import select

        t0 = time.perf_counter()
        chunks: list[bytes] = []
        try:
            while True:
                left = TIMEOUT_S - (time.perf_counter() - self.started)
                if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                    self.cancel()
                    return False, time.perf_counter() - self.started, \
                        f"no answer after {TIMEOUT_S:.0f} s: stopped", time.perf_counter() - t0
                b = os.read(self.fd, 65536)
                if not b:
                    break
                chunks.append(b)
            os.close(self.fd)
            _, status = os.waitpid(self.pid, 0)
            self.done = True
        except BaseException:
            self.cancel()
            raise
        release_freed_memory()  # pages freed while the child lived are still marked copy-on-write
        waited = time.perf_counter() - t0
        try:
            msg = json.loads(b"".join(chunks).decode() or "{}")
        except ValueError:
            msg = {}
        code = os.waitstatus_to_exitcode(status)
        ok = code == 0 and bool(msg.get("stored"))
        if not ok:
            _remove_temp_files(self.pid)
        err = str(msg.get("error") or (f"exit status {code}" if not ok else ""))
        return ok, float(msg.get("seconds", 0.0)), err, waited

    def cancel(self) -> None:
        """Stop the child (this process gave up on the request) and remove what it may have left half-written."""
        import signal

        if self.done:
            return
        self.done = True
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        _remove_temp_files(self.pid)


def _remove_temp_files(pid: int) -> None:
    """A child that died mid-store leaves its ``.KEY.<pid>.tmp`` files (the store writes, then renames)."""
    from hetforge.runtime import compile_cache

    try:
        for p in compile_cache.cache_dir().glob(f".*.{pid}.tmp"):
            p.unlink(missing_ok=True)
    except OSError:
        pass


def start(build: Any) -> Ahead | None:
    """Fork a child that calls ``build()`` (which must store its program in the compile cache and return whether
    it did) and exits; None where the fork fails."""
    import torch

    from hetforge.frontend import preload_capture
    from hetforge.kernels import onednn

    threads = torch.get_num_threads()
    imports_s = preload_capture()  # imported once here, not once here and once more in the child
    release_freed_memory()  # free heap pages would be shared copy-on-write with the child: give them back first
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return None
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(r)
            os.nice(NICE)
            torch.set_num_threads(1)  # see the module docstring: libgomp's team is not usable after fork
            onednn.pin_threads(threads)  # choices, kernel context and cache key for the parent's thread count
            t0 = time.perf_counter()
            msg: dict[str, Any] = {"stored": False}
            try:
                msg["stored"] = bool(build())
            except BaseException as e:  # noqa: BLE001 - reported to the parent, which builds it itself
                msg["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            msg["seconds"] = time.perf_counter() - t0
            os.write(w, json.dumps(msg).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return Ahead(pid, r, time.perf_counter(), imports_s=imports_s)
