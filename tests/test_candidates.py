"""Batched multi-candidate decoding and candidate selection (issue 19, items 1–2).

Real compiled programs on tiny zoo models (placed path, host SoC, default strategy): batched greedy rows equal
single runs, rows at different positions equal their single runs, a compacted batch goes on exactly, CSVET stops
candidates early on cases built for each rule, and ``hetforge run --candidates`` answers bad input with exit 2.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands
from hetforge.errors import UsageError
from hetforge.models.zoo import load_model
from hetforge.runtime import Engine, SamplingParams
from hetforge.runtime.batched import BatchKVCache, batch_tier
from hetforge.runtime.candidates import generate_candidates
from hetforge.runtime.select import MAX_CANDIDATES, MODES, Candidate, SelectParams, choose, early_stops

_load_commands()


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    return {}


def _engine(engines: dict[str, Engine], name: str) -> Engine:
    if name not in engines:
        engines[name] = Engine(load_model(name))
    return engines[name]


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_batched_greedy_candidates_equal_the_single_run(engines, name):
    e = _engine(engines, name)
    params = SamplingParams(max_new_tokens=7, ignore_eos=True)
    single = e.generate("The quick brown fox", params)
    res = generate_candidates(e, "The quick brown fox", params, SelectParams(k=3, mode="best-of"))
    assert res.batch_sizes == [4] * 6  # 3 rows run in the batch-4 program, 6 decode calls
    for c in res.candidates:
        assert c.tokens == single.tokens
        assert c.stop_reason == "length"
    prog = e.programs.programs[("decode-x4", single.cache_length)]
    assert prog.placed is not None and "executor: 1 partition(s) on soc 'host'" in " ".join(prog.notes)


def test_batched_rows_at_different_positions_and_after_compaction_equal_single_runs(engines):
    """Two prompts of different lengths in one batch-4 cache (rows 1 and 3), decoded together at their own
    positions, then compacted to a batch-2 program mid-way: each row's greedy tokens equal its single run."""
    e = _engine(engines, "llama-tiny")
    prompts = ["Hello there, how are", "A much longer prompt than the other one is"]
    n_new = 6
    singles = [e.generate(p, SamplingParams(max_new_tokens=n_new, ignore_eos=True)).tokens for p in prompts]
    ids = [e.encode(p) for p in prompts]
    length = 64
    cache = BatchKVCache.for_model(e.loaded.model, length, 4)
    rows, toks, pos = [1, 3], [], []
    for b, x in zip(rows, ids, strict=True):
        prefill, _ = e.programs.prefill(64)
        inp = torch.zeros((1, 64), dtype=torch.long)
        inp[0, :len(x)] = torch.tensor(x)
        out = prefill.run(inp, torch.tensor([len(x) - 1]))
        cache.write_row(b, out[1:], 0)
        toks.append([int(out[0].argmax())])
        pos.append(len(x))
    assert pos[0] != pos[1]
    batch = 4
    for step in range(n_new - 1):
        if step == 2:  # compact rows 1 and 3 into a batch-2 cache and go on with the batch-2 program
            cache, rows, batch = cache.compact(rows, 2), [0, 1], 2
        dec, _ = e.programs.decode_batch(length, batch)
        ids_in = torch.zeros((batch, 1), dtype=torch.long)
        pos_in = torch.zeros((batch, 1), dtype=torch.long)
        for r, t, p in zip(rows, toks, pos, strict=True):
            ids_in[r, 0], pos_in[r, 0] = t[-1], p
        out = dec.run(ids_in, pos_in, *cache.buffers)
        write = [0] * batch
        for r, p in zip(rows, pos, strict=True):
            write[r] = p
        cache.write_rows(out[1:], write)
        for i, r in enumerate(rows):
            toks[i].append(int(out[0][r].argmax()))
            pos[i] += 1
    assert toks == singles


def test_sampled_candidates_are_seeded_per_row_and_reproducible(engines):
    e = _engine(engines, "arith-demo")
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=7)
    sel = SelectParams(k=6, mode="majority", match=r"\d+")
    a = generate_candidates(e, "37+45=", params, sel)
    b = generate_candidates(e, "37+45=", params, sel)
    assert [c.tokens for c in a.candidates] == [c.tokens for c in b.candidates]
    assert [c.seed for c in a.candidates] == list(range(7, 13))
    # candidate i samples like a single request seeded seed + i (HF processors + its own generator)
    for c in a.candidates[:3]:
        assert c.tokens == e.generate("37+45=", SamplingParams(max_new_tokens=5, temperature=1.0, seed=c.seed)).tokens


def test_greedy_anchor_row_equals_the_greedy_run_and_the_others_still_sample(engines):
    e = _engine(engines, "arith-demo")
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=7)
    greedy = e.generate("37+45=", SamplingParams(max_new_tokens=5)).tokens
    res = generate_candidates(e, "37+45=", params, SelectParams(k=4, mode="best-of", greedy_anchor=True))
    assert res.candidates[0].greedy and res.candidates[0].tokens == greedy
    plain = generate_candidates(e, "37+45=", params, SelectParams(k=4, mode="best-of"))
    for a, b in zip(res.candidates[1:], plain.candidates[1:], strict=True):
        assert not a.greedy and a.tokens == b.tokens  # rows 1.. draw exactly as without the anchor
    assert res.to_dict()["candidates"][0]["greedy"] is True


def test_candidate_energy_is_modeled_and_shared_out_exactly(engines):
    e = _engine(engines, "arith-demo")
    res = generate_candidates(e, "12+9=", SamplingParams(max_new_tokens=5, temperature=1.0),
                              SelectParams(k=4, mode="best-of"))
    assert res.modeled_energy_mj is not None and res.modeled_energy_mj > 0
    assert math.isclose(sum(c.energy_mj for c in res.candidates), res.modeled_energy_mj, rel_tol=1e-9)
    assert res.modeled_budget_mj >= res.modeled_energy_mj
    assert res.to_dict()["labels"]["modeled_*"].startswith("modeled")
    # the same 4 samples as 4 separate requests cost more than twice the batched request (modeled; decoding
    # alone on both sides: the batched request without the verification pass)
    dec = generate_candidates(e, "12+9=", SamplingParams(max_new_tokens=5, temperature=1.0),
                              SelectParams(k=4, mode="best-of", verifier="logprob"))
    assert [c.tokens for c in dec.candidates] == [c.tokens for c in res.candidates]
    separate = 0.0
    for c in res.candidates:
        r = e.generate("12+9=", SamplingParams(max_new_tokens=5, temperature=1.0, seed=c.seed))
        assert r.tokens == c.tokens
        pl = r.placed
        separate += pl["prefill"]["modeled_mj"] + (pl["decode_per_token"]["modeled_mj"] * pl["decode_tokens"]
                                                   if pl["decode_per_token"] else 0.0)
    assert dec.modeled_energy_mj < separate / 2


def test_csvet_stops_high_entropy_candidates_early(engines):
    """Random weights at temperature 1: every step's distribution is near uniform (entropy ≈ ln V ≫ 1.5 nats),
    so CSVET's entropy rule stops every candidate after ``min_tokens`` while best-of decodes to the limit."""
    e = _engine(engines, "gpt2-tiny")
    params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    cs = generate_candidates(e, "abc", params, SelectParams(k=4, mode="csvet"))
    bo = generate_candidates(e, "abc", params, SelectParams(k=4, mode="best-of"))
    assert len(cs.stopped_early) == 4 and all(c.stopped_early["rule"] == "entropy" for c in cs.candidates)
    assert all(c.stopped_early["after_tokens"] == 2 and c.stopped_early["modeled_mj_spent"] > 0 for c in cs.candidates)
    assert cs.chosen is None and "no candidate passed" in cs.why
    assert cs.steps == 1 and bo.steps == 11
    assert cs.modeled_energy_mj < bo.modeled_energy_mj / 3


def _cand(i: int, text: str, logprobs: list[float], stop: str = "eos", ent: float = 0.1) -> Candidate:
    c = Candidate(i, i, tokens=list(range(len(logprobs))), logprobs=logprobs, entropies=[ent] * len(logprobs))
    c.text, c.stop_reason = text, stop
    return c


def test_csvet_consensus_dominated_and_behind_leader_rules():
    sel = SelectParams(k=5, mode="csvet", match=r"\d+")
    done = [_cand(0, "82", [-0.1, -0.1]), _cand(1, "82", [-0.2, -0.1]), _cand(2, "82", [-0.1, -0.3])]
    live = [_cand(3, "8", [-0.1], stop=""), _cand(4, "9", [-0.05], stop="")]
    # 3 of 5 votes = 60%: under the threshold at no energy spent (90%), over it at 90% spent (54%)
    assert early_stops(live, done, sel, 0.0) == []
    stops = early_stops(live, done, sel, 0.9)
    assert {c.index for c, rule, _ in stops} == {3, 4} and {rule for _, rule, _ in stops} == {"consensus"}
    # dominated: a live candidate already less likely than a finished one
    low = _cand(5, "7", [-3.0], stop="")
    assert [(c.index, r) for c, r, _ in early_stops([low], done, sel, 0.0)] == [(5, "dominated")]
    # behind leader: the margin (4 nats) shrinks as energy is spent
    lead, far = _cand(6, "1", [-0.1], stop=""), _cand(7, "2", [-2.5], stop="")
    assert early_stops([lead, far], [], sel, 0.0) == []
    assert [(c.index, r) for c, r, _ in early_stops([lead, far], [], sel, 0.5)] == [(7, "behind leader")]
    # the other modes never stop early
    assert early_stops([lead, far], [], SelectParams(k=2, mode="best-of"), 1.0) == []


def test_selection_modes_choose_by_score_votes_and_probability_mass():
    cands = [_cand(0, "82", [-1.0, -0.5]), _cand(1, "82", [-1.1]), _cand(2, "83", [-0.2]), _cand(3, "x1", [-0.01]),
             _cand(4, "7", [-0.5], stop="length")]
    best, why = choose(cands, SelectParams(k=5, mode="best-of", match=r"\d+", require_stop=True))
    assert best.index == 2 and "best-of" in why
    assert cands[3].verdict.startswith("structural") and cands[4].verdict.startswith("structural: cut off")
    maj, why = choose(cands, SelectParams(k=5, mode="majority", match=r"\d+", require_stop=True))
    assert maj.index == 1 and "2 of 3" in why
    # csvet: mass of '82' = e^-1.5 + e^-1.1 = 0.56 < mass of '83' = e^-0.2 = 0.82
    cs, why = choose(cands, SelectParams(k=5, mode="csvet", match=r"\d+", require_stop=True))
    assert cs.index == 2 and "consensus answer '83'" in why
    # a sequence sampled several times is one sequence of the answer's mass: 3 × '83' (e^-0.5) < e^-0.2 + e^-0.3
    dup = [_cand(i, "83", [-0.5]) for i in range(3)] + [_cand(3, "82", [-0.2, 0.0]), _cand(4, "82", [-0.3])]
    assert choose(dup, SelectParams(k=5, mode="csvet"))[0].answer == "82"
    assert choose(dup, SelectParams(k=5, mode="majority"))[0].answer == "83"
    hot = [_cand(0, "82", [-0.1], ent=3.0), _cand(1, "83", [-2.0], ent=0.2)]
    assert choose(hot, SelectParams(k=2, mode="csvet"))[0].index == 1 and hot[0].verdict.startswith("entropy")


def test_structural_filter_regex_group_and_json_schema():
    sel = SelectParams(k=2, mode="best-of", match=r"answer: (\d+)")
    good, bad = _cand(0, "answer: 42", [-1.0]), _cand(1, "answer: 4x", [-0.1])
    assert choose([good, bad], sel)[0].answer == "42"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    sel = SelectParams(k=3, mode="best-of", schema=schema)
    cands = [_cand(0, '{"n": 3}', [-1.0]), _cand(1, '{"n": "3"}', [-0.1]), _cand(2, "{n: 3", [-0.1])]
    assert choose(cands, sel)[0].index == 0
    assert "schema" in cands[1].verdict and "not JSON" in cands[2].verdict


@pytest.mark.parametrize("kw,text", [
    ({"k": 0}, f"--candidates must be in 1..{MAX_CANDIDATES} (got 0)"),
    ({"k": MAX_CANDIDATES + 1}, f"(got {MAX_CANDIDATES + 1})"),
    ({"mode": "vote"}, f"allowed: {', '.join(MODES)}"),
    ({"match": "(("}, "not a valid regular expression"),
    ({"schema": {"type": 5}}, "not a valid JSON schema"),
    ({"max_entropy": 0.0}, "--max-entropy must be > 0"),
])
def test_select_params_refuse_bad_values(kw, text):
    with pytest.raises(UsageError, match=None) as e:
        SelectParams(**kw)
    assert text in str(e.value)


@pytest.mark.parametrize("args,text", [
    (["--candidates", "0"], "--candidates must be in 1..16 (got 0)"),
    (["--candidates", "-3"], "--candidates must be in 1..16 (got -3)"),
    (["--candidates", "17"], "--candidates must be in 1..16 (got 17)"),
    (["--candidates", "4", "--select", "vote"], "unknown --select 'vote'; allowed: csvet, best-of, majority"),
    (["--select", "vote"], "allowed: csvet, best-of, majority"),
    (["--candidates", "4", "--schema", "/nonexistent/s.json"], "does not exist"),
    (["--greedy-anchor"], "--greedy-anchor needs --candidates K with K >= 2"),
])
def test_run_candidates_bad_input_exits_2_with_one_line(args, text):
    r = CliRunner().invoke(app, ["run", "arith-demo", "-p", "1+2=", "--json", *args])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and text in lines[0], r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr


def test_run_candidates_json_record():
    r = CliRunner().invoke(app, ["run", "arith-demo", "-p", "37+45=", "-n", "5", "--candidates", "4",
                                 "--temperature", "1", "--select", "csvet", "--match", r"\d+", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["candidates_started"] == 4 and len(d["candidates"]) == 4 and d["mode"] == "csvet"
    assert d["chosen"] in range(4) and d["why"].startswith("csvet: consensus answer")
    assert d["answer"] == d["candidates"][d["chosen"]]["answer"] and d["modeled_energy_mj"] > 0
    for c in d["candidates"]:
        assert {"stop_reason", "stopped_early", "modeled_energy_mj", "verdict", "score_logprob"} <= set(c)


def test_batch_tiers():
    assert [batch_tier(n) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]


def test_batched_programs_are_refused_under_a_generation_plan(engines):
    """A generation plan holds batch-1 programs only: asking for a batch-4 decode program names that (exit 2)."""
    from hetforge.runtime.genplan import GenPlanError

    e = Engine(load_model("llama-tiny"))
    e.programs.fixed, e.programs.fixed_source = {("prefill", 32): {}, ("decode", 64): {}}, "gen.hfp"
    with pytest.raises(GenPlanError, match="holds batch-1 programs only"):
        e.programs.decode_batch(64, 4)
    assert issubclass(GenPlanError, UsageError)
