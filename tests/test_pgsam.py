"""PGSAM over abstract layer tables: Pareto front quality, momentum, reproducibility; the bench's baselines."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from hetforge.placement.pareto import Archive, dominates, non_dominated
from hetforge.placement.pgsam_search import pgsam_search, pick, simplex_weights
from hetforge.placement.stages import StagePlan, evaluate, exhaustive_front, stages_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from search_baselines import decode, front_quality, hypervolume, nsga2_search, random_table  # noqa: E402


def test_dominance_and_archive():
    assert dominates((1, 2, 3), (1, 2, 4)) and not dominates((1, 2, 3), (1, 2, 3))
    assert not dominates((0, 5, 0), (1, 1, 1)) and not dominates((1, 1, 1), (0, 5, 0))
    assert non_dominated([(1, 1), (0, 2), (2, 2), (1, 1)]) == [0, 1]
    a = Archive()
    assert a.offer("x", (1.0, 1.0)) and not a.offer("y", (2.0, 2.0))  # dominated: refused
    assert a.offer("z", (0.5, 0.5)) and list(a.items) == ["z"]  # dominates x: x evicted


def test_hypervolume_of_known_set():
    pts = np.array([[0.0, 1.0], [1.0, 0.0]])
    # normalized to [0,1], reference 1.1: two 1.1×0.1 strips overlapping in a 0.1×0.1 square
    assert hypervolume(pts, np.zeros(2), np.ones(2)) == pytest.approx(0.21)
    assert hypervolume(pts[:1], np.zeros(2), np.ones(2)) == pytest.approx(0.11)


def test_boundary_vector_assignment_is_contiguous():
    plan = StagePlan((2, 0, 1), (3, 3))
    a = plan.assignment(6)
    assert a == (2, 2, 2, 1, 1, 1)  # empty middle stage
    assert stages_of(a) == [(2, 0, 3), (1, 3, 6)]


@pytest.mark.parametrize("seed,cap", [(0, 1.0), (1, 1.0), (2, 0.6), (3, 0.5)])
def test_pgsam_matches_exhaustive_front_on_tiny_problems(seed, cap):
    table = random_table(6, 3, seed=seed, capacity_frac=cap)
    exact, _ = exhaustive_front(table)
    res = pgsam_search(table, seed=seed)
    got = res.archive.points()
    assert {tuple(p) for p in got} == {tuple(p) for p in exact.points()}
    for i, p in enumerate(got):  # non-dominated among themselves
        assert not any(dominates(q, p) for j, q in enumerate(got) if j != i)
    for key, (f, _) in res.archive.items.items():  # every archived plan is feasible and its f is right
        assert evaluate(table, key) == pytest.approx(f)


def test_capacity_makes_plans_infeasible():
    table = random_table(6, 3, seed=4, capacity_frac=0.45)
    assert evaluate(table, (0,) * 6) is None  # one device cannot hold every layer
    exact, _ = exhaustive_front(table)
    res = pgsam_search(table, seed=0, random_starts=0)  # must walk from an infeasible start to the feasible plans
    assert {tuple(p) for p in res.archive.points()} == {tuple(p) for p in exact.points()}
    assert all(evaluate(table, k) is not None for k in res.archive.items)
    none_fit = random_table(6, 3, seed=4, capacity_frac=0.4)
    assert len(exhaustive_front(none_fit)[0]) == 0 and len(pgsam_search(none_fit, seed=0).archive) == 0


def test_momentum_is_used_and_runs_are_reproducible():
    table = random_table(12, 3, seed=7)
    r1 = pgsam_search(table, seed=11)
    r2 = pgsam_search(table, seed=11)
    assert r1.trajectory == r2.trajectory and set(r1.archive.items) == set(r2.archive.items)
    assert r1.momentum_accepts > 0
    r0 = pgsam_search(table, seed=11, mu=0.0)
    assert r0.momentum_accepts == 0
    assert r0.trajectory != r1.trajectory  # same seed, momentum changes which moves are accepted


def test_pick_objectives():
    table = random_table(8, 3, seed=5)
    res = pgsam_search(table, seed=0)
    pts = res.archive.points()
    _, fe = pick(res.archive, "energy")
    _, fl = pick(res.archive, "latency")
    assert fe[0] == pytest.approx(pts[:, 0].min()) and fl[1] == pytest.approx(pts[:, 1].min())
    _, fb = pick(res.archive, "balanced")
    assert tuple(fb) in {tuple(p) for p in pts}


def test_simplex_weights_cover_the_simplex():
    ws = simplex_weights(3)
    assert len(ws) == 10 and all(abs(sum(w) - 1) < 0.01 for w in ws)


def test_nsga2_baseline_integer_encoding_and_equal_budget_against_the_exact_front():
    assert decode(np.array([2, 0, 1, 9, 4]), 8, 3) == StagePlan((1, 2, 0), (4, 8))  # ranks → order; cuts clipped
    assert decode(np.array([1, 1, 0, 3, 3]), 8, 3).order == (2, 0, 1)  # ties keep index order
    table = random_table(12, 3, seed=21)
    exact = exhaustive_front(table)[0].points()
    res = pgsam_search(table, seed=21)
    ns = nsga2_search(table, res.evaluations, seed=21)
    assert ns.evaluations == res.evaluations  # the same number of objective evaluations credited
    qp, qn = front_quality(res.archive.points(), exact), front_quality(ns.archive.points(), exact)
    for q in (qp, qn):  # both searches find most of the exact front (399 plans, ~1,700 evaluations)
        assert q["found_share"] >= 0.8 and q["hv_ratio"] >= 0.98


def test_front_quality_counts_found_and_dominated_points():
    exact = np.array([[1.0, 4.0, 0.0], [2.0, 2.0, 0.0], [4.0, 1.0, 0.0]])
    found = np.array([[1.0, 4.0, 0.0], [3.0, 2.0, 0.0]])  # one exact point, one dominated by (2, 2, 0): +50% f1
    q = front_quality(found, exact)
    assert q["found"] == 1 and q["found_share"] == pytest.approx(1 / 3) and q["dominated"] == 1
    assert q["worst_gap"] == pytest.approx([0.5, 0.0, 0.0])
    assert q["hv_ratio"] < 1.0
