"""Decode under contention: 1 thread vs 2 threads (fixed) vs 2 threads (adaptive), plus a second 1-thread engine as
an A/A control, with and without a busy background process, for the native kernels' own thread pool and
(optionally) the OpenMP kernels they replaced.
Writes docs/bench/contention.json and generates docs/bench/contention.md from it.

    .venv/bin/python bench/contention.py [--models gpt2,llama-110m] [--rounds 3] [--tokens 32]
                                         [--baseline-rev REV] [--load none,pinned]

How each configuration runs (as a user would run it): every (model, kernels) pair is one worker process that
holds one fresh Engine per configuration, each made and warmed under its own settings — ``torch`` threads 1
or 2, ``HETFORGE_ADAPT_THREADS`` 0 (fixed) or 1 (adaptive: ``hetforge.runtime.threads``) — so a tuner is
never made under another configuration's settings. The parent sends one request at a time to the workers,
round-robin (model × kernels × configuration per round: interleaved, the configurations' order rotated each
round), and starts and stops the background
load: ``pinned`` is one process spinning (``while True: pass``) pinned to the host's last CPU with
``sched_setaffinity``; ``unpinned`` is the same process left to the scheduler; ``none`` is no process of
ours (other users of the host may still load it: the load average is recorded before and after each phase).

Kernels: ``pool`` is the working tree's ``native.c`` (chunks claimed from a shared counter by the caller and
helper threads that spin briefly, then sleep: ``hetforge.kernels.native``); ``--baseline-rev REV`` adds
``omp`` — the same file at git revision REV (its one-row kernels ran on OpenMP teams that end in barriers),
built into the kernel cache like any other source.

Measured: decode ms/token of one request (mean of its steps, wall clock) with a 16-token prompt, and (pages from
session 45 on) its time to first token: the prompt's prefill and first sample, on the count the tuner picks for a
prefill (the cores other tasks leave free, ``ThreadTuner.before_prefill``) or the fixed count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "bench"
CONFIGS = {"1 thread": (1, "0"), "2 threads, fixed": (2, "0"), "2 threads, adaptive": (2, "1"),
           "1 thread, again": (1, "0")}  # the last: an A/A control, the same-round noise of a ratio to 1 thread
def defines(source: str, name: str) -> bool:
    """Whether the C file ``source`` defines (or declares) function ``name`` (a baseline has fewer)."""
    return re.search(rf"\b{name}\s*\(", Path(source).read_text()) is not None


BUSY = "import os, sys\nif sys.argv[1] != '-': os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass\n"


def loadavg() -> list[float]:
    return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]


# ---------------------------------------------------------------- worker (one model, one kernel source)

def worker(model: str, source: str | None, tokens: int) -> None:
    """Hold one engine per configuration; answer one request per line read from stdin with one JSON line."""
    import torch

    from hetforge.kernels import native

    if source:  # the baseline kernels: an older native.c (its own functions only: no pool, so no pool read-back)
        native.SOURCE = Path(source)
        native.SIGNATURES = {k: v for k, v in native.SIGNATURES.items() if defines(source, k)}
    if native.library() is None:
        raise SystemExit(f"native kernels unavailable: {native.status().reason}")
    from hetforge.models.zoo import load_model
    from hetforge.runtime import Engine, SamplingParams

    loaded = load_model(model)
    engines = {}

    def request(name: str, n: int) -> dict:
        threads, adapt = CONFIGS[name]
        torch.set_num_threads(threads)
        os.environ["HETFORGE_ADAPT_THREADS"] = adapt
        before = vars(native.pool_info()) if not source else {}
        gen = engines[name].stream(list(range(1, 17)), SamplingParams(max_new_tokens=n, ignore_eos=True))
        for _ in gen:
            pass
        r = {"decode_ms": gen.result.decode_ms_per_token, "ttft_ms": gen.result.ttft_s * 1e3,
             "tuner": gen.tuner.summary() if gen.tuner else None}
        if before:  # this request's pool jobs, the caller's waits over stall_us, the jobs it ran alone after one, and
            # the chunks it took over from a helper (and of those, the ones whose helper did not answer: descheduled)
            after = vars(native.pool_info())
            r["pool_request"] = {k: after[k] - before[k] for k in ("jobs", "stalls", "solo_jobs", "steals",
                                                                   "steals_unanswered", "quiet_periods", "moves")}
        return r

    for name in CONFIGS:
        engines[name] = Engine(loaded, executor="auto")
        request(name, 4)  # compile (or load from the compile cache) and warm, under this configuration
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        name = line.strip()
        if not name:
            break
        r = request(name, tokens)
        if not source:
            r["pool"] = vars(native.pool_info())
        print(json.dumps(r), flush=True)


# ---------------------------------------------------------------- kernel check (one process, both libraries)

SHAPES = {"gpt2 c_attn [K=768, N=2304]": (768, 2304, True), "gpt2 c_fc [K=768, N=3072]": (768, 3072, True),
          "gpt2 mlp c_proj [K=3072, N=768]": (3072, 768, True), "lm_head [N=50257, K=768]": (768, 50257, False),
          "llama down [N=768, K=2048]": (2048, 768, False)}


BLOCK = 8  # calls in a row per library: a decode step's kernels run back to back (the pool's helpers stay awake)


def kernel_check(source: str, reps: int) -> None:
    """Time each one-row product on the pool kernels and on the baseline source's, in alternating blocks of
    ``BLOCK`` back-to-back calls, each call on the next of several weight copies that together exceed the
    last-level cache (each call streams its weight from memory); print one JSON line. The minimum over calls
    is the closest this shared host gets to an idle one."""
    import torch

    from hetforge.kernels import native

    libs = {"pool": native.library()}
    native.SOURCE = Path(source)
    native.SIGNATURES = {k: v for k, v in native.SIGNATURES.items() if defines(source, k)}
    native._state.clear()
    libs["omp"] = native.library()
    if libs["pool"] is None or libs["omp"] is None:
        raise SystemExit(f"native kernels unavailable: {native.status().reason}")
    out = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, (k, n, weight_t) in SHAPES.items():
            copies = [torch.randn((k, n) if weight_t else (n, k)) for _ in range(max(2, (96 << 20) // (k * n * 4)))]
            x, y, part = torch.randn(k), torch.empty(n), torch.empty(native.split_k_slots(), n)
            times: dict[str, list[float]] = {"pool": [], "omp": []}
            at = 0
            for i in range(reps // BLOCK):
                for lib_name, _ in [(n_, b) for n_ in (("pool", "omp") if i % 2 else ("omp", "pool"))
                                    for b in range(BLOCK)]:
                    fn, w = libs[lib_name], copies[at % len(copies)]
                    at += 1
                    t0 = time.perf_counter()
                    if weight_t:
                        fn.hf_gemv_kn(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), n, k, threads, part.data_ptr(),
                                      part.shape[0])
                    else:
                        fn.hf_gemv_nk(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), n, k, threads)
                    times[lib_name].append(time.perf_counter() - t0)
            row = {"shape": name, "threads": threads, "weight_mib": round(k * n * 4 / 2**20, 2)}
            for lib_name, ts in times.items():
                row[f"{lib_name}_min_us"] = round(min(ts) * 1e6, 1)
                row[f"{lib_name}_median_us"] = round(statistics.median(ts) * 1e6, 1)
            row["ratio_min"] = round(min(times["pool"]) / min(times["omp"]), 3)
            row["ratio_median"] = round(statistics.median(times["pool"]) / statistics.median(times["omp"]), 3)
            out.append(row)
            del copies
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------- parent

class Worker:
    def __init__(self, model: str, kernels: str, source: str | None, tokens: int):
        cmd = [sys.executable, __file__, "--worker", model, "--tokens", str(tokens)]
        if source:
            cmd += ["--source", source]
        self.key = (model, kernels)
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.read()

    def read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"worker {self.key} ended (exit {self.p.wait()})")
        return json.loads(line)

    def ask(self, config: str) -> dict:
        self.p.stdin.write(config + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


def start_busy(mode: str) -> subprocess.Popen | None:
    if mode == "none":
        return None
    cpu = str(max(os.sched_getaffinity(0))) if mode == "pinned" else "-"
    p = subprocess.Popen([sys.executable, "-c", BUSY, cpu])
    time.sleep(0.5)
    return p


def baseline_source(rev: str) -> str:
    text = subprocess.run(["git", "show", f"{rev}:src/hetforge/kernels/native.c"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"hetforge_native_{rev[:12]}.c"
    path.write_text(text)
    return str(path)


def summarize(rows: list[dict]) -> list[dict]:
    """Per (model, kernels, load): the median over rounds of each configuration's ms/token and of the per-round
    ratios to the 1-thread run of the same round."""
    out = []
    keys = sorted({(r["model"], r["kernels"], r["load"]) for r in rows}, key=str)
    for model, kernels, load in keys:
        sel = {r["config"]: r for r in rows if (r["model"], r["kernels"], r["load"]) == (model, kernels, load)}
        one = sel["1 thread"]["decode_ms"]
        s = {"model": model, "kernels": kernels, "load": load,
             "median_ms": {c: round(statistics.median(r["decode_ms"]), 2) for c, r in sel.items()}}
        for c in ("2 threads, fixed", "2 threads, adaptive", "1 thread, again"):
            if c in sel:  # older pages have no A/A control
                per_round = [a / b for a, b in zip(sel[c]["decode_ms"], one, strict=True)]
                s[f"ratio {c} / 1 thread"] = round(statistics.median(per_round), 3)
        if all(r.get("ttft_ms") for r in sel.values()):  # pages from session 45 on: each request's prefill too
            s["ttft_median_ms"] = {c: round(statistics.median(r["ttft_ms"]), 2) for c, r in sel.items()}
            for c in ("2 threads, fixed", "2 threads, adaptive", "1 thread, again"):
                if c in sel:
                    per_round = [a / b for a, b in zip(sel[c]["ttft_ms"], sel["1 thread"]["ttft_ms"], strict=True)]
                    s[f"ttft ratio {c} / 1 thread"] = round(statistics.median(per_round), 3)
        pr = [p for p in sel["2 threads, fixed"].get("pool_request", []) if p]
        if pr:  # the fixed 2-thread requests on the pool: stalls per request, share of jobs run alone
            s["fixed_stalls_per_request"] = statistics.median(p["stalls"] for p in pr)
            s["fixed_solo_share"] = round(sum(p["solo_jobs"] for p in pr) / max(1, sum(p["jobs"] for p in pr)), 3)
            s["fixed_steals_per_request"] = statistics.median(p["steals"] for p in pr)  # chunks taken over
        out.append(s)
    return out


def render(doc: dict) -> str:
    h = doc["host"]
    md = ["# Decode under contention (measured)", "",
          f"Generated by `bench/contention.py` from [`contention.json`](contention.json). Command: "
          f"`{doc['command']}`. Models {', '.join(doc['models'])}; {doc['tokens']} new tokens after a 16-token "
          f"prompt; {doc['rounds']} interleaved rounds. Host: {h['cpu']}, {h['cores']} cores; ISA: "
          f"{', '.join(h['isa'])}. Load average (1/5/15 min) at the start {doc['loadavg_start']}, at the end "
          f"{doc['loadavg_end']}. {doc['note']}", "",
          "Background load: " + "; ".join(f"`{k}`: {v}" for k, v in doc["load_modes"].items() if k in doc["loads"])
          + ".", "",
          "Kernels: " + "; ".join(f"`{k}`: {v}" for k, v in doc["kernels"].items()) + ".", "",
          "## Ratios (median over rounds of the per-round ratio to the 1-thread request of the same round)", "",
          "| model | kernels | background load | 1 thread ms/token | 2 fixed ms/token | 2 adaptive ms/token | "
          "2 fixed ÷ 1 | 2 adaptive ÷ 1 | 1 again ÷ 1 (A/A) | 2 fixed: stalls per request, jobs run alone, chunks "
          "taken over per request |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for s in doc["summary"]:
        m = s["median_ms"]
        stalls = (f"{s['fixed_stalls_per_request']:g}, {s['fixed_solo_share']:.1%}, {s['fixed_steals_per_request']}"
                  if "fixed_solo_share" in s else "—")
        md.append(f"| {s['model']} | {s['kernels']} | {s['load']} | {m['1 thread']} | {m['2 threads, fixed']} | "
                  f"{m['2 threads, adaptive']} | {s['ratio 2 threads, fixed / 1 thread']} | "
                  f"{s['ratio 2 threads, adaptive / 1 thread']} | {s.get('ratio 1 thread, again / 1 thread', '—')} | "
                  f"{stalls} |")
    if all("ttft_median_ms" in s for s in doc["summary"]):
        md += ["", "## Time to first token (the 16-token prompt's prefill and first sample; median over rounds, ratios "
               "as above)", "",
               "| model | kernels | background load | 1 thread ms | 2 fixed ms | 2 adaptive ms | 2 fixed ÷ 1 | "
               "2 adaptive ÷ 1 | 1 again ÷ 1 (A/A) |", "|---|---|---|---|---|---|---|---|---|"]
        for s in doc["summary"]:
            t = s["ttft_median_ms"]
            md.append(f"| {s['model']} | {s['kernels']} | {s['load']} | {t['1 thread']} | {t['2 threads, fixed']} | "
                      f"{t['2 threads, adaptive']} | {s['ttft ratio 2 threads, fixed / 1 thread']} | "
                      f"{s['ttft ratio 2 threads, adaptive / 1 thread']} | "
                      f"{s.get('ttft ratio 1 thread, again / 1 thread', '—')} |")
    if doc.get("kernel_ratios"):
        md += ["", "## Pool ÷ OpenMP kernels, same configuration, same round (median of per-round ratios)", "",
               "| model | background load | config | pool ÷ omp |", "|---|---|---|---|"]
        md += [f"| {r['model']} | {r['load']} | {r['config']} | {r['ratio']} |" for r in doc["kernel_ratios"]]
    kc = doc.get("kernel_check", {}).get("rows")
    if kc:
        md += ["", "## One-row products alone: pool ÷ OpenMP kernels (no background process of ours)", "",
               "Each call streams its weight from memory (copies that together exceed the last-level cache), "
               "the two libraries alternating in blocks of 8 back-to-back calls, 40 calls each; the minimum is the "
               "closest this shared host gets to an idle one (load average after: "
               f"{doc['kernel_check']['loadavg_after']}).",
               "", "| product | weight MiB | threads | pool min µs | omp min µs | pool ÷ omp (min) | "
               "pool ÷ omp (median) |", "|---|---|---|---|---|---|---|"]
        md += [f"| {r['shape']} | {r['weight_mib']} | {r['threads']} | {r['pool_min_us']} | {r['omp_min_us']} | "
               f"{r['ratio_min']} | {r['ratio_median']} |" for r in kc]
    md += ["", "## Every request (measured decode ms/token per round; load average around each phase)", "",
           "| model | kernels | background load | config | ms/token per round | load avg before → after |",
           "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        md.append(f"| {r['model']} | {r['kernels']} | {r['load']} | {r['config']} | {r['decode_ms']} | "
                  f"{r['loadavg_before']} → {r['loadavg_after']} |")
    md += ["", "Adaptive: the decode loop probes 1 thread against the requested count and keeps the faster "
           "(`hetforge.runtime.threads`). Fixed: `HETFORGE_ADAPT_THREADS=0`. A ratio ≤ 1 means two threads "
           "were no slower than one in the same round. `1 thread, again` is a second 1-thread engine in the same "
           "rounds (an A/A control): its ratio shows how far two identical configurations drift apart here. The "
           "configurations run in a rotated order (round r starts with configuration r mod 4). Stalls: the pool "
           "caller's waits over `stall_us` for a chunk a helper had claimed; after one it runs the next jobs alone "
           "for a while (`hetforge.kernels.native`, `pool_info()`)."]
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,llama-110m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--load", default="none,pinned", help="comma list of none, pinned, unpinned")
    ap.add_argument("--baseline-rev", default="", help="also run native.c at this git revision (`omp`)")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=str(DOCS / "contention.json"))
    ap.add_argument("--from-json", default="", help="regenerate the page from this JSON, measuring nothing")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--source", default="", help=argparse.SUPPRESS)
    ap.add_argument("--kernel-check", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.from_json:
        Path(a.from_json).with_suffix(".md").write_text(render(json.loads(Path(a.from_json).read_text())))
        return
    if a.kernel_check:
        kernel_check(a.source, a.kernel_check)
        return
    if a.worker:
        worker(a.worker, a.source or None, a.tokens)
        return
    from hetforge.hardware.isa import host_record

    models, loads = a.models.split(","), a.load.split(",")
    kernels = {"pool": "the working tree's native.c: the decode kernels' own pool (chunks claimed by whoever "
                       "runs; idle helpers spin 50 µs, then sleep; a chunk a helper holds for over 100 µs is taken "
                       "over by the caller, and two take-overs within 50 ms stop idle helpers spinning for 200 ms; a "
                       "helper that joins a job on the caller's CPU moves to the other CPUs; "
                       "a wait over 300 µs sends the caller solo for a while)"}
    sources: dict[str, str | None] = {"pool": None}
    if a.baseline_rev:
        rev = subprocess.run(["git", "rev-parse", "--short", a.baseline_rev], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()
        kernels["omp"] = f"native.c at {rev}: OpenMP teams (barrier at the end of each kernel), libgomp's defaults"
        sources["omp"] = baseline_source(a.baseline_rev)
    start = loadavg()
    kernel_rows = []
    if a.baseline_rev:  # one-row products alone, pool vs OpenMP, interleaved in blocks
        kc = subprocess.run([sys.executable, __file__, "--kernel-check", "40", "--source", sources["omp"]],
                            cwd=ROOT, check=True, capture_output=True, text=True)
        kernel_rows = json.loads(kc.stdout.strip().splitlines()[-1])
    kernel_load = loadavg()
    workers = [Worker(m, k, src, a.tokens) for m in models for k, src in sources.items()]
    raw: dict[tuple, dict] = {}
    try:
        for load in loads:
            busy = start_busy(load)
            before = loadavg()
            try:
                for rnd in range(a.rounds):
                    for w in workers:
                        order = list(CONFIGS)
                        order = order[rnd % len(order):] + order[:rnd % len(order)]  # no configuration always first
                        for c in order:
                            r = w.ask(c)
                            row = raw.setdefault((*w.key, load, c), {"decode_ms": [], "ttft_ms": [], "tuner": [],
                                                                     "pool": [], "pool_request": []})
                            row["decode_ms"].append(round(r["decode_ms"], 2))
                            row["ttft_ms"].append(round(r["ttft_ms"], 2))
                            row["tuner"].append(r["tuner"])
                            if "pool" in r:
                                row["pool"].append(r["pool"])
                                row["pool_request"].append(r["pool_request"])
                            print(w.key, load, c, round(r["decode_ms"], 2), flush=True)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
            after = loadavg()
            for key, row in raw.items():
                if key[2] == load:
                    row["loadavg_before"], row["loadavg_after"] = before, after
    finally:
        for w in workers:
            w.close()
    rows = [{"model": k[0], "kernels": k[1], "load": k[2], "config": k[3], **v} for k, v in raw.items()]
    ratios = []
    if "omp" in sources:
        for m in models:
            for load in loads:
                for c in CONFIGS:
                    new, old = raw[(m, "pool", load, c)]["decode_ms"], raw[(m, "omp", load, c)]["decode_ms"]
                    ratios.append({"model": m, "load": load, "config": c,
                                   "ratio": round(statistics.median(x / y for x, y in zip(new, old, strict=True)), 3)})
    doc = {"command": shlex.join(["python", "bench/contention.py", *sys.argv[1:]]), "models": models,
           "tokens": a.tokens, "rounds": a.rounds, "loads": loads, "kernels": kernels, "timing": "measured",
           "load_modes": {"none": "no background process of ours",
                          "pinned": "one `while True: pass` process pinned to the last CPU",
                          "unpinned": "one `while True: pass` process, not pinned"},
           "loadavg_start": start, "loadavg_end": loadavg(), "host": host_record(), "note": a.note,
           "summary": summarize(rows), "kernel_ratios": ratios, "rows": rows,
           "kernel_check": {"loadavg_after": kernel_load, "rows": kernel_rows}}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    Path(a.out).with_suffix(".md").write_text(render(doc))
    print(render(doc))


if __name__ == "__main__":
    main()
