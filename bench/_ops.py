"""The split of a prefill's per-op profile into the bound's GEMM ops, attention and the rest (no torch: the summary
page uses it too).

A row's ``ops`` record (bench/prefill_gemm.py ``op_profile``: each instruction of one profiled call timed, summed by
op) carries FLOPs for the bound's GEMM ops only (``hetforge.ir.kernel_choice.ONEDNN_OPS``, the products the bound
counts), so an op with FLOPs in the record is a GEMM op; attention's products are left out of the bound.
"""

from __future__ import annotations

ATTENTION_OP = "hetforge.attention.default"


def op_split(row: dict, peak_gflops: float) -> dict | None:
    """A row's profiled call split by op (its ``ops`` record): ms and ÷ bound of the GEMM ops, attention and the
    rest, and the GEMM ops' rate (GFLOP/s and share of ``peak_gflops``); where the record has the GEMM ops hot
    (``hot_ms``, ``again_ms``), their hot time ÷ bound, hot rate (share of the peak) and program ÷ hot time; None
    without a record or a bound."""
    rec, bound = row.get("ops"), row.get("bound_ms", {}).get("fp32")
    if not rec or not bound:
        return None
    gemm = [a for a in rec["ops"] if a["gflop"] > 0]
    g_ms, g_fl = sum(a["ms"] for a in gemm), sum(a["gflop"] for a in gemm)
    att = sum(a["ms"] for a in rec["ops"] if a["op"] == ATTENTION_OP)
    rest = rec["total_ms"] - g_ms - att  # the other ops and the code between instructions
    rate = g_fl / g_ms * 1e3 if g_ms else 0.0
    out = {"total_ms": rec["total_ms"], "gemm_ms": g_ms, "gemm_gflops": rate, "gemm_of_peak": rate / peak_gflops,
           "attention_ms": att, "rest_ms": rest, "gemm_over_bound": g_ms / bound, "attention_over_bound": att / bound,
           "rest_over_bound": rest / bound, "total_over_bound": rec["total_ms"] / bound}
    if gemm and all("hot_ms" in a for a in gemm):  # the GEMM ops hot (each call again right after itself)
        hot, again = sum(a["hot_ms"] for a in gemm), sum(a["again_ms"] for a in gemm)
        out.update({"hot_ms": hot, "hot_of_peak": g_fl / hot * 1e3 / peak_gflops, "hot_over_bound": hot / bound,
                    "program_over_hot": again / hot})
    return out
