"""Generation benchmark: hetforge's runtime vs Hugging Face eager ``generate``, and vs the bandwidth bound.

Usage: python bench/generate.py [--models gpt2 llama-110m] [--prompt-tokens 32] [--new-tokens 64]
                                [--rounds 5] [--threads 2] [--executor auto] [--json FILE]

Per model, in one process: build both, warm both up (hetforge compiles its two programs here; the
compile seconds are reported), then ``--rounds`` rounds, each running HF then hetforge on the same
seeded prompt (interleaved, so drift hits both). Greedy, end-of-text ignored by both.

* HF time to first token = wall time of ``generate(max_new_tokens=1)``; HF decode ms/token =
  (``generate(max_new_tokens=N)`` − that) / (N − 1). hetforge's figures come from its own per-step
  timers (prefill + first sample; mean decode step). All wall-clock, measured.
* Bandwidth bound: bytes a decode step must read (every weight except the unused rows of input-only
  embedding tables, plus the live KV rows at the mean context) ÷ the read bandwidth measured here
  (``sum`` over a 512 MiB tensor, best of 5). A lower bound on decode time (modeled from measured inputs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from hetforge.models.zoo import load_model
from hetforge.runtime import Engine, SamplingParams


def read_bandwidth(mib: int = 512, repeat: int = 5) -> float:
    """Measured bytes/s of reading a large fp32 tensor (``sum``), best of ``repeat``."""
    x = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


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
    t0 = time.perf_counter()
    eng = Engine(loaded, executor=args.executor)
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    warm = eng.generate(prompt[0].tolist(), params)
    setup_s = time.perf_counter() - t0
    hf_run(model, prompt, 2)
    hf_ttft, hf_dec, our_ttft, our_dec = [], [], [], []
    same = True
    for _ in range(args.rounds):
        t1, _ = hf_run(model, prompt, 1)
        tn, hf_tokens = hf_run(model, prompt, n)
        r = eng.generate(prompt[0].tolist(), params)
        hf_ttft.append(t1)
        hf_dec.append((tn - t1) / (n - 1))
        our_ttft.append(r.ttft_s)
        our_dec.append(r.decode_ms_per_token / 1e3)
        same &= r.tokens == hf_tokens
    cache = eng.programs.cache(warm.cache_length)
    per_pos = cache.nbytes // cache.length
    need = decode_bytes(model, per_pos, args.prompt_tokens + n / 2)
    bound = need / bw

    def st(xs):
        return {"median": statistics.median(xs), "min": min(xs)}

    res = {
        "model": name, "parameters": loaded.num_parameters, "executor": warm.executor,
        "prompt_tokens": args.prompt_tokens, "new_tokens": n, "rounds": args.rounds,
        "prefill_tier": warm.prefill_tier, "kv_cache_length": warm.cache_length, "kv_cache_bytes": warm.kv_cache_bytes,
        "compile_s": warm.compile_s, "setup_s": setup_s,
        "hf": {"ttft_s": st(hf_ttft), "decode_s_per_token": st(hf_dec)},
        "hetforge": {"ttft_s": st(our_ttft), "decode_s_per_token": st(our_dec)},
        "decode_ratio_vs_hf": statistics.median(our_dec) / statistics.median(hf_dec),
        "ttft_ratio_vs_hf": statistics.median(our_ttft) / statistics.median(hf_ttft),
        "decode_bytes_per_token": need, "bandwidth_bound_s_per_token": bound,
        "decode_ratio_vs_bound": statistics.median(our_dec) / bound,
        "hf_decode_ratio_vs_bound": statistics.median(hf_dec) / bound,
        "same_tokens_as_hf": same,
    }
    return res


def table(results: list[dict], bw: float) -> str:
    rows = ["| model | system | TTFT median (min) ms | decode median (min) ms/token | decode ÷ HF | decode ÷ bound |",
            "|---|---|---|---|---|---|"]
    for r in results:
        for sys_, key in (("HF eager generate", "hf"), (f"hetforge ({r['executor']})", "hetforge")):
            d, t = r[key]["decode_s_per_token"], r[key]["ttft_s"]
            ratio = f"{r['decode_ratio_vs_hf']:.2f}" if key == "hetforge" else "1"
            bound = r["decode_ratio_vs_bound"] if key == "hetforge" else r["hf_decode_ratio_vs_bound"]
            rows.append(f"| {r['model']} | {sys_} | {1e3 * t['median']:.1f} ({1e3 * t['min']:.1f}) | "
                        f"{1e3 * d['median']:.2f} ({1e3 * d['min']:.2f}) | {ratio} | {bound:.2f} |")
    rows.append("")
    for r in results:
        comp = ", ".join(f"{k} {v:.1f} s" for k, v in r["compile_s"].items())
        rows.append(f"- {r['model']}: bound {1e3 * r['bandwidth_bound_s_per_token']:.2f} ms/token = "
                    f"{r['decode_bytes_per_token'] / 1e6:.1f} MB ÷ {bw / 1e9:.1f} GB/s; prefill tier "
                    f"{r['prefill_tier']}, KV cache {r['kv_cache_length']} positions = "
                    f"{r['kv_cache_bytes'] / 2**20:.1f} MiB; compiled {comp}; same greedy tokens as HF: "
                    f"{r['same_tokens_as_hf']}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama-110m"])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--executor", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    bw = read_bandwidth()
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads": args.threads,
               "torch": torch.__version__, "load_avg_start": os.getloadavg()}
    print(f"read bandwidth (measured): {bw / 1e9:.2f} GB/s; machine {machine}", flush=True)
    results = []
    for name in args.models:
        results.append(bench_model(name, args, bw))
        print(json.dumps(results[-1], indent=1, default=str), flush=True)
    machine["load_avg_end"] = os.getloadavg()
    print(table(results, bw))
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"machine": machine, "read_bandwidth_Bps": bw, "results": results}, f, indent=1, default=str)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
