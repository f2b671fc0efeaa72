"""The GEMM ops of the prefill-GEMM bound and the split of a per-op profile by them (no torch: the summary page
uses it too).

The bound (bench/prefill_gemm.py) counts the FLOPs of these ops only; a row's ``ops`` record (prefill_gemm's
``op_profile``: each instruction of one profiled call timed, summed by op) splits that call into the GEMM ops,
attention (whose products the bound leaves out) and everything else.
"""

from __future__ import annotations

GEMM_OPS = ("aten.linear.default", "aten.addmm.default", "aten.mm.default", "hetforge.linear_act.default",
            "hetforge.gated_mlp.default")
ATTENTION_OP = "hetforge.attention.default"


def op_split(row: dict, peak_gflops: float) -> dict | None:
    """A row's profiled call split by op (its ``ops`` record): ms and ÷ bound of the GEMM ops, attention and the
    rest, and the GEMM ops' rate (GFLOP/s and share of ``peak_gflops``); None without a record or a bound."""
    rec, bound = row.get("ops"), row.get("bound_ms", {}).get("fp32")
    if not rec or not bound:
        return None
    gemm = [a for a in rec["ops"] if a["op"] in GEMM_OPS]
    g_ms, g_fl = sum(a["ms"] for a in gemm), sum(a["gflop"] for a in gemm)
    att = sum(a["ms"] for a in rec["ops"] if a["op"] == ATTENTION_OP)
    rest = rec["total_ms"] - g_ms - att  # the other ops and the code between instructions
    rate = g_fl / g_ms * 1e3 if g_ms else 0.0
    return {"total_ms": rec["total_ms"], "gemm_ms": g_ms, "gemm_gflops": rate, "gemm_of_peak": rate / peak_gflops,
            "attention_ms": att, "rest_ms": rest, "gemm_over_bound": g_ms / bound, "attention_over_bound": att / bound,
            "rest_over_bound": rest / bound, "total_over_bound": rec["total_ms"] / bound}
