"""``hetforge explain`` (why a node went where it did) and ``hetforge pareto`` (PGSAM's front)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from hetforge.cli import options as opt
from hetforge.cli.common import app, console, emit_json, handles_errors
from hetforge.errors import UsageError

_MODEL_HELP = "zoo name, a local HF folder, or llama-3.1-8b-shape (shape-only, meta device)"


def placement_graph(model: str, seq: int, attn: str, passes: bool):
    """Capture ``model`` (optionally through the middle-end passes) and return its FX graph."""
    from hetforge.frontend import capture_shaped
    from hetforge.models.shapes import is_shaped

    if is_shaped(model):  # meta tensors: constant folding cannot evaluate them, the other passes run
        gm = capture_shaped(model, seq=seq, attn=attn).gm
        if not passes:
            return gm
        from hetforge.passes import PASS_NAMES, optimize

        return optimize(gm, passes=[p for p in PASS_NAMES if p != "constant_fold"]).gm
    from hetforge.cli.commands.frontend import capture_model

    _, inputs, cg = capture_model(model, seq, attn, False)
    if not passes:
        return cg.gm
    from hetforge.passes import optimize

    return optimize(cg.gm, inputs).gm


def _f(x: float, unit: str) -> str:
    if x == 0:
        return "0"
    for scale, pre in ((1, ""), (1e-3, "m"), (1e-6, "µ"), (1e-9, "n")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {pre}{unit}"
    return f"{x:.2e} {unit}"


@app.command()
@handles_errors
def explain(
    model: str = typer.Argument(..., help=_MODEL_HELP),
    soc: opt.Soc = ...,
    node: str = typer.Option(..., "--node", help="graph node name (see `hetforge compile --text`)"),
    strategy: opt.Strategy = opt.STRATEGY,
    objective: opt.Objective = opt.OBJECTIVE,
    seq: opt.Seq = 16,
    attn: opt.Attn = opt.ATTN,
    passes: opt.Passes = True,
    moe_calib: Path | None = typer.Option(None, "--moe-calib", help="for a hetforge::moe node: also explain where "
                                          "each expert group runs (residency, from `hetforge moe calibrate`)"),
    json_out: opt.Json = False,
) -> None:
    """Why a node went where it did: its modeled cost on every device and the rule or objective that decided."""
    from hetforge.hardware import load_soc
    from hetforge.placement import get_strategy
    from hetforge.placement.costs import NodeCosts, check_objective
    from hetforge.placement.explain import explain_node

    fn = get_strategy(strategy)
    check_objective(objective)
    soc_p = load_soc(soc)
    gm = placement_graph(model, seq, attn, passes)
    nc = NodeCosts.build(gm, soc_p)
    groups = None
    if node not in nc.index and moe_calib is not None:  # an expert-group node: the graph as `run` expands it
        import inspect

        if "pin" not in inspect.signature(fn).parameters:
            raise UsageError(f"expert groups are pinned to their residency device; strategy '{strategy}' takes no "
                             "pins (use rules, greedy, pgsam or single)")
        gm, groups, pins = _moe_expanded(model, gm, soc_p, moe_calib, objective)
        nc = NodeCosts.build(gm, soc_p)
    if node not in nc.index:
        explain_node(gm, nc, _dummy(strategy), node)  # raises the UsageError with suggestions
    pl = fn(gm, soc_p, objective=objective) if groups is None else fn(gm, soc_p, objective=objective, pin=pins)
    if groups is not None:
        for g in groups.groups:
            pl.reasons[g.node] = g.reason
    rep = explain_node(gm, nc, pl, node)
    rep["model"] = model
    if moe_calib is not None and groups is None:
        rep["moe_residency"] = _moe_residency(model, gm, node, soc_p, seq, moe_calib)
    if groups is not None:
        rep["moe_groups"] = groups.to_dict()
    if json_out:
        emit_json(rep)
        return
    console.print(f"[bold]{node}[/] ({rep['op']}, stage {rep['stage']}) → [bold]{rep['device']}[/] "
                  f"under {strategy}/{objective} on {rep['soc']}")
    console.print(f"reason: {rep['reason']}", highlight=False)
    t = Table(title="cost on every device (modeled)")
    for col in ("device", "runs?", "time", "energy", "DASI", "bound", "transfer in", "transfer out", "total time"):
        t.add_column(col)
    for r in rep["devices"]:
        mark = "✓" if r["supported"] else f"✗ {r['why_not']}"
        name = f"[bold]{r['device']}*[/]" if r["chosen"] else r["device"]
        t.add_row(name, mark, _f(r["time_s"], "s"), _f(r["energy_j"], "J"), f"{r['dasi']:.3f}", r["bound"],
                  _f(r["transfer_in_s"], "s"), _f(r["transfer_out_s"], "s"), _f(r["total_time_s"], "s"))
    console.print(t)
    for rj in rep["rejections"]:
        console.print(f"rejected {rj['device']}: {rj['why']}", highlight=False)
    if groups is not None:
        for g in groups.groups:
            console.print(f"MoE l{g.layer}g{g.group} ({g.node}, experts {g.experts}) → {g.device}", highlight=False)
    elif moe_calib is not None:
        from hetforge.cli.commands.moe import print_residency

        print_residency(rep["moe_residency"])


def _moe_residency(model: str, gm, node: str, soc_p, seq: int, calib: Path) -> dict:
    """Residency of the expert groups of one ``hetforge::moe`` node (its layer), for calls of ``seq`` tokens."""
    import torch

    from hetforge.errors import UsageError
    from hetforge.models.zoo import load_model
    from hetforge.moe import load_calibration
    from hetforge.moe.residency import residency_report

    n = next(x for x in gm.graph.nodes if x.name == node)
    if n.target is not torch.ops.hetforge.moe.default:
        raise UsageError(f"--moe-calib needs a hetforge::moe node; '{node}' is {n.target}")
    loaded = load_model(model)
    layer = int(n.args[15]) if len(n.args) > 15 else -1
    return residency_report(loaded, load_calibration(calib, loaded), soc_p, seq, layer=layer)


def _moe_expanded(model: str, gm, soc_p, calib: Path, objective: str):
    """The graph with its MoE blocks expanded into expert groups as ``hetforge run --moe-calibration`` does
    (default tiers: share 0.9, G = 2, capacity factor 1.25), and the residency pins."""
    from hetforge.models.zoo import load_model
    from hetforge.moe import load_calibration
    from hetforge.moe.expand import expand_for_soc, moe_nodes
    from hetforge.moe.residency import expert_dims

    if not moe_nodes(gm):
        raise UsageError(f"--moe-calib: model '{model}' has no MoE block hetforge recognises")
    loaded = load_model(model)
    obj = objective if objective in ("latency", "energy") else "latency"
    return expand_for_soc(gm, load_calibration(calib, loaded), soc_p, expert_dims(loaded.model), objective=obj)


def _dummy(strategy: str):
    from hetforge.placement import Placement

    return Placement(strategy, {})


@app.command()
@handles_errors
def pareto(
    model: str = typer.Argument(..., help=_MODEL_HELP),
    soc: opt.Soc = ...,
    objective: opt.Objective = opt.OBJECTIVE,
    latency_mode: str = typer.Option("bottleneck", "--latency", help="f2: bottleneck (pipelined) or total"),
    seed: int = typer.Option(0, "--seed", help="PGSAM random seed"),
    search: str = typer.Option("auto", "--search", help="auto (exact front when the plan count fits the budget, "
                               "else PGSAM), exact or pgsam"),
    budget: int | None = typer.Option(None, "--budget", help="most stage plans the search may evaluate"),
    aux: str = typer.Option("power", "--aux", help="embedding/LM-head routing: power (lowest TDP) or cost"),
    seq: opt.Seq = 16,
    attn: opt.Attn = opt.ATTN,
    passes: opt.Passes = True,
    plot: Path | None = typer.Option(None, "--plot", help="write a PNG of the front (energy vs latency)"),
    json_out: opt.Json = False,
) -> None:
    """The Pareto front of contiguous decoder-layer placements (modeled energy, latency, min DASI)."""
    from hetforge.hardware import load_soc
    from hetforge.placement import get_strategy
    from hetforge.placement.costs import check_objective

    check_objective(objective)
    if latency_mode not in ("bottleneck", "total"):
        raise UsageError(f"unknown --latency '{latency_mode}'; valid: bottleneck, total")
    if aux not in ("power", "cost"):
        raise UsageError(f"unknown --aux '{aux}'; valid: power, cost")
    if plot is not None:
        from hetforge.files import check_output

        check_output(plot, "--plot", (".png", ".svg"), example="front.png")  # before the search
    soc_p = load_soc(soc)
    gm = placement_graph(model, seq, attn, passes)
    if search not in ("auto", "exact", "pgsam"):
        raise UsageError(f"unknown --search '{search}'; valid: auto, exact, pgsam")
    pl = get_strategy("stages")(gm, soc_p, objective=objective, seed=seed, latency_mode=latency_mode, aux=aux,
                                search=search, budget=budget)
    front = pl.extra["front"]
    s = pl.extra["search"]
    who = "exact front" if s["method"] == "exact" else "PGSAM front"
    if plot is not None:
        plot = plot_front(front, plot, f"{model} on {soc_p.name}: {who} (modeled, f2 = {latency_mode})")
    rep = {"model": model, "soc": soc_p.name, "objective": objective, "latency_mode": latency_mode,
           "front": front, "aux": pl.extra["aux"], "search": pl.extra["search"], "label": "modeled",
           "plot": str(plot) if plot else None}
    if json_out:
        emit_json(rep)
        return
    t = Table(title=f"{model} on {soc_p.name}: {len(front)} Pareto-optimal layer placements (modeled); "
              f"embedding → {pl.extra['aux']['embed']}, head → {pl.extra['aux']['head']}")
    for col in ("#", "plan (device[layers])", "energy", f"{latency_mode} latency", "min DASI", ""):
        t.add_column(col)
    for i, p in enumerate(front):
        t.add_row(str(i), p["plan"], _f(p["energy_j"], "J"), _f(p["latency_s"], "s"), f"{p['min_dasi']:.3f}",
                  f"← {objective}" if p["chosen"] else "")
    console.print(t)
    if s["method"] == "exact":
        how = (f"exact front of all {s['plans']:,} stage plans (dynamic program, {s['labels']:,} partial plans "
               f"kept) in {s['seconds']:.2f} s (measured)")
    else:
        how = (f"PGSAM (the {s['plans']:,} plans exceed the exact budget): {s['evaluations']} evaluations in "
               f"{s['seconds']:.2f} s (measured), {s['momentum_accepts']} moves accepted thanks to momentum")
    console.print(how + "; pick another point with the strategy option point=#"
                  + (f"; plot written to {plot}" if plot else ""), highlight=False)


def plot_front(front: list[dict], path: Path, title: str, what: str = "--plot") -> Path:
    """Energy vs latency scatter of the front, colored by min DASI, the chosen point ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p["latency_s"] * 1e3 for p in front]
    ys = [p["energy_j"] * 1e3 for p in front]
    sc = ax.scatter(xs, ys, c=[p["min_dasi"] for p in front], cmap="viridis")
    for i, p in enumerate(front):
        ax.annotate(str(i), (xs[i], ys[i]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if p["chosen"]:
            ax.scatter([xs[i]], [ys[i]], s=160, facecolors="none", edgecolors="red")
    fig.colorbar(sc, label="min DASI")
    ax.set_xlabel("latency (ms, modeled)")
    ax.set_ylabel("energy (mJ, modeled)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    from hetforge.files import save_figure

    try:
        return save_figure(fig, path, what, dpi=120)
    finally:
        plt.close(fig)
