"""``hetforge moe calibrate`` / ``hetforge moe tiers``: expert popularity, static capacity tiers and what they cost."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from hetforge.cli.common import app, console, emit_json, handles_errors
from hetforge.errors import UsageError

moe_app = typer.Typer(help="Mixture-of-Experts: calibrate expert popularity, choose static capacity tiers.",
                      no_args_is_help=True)
app.add_typer(moe_app, name="moe")


def _capacity(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        hot, cold = (int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"--capacity '{text}' must be HOT,COLD (two integers, e.g. 96,16)") from None
    return hot, cold


@moe_app.command("calibrate")
@handles_errors
def calibrate_cmd(
    model: str = typer.Argument(..., help="zoo name or local HF folder of an MoE model"),
    data: Path = typer.Option(..., "--data", help="UTF-8 text file to route through the model"),
    out: Path = typer.Option(None, "--out", help="calibration JSON to write (default: moe-calib-MODEL.json)"),
    seq: int = typer.Option(128, "--seq", help="tokens per forward call"),
    max_chunks: int = typer.Option(16, "--max-chunks", help="at most this many [1, seq] windows of the data"),
    plot: Path = typer.Option(None, "--plot", help="write the per-layer popularity histogram (PNG/SVG)"),
    json_out: bool = typer.Option(False, "--json", help="print the calibration as JSON"),
) -> None:
    """Record per-layer expert popularity (tokens routed, router-probability mass) into a file tied to the model."""
    from hetforge.models.zoo import load_model
    from hetforge.moe import calibrate

    loaded = load_model(model)
    cal = calibrate(loaded, data, seq=seq, max_chunks=max_chunks)
    path = out or Path(f"moe-calib-{loaded.name}.json")
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(cal, indent=1))
        tmp.replace(path)  # nothing half-written
    except OSError as e:
        raise UsageError(f"cannot write '{path}': {e.strerror or e}") from None
    if plot is not None:
        _plot(cal, plot)
    if json_out:
        emit_json({**cal, "file": str(path), "plot": str(plot) if plot else None})
        return
    console.print(f"[bold]{loaded.name}[/] ({loaded.weights}): {cal['tokens']} tokens in {cal['chunks']} calls of "
                  f"{seq}, {cal['run_seconds_measured']:.2f} s (measured) → {path}")
    t = Table(title="share of routed assignments per expert (hottest first)")
    for col in ("layer", "experts", "top-k", "hottest experts (share)", "coldest"):
        t.add_column(col)
    for lay in cal["layers"]:
        order = sorted(range(lay["experts"]), key=lambda i: -lay["share"][i])
        t.add_row(str(lay["layer"]), str(lay["experts"]), str(lay["top_k"]),
                  ", ".join(f"{i} ({lay['share'][i]:.1%})" for i in order[:3]),
                  f"{order[-1]} ({lay['share'][order[-1]]:.1%})")
    console.print(t)
    if plot is not None:
        console.print(f"histogram: {plot}")


def _plot(cal: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = cal["layers"]
    fig, axes = plt.subplots(len(layers), 1, figsize=(7, 1.6 * len(layers) + 0.6), squeeze=False)
    for ax, lay in zip(axes[:, 0], layers, strict=True):
        ax.bar(range(lay["experts"]), [100 * s for s in lay["share"]], color="tab:blue")
        ax.set_ylabel(f"layer {lay['layer']}\n% routed")
        ax.set_xticks(range(lay["experts"]))
    axes[-1, 0].set_xlabel("expert")
    fig.suptitle(f"{cal['model']}: expert popularity over {cal['tokens']} tokens (measured)")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot write plot '{path}': {e}") from None
    finally:
        plt.close(fig)


@moe_app.command("tiers")
@handles_errors
def tiers_cmd(
    model: str = typer.Argument(..., help="zoo name or local HF folder of an MoE model"),
    calib: Path = typer.Option(..., "--calib", help="calibration JSON from `hetforge moe calibrate`"),
    data: Path = typer.Option(..., "--data", help="UTF-8 text to measure drops, padding and perplexity on"),
    seq: int = typer.Option(128, "--seq", help="tokens per call (the static prefill length the tiers are sized for)"),
    share: float = typer.Option(0.9, "--share", help="hot tier: the most popular experts covering this share"),
    group_size: int = typer.Option(0, "--group-size", help="experts per grouped call; must divide the experts "
                                   "(0 = one group per tier)"),
    capacity_factor: float = typer.Option(1.0, "--capacity-factor", help="slots = factor × expected assignments"),
    capacity: str = typer.Option(None, "--capacity", help="explicit HOT,COLD slots per expert (overrides factor)"),
    max_drop: float = typer.Option(1.0, "--max-drop", help="refuse if a layer drops more than this fraction"),
    max_chunks: int = typer.Option(4, "--max-chunks", help="at most this many [1, seq] windows of the data"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON document"),
) -> None:
    """Choose static capacity tiers from a calibration and measure drops, padding and perplexity on data."""
    from hetforge.models.zoo import load_model
    from hetforge.moe import check_max_drop, check_plan_options, choose_tiers, evaluate, load_calibration, read_tokens

    cap = _capacity(capacity)
    check_plan_options(group_size, capacity_factor, cap, share)
    if not 0 <= max_drop <= 1:
        raise UsageError(f"--max-drop {max_drop} must be in [0, 1]")
    loaded = load_model(model)
    cal = load_calibration(calib, loaded)
    plan = choose_tiers(cal, seq, share=share, group_size=group_size, capacity_factor=capacity_factor, capacity=cap)
    chunks = read_tokens(loaded, data, seq, max_chunks)
    ev = evaluate(loaded, chunks, plan)
    check_max_drop(ev, max_drop)
    if json_out:
        emit_json({"model": loaded.name, "calibration": str(calib), "seq": seq, "share": share,
                   "group_size": group_size, "capacity_factor": capacity_factor, "capacity": cap,
                   "max_drop": max_drop, **ev.to_dict()})
        return
    console.print(f"[bold]{loaded.name}[/]: {ev.tokens} predicted tokens, calls of {seq}; tiers for share {share:.0%}, "
                  f"capacity factor {capacity_factor}")
    t = Table(title="per layer (measured on --data)")
    for col in ("layer", "hot experts", "slots hot/cold", "G", "drop rate", "padding waste", "groups run"):
        t.add_column(col)
    for d in ev.layers:
        t.add_row(str(d["layer"]), ",".join(map(str, d["hot"] or [])), f"{d['hot_capacity']}/{d['cold_capacity']}",
                  str(d["group_size"]), f"{d['drop_rate']:.1%}", f"{d['padding_waste']:.1%}",
                  f"{d['groups_run']}/{d['groups']}")
    console.print(t)
    console.print(f"perplexity: unlimited {ev.ppl_unlimited:.3f}, tiered {ev.ppl_tiered:.3f} "
                  f"({ev.ppl_change:+.2%}) (measured)")
    console.print(f"time: unlimited {ev.seconds_unlimited * 1e3:.0f} ms, tiered {ev.seconds_tiered * 1e3:.0f} ms "
                  "(measured, all calls)")


@moe_app.command("residency")
@handles_errors
def residency_cmd(
    model: str = typer.Argument(..., help="zoo name or local HF folder of an MoE model"),
    calib: Path = typer.Option(..., "--calib", help="calibration JSON from `hetforge moe calibrate`"),
    soc: str = typer.Option(..., "--soc", help="SoC profile (see `hetforge hardware list`)"),
    seq: int = typer.Option(512, "--seq", help="tokens per call (512: a prefill; 1: a decode step)"),
    share: float = typer.Option(0.9, "--share", help="hot tier: the most popular experts covering this share"),
    group_size: int = typer.Option(0, "--group-size", help="experts per grouped call (0 = one group per tier)"),
    capacity_factor: float = typer.Option(1.0, "--capacity-factor", help="slots = factor × expected assignments"),
    npu_budget_mb: float = typer.Option(None, "--npu-budget-mb", help="NPU memory for resident experts "
                                        "(default: the profile's NPU memory)"),
    objective: str = typer.Option("latency", "--objective", help="latency or energy: what a group's device minimises"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON document"),
) -> None:
    """Which expert groups stay resident on the NPU and why, and the modeled time/energy per token it gives."""
    from hetforge.hardware import load_soc
    from hetforge.models.zoo import load_model
    from hetforge.moe import check_plan_options, load_calibration
    from hetforge.moe.residency import residency_report

    check_plan_options(group_size, capacity_factor, None, share)
    if objective not in ("latency", "energy"):
        raise UsageError(f"--objective '{objective}' must be latency or energy")
    if seq < 1:
        raise UsageError(f"--seq {seq} must be ≥ 1")
    if npu_budget_mb is not None and npu_budget_mb < 0:
        raise UsageError(f"--npu-budget-mb {npu_budget_mb} must be ≥ 0")
    soc_p = load_soc(soc)
    loaded = load_model(model)
    cal = load_calibration(calib, loaded)
    rep = residency_report(loaded, cal, soc_p, seq, share, group_size, capacity_factor,
                           None if npu_budget_mb is None else npu_budget_mb * 1e6, objective=objective)
    if json_out:
        emit_json(rep)
        return
    print_residency(rep)


def print_residency(rep: dict) -> None:
    """The per-group table and the with/without-residency summary (all modeled)."""
    console.print(f"[bold]{rep['model']}[/] on {rep['soc']}: expert groups for calls of {rep['tokens_per_call']} "
                  "tokens (all figures modeled)")
    t = Table(title="expert groups")
    for col in ("layer", "group", "experts", "slots", "rows/call", "p(run)", "npu µs", "cpu µs", "gpu µs", "device"):
        t.add_column(col)
    for g in rep["groups"]:
        ts = g["t_s"]
        t.add_row(str(g["layer"]), str(g["group"]), ",".join(map(str, g["experts"])), str(g["slots"]),
                  f"{g['expected_rows']:.1f}", f"{g['p_run']:.2f}",
                  *(f"{ts[d] * 1e6:.0f}" if d in ts else "—" for d in ("npu", "cpu", "gpu")), g["device"])
    console.print(t)
    for g in rep["groups"]:
        console.print(f"  layer {g['layer']} group {g['group']}: {g['reason']}", highlight=False)
    for name, s in rep["modeled"].items():
        console.print(f"  {name}: {s['time_per_token_s'] * 1e6:.2f} µs/token, {s['energy_per_token_j'] * 1e6:.2f} "
                      f"µJ/token of expert work, {s['groups_on_npu']}/{s['groups']} groups on the NPU (modeled)")
