"""Several candidate answers to one prompt, decoded as one batch, then one chosen (runtime.select).

The prompt is prefilled once (the batch-1 prefill program); its K/V rows are copied into every row of a batch
KV cache, and the K candidates are decoded together by the batched decode program of the smallest batch tier
that holds them (``runtime.batched``). Each row has its own position, its own stop (end-of-text, token limit,
stop strings) and its own seeded ``torch.Generator`` (candidate ``i`` uses ``seed + i``); sampling goes through
Hugging Face's logits processors (repetition penalty, temperature, top-k, top-p) on the ``[rows, V]`` logits.
At temperature 0 every row is greedy (and equals the single-sequence run). With ``greedy_anchor`` candidate 0
is decoded greedily at any temperature (it equals the plain greedy run) and the others sample, so selection
chooses between the greedy answer and the samples.

After every step the CSVET policy may stop live candidates early (``select.early_stops``); when the live rows
fit a smaller batch tier, the cache is compacted and decoding goes on with the smaller (cheaper) program.

When decoding is over, the valid candidates are scored by the model's own verifier when it ships one
(``runtime.verify``: one batched pass through the same compiled programs) before one is chosen; the record names
the verifier used. When the valid candidates all give one answer the pass is skipped (it could only rank token
sequences of that same answer) and the record says so.

Energy is **modeled**: each placed call's modeled energy (the ledger's list-scheduled timeline for the SoC) is
shared among the candidates decoded in it (the prefill equally among all K; the verification pass among the
candidates it scored). Times are **measured** here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hetforge.runtime.batched import BatchKVCache, batch_tier
from hetforge.runtime.ledger import Ledger, Step, _step_figures
from hetforge.runtime.sampling import SamplingParams
from hetforge.runtime.select import Candidate, SelectParams, choose, early_stops, valid_candidates
from hetforge.runtime.verify import resolve, save_row, verify


@dataclass
class CandidatesResult:
    """One request decoded as K candidates: every candidate's record, the chosen one and why."""

    prompt_tokens: int
    mode: str
    candidates: list[Candidate]
    chosen: Candidate | None
    why: str
    steps: int  # batched decode calls
    batch_sizes: list[int]  # the batch tier of each decode call
    modeled_energy_mj: float | None  # prefill + every decode call (None: no placed programs, nothing modeled)
    modeled_budget_mj: float | None  # all K to the token limit at the first decode call's energy, plus the
    # verification pass at its longest (:func:`verify_budget`)
    measured_s: float  # the request's wall time, less programs compiled during it
    compile_s: dict[str, float] = field(default_factory=dict)
    placed: dict | None = None
    verifier: dict[str, Any] = field(default_factory=dict)  # which self-verification score was used, and its pass

    @property
    def text(self) -> str:
        return self.chosen.text if self.chosen is not None else ""

    @property
    def stopped_early(self) -> list[Candidate]:
        return [c for c in self.candidates if c.stopped_early is not None]

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "candidates_started": len(self.candidates),
                "candidates_stopped_early": len(self.stopped_early),
                "chosen": self.chosen.index if self.chosen is not None else None, "text": self.text,
                "answer": self.chosen.answer if self.chosen is not None else None, "why": self.why,
                "decode_steps": self.steps, "batch_sizes": self.batch_sizes,
                "modeled_energy_mj": self.modeled_energy_mj, "modeled_budget_mj": self.modeled_budget_mj,
                "measured_s": self.measured_s, "compile_s": self.compile_s, "verifier": self.verifier,
                "labels": {"modeled_*": "modeled (cost model of the SoC, list-scheduled timeline)",
                           "measured_*": "measured (this host)"},
                "candidates": [c.to_dict() for c in self.candidates], "placed": self.placed}


def processors(params: SamplingParams):
    """Hugging Face logits processors for ``params`` (empty when greedy without a repetition penalty)."""
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    out = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if not params.greedy:
        out.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k > 0:
            out.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            out.append(TopPLogitsWarper(params.top_p))
    return out


def _modeled_mj(placed) -> float | None:
    if placed is None or placed.last is None:
        return None
    return _step_figures(Step("decode", 0.0, placed.last, placed))["modeled_mj"]


def generate_candidates(engine, prompt: str | list[int], params: SamplingParams,
                        sel: SelectParams) -> CandidatesResult:
    """Decode ``sel.k`` candidates of ``prompt`` as one batch and choose one per ``sel.mode``."""
    ids = engine.encode(prompt)
    n = len(ids)
    tier, length, fit = engine.plan(n, params.max_new_tokens)
    progs = engine.programs
    compile_s: dict[str, float] = {}
    prefill, fresh = progs.prefill(tier)
    if fresh:
        compile_s[f"prefill-{tier}"] = prefill.total_s
    k = sel.k
    cands = [Candidate(i, params.seed + i, greedy=sel.greedy_anchor and i == 0) for i in range(k)]
    gens = [torch.Generator().manual_seed(c.seed) for c in cands]
    procs = processors(params)
    tok = engine.tokenizer
    eos = tok.eos_id
    vocab = engine.vocab_size
    ledger = Ledger(engine.soc_name)
    spec, vwhy = resolve(engine.loaded, tok, sel.verifier, prompt if isinstance(prompt, str) else tok.decode(ids))
    saved: dict[int, list[torch.Tensor]] = {}  # finished candidates' cache rows (for the verification pass)
    t_start = time.perf_counter()
    excluded = 0.0  # measured seconds spent compiling programs mid-request (not counted in measured_s)
    x = torch.zeros((1, tier), dtype=torch.long)
    x[0, :n] = torch.tensor(ids)
    out = prefill.run(x, torch.tensor([n - 1]))
    ledger.add("prefill", 0.0, prefill.placed)
    pre_mj = _modeled_mj(prefill.placed)
    spent = pre_mj or 0.0
    for c in cands:
        c.energy_mj = (pre_mj or 0.0) / k
    batch = batch_tier(k)
    cache = BatchKVCache.for_model(engine.loaded.model, length, batch)
    cache.fill_rows(out[1:], 0)
    rows: list[Candidate] = list(cands)  # the candidates sampled at this step (live ones), in order
    row_of = {c.index: i for i, c in enumerate(cands)}  # candidate → its row of the batch cache
    logits = out[0].reshape(1, -1)[:, :vocab].float().expand(k, -1)
    history = torch.tensor(ids, dtype=torch.long).unsqueeze(0).expand(k, -1)
    budget: float | None = None
    steps, batch_sizes = 0, []
    pos = n
    done: list[Candidate] = []
    while True:
        _sample(rows, logits, history, procs, gens, params)
        for c in rows:
            _check_stop(c, tok, eos, params, fit)
        for c in rows:
            if not c.live and spec is not None and spec.kind == "yes-no":
                saved[c.index] = save_row(cache, row_of[c.index])
        done += [c for c in rows if not c.live]
        live = [c for c in rows if c.live]
        if live and steps:
            frac = spent / budget if budget else steps / max(1, fit - 1)
            elapsed = time.perf_counter() - t_start
            for c, rule, why in early_stops(live, done, sel, frac, model_verifier=spec is not None):
                c.stop_reason = f"stopped early: {rule}"
                c.stopped_early = {"rule": rule, "why": why, "after_tokens": len(c.tokens), "step": steps,
                                   "modeled_mj_spent": spent if budget else None, "measured_s": elapsed}
                c.text = tok.decode([t for t in c.tokens if t != eos])
                done.append(c)
            live = [c for c in live if c.live]
        if not live:
            break
        keep = [rows.index(c) for c in live]  # history rows follow ``rows``
        history = torch.cat([history, torch.tensor([[c.tokens[-1]] for c in rows])], dim=1)[keep]
        new_batch = batch_tier(len(live))
        if new_batch < batch:  # fewer live rows: go on in a smaller batch program
            cache = cache.compact([row_of[c.index] for c in live], new_batch)
            row_of = {c.index: i for i, c in enumerate(live)}
            batch = new_batch
        rows_idx = [row_of[c.index] for c in live]
        t0 = time.perf_counter()
        dec, fresh = progs.decode_batch(length, batch)
        if fresh:
            excluded += time.perf_counter() - t0
            compile_s[f"decode-{length}x{batch}"] = dec.total_s
        ids_in = torch.zeros((batch, 1), dtype=torch.long)
        pos_in = torch.full((batch, 1), pos, dtype=torch.long)
        for c, r in zip(live, rows_idx, strict=True):
            ids_in[r, 0] = c.tokens[-1]
        t0 = time.perf_counter()
        out = dec.run(ids_in, pos_in, *cache.buffers)
        ledger.add("decode", t0 - t_start, dec.placed)
        cache.write_rows(out[1:], [pos] * batch)
        steps += 1
        batch_sizes.append(batch)
        mj = _modeled_mj(dec.placed)
        if mj is not None:
            spent += mj
            for c in live:
                c.energy_mj += mj / len(live)
            if budget is None:
                budget = (pre_mj or 0.0) + mj * max(1, fit - 1) + verify_budget(spec, tok, k, pre_mj or 0.0, mj, fit)
        logits = out[0][torch.tensor(rows_idx)][:, :vocab].float()
        rows = live
        pos += 1
    vinfo: dict[str, Any] = {"kind": "logprob", "why": vwhy}
    valid = valid_candidates(cands, sel)
    answers = {c.answer for c in valid}
    if spec is not None and len(answers) == 1:  # the verifier could only rank sequences of the same answer: skip it
        vinfo = {**spec.to_dict(), "why": vwhy, "pass": None,
                 "skipped": f"all {len(valid)} valid candidate(s) give one answer: nothing for the verifier to choose "
                            "between, no pass run"}
        spec = None
    elif spec is not None and valid:
        try:
            run = verify(engine, spec, valid, saved, n, eos, ledger, t_start, _modeled_mj)
        except ValueError as e:  # no room in the context for the suffix: the log-probability score instead
            vinfo = {"kind": "logprob", "why": f"log-probability (the verification pass does not fit: {e})"}
            spec = None
        else:
            spent += run["modeled_mj"] or 0.0
            excluded += run.pop("compile_wall_s")  # a program compiled mid-request is not in the measured time
            compile_s.update(run.pop("compile_s"))
            vinfo = {**spec.to_dict(), "why": vwhy, "pass": run}
    elif spec is not None:
        vinfo = {**spec.to_dict(), "why": vwhy, "pass": None}
    chosen, why = choose(cands, sel, spec.threshold if spec is not None else None)
    return CandidatesResult(n, sel.mode, cands, chosen, why, steps, batch_sizes,
                            spent if pre_mj is not None else None, budget, time.perf_counter() - t_start - excluded,
                            compile_s, ledger.summary(), vinfo)


def verify_budget(spec, tok, k: int, pre_mj: float, dec_mj: float, fit: int) -> float:
    """The verification pass at its longest, at the request's prefill and first decode call's modeled energy: a
    rewrite verifier prefills each check prompt (once, or per candidate when it holds the candidate) and feeds the
    longest expected answer (a candidate of ``fit`` tokens) through ``ceil(rows / 16)`` batched decode loops; a
    yes/no one feeds a cut-off candidate's last token and the suffix (one decode call each); none: 0."""
    if spec is None:
        return 0.0
    if spec.kind == "rewrite":
        from hetforge.runtime.batched import BATCH_TIERS

        f = {**dict(spec.groups), "candidate": "0" * fit}
        per_cand = sum("{candidate}" in p for p, _ in spec.checks)
        prefills = len(spec.checks) - per_cand + k * per_cand
        longest = max(len(tok.encode(e.format(**f))) + 1 for _, e in spec.checks)
        loops = -(-k * len(spec.checks) // BATCH_TIERS[-1])
        return pre_mj * prefills + dec_mj * max(0, longest - 1) * loops
    return dec_mj * (len(spec.suffix) + 1)


def _sample(rows: list[Candidate], logits: torch.Tensor, history: torch.Tensor, procs, gens, params) -> None:
    """Pick each row's next token (HF processors, then argmax or one draw from the row's generator); record the
    chosen token's log-probability and the distribution's entropy at temperature 1 (the model's own)."""
    logp = torch.log_softmax(logits, dim=-1)
    ent = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
    scores = procs(history, logits.clone()) if len(procs) else logits
    for b, c in enumerate(rows):
        if params.greedy or c.greedy:  # temperature, top-k and top-p keep the argmax: greedy over the warped scores
            t = int(torch.argmax(scores[b]))
        else:
            probs = torch.softmax(scores[b], dim=-1)
            if not bool(torch.isfinite(probs).all()):
                t = int(torch.argmax(scores[b]))  # overflow at a tiny temperature: its limit is greedy
            else:
                t = int(torch.multinomial(probs, 1, generator=gens[c.index]))
        c.tokens.append(t)
        c.logprobs.append(float(logp[b, t]))
        c.entropies.append(float(ent[b]))


def _check_stop(c: Candidate, tok, eos: int | None, params: SamplingParams, fit: int) -> None:
    """Per-row stop: end-of-text, the token limit, or a stop string (cut from the text)."""
    t = c.tokens[-1]
    body = c.tokens[:-1] if (eos is not None and t == eos and not params.ignore_eos) else c.tokens
    c.text = tok.decode(body)
    if len(body) < len(c.tokens):
        c.stop_reason = "eos"
    for s in params.stop:
        cut = c.text.find(s)
        if cut >= 0:
            c.text = c.text[:cut]
            c.stop_reason = f"stop string {s!r}"
            return
    if not c.stop_reason and len(c.tokens) >= fit:
        c.stop_reason = "length" if fit == params.max_new_tokens else "context full"

