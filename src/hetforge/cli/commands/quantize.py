"""``hetforge quantize``: quantize a model's linears (w8 / w4 / w8a8) and show bytes, errors and fidelity."""

from __future__ import annotations

import time

import typer
from rich.table import Table

from hetforge.cli import options as opt
from hetforge.cli.common import app, console, emit_json, handles_errors

SCHEME_HELP = "w8 (int8 weights), w4 (group-wise int4 weights), w8a8 (int8 weights + dynamic int8 activations), none"


@app.command()
@handles_errors
def quantize(
    model: str = typer.Argument(..., help="zoo name (see `hetforge models`) or a local HF folder"),
    scheme: str = typer.Option("w8", "--scheme", help=SCHEME_HELP),
    group_size: opt.GroupSize = opt.GROUP_SIZE,
    w8_act: opt.W8Act = None,
    w4_act: opt.W4Act = None,
    skip: list[str] = typer.Option([], "--skip", help="keep layers whose module path matches in float "
                                   "(repeatable; 'lm_head', 'layers.0', globs like '*.mlp.*')"),
    w4_unfit: str = typer.Option("w8", "--w4-unfit", help="under w4, what a layer the int4 kernel cannot take "
                                 "(N not a multiple of 16, group size not dividing K) gets: w8 (int8 per channel) "
                                 "or float"),
    seq: opt.Seq = 16,
    show_report: bool = typer.Option(False, "--report", help="print the per-tensor table"),
    json_out: opt.Json = False,
) -> None:
    """Quantize every linear of a model and compare the quantized graph with the eager fp32 model."""
    from hetforge.cli.commands.frontend import capture_model
    from hetforge.kernels import native
    from hetforge.quant import check_options, quantize_graph
    from hetforge.verify import verify

    native.set_w8_act(w8_act)
    native.set_w4_act(w4_act)
    check_options(scheme, group_size, skip, w4_unfit)  # fail fast, before loading the model
    loaded, inputs, cg = capture_model(model, seq, "sdpa", False)
    t0 = time.perf_counter()
    res = quantize_graph(cg.gm, scheme, group_size=group_size, skip=tuple(skip), w4_unfit=w4_unfit)
    seconds = time.perf_counter() - t0
    fid = verify(loaded.logits_module(), res.gm, inputs, kl_threshold=float("inf"))
    rep = res.report
    out = {"model": loaded.name, "weights": loaded.weights, "seq": seq, "quantize_seconds_measured": seconds,
           "fidelity_vs_eager_measured": fid.to_dict(), **rep.to_dict()}
    if json_out:
        emit_json(out)
        return
    console.print(f"[bold]{loaded.name}[/] ({loaded.weights}) — {rep.summary_line()} "
                  f"in {seconds:.2f} s (measured)")
    if show_report and rep.entries:
        console.print(_table(rep))
    for e in rep.skipped:
        if not show_report:
            console.print(f"  kept in float: {e.path} ({e.reason})")
    for e in rep.quantized:
        if not show_report and e.scheme != rep.scheme:
            console.print(f"  {e.scheme} instead of {rep.scheme}: {e.path} ({e.reason})")
    for p in rep.unmatched_skip:
        console.print(f"  [yellow]note:[/] --skip '{p}' matched no linear layer")
    console.print(f"  fidelity vs eager fp32 (measured, [1,{seq}]): KL mean {fid.kl_mean:.3e}, "
                  f"KL max {fid.kl_max:.3e}, top-1 agreement {fid.top1_agree:.3f}, max |Δlogit| {fid.max_abs_err:.3e}")
    if loaded.weights.startswith("seeded random"):
        console.print("  (random weights: logits are nearly flat, so top-1 flips easily; judge quality on a "
                      "trained model such as `demo`)")


def _table(rep) -> Table:
    t = Table(title=f"per-tensor report ({rep.scheme}{f', group {rep.group_size}' if rep.group_size else ''})")
    for col in ("layer", "shape", "scheme", "KB before", "KB after", "rel. error", "note"):
        t.add_column(col, justify="right" if col.startswith(("KB", "rel")) else "left")
    for e in rep.entries:
        t.add_row(e.path, "×".join(map(str, e.shape)), e.scheme, f"{e.bytes_before / 1e3:.1f}",
                  f"{e.bytes_after / 1e3:.1f}", "" if e.rel_error is None else f"{e.rel_error:.2e}", e.reason)
    return t
