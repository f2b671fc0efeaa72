"""The data of a generation report: per-token measured host time and modeled SoC time/energy from the runtime's
ledger, and the compile-side sections of the decode program that produced the tokens."""

from __future__ import annotations

from typing import Any


def generation_report_data(engine: Any, result: Any, ledger: Any, prompt: str, strategy: str, objective: str,
                           quantize: str) -> dict[str, Any]:
    """Sections for ``hetforge run --report``: one row per generated token (measured host seconds; modeled SoC
    seconds and joules from that step's list schedule), and, from the last placed step, passes / placement /
    front / roofline / memory / schedule of its program."""
    from hetforge.report.collect import compile_sections, soc_summary

    prof = getattr(engine.executor, "soc_profile", None)
    data: dict[str, Any] = {"kind": "generation", "model": engine.loaded.name, "soc": engine.soc_name,
                            "devices": soc_summary(prof) if prof is not None else [],
                            "strategy": strategy, "objective": objective, "quantize": quantize,
                            "prompt": prompt, "text": result.text, "stop_reason": result.stop_reason,
                            "executor": result.executor, "stages": [], "failure": None}
    steps = list(ledger.steps) if ledger is not None else []
    measured = [result.ttft_s] + list(result.decode_s)
    tok = engine.tokenizer
    rows = []
    for i, t in enumerate(result.tokens):
        step = steps[i] if i < len(steps) else None
        tl = step.timeline if step is not None else None
        rows.append({"i": i, "token": int(t), "text": _piece(tok, t),
                     "step": step.kind if step is not None else ("prefill" if i == 0 else "decode"),
                     "measured_s": measured[i] if i < len(measured) else None,
                     "measured_call_s": step.report.wall_s if step is not None else None,
                     "modeled_s": tl.makespan_s if tl is not None else None,
                     "modeled_j": tl.energy_j if tl is not None else None,
                     "switches": tl.switches if tl is not None else None})
    data["tokens"] = rows
    data["generation"] = {k: v for k, v in result.to_dict().items() if k not in ("tokens", "placed")}
    data["placed"] = result.placed
    data["totals"] = _totals(result, rows)
    placed_steps = [s for s in steps if s.placed is not None]
    if placed_steps:
        last = next((s for s in reversed(placed_steps) if s.kind == "decode"), placed_steps[-1])
        res = last.placed.compiled
        data["program"] = {"label": f"the {last.kind} program (cache {getattr(res, 'name', '')})",
                           "instructions": len(res.program.instrs)}
        data.update(compile_sections(res, last.report, None, f"the last {last.kind} step"))
        data["bindings"] = {d: b.to_dict() for d, b in last.placed.exe.bindings.items()}
    return data


def _piece(tok: Any, t: int) -> str:
    try:
        return tok.decode([int(t)])
    except Exception:  # a byte-level piece that is not valid text alone
        return f"<{int(t)}>"


def _totals(result: Any, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [{"what": "time to first token", "value": result.ttft_s, "unit": "s", "figure": "measured"}]
    if result.decode_s:
        out.append({"what": "decode, mean per token", "value": sum(result.decode_s) / len(result.decode_s),
                    "unit": "s", "figure": "measured"})
    mod = [r for r in rows if r["modeled_s"] is not None]
    if mod:
        out += [{"what": f"all {len(mod)} steps on the SoC (sum of list-scheduled makespans)",
                 "value": sum(r["modeled_s"] for r in mod), "unit": "s", "figure": "modeled"},
                {"what": f"all {len(mod)} steps' energy on the SoC", "value": sum(r["modeled_j"] for r in mod),
                 "unit": "J", "figure": "modeled"}]
    out.append({"what": "energy on this host", "value": None, "unit": "J",
                "figure": "not measured (no power meter on this host)"})
    return out
