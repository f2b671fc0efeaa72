"""Candidate selection benchmark (QEIL v2's CSVET on hetforge): what several candidates add on checkable answers,
at what modeled energy, and what batching them saves — one run, raw JSON, and the Markdown page generated from it.

The task: two-number addition (``37+45=`` → ``82``), answered by ``arith-demo``, a 100 k-parameter model trained by
``scripts/train_arith.py`` on 9,200 of the 10,000 pairs ``a+b`` (0 ≤ a, b < 100; 400 more are its validation split)
and deliberately undertrained. Selection scores candidates by the verifier the model declares (``runtime.verify``):
re-derivation under the swapped, equivalent prompt (``b+a=``: the probability of the candidate's tokens there, times
their probability after ``a+b=``; threshold from the validation split); the yes/no check the model was also taught
(``37+45=82?`` → ``Y``/``N``) and the log-probability alone are run for comparison. The problems here are the 400
held-out test ones its ``training.json`` lists. An answer is right when the chosen candidate's text is the sum;
every row keeps its per-problem right/wrong string, and the page compares each selection row with plain greedy on
the same problems (McNemar's exact test on the discordant problems; a seeded paired bootstrap of the difference).

1. **Accuracy and energy.** Per problem: plain decoding (greedy; and one sample at each of --temperatures), then
   K ∈ --ks candidates decoded as one batch at each of --temperatures and chosen by ``best-of``, ``majority`` and
   ``csvet`` (structural filter ``--match '\\d+'`` and ``--require-stop`` for all three), each also with the
   greedy anchor (candidate 0 decoded greedily, ``--greedy-anchor``), and the anchored csvet and best-of once more
   with the yes/no verifier (``--verifier yesno``) and the log-probability one (``--verifier logprob``). Plain
   greedy on the swapped prompt ``b+a=`` too (what the rewrite alone would give). pass@1 = share of
   problems whose one chosen answer is right; pass@K (oracle) = share where any of the K candidates is right.
   Energy per problem is **modeled** (the SoC's cost model over every placed call of the request); time is
   **measured** here (compiles excluded).
2. **Batched vs separate (measured and modeled).** On the first --speed-problems problems, interleaved: K
   candidates as one batched request vs the same K samples as K separate requests (``Engine.generate`` with seeds
   ``seed..seed+K-1``); wall time and modeled energy per problem, and their ratios.

    python bench/selection.py --out docs/bench/select.json --md docs/bench/select.md
    python bench/selection.py --from-json docs/bench/select.json --md docs/bench/select.md   # the page again
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
import warnings
from dataclasses import replace

import torch
from _pages import page_from_json, write_result

warnings.filterwarnings("ignore")


SUFFIXES = {"auto": "", "yesno": " (yes/no verifier)", "logprob": " (log-prob verifier)"}
BOOTSTRAP = 10000  # paired bootstrap resamples of the problems (seeded)


def paired(hits: str, base: str, seed: int = 0) -> dict:
    """A row against plain greedy on the same problems: problems right only here / only in greedy, McNemar's exact
    two-sided p on those discordant problems, and a seeded paired bootstrap 95% interval of the pass@1 difference."""
    h = torch.tensor([c == "1" for c in hits], dtype=torch.float64)
    g = torch.tensor([c == "1" for c in base], dtype=torch.float64)
    win, loss = int(((h == 1) & (g == 0)).sum()), int(((h == 0) & (g == 1)).sum())
    n = win + loss
    tail = sum(math.comb(n, i) for i in range(min(win, loss) + 1)) / 2 ** n if n else 1.0
    d = h - g
    idx = torch.randint(0, len(d), (BOOTSTRAP, len(d)), generator=torch.Generator().manual_seed(seed))
    means = d[idx].mean(1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"win": win, "loss": loss, "p": min(1.0, 2 * tail), "lo": lo, "hi": hi, "diff": float(d.mean())}


SPEED_PROMPTS = ["Once upon a time there was", "The compiler places every operator", "In the morning the"]


def plain_energy(r) -> float | None:
    """Modeled mJ of a plain request: its prefill plus every decode call."""
    pl = r.placed
    if not pl:
        return None
    dec = pl["decode_per_token"]["modeled_mj"] * pl["decode_tokens"] if pl.get("decode_per_token") else 0.0
    return pl["prefill"]["modeled_mj"] + dec


def accuracy(args, engine, problems) -> list[dict]:
    from hetforge.runtime import SamplingParams

    rows = []

    def plain(temp: float, swapped: bool = False):
        hits, mj, secs, steps = [], [], [], []
        for i, (a, b) in enumerate(problems):
            p = SamplingParams(max_new_tokens=args.max_new, temperature=temp, seed=args.seed + 1000 * i)
            t0 = time.perf_counter()
            r = engine.generate(f"{b}+{a}=" if swapped else f"{a}+{b}=", p)
            secs.append(time.perf_counter() - t0 - sum(r.compile_s.values()))
            hits.append(r.text.strip() == str(a + b))
            mj.append(plain_energy(r))
            steps.append(len(r.decode_s))
        return {"pass_at_1": statistics.fmean(hits), "modeled_mj_per_problem": statistics.fmean(mj),
                "measured_ms_per_problem": 1e3 * statistics.fmean(secs), "decode_steps": statistics.fmean(steps),
                "hits": "".join("1" if h else "0" for h in hits)}

    a0, b0 = problems[0]
    engine.generate(f"{a0}+{b0}=", SamplingParams(max_new_tokens=args.max_new))  # warm-up: compiles, first calls
    rows.append({"method": "plain greedy", "k": 1, "temperature": 0.0, **plain(0.0)})
    rows.append({"method": "plain greedy, swapped prompt b+a=", "k": 1, "temperature": 0.0, **plain(0.0, True)})
    for temp in args.temperatures:
        rows.append({"method": "plain sampled", "k": 1, "temperature": temp, **plain(temp)})
        rows += candidates(args, engine, problems, temp)
    return rows


def candidates(args, engine, problems, temp: float) -> list[dict]:
    from hetforge.runtime import SamplingParams
    from hetforge.runtime.candidates import generate_candidates
    from hetforge.runtime.select import SelectParams

    rows = []
    for k in args.ks:
        grid = [(m, a, "auto") for a in (False, True) for m in ("best-of", "majority", "csvet")]
        grid += [(m, True, v) for v in ("yesno", "logprob") for m in ("best-of", "csvet")]
        for mode, anchor, verifier in grid:
            sel = SelectParams(k=k, mode=mode, match=r"\d+", require_stop=True, greedy_anchor=anchor,
                               verifier=verifier)
            kind = ""
            hits, oracle, mj, secs, steps, early, rules = [], [], [], [], [], 0, {}
            for i, (a, b) in enumerate(problems):
                p = SamplingParams(max_new_tokens=args.max_new, temperature=temp, seed=args.seed + 1000 * i)
                res = generate_candidates(engine, f"{a}+{b}=", p, sel)
                kind = res.verifier.get("verifier_kind", res.verifier["kind"])
                hits.append(res.chosen is not None and res.chosen.text.strip() == str(a + b))
                oracle.append(any(c.text.strip() == str(a + b) for c in res.candidates if c.stopped_early is None))
                mj.append(res.modeled_energy_mj)
                secs.append(res.measured_s)
                steps.append(res.steps)
                early += len(res.stopped_early)
                for c in res.stopped_early:
                    rules[c.stopped_early["rule"]] = rules.get(c.stopped_early["rule"], 0) + 1
            name = mode + (" + greedy anchor" if anchor else "") + SUFFIXES[verifier]
            rows.append({"method": name, "k": k, "temperature": temp, "verifier": kind,
                         "pass_at_1": statistics.fmean(hits), "pass_at_k_oracle": statistics.fmean(oracle),
                         "modeled_mj_per_problem": statistics.fmean(mj),
                         "measured_ms_per_problem": 1e3 * statistics.fmean(secs),
                         "decode_steps": statistics.fmean(steps),
                         "stopped_early_share": early / (k * len(problems)), "early_rules": rules,
                         "hits": "".join("1" if h else "0" for h in hits)})
            r = rows[-1]
            print(f"T={temp} {r['method']:26s} K={k}: pass@1 {r['pass_at_1']:.3f}, "
                  f"{r['modeled_mj_per_problem']:.2f} mJ "
                  f"(modeled), {r['measured_ms_per_problem']:.1f} ms (measured)", flush=True)
    return rows


def batching(args, engine, prompts: list[str], max_new: int, ignore_eos: bool = False) -> list[dict]:
    """K candidates as one batch vs the same K samples as K separate requests (interleaved per prompt and round;
    measured wall time, modeled energy)."""
    from hetforge.runtime import SamplingParams
    from hetforge.runtime.candidates import generate_candidates
    from hetforge.runtime.select import SelectParams

    out = []
    for k in args.ks:
        sel = SelectParams(k=k, mode="best-of", verifier="logprob")  # decoding alone on both sides (no verify pass)
        tb, ts, eb, es, same = [], [], [], [], 0
        for i, prompt in enumerate(prompts):
            p = SamplingParams(max_new_tokens=max_new, temperature=args.temperatures[-1], seed=args.seed + 1000 * i,
                               ignore_eos=ignore_eos)
            generate_candidates(engine, prompt, p, sel)  # warm-up (compiles the batch programs once)
            engine.generate(prompt, p)
            for _ in range(args.rounds):
                res = generate_candidates(engine, prompt, p, sel)
                tb.append(res.measured_s)
                eb.append(res.modeled_energy_mj)
                t0 = time.perf_counter()
                singles = [engine.generate(prompt, replace(p, seed=p.seed + j)) for j in range(k)]
                ts.append(time.perf_counter() - t0)
                es.append(sum(plain_energy(r) for r in singles))
            same += sum(c.tokens == r.tokens for c, r in zip(res.candidates, singles, strict=True))
        out.append({"model": engine.loaded.name, "k": k, "requests": len(tb), "new_tokens": max_new,
                    "batched_ms": 1e3 * statistics.median(tb), "separate_ms": 1e3 * statistics.median(ts),
                    "time_ratio_batched_over_separate": statistics.median(tb) / statistics.median(ts),
                    "batched_modeled_mj": statistics.fmean(eb), "separate_modeled_mj": statistics.fmean(es),
                    "energy_ratio_batched_over_separate": statistics.fmean(eb) / statistics.fmean(es),
                    "same_tokens_share": same / (k * len(prompts))})
        r = out[-1]
        print(f"{r['model']} K={k}: batched {r['batched_ms']:.2f} ms vs separate {r['separate_ms']:.2f} ms "
              f"(measured), energy ratio {r['energy_ratio_batched_over_separate']:.3f} (modeled)", flush=True)
    return out


def render(doc: dict) -> str:
    """The Markdown page of a result document."""
    m = doc["meta"]
    lines = [
        "# Candidate selection (CSVET, best-of, majority) on checkable answers",
        "",
        f"Generated by `bench/selection.py` from `docs/bench/select.json` ({m['date']}, {m['machine']}, torch "
        f"{m['torch']}, {m['threads']} thread(s); {m['note']}).",
        "",
        f"Task: `a+b=` → the sum, on the {m['problems']} held-out {m.get('split', 'test')} problems of `arith-demo` "
        "(trained by "
        f"`scripts/train_arith.py`: {m['parameters']} parameters, greedy test accuracy at training "
        f"{m['greedy_at_training']:.3f}). SoC `{m['soc']}`, strategy `{m['strategy']}`, max {m['max_new']} new "
        f"tokens, candidates sampled at temperatures {', '.join(map(str, m['temperatures']))} (candidate i of "
        f"problem p seeded "
        f"{m['seed']} + 1000·p + i). Structural filter for all selection modes: `--match '\\d+' --require-stop`.",
        "",
        *verifier_lines(m),
        "**Energy is modeled** (the SoC's cost model over every placed call of the request, list-scheduled); "
        "**times are measured** on this host (compiles excluded).",
        "",
        "## Accuracy at modeled energy",
        "",
        "| method | verifier | temperature | K | pass@1 | pass@K (oracle) | modeled mJ / problem | "
        "× plain greedy energy | measured ms / problem | decode steps | candidates stopped early | early-stop rules |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = next(r for r in doc["accuracy"] if r["method"] == "plain greedy")["modeled_mj_per_problem"]
    for r in doc["accuracy"]:
        orc = f"{r['pass_at_k_oracle']:.3f}" if "pass_at_k_oracle" in r else "—"
        early = f"{r['stopped_early_share']:.1%}" if "stopped_early_share" in r else "—"
        rules = ", ".join(f"{k} {v}" for k, v in sorted(r.get("early_rules", {}).items())) or "—"
        lines.append(f"| {r['method']} | {r.get('verifier', '—')} | {r['temperature']:g} | {r['k']} | "
                     f"{r['pass_at_1']:.3f} | {orc} | "
                     f"{r['modeled_mj_per_problem']:.2f} | "
                     f"{r['modeled_mj_per_problem'] / base:.2f}× | {r['measured_ms_per_problem']:.1f} | "
                     f"{r['decode_steps']:.2f} | {early} | {rules} |")
    gh = next(r for r in doc["accuracy"] if r["method"] == "plain greedy").get("hits")
    if gh:
        lines += ["", "## Against plain greedy on the same problems (paired)", "",
                  f"Per row: the problems it gets right and greedy does not (wins) and the reverse (losses); McNemar's "
                  f"exact two-sided p on those discordant problems; a paired bootstrap ({BOOTSTRAP} resamples of the "
                  f"{m['problems']} problems, seed 0) 95% interval of the pass@1 difference. Energy modeled.", "",
                  "| method | verifier | temperature | K | pass@1 | Δ vs greedy | wins / losses | McNemar p | "
                  "bootstrap 95% CI of Δ | × plain greedy energy |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in doc["accuracy"]:
            if r["method"] == "plain greedy" or "hits" not in r:
                continue
            st = paired(r["hits"], gh)
            lines.append(f"| {r['method']} | {r.get('verifier', '—')} | {r['temperature']:g} | {r['k']} | "
                         f"{r['pass_at_1']:.3f} | {st['diff']:+.3f} | {st['win']} / {st['loss']} | {st['p']:.2g} | "
                         f"[{st['lo']:+.3f}, {st['hi']:+.3f}] | {r['modeled_mj_per_problem'] / base:.2f}× |")
    lines += ["", "## K candidates as one batch vs K separate requests", "",
              "Same prompts, same seeds; per prompt and round the batched request and the K separate ones run back "
              "to back (interleaved), medians of measured wall time; modeled energy means. Decoding alone on both "
              "sides (the batched requests use the log-probability verifier: no verification pass). `arith-demo` on "
              "the first "
              "held-out problems (answers end by themselves); the larger model (seeded random weights) decodes a "
              "fixed number of tokens past end-of-text. Batch > 1 rows run ATen kernels, batch 1 the native one-row "
              "kernels.", "",
              "| model | new tokens | K | requests | batched ms (measured) | separate ms (measured) | time ratio | "
              "batched mJ (modeled) | separate mJ (modeled) | energy ratio | candidates equal to the separate run |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["batching"]:
        lines.append(f"| {r.get('model', 'arith-demo')} | {r.get('new_tokens', m['max_new'])} | {r['k']} | "
                     f"{r['requests']} | {r['batched_ms']:.2f} | {r['separate_ms']:.2f} | "
                     f"{r['time_ratio_batched_over_separate']:.2f} | {r['batched_modeled_mj']:.2f} | "
                     f"{r['separate_modeled_mj']:.2f} | {r['energy_ratio_batched_over_separate']:.2f} | "
                     f"{r['same_tokens_share']:.0%} |")
    lines += ["", "## Reading it", "", *reading(doc), "", "## Reproduce", "", "```bash", m["command"], "```", ""]
    return "\n".join(lines)


def verifier_lines(m: dict) -> list[str]:
    """The page's sentences on the self-verification scores (from the model's verifier entry)."""
    v = m.get("verifier")
    if not v:
        return ["Self-verification score: the log-probability of the candidate's tokens (the model ships no "
                "verifier).", ""]
    out = []
    if v.get("kind") == "rewrite":
        f = v["validation"]
        checks = v.get("checks") or [{"prompt": v["prompt"], "expect": "{candidate}"}]
        listed = "; ".join(f"`{c.get('expect', '{candidate}')}` after `{c['prompt']}`" for c in checks)
        out.append(f"Self-verification score, verifier `rewrite` (the model's declared verifier, `--verifier auto`): "
                   f"re-derivation under equivalent prompts — the prompt must match `{v['match']}`, and a "
                   f"candidate's score is the product over the checks ({listed}; `{{candidate}}` is the candidate's "
                   "text, each expected answer followed by end of text) of the probability the model gives the "
                   "expected answer after the check's prompt: one prefill per distinct check prompt and one batched "
                   "decode call per expected token but the last over all (candidate, check) rows; skipped when the "
                   "valid candidates all give one answer (its modeled energy is in every figure below). Selection "
                   f"multiplies it with the candidate's own probability. csvet's threshold on it, "
                   f"{v['threshold']:.3f}, was chosen on the {v['threshold_chosen_on']}. On that split its ROC AUC "
                   f"(right vs wrong candidates) is {f['auc']:.3f}; ranking the candidates by the product gives pass@1 "
                   f"{f['rewrite_best_pass_at_1']:.3f} vs greedy {f['greedy_pass_at_1']:.3f} (greedy on the swapped "
                   f"prompt {f['greedy_swapped_pass_at_1']:.3f}; oracle {f['oracle']:.3f}).")
        v = v.get("yes_no")
    if v:
        f = v["validation"]
        out.append(f"Verifier `yes-no` (`--verifier yesno`): the model's P(`{v['yes']}`) after `{v['template']}`, "
                   "read in one batched decode call over the valid candidates' cached rows; csvet's threshold P(yes) "
                   f"≥ {v['threshold']:.3f} (same validation split). On that split its ROC AUC is {f['auc']:.3f}; "
                   f"ranking the candidates by it gives pass@1 {f['verifier_best_pass_at_1']:.3f} vs greedy "
                   f"{f['greedy_pass_at_1']:.3f}.")
    out.append("Verifier `logprob`: the candidate's log-probability (no extra pass).")
    return [" ".join(out), ""]


def reading(doc: dict) -> list[str]:
    """Sentences computed from the numbers (never typed by hand)."""
    acc = {(r["method"], r["k"], r["temperature"]): r for r in doc["accuracy"]}
    g = acc[("plain greedy", 1, 0.0)]
    out = [f"- Plain greedy decoding: pass@1 {g['pass_at_1']:.3f} at {g['modeled_mj_per_problem']:.2f} mJ/problem "
           "(modeled)."]
    for t in doc["meta"]["temperatures"]:
        s = acc[("plain sampled", 1, t)]
        out.append(f"- One sample at temperature {t:g}: pass@1 {s['pass_at_1']:.3f}.")
    for t, k in [(t, k) for t in doc["meta"]["temperatures"] for k in doc["meta"]["ks"]]:
        b, mj, cs = acc[("best-of", k, t)], acc[("majority", k, t)], acc[("csvet", k, t)]
        out.append(f"- T={t:g}, K={k}: csvet {cs['pass_at_1']:.3f} at {cs['modeled_mj_per_problem']:.2f} mJ, best-of "
                   f"{b['pass_at_1']:.3f} at {b['modeled_mj_per_problem']:.2f} mJ, majority {mj['pass_at_1']:.3f} at "
                   f"{mj['modeled_mj_per_problem']:.2f} mJ (modeled); csvet vs plain greedy: "
                   f"{cs['pass_at_1'] - g['pass_at_1']:+.3f} pass@1 at "
                   f"{cs['modeled_mj_per_problem'] / g['modeled_mj_per_problem']:.2f}× the energy; csvet vs best-of: "
                   f"{cs['pass_at_1'] - b['pass_at_1']:+.3f} at "
                   f"{cs['modeled_mj_per_problem'] / b['modeled_mj_per_problem']:.2f}× the energy; "
                   f"{cs['stopped_early_share']:.1%} of csvet's candidates stopped early.")
    for t, k in [(t, k) for t in doc["meta"]["temperatures"] for k in doc["meta"]["ks"]]:
        if ("csvet + greedy anchor", k, t) not in acc:
            continue
        parts = []
        for m in ("csvet", "best-of", "majority"):
            a = acc[(m + " + greedy anchor", k, t)]
            parts.append(f"{m} {a['pass_at_1']:.3f} ({a['pass_at_1'] - g['pass_at_1']:+.3f} vs greedy, "
                         f"{a['modeled_mj_per_problem'] / g['modeled_mj_per_problem']:.2f}× its energy)")
        out.append(f"- With the greedy anchor (candidate 0 greedy), T={t:g}, K={k}: " + "; ".join(parts) + ".")
    for t, k in [(t, k) for t in doc["meta"]["temperatures"] for k in doc["meta"]["ks"]]:
        cs, one = acc[("csvet", k, t)], acc[("plain sampled", 1, t)]
        n = int(cs["modeled_mj_per_problem"] // one["modeled_mj_per_problem"])
        out.append(f"- Equal modeled energy, T={t:g}: one batched csvet request with K={k} costs "
                   f"{cs['modeled_mj_per_problem']:.2f} mJ; separate sampled requests at "
                   f"{one['modeled_mj_per_problem']:.2f} mJ each afford {n} sample(s) in that budget "
                   f"(pass@1 of one sample {one['pass_at_1']:.3f} vs csvet {cs['pass_at_1']:.3f}).")
    sel = [r for r in doc["accuracy"] if r["method"] in ("best-of", "majority", "csvet")]
    top = max(sel, key=lambda r: r["pass_at_1"])
    orc = max(sel, key=lambda r: r["pass_at_k_oracle"])
    beats = top["pass_at_1"] > g["pass_at_1"]
    auc = (doc["meta"].get("verifier") or {}).get("validation", {}).get("auc")
    why = ("" if beats else ": the self-verification score does not separate right from wrong candidates well "
           "enough" + (f" (its ROC AUC on the validation split is {auc:.3f})" if auc is not None else ""))
    for t, k in [(t, k) for t in doc["meta"]["temperatures"] for k in doc["meta"]["ks"]]:
        for m in ("csvet", "best-of"):
            rs = [(v, acc.get((m + " + greedy anchor" + SUFFIXES[v], k, t))) for v in SUFFIXES]
            if any(r is None for _, r in rs):
                continue
            out.append(f"- {m} + greedy anchor, T={t:g}, K={k}: " + "; ".join(
                f"{r['verifier']} verifier {r['pass_at_1']:.3f} at {r['modeled_mj_per_problem']:.2f} mJ" for _, r in rs)
                + f" (modeled); greedy {g['pass_at_1']:.3f}.")
    n_prob = doc["meta"]["problems"]
    if "hits" in g:
        for m in ("csvet", "best-of"):
            rs = [r for r in sel if r["method"] == m]
            if not rs:
                continue
            worst = min(rs, key=lambda r: r["pass_at_1"])
            st = paired(worst["hits"], g["hits"])
            ok = [r for r in rs if paired(r["hits"], g["hits"])["p"] < 0.05 and r["pass_at_1"] > g["pass_at_1"]]
            out.append(f"- {m} (the model's declared verifier, no anchor) beats greedy with McNemar p < 0.05 in "
                       f"{len(ok)} of {len(rs)} settings; its weakest setting, T={worst['temperature']:g}, "
                       f"K={worst['k']}: {worst['pass_at_1']:.3f} vs {g['pass_at_1']:.3f} ({st['win']} wins / "
                       f"{st['loss']} losses, p {st['p']:.2g}, 95% CI of Δ [{st['lo']:+.3f}, {st['hi']:+.3f}]) at "
                       f"{worst['modeled_mj_per_problem'] / g['modeled_mj_per_problem']:.2f}× greedy's modeled "
                       "energy.")
    out.append(f"- Against plain greedy decoding: the best selection result, {top['method']} at "
               f"T={top['temperature']:g}, K={top['k']}, pass@1 {top['pass_at_1']:.3f}, "
               f"{'beats' if beats else 'does not beat'} greedy's {g['pass_at_1']:.3f} "
               f"({top['pass_at_1'] - g['pass_at_1']:+.3f} = {round((top['pass_at_1'] - g['pass_at_1']) * n_prob):+d} "
               f"of {n_prob} problems, at {top['modeled_mj_per_problem'] / g['modeled_mj_per_problem']:.2f}× greedy's "
               f"modeled energy{_p_note(top, g)}); a right answer is among the "
               f"candidates in up to {orc['pass_at_k_oracle']:.3f} of the problems (oracle, T={orc['temperature']:g}, "
               f"K={orc['k']}){why}.")
    for r in doc["batching"]:
        out.append(f"- {r.get('model', 'arith-demo')}, K={r['k']} as one batch: "
                   f"{r['time_ratio_batched_over_separate']:.2f}× the measured time and "
                   f"{r['energy_ratio_batched_over_separate']:.2f}× the modeled energy of K separate requests.")
    return out


def _p_note(r: dict, g: dict) -> str:
    if "hits" not in r or "hits" not in g:
        return ""
    st = paired(r["hits"], g["hits"])
    return f"; McNemar p {st['p']:.2g}, 95% CI of Δ [{st['lo']:+.3f}, {st['hi']:+.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=400)
    ap.add_argument("--split", choices=("test", "validation"), default="test", help="which held-out problems (the "
                    "validation split is for choosing settings; the page reports the test split)")
    ap.add_argument("--ks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0])
    ap.add_argument("--max-new", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--soc", default="host")
    ap.add_argument("--strategy", default="rules")
    ap.add_argument("--speed-problems", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--speed-models", nargs="*", default=["llama-110m"])
    ap.add_argument("--speed-prompts", type=int, default=2)
    ap.add_argument("--speed-new", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--note", default="2-core VM shared with other build jobs (loaded): read ratios, not absolute "
                                      "times")
    ap.add_argument("--out", default="")
    ap.add_argument("--md", default="")
    ap.add_argument("--from-json", default="", help="write the Markdown page of an earlier --out file and exit")
    args = ap.parse_args()
    if args.from_json:
        page_from_json(args.from_json, args.md, render)
        return

    from hetforge.models.zoo import load_model
    from hetforge.runtime import Engine

    torch.set_num_threads(args.threads)
    loaded = load_model("arith-demo")
    rec = loaded.extra["training"]
    problems = [tuple(p) for p in rec[args.split]][: args.problems]
    engine = Engine(loaded, soc=args.soc, strategy=args.strategy)
    opts = [f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if k not in ("out", "md", "from_json", "note")]
    cmd = "python bench/selection.py " + " ".join(opts)
    doc = {"meta": {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {platform.node()}",
                    "torch": torch.__version__, "threads": args.threads, "note": args.note,
                    "problems": len(problems), "split": args.split, "parameters": rec["parameters"],
                    "verifier": loaded.extra.get("verifier"),
                    "greedy_at_training": rec["greedy_test_accuracy"], "soc": engine.soc_name,
                    "strategy": args.strategy, "max_new": args.max_new, "temperatures": args.temperatures,
                    "seed": args.seed, "ks": args.ks, "command": cmd + " --out docs/bench/select.json --md "
                                                                       "docs/bench/select.md"}}
    doc["accuracy"] = accuracy(args, engine, problems)
    doc["batching"] = batching(args, engine, [f"{a}+{b}=" for a, b in problems[: args.speed_problems]], args.max_new)
    for name in args.speed_models:  # a larger model (seeded random weights): the same comparison at its size
        big = Engine(load_model(name), soc=args.soc, strategy=args.strategy)
        doc["batching"] += batching(args, big, SPEED_PROMPTS[: args.speed_prompts], args.speed_new, ignore_eos=True)
    write_result(doc, args.out, args.md, render)


if __name__ == "__main__":
    main()
