"""bench/read_bandwidth.py's one-row products section: every decode kernel runs on its pool at each thread count,
and the page's ratios are the products' pooled bandwidth over β_read's (small pools here; the real run uses
pools of ≥ 8× the last-level cache)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_native import needs_cc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import read_bandwidth as rb  # noqa: E402

from hetforge.kernels import native  # noqa: E402


def test_pooled_bandwidth_is_bytes_over_the_sum_of_per_copy_best_times():
    # two copies of 1 GB: copy 0 best 0.5 s, copy 1 best 0.25 s -> 2 GB / 0.75 s
    assert rb._pooled_GBps(10**9, [0.5, 0.25]) == pytest.approx(2 / 0.75)


@needs_cc
def test_products_time_every_kernel_at_each_thread_count_and_the_page_shows_the_ratios():
    assert native.library() is not None
    small = [("hf_gemv_nk", [(64, 48)], "a"), ("hf_gemv_kn", [(48, 80)], "b"), ("hf_linear_act", [(48, 80)], "c"),
             ("hf_gated_mlp", [(32, 48), (32, 48), (48, 32)], "d")]
    pr = rb.products(2, [1, 2], small, factor=0, beta_buffers=2)
    assert set(pr["best_s"]) == set(pr["round_total_s"]) == {"beta_read", "0", "1", "2", "3"}
    for key in pr["best_s"]:
        for t in ("1", "2"):
            best, totals = pr["best_s"][key][t], pr["round_total_s"][key][t]
            assert len(best) == 2 and len(totals) == 2 and all(b > 0 for b in best)  # 2 copies, 2 rounds
            assert sum(best) <= min(totals)  # per copy the best call: no round's total is below their sum
    ps = rb.product_summary(pr)
    for t in ("1", "2"):
        beta = ps[t]["beta_read_GBps"]
        for i, row in enumerate(ps[t]["products"]):
            assert row["kernel"] == small[i][0]
            assert row["ratio_to_beta_read"] == pytest.approx(row["GBps"] / beta)
    lines = "\n".join(rb.product_lines({"products": pr}))
    assert "`hf_gated_mlp`" in lines and "÷ β_read" in lines and "2 threads" in lines
    assert rb.product_lines({}) == []  # a JSON from before the section existed renders without it
