"""Choosing one answer among several decoded candidates (QEIL v2's cascade), and when to stop candidates early.

Three modes (``hetforge run ... --candidates K --select MODE``):

* ``best-of`` — every candidate runs to its end; the structural filter drops malformed ones; the one the model
  scores highest (self-verification score, below) wins.
* ``majority`` — every candidate runs to its end; structural filter; the answer given by most candidates wins
  (ties: the higher summed score).
* ``csvet`` — the cascade with early termination: structural → entropy → self-verification → consensus, and
  candidates are stopped while decoding when the leader is confident enough for the energy already spent.

The filters, in cascade order:

1. **structural** — the user's rules: a regex the whole (stripped) text must match (``--match``; its first group,
   if any, is the answer, else the stripped text), a JSON schema the text must parse as and satisfy
   (``--schema``), and the stop rule (``--require-stop``: a candidate cut off by the token limit is dropped).
2. **entropy** — the mean token entropy (nats, of the model's own distribution at temperature 1) over a threshold
   (``--max-entropy``) drops the candidate: the model was guessing.
3. **self-verification** — the model scores its own candidate. With a model that ships a verifier
   (``runtime.verify``: arith-demo declares re-derivation — the candidate after the swapped sum ``{b}+{a}=``
   and ``{a}`` after ``{candidate}-{b}=`` — and also ships a ``Y``/``N`` entry after ``{prompt}{candidate}?``)
   the score — written P(yes) below; for a rewrite verifier the product of the checks' probabilities — comes
   from one batched pass over the valid candidates, and ``csvet`` drops candidates under
   the threshold the model's training chose on its validation split (when none reaches it, all are kept and the
   record says so). Without one (or with ``--verifier logprob``) the score is the log-probability the model
   gave the candidate's tokens while decoding (sum over tokens, at temperature 1: no extra pass) and nothing
   is dropped at this stage.
4. **consensus** — candidates are grouped by answer; a group weighs the probability mass the model gives that
   answer as far as the candidates show it (the sum of ``exp(log-probability)`` over the group's *distinct*
   token sequences), times, with a model verifier, each sequence's P(yes) (the model's prior on the answer
   times its own check of it); the heaviest group wins, and its best-verified member is returned.

``best-of`` ranks by the log-probability, plus log P(yes) when the model verifier is used (the candidate's
probability times the model's own check of it: a confident "no" sinks a likely candidate, an unsure verifier
leaves the model's ranking as it is); ``majority`` breaks vote ties by the groups' summed P(yes) (or
``exp(log-probability)``).

Early termination (``csvet`` only), checked after every decode step, with ``f`` = the share of the modeled
energy budget spent so far (budget: the prefill plus all K candidates decoded to the token limit at the first
step's modeled energy, plus the verification pass at its longest; when no energy is modeled, the share of
the token limit):

* a live candidate whose running mean entropy is over the threshold (after ``min_tokens``) stops (``entropy``);
* a live candidate whose log-probability so far is below a finished valid candidate's whole score stops
  (``dominated``: its score can only fall, so it can never win the self-verification ranking) — only with the
  log-probability verifier: under a model verifier a lower log-probability does not mean a lower P(yes);
* a live candidate more than ``margin·(1 − f)`` nats behind the leader (the best score among live and finished
  candidates) stops (``behind leader``): the margin shrinks as energy is spent;
* all live candidates stop when the leading answer's share of the finished valid votes plus the live
  candidates reaches ``tau_hi − (tau_hi − tau_lo)·f`` (``consensus``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from hetforge.errors import UsageError

MODES = ("csvet", "best-of", "majority")
VERIFIERS = ("auto", "yesno", "logprob")  # auto: the model's declared verifier when it ships one, else the
# log-probability; yesno: the model's yes/no verifier entry (runtime.verify)
MAX_CANDIDATES = 16  # the largest batch tier of runtime.batched


@dataclass(frozen=True)
class SelectParams:
    """How many candidates, how one is chosen, and the cascade's knobs (validated: one-line UsageErrors)."""

    k: int = 4
    mode: str = "csvet"
    match: str | None = None  # regex over the stripped text (fullmatch); group 1 is the answer when present
    schema: dict | None = None  # JSON schema the text must satisfy
    require_stop: bool = False  # a candidate cut off by the token limit fails the structural filter
    max_entropy: float = 1.5  # nats per token
    min_tokens: int = 2  # the entropy rule waits for this many tokens
    margin: float = 4.0  # nats behind the leader at no energy spent
    tau_hi: float = 0.9  # consensus share needed at no energy spent
    tau_lo: float = 0.5  # ... and at the whole budget spent
    greedy_anchor: bool = False  # candidate 0 decodes greedily (the others sample): selection starts from greedy
    verifier: str = "auto"  # self-verification score: the model's verifier when it has one, or "logprob"

    def __post_init__(self) -> None:
        if not 1 <= self.k <= MAX_CANDIDATES:
            raise UsageError(f"--candidates must be in 1..{MAX_CANDIDATES} (got {self.k})")
        if self.mode not in MODES:
            raise UsageError(f"unknown --select '{self.mode}'; allowed: {', '.join(MODES)}")
        if self.verifier not in VERIFIERS:
            raise UsageError(f"unknown --verifier '{self.verifier}'; allowed: {', '.join(VERIFIERS)}")
        if self.match is not None:
            try:
                re.compile(self.match)
            except re.error as e:
                raise UsageError(f"--match '{self.match}' is not a valid regular expression: {e}") from None
        if self.schema is not None:
            from jsonschema import Draft202012Validator
            from jsonschema.exceptions import SchemaError

            try:
                Draft202012Validator.check_schema(self.schema)
            except SchemaError as e:
                raise UsageError(f"--schema is not a valid JSON schema: {e.message}") from None
        if not self.max_entropy > 0:
            raise UsageError(f"--max-entropy must be > 0 nats (got {self.max_entropy})")
        if not 0 < self.tau_lo <= self.tau_hi <= 1:
            raise UsageError(f"consensus thresholds must satisfy 0 < tau_lo <= tau_hi <= 1 (got {self.tau_lo}, "
                             f"{self.tau_hi})")
        if not self.margin > 0:
            raise UsageError(f"the leader margin must be > 0 nats (got {self.margin})")


@dataclass
class Candidate:
    """One decoded candidate and what happened to it."""

    index: int
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each chosen token, temperature 1
    entropies: list[float] = field(default_factory=list)  # of each step's distribution, temperature 1 (nats)
    text: str = ""
    stop_reason: str = ""  # eos, length, stop string '...', or "stopped early: <rule>"
    stopped_early: dict[str, Any] | None = None  # rule, why, after_tokens, step, modeled_mj_spent, measured_s
    energy_mj: float = 0.0  # modeled: its share of every step it was decoded in (prefill shared equally)
    greedy: bool = False  # decoded by argmax (the greedy anchor), not sampled
    answer: str | None = None
    verdict: str = ""  # "kept" or the filter that dropped it, with why
    verify_p: float | None = None  # the model verifier's P(yes) (None: not verified by the model)
    verify_p_no: float | None = None  # ... and its P(no) (yes/no verifier only)
    verify_label: str = "P(yes)"  # what verify_p is: P(yes), or P(answer | rewritten prompt) (runtime.verify)

    @property
    def score(self) -> float:
        """Self-verification score: the model's log-probability of the candidate (sum over its tokens)."""
        return float(sum(self.logprobs))

    @property
    def rank(self) -> tuple[float, ...]:
        """The self-verification ranking key: (log verify_p + log-probability, log-probability) when model-verified
        (P(yes), or the probability after the rewritten prompt: a product of experts), else (log-probability,)."""
        if self.verify_p is None:
            return (self.score,)
        return (math.log(max(self.verify_p, 1e-30)) + self.score, self.score)

    @property
    def mean_entropy(self) -> float:
        return float(sum(self.entropies) / len(self.entropies)) if self.entropies else 0.0

    @property
    def live(self) -> bool:
        return not self.stop_reason

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "seed": self.seed, "greedy": self.greedy, "text": self.text,
                "tokens": self.tokens,
                "stop_reason": self.stop_reason, "stopped_early": self.stopped_early,
                "score_logprob": round(self.score, 4), "mean_entropy_nats": round(self.mean_entropy, 4),
                "verify_p": None if self.verify_p is None else round(self.verify_p, 5),
                "verify_label": self.verify_label if self.verify_p is not None else None,
                "verify_p_yes": None if self.verify_p is None or self.verify_label != "P(yes)"
                else round(self.verify_p, 5),
                "verify_p_no": None if self.verify_p_no is None else round(self.verify_p_no, 5),
                "modeled_energy_mj": round(self.energy_mj, 5), "answer": self.answer, "verdict": self.verdict}


def structural(c: Candidate, sel: SelectParams) -> tuple[str | None, str]:
    """(answer, "") when ``c`` passes the structural rules, else (None, why)."""
    if sel.require_stop and c.stop_reason in ("length", "context full"):
        return None, f"structural: cut off by the token limit ({len(c.tokens)} tokens) without a stop"
    text = c.text.strip()
    answer = text
    if sel.match is not None:
        m = re.fullmatch(sel.match, text, flags=re.DOTALL)
        if m is None:
            return None, f"structural: {text[:40]!r} does not match --match {sel.match!r}"
        answer = m.group(1) if m.re.groups else text
    if sel.schema is not None:
        from jsonschema import Draft202012Validator

        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            return None, f"structural: not JSON ({e.msg} at {e.pos})"
        err = next(iter(Draft202012Validator(sel.schema).iter_errors(doc)), None)
        if err is not None:
            return None, f"structural: JSON does not satisfy the schema ({err.message})"
        answer = json.dumps(doc, sort_keys=True)
    return answer, ""


def entropy_ok(c: Candidate, sel: SelectParams) -> tuple[bool, str]:
    if c.mean_entropy > sel.max_entropy:
        return False, f"entropy: mean token entropy {c.mean_entropy:.2f} nats > {sel.max_entropy:g}"
    return True, ""


def _valid(done: list[Candidate], sel: SelectParams, use_entropy: bool) -> list[Candidate]:
    """Finished candidates that pass the cascade's filters (answers filled in, verdicts written)."""
    out = []
    for c in done:
        if c.stopped_early is not None:
            c.verdict = f"stopped early ({c.stopped_early['rule']})"
            continue
        ans, why = structural(c, sel)
        if ans is None:
            c.verdict = why
            continue
        c.answer = ans
        if use_entropy:
            ok, why = entropy_ok(c, sel)
            if not ok:
                c.verdict = why
                continue
        c.verdict = "kept"
        out.append(c)
    return out


def valid_candidates(cands: list[Candidate], sel: SelectParams) -> list[Candidate]:
    """The finished candidates that pass the structural (and, for csvet, entropy) filters of ``sel.mode``."""
    return _valid(cands, sel, use_entropy=sel.mode == "csvet")


def _scored(c: Candidate) -> str:
    if c.verify_p is not None:
        return f"{c.verify_label} {c.verify_p:.3g}, log-probability {c.score:.3f}"
    return f"log-probability {c.score:.3f}"


def choose(cands: list[Candidate], sel: SelectParams, threshold: float | None = None) -> tuple[Candidate | None, str]:
    """The chosen candidate (None when every candidate was dropped) and why, per ``sel.mode``.

    ``threshold``: the model verifier's P(yes) threshold for csvet's self-verification filter (None: no filter)."""
    valid = valid_candidates(cands, sel)
    if not valid:
        return None, f"no candidate passed the filters ({len(cands)} started)"
    n = len(valid)
    verified = all(c.verify_p is not None for c in valid)
    if sel.mode == "best-of":
        best = max(valid, key=lambda c: (*c.rank, -c.index))
        return best, (f"best-of: highest self-verification score ({_scored(best)}) among {n} valid "
                      f"candidate(s)")
    if sel.mode == "majority":
        groups = _groups(valid)
        ans, members = max(groups.items(), key=lambda kv: (len(kv[1]), sum(
            c.verify_p if verified else math.exp(c.score) for c in kv[1])))
        best = max(members, key=lambda c: (*c.rank, -c.index))
        return best, f"majority: answer {ans!r} given by {len(members)} of {n} valid candidate(s)"
    note = ""
    label = valid[0].verify_label if verified else ""
    if verified and threshold is not None:
        passed = [c for c in valid if c.verify_p >= threshold]
        for c in valid:
            if c.verify_p < threshold:
                c.verdict = f"self-verification: {label} {c.verify_p:.3g} < threshold {threshold:.3g}"
        if passed:
            note = f"; {len(passed)} of {n} reached the self-verification threshold {label} >= {threshold:.3g}"
            valid = passed
        else:
            for c in valid:
                c.verdict = "kept"
            note = f"; none reached the self-verification threshold {label} >= {threshold:.3g}, all kept"
    groups = _groups(valid)
    weights = {a: _mass(m) for a, m in groups.items()}
    ans = max(weights, key=lambda a: (weights[a], len(groups[a])))
    best = max(groups[ans], key=lambda c: (*c.rank, -c.index))
    total = sum(weights.values()) or 1.0
    what = f"probability mass × {label}" if verified else "probability mass"
    return best, (f"csvet: consensus answer {ans!r} ({len(groups[ans])} of {len(valid)} candidate(s), "
                  f"{weights[ans] / total:.0%} of their {what}){note}; passed structural, entropy "
                  f"(mean {best.mean_entropy:.2f} nats) and self-verification ({_scored(best)})")


def _groups(valid: list[Candidate]) -> dict[str, list[Candidate]]:
    groups: dict[str, list[Candidate]] = {}
    for c in valid:
        groups.setdefault(c.answer or "", []).append(c)
    return groups


def _mass(members: list[Candidate]) -> float:
    """The probability the model gives an answer, as far as the candidates show it: the sum of ``exp(score)``
    over the *distinct* token sequences giving it (a sequence sampled twice is one sequence, not twice the mass),
    each times its P(yes) when the model verified it."""
    seen: dict[tuple[int, ...], float] = {}
    for c in members:
        seen[tuple(c.tokens)] = math.exp(c.score) * (c.verify_p if c.verify_p is not None else 1.0)
    return sum(seen.values())


def early_stops(live: list[Candidate], done: list[Candidate], sel: SelectParams,
                spent: float, model_verifier: bool = False) -> list[tuple[Candidate, str, str]]:
    """CSVET's early terminations after a step: ``(candidate, rule, why)`` for each live candidate to stop.

    ``spent`` is the share (0..1) of the modeled energy budget spent so far; with ``model_verifier`` the
    ``dominated`` rule is off (a lower log-probability does not mean a lower P(yes))."""
    if sel.mode != "csvet" or not live:
        return []
    spent = min(max(spent, 0.0), 1.0)
    out: list[tuple[Candidate, str, str]] = []
    rest = []
    for c in live:
        if len(c.tokens) >= sel.min_tokens and c.mean_entropy > sel.max_entropy:
            out.append((c, "entropy", f"running mean entropy {c.mean_entropy:.2f} nats > {sel.max_entropy:g} "
                                      f"after {len(c.tokens)} tokens"))
        else:
            rest.append(c)
    finished = [c for c in done if c.stopped_early is None and structural(c, sel)[0] is not None
                and entropy_ok(c, sel)[0]]
    best_done = max((c.score for c in finished), default=-math.inf)
    leader = max([c.score for c in rest] + [best_done], default=-math.inf)
    margin = sel.margin * (1 - spent)
    keep = []
    for c in rest:
        if c.score < best_done and not model_verifier:
            out.append((c, "dominated", f"log-probability so far {c.score:.3f} < finished candidate's "
                                        f"{best_done:.3f}"))
        elif c.score < leader - margin:
            out.append((c, "behind leader", f"{leader - c.score:.2f} nats behind the leader > margin "
                                            f"{margin:.2f} at {spent:.0%} of the modeled energy budget"))
        else:
            keep.append(c)
    if finished and keep:
        votes: dict[str, int] = {}
        for c in finished:
            a = structural(c, sel)[0] or ""
            votes[a] = votes.get(a, 0) + 1
        ans, v = max(votes.items(), key=lambda kv: kv[1])
        share = v / (len(finished) + len(keep))
        tau = sel.tau_hi - (sel.tau_hi - sel.tau_lo) * spent
        if share >= tau:
            why = (f"leader {ans!r} holds {v} of {len(finished) + len(keep)} finished-or-live votes "
                   f"({share:.0%}) >= threshold {tau:.0%} at {spent:.0%} of the modeled energy budget")
            out += [(c, "consensus", why) for c in keep]
    return out
