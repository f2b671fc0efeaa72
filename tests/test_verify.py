"""Self-verification by the model itself (issue 19, items 2 and 3): the shipped arith-demo declares a *rewrite*
verifier (re-derivation under the swapped sum ``b+a=``: the probability of the candidate's tokens there) and also
ships the ``Y``/``N`` check it was trained for (``a+b=c?``; ``--verifier yesno``); ``runtime.verify`` runs either
as one batched pass through the compiled programs.

Real model, real compiled and placed programs (host SoC): each pass gives the same score as a plain forward of
the Hugging Face module, is in the request's ledger and modeled energy; the rewrite verifier ranks the sum above
near misses and, on the validation split, makes best-of and csvet right more often than greedy decoding (the
yes/no one does neither); a model without a verifier falls back to the log-probability, saying so.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from typer.testing import CliRunner

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands
from hetforge.models.zoo import load_model
from hetforge.runtime import Engine, SamplingParams
from hetforge.runtime.candidates import generate_candidates
from hetforge.runtime.select import Candidate, SelectParams, choose
from hetforge.runtime.verify import resolve, score_texts

_SEL = {"match": r"\d+", "require_stop": True}

_load_commands()


@pytest.fixture(scope="module")
def arith() -> Engine:
    return Engine(load_model("arith-demo"))


def _plain_p_yes(engine: Engine, text: str) -> float:
    """P(yes) from a plain forward of the Hugging Face module over the whole template text (no hetforge)."""
    spec, _ = resolve(engine.loaded, engine.tokenizer, "yesno")
    ids = engine.tokenizer.encode(text) + spec.suffix
    with torch.no_grad():
        logits = engine.loaded.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    return float(torch.softmax(logits, -1)[spec.yes])


def _plain_p(engine: Engine, prompt: str, answer: str) -> float:
    """P(answer + end-of-text | prompt) from a plain forward of the Hugging Face module (no hetforge)."""
    ids, tokens = engine.tokenizer.encode(prompt), [*engine.tokenizer.encode(answer), engine.tokenizer.eos_id]
    with torch.no_grad():
        logp = torch.log_softmax(engine.loaded.model(input_ids=torch.tensor([ids + tokens])).logits[0].float(), -1)
    return math.exp(sum(float(logp[len(ids) - 1 + j, t]) for j, t in enumerate(tokens)))


def _plain_p_rewrite(engine: Engine, prompt: str, candidate: str) -> float:
    """The product over the model's declared checks of P(expected | check prompt), by plain forwards."""
    groups = re.fullmatch(engine.loaded.extra["verifier"]["match"], prompt).groupdict()
    out = 1.0
    for chk in engine.loaded.extra["verifier"]["checks"]:
        f = {**groups, "candidate": candidate}
        out *= _plain_p(engine, chk["prompt"].format(**f), chk.get("expect", "{candidate}").format(**f))
    return out


def test_arith_demo_ships_a_verifier_with_a_threshold_chosen_on_validation(arith):
    entry = arith.loaded.extra["verifier"]
    assert entry["kind"] == "rewrite" and entry["checks"] == [{"prompt": "{b}+{a}=", "expect": "{candidate}"},
                                                              {"prompt": "{candidate}-{b}=", "expect": "{a}"}]
    assert 0 < entry["threshold"] < 1 and entry["threshold_chosen_on"].startswith("validation split")
    yn = entry["yes_no"]
    assert yn["template"] == "{prompt}{candidate}?" and (yn["yes"], yn["no"]) == ("Y", "N")
    assert 0 < yn["threshold"] < 1 and yn["threshold_chosen_on"].startswith("validation split")
    rec = arith.loaded.extra["training"]
    test, val = {tuple(p) for p in rec["test"]}, {tuple(p) for p in rec["validation"]}
    assert len(test) == 400 and len(val) == entry["validation"]["problems"] and not test & val


def test_verify_pass_equals_a_plain_forward_of_the_template(arith):
    """Candidates finished by end-of-text and cut off by the token limit: the yes/no pass over cached rows gives
    the plain forward's P(yes), the rewrite pass the plain forward's product over the declared checks."""
    for max_new in (6, 2):  # "1+70=" → 2 digits and end-of-text: with 2 new tokens every candidate is cut off
        for verifier in ("yesno", "auto"):
            res = generate_candidates(arith, "1+70=", SamplingParams(max_new_tokens=max_new, temperature=1.0,
                                                                     seed=0), SelectParams(k=4, mode="best-of",
                                                                                           verifier=verifier))
            assert res.verifier["kind"] == "model" and len({c.text for c in res.candidates}) > 1
            assert res.verifier["verifier_kind"] == ("yes-no" if verifier == "yesno" else "rewrite")
            for c in res.candidates:
                assert c.verify_p is not None
                want = (_plain_p_yes(arith, "1+70=" + c.text) if verifier == "yesno"
                        else _plain_p_rewrite(arith, "1+70=", c.text))
                assert math.isclose(c.verify_p, want, abs_tol=1e-4)
            assert {c.stop_reason for c in res.candidates} == ({"length"} if max_new == 2 else {"eos"})


def test_verifier_is_skipped_when_every_candidate_gives_one_answer(arith):
    """Nothing to choose between: no pass, no verify calls in the ledger, and the record says why."""
    res = generate_candidates(arith, "37+45=", SamplingParams(max_new_tokens=5, temperature=1.0, seed=0),
                              SelectParams(k=4, mode="csvet"))
    assert {c.text for c in res.candidates} == {"82"}
    assert res.verifier["pass"] is None and "one answer" in res.verifier["skipped"]
    assert "verify" not in res.placed and all(c.verify_p is None for c in res.candidates)


HELD_OUT = 12


def _pairwise_wins(arith: Engine, wrong_of, choice: str = "yesno") -> tuple[int, int]:
    """On the first held-out test problems: in how many (right, wrong) pairs the runtime's verify pass gives the
    sum a higher score than each wrong answer ``wrong_of(a, b)`` lists."""
    problems = [tuple(p) for p in arith.loaded.extra["training"]["test"][:HELD_OUT]]
    spec, _ = resolve(arith.loaded, arith.tokenizer, choice)
    wins, total = 0, 0
    for a, b in problems:
        wrong = [w for w in wrong_of(a, b) if w != str(a + b)]
        scores, _ = score_texts(arith, spec, f"{a}+{b}=", [str(a + b), *wrong])
        wins += sum(scores[0] > w for w in scores[1:])
        total += len(wrong)
    return wins, total


def test_verifier_ranks_the_sum_above_answers_of_the_wrong_length_on_held_out_problems(arith):
    """What the shipped verifier did learn: an answer with a digit too many or too few (a digit appended, the
    last digit dropped) scores below the sum."""
    wins, total = _pairwise_wins(arith, lambda a, b: [str(a + b) + "9", str(a + b)[:-1] or "00"])
    assert wins / total >= 0.75, f"the sum ranked above the wrong-length answer in {wins} of {total} pairs"


def _near_misses(a: int, b: int) -> list[str]:
    return [str(w) for w in (a + b + 1, a + b - 1, a + b + 10, a + b - 10) if w >= 0]


def test_rewrite_verifier_ranks_the_sum_above_near_misses_on_held_out_problems(arith):
    """The declared verifier (re-derivation: the answer after b+a=, a after answer-b=) tells the sum from its near
    misses (±1, ±10)."""
    wins, total = _pairwise_wins(arith, _near_misses, "auto")
    assert wins / total >= 0.9, f"the sum ranked above a near miss in {wins} of {total} pairs"


# Strict xfail: a measured limit of the shipped yes/no verifier (AUC 0.532 on validation); it fails the suite once
# that verifier learns near misses, so the mark must then be removed. A user loses nothing to it: selection uses the
# declared rewrite verifier by default, and --verifier yesno is kept only for comparison.
@pytest.mark.xfail(strict=True, reason="known limit of arith-demo's yes/no verifier entry (--verifier yesno): on "
                   "near misses of the sum (±1, ±10) it is at chance (ROC AUC 0.532 on its validation split, see "
                   "verifier.json); the declared rewrite verifier is the one selection uses by default (the test "
                   "above); this test passes, and must then lose this mark, once the training script teaches the "
                   "yes/no check to tell them apart")
def test_yes_no_verifier_ranks_the_sum_above_near_misses_on_held_out_problems(arith):
    wins, total = _pairwise_wins(arith, _near_misses, "yesno")
    assert wins / total >= 0.9, f"the sum ranked above a near miss in {wins} of {total} pairs"


def _mcnemar_p(win: int, loss: int) -> float:
    n = win + loss
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(win, loss) + 1)) / 2 ** n) if n else 1.0


@pytest.fixture(scope="module")
def validation_greedy(arith) -> list[bool]:
    """Whether plain greedy decoding is right on each validation problem."""
    val = [tuple(p) for p in arith.loaded.extra["training"]["validation"]]
    return [arith.generate(f"{a}+{b}=", SamplingParams(max_new_tokens=6)).text.strip() == str(a + b) for a, b in val]


@pytest.mark.parametrize("mode", ["best-of", "csvet"])
def test_selection_with_the_declared_verifier_beats_greedy_on_the_validation_split(arith, validation_greedy, mode):
    """Issue 19 item 3, on the validation split (never trained on, never the bench's test split): K=4 candidates
    at temperature 0.6 chosen with the model's declared verifier are right on clearly more problems than plain
    greedy decoding (McNemar's exact p < 0.05 on the discordant problems, and +2 points at least)."""
    val = [tuple(p) for p in arith.loaded.extra["training"]["validation"]]
    win = loss = right = 0
    for i, ((a, b), g) in enumerate(zip(val, validation_greedy, strict=True)):
        res = generate_candidates(arith, f"{a}+{b}=", SamplingParams(max_new_tokens=6, temperature=0.6,
                                                                     seed=1000 * i), SelectParams(k=4, mode=mode,
                                                                                                  **_SEL))
        c = res.chosen is not None and res.chosen.text.strip() == str(a + b)
        right += c
        win, loss = win + (c and not g), loss + (g and not c)
    greedy_right, p = sum(validation_greedy), _mcnemar_p(win, loss)
    assert right - greedy_right >= 0.02 * len(val) and p < 0.05, (
        f"{mode}: {right} vs greedy {greedy_right} of {len(val)} ({win} wins / {loss} losses, McNemar p {p:.3g})")


def _expected_calls(res) -> int:
    """Verify calls a pass makes: yes/no, one per suffix token (one here); rewrite, one prefill per distinct check
    prompt and one batched decode call per expected token but the last (chunks of 16 rows: one here)."""
    v = res.verifier
    if v["verifier_kind"] == "yes-no":
        return 1
    longest = 0
    for c in res.candidates:
        if c.verify_p is None:
            continue
        for chk in v["checks"]:
            f = {**v["groups"], "candidate": c.text.strip()}
            longest = max(longest, len(chk["expect"].format(**f)) + 1)  # bytes + end-of-text
    return v["pass"]["prefills"] + longest - 1


@pytest.mark.parametrize("verifier", ["auto", "yesno"])
def test_verifier_pass_is_in_the_ledger_and_the_modeled_energy(arith, verifier):
    """The same request with and without the model verifier decodes the same tokens (best-of: no early stops);
    the difference in modeled energy is exactly the verify calls in the ledger (yes/no: one decode call for the
    one-token suffix; rewrite: a prefill per distinct check prompt and a decode call per expected token but the
    last)."""
    p = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)
    on = generate_candidates(arith, "47+38=", p, SelectParams(k=8, mode="best-of", verifier=verifier))
    off = generate_candidates(arith, "47+38=", p, SelectParams(k=8, mode="best-of", verifier="logprob"))
    assert [c.tokens for c in on.candidates] == [c.tokens for c in off.candidates]
    ver = on.placed["verify"]
    assert ver["calls"] == on.verifier["pass"]["calls"] == _expected_calls(on)
    assert ver["modeled_mj"] > 0
    assert math.isclose(on.modeled_energy_mj - off.modeled_energy_mj, ver["modeled_mj"], rel_tol=1e-9)
    assert math.isclose(sum(c.energy_mj for c in on.candidates), on.modeled_energy_mj, rel_tol=1e-9)
    assert "verify" not in off.placed and off.verifier["kind"] == "logprob"
    distinct = len({tuple(c.tokens) for c in on.candidates if c.verify_p is not None})
    assert on.verifier["pass"]["rows"] == distinct * (len(on.verifier["checks"]) if verifier == "auto" else 1)


def test_model_without_a_verifier_falls_back_to_the_log_probability():
    e = Engine(load_model("llama-tiny"))
    res = generate_candidates(e, "Hello", SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True),
                              SelectParams(k=4, mode="best-of"))
    assert res.verifier == {"kind": "logprob",
                            "why": "log-probability (model 'llama-tiny' ships no verifier template)"}
    assert all(c.verify_p is None for c in res.candidates) and "verify" not in res.placed
    assert res.chosen.score == max(c.score for c in res.candidates) and "log-probability" in res.why


def test_rewrite_entry_forms_and_a_template_naming_a_missing_group(arith):
    class Loaded:
        name = "m"
        extra = {"verifier": {"kind": "rewrite", "match": r"^(?P<a>\d+)\+(?P<b>\d+)=$", "prompt": "{b}+{a}="}}

    spec, why = resolve(Loaded(), arith.tokenizer, "auto", "12+7=")  # the older one-prompt form: one check
    assert spec.checks == (("{b}+{a}=", "{candidate}"),) and dict(spec.groups) == {"a": "12", "b": "7"}
    Loaded.extra = {"verifier": {"kind": "rewrite", "match": r"^(?P<a>\d+)\+(?P<b>\d+)=$",
                                 "checks": [{"prompt": "{c}+{a}="}]}}
    spec, why = resolve(Loaded(), arith.tokenizer, "auto", "12+7=")
    assert spec is None and "missing group" in why
    spec, why = resolve(Loaded(), arith.tokenizer, "yesno", "12+7=")
    assert spec is None and "no yes/no verifier" in why


def test_verifier_with_multi_token_yes_falls_back_with_the_reason(arith):
    class Loaded:
        name = "m"
        extra = {"verifier": {"suffix": "?", "yes": "YES", "no": "N"}}

    spec, why = resolve(Loaded(), arith.tokenizer)
    assert spec is None and "one token each" in why


def test_csvet_threshold_filter_and_best_of_rank_by_p_yes():
    def cand(i, text, lp, p):
        c = Candidate(i, i, tokens=[ord(ch) for ch in text] + [10], logprobs=[lp], entropies=[0.1], text=text,
                      stop_reason="eos")
        c.verify_p = p
        return c

    # the likelier answer (log-probability) fails the check; the other passes it
    cands = [cand(0, "81", -0.1, 0.2), cand(1, "82", -1.0, 0.9)]
    best, why = choose(cands, SelectParams(k=2, mode="best-of"))  # log 0.9 - 1.0 > log 0.2 - 0.1
    assert best.index == 1 and "P(yes) 0.9," in why
    cands[1].logprobs = [-2.0]  # now log 0.9 - 2.0 < log 0.2 - 0.1: the model's own probability wins
    assert choose(cands, SelectParams(k=2, mode="best-of"))[0].index == 0
    best, why = choose(cands, SelectParams(k=2, mode="csvet"), threshold=0.5)
    assert best.index == 1 and "1 of 2 reached" in why and cands[0].verdict.startswith("self-verification")
    # nobody passes: all kept, consensus on probability mass × P(yes)
    cands = [cand(0, "81", -0.1, 0.2), cand(1, "82", -2.0, 0.3)]
    best, why = choose(cands, SelectParams(k=2, mode="csvet"), threshold=0.5)
    assert best.index == 0 and "none reached" in why


def test_run_json_names_the_verifier_and_bad_verifier_exits_2():
    for verifier, kind in (("auto", "rewrite"), ("yesno", "yes-no")):
        r = CliRunner().invoke(app, ["run", "arith-demo", "-p", "1+70=", "-n", "6", "--candidates", "4",
                                     "--temperature", "1", "--select", "best-of", "--verifier", verifier, "--json"])
        assert r.exit_code == 0, r.output
        d = json.loads(r.stdout)
        assert d["verifier"]["verifier_kind"] == kind and d["verifier"]["pass"]["calls"] >= 1
        assert all(c["verify_p"] is not None for c in d["candidates"])
        assert all((c["verify_p_yes"] is not None) == (kind == "yes-no") for c in d["candidates"])
    r = CliRunner().invoke(app, ["run", "arith-demo", "-p", "1+2=", "--candidates", "2", "--verifier", "nope"])
    assert r.exit_code == 2 and "allowed: auto, yesno, logprob" in r.output


def test_rewrite_verifier_falls_back_when_the_prompt_does_not_match(arith):
    res = generate_candidates(arith, "12-5=", SamplingParams(max_new_tokens=4, temperature=1.0, seed=1),
                              SelectParams(k=4, mode="best-of"))
    assert res.verifier["kind"] == "logprob" and "does not match" in res.verifier["why"]
    assert all(c.verify_p is None for c in res.candidates)
