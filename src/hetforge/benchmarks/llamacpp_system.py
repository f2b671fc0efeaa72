"""llama.cpp as a decode peer (through llama-cpp-python), on the zoo model's own seeded weights.

Preparation: the weights are written as GGUF by :mod:`hetforge.benchmarks.gguf_export` (``f32`` or
``q8_0``; measured as stage ``gguf_write``) and loaded by ``llama_cpp.Llama`` with the benchmark's thread
count (stage ``load``). Forward (prefill, and the one-token step): a fresh context evaluates the token ids and
returns the logits of every position (``logits_all``), so fidelity is compared like any other peer's.
Decode: the prompt is evaluated (time to first token = that plus the greedy pick), then one token at a time
through llama.cpp's own KV cache, greedy; the mean time per new token is reported (measured).

llama-cpp-python ships as source on PyPI: installing it builds llama.cpp with the host's compiler (CMake, a C++
compiler; several minutes on two cores). Without it this peer is reported as not installed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetforge.benchmarks.base import DecodeTiming, Prepared, PrepContext
from hetforge.models.zoo import LoadedModel


def open_gguf(loaded: LoadedModel, workdir: Path, qtype: str, threads: int, n_ctx: int, logits_all: bool,
              check: Callable[[Path], None] | None = None) -> tuple[Any, dict[str, float], Path]:
    """Write ``loaded``'s weights as GGUF ``qtype`` under ``workdir`` and load them with ``llama_cpp.Llama``
    (``threads`` for both batch and single-token evaluation; ``logits_all`` keeps every position's logits in
    ``Llama.scores``, else only the last position's are computed: read them with :func:`last_logits`).
    ``check`` is called with the file's path before this process loads it (e.g. a probe in a child process).
    Returns (the Llama, seconds of stages ``gguf_write`` and ``load``, the file's path)."""
    from hetforge.benchmarks.gguf_export import write_gguf

    stages: dict[str, float] = {}
    t0 = time.perf_counter()
    path = write_gguf(loaded, workdir / f"{loaded.name}-{qtype}.gguf", qtype)
    stages["gguf_write"] = time.perf_counter() - t0
    if check is not None:
        check(path)
    t0 = time.perf_counter()
    llm = load_gguf(path, threads, n_ctx, logits_all)
    stages["load"] = time.perf_counter() - t0
    return llm, stages, path


def load_gguf(path: Path | str, threads: int, n_ctx: int, logits_all: bool) -> Any:
    """``llama_cpp.Llama`` on the GGUF file ``path`` with the benchmarks' settings (see :func:`open_gguf`)."""
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                           n_threads_batch=threads, logits_all=logits_all, verbose=False, use_mmap=True)


def build_info() -> str:
    """The llama-cpp-python version and the CPU features its llama.cpp was built with (``llama_print_system_info``):
    which kernels the peer could use, e.g. whether ggml's AMX backend is in the build."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    feats = [k.split(":")[-1].strip() for k, _, v in (part.partition("=") for part in info.split("|"))
             if v.strip() == "1"]
    built = ", ".join(feats) or "no listed features"
    return f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')} (built with {built})"


def last_logits(llm: Any, vocab: int) -> np.ndarray:
    """The logits of the last position of the latest ``Llama.eval`` (a view into llama.cpp's buffer)."""
    import llama_cpp

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))


def prepare_llamacpp(ctx: PrepContext, qtype: str) -> Prepared:
    n_ctx = min(ctx.loaded.max_positions, max(512, 2 * ctx.prefill_inputs[0].shape[1] + 256))
    llm, stages, path = open_gguf(ctx.loaded, ctx.workdir, qtype, ctx.threads, n_ctx, logits_all=True)
    vocab = ctx.loaded.vocab_size

    def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        toks = [int(t) for t in ids[0].tolist()]
        llm.reset()
        llm.eval(toks)
        return torch.from_numpy(np.array(llm.scores[: len(toks), :vocab], dtype=np.float32)).unsqueeze(0)

    def decode(inputs: tuple[torch.Tensor, torch.Tensor], n: int, tries: int = 2) -> DecodeTiming:
        prompt = [int(t) for t in inputs[0][0].tolist()]
        best = None
        for _ in range(tries):  # the first request warms llama.cpp's buffers; keep the better one
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(prompt)
            tok = int(np.argmax(llm.scores[len(prompt) - 1, :vocab]))
            stamps = [time.perf_counter()]
            for _ in range(n):
                llm.eval([tok])
                tok = int(np.argmax(llm.scores[llm.n_tokens - 1, :vocab]))
                stamps.append(time.perf_counter())
            gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
            cur = DecodeTiming((stamps[0] - t0) * 1e3, sum(gaps) / len(gaps) * 1e3, len(gaps))
            if best is None or cur.decode_ms_per_token < best.decode_ms_per_token:
                best = cur
        return best

    notes = [f"GGUF {qtype} written from the zoo's seeded weights ({path.stat().st_size / 2**20:.1f} MiB); "
             f"{build_info()}, n_ctx {n_ctx}"]
    return Prepared(forward=forward, stages=stages, decode=decode if ctx.loaded.kind == "causal-lm" else None,
                    notes=notes, precision=qtype)
