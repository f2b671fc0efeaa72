"""``hetforge optimize``: run the middle-end passes on a captured model and show what each one did."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from hetforge.cli import options as opt
from hetforge.cli.common import app, console, emit_json, handles_errors

_PASSES_HELP = "comma-separated passes to run, in order (default: all seven: cleanup,constant_fold,cse,moe," \
               "attention,op_fusion,norm_fusion)"


@app.command()
@handles_errors
def optimize(
    model: str = typer.Argument(..., help="zoo name (see `hetforge models`) or a local HF folder"),
    seq: opt.Seq = 16,
    attn: opt.Attn = opt.ATTN,
    passes: str | None = typer.Option(None, "--passes", help=_PASSES_HELP),
    dump_dir: Path | None = typer.Option(None, "--dump-dir", help="write the graph after each pass as text here"),
    verify_each: bool = typer.Option(False, "--verify-each", help="check numerics after every pass"),
    kl_threshold: float | None = typer.Option(None, "--kl-threshold", help="KL(eager ‖ optimized) allowed "
                                              "(default 1e-8, or 1e-2 with --quantize)"),
    quantize: opt.Quantize = opt.QUANTIZE,
    group_size: opt.GroupSize = opt.GROUP_SIZE,
    w8_act: opt.W8Act = None,
    w4_act: opt.W4Act = None,
    skip: list[str] = typer.Option([], "--skip", help="module path or glob kept in float (repeatable)"),
    quantize_report: bool = typer.Option(False, "--quantize-report", help="list every quantized tensor"),
    show: int = typer.Option(10, "--show", help="near-misses to list (0: none)"),
    json_out: opt.Json = False,
) -> None:
    """Capture a model, run the optimization passes, report rewrites/near-misses per pass and fidelity vs eager."""
    from hetforge.cli.commands.frontend import capture_model
    from hetforge.kernels import native
    from hetforge.passes import optimize as run_optimize
    from hetforge.passes import resolve_passes
    from hetforge.verify import check_kl_threshold, verify

    native.set_w8_act(w8_act)
    native.set_w4_act(w4_act)
    names = resolve_passes(passes)  # bad names fail before the model is built
    if quantize != "none":
        from hetforge.quant import check_options

        check_options(quantize, group_size, tuple(skip))
    if kl_threshold is None:
        kl_threshold = 1e-8 if quantize == "none" else 1e-2
    check_kl_threshold(kl_threshold)
    loaded, inputs, cg = capture_model(model, seq, attn, False)
    res = run_optimize(cg.gm, inputs, passes=names, verify_each=verify_each, dump_dir=dump_dir,
                       kl_threshold=1e-8)
    final_gm, quant = res.gm, None
    if quantize != "none":
        from hetforge.quant import quantize_graph

        quant = quantize_graph(res.gm, scheme=quantize, group_size=group_size, skip=tuple(skip))
        final_gm = quant.gm
    rep = verify(loaded.logits_module(), final_gm, inputs, kl_threshold=kl_threshold)
    misses = [{"pass": p.name, "kind": m.kind, "node": m.node, "reason": m.reason}
              for p in res.passes for m in p.near_misses]
    if json_out:
        emit_json({
            "model": loaded.name, "seq": seq, "attn": attn, "capture_seconds": cg.seconds,
            "passes_seconds": res.seconds, "nodes_before": res.nodes_before, "nodes_after": res.nodes_after,
            "passes": [p.to_dict() for p in res.passes], "fused": res.fused,
            "kl_mean": rep.kl_mean, "kl_max": rep.kl_max, "max_abs_err": rep.max_abs_err,
            "top1_agree": rep.top1_agree, "passed": rep.passed, "near_misses": misses, "dumped": res.dumped,
            "unknown_ops": res.unknown_ops,
            "quantize": quant.report.to_dict() if quant is not None else None,
        })
    else:
        _print_report(loaded.name, cg.seconds, res, rep, misses, show, verify_each)
        if quant is not None:
            _print_quant(quant.report, quantize_report)
    if not rep.passed:
        raise typer.Exit(1)


def _print_quant(report, full: bool) -> None:
    console.print("quantize : " + report.summary_line() + " (exact bytes)", highlight=False)
    if not full:
        return
    t = Table(title="quantized tensors (error: relative Frobenius error of the dequantized weight, measured)")
    for col in ("tensor", "scheme", "bytes before", "bytes after", "error / reason"):
        t.add_column(col, justify="left" if col in ("tensor", "scheme", "error / reason") else "right")
    for e in report.entries:
        err = f"{e.rel_error:.2e}" if e.rel_error is not None else e.reason
        t.add_row(e.path, e.scheme, str(e.bytes_before), str(e.bytes_after), err)
    console.print(t)


def _print_report(name, capture_s, res, rep, misses, show, verify_each) -> None:
    t = Table(title=f"{name}: {res.nodes_before} → {res.nodes_after} nodes; passes {res.seconds * 1e3:.0f} ms, "
              f"capture {capture_s:.2f} s (both measured)")
    for col in ("pass", "nodes", "rewrites", "near-misses", "ms"):
        t.add_column(col, justify="left" if col == "pass" else "right", no_wrap=True)
    if verify_each:
        t.add_column("KL vs prev", justify="right", no_wrap=True)
    for p in res.passes:
        row = [p.name, f"{p.nodes_before} → {p.nodes_after}", str(len(p.rewrites)), str(len(p.near_misses)),
               f"{p.seconds * 1e3:.1f}"]
        if verify_each:
            row.append(f"{p.fidelity['kl_max']:.2e}" if p.fidelity and "kl_max" in p.fidelity else "-")
        t.add_row(*row)
    console.print(t)
    if verify_each:
        console.print("KL vs prev: KL of each pass's output against the previous graph's (measured)")
    console.print("fused ops: " + ", ".join(f"{k} {v}" for k, v in res.fused.items()))
    if res.unknown_ops:
        console.print("ops unknown to the registry (passed through untouched): "
                      + ", ".join(f"{k} ×{v}" for k, v in res.unknown_ops.items()), highlight=False)
    for m in misses[:show]:
        console.print(escape(f"  near-miss [{m['pass']}] {m['node']}: {m['reason']}"), highlight=False)
    if len(misses) > show:
        console.print(f"  … {len(misses) - show} more near-misses (--show N or --json lists them)")
    status = "[green]PASS[/]" if rep.passed else "[red]FAIL[/]"
    console.print(f"optimized vs eager (measured): max_abs_err {rep.max_abs_err:.3e}, kl_mean {rep.kl_mean:.3e}, "
                  f"kl_max {rep.kl_max:.3e}, top1_agree {rep.top1_agree:.3f} (threshold KL ≤ {rep.kl_threshold:g}) "
                  f"{status}")
    for d in res.dumped[:1]:
        console.print(f"graphs written to {Path(d).parent}/ ({len(res.dumped)} files)")
