"""``hetforge compile`` and ``hetforge run-graph``: the backend (lower, schedule, plan memory, execute)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from hetforge.cli import options as opt
from hetforge.cli.common import app, console, emit_json, handles_errors
from hetforge.errors import UsageError


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _compile(model: str, seq: int, soc: str, strategy: str, attn: str, passes: bool, mode: str, build: bool,
             objective: str = "energy", strict: bool = False, quantize: str = "none", group_size: int = 128,
             skip: tuple[str, ...] = ()):
    from hetforge.compile import compile_model
    from hetforge.executor import MODES
    from hetforge.placement import get_strategy
    from hetforge.runtime.programs import policy_capture

    get_strategy(strategy)  # unknown names fail before the model is built
    if mode not in MODES:
        raise UsageError(f"unknown --mode '{mode}'; allowed: {', '.join(MODES)}")
    from hetforge.placement import OBJECTIVES

    if objective not in OBJECTIVES:
        raise UsageError(f"unknown --objective '{objective}'; allowed: {', '.join(OBJECTIVES)}")
    if quantize != "none":
        from hetforge.quant import check_options

        check_options(quantize, group_size, skip)
    from hetforge.hardware import load_soc

    soc_p = load_soc(soc)
    options = {} if strategy == "support" else {"objective": objective, "strict": strict}
    return compile_model(model, seq=seq, soc=soc_p, strategy=strategy, attn=attn, passes=passes, mode=mode,
                         build=build, strategy_options=options, quantize=quantize, group_size=group_size,
                         quant_skip=skip, capture_with=policy_capture())


@app.command("compile")
@handles_errors
def compile_cmd(
    model: str = typer.Argument(..., help="zoo name (see `hetforge models`) or a local HF folder"),
    soc: opt.Soc = "host",
    seq: opt.Seq = 16,
    strategy: opt.Strategy = opt.STRATEGY,
    objective: opt.Objective = opt.OBJECTIVE,
    strict: bool = typer.Option(False, "--strict", help="any placement fallback is an error (exit 1)"),
    quantize: opt.Quantize = opt.QUANTIZE,
    group_size: opt.GroupSize = opt.GROUP_SIZE,
    w8_act: opt.W8Act = None,
    w4_act: opt.W4Act = None,
    skip: list[str] = typer.Option([], "--skip", help="module path or glob kept in float (repeatable)"),
    attn: opt.Attn = opt.ATTN,
    passes: opt.Passes = True,
    out: Path | None = typer.Option(None, "--out", help="write the program (JSON; weights referenced) here"),
    text: Path | None = typer.Option(None, "--text", help="write the program's text form here"),
    generate: bool = typer.Option(False, "--generate", help="compile the prefill/decode programs of text "
                                  "generation (with --tiers, --cache) into a plan for `hetforge run --plan`"),
    tiers: str = typer.Option("32,64,128", "--tiers", help="--generate: prompt tiers to compile, comma-separated"),
    cache: str = typer.Option("128,256", "--cache", help="--generate: KV cache lengths to compile"),
    json_out: opt.Json = False,
) -> None:
    """Compile a model: instructions per device, transfers, device switches, memory plan, seconds per stage."""
    from hetforge.kernels import native

    native.set_w8_act(w8_act)
    native.set_w4_act(w4_act)
    from hetforge.files import check_output

    if out is not None:
        check_output(out, "--out", example="plan.json")  # a bad path fails before any work
    if text is not None:
        check_output(text, "--text", example="program.txt")
    if generate:
        _compile_generation(model, soc, strategy, objective, quantize, group_size, tiers, cache, out, json_out)
        return
    res = _compile(model, seq, soc, strategy, attn, passes, "arena", build=False, objective=objective, strict=strict,
                   quantize=quantize, group_size=group_size, skip=tuple(skip))
    if out is not None:
        from hetforge.ir import save_program

        save_program(res.program, out, "--out")
    if text is not None:
        from hetforge.files import write_text

        write_text(text, res.program.text(), "--text")
    rep = res.report()
    rep["seq"] = seq
    rep["objective"] = objective if strategy != "support" else None
    q = res.extra.get("quantize")
    if q is not None:
        rep["quantize"] = {"scheme": quantize, "group_size": group_size, **_quant_totals(q)}
    s = rep["seconds"]
    rep["seconds"] = {"load": s.get("load", 0.0), "capture": s.get("capture", 0.0), "passes": s.get("passes", 0.0),
                      "stamp": s.get("stamp", 0.0), "place": s.get("place", 0.0), "lower": s["lower"],
                      "schedule": s["schedule"], "memory": s["memory"], "kernels": s["kernels"], "total": s["total"]}
    rep["capture"] = res.extra.get("capture_note") or "capture: the whole module exported"
    if out is not None:
        rep["out"] = str(out)
    if json_out:
        emit_json(rep)
        return
    _print(rep)


def _quant_totals(q) -> dict:
    """Weight bytes before/after quantization (exact, from the rewritten graph)."""
    return q.report.to_dict()["summary"]


def _print(rep: dict) -> None:
    console.print(f"[bold]{rep['model']}[/] on {rep['soc']} (strategy {rep['strategy']}, seq {rep['seq']}): "
                  f"{rep['instructions']} instructions")
    t = Table(title="per device")
    for c in ("device", "instructions", "naive bytes", "planned arena", "lower bound", "algorithm"):
        t.add_column(c, justify="left" if c in ("device", "algorithm") else "right")
    per = rep["memory"]["per_device"]
    for d, n in rep["instructions_by_device"].items():
        m = per.get(d, {})
        t.add_row(d, str(n), _mb(m.get("naive_bytes", 0)), _mb(m.get("planned_bytes", 0)),
                  _mb(m.get("lower_bound_bytes", 0)), m.get("algorithm", "-"))
    console.print(t)
    mem = rep["memory"]
    td = rep["transfers_detail"]
    ms = td["modeled_seconds"]
    console.print(f"  transfers : {rep['transfers']} ({td['zero_copy']} zero-copy, {_mb(td['bytes_moved'])} moved"
                  + (f", {ms * 1e3:.3f} ms modeled)" if ms is not None else ")"))
    sw = rep["switches"]
    console.print(f"  switches  : {sw['naive']} in graph order → {sw['scheduled']} scheduled")
    console.print(f"  capture   : {rep['capture'].removeprefix('capture: ')}")
    console.print(f"  memory    : naive {_mb(mem['naive_bytes'])} → planned {_mb(mem['planned_bytes'])} "
                  f"(lower bound {_mb(mem['lower_bound_bytes'])}; exact figures from the plan)")
    console.print("  seconds   : " + ", ".join(f"{k} {v:.3f}" for k, v in rep["seconds"].items()) + " (measured)")
    if rep.get("quantize"):
        q = rep["quantize"]
        console.print(f"  quantize  : {q['scheme']}: {q['quantized']} weights quantized, {q['skipped']} kept in float; "
                      f"graph constants {_mb(q['graph_bytes_before'])} → {_mb(q['graph_bytes_after'])}")
    if rep.get("out"):
        console.print(f"  program written to {rep['out']}")


@app.command("run-graph")
@handles_errors
def run_graph(
    model: str = typer.Argument(..., help="zoo name (see `hetforge models`) or a local HF folder"),
    soc: opt.Soc = "host",
    seq: opt.Seq = 16,
    strategy: opt.Strategy = opt.STRATEGY,
    objective: opt.Objective = opt.OBJECTIVE,
    quantize: opt.Quantize = opt.QUANTIZE,
    group_size: opt.GroupSize = opt.GROUP_SIZE,
    w8_act: opt.W8Act = None,
    w4_act: opt.W4Act = None,
    attn: opt.Attn = opt.ATTN,
    passes: opt.Passes = True,
    mode: str = typer.Option("arena", "--mode", help="arena: every result in its planned slice; fast: ops without "
                             "an out= kernel keep their own allocation"),
    kl_threshold: float | None = typer.Option(None, "--kl-threshold", help="KL(eager ‖ compiled) allowed "
                                              "(default 1e-8 at fp32, 1e-2 with --quantize)"),
    profile: int = typer.Option(0, "--profile", help="also time every instruction and list the N slowest ops"),
    json_out: opt.Json = False,
) -> None:
    """Compile a model, run the program once from its arenas, and compare with eager (measured)."""
    import time

    from hetforge.kernels import native

    native.set_w8_act(w8_act)
    native.set_w4_act(w4_act)

    import torch

    from hetforge.verify import compare_logits

    if profile < 0:
        raise UsageError("--profile must be >= 0")
    if kl_threshold is None:
        kl_threshold = 1e-8 if quantize == "none" else 1e-2
    from hetforge.verify import check_kl_threshold

    check_kl_threshold(kl_threshold)
    res = _compile(model, seq, soc, strategy, attn, passes, mode, build=True, objective=objective,
                   quantize=quantize, group_size=group_size)
    module, inputs, exe = res.extra["module"], res.example_inputs, res.executable
    with torch.no_grad():
        ref = module(*inputs)
        t0 = time.perf_counter()
        got = exe(*inputs)
        run_s = time.perf_counter() - t0
    rep = compare_logits(ref, got, kl_threshold=kl_threshold)
    d = {"model": res.name, "soc": rep_soc(res), "mode": mode, "seq": seq, "fidelity": rep.to_dict(),
         "run_seconds": run_s, "compile_seconds": res.seconds, "arena_bytes": exe.arena_bytes(),
         "labels": {"fidelity": "measured", "run_seconds": "measured (first call)", "compile_seconds": "measured"}}
    if profile:
        pr = exe.profile(*inputs, repeat=3)
        d["profile"] = {"total_seconds": pr.total_seconds, "by_op": dict(list(pr.by_op().items())[:profile]),
                        "label": "measured"}
    if json_out:
        emit_json(d)
    else:
        status = "[green]PASS[/]" if rep.passed else "[red]FAIL[/]"
        console.print(f"{res.name} compiled ({rep_soc(res)}, mode {mode}) vs eager (measured): max_abs_err "
                      f"{rep.max_abs_err:.3e}, kl_mean {rep.kl_mean:.3e}, kl_max {rep.kl_max:.3e}, top1_agree "
                      f"{rep.top1_agree:.3f} (threshold KL ≤ {kl_threshold:g}) {status}")
        console.print(f"  one run: {run_s * 1e3:.1f} ms (measured, first call); arenas "
                      + ", ".join(f"{k} {_mb(v)}" for k, v in exe.arena_bytes().items()))
        if profile:
            for op, s in d["profile"]["by_op"].items():
                console.print(f"  {op:45s} {s * 1e3:8.3f} ms (measured)")
    if not rep.passed:
        raise typer.Exit(1)


def rep_soc(res) -> str:
    return getattr(res.soc, "name", str(res.soc))


def _lengths(option: str, text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{option} must be comma-separated positive integers, got '{text}'") from None
    if not out or any(n <= 0 for n in out):
        raise UsageError(f"{option} must be comma-separated positive integers, got '{text}'")
    return out


def _compile_generation(model: str, soc: str, strategy: str, objective: str, quantize: str, group_size: int,
                        tiers: str, cache: str, out: Path | None, json_out: bool) -> None:
    """``compile --generate``: the prefill tiers and decode programs, placed, written as one plan."""
    from hetforge.cli.commands.run import make_engine
    from hetforge.runtime.genplan import save_genplan

    if out is None:
        raise UsageError("--generate writes a plan: give --out FILE")
    from hetforge.files import check_output

    check_output(out, "--out", example="plan.hfp")
    pre, dec = _lengths("--tiers", tiers), _lengths("--cache", cache)
    engine = make_engine(model, soc, "backend", quantize, group_size, strategy, objective)
    doc = save_genplan(engine, pre, dec, out)
    rep = {"model": doc["model"], "soc": doc["soc"], "strategy": strategy, "objective": objective,
           "quantize": quantize, "out": str(out),
           "programs": {k: {"instructions": len(v["instructions"]), "partitions": v["partitions"],
                            "devices": v["devices"]} for k, v in doc["programs"].items()}}
    if json_out:
        emit_json(rep)
        return
    console.print(f"[bold]{rep['model']}[/] on {rep['soc']} (strategy {strategy}): generation plan -> {out}")
    for k, v in rep["programs"].items():
        console.print(f"  {k}: {v['instructions']} instructions, {v['partitions']} partitions, {v['devices']}")
