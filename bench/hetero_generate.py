"""Generation on placed programs: modeled per-token cost on every shipped SoC × strategy, and measured host costs.

Usage: python bench/hetero_generate.py [--models llama-110m gpt2] [--quantize none w8] [--socs ...]
                                       [--strategies ...] [--prompt-tokens 100] [--rounds 3] [--new-tokens 32]
                                       [--threads 2] [--out docs/bench/hetero_generate.json]
       python bench/hetero_generate.py --render docs/bench/hetero_generate.json   # the page only

Three parts, one process:

1. **Sweep (modeled).** Per model and program (prefill at the prompt's tier, decode at the cache length),
   captured and optimized once; per SoC × placement × scheme, hetforge's placed executor places, lowers,
   partitions and builds it, and one prefill call and one decode call run for real through the runner (so
   the transfers counted are the ones that happened). Figures: the list-scheduled modeled latency and
   energy (runtime.ledger / hetero.timeline), device switches, transfers and bytes copied per call. Every
   device runs on a torch-cpu stand-in here (``emulated:torch-cpu``; constraints still enforced): the
   modeled figures do not depend on the stand-in and OpenVINO's compile would only add minutes. Placements:
   the five strategies plus ``single:<device>`` for every device (all-on-one-device baselines).
2. **Host plan vs the direct executor (measured).** ``hetforge run --soc host`` now goes through the one
   runner (one partition on the torch-cpu backend); the old path called the compiled arena program
   directly. Both decode the same prompt in interleaved rounds; ratio of mean ms/token.
3. **Runner overhead of a three-device plan (measured).** The same greedy/pgsam plan on
   intel-core-ultra-155h decoded with every device on a torch-cpu stand-in: measured host time per decode
   step in transfers (real copies: the 155H's links are not unified) and between calls, per switch and
   per transfer, against the host single-partition plan.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

STRATEGIES = ("rules", "greedy", "pgsam", "support", "single")


def _socs() -> list[str]:
    from hetforge.hardware import list_socs

    return [s for s in list_socs() if s not in ("host", "test-npu-gaps")]


def _programs(name: str, prompt_tokens: int, new_tokens: int):
    """Capture + passes once per model: the prefill and decode graphs with their inputs."""
    from hetforge.frontend import capture
    from hetforge.models.zoo import load_model
    from hetforge.passes import optimize
    from hetforge.runtime.programs import ProgramCache, pick_tier
    from hetforge.runtime.static_kv import DecodeModule, PrefillModule

    lm = load_model(name)
    pc = ProgramCache(lm.model, lm.max_positions, None)
    tier = pick_tier(prompt_tokens, pc.tiers)
    length = pick_tier(max(tier, prompt_tokens + new_tokens - 1), pc.tiers)
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros((1, tier), dtype=torch.long)
    ids[0, :prompt_tokens] = torch.randint(0, lm.vocab_size, (prompt_tokens,), generator=g)
    pre_in = (ids, torch.tensor([prompt_tokens - 1]))
    cache = pc.cache(length)
    dec_in = (torch.tensor([[7]]), torch.tensor([[prompt_tokens]]), *cache.buffers)
    out = {}
    for kind, mod, inputs in (("prefill", PrefillModule(lm.model), pre_in), ("decode", DecodeModule(lm.model), dec_in)):
        cg = capture(mod, inputs, name=kind)
        out[kind] = (optimize(cg.gm, inputs).gm, inputs)
    return lm, out, tier, length


def sweep(models, schemes, socs, strategies, prompt_tokens, new_tokens) -> list[dict]:
    from hetforge.hardware import load_soc
    from hetforge.runtime.executors import PlacedExecutor
    from hetforge.runtime.ledger import Ledger

    rows = []
    for name in models:
        lm, progs, tier, length = _programs(name, prompt_tokens, new_tokens)
        for soc in socs:
            prof = load_soc(soc)
            standins = {d.name: "emulated:torch-cpu" for d in prof.devices if d.kind != "cpu"}
            placements = list(strategies) + [f"single:{d}" for d in prof.device_names]
            for scheme in schemes:
                for strat in placements:
                    row = {"model": name, "soc": soc, "strategy": strat, "quantize": scheme, "prefill_tier": tier,
                           "cache_length": length}
                    try:
                        ex = PlacedExecutor(soc=prof, strategy=strat, quantize=scheme, backends=standins)
                        led = Ledger(prof.name)
                        for kind in ("prefill", "decode"):
                            gm, inputs = progs[kind]
                            b = ex.build(gm, inputs, kind, optimize=False)
                            b.run(*inputs)
                            led.add(kind, 0.0, b.placed)
                            row[f"{kind}_partitions"] = len(b.placed.partitions.partitions)
                            row[f"{kind}_devices"] = b.placed.compiled.program.count_by_device()
                        s = led.summary()
                        for kind, key in (("prefill", "prefill"), ("decode", "decode_per_token")):
                            f = s[key]
                            row[kind] = {k: f[k] for k in ("modeled_ms", "modeled_mj", "modeled_serial_ms",
                                                           "modeled_switch_ms", "switches", "transfers",
                                                           "zero_copy", "bytes_moved")}
                            row[kind]["by_device"] = f["by_device"]
                    except Exception as e:  # an infeasible plan (e.g. an op or dtype a device lacks) is a result
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"
                    rows.append(row)
                    print(json.dumps({k: row.get(k) for k in ("model", "soc", "strategy", "quantize")}),
                          (f"decode {row['decode']['modeled_ms']:.3f} ms {row['decode']['modeled_mj']:.3f} mJ"
                           if "decode" in row else row.get("error")), flush=True)
        del lm, progs
    return rows


class DirectExecutor:
    """The pre-runner path, for comparison only: compile_graph's arena program called directly."""

    name = "direct"

    def build(self, gm, inputs, label, optimize):
        from hetforge.compile import compile_graph
        from hetforge.runtime.executors import Built

        res = compile_graph(gm, soc="host", example_inputs=inputs, passes=optimize, name=label)
        run = res.executable.run_flat

        def call(*args):
            with torch.no_grad():
                return run(*args)

        return Built(call, 0.0, res.seconds["total"], len(res.gm.graph.nodes))


def host_vs_direct(models, rounds, new_tokens, prompt_tokens) -> list[dict]:
    from hetforge.models.zoo import load_model
    from hetforge.runtime import Engine, SamplingParams

    out = []
    for name in models:
        lm = load_model(name)
        engines = {"placed (one partition)": Engine(lm, soc="host"),
                   "direct executable": Engine(lm, executor=DirectExecutor())}
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, lm.vocab_size, (prompt_tokens,), generator=g).tolist()
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        toks = {k: e.generate(prompt, params).tokens for k, e in engines.items()}  # compile + warm
        ms = {k: [] for k in engines}
        for _ in range(rounds):
            for k, e in engines.items():
                ms[k].append(e.generate(prompt, params).decode_ms_per_token)
        a, b = statistics.fmean(ms["placed (one partition)"]), statistics.fmean(ms["direct executable"])
        out.append({"model": name, "decode_ms_per_token": ms, "ratio_placed_over_direct": a / b,
                    "same_tokens": len({tuple(t) for t in toks.values()}) == 1, "figure": "measured"})
        print(name, f"placed/direct decode = {a:.2f}/{b:.2f} ms = {a / b:.3f}", flush=True)
    return out


def runner_overhead(model, strategies, rounds, new_tokens, prompt_tokens) -> list[dict]:
    from hetforge.hardware import load_soc
    from hetforge.models.zoo import load_model
    from hetforge.runtime import Engine, SamplingParams

    lm = load_model(model)
    prof = load_soc("intel-core-ultra-155h")
    standins = {d.name: "emulated:torch-cpu" for d in prof.devices if d.kind != "cpu"}
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, lm.vocab_size, (prompt_tokens,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    rows = []
    engines = {"host": Engine(lm, soc="host")}
    for s in strategies:
        engines[f"155h/{s}"] = Engine(lm, soc=prof, strategy=s, backends=standins)
    for e in engines.values():
        e.generate(prompt, params)
    res = {k: [] for k in engines}
    for _ in range(rounds):
        for k, e in engines.items():
            res[k].append(e.generate(prompt, params))
    base = statistics.fmean(r.decode_ms_per_token for r in res["host"])
    for k, rs in res.items():
        d = [r.placed["decode_per_token"] for r in rs]
        wall = statistics.fmean(x["measured_wall_ms"] for x in d)
        calls = statistics.fmean(x["measured_calls_ms"] for x in d)
        xfer = statistics.fmean(x["measured_transfer_ms"] for x in d)
        sw, tr = d[0]["switches"], d[0]["transfers"]
        rows.append({"plan": k, "devices": rs[0].placed["partitions"]["decode"]["instructions_by_device"],
                     "decode_ms_per_token": statistics.fmean(r.decode_ms_per_token for r in rs),
                     "vs_host": statistics.fmean(r.decode_ms_per_token for r in rs) / base,
                     "switches": sw, "transfers": tr, "bytes_moved": d[0]["bytes_moved"],
                     "measured_transfer_ms": xfer, "measured_between_calls_ms": wall - calls - xfer,
                     "per_transfer_us": 1e3 * xfer / tr if tr else None,
                     "per_switch_us": 1e3 * (wall - calls - xfer) / sw if sw else None, "figure": "measured"})
        print(rows[-1], flush=True)
    return rows


def render(d: dict) -> str:
    m = d["meta"]
    lines = ["# Generation on placed programs (modeled per SoC, measured on this host)", "",
             f"Generated by `bench/hetero_generate.py` from [hetero_generate.json](hetero_generate.json) "
             f"({m['date']}, {m['cpu']}, {m['threads']} threads, torch {m['torch']}; load average at start "
             f"{m['load']}). Command: `{m['command']}`.", "",
             "**Modeled** figures come from the SoC's cost model, list-scheduled (devices overlap where the "
             "partition DAG allows; a device switch costs the profile's dispatch + synchronisation). Every non-CPU "
             "device ran on a torch-cpu stand-in with its constraints enforced. Switches, transfers and bytes are "
             "counted on the real run of one prefill call (prompt "
             f"{m['prompt_tokens']} tokens, tier {d['sweep'][0]['prefill_tier'] if d['sweep'] else '?'}) and one "
             "decode call. **Measured** figures are wall-clock on this host.", ""]
    lines += ["## Energy and latency per token against all-on-GPU (modeled)", "",
              "Per model × scheme × SoC: the plan with the least decode energy among the strategies, and all-on-GPU "
              "(`single:gpu`). Saved = 1 − energy/all-GPU energy; latency cost = latency/all-GPU latency.", "",
              "| model | scheme | SoC | best strategy | decode mJ/token | all-GPU mJ | energy saved | "
              "decode ms/token | all-GPU ms | latency ×|",
              "|---|---|---|---|---|---|---|---|---|---|"]
    rows = [r for r in d["sweep"] if "decode" in r]
    keys = sorted({(r["model"], r["quantize"], r["soc"]) for r in rows})
    for model, q, soc in keys:
        grp = [r for r in rows if (r["model"], r["quantize"], r["soc"]) == (model, q, soc)]
        gpu = next((r for r in grp if r["strategy"] == "single:gpu"), None)
        cands = [r for r in grp if r["strategy"] in STRATEGIES]
        if not cands:
            continue
        best = min(cands, key=lambda r: r["decode"]["modeled_mj"])
        if gpu is None:
            lines.append(f"| {model} | {q} | {soc} | {best['strategy']} | {best['decode']['modeled_mj']:.3f} | — | — | "
                         f"{best['decode']['modeled_ms']:.3f} | — | — |")
            continue
        e, ge = best["decode"]["modeled_mj"], gpu["decode"]["modeled_mj"]
        t, gt = best["decode"]["modeled_ms"], gpu["decode"]["modeled_ms"]
        lines.append(f"| {model} | {q} | {soc} | {best['strategy']} | {e:.3f} | {ge:.3f} | {100 * (1 - e / ge):.1f}% | "
                     f"{t:.3f} | {gt:.3f} | {t / gt:.2f} |")
    lines += ["", "## Every plan (modeled)", "",
              "| model | scheme | SoC | strategy | prefill ms | prefill mJ | decode ms/token | decode mJ/token | "
              "switches/token | transfers/token | KiB copied/token | decode devices |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["sweep"]:
        if "decode" not in r:
            lines.append(f"| {r['model']} | {r['quantize']} | {r['soc']} | {r['strategy']} | refused: "
                         f"{r['error'][:140]} |||||||| ")
            continue
        p, c = r["prefill"], r["decode"]
        devs = ", ".join(f"{k} {v}" for k, v in r["decode_devices"].items() if v)
        lines.append(f"| {r['model']} | {r['quantize']} | {r['soc']} | {r['strategy']} | {p['modeled_ms']:.3f} | "
                     f"{p['modeled_mj']:.3f} | {c['modeled_ms']:.3f} | {c['modeled_mj']:.3f} | {c['switches']:.0f} | "
                     f"{c['transfers']:.0f} | {c['bytes_moved'] / 1024:.1f} | {devs} |")
    lines += ["", "## The host plan through the one runner vs the direct executable (measured)", "",
              "| model | placed ms/token (rounds) | direct ms/token (rounds) | placed ÷ direct | same tokens |",
              "|---|---|---|---|---|"]
    for r in d["host_vs_direct"]:
        a, b = r["decode_ms_per_token"].values()
        lines.append(f"| {r['model']} | {', '.join(f'{x:.2f}' for x in a)} | {', '.join(f'{x:.2f}' for x in b)} | "
                     f"{r['ratio_placed_over_direct']:.3f} | {r['same_tokens']} |")
    lines += ["", "## Runner overhead of multi-device plans on this host (measured)", "",
              "intel-core-ultra-155h plans, every device on a torch-cpu stand-in; per decode step.", "",
              "| plan | instructions by device | ms/token | × host | switches | transfers | KiB copied | "
              "ms in transfers | ms between calls | µs per transfer | µs per switch |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["runner_overhead"]:
        def f(x, fmt):
            return "—" if x is None else format(x, fmt)
        lines.append(f"| {r['plan']} | {r['devices']} | {r['decode_ms_per_token']:.2f} | {r['vs_host']:.2f} | "
                     f"{r['switches']:.0f} | {r['transfers']:.0f} | {r['bytes_moved'] / 1024:.1f} | "
                     f"{r['measured_transfer_ms']:.3f} | {r['measured_between_calls_ms']:.3f} | "
                     f"{f(r['per_transfer_us'], '.1f')} | {f(r['per_switch_us'], '.1f')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama-110m", "gpt2"])
    ap.add_argument("--quantize", nargs="+", default=["none", "w8"])
    ap.add_argument("--socs", nargs="+", default=None)
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--out", default="docs/bench/hetero_generate.json")
    ap.add_argument("--render", default=None, help="only write the page from this JSON")
    a = ap.parse_args()
    if a.render:
        d = json.loads(Path(a.render).read_text())
        Path(a.render).with_suffix(".md").write_text(render(d))
        return
    torch.set_num_threads(a.threads)
    from hetforge.hardware.host import cpu_name

    cpu = cpu_name()  # with its family, model and stepping, as every other page records it
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu, "threads": a.threads, "torch": torch.__version__,
            "load": round(os.getloadavg()[0], 2), "command": "python " + " ".join(sys.argv),
            "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens}
    d = {"meta": meta,
         "host_vs_direct": host_vs_direct(a.models, a.rounds, a.new_tokens, a.prompt_tokens),
         "runner_overhead": runner_overhead(a.models[0], ["greedy", "pgsam"], a.rounds, a.new_tokens,
                                            a.prompt_tokens),
         "sweep": [] if a.skip_sweep else sweep(a.models, a.quantize, a.socs or _socs(), a.strategies,
                                                a.prompt_tokens, a.new_tokens)}
    out = Path(a.out)
    out.write_text(json.dumps(d, indent=1))
    out.with_suffix(".md").write_text(render(d))
    print("wrote", out, out.with_suffix(".md"))


if __name__ == "__main__":
    main()
