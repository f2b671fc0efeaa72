"""Residency decisions from the cost model: hot groups amortise the NPU's fixed cost, cold ones do not."""

from hetforge.hardware import load_soc
from hetforge.moe import choose_tiers
from hetforge.moe.residency import plan_residency, summarize

E, D, F = 8, 512, 1024


def _cal(shares):
    return {"model": "synthetic", "layers": [{"layer": 0, "experts": E, "top_k": 2, "share": shares}]}


SKEWED = _cal([0.45, 0.45] + [0.1 / 6] * 6)


def test_hot_group_goes_to_the_npu_and_cold_groups_stay_on_the_host():
    soc = load_soc("snapdragon-x-elite")
    plan = choose_tiers(SKEWED, 512, share=0.9, group_size=2)
    ch = plan_residency(soc, SKEWED, plan, D, F, 512)
    hot, cold = ch[0], ch[1:]
    assert sorted(hot.experts) == [0, 1] and hot.device == "npu" and "resident" in hot.reason
    assert hot.t_s["npu"] < min(hot.t_s["cpu"], hot.t_s["gpu"])
    assert all(c.device != "npu" and "NPU call costs" in c.reason for c in cold)
    # a decode step (one token) never amortises the NPU call
    dec = plan_residency(soc, SKEWED, choose_tiers(SKEWED, 1, share=0.9, group_size=2), D, F, 1)
    assert all(c.device != "npu" for c in dec)


def test_npu_budget_limits_residency_and_the_plan_is_never_slower_than_either_baseline():
    soc = load_soc("snapdragon-x-elite")
    plan = choose_tiers(SKEWED, 512, share=0.9, group_size=2)
    none = plan_residency(soc, SKEWED, plan, D, F, 512, npu_budget_bytes=0)
    assert all(c.device != "npu" for c in none) and "budget" in none[0].reason
    res = summarize(plan_residency(soc, SKEWED, plan, D, F, 512), 512)
    host = summarize(plan_residency(soc, SKEWED, plan, D, F, 512, force="host"), 512)
    npu = summarize(plan_residency(soc, SKEWED, plan, D, F, 512, force="npu"), 512)
    assert res["time_per_token_s"] <= min(host["time_per_token_s"], npu["time_per_token_s"])
    assert res["time_per_token_s"] < host["time_per_token_s"]  # the hot group's NPU saving is real
