r"""Self-verification: the model scores its own candidates with one more batched pass.

A model ships its verifier in ``verifier.json`` (read into ``LoadedModel.extra["verifier"]``); its ``kind`` says
which of two kinds it is:

* ``rewrite`` — *re-derivation under equivalent prompts*: a regex with named groups that the whole prompt must
  match (``match``) and a list of ``checks``, each a prompt template and an expected-answer template over those
  groups and ``{candidate}`` (arith-demo: ``^(?P<a>\d+)\+(?P<b>\d+)=$``; the candidate after the swapped sum
  ``{b}+{a}=``, and ``{a}`` after ``{candidate}-{b}=``). The score of a candidate is the product over the checks
  of the probability the model gives the expected answer, then end-of-text, after the check's prompt; selection
  multiplies it with the candidate's own probability (product of experts: the model must derive the answer
  again from prompts whose errors are partly independent). The pass (:func:`verify_rewrite`) prefills each
  distinct check prompt once (the batch-1 prefill program), copies its rows into a batch KV cache and feeds all
  (candidate, check) rows through the batched decode program (one call per expected token but the last). An
  older entry with one ``prompt`` is the single check ``prompt`` → ``{candidate}``.
* ``yes-no`` (no ``kind``: the older entry) — a suffix appended after the prompt and the candidate (arith-demo:
  ``"{prompt}{candidate}?"``), the token the model answers when the candidate is right (``yes``) and when it is
  wrong (``no``); the score is the model's P(yes) at the last suffix token. The candidates already sit in the
  KV cache: when a candidate finishes, its batch row is copied out (:func:`save_row`); afterwards the distinct
  valid candidates' rows go into one batch KV cache and the tokens not yet in it (a cut-off candidate's last
  token, then the suffix) are fed through the same batched decode program — one call per suffix token. A
  ``rewrite`` entry may carry a ``yes_no`` entry too (``--verifier yesno``).

Both kinds carry a ``threshold`` on the score chosen on a validation split by the script that made the entry
(csvet's filter; null: none). Every call of the pass is added to the request's ledger (kind ``verify``) and its
modeled energy to the request's, shared among the verified candidates; its time is in the request's measured time.

A model without a verifier entry, a prompt the rewrite regex does not match, or a yes/no entry whose words are
not single tokens falls back to the log-probability score (the sum of the candidate's token log-probabilities
from decoding: no extra pass), and the request's record says which verifier was used and why.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from hetforge.runtime.batched import BatchKVCache, batch_tier
from hetforge.runtime.ledger import Ledger, Step, _step_figures
from hetforge.runtime.programs import pick_tier
from hetforge.runtime.select import Candidate


@dataclass(frozen=True)
class VerifierSpec:
    """A model's verification template, resolved to token ids."""

    template: str
    suffix: list[int]
    yes: int
    no: int
    threshold: float | None
    source: str
    kind: str = "yes-no"  # or "rewrite"
    match: str = ""  # rewrite: the regex the whole prompt must match (named groups)
    rewrite: list[int] | None = None  # rewrite: the first check's prompt for this request, tokens (when fixed)
    checks: tuple[tuple[str, str], ...] = ()  # rewrite: (prompt, expected answer) templates
    groups: tuple[tuple[str, str], ...] = ()  # rewrite: this request's prompt's named groups

    @property
    def label(self) -> str:
        """What the score is, for records and reasons."""
        return "P(yes)" if self.kind == "yes-no" else "P(re-derivations)"

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "rewrite":
            return {"kind": "model", "verifier_kind": "rewrite", "match": self.match, "template": self.template,
                    "checks": [{"prompt": p, "expect": e} for p, e in self.checks],
                    "groups": dict(self.groups), "threshold": self.threshold, "source": self.source}
        return {"kind": "model", "verifier_kind": "yes-no", "template": self.template, "suffix_tokens": self.suffix,
                "yes_token": self.yes, "no_token": self.no, "threshold": self.threshold, "source": self.source}


def resolve(loaded, tokenizer, choice: str = "auto", prompt: str | None = None) -> tuple[VerifierSpec | None, str]:
    """The model's verifier (or None) and a line saying which verifier is used and why.

    ``choice``: ``auto`` (the model's declared verifier), ``yesno`` (its yes/no entry) or ``logprob``; ``prompt``:
    the request's prompt text (a ``rewrite`` verifier needs it; without it the rewrite is left unresolved)."""
    if choice == "logprob":
        return None, "log-probability (--verifier logprob)"
    entry = (getattr(loaded, "extra", None) or {}).get("verifier")
    if not entry:
        return None, f"log-probability (model '{loaded.name}' ships no verifier template)"
    kind = str(entry.get("kind", "yes-no"))
    if choice == "yesno" and kind != "yes-no":
        entry = entry.get("yes_no")
        if not entry:
            return None, f"log-probability (model '{loaded.name}' ships no yes/no verifier)"
        kind = "yes-no"
    thr = entry.get("threshold")
    source = str(entry.get("threshold_chosen_on", "the model's verifier entry"))
    if kind == "rewrite":
        pattern = str(entry.get("match", ""))
        checks = tuple((str(c["prompt"]), str(c.get("expect", "{candidate}"))) for c in entry.get("checks", [])) or (
            (str(entry.get("prompt", "")), "{candidate}"),)
        template = "; ".join(f"{p} -> {e}" for p, e in checks)
        thr_f = float(thr) if thr is not None else None
        if prompt is None:
            return VerifierSpec(template, [], -1, -1, thr_f, source, "rewrite", pattern, None, checks), \
                f"model re-derivation ({template})"
        m = re.fullmatch(pattern, prompt)
        if m is None:
            return None, (f"log-probability (the prompt does not match the model's rewrite verifier regex "
                          f"{pattern!r})")
        groups = {k: v for k, v in m.groupdict().items() if v is not None}
        try:
            first = [p.format(**groups, candidate="") for p, _ in checks]
            for _, e in checks:
                e.format(**groups, candidate="")
        except (KeyError, IndexError) as e:
            return None, f"log-probability (the model's rewrite checks {template!r} name a missing group {e})"
        spec = VerifierSpec(template, [], -1, -1, thr_f, source, "rewrite", pattern, tokenizer.encode(first[0]),
                            checks, tuple(groups.items()))
        return spec, (f"model re-derivation: the product of P(expected answer | prompt) over the checks "
                      f"{template} (groups {groups}) times the candidate's own probability")
    if kind != "yes-no":
        return None, f"log-probability (model '{loaded.name}': unknown verifier kind {kind!r})"
    suffix = tokenizer.encode(str(entry.get("suffix", "")))
    yes, no = tokenizer.encode(str(entry.get("yes", ""))), tokenizer.encode(str(entry.get("no", "")))
    if not suffix or len(yes) != 1 or len(no) != 1:
        return None, (f"log-probability (model '{loaded.name}': its verifier needs a non-empty suffix and yes/no "
                      f"words of one token each; got {len(suffix)}, {len(yes)}, {len(no)} tokens)")
    spec = VerifierSpec(str(entry.get("template", "{prompt}{candidate}" + str(entry["suffix"]))), suffix, yes[0],
                        no[0], float(thr) if thr is not None else None, source)
    return spec, f"model self-verification P({entry['yes']!r}) after {spec.template!r}"


def modeled_mj(placed) -> float | None:
    """Modeled mJ of a placed program's latest call (None when nothing is modeled)."""
    if placed is None or placed.last is None:
        return None
    return _step_figures(Step("verify", 0.0, placed.last, placed))["modeled_mj"]


class _Calls:
    """The program calls of one verify pass: each recorded in the request's ledger (``verify``), their modeled mJ
    summed (``mj`` stays None when no call has a modeled figure), then shared evenly by the candidates."""

    def __init__(self, ledger, t_start: float):
        self.ledger, self.t_start, self.calls, self.mj = ledger, t_start, 0, None

    def run(self, prog, *args):
        ts = time.perf_counter()
        out = prog.run(*args)
        self.ledger.add("verify", ts - self.t_start, prog.placed)
        self.calls += 1
        mj = modeled_mj(prog.placed)
        if mj is not None:
            self.mj = (self.mj or 0.0) + mj
        return out

    def share(self, cands: list[Candidate]) -> None:
        if self.mj is not None:
            for c in cands:
                c.energy_mj += self.mj / len(cands)


def save_row(cache: BatchKVCache, row: int) -> list[torch.Tensor]:
    """A copy of one batch row of the cache (``[1, Hkv, S, D]`` per buffer)."""
    return [buf[row:row + 1].clone() for buf in cache.buffers]


def pending_tokens(c: Candidate, eos: int | None, spec: VerifierSpec) -> list[int]:
    """The tokens still to feed after the cached ones: a candidate's row holds the prompt and all its tokens but
    the last sampled one (never fed); the body is its tokens less a final end-of-text."""
    body = c.tokens[:-1] if (c.stop_reason == "eos" and eos is not None and c.tokens and c.tokens[-1] == eos) \
        else c.tokens
    return body[len(c.tokens) - 1:] + spec.suffix


def verify(engine, spec: VerifierSpec, cands: list[Candidate], rows: dict[int, list[torch.Tensor]],
           n_prompt: int, eos: int | None, ledger, t_start: float, modeled_mj) -> dict[str, Any]:
    """Score ``cands`` (finished, valid) with one batched pass; set each one's ``verify_p``.

    ``rows`` maps a candidate index to its saved cache row. Returns what the pass did (calls, batch, cache
    length, modeled mJ, measured s less any compile, compile s, and the compile's wall time) for the record.
    A ``rewrite`` spec needs no saved rows (it scores the candidates after its own prompt)."""
    import time

    if spec.kind == "rewrite":
        return verify_rewrite(engine, spec, cands, ledger, t_start, modeled_mj)
    t0 = time.perf_counter()
    groups: dict[tuple[int, ...], list[Candidate]] = {}
    for c in cands:  # the same token sequence scores the same: one row for each distinct one
        groups.setdefault(tuple(c.tokens), []).append(c)
    reps = [m[0] for m in groups.values()]
    pend = [pending_tokens(c, eos, spec) for c in reps]
    pos0 = [n_prompt + len(c.tokens) - 1 for c in reps]  # first position not in the cache
    need = max(p + len(q) for p, q in zip(pos0, pend, strict=True))
    held = rows[reps[0].index][0].shape[2]
    progs = engine.programs
    length = next(t for t in progs.tiers if t >= max(need, held)) if need <= progs.tiers[-1] else None
    if length is None:
        raise ValueError(f"verification needs {need} positions; the model's context is {progs.tiers[-1]}")
    batch = batch_tier(len(reps))
    cache = BatchKVCache.for_model(engine.loaded.model, length, batch)
    for r, c in enumerate(reps):
        cache.write_row(r, rows[c.index], 0)
    compile_s: dict[str, float] = {}
    tc = time.perf_counter()
    dec, fresh = progs.decode_batch(length, batch)
    excluded = 0.0
    if fresh:  # compiled mid-request: not counted in the measured time
        compile_s[f"decode-{length}x{batch}"] = dec.total_s
        excluded += time.perf_counter() - tc
    steps = max(len(q) for q in pend)
    spent = _Calls(ledger, t_start)
    vocab = engine.vocab_size
    for j in range(steps):
        ids_in = torch.zeros((batch, 1), dtype=torch.long)
        pos_in = torch.zeros((batch, 1), dtype=torch.long)
        at = [0] * batch
        for r, (p, q) in enumerate(zip(pos0, pend, strict=True)):
            k = min(j, len(q) - 1)  # a row whose tokens are all fed repeats its last one (its result is unused)
            ids_in[r, 0], pos_in[r, 0], at[r] = q[k], p + k, p + k
        out = spent.run(dec, ids_in, pos_in, *cache.buffers)
        cache.write_rows(out[1:], at)
        probs = torch.softmax(out[0][:, :vocab].float(), dim=-1)
        for r, q in enumerate(pend):
            if len(q) - 1 == j:
                py, pn = float(probs[r, spec.yes]), float(probs[r, spec.no])
                for c in groups[tuple(reps[r].tokens)]:
                    c.verify_p, c.verify_p_no, c.verify_label = py, pn, spec.label
    spent.share(cands)
    return {"calls": steps, "batch": batch, "rows": len(reps), "cache_length": length, "modeled_mj": spent.mj,
            "measured_s": time.perf_counter() - t0 - excluded, "compile_s": compile_s, "compile_wall_s": excluded}


def verify_rewrite(engine, spec: VerifierSpec, cands: list[Candidate], ledger, t_start: float,
                   modeled_mj) -> dict[str, Any]:
    """Score ``cands`` by the product over the spec's checks of P(expected answer + end-of-text | check prompt),
    the templates filled with the request prompt's groups and the candidate's stripped text. Each distinct check
    prompt is prefilled once (the batch-1 prefill program; a prompt without ``{candidate}`` serves every
    candidate), its rows copied into a batch KV cache, and all (candidate, check) rows are fed together through
    the batched decode program, each at its own positions (one call per expected token but the last; rows in
    chunks of the largest batch tier). Sets each one's ``verify_p``; returns what :func:`verify` returns."""
    import time

    from hetforge.runtime.batched import BATCH_TIERS

    t0 = time.perf_counter()
    tok = engine.tokenizer
    eos = tok.eos_id
    groups_by_seq: dict[tuple[int, ...], list[Candidate]] = {}
    for c in cands:
        groups_by_seq.setdefault(tuple(c.tokens), []).append(c)
    reps = [m[0] for m in groups_by_seq.values()]
    fields = dict(spec.groups)
    rows: list[tuple[int, list[int], list[int]]] = []  # (candidate rep, prompt ids, expected ids)
    for r, c in enumerate(reps):
        for pt, et in spec.checks:
            f = {**fields, "candidate": c.text.strip()}
            rows.append((r, tok.encode(pt.format(**f)), tok.encode(et.format(**f)) + ([eos] if eos is not None
                                                                                      else [])))
    progs = engine.programs
    need = max(len(p) + max(len(e), 2) - 1 for _, p, e in rows)
    if need > progs.tiers[-1]:
        raise ValueError(f"verification needs {need} positions; the model's context is {progs.tiers[-1]}")
    compile_s: dict[str, float] = {}
    excluded, spent = 0.0, _Calls(ledger, t_start)
    vocab = engine.vocab_size
    logp = [0.0] * len(rows)
    cached: dict[tuple[int, ...], list[torch.Tensor]] = {}
    max_tier = 0
    for _, p, _e in rows:  # one prefill per distinct prompt: the first expected token's log-probability
        key = tuple(p)
        if key not in cached:
            tier = pick_tier(len(p), progs.tiers)
            max_tier = max(max_tier, tier)
            tc = time.perf_counter()
            prefill, fresh = progs.prefill(tier)
            if fresh:
                compile_s[f"prefill-{tier}"] = prefill.total_s
                excluded += time.perf_counter() - tc
            x = torch.zeros((1, tier), dtype=torch.long)
            x[0, :len(p)] = torch.tensor(p)
            out = spent.run(prefill, x, torch.tensor([len(p) - 1]))
            cached[key] = [torch.log_softmax(out[0].reshape(1, -1)[:, :vocab].float(), dim=-1)[0],
                           *[t.clone() for t in out[1:]]]
    for i, (_, p, e) in enumerate(rows):
        logp[i] = float(cached[tuple(p)][0][e[0]])
    length = next(t for t in progs.tiers if t >= max(need, max_tier))
    steps = max(len(e) for _, _, e in rows) - 1
    top = BATCH_TIERS[-1]
    batches = []
    for lo in range(0, len(rows), top) if steps > 0 else ():
        chunk = list(range(lo, min(lo + top, len(rows))))
        batch = batch_tier(len(chunk))
        batches.append(batch)
        cache = BatchKVCache.for_model(engine.loaded.model, length, batch)
        for b, i in enumerate(chunk):
            cache.write_row(b, cached[tuple(rows[i][1])][1:], 0)
        tc = time.perf_counter()
        dec, fresh = progs.decode_batch(length, batch)
        if fresh:
            compile_s[f"decode-{length}x{batch}"] = dec.total_s
            excluded += time.perf_counter() - tc
        for j in range(steps):
            ids_in = torch.zeros((batch, 1), dtype=torch.long)
            pos_in = torch.zeros((batch, 1), dtype=torch.long)
            at = [0] * batch
            for b, i in enumerate(chunk):
                _, p, e = rows[i]
                k = min(j, max(len(e) - 2, 0))  # a row whose tokens are all fed repeats its last (result unused)
                ids_in[b, 0], pos_in[b, 0], at[b] = e[k], len(p) + k, len(p) + k
            out = spent.run(dec, ids_in, pos_in, *cache.buffers)
            cache.write_rows(out[1:], at)
            lp = torch.log_softmax(out[0][:, :vocab].float(), dim=-1)
            for b, i in enumerate(chunk):
                e = rows[i][2]
                if j + 1 < len(e):
                    logp[i] += float(lp[b, e[j + 1]])
    score = [0.0] * len(reps)
    for i, (r, _, _) in enumerate(rows):
        score[r] += logp[i]
    for r, c in enumerate(reps):
        for m in groups_by_seq[tuple(c.tokens)]:
            m.verify_p, m.verify_p_no, m.verify_label = math.exp(score[r]), None, spec.label
    spent.share(cands)
    return {"calls": spent.calls, "batch": max(batches, default=1), "rows": len(rows), "cache_length": length,
            "prefills": len(cached), "modeled_mj": spent.mj,
            "measured_s": time.perf_counter() - t0 - excluded, "compile_s": compile_s, "compile_wall_s": excluded}


def score_texts(engine, spec: VerifierSpec, prompt: str, texts: list[str]) -> tuple[list[float], dict[str, Any]]:
    """The verifier's score of given answers to ``prompt`` (not decoded here; each followed by end-of-text).
    Yes/no: each ``prompt + text`` is prefilled by the prefill program, then all are verified in one batched pass
    as :func:`verify` does for decoded candidates; rewrite: :func:`verify_rewrite` on the texts.
    Returns the scores and the ledger summary (modeled/measured figures of every call)."""
    import time

    ids = engine.encode(prompt)
    eos = engine.tokenizer.eos_id
    ledger = Ledger(engine.soc_name)
    t_start = time.perf_counter()
    if spec.kind == "rewrite":
        spec, why = resolve(engine.loaded, engine.tokenizer, "auto", prompt)
        if spec is None:
            raise ValueError(why)
        cands = [Candidate(i, 0, tokens=[*engine.tokenizer.encode(t), *([eos] if eos is not None else [])], text=t,
                           stop_reason="eos" if eos is not None else "length") for i, t in enumerate(texts)]
        verify_rewrite(engine, spec, cands, ledger, t_start, modeled_mj)
        return [float(c.verify_p) for c in cands], ledger.summary() or {}
    cands, rows = [], {}
    for i, text in enumerate(texts):
        body = engine.tokenizer.encode(text)
        full = ids + body
        tier, _, _ = engine.plan(len(full), 1)
        prefill, _ = engine.programs.prefill(tier)
        x = torch.zeros((1, tier), dtype=torch.long)
        x[0, :len(full)] = torch.tensor(full)
        out = prefill.run(x, torch.tensor([len(full) - 1]))
        ledger.add("prefill", time.perf_counter() - t_start, prefill.placed)
        c = Candidate(i, 0, tokens=[*body, eos] if eos is not None else body, text=text,
                      stop_reason="eos" if eos is not None else "length")
        cands.append(c)
        rows[i] = [t.clone() for t in out[1:]]  # without an end-of-text the last body token is fed again (same K/V)
    verify(engine, spec, cands, rows, len(ids), eos, ledger, t_start, modeled_mj)
    return [float(c.verify_p) for c in cands], ledger.summary() or {}
