"""Time to first token (TTFT) at several prompt lengths: hetforge's three prefill modes (tier-padded, chunked,
fine: the default), per ``--quantize`` scheme, next to peers that prefill the exact prompt length.

Usage: python bench/ttft.py [--models gpt2 llama-110m] [--lengths 16 84 500] [--quantize none w8 w4 w8a8 bf16]
                            [--rounds 3] [--threads 2] [--peers hf ov-f32 ov-default llamacpp-f32 llamacpp-q8
                             llamacpp-q4]
                            [--json docs/bench/ttft.json] [--md docs/bench/ttft.md]
       python bench/ttft.py --from-json docs/bench/ttft.json --md docs/bench/ttft.md

``--quantize`` takes hetforge's weight schemes (``none`` = fp32, ``w8``, ``w4``, ``w8a8``) and ``bf16``: the
model in bfloat16 as ``hetforge run --precision bf16`` loads it (refused, and noted, on a CPU without bf16
instructions). Peers: ``hf``, ``ov-f32``, ``ov-default``, ``llamacpp-f32``, ``llamacpp-q8``, ``llamacpp-q4``.

Per model, in one process: build every system, warm each up at every length (hetforge compiles its programs
here; the compile seconds per program are recorded), then ``--rounds`` rounds; in each round every length
runs every system once (interleaved, so drift and other processes hit all of them), in the listed order in
even rounds and in reverse in odd ones (so no system always runs right after the same one).

* hetforge TTFT = the runtime's own timer (``GenerationResult.ttft_s``: every prefill program call, the KV
  writes and the first greedy pick; compilation excluded), for a request of ``--new-tokens`` (default 1, so
  the KV cache is the prompt's tier). The modes (``Engine.prefill_mode``, ``runtime.programs.prefill_pieces``):
  ``tier`` = the prompt padded to the next power-of-two tier, one prefill call; ``chunked`` = the largest tier
  ``<= n`` plus chunks over the KV cache; ``fine`` (the engine's default) = one call of a program about the
  prompt's length (``runtime.programs.fine_length``: padded to a multiple of 8, by at most 1/8 from 64 tokens).
* ``hf`` = Hugging Face eager, one forward of exactly ``n`` tokens with ``logits_to_keep=1`` and the argmax
  (a reference row: not one of the peers the ratios divide by).
* ``ov-f32`` / ``ov-default`` = OpenVINO's CPU plugin on the same model converted with a dynamic sequence
  length (``logits_to_keep=1``), compiled with ``INFERENCE_NUM_THREADS`` = ``--threads`` and the f32 hint or
  the plugin's default precision (bf16 where the CPU has it); one stateless inference of exactly ``n`` tokens
  and the argmax. This is OpenVINO's prefill, not its stateful KV-cache pipeline (optimum-intel, which also
  writes the KV state).
* ``llamacpp-f32`` / ``llamacpp-q8`` / ``llamacpp-q4`` = llama.cpp (llama-cpp-python) on the same seeded weights
  written as GGUF f32 / Q8_0 / Q4_0 (``hetforge.benchmarks.gguf_export``) into a temporary folder removed at the
  end, loaded with ``n_threads`` = ``n_threads_batch`` = ``--threads``, ``n_batch`` = ``n_ubatch`` = 512 and only
  the last position's logits computed; TTFT = ``reset()`` + ``eval`` of exactly ``n`` tokens + the argmax of the last
  logits. Marked not installed when ``llama_cpp`` (or ``gguf``) is not importable. Each GGUF is first evaluated
  at every length in a child process (:func:`_probe`); a build that dies there is noted and left out of the run
  instead of ending it.

The ratio table divides hetforge's fine (default) TTFT by the best (lowest median) peer of the matching precision
(:data:`MATCHING`: fp32 by ov-f32 and llamacpp-f32, w8 and w8a8 by llamacpp-q8, w4 by llamacpp-q4, bf16 by
ov-default; Q8_0 also rounds the activations to 8 bits in its products, hence the 8-bit peer of both w8 and w8a8;
Q4_0 does the same with 4-bit weights, as w4's default ``--w4-act q8`` does) and by the best peer of any
precision, naming the peer in each cell.
All times are wall clock, measured on this host. The peers run in the same process as hetforge (their thread
pools may wait on each other between calls); the page says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pages import page_from_json, write_result  # noqa: E402

from hetforge.errors import UsageError  # noqa: E402
from hetforge.hardware.isa import host_record  # noqa: E402
from hetforge.models.zoo import LoadedModel, load_model  # noqa: E402
from hetforge.runtime import Engine, SamplingParams  # noqa: E402
from hetforge.runtime.programs import CALL_TOKENS, CHUNK_MIN, FINE_PER_OCTAVE, prefill_pieces  # noqa: E402

PEERS = ("hf", "ov-f32", "ov-default", "llamacpp-f32", "llamacpp-q8", "llamacpp-q4")
SCHEMES = ("none", "w8", "w4", "w8a8", "bf16")
GGUF_TYPE = {"llamacpp-f32": "f32", "llamacpp-q8": "q8_0", "llamacpp-q4": "q4_0"}
# hetforge precision -> the peers of the matching precision (None: no such peer here, every peer counts)
MATCHING: dict[str, tuple[str, ...] | None] = {"fp32": ("ov-f32", "llamacpp-f32"), "w8": ("llamacpp-q8",),
                                               "w8a8": ("llamacpp-q8",), "bf16": ("ov-default",),
                                               "w4": ("llamacpp-q4",)}


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed + n)
    return torch.randint(1, vocab - 1, (n,), generator=g).tolist()


class _LastLogits(torch.nn.Module):
    """``(input_ids [1, T], attention_mask [1, T]) -> logits of the last position [1, V]`` (one row through the
    LM head). The mask is passed so that transformers does not call ``torch.diff``, which OpenVINO cannot convert
    (as ``hetforge.models.zoo.LogitsModule``)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                          logits_to_keep=1).logits[:, -1, :]


def _hf_system(model: torch.nn.Module):
    mod = _LastLogits(model).eval()

    def ttft(prompt: list[int]) -> tuple[float, int]:
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        with torch.no_grad():
            tok = int(mod(ids, torch.ones_like(ids)).argmax(-1))
        return time.perf_counter() - t0, tok

    return ttft, {"precision": "f32"}


def _ov_system(model: torch.nn.Module, threads: int, f32: bool, max_pos: int):
    import numpy as np
    import openvino as ov

    t0 = time.perf_counter()
    ex = torch.ones((1, 8), dtype=torch.long)
    with torch.no_grad():
        seq = ov.PartialShape([1, ov.Dimension(1, max_pos)])
        ovm = ov.convert_model(_LastLogits(model).eval(), example_input=(ex, torch.ones_like(ex)),
                               input=[(seq, ov.Type.i64), (seq, ov.Type.i64)])
    config: dict[str, object] = {"INFERENCE_NUM_THREADS": threads}
    if f32:
        config["INFERENCE_PRECISION_HINT"] = "f32"
    compiled = ov.Core().compile_model(ovm, "CPU", config)
    try:
        precision = str(compiled.get_property("INFERENCE_PRECISION_HINT")).replace("<Type: '", "").replace("'>", "")
    except Exception:  # older plugins do not expose it
        precision = "f32" if f32 else "plugin default"
    req = compiled.create_infer_request()
    prep = time.perf_counter() - t0

    def ttft(prompt: list[int]) -> tuple[float, int]:
        ids = np.array([prompt], dtype=np.int64)
        t = time.perf_counter()
        req.infer([ids, np.ones_like(ids)], share_inputs=True)
        tok = int(np.argmax(req.get_output_tensor(0).data[0]))
        return time.perf_counter() - t, tok

    return ttft, {"precision": precision, "prepare_s": prep}


# evaluates a GGUF at each prompt length in a child process (see _probe)
_PROBE = ("import sys\nfrom hetforge.benchmarks.llamacpp_system import load_gguf\n"
          "llm = load_gguf(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), logits_all=False)\n"
          "for n in sys.argv[4:]:\n    llm.reset()\n    llm.eval(list(range(1, int(n) + 1)))\n")


class PeerCrashed(RuntimeError):
    """A peer failed in its probe process (the message says how); it is noted and left out of the run."""


def _probe(path: Path, threads: int, n_ctx: int, lengths: list[int]) -> None:
    """Evaluate the GGUF ``path`` at every prompt length in a child process first: this bench runs the peers in
    its own process, so a crash inside llama.cpp would end the whole run. Seen on an Intel host with AMX:
    llama-cpp-python 0.3.36 built for the host died with SIGSEGV in ``ggml_backend_amx_mul_mat`` (called from
    ``llama_decode``) during this bench's first llama.cpp evaluations."""
    r = subprocess.run([sys.executable, "-c", _PROBE, str(path), str(threads), str(n_ctx), *map(str, lengths)],
                       capture_output=True, text=True, timeout=900)
    if r.returncode < 0:
        raise PeerCrashed(f"llama.cpp died with {signal.Signals(-r.returncode).name} evaluating the prompts in a "
                          "probe process")
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no message"])[-1]
        raise PeerCrashed(f"llama.cpp failed in a probe process: {last[:300]}")


def _llamacpp_system(loaded: LoadedModel, workdir: Path, qtype: str, threads: int, n_ctx: int, lengths: list[int]):
    """llama.cpp on ``loaded``'s weights written as GGUF ``qtype``, probed at ``lengths`` in a child process
    first (:func:`_probe`): (ttft fn, info, the Llama to close)."""
    import llama_cpp
    import numpy as np

    from hetforge.benchmarks.llamacpp_system import build_info, last_logits, open_gguf

    llm, stages, path = open_gguf(loaded, workdir, qtype, threads, n_ctx, logits_all=False,
                                  check=lambda p: _probe(p, threads, n_ctx, lengths))
    vocab = loaded.vocab_size

    def ttft(prompt: list[int]) -> tuple[float, int]:
        t = time.perf_counter()
        llm.reset()
        llm.eval(prompt)
        tok = int(np.argmax(last_logits(llm, vocab)))
        return time.perf_counter() - t, tok

    info = {"precision": qtype, "prepare_s": round(sum(stages.values()), 3),
            "gguf_mib": round(path.stat().st_size / 2**20, 1), "n_ctx": n_ctx,
            "version": getattr(llama_cpp, "__version__", "?"), "build": build_info()}
    return ttft, info, llm


MODES = ("tier", "chunked", "fine")  # hetforge's prefill modes measured; the last is the engine's default
DEFAULT_MODE = "fine"


def _hetforge_system(engine: Engine, mode: str, new_tokens: int):
    def ttft(prompt: list[int]) -> tuple[float, int]:
        engine.prefill_mode = mode
        r = engine.generate(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        ttft.last = r  # type: ignore[attr-defined]
        return r.ttft_s, r.tokens[0]

    return ttft


def _missing(*modules: str) -> str | None:
    return next((m for m in modules if importlib.util.find_spec(m) is None), None)


def _engine(loaded: LoadedModel, scheme: str) -> Engine:
    """The engine of one ``--quantize`` name: a weight scheme, or ``bf16`` = the model loaded in bfloat16 as
    ``hetforge run --precision bf16`` loads it (a UsageError on a CPU without bf16 instructions)."""
    if scheme != "bf16":
        return Engine(loaded, quantize=scheme)
    from hetforge.precision import resolve_precision

    return Engine(load_model(loaded.name, dtype=resolve_precision("bf16")))


def bench_model(name: str, lengths: list[int], schemes: list[str], peers: list[str], rounds: int, threads: int,
                new_tokens: int) -> dict:
    loaded = load_model(name)
    vocab, max_pos = loaded.vocab_size, loaded.max_positions
    prompts = {n: _prompt(n, vocab) for n in lengths}
    systems: dict[str, tuple] = {}  # key -> (ttft fn, info)
    notes: list[str] = []
    llamas: list = []
    with tempfile.TemporaryDirectory(prefix="hetforge-ttft-") as tmp:  # the GGUF files, removed at the end
        try:
            for p in peers:
                if p == "hf":
                    systems["hf"] = _hf_system(loaded.model)
                elif p in ("ov-f32", "ov-default"):
                    if _missing("openvino"):
                        notes.append(f"{p}: not installed (no module named 'openvino')")
                        continue
                    systems[p] = _ov_system(loaded.model, threads, p == "ov-f32", max_pos)
                elif p in GGUF_TYPE:
                    mod = _missing("llama_cpp", "gguf")
                    if mod:
                        notes.append(f"{p}: not installed (no module named '{mod}')")
                        continue
                    try:
                        fn, info, llm = _llamacpp_system(loaded, Path(tmp), GGUF_TYPE[p], threads,
                                                         min(max_pos, max(512, max(lengths))), lengths)
                    except PeerCrashed as e:
                        notes.append(f"{p}: not measured: {e}")
                        continue
                    except Exception as e:  # a family the GGUF export does not cover: noted, the rest measured
                        notes.append(f"{p}: not measured: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                        continue
                    llamas.append(llm)
                    systems[p] = (fn, info)
            for scheme in schemes:
                label = "fp32" if scheme == "none" else scheme
                try:
                    eng = _engine(loaded, scheme)
                except UsageError as e:
                    notes.append(f"hetforge {label}: refused: {e}")
                    continue
                for mode in MODES:
                    fn = _hetforge_system(eng, mode, new_tokens)
                    systems[f"hetforge {label} {mode}"] = (fn, {"precision": label, "scheme": scheme, "mode": mode})
            out = _measure(name, systems, prompts, lengths, rounds, notes)
        finally:
            for llm in llamas:
                llm.close()
    return {"model": name, "vocab": vocab, "max_positions": max_pos, **out}


def _measure(name: str, systems: dict[str, tuple], prompts: dict[int, list[int]], lengths: list[int], rounds: int,
             notes: list[str]) -> dict:
    """Warm every system up at every length (hetforge compiles here), then ``rounds`` interleaved rounds."""
    compile_s: dict[str, dict[str, float]] = {}
    pieces: dict[str, dict[str, list[str]]] = {}
    first: dict[str, dict[int, int]] = {}
    for key, (fn, info) in list(systems.items()):
        for n in lengths:
            try:
                _, tok = fn(prompts[n])
            except Exception as e:  # a scheme this model cannot run: reported, the rest still measured
                notes.append(f"{key}: failed at n = {n}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                del systems[key]
                break
            first.setdefault(key, {})[n] = tok
            if "mode" in info:
                r = fn.last
                for prog, secs in r.compile_s.items():
                    compile_s.setdefault(key, {})[prog] = round(secs, 3)
                pieces.setdefault(key, {})[str(n)] = r.prefill_pieces
    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in lengths} for k in systems}
    order = list(systems.items())
    for r in range(rounds):
        for n in lengths:
            for key, (fn, _info) in order if r % 2 == 0 else order[::-1]:  # flipped every round
                s, _ = fn(prompts[n])
                times[key][n].append(s * 1e3)
    out: dict = {"model": name, "notes": notes, "systems": {}}
    for key, (_fn, info) in systems.items():
        info = {k: v for k, v in info.items() if k != "scheme"}
        out["systems"][key] = {
            **info, "ttft_ms": {str(n): times[key][n] for n in lengths},
            "median_ms": {str(n): statistics.median(times[key][n]) for n in lengths},
            "min_ms": {str(n): min(times[key][n]) for n in lengths},
            "first_token": {str(n): first[key][n] for n in lengths},
            "compile_s": compile_s.get(key, {}), "pieces": pieces.get(key, {}),
        }
    return out


# ---------------------------------------------------------------- the page


def _fmt(d: dict, n: str) -> str:
    return f"{d['median_ms'][n]:.1f} ({d['min_ms'][n]:.1f})"


def _json_named(command: str) -> str:
    """The ``--json`` file of a recorded command line (the page names the JSON it was generated from)."""
    args = shlex.split(command)
    return args[args.index("--json") + 1] if "--json" in args[:-1] else "docs/bench/ttft.json"


def _best(sy: dict, keys: list[str], n: str) -> tuple[float, str] | None:
    """(median ms, peer) of the fastest of ``keys`` measured at ``n``, or None when none was."""
    got = [(sy[k]["median_ms"][n], k) for k in keys if k in sy]
    return min(got) if got else None


def _ratio(d: dict, best: tuple[float, str] | None, n: str) -> str:
    return f"{d['median_ms'][n] / best[0]:.2f} ({best[1]})" if best else "—"


def _matching_peers(label: str, peers: list[str]) -> list[str]:
    match = MATCHING.get(label)
    return peers if match is None else [k for k in peers if k in match]


def _rule() -> str:
    """The matching-precision rule, from :data:`MATCHING`, as the page states it."""
    parts = [f"{k} → {' / '.join(v) if v else 'every peer (no peer of that precision is measured here)'}"
             for k, v in MATCHING.items()]
    return "; ".join(parts)


def render(res: dict) -> str:
    d_ = DEFAULT_MODE
    lines = ["# Time to first token: hetforge's prefill modes next to exact-length peers", "",
             f"Generated by `bench/ttft.py` from `{_json_named(res['command'])}` (never edited by hand). Measured on "
             f"{res['host']['cpu']} ({res['host']['cores']} cores; ISA: {', '.join(res['host']['isa'])}), "
             f"{res['threads']} thread(s), {res['rounds']} interleaved rounds "
             f"({res.get('order', 'every round in the same order')}), load average "
             f"{res['load_before']} before and {res['load_after']} after the run (a machine shared with other "
             f"jobs: figures are noisy, compare within a round). Command: `{res['command']}`.", "",
             "TTFT = prefill of the prompt + the first greedy token, compilation excluded, measured; hetforge's "
             "from its runtime timer, the peers' around one exact-length forward (see the script's docstring). "
             "hetforge's prefill modes: `tier` pads the prompt to the next power-of-two tier; `chunked` runs the "
             f"largest tier <= n, then chunks over the KV cache (powers of two, the rest rounded up to "
             f"{res['chunk_min']}, chosen when padded tokens + {res['call_tokens']} per extra call is less than the "
             f"next tier); `fine` (the default) runs one program of about the prompt's length (padded to a step of "
             f"1/{res.get('fine_per_octave', FINE_PER_OCTAVE)} of the power of two below it, at least 8). "
             "Cells: median (min) ms. The peers run in the same process as hetforge, one after another.", "",
             f"Ratios: hetforge's {d_} median ÷ the lowest peer median, the peer named in each cell. *Same "
             f"precision* peers: {_rule()}. *Any precision*: the lowest of every peer measured. hf is a reference "
             "row, not a peer; — = no such peer measured in this run.", ""]
    lengths = [str(n) for n in res["lengths"]]
    for m in res["models"]:
        lines += [f"## {m['model']}", "", "| system | precision | " + " | ".join(f"n = {n}" for n in lengths) + " |",
                  "|---|---|" + "---|" * len(lengths)]
        sy = m["systems"]
        for key, d in sy.items():
            lines.append(f"| {key} | {d['precision']} | " + " | ".join(_fmt(d, n) for n in lengths) + " |")
        peers = [k for k in sy if k.startswith(("ov", "llamacpp"))]
        others = [md for md in MODES if md != d_]
        lines += ["", "| hetforge scheme | " + " | ".join(f"{d_} ÷ {o}, n = {n}" for o in others for n in lengths)
                  + " | " + " | ".join(f"{d_} ÷ best same-precision peer, n = {n}" for n in lengths)
                  + " | " + " | ".join(f"{d_} ÷ best peer of any precision, n = {n}" for n in lengths) + " |",
                  "|---|" + "---|" * ((len(others) + 2) * len(lengths))]
        for key, d in sy.items():
            if not key.endswith(f" {d_}"):
                continue
            label = key.removeprefix("hetforge ").removesuffix(f" {d_}")
            r1 = []
            for o in others:
                od = sy.get(key.removesuffix(d_) + o)
                r1 += [f"{d['median_ms'][n] / od['median_ms'][n]:.2f}" if od else "—" for n in lengths]
            same = _matching_peers(label, peers)
            r2 = [_ratio(d, _best(sy, same, n), n) for n in lengths]
            r3 = [_ratio(d, _best(sy, peers, n), n) for n in lengths]
            lines.append(f"| {key.removesuffix(' ' + d_)} | " + " | ".join(r1 + r2 + r3) + " |")
        lines += ["", "Prefill programs per length (chunked and fine):", ""]
        for key, d in sy.items():
            if key.endswith((" chunked", f" {d_}")) and "pieces" in d:
                lines.append(f"- {key}: " + "; ".join(f"n = {n}: {' + '.join(p)}" for n, p in d["pieces"].items()))
        lines += ["", "Compile on first use (measured s, capture + passes + lowering + warm-up call; 0 = compile "
                  "cache hit):", ""]
        for key, d in sy.items():
            if d.get("compile_s"):
                lines.append(f"- {key}: " + ", ".join(f"{p} {s:.1f}" for p, s in d["compile_s"].items()))
        gguf = [f"{k}: GGUF {d['precision']} {d['gguf_mib']:.1f} MiB written from the same seeded weights, "
                f"{d.get('build') or 'llama-cpp-python ' + d['version']}, n_ctx {d['n_ctx']}, write + load "
                f"{d['prepare_s']:.1f} s (measured)"
                for k, d in sy.items() if "gguf_mib" in d]
        if gguf:
            lines += ["", "llama.cpp peers:", "", *(f"- {g}" for g in gguf)]
        fp32 = [k for k, d in sy.items() if d["precision"] in ("f32", "fp32", "float32") and "default" not in k]
        equal = [n for n in lengths if len({sy[k]["first_token"][n] for k in fp32}) == 1]
        lines += ["", f"First token equal across the fp32 systems ({', '.join(fp32)}) at "
                  f"n = {', '.join(equal) or 'none'} of {', '.join(lengths)}."]
        if "hf" in sy:
            differ = {n: [k for k, d in sy.items() if d["first_token"][n] != sy["hf"]["first_token"][n]]
                      for n in lengths}
            lines.append("First token different from hf's: " + "; ".join(
                f"n = {n}: {', '.join(ks) or 'none'}" for n, ks in differ.items()) + ".")
        for note in m["notes"]:
            lines.append(f"- {note}")
        lines.append("")
    return "\n".join(lines) + "\n"


def _usage_error(msg: str) -> None:
    """Bad input: one readable line on stderr, exit status 2."""
    print(f"ttft.py: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _check(a: argparse.Namespace) -> None:
    """Refuse bad input before any measurement (unknown names, lengths outside every model's positions)."""
    for opt, got, allowed in (("--peers", a.peers, PEERS), ("--quantize", a.quantize, SCHEMES)):
        bad = [x for x in got if x not in allowed]
        if bad:
            _usage_error(f"unknown {opt} name(s) {', '.join(bad)}; allowed: {', '.join(allowed)}")
    for opt in ("rounds", "threads", "new_tokens"):
        if getattr(a, opt) < 1:
            _usage_error(f"--{opt.replace('_', '-')} must be >= 1, got {getattr(a, opt)}")
    if min(a.lengths) < 1:
        _usage_error(f"--lengths must be >= 1 token, got {min(a.lengths)}")
    for name in a.models:
        try:
            max_pos = load_model(name).max_positions
        except UsageError as e:
            _usage_error(str(e))
        longest = max(a.lengths) + a.new_tokens
        if longest > max_pos:
            _usage_error(f"--lengths {max(a.lengths)} + --new-tokens {a.new_tokens} exceeds {name}'s {max_pos} "
                         "positions")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama-110m"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[16, 84, 500])
    ap.add_argument("--quantize", nargs="+", default=list(SCHEMES),
                    help="hetforge schemes: none (fp32), w8, w4, w8a8, and bf16 (--precision bf16)")
    ap.add_argument("--peers", nargs="+", default=list(PEERS), help=f"of {', '.join(PEERS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=1)
    ap.add_argument("--json", default="")
    ap.add_argument("--md", default="")
    ap.add_argument("--from-json", default="")
    a = ap.parse_args()
    if a.from_json:
        if not Path(a.from_json).is_file():
            _usage_error(f"--from-json {a.from_json} is not a file")
        page_from_json(a.from_json, a.md, render)
        return
    _check(a)
    torch.set_num_threads(a.threads)
    load_before = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    t0 = time.time()
    models = []
    for name in a.models:
        models.append(bench_model(name, a.lengths, a.quantize, a.peers, a.rounds, a.threads, a.new_tokens))
        print(f"{name} done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    res = {"host": host_record(), "threads": a.threads, "rounds": a.rounds, "order": "flipped every round",
           "lengths": a.lengths,
           "new_tokens": a.new_tokens, "chunk_min": CHUNK_MIN, "call_tokens": CALL_TOKENS,
           "fine_per_octave": FINE_PER_OCTAVE,
           "pieces_rule": {mode: {str(n): [f"{p.kind}-{p.size}" for p in prefill_pieces(n, (32, 64, 128, 256, 512,
                                                                                         1024), mode=mode)]
                                  for n in a.lengths} for mode in MODES},
           "load_before": load_before, "load_after": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
           "command": "python bench/ttft.py " + " ".join(sys.argv[1:]), "timing": "measured",
           "compile_cache": os.environ.get("HETFORGE_COMPILE_CACHE", "default"), "models": models}
    write_result(res, a.json, a.md, render)


if __name__ == "__main__":
    main()
