"""Time to a runnable prefill + decode pair: cold (empty compile cache; the decode program built in a forked child
alongside the prefill program, as a request builds it, and again with both built in-process one after the other)
and warm (cache hit), each in a fresh process, rounds interleaved. Writes docs/bench/compile_cache.json and
generates docs/bench/compile_cache.md.

    .venv/bin/python bench/compile_cache.py [--models gpt2,llama-110m] [--rounds 2] [--tier 128] [--cache 256]

Measured: wall time from ``Engine(...)`` to both programs built (model loading excluded: it is the same for
every system), the main thread's CPU time over the same span (``time.thread_time``: what the work itself took,
robust to other processes taking the cores), its parts per program (capture, passes, the rest of compilation,
the warm-up call; or the cache hit) and the rest (``other``: mostly the KV cache's allocation), the 1-min load
average around each child, and the first generated token of a 16-token prompt (TTFT, measured) after that.

hetforge's own bytecode is compiled first (``python -m compileall``), as a pip install does: in an editable
checkout run with ``PYTHONDONTWRITEBYTECODE=1`` every child would otherwise compile from source each hetforge
module that a hit imports lazily, which is not what an installed hetforge pays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "bench"

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[4]))
from hetforge.models.zoo import load_model
from hetforge.runtime import Engine, SamplingParams
loaded = load_model(sys.argv[1])
t0, c0 = time.perf_counter(), time.thread_time()
eng = Engine(loaded, executor="auto")
t_engine = time.perf_counter() - t0
eng.programs.decode_ahead(int(sys.argv[3]))  # as a request does (refused with HETFORGE_PARALLEL_COMPILE=0)
pre, _ = eng.programs.prefill(int(sys.argv[2]))
dec, _ = eng.programs.decode(int(sys.argv[3]))
pair, cpu = time.perf_counter() - t0, time.thread_time() - c0
hit = any("compile cache: hit" in n for n in pre.notes) or (
    dec.child_s is None and any("compile cache: hit" in n for n in dec.notes))
def note_s(p, prefix):  # the seconds of the program's note "<prefix><seconds> s ...", else 0
    got = [n for n in p.notes if n.startswith(prefix)]
    return float(got[0][len(prefix):].split(" s")[0]) if got else 0.0
def parts(p):
    if p.child_s is not None:
        return {"built in a forked child (its own s)": round(p.child_s, 3),
                "waited for it + cache hit": round(p.compile_s, 3)}
    d = {"capture": p.capture_s, "passes": p.optimize_s}
    warm = note_s(p, "warm-up call ")
    if warm:
        d["warm-up call"] = warm
    else:  # an unquantized program: its weights packed, no warm-up call (runtime.programs)
        warm = d["pack weights (no warm-up call)"] = note_s(p, "weights packed in ")
    other = note_s(p, "other compile-path work ")
    if other:
        d["cache lookup+store, between stages"] = other
    d["place+lower+schedule+plan+build" if not hit else "cache hit (load+bind+build)"] = p.compile_s - warm - other
    return {k: round(v, 3) for k, v in d.items()}
r = eng.generate(list(range(1, 17)), SamplingParams(max_new_tokens=2, ignore_eos=True))
print(json.dumps({"pair_s": pair, "pair_cpu_s": cpu, "hit": hit, "ttft_s": r.ttft_s,
                  "alongside": dec.child_s is not None,
                  "engine_s": round(t_engine, 3), "prefill": parts(pre), "decode": parts(dec),
                  "other_s": round(pair - t_engine - pre.total_s - dec.total_s, 3),
                  "prefill_capture_s": pre.capture_s, "decode_capture_s": dec.capture_s}))
"""


def child(model: str, tier: int, cache: int, threads: int, cache_dir: str, alongside: bool = True) -> dict:
    env = dict(os.environ, HETFORGE_COMPILE_CACHE_DIR=cache_dir, HETFORGE_PARALLEL_COMPILE="1" if alongside else "0")
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(tier), str(cache), str(threads)], env=env,
                         capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["load"] = [round(load, 2), round(os.getloadavg()[0], 2)]  # 1-min load average before and after (measured)
    return got


def _command(argv: list[str]) -> list[str]:
    """The command line with the note's text left out (the page prints the note once, after the command)."""
    out: list[str] = []
    for i, x in enumerate(argv):
        if i and argv[i - 1] == "--note":
            continue
        out.append("--note NOTE" if x == "--note" or x.startswith("--note=") else x)
    return out


def _packing_note(doc: dict) -> str:
    """What the cold figure holds of the one-time kernel work, by the parts the run recorded: a run of the code
    before session 21 made a warm-up call per program; later code packs the weights and makes none (unquantized)."""
    parts = [r.get("cold_parts", [{}])[0].get("prefill", {}) for r in doc["rows"]]
    if any("pack weights (no warm-up call)" in p for p in parts):
        return ("A warm hit packs no weights, so its first TTFT includes that one-time kernel work (packing the "
                "weights into the GEMM kernels' layouts: the panel GEMM's, oneDNN's); the cold figure includes the "
                "packing (`pack weights`; a quantized program's warm-up call, which also pays FBGEMM's prepacking), "
                "and an unquantized program makes no warm-up call, so the "
                "first request's TTFT after cold includes its first touch of memory. The passes run on two layers "
                "and the rest is stamped after them, inside `place+lower+schedule+plan+build` "
                "(`runtime/stamp.py` `Deferred`).")
    return ("A warm hit makes no warm-up call, so its first TTFT includes one-time kernel work (oneDNN weight "
            "packing, first-call kernel setup); the cold figure includes it in its warm-up call.")


def render(doc: dict) -> str:
    """The page, from the JSON alone."""
    h = doc["host"]
    md = ["# Compile cache: time to a runnable prefill + decode pair (measured)", "",
          f"Generated by `bench/compile_cache.py` from `compile_cache.json` (`{doc['command']}`). Host: {h['cpu']}, "
          f"{h['cores']} cores; ISA: {', '.join(h['isa'])}." + (f" {doc['note']}" if doc.get("note") else ""), "",
          "| model | prefill tier | KV cache | threads | cold s (each round) | cold, decode built in-process s "
          "| warm s (each round) | warm main-thread CPU s | cold capture s | TTFT after cold ms | TTFT after warm ms "
          "| 1-min load average before/after (cold; warm) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        serial = r.get("cold_serial_pair_s", "—")
        md.append(f"| {r['model']} | {r['tier']} | {r['cache']} | {r['threads']} | {r['cold_pair_s']} | {serial} | "
                  f"{r['warm_pair_s']} | {r['warm_pair_cpu_s']} | {r['cold_capture_s']} | {r['cold_ttft_ms']} | "
                  f"{r['warm_ttft_ms']} | {'; '.join(f'{c} ; {w}' for c, w in r['load'])} |")
    md += ["", "Where the time goes (first round, seconds, measured; `engine` = making the executor and the Engine):",
           ""]
    for r in doc["rows"]:
        for mode in ("cold", "serial", "warm"):
            if f"{mode}_parts" not in r:
                continue
            p = r[f"{mode}_parts"][0]
            name = "cold, decode built in-process" if mode == "serial" else mode
            md.append(f"- {r['model']} {name}: engine {p['engine']}; prefill {p['prefill']}; decode {p['decode']}; "
                      f"other {p['other']}")
    md += ["", "Cold: empty cache folder, a fresh process, the decode program built in a forked child alongside "
           "the prefill program as a request builds it (`runtime/ahead.py`; the child's work is not in the "
           "main-thread CPU figure, and its entry is the decode program's cache hit); cold, decode built in-process: "
           "the same with `HETFORGE_PARALLEL_COMPILE=0` (one program after the other), rounds interleaved with the "
           "others; warm: the next fresh process on the same folder (a hit "
           "skips capture, passes, placement, partitioning, lowering, kernel choice, scheduling and memory "
           "planning; it binds the model's weights to the stored partition programs, re-checks their memory plans "
           "and generates the executor's code). Main-thread CPU time is `time.thread_time` over the pair: the "
           "work itself, without the time the process waited for a core. hetforge's bytecode is compiled before "
           "the children run, as an installed package has it. Model loading (building the model and its seeded "
           "weights) is outside both figures. " + _packing_note(doc)]
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,llama-110m,mixtral-small")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tier", type=int, default=128)
    ap.add_argument("--cache", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=str(DOCS / "compile_cache.json"))
    ap.add_argument("--from-json", default="", help="regenerate the page from this JSON, measuring nothing")
    a = ap.parse_args()
    if a.from_json:
        Path(a.from_json).with_suffix(".md").write_text(render(json.loads(Path(a.from_json).read_text())))
        return
    import hetforge  # its folder: bytecode compiled once, as an installed package has it
    from hetforge.hardware.isa import host_record

    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(hetforge.__file__).parent)], check=True,
                   capture_output=True)
    rows = []
    for model in a.models.split(","):
        cold, warm, serial = [], [], []
        for _ in range(a.rounds):
            with tempfile.TemporaryDirectory() as d:
                cold.append(child(model, a.tier, a.cache, a.threads, d))
                warm.append(child(model, a.tier, a.cache, a.threads, d))
            with tempfile.TemporaryDirectory() as d:
                serial.append(child(model, a.tier, a.cache, a.threads, d, alongside=False))
        if any(c["hit"] for c in cold + serial) or not all(w["hit"] for w in warm) or any(
                c["alongside"] for c in serial):
            raise SystemExit(f"{model}: cold runs must miss and warm runs hit the cache (cold {cold}, warm {warm}); "
                             "was hetforge's source edited during the run?")
        row = {"model": model, "tier": a.tier, "cache": a.cache, "threads": a.threads,
               "cold_pair_s": [round(c["pair_s"], 3) for c in cold],
               "cold_alongside": [c["alongside"] for c in cold],
               "cold_serial_pair_s": [round(c["pair_s"], 3) for c in serial],
               "serial_parts": [{"engine": c["engine_s"], "prefill": c["prefill"], "decode": c["decode"],
                                 "other": c["other_s"]} for c in serial],
               "warm_pair_s": [round(w["pair_s"], 3) for w in warm],
               "cold_pair_cpu_s": [round(c["pair_cpu_s"], 3) for c in cold],
               "warm_pair_cpu_s": [round(w["pair_cpu_s"], 3) for w in warm],
               "cold_capture_s": [round(c["prefill_capture_s"] + c["decode_capture_s"], 3) for c in cold],
               "cold_ttft_ms": [round(c["ttft_s"] * 1e3, 1) for c in cold],
               "warm_ttft_ms": [round(w["ttft_s"] * 1e3, 1) for w in warm],
               "cold_parts": [{"engine": c["engine_s"], "prefill": c["prefill"], "decode": c["decode"],
                               "other": c["other_s"]} for c in cold],
               "warm_parts": [{"engine": w["engine_s"], "prefill": w["prefill"], "decode": w["decode"],
                               "other": w["other_s"]} for w in warm],
               "load": [[c["load"], w["load"]] for c, w in zip(cold, warm, strict=True)]}
        row["warm_median_s"] = round(statistics.median(row["warm_pair_s"]), 3)
        row["cold_median_s"] = round(statistics.median(row["cold_pair_s"]), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = {"rows": rows, "host": host_record(), "note": a.note,
           "command": "python bench/compile_cache.py " + " ".join(_command(sys.argv[1:]))}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    Path(a.out).with_suffix(".md").write_text(render(doc))


if __name__ == "__main__":
    main()
