"""``hetforge models``, ``capture`` and ``verify``: the foundation commands."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from hetforge.cli import options as opt
from hetforge.cli.common import app, console, emit_json, handles_errors


@app.command()
@handles_errors
def models(json_out: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """List the model zoo with parameter counts and families."""
    from hetforge.models.zoo import count_parameters, list_models

    rows = [
        {"name": s.name, "family": s.family, "kind": s.kind, "parameters": count_parameters(s),
         "tiny": s.tiny, "attn": list(s.attn_impls), "description": s.description}
        for s in list_models()
    ]
    if json_out:
        emit_json({"models": rows})
        return
    t = Table(title="hetforge model zoo (seeded random weights unless noted)")
    for col in ("name", "family", "kind", "parameters", "attention", "description"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["name"], r["family"], r["kind"], f"{r['parameters'] / 1e6:.2f} M", "/".join(r["attn"]),
                  r["description"])
    console.print(t)


def capture_model(model: str, seq: int, attn: str, strict: bool):
    """Load a model and capture it at [1, seq]; shared by several commands."""
    from hetforge.frontend import capture
    from hetforge.models.zoo import example_inputs, load_model

    loaded = load_model(model, attn=attn)
    inputs = example_inputs(loaded, seq=seq)
    cg = capture(loaded.logits_module(), inputs, strict=strict, name=loaded.name)
    return loaded, inputs, cg


@app.command()
@handles_errors
def capture(
    model: str = typer.Argument(..., help="zoo name (see `hetforge models`) or a local HF folder"),
    seq: opt.Seq = 16,
    attn: opt.Attn = opt.ATTN,
    strict: bool = typer.Option(False, "--strict/--non-strict", help="torch.export mode (default non-strict)"),
    dump: Path | None = typer.Option(None, "--dump", help="write the captured graph as readable text"),
    json_out: opt.Json = False,
) -> None:
    """Capture a model with torch.export: node counts by op, parameter count, capture time."""
    from hetforge.files import check_output, write_text

    if dump is not None:
        check_output(dump, "--dump", example="graph.txt")  # a bad path fails before the model is built
    loaded, _, cg = capture_model(model, seq, attn, strict)
    counts = cg.op_counts()
    if dump is not None:
        write_text(dump, cg.gm.print_readable(print_output=False), "--dump")
    report = {
        "model": loaded.name, "seq": seq, "attn": loaded.attn, "strict": strict, "nodes": cg.num_nodes,
        "parameters": cg.num_parameters, "capture_seconds": cg.seconds,
        "ops": dict(counts.most_common()), "weights": loaded.weights,
    }
    if json_out:
        emit_json(report)
        return
    t = Table(title=f"{loaded.name}: {cg.num_nodes} nodes, {cg.num_parameters / 1e6:.2f} M parameters, "
              f"captured in {cg.seconds:.2f} s (measured, {'strict' if strict else 'non-strict'})")
    t.add_column("op")
    t.add_column("count", justify="right")
    for op, n in counts.most_common():
        t.add_row(op, str(n))
    console.print(t)
    if dump is not None:
        console.print(f"graph written to {dump}")


@app.command()
@handles_errors
def verify(
    model: str = typer.Argument(..., help="zoo name or local HF folder"),
    seq: opt.Seq = 16,
    attn: opt.Attn = opt.ATTN,
    kl_threshold: float = typer.Option(1e-9, "--kl-threshold"),
    json_out: opt.Json = False,
) -> None:
    """Capture a model and compare the captured graph with eager: abs error, KL, top-1 agreement."""
    from hetforge.verify import check_kl_threshold
    from hetforge.verify import verify as run_verify

    check_kl_threshold(kl_threshold)
    loaded, inputs, cg = capture_model(model, seq, attn, False)
    rep = run_verify(loaded.logits_module(), cg.gm, inputs, kl_threshold=kl_threshold)
    d = {"model": loaded.name, "stage": "capture", **rep.to_dict()}
    if json_out:
        emit_json(d)
    else:
        status = "[green]PASS[/]" if rep.passed else "[red]FAIL[/]"
        console.print(
            f"{loaded.name} captured vs eager (measured): max_abs_err {rep.max_abs_err:.3e}, "
            f"kl_mean {rep.kl_mean:.3e}, kl_max {rep.kl_max:.3e}, top1_agree {rep.top1_agree:.3f} "
            f"(threshold KL ≤ {kl_threshold:g}) {status}"
        )
    if not rep.passed:
        raise typer.Exit(1)
