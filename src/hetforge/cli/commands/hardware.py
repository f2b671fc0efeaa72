"""``hetforge socs``, ``calibrate`` and ``profile``: hardware profiles and the cost model on the CLI."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hetforge.cli import options as opt
from hetforge.cli.common import app, console, emit_json, err_console, handles_errors
from hetforge.errors import UsageError


@app.command()
@handles_errors
def socs(json_out: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """List the SoC profiles (shipped files and the host) with their devices."""
    from hetforge.hardware import list_socs, load_soc

    profs = [load_soc(n) for n in list_socs()]
    if json_out:
        emit_json({"socs": [p.to_dict() for p in profs]})
        return
    t = Table(title="SoC profiles (figures from vendor sources or estimates; see `--json` for each source)")
    for col in ("soc", "device", "kind", "fp32 TFLOP/s", "fp16 TFLOP/s", "int8 TOP/s", "bandwidth GB/s",
                "TDP W (est.)", "static", "unsupported ops"):
        t.add_column(col)
    for p in profs:
        for i, d in enumerate(p.devices):
            def rate(k: str, d=d) -> str:
                return f"{d.peak_flops[k] / 1e12:.3g}" if k in d.peak_flops else "–"

            t.add_row(p.name if i == 0 else "", d.name, d.kind, rate("fp32"), rate("fp16"), rate("int8"),
                      f"{d.mem_bandwidth / 1e9:.4g}", f"{d.tdp_w:.3g}", "yes" if d.static_shapes else "no",
                      str(len(d.unsupported_ops)))
        if p.name == "host" and not p.calibrated:
            t.add_row("", "[yellow]uncalibrated default: run `hetforge calibrate`[/]", *[""] * 8)
    console.print(t)


@app.command()
@handles_errors
def calibrate(
    out: Path | None = typer.Option(None, "--out", help="profile file to write (default: the per-user host profile)"),
    quick: bool = typer.Option(False, "--quick", help="small sizes, a few seconds (for tests)"),
    threads: int | None = typer.Option(None, "--threads", help="torch threads to calibrate with (default: torch's)"),
    clock: str = typer.Option("wall", "--clock", help="wall, or thread (CPU time of the calling thread; needs "
                              "--threads 1; ignores time lost to other processes on a shared host)"),
    json_out: opt.Json = False,
) -> None:
    """Measure this host (GEMM per dtype, memory bandwidth, dispatch, per-op-group efficiency): the `host` profile."""
    from hetforge.hardware import host_profile_path, load_file, save_spec
    from hetforge.hardware.calibrate import host_spec, measure, n_steps

    path = out or host_profile_path()
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be ≥ 1, got {threads}")
    if clock not in ("wall", "thread"):
        raise UsageError(f"--clock must be 'wall' or 'thread', got '{clock}'")
    if clock == "thread" and threads != 1:
        raise UsageError("--clock thread needs --threads 1 (thread CPU time misses other threads' work)")
    if out is not None:
        import contextlib

        from hetforge.files import check_output

        with contextlib.suppress(OSError):  # the profile's folder is made if needed (a bad one is reported next)
            out.parent.mkdir(parents=True, exist_ok=True)
        check_output(out, "--out", example="host.json")  # before the minutes of measuring
    with Progress(TextColumn("[bold]calibrate[/] {task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True, disable=json_out) as prog:
        task = prog.add_task("starting", total=n_steps(quick))

        def tick(msg: str) -> None:
            prog.update(task, advance=1, description=msg)

        m = measure(quick=quick, tick=tick, threads=threads, clock=clock)
    spec = host_spec(m, quick)
    save_spec(spec, path)
    prof = load_file(path)
    d = prof.devices[0]
    rep = {"path": str(path), "seconds": m.seconds, "label": "measured", "quick": quick, "threads": m.threads,
           "clock": m.clock,
           "gemm_flops": {k: {str(n): v for n, v in r.items()} for k, r in m.gemm.items()},
           "bandwidth_copy": m.bw_copy, "bandwidth_triad": m.bw_triad, "bandwidth_read": m.bw_read,
           "bandwidth_read_method": m.read.to_dict() if m.read is not None else None,
           "dispatch_s": m.dispatch_s,
           "efficiency": m.efficiency, "overhead_s": m.overhead_s}
    if json_out:
        emit_json(rep)
        return
    console.print(f"host profile written to {path} (calibrated in {m.seconds:.1f} s, measured)")
    console.print("  peak (measured): " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in d.peak_flops.items()))
    console.print(f"  read bandwidth β_read (measured; the profile's bandwidth): {m.bw_read / 1e9:.2f} GB/s"
                  + (f" — {m.read.method}" if m.read is not None else ""))
    console.print(f"  copy {m.bw_copy / 1e9:.2f} GB/s, triad {m.bw_triad / 1e9:.2f} GB/s (measured, for reference)")
    console.print(f"  dispatch overhead (measured): {m.dispatch_s * 1e6:.2f} µs")
    console.print("  efficiency factors (fitted): " + ", ".join(f"{k} {v:.3g}" for k, v in m.efficiency.items()))
    console.print("  fixed overheads (fitted): " + ", ".join(f"{k} {v * 1e6:.2g} µs" for k, v in m.overhead_s.items()))
    console.print("  power: TDP/idle are estimates (no power sensor is read)")


def _layers(gc, devices: list[str]) -> list[dict]:
    groups: OrderedDict[str, list] = OrderedDict()
    for n in gc.nodes:
        groups.setdefault(n.layer, []).append(n)
    rows = []
    for layer, ns in groups.items():
        first = [next(iter(n.costs.values())) for n in ns]
        fl = sum(c.flops for c in first)
        by = sum(c.bytes for c in first)
        row = {"layer": layer, "nodes": len(ns), "flops": fl, "bytes": by,
               "ai": fl / by if by else (float("inf") if fl else 0.0),
               "time_s": {d: sum(n.costs[d].time_s for n in ns) for d in devices},
               "energy_j": {d: sum(n.costs[d].energy_j for n in ns) for d in devices},
               "unsupported": {d: sum(1 for n in ns if not n.supported[d]) for d in devices}}
        dev0 = devices[0]
        cls_t: dict[str, float] = {}
        for n in ns:
            c = n.costs[dev0]
            cls_t[c.op_class] = cls_t.get(c.op_class, 0.0) + c.time_s
        row["class"] = max(cls_t, key=cls_t.get) if cls_t else "control"
        rows.append(row)
    return rows


def _terms_line(name: str, terms: dict[str, dict]) -> str:
    """``gpu: compute eff 0.75 (estimate), …`` — which efficiency/overhead terms the modeled figures used."""
    def prov(t: dict) -> str:
        return "default" if t["estimate"] is None else "estimate" if t["estimate"] else "published"

    c, b, d, sw, cal = (terms[k] for k in ("compute_efficiency", "bandwidth_efficiency", "dispatch_s",
                                          "switch_overhead_us", "calibrated"))
    return (f"{name}: compute eff {c['value']:.2f} ({prov(c)}), bandwidth eff {b['value']:.2f} ({prov(b)}), "
            f"dispatch {d['value'] * 1e6:.0f} µs/op ({prov(d)}), switch-in {sw['value']:.0f} µs ({prov(sw)}), "
            f"calibrated per-op factors: {cal['value'] or 'none'}")


TEMP_RANGE_C = (-40.0, 150.0)  # industrial ambient minimum .. silicon junction maximum


@app.command()
@handles_errors
def profile(
    model: str = typer.Argument(..., help="zoo name or local HF folder"),
    soc: opt.Soc = "host",
    seq: opt.Seq = 128,
    attn: opt.Attn = opt.ATTN,
    temp: float | None = typer.Option(None, "--temp", help="device temperature in °C for the thermal factor"),
    plot: Path | None = typer.Option(None, "--plot", help="write a roofline plot (.png or .svg)"),
    json_out: opt.Json = False,
) -> None:
    """Cost model of a model on an SoC: per-layer FLOPs, bytes, AI, class, modeled time and energy per device."""
    from hetforge.cli.commands.frontend import capture_model
    from hetforge.cost import analyze
    from hetforge.cost.model import model_terms
    from hetforge.hardware import load_soc

    if seq < 1:
        raise UsageError(f"--seq must be ≥ 1, got {seq}")
    if temp is not None and not TEMP_RANGE_C[0] <= temp <= TEMP_RANGE_C[1]:  # also refuses NaN
        raise UsageError(f"--temp must be a device temperature in {TEMP_RANGE_C[0]:g}..{TEMP_RANGE_C[1]:g} °C, "
                         f"got {temp}")
    if plot is not None:
        from hetforge.files import check_output

        check_output(plot, "--plot", (".png", ".svg"), example="roofline.png")  # before any work
    prof = load_soc(soc)
    loaded, _, cg = capture_model(model, seq, attn, False)
    gc = analyze(cg.gm, prof, temp)
    devs = prof.device_names
    layers = _layers(gc, devs)
    totals = {d: {"time_s": gc.total_time(d), "energy_j": gc.total_energy(d),
                  "unsupported_nodes": sum(1 for n in gc.nodes if not n.supported[d])} for d in devs}
    if plot is not None:
        from hetforge.cost.plot import roofline_plot

        roofline_plot(gc, prof, plot, title=f"{loaded.name} seq {seq} on {prof.name} (modeled)", what="--plot")
    if json_out:
        emit_json({"model": loaded.name, "soc": prof.name, "soc_calibrated": prof.calibrated, "seq": seq,
                   "label": "modeled", "temp_c": temp, "devices": devs, "totals": totals, "layers": layers,
                   "unknown_ops": gc.unknown_ops, "nodes": [n.to_dict() for n in gc.nodes],
                   "terms": {d.name: model_terms(d) for d in prof.devices}, "plot": str(plot) if plot else None})
        return
    t = Table(title=f"{loaded.name} seq {seq} on {prof.name}: modeled time and energy per device"
              + ("" if prof.name != "host" or prof.calibrated else " [yellow](host NOT calibrated)[/]"))
    for col in ("layer", "nodes", "MFLOP", "MB", "AI", "class"):
        t.add_column(col, justify="right" if col not in ("layer", "class") else "left")
    for d in devs:
        t.add_column(f"{d} µs | mJ", justify="right")
    for r in layers:
        cells = [r["layer"], str(r["nodes"]), f"{r['flops'] / 1e6:.2f}", f"{r['bytes'] / 1e6:.2f}",
                 f"{r['ai']:.2f}", r["class"]]
        for d in devs:
            mark = "*" if r["unsupported"][d] else ""
            cells.append(f"{r['time_s'][d] * 1e6:.1f}{mark} | {r['energy_j'][d] * 1e3:.3g}")
        t.add_row(*cells)
    tot = ["total", str(len(gc.nodes)), f"{gc.total_flops() / 1e6:.2f}",
           f"{sum(r['bytes'] for r in layers) / 1e6:.2f}", "", ""]
    for d in devs:
        tot.append(f"{totals[d]['time_s'] * 1e6:.1f} | {totals[d]['energy_j'] * 1e3:.3g}")
    t.add_row(*tot, style="bold")
    console.print(t)
    console.print("times (µs) and energies (mJ) are modeled, not measured; "
                  "* = the layer has ops this device cannot run (" + ", ".join(
        f"{d}: {totals[d]['unsupported_nodes']} nodes" for d in devs) + "); times assume single-device execution")
    console.print("terms used per device (value, provenance):", highlight=False)
    for dev in prof.devices:
        console.print("  " + _terms_line(dev.name, model_terms(dev)), highlight=False, soft_wrap=True)
    if gc.unknown_ops:
        err_console.print(f"[yellow]warning:[/] no cost formula for {', '.join(gc.unknown_ops)}: "
                          "costed as control ops (dispatch time only)")
    if plot is not None:
        console.print(f"roofline plot written to {plot}")
