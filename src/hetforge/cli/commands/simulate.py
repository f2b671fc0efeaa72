"""``hetforge simulate thermal``: sustained generation on an SoC, fixed placement vs Φ-guided re-placement, over
simulated minutes (lumped RC thermal model + cost model; every figure modeled), plotted to a PNG."""

from __future__ import annotations

from pathlib import Path

import typer

from hetforge.cli import options as opt
from hetforge.cli.common import app, console, emit_json, err_console, handles_errors

simulate_app = typer.Typer(help="Simulations over modeled time (thermal).", no_args_is_help=True)
app.add_typer(simulate_app, name="simulate")


@simulate_app.command("thermal")
@handles_errors
def thermal_cmd(
    soc: opt.Soc = ...,
    workload: str = typer.Option("gpt2:prefill", "--workload",
                                 help="MODEL[:decode|:prefill]: a zoo model generating back to back in that phase"),
    minutes: float = typer.Option(30.0, "--minutes", help="simulated minutes, in (0, 1440]"),
    strategy: str = typer.Option("greedy", "--strategy", help="placement strategy (cost-driven: greedy or pgsam)"),
    objective: opt.Objective = opt.OBJECTIVE,
    duty: float = typer.Option(1.0, "--duty", help="fraction of the time spent generating, in (0, 1]"),
    ambient: float = typer.Option(None, "--ambient", help="ambient °C in [-40, 60] (default: the profile's)"),
    min_dwell: float = typer.Option(60.0, "--min-dwell", help="seconds a plan runs before an energy-saving switch "
                                    "(safety switches are never delayed), in [0, 3600]"),
    min_gain: float = typer.Option(0.10, "--min-gain", help="least fraction of energy per token a new plan must "
                                   "save for an energy-saving switch, in [0, 1)"),
    out: Path = typer.Option(Path("thermal.png"), "--out", help="PNG plot to write"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON document (with the time series)"),
) -> None:
    """Compare fixed placement with Φ-guided re-placement: peak temperature, throttling events, energy and
    tokens/s over time (all modeled), plotted to --out."""
    from hetforge.errors import UsageError
    from hetforge.files import check_output
    from hetforge.hardware import load_soc
    from hetforge.placement import get_strategy
    from hetforge.placement.costs import check_objective
    from hetforge.thermal.simulate import ThermalSimulation, plot

    if not 0 < minutes <= 24 * 60:
        raise UsageError(f"--minutes must be in (0, 1440], got {minutes:g}")
    if not 0 < duty <= 1:
        raise UsageError(f"--duty must be in (0, 1], got {duty:g}")
    if ambient is not None and not -40 <= ambient <= 60:
        raise UsageError(f"--ambient must be in [-40, 60] °C, got {ambient:g}")
    prof = load_soc(soc)
    get_strategy(strategy.partition(":")[0])
    check_objective(objective)
    phase = workload.partition(":")[2]
    if phase not in ("", "decode", "prefill"):
        raise UsageError(f"--workload '{workload}': the phase must be decode or prefill (MODEL[:decode|:prefill])")
    if not 0 <= min_dwell <= 3600:
        raise UsageError(f"--min-dwell must be in [0, 3600] s, got {min_dwell:g}")
    if not 0 <= min_gain < 1:
        raise UsageError(f"--min-gain must be in [0, 1), got {min_gain:g}")
    check_output(out, "--out", (".png",), example="thermal.png")
    log = (lambda s: None) if json_out else (lambda s: err_console.print(s, style="dim", highlight=False))
    sim = ThermalSimulation(prof, workload, strategy=strategy, objective=objective, duty=duty, ambient_c=ambient,
                            log=log)
    doc = sim.compare(minutes, min_dwell_s=min_dwell, min_gain=min_gain)
    plot(doc, out)
    doc["plot"] = str(out)
    if json_out:
        emit_json(doc)
        return
    console.print(f"{doc['workload']} ({doc['phase']}) on {doc['soc']}, {minutes:g} simulated minutes, ambient "
                  f"{doc['thermal']['ambient_c']:g} °C (all modeled: cost model + lumped RC)",
                  highlight=False, soft_wrap=True)
    for pol, label in (("fixed", "fixed placement"), ("phi", "Φ-guided re-placement"),
                       ("phi_nodwell", "Φ-guided without dwell")):
        d = doc[pol]
        peak = ", ".join(f"{n} {t:.1f} °C" for n, t in d["peak_temp_c"].items())
        console.print(f"{label}: peak {peak} | {d['throttling_events']} throttling events | "
                      f"{d['energy_j'] / 1e3:.2f} kJ, {d['energy_per_token_mj']:.3f} mJ/token | "
                      f"{d['mean_tokens_per_s']:.1f} tokens/s mean | {d['re_placements']} re-placements (modeled)",
                      highlight=False, soft_wrap=True)
    for s in doc["phi"]["switch_log"][:10]:
        console.print(f"  t={s['t_s']:.0f} s: {s['from']} -> {s['to']}: {s['reason']}", style="dim", highlight=False,
                      soft_wrap=True)
    console.print(f"plot: {out}", style="dim", highlight=False)
