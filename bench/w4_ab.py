"""w4 before/after, interleaved in one process: ``--w4-act weight-only`` (ATen's int4 kernel for one row, the weight
dequantized per call + one float GEMM for several) vs ``--w4-act q8`` (hetforge's int4 × q8-activation kernels
``hf_gemv_q4a`` / ``hf_gemm_q4a``). Prints measured figures (wall clock, this host) and the load average.

* kernels: one product per shape, GFLOP/s of ``hf_gemm_q4a`` / ``hf_gemv_q4a`` next to ``hf_gemm_q8a`` /
  ``hf_gemv_q8a`` (w8's q8 kernels), the weight-only w4 path and fp32 ``F.linear`` on the same shape, best of
  ``--rounds`` interleaved rounds of 5 calls;
* models: per model two ``Engine(quantize="w4")`` (one per mode; the mode is set around each call), TTFT
  (``GenerationResult.ttft_s``: the prefill in the engine's default mode, fine, and the first pick) at each
  ``--lengths`` and decode ms/token over ``--new-tokens`` after the first length, in interleaved rounds; median
  and best.

    .venv/bin/python bench/w4_ab.py [--models gpt2 llama-110m] [--lengths 16 84 128 512] [--rounds 5]
                                    [--threads 2] [--new-tokens 32] [--no-kernels] [--no-models] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

MODES = ("weight-only", "q8")
SHAPES = ((1, 3072, 768), (1, 768, 3072), (16, 3072, 768), (128, 2304, 768), (128, 3072, 768), (512, 768, 3072))


def _best(fn, calls: int = 5) -> float:
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def _products(m: int, n: int, k: int, group: int) -> dict:
    """The products timed on one ``[m, k]·[n, k]ᵀ`` shape, on the same seeded weight."""
    from hetforge.kernels import native
    from hetforge.ops.quant import dequantize_w4
    from hetforge.quant.schemes import pack_int4, quantize_int4, quantize_int8

    g = torch.Generator().manual_seed(m + n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    q4, s4 = quantize_int4(w, group)
    packed, sz = pack_int4(q4, s4)
    q8, s8 = quantize_int8(w)
    y = torch.empty(n)
    if m > 1:
        q8a = lambda: native.gemm_q8a(x, q8, s8, None, "none")  # noqa: E731
        w4 = lambda: torch.nn.functional.linear(x, dequantize_w4(packed, sz, group))  # noqa: E731
    else:
        q8a = lambda: native.library().hf_gemv_q8a(q8.data_ptr(), s8.data_ptr(), x.data_ptr(), None,  # noqa: E731
                                                   y.data_ptr(), n, k, 0, torch.get_num_threads())
        w4 = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)  # noqa: E731
    return {"q4a": lambda: native.q4a(x, packed, sz, group, None, "none"), "q8a": q8a, "w4 weight-only": w4,
            "fp32": lambda: torch.nn.functional.linear(x, w)}


def kernels(rounds: int, group: int) -> list[dict]:
    out = []
    for m, n, k in SHAPES:
        fns = _products(m, n, k, group)
        times: dict[str, list[float]] = {key: [] for key in fns}
        for _ in range(rounds):
            for key, fn in fns.items():
                times[key].append(_best(fn))
        row = {"shape": [m, n, k], "group": group,
               "ms": {key: round(min(v) * 1e3, 4) for key, v in times.items()},
               "gflops": {key: round(2 * m * n * k / min(v) / 1e9, 1) for key, v in times.items()}}
        out.append(row)
        print(f"[{m}x{k}]·[{n}x{k}]ᵀ G={group} (measured, best of {rounds}): "
              + "  ".join(f"{key} {row['ms'][key]:.3f} ms = {row['gflops'][key]:.0f} GFLOP/s" for key in fns),
              flush=True)
    return out


def model(name: str, lengths: list[int], rounds: int, new_tokens: int) -> dict:
    from hetforge.models.zoo import load_model
    from hetforge.runtime import Engine, SamplingParams

    loaded = load_model(name)
    engines = {}
    for mode in MODES:
        os.environ["HETFORGE_W4_ACT"] = mode
        engines[mode] = Engine(loaded, quantize="w4")
    g = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(1, loaded.vocab_size - 1, (n,), generator=g).tolist() for n in lengths}

    def run(mode: str, n: int, new: int = 1):
        os.environ["HETFORGE_W4_ACT"] = mode
        return engines[mode].generate(prompts[n], SamplingParams(max_new_tokens=new, ignore_eos=True))

    for mode in MODES:  # compile every program (excluded from the figures)
        for n in lengths:
            run(mode, n)
        run(mode, lengths[0], new_tokens)
    ttft = {mode: {n: [] for n in lengths} for mode in MODES}
    dec: dict[str, list[float]] = {mode: [] for mode in MODES}
    first: dict[str, dict] = {mode: {} for mode in MODES}
    for _ in range(rounds):
        for n in lengths:
            for mode in MODES:
                r = run(mode, n)
                ttft[mode][n].append(r.ttft_s * 1e3)
                first[mode][n] = r.tokens[0]
        for mode in MODES:
            r = run(mode, lengths[0], new_tokens)
            dec[mode].append(r.decode_ms_per_token)
            first[mode]["gen"] = r.tokens
    res = {"model": name, "ttft_ms": {}, "decode_ms_per_token": {}}
    for n in lengths:
        a, b = ttft["weight-only"][n], ttft["q8"][n]
        res["ttft_ms"][n] = {mode: {"median": round(statistics.median(v), 2), "best": round(min(v), 2)}
                             for mode, v in ((m, ttft[m][n]) for m in MODES)}
        print(f"{name} [1,{n}] TTFT (measured, median / best of {rounds}): weight-only {statistics.median(a):.1f} / "
              f"{min(a):.1f} ms, q8 {statistics.median(b):.1f} / {min(b):.1f} ms "
              f"(median ratio {statistics.median(a) / statistics.median(b):.2f}x); same first token: "
              f"{first['weight-only'][n] == first['q8'][n]}", flush=True)
    a, b = dec["weight-only"], dec["q8"]
    same = sum(x == y for x, y in zip(first["weight-only"]["gen"], first["q8"]["gen"], strict=False))
    res["decode_ms_per_token"] = {mode: {"median": round(statistics.median(v), 3), "best": round(min(v), 3)}
                                  for mode, v in dec.items()}
    res["greedy_tokens_equal"] = [same, new_tokens]
    print(f"{name} decode after [1,{lengths[0]}], {new_tokens} tokens (measured, median / best of {rounds}): "
          f"weight-only {statistics.median(a):.2f} / {min(a):.2f} ms/token, q8 {statistics.median(b):.2f} / "
          f"{min(b):.2f} ms/token; greedy tokens equal {same}/{new_tokens}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama-110m"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[16, 84, 128, 512])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--no-models", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.rounds < 1 or a.threads < 1 or a.new_tokens < 1 or min(a.lengths) < 1:
        print("error: --rounds, --threads, --new-tokens and --lengths must be >= 1", file=sys.stderr)
        sys.exit(2)
    from hetforge.kernels import native

    if native.library() is None or native.q4a_path() == "portable":
        print("error: hf_gemm_q4a needs the native kernels with AVX512-VNNI + VBMI or AVX2 + FMA: "
              + (native.status().reason or "this CPU lacks them"), file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("HETFORGE_CACHE", tempfile.mkdtemp(prefix="hetforge-w4ab-"))  # no stale programs
    torch.set_num_threads(a.threads)
    doc: dict = {"threads": a.threads, "load_before": os.getloadavg()}
    print(f"threads {a.threads}; load average before {os.getloadavg()}", flush=True)
    if not a.no_kernels:
        doc["kernels"] = kernels(a.rounds, a.group_size)
    if not a.no_models:
        doc["models"] = [model(name, a.lengths, a.rounds, a.new_tokens) for name in a.models]
    doc["load_after"] = os.getloadavg()
    print(f"load average after {doc['load_after']}")
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
