"""Self-verification: the model scores its own candidates with one more batched pass.

A model that was taught to check an answer ships a verifier entry (``verifier.json`` in its folder, read into
``LoadedModel.extra["verifier"]``): a suffix appended after the prompt and the candidate (arith-demo:
``"{prompt}{candidate}?"``), the token the model answers when the candidate is right (``yes``) and when it is
wrong (``no``), and a threshold on P(yes) chosen on a validation split by the script that trained it. The
verification score of a candidate is the model's P(yes) — the softmax over the whole vocabulary at the last
suffix token — after ``prompt + candidate + suffix``.

The pass is cheap because the candidates already sit in the KV cache: when a candidate finishes, its batch row
(prompt + the candidate's tokens fed so far) is copied out (:func:`save_row`); after decoding, the distinct
valid candidates' rows go into one batch KV cache and the tokens not yet in it (the last token of a candidate
cut off by the length limit, then the suffix) are fed through the same compiled, placed batched decode
program the candidates used — one call per suffix token (one for arith-demo), all candidates in one batch.
Each call is added to the request's ledger (kind ``verify``) and its modeled energy to the request's, shared
among the verified candidates; its time is in the request's measured time.

A model without a verifier entry (or one whose yes/no are not single tokens) falls back to the log-probability
score (the sum of the candidate's token log-probabilities from decoding: no extra pass), and the request's
record says which verifier was used and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hetforge.runtime.batched import BatchKVCache, batch_tier
from hetforge.runtime.ledger import Ledger, Step, _step_figures
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

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "model", "template": self.template, "suffix_tokens": self.suffix, "yes_token": self.yes,
                "no_token": self.no, "threshold": self.threshold, "source": self.source}


def resolve(loaded, tokenizer, choice: str = "auto") -> tuple[VerifierSpec | None, str]:
    """The model's verifier (or None) and a line saying which verifier is used and why."""
    if choice == "logprob":
        return None, "log-probability (--verifier logprob)"
    entry = (getattr(loaded, "extra", None) or {}).get("verifier")
    if not entry:
        return None, f"log-probability (model '{loaded.name}' ships no verifier template)"
    suffix = tokenizer.encode(str(entry.get("suffix", "")))
    yes, no = tokenizer.encode(str(entry.get("yes", ""))), tokenizer.encode(str(entry.get("no", "")))
    if not suffix or len(yes) != 1 or len(no) != 1:
        return None, (f"log-probability (model '{loaded.name}': its verifier needs a non-empty suffix and yes/no "
                      f"words of one token each; got {len(suffix)}, {len(yes)}, {len(no)} tokens)")
    thr = entry.get("threshold")
    spec = VerifierSpec(str(entry.get("template", "{prompt}{candidate}" + str(entry["suffix"]))), suffix, yes[0],
                        no[0], float(thr) if thr is not None else None,
                        str(entry.get("threshold_chosen_on", "the model's verifier entry")))
    return spec, f"model self-verification P({entry['yes']!r}) after {spec.template!r}"


def modeled_mj(placed) -> float | None:
    """Modeled mJ of a placed program's latest call (None when nothing is modeled)."""
    if placed is None or placed.last is None:
        return None
    return _step_figures(Step("verify", 0.0, placed.last, placed))["modeled_mj"]


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
    length, modeled mJ, measured s less any compile, compile s, and the compile's wall time) for the record."""
    import time

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
    mj_total, any_mj = 0.0, False
    vocab = engine.vocab_size
    for j in range(steps):
        ids_in = torch.zeros((batch, 1), dtype=torch.long)
        pos_in = torch.zeros((batch, 1), dtype=torch.long)
        at = [0] * batch
        for r, (p, q) in enumerate(zip(pos0, pend, strict=True)):
            k = min(j, len(q) - 1)  # a row whose tokens are all fed repeats its last one (its result is unused)
            ids_in[r, 0], pos_in[r, 0], at[r] = q[k], p + k, p + k
        ts = time.perf_counter()
        out = dec.run(ids_in, pos_in, *cache.buffers)
        ledger.add("verify", ts - t_start, dec.placed)
        mj = modeled_mj(dec.placed)
        if mj is not None:
            mj_total, any_mj = mj_total + mj, True
        cache.write_rows(out[1:], at)
        probs = torch.softmax(out[0][:, :vocab].float(), dim=-1)
        for r, q in enumerate(pend):
            if len(q) - 1 == j:
                py, pn = float(probs[r, spec.yes]), float(probs[r, spec.no])
                for c in groups[tuple(reps[r].tokens)]:
                    c.verify_p, c.verify_p_no = py, pn
    if any_mj:
        for c in cands:
            c.energy_mj += mj_total / len(cands)
    return {"calls": steps, "batch": batch, "rows": len(reps), "cache_length": length,
            "modeled_mj": mj_total if any_mj else None,
            "measured_s": time.perf_counter() - t0 - excluded, "compile_s": compile_s, "compile_wall_s": excluded}


def score_texts(engine, spec: VerifierSpec, prompt: str, texts: list[str]) -> tuple[list[float], dict[str, Any]]:
    """P(yes) of given answers to ``prompt`` (not decoded here): each ``prompt + text`` is prefilled by the
    prefill program, then all are verified in one batched pass as :func:`verify` does for decoded candidates.
    Returns the scores and the ledger summary (modeled/measured figures of every call)."""
    import time

    ids = engine.encode(prompt)
    eos = engine.tokenizer.eos_id
    ledger = Ledger(engine.soc_name)
    t_start = time.perf_counter()
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
