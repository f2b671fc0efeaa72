"""Generation benchmark: hetforge's runtime vs Hugging Face eager ``generate``, and vs the bandwidth bound.

Usage: python bench/generate.py [--models gpt2 llama-110m] [--prompt-tokens 32] [--new-tokens 64]
                                [--rounds 5] [--threads 2] [--executor auto] [--quantize none w8a8]
                                [--out JSON] [--md PAGE]
       python bench/generate.py --from-json --out docs/bench/generate.json --md docs/bench/generate.md

Per model, in one process: build both, warm both up (hetforge compiles its two programs here; the
compile seconds are reported), then ``--rounds`` rounds, each running HF then hetforge on the same
seeded prompt (interleaved, so drift hits both). Greedy, end-of-text ignored by both.

* HF time to first token = wall time of ``generate(max_new_tokens=1)``; HF decode ms/token =
  (``generate(max_new_tokens=N)`` − that) / (N − 1). hetforge's figures come from its own per-step
  timers (prefill + first sample; mean decode step). All wall-clock, measured.
* Bandwidth bound (modeled from a measured bandwidth): bytes a decode step must read (every weight except the
  unused rows of input-only embedding tables, plus the live KV rows at the mean context) ÷ β_read, the one
  read bandwidth hetforge defines (docs/arch/hardware-cost.md#read-bandwidth;
  ``hetforge.hardware.bandwidth.read_bandwidth``, the figure ``hetforge calibrate`` writes as the profile's
  bandwidth), measured here at the bench's thread count: once at the start and again in every round right before
  hetforge's requests; the target is judged per round (decode ÷ that round's bound, median over rounds), since this
  host's read bandwidth moves between rounds. A ratio below 1.0 means the bound is wrong.
  For a quantized run the linears' weights count at their quantized size (int8 + fp32 scales).
* ``--quantize``: one hetforge row per scheme (``none`` = fp32, the same precision as HF). A quantized
  row is *not* the same computation as HF's fp32 one: its tokens are compared with HF's (length of the
  common prefix) and reported next to its speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from _pages import add_page_args, end_meta, from_json_done, meta_lines, run_meta, write_result

from hetforge.models.zoo import load_model
from hetforge.runtime import Engine, SamplingParams


def read_bandwidth() -> tuple[float, str]:
    """β_read at the bench's thread count and its method (measured; docs/arch/hardware-cost.md#read-bandwidth)."""
    from hetforge.hardware.bandwidth import read_bandwidth as measure_read

    r = measure_read()
    return r.bytes_per_s, r.method


def decode_bytes(model, kv_bytes_per_pos: int, mean_ctx: float) -> int:
    """Bytes one decode step must read: weights (input-only embeddings count one row) + live KV rows."""
    out_emb = model.get_output_embeddings().weight
    total = 0
    seen = set()
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        is_input_table = isinstance(_owner(model, name), torch.nn.Embedding) and p.data_ptr() != out_emb.data_ptr()
        total += (p.shape[-1] if is_input_table else p.numel()) * p.element_size()
    return int(total + kv_bytes_per_pos * mean_ctx)


def quantized_bytes(model, scheme: str, fp32_bytes: int) -> int:
    """``fp32_bytes`` with every linear weight (incl. the LM head) counted at its ``scheme`` size."""
    from hetforge.ops.quant import weight_bytes

    if scheme == "none":
        return fp32_bytes
    delta, seen = 0, set()
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        kind = type(mod).__name__
        if w is None or w.dim() != 2 or kind not in ("Linear", "Conv1D") or w.data_ptr() in seen:
            continue
        seen.add(w.data_ptr())
        n, k = (w.shape[1], w.shape[0]) if kind == "Conv1D" else tuple(w.shape)
        delta += w.numel() * w.element_size() - weight_bytes(scheme, n, k)
    return fp32_bytes - delta


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _owner(model, pname: str):
    mod = model
    for part in pname.split(".")[:-1]:
        mod = getattr(mod, part)
    return mod


def hf_run(model, ids: torch.Tensor, n: int) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False)
    return time.perf_counter() - t0, out[0, ids.shape[1]:].tolist()


def bench_model(name: str, args, bw: float) -> dict:
    loaded = load_model(name)
    model = loaded.model
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, loaded.vocab_size, (1, args.prompt_tokens), generator=g)
    n = args.new_tokens
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    engines, warm, setup_s = {}, {}, {}
    for scheme in args.quantize:
        t0 = time.perf_counter()
        engines[scheme] = Engine(loaded, executor=args.executor, quantize=scheme)
        warm[scheme] = engines[scheme].generate(prompt[0].tolist(), params)
        setup_s[scheme] = time.perf_counter() - t0
    hf_run(model, prompt, 2)
    hf_ttft, hf_dec, betas = [], [], []
    ours = {s: {"ttft": [], "dec": [], "prefix": []} for s in args.quantize}
    for _ in range(args.rounds):
        t1, _ = hf_run(model, prompt, 1)
        tn, hf_tokens = hf_run(model, prompt, n)
        hf_ttft.append(t1)
        hf_dec.append((tn - t1) / (n - 1))
        betas.append(read_bandwidth()[0])  # β_read again, next to this round's requests (the host's bandwidth moves)
        for scheme, eng in engines.items():
            r = eng.generate(prompt[0].tolist(), params)
            ours[scheme]["ttft"].append(r.ttft_s)
            ours[scheme]["dec"].append(r.decode_ms_per_token / 1e3)
            ours[scheme]["prefix"].append(common_prefix(r.tokens, hf_tokens))
    first = warm[args.quantize[0]]
    cache = engines[args.quantize[0]].programs.cache(first.cache_length)
    per_pos = cache.nbytes // cache.length
    need = decode_bytes(model, per_pos, args.prompt_tokens + n / 2)

    def st(xs):
        return {"median": statistics.median(xs), "min": min(xs)}

    def paired(dec: list[float], nbytes: int) -> dict:
        """Per round, decode ÷ the bound at the β_read measured in that round: median, min, max."""
        rs = [d / (nbytes / b) for d, b in zip(dec, betas, strict=True)]
        return {"median": statistics.median(rs), "min": min(rs), "max": max(rs)}

    runs = {}
    for scheme, o in ours.items():
        need_q = quantized_bytes(model, scheme, need)
        runs[scheme] = {
            "executor": warm[scheme].executor, "compile_s": warm[scheme].compile_s, "setup_s": setup_s[scheme],
            "ttft_s": st(o["ttft"]), "decode_s_per_token": st(o["dec"]),
            "decode_ratio_vs_hf": statistics.median(o["dec"]) / statistics.median(hf_dec),
            "decode_ratio_vs_hf_min": min(o["dec"]) / min(hf_dec),
            "ttft_ratio_vs_hf": statistics.median(o["ttft"]) / statistics.median(hf_ttft),
            "decode_bytes_per_token": need_q, "bandwidth_bound_s_per_token": need_q / bw,
            "decode_ratio_vs_bound": statistics.median(o["dec"]) / (need_q / bw),
            "decode_ratio_vs_round_bound": paired(o["dec"], need_q),
            "tokens_equal_to_hf_prefix": min(o["prefix"]), "same_tokens_as_hf": min(o["prefix"]) == n,
        }
    return {
        "model": name, "parameters": loaded.num_parameters,
        "prompt_tokens": args.prompt_tokens, "new_tokens": n, "rounds": args.rounds,
        "prefill_tier": first.prefill_tier, "kv_cache_length": first.cache_length,
        "kv_cache_bytes": first.kv_cache_bytes, "round_read_bandwidth_Bps": betas,
        "hf": {"ttft_s": st(hf_ttft), "decode_s_per_token": st(hf_dec), "decode_bytes_per_token": need,
               "bandwidth_bound_s_per_token": need / bw,
               "decode_ratio_vs_bound": statistics.median(hf_dec) / (need / bw),
               "decode_ratio_vs_round_bound": paired(hf_dec, need)},
        "hetforge": runs,
    }


def table(results: list[dict], bw: float) -> str:
    rows = ["| model | system | TTFT median (min) ms | decode median (min) ms/token | decode ÷ HF median (min) | "
            "decode ÷ bound (one β_read) | decode ÷ bound at its round's β_read, median (range) | tokens equal to HF |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        h = r["hf"]
        rows.append(f"| {r['model']} | HF eager generate (fp32) | {_ms(h['ttft_s'])} | "
                    f"{_ms(h['decode_s_per_token'], 2)} | 1 | {h['decode_ratio_vs_bound']:.2f} | {_paired(h)} | — |")
        for scheme, o in r["hetforge"].items():
            prec = "fp32" if scheme == "none" else scheme
            label = o["executor"] if prec in o["executor"] else f"{o['executor']}, {prec}"
            rows.append(f"| {r['model']} | hetforge ({label}) | {_ms(o['ttft_s'])} | "
                        f"{_ms(o['decode_s_per_token'], 2)} | {o['decode_ratio_vs_hf']:.2f} "
                        f"({o['decode_ratio_vs_hf_min']:.2f}) | {o['decode_ratio_vs_bound']:.2f} | {_paired(o)} | "
                        f"{o['tokens_equal_to_hf_prefix']}/{r['new_tokens']} |")
    rows.append("")
    for r in results:
        bounds = "; ".join(f"{'fp32' if s == 'none' else s} {1e3 * o['bandwidth_bound_s_per_token']:.2f} ms/token = "
                           f"{o['decode_bytes_per_token'] / 1e6:.1f} MB" for s, o in r["hetforge"].items())
        comp = "; ".join(f"{s}: " + ", ".join(f"{k} {v:.1f} s" for k, v in o["compile_s"].items())
                         for s, o in r["hetforge"].items())
        betas = r.get("round_read_bandwidth_Bps")
        again = "" if not betas else (f" (β_read measured again in each round: {min(betas) / 1e9:.1f}–"
                                      f"{max(betas) / 1e9:.1f} GB/s)")
        rows.append(f"- {r['model']}: bound at β_read = {bw / 1e9:.1f} GB/s (measured){again}: {bounds}; "
                    f"prefill tier {r['prefill_tier']}, "
                    f"KV cache {r['kv_cache_length']} positions = {r['kv_cache_bytes'] / 2**20:.1f} MiB; "
                    f"compiled (measured) {comp}")
    return "\n".join(rows)


def _paired(o: dict) -> str:
    """The per-round decode ÷ bound at that round's β_read (median and range), or — for a run without it."""
    p = o.get("decode_ratio_vs_round_bound")
    return "—" if p is None else f"{p['median']:.2f} ({p['min']:.2f}–{p['max']:.2f})"


def _ms(s: dict, nd: int = 1) -> str:
    return f"{1e3 * s['median']:.{nd}f} ({1e3 * s['min']:.{nd}f})"


def render(res: dict) -> str:
    """The page of one run's JSON: the table, the bounds and the reading against the targets, all from it."""
    m, results, bw = res["meta"], res["results"], res["read_bandwidth_Bps"]
    n = results[0]["new_tokens"] if results else 0
    lines = ["# Generation: hetforge runtime vs Hugging Face eager `generate`", "", *meta_lines(m), "",
             f"Both systems run in one process, interleaved round by round ({results[0]['rounds'] if results else 0} "
             f"rounds after a warm-up), on the same seeded {results[0]['prompt_tokens'] if results else 0}-token "
             f"prompt, greedy, {n} new tokens, end-of-text ignored. The zoo models have **seeded random weights**. "
             "All times are **measured** wall clock: HF time to first token = `generate(max_new_tokens=1)`, HF decode "
             f"= (`generate(max_new_tokens={n})` − that) ÷ {n - 1}; hetforge's come from its own per-step timers "
             "(TTFT = prefill program + KV write + first sample; decode = mean step). One-time compilation is "
             "excluded and listed below.", "",
             "The bound is **modeled** from measured inputs: the bytes a decode step must read (every weight, "
             "input-only embedding tables counted as one row, plus the live KV rows at the mean context; quantized "
             "linears at their quantized size) ÷ β_read, the one read bandwidth hetforge defines (the figure "
             "`hetforge calibrate` writes as the profile's bandwidth), measured in the same process at the bench's "
             f"thread count: **{bw / 1e9:.2f} GB/s**, {_method(res['read_bandwidth_method'])}"
             + (", at the start, and again in every round right before hetforge's requests (the per-round column and "
                "the target below)" if any(r.get("round_read_bandwidth_Bps") for r in results) else "")
             + ". A ratio below 1.0 would mean the bound is wrong.", "",
             table(results, bw), "", _spread(results), ""]
    fp32 = [(r, r["hetforge"]["none"]) for r in results if "none" in r["hetforge"]]
    quant = [s for r in results for s in r["hetforge"] if s != "none"]
    if fp32:
        lines += ["## Against the targets", "",
                  "* **decode ≤ 0.7× HF (fp32):** " + "; ".join(
                      f"{r['model']} {o['decode_ratio_vs_hf']:.2f}× — "
                      f"**{'met' if o['decode_ratio_vs_hf'] <= 0.7 else 'not met'}**" for r, o in fp32)
                  + " (median decode ÷ median HF decode).",
                  _bound_reading(fp32),
                  "* **greedy tokens = HF:** " + "; ".join(
                      f"{r['model']} {o['tokens_equal_to_hf_prefix']}/{r['new_tokens']} in every round"
                      if o["same_tokens_as_hf"] else
                      f"{r['model']} only {o['tokens_equal_to_hf_prefix']}/{r['new_tokens']} (worst round)"
                      for r, o in fp32) + ".", ""]
    if quant:
        lines += [f"The quantized rows ({', '.join(sorted(set(quant)))}) are **not** the same computation as HF's "
                  "fp32: their tokens are compared with HF's (common prefix, worst round) and shown next to their "
                  "speed only. On these random-weight models the logits are nearly flat, so int8 rounding changes "
                  "the greedy token almost at once; the quality of quantized models is measured on the trained demo "
                  "model in [quant.md](quant.md).", ""]
    return "\n".join(lines)


def _bound_reading(fp32: list[tuple[dict, dict]]) -> str:
    """The bandwidth-bound target's line. Where the run measured β_read again next to each round's requests, the
    verdict is the median over rounds of decode ÷ that round's bound: this host's read bandwidth moves by up to 2×
    within a minute, and against one reading for the whole run a fast round came out below 1.0, which a bound must
    not allow (docs/arch/hardware-cost.md#read-bandwidth, session 51). Older runs have one reading, judged as they
    were."""
    def verdict(ratio: float) -> str:
        return f"**{'met' if ratio <= 1.5 else 'not met'}**"

    hf = ", ".join(f"{r['hf']['decode_ratio_vs_bound']:.2f}×" for r, _ in fp32)
    fastest = [o["decode_s_per_token"]["min"] / o["bandwidth_bound_s_per_token"] for _, o in fp32]
    single = [f"{r['model']} {o['decode_ratio_vs_bound']:.2f}× (fastest round {f:.2f}×)"
              for (r, o), f in zip(fp32, fastest, strict=True)]
    if not all(o.get("decode_ratio_vs_round_bound") for _, o in fp32):
        return ("* **decode ≤ 1.5× the bandwidth bound (fp32, β_read):** " + "; ".join(
            f"{one} — {verdict(o['decode_ratio_vs_bound'])}" for one, (_, o) in zip(single, fp32, strict=True))
            + f"; HF eager {hf}.")
    betas = [b for r, _ in fp32 for b in r["round_read_bandwidth_Bps"]]
    return ("* **decode ≤ 1.5× the bandwidth bound (fp32, β_read measured next to each round's requests):** "
            + "; ".join(f"{r['model']} {_paired(o)} — {verdict(o['decode_ratio_vs_round_bound']['median'])}"
                        for r, o in fp32)
            + " (median over rounds of decode ÷ that round's bound; range in parentheses); HF eager "
            + ", ".join(_paired(r["hf"]) for r, _ in fp32)
            + f". The rounds' β_read read {min(betas) / 1e9:.1f}–{max(betas) / 1e9:.1f} GB/s. Against the one "
            f"reading at the start (the figure above): {'; '.join(single)}; HF eager {hf}"
            + (" — a ratio below 1.0, so one reading of β_read for a whole run is not a bound on this host."
               if min(fastest) < 1.0 else "."))


def _spread(results: list[dict]) -> str:
    """Round-to-round spread of each system's decode time (median ÷ fastest round), computed from the JSON."""
    def sp(d: dict) -> str:
        return f"{d['median'] / d['min']:.2f}"

    cells = "; ".join(f"{r['model']}: HF {sp(r['hf']['decode_s_per_token'])}, " + ", ".join(
        f"hetforge {'fp32' if s == 'none' else s} {sp(o['decode_s_per_token'])}" for s, o in r["hetforge"].items())
        for r in results)
    return (f"Round-to-round spread of decode time (median ÷ fastest round; measured): {cells}. A spread well above "
            "1 means that system's rounds were disturbed by other load; the ratios to HF of such a run are then "
            "uncertain by as much, so compare the fastest rounds (the figures in parentheses) as well.")


def _method(method: str) -> str:
    """β_read's recorded method with its definition as a link from this page."""
    ref = "(docs/arch/hardware-cost.md#read-bandwidth)"
    return method.replace("read bandwidth " + ref, "[read bandwidth](../arch/hardware-cost.md#read-bandwidth)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama-110m"])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--executor", default="auto")
    ap.add_argument("--quantize", nargs="+", default=["none"], help="one hetforge row per scheme: none w8 w4 w8a8")
    add_page_args(ap)
    args = ap.parse_args(argv)
    if from_json_done(ap, args, render):
        return 0
    if args.rounds < 1 or args.new_tokens < 2:
        ap.error("--rounds must be >= 1 and --new-tokens >= 2")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    meta = run_meta("bench/generate.py", argv)
    bw, bw_method = read_bandwidth()
    print(f"read bandwidth β_read (measured): {bw / 1e9:.2f} GB/s ({bw_method})", flush=True)
    results = []
    for name in args.models:
        results.append(bench_model(name, args, bw))
        print(json.dumps(results[-1], indent=1, default=str), flush=True)
    res = {"meta": end_meta(meta), "read_bandwidth_Bps": bw, "read_bandwidth_method": bw_method, "results": results}
    write_result(res, args.out, args.md, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
