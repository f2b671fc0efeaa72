"""``hetforge demo``: the main job on the built-in default model, offline, in well under a minute."""

from __future__ import annotations

import typer

from hetforge.cli.common import app, console, emit_json, handles_errors

DEFAULT_MODEL = "llama-tiny"


@app.command()
@handles_errors
def demo(
    model: str = typer.Option(DEFAULT_MODEL, "--model", help="model to run the demo on"),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Capture and verify the default model, with a readable summary of each stage."""
    from hetforge.frontend import capture
    from hetforge.models.zoo import example_inputs, load_model
    from hetforge.verify import verify

    loaded = load_model(model)
    inputs = example_inputs(loaded, seq=32)
    cg = capture(loaded.logits_module(), inputs, name=loaded.name)
    rep = verify(loaded.logits_module(), cg.gm, inputs, kl_threshold=1e-9)
    summary = {
        "model": loaded.name, "parameters": loaded.num_parameters, "weights": loaded.weights,
        "capture": {"nodes": cg.num_nodes, "seconds": cg.seconds},
        "fidelity": rep.to_dict(),
    }
    if json_out:
        emit_json(summary)
    else:
        console.print(f"[bold]hetforge demo[/] — {loaded.name} ({loaded.num_parameters / 1e6:.2f} M params, "
                      f"{loaded.weights})")
        console.print(f"  capture  : {cg.num_nodes} ATen nodes in {cg.seconds:.2f} s (measured)")
        console.print(f"  fidelity : KL max {rep.kl_max:.2e}, max |Δ| {rep.max_abs_err:.2e}, "
                      f"top-1 {rep.top1_agree:.3f} (measured vs eager)")
    if not rep.passed:
        raise typer.Exit(1)
