"""``hetforge report MODEL --soc NAME -o report.html``: one self-contained HTML page that explains a compilation."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from hetforge.cli import options as opt
from hetforge.cli.common import app, console, emit_json, handles_errors
from hetforge.errors import HetforgeError, UsageError


def reproduce_commands(model: str, soc: str, strategy: str, objective: str, quantize: str, group_size: int,
                       seq: int, out: str) -> list[str]:
    """The commands that recompute what the report shows (same options), one per line."""
    q = [] if quantize == "none" else ["--quantize", quantize] + (["--group-size", str(group_size)]
                                                                  if quantize == "w4" else [])
    obj = [] if strategy == "support" else ["--objective", objective]
    base = [model, "--soc", soc]

    def cmd(*parts: str) -> str:
        return shlex.join(["hetforge", *parts])

    return [
        cmd("report", *base, "--strategy", strategy, *obj, *q, "--seq", str(seq), "-o", out),
        cmd("compile", *base, "--strategy", strategy, *obj, *q, "--seq", str(seq), "--json"),
        cmd("optimize", model, "--seq", str(seq), "--json"),
        cmd("explain", *base, "--strategy", strategy, *obj, "--seq", str(seq), "--node", "NODE"),
        cmd("pareto", *base, *obj, "--seq", str(seq)),
        cmd("hetero", *base, "--strategy", strategy, *obj, "--seq", str(seq), "--repeat", "1"),
    ]


@app.command()
@handles_errors
def report(
    model: str = typer.Argument(..., help="zoo name (see `hetforge models`) or a local Hugging Face folder"),
    soc: str = typer.Option(..., "--soc", help="SoC profile name or file (see `hetforge socs`)"),
    out: Path = typer.Option(..., "--out", "-o", help="the HTML file to write (e.g. report.html)"),
    strategy: opt.Strategy = opt.STRATEGY,
    objective: opt.Objective = opt.OBJECTIVE,
    quantize: opt.Quantize = opt.QUANTIZE,
    group_size: opt.GroupSize = opt.GROUP_SIZE,
    w8_act: opt.W8Act = None,
    w4_act: opt.W4Act = None,
    seq: opt.Seq = 16,
    run: bool = typer.Option(True, "--run/--no-run", help="run the partitioned program once on this host's "
                             "backends (measured time, fidelity, and the modeled device timeline)"),
    json_out: opt.Json = False,
) -> None:
    """Write one offline HTML page explaining how MODEL compiles for an SoC (passes, placement, front,
    roofline, memory, timeline); a stage that fails is named in the page and the exit code is 1."""
    from hetforge.files import check_output
    from hetforge.hardware import load_soc
    from hetforge.kernels import native
    from hetforge.placement import get_strategy
    from hetforge.placement.costs import check_objective
    from hetforge.report import compile_report_data, write_report

    native.set_w8_act(w8_act)
    native.set_w4_act(w4_act)
    check_output(out, "--out", (".html", ".htm"), example="report.html")  # before any work: nothing half-written
    if not 1 <= seq <= 4096:
        raise UsageError(f"--seq {seq} is outside 1..4096")
    get_strategy(strategy)
    check_objective(objective)
    if quantize != "none":
        from hetforge.quant import check_options

        check_options(quantize, group_size, ())
    prof = load_soc(soc)
    data, log = compile_report_data(model, prof, strategy, objective, quantize, group_size, seq, run=run)
    path = write_report(out, data, reproduce_commands(model, soc, strategy, objective, quantize, group_size, seq,
                                                      str(out)), "--out")
    size = path.stat().st_size
    fid = data.get("fidelity")
    summary = {"out": str(path), "bytes": size, "model": data["model"], "soc": prof.name, "strategy": strategy,
               "stages": data["stages"], "failure": data["failure"], "fidelity": fid}
    if json_out:
        emit_json(summary)
    else:
        console.print(f"report written to {path} ({size / 2**20:.2f} MiB); stages "
                      + ", ".join(f"{s['name']} {s['seconds']:.2f} s" for s in data["stages"]) + " (measured)",
                      highlight=False, soft_wrap=True)
    if data["failure"]:
        f = data["failure"]
        first = (f["error"].splitlines() or [""])[0]
        raise HetforgeError(f"stage '{f['stage']}' failed: {first} (the report at {path} says so too)")
    if fid is not None and not fid.get("passed", True):
        raise HetforgeError(f"outputs do not match eager: KL max {fid['kl_max']:.3g} > threshold "
                            f"{fid['kl_threshold']:g} (see the report at {path})")
