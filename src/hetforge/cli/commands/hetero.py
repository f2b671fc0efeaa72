"""``hetforge backends``, ``hetero`` and ``run-plan``: heterogeneous execution on this host's backends."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from hetforge.cli.common import app, console, emit_json, handles_errors
from hetforge.errors import HetforgeError, UsageError

BACKEND_HELP = "DEVICE=BACKEND override, repeatable (torch-cpu, torch-cpu:fx, torch-cuda, openvino:CPU|GPU|NPU, " \
               "emulated:torch-cpu, emulated:openvino:CPU)"
POLICY_HELP = ("emulated dtypes: 'exact' admits fp32 on an fp16-only device (computed at fp32, reported), "
               "'strict' refuses")


@app.command()
@handles_errors
def backends(
    soc: str = typer.Option("intel-core-ultra-155h", "--soc", help="SoC profile whose default mapping to print"),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Backends installed on this host, and the default device → backend mapping for an SoC."""
    from hetforge.backends.inventory import inventory
    from hetforge.backends.mapping import resolve
    from hetforge.hardware import load_soc

    prof = load_soc(soc)
    inv = inventory()
    rows = [b.to_dict() for b in resolve(prof).values()]
    for r in rows:
        d = prof.device(r["device"])
        r["constraints"] = _constraints(d)
    if json_out:
        emit_json({"soc": prof.name, "installed": inv, "mapping": rows})
        return
    t = Table(title="backends on this host (checked now)")
    for col in ("backend", "available", "detail"):
        t.add_column(col)
    for b in inv:
        t.add_row(b["backend"], "yes" if b["available"] else "[red]no[/]", b["detail"])
    console.print(t)
    m = Table(title=f"default mapping for {prof.name} (override with --backend DEVICE=BACKEND)")
    for col in ("device", "kind", "backend", "real/emulated", "why", "constraints enforced"):
        m.add_column(col)
    for r in rows:
        m.add_row(r["device"], r["kind"], r["backend"], "emulated" if r["emulated"] else "real", r["why"],
                  r["constraints"] if r["emulated"] else "–")
    console.print(m)
    console.print("Emulated devices run for real on their stand-in (measured) while their time and energy come "
                  "from the cost model (modeled).", style="dim")


def _constraints(d) -> str:
    parts = [f"ops ({len(d.unsupported_ops)} unsupported)", f"dtypes {'/'.join(sorted(d.dtypes))}",
             f"memory {d.mem_capacity / 2**30:.0f} GiB"]
    if d.static_shapes:
        parts.insert(1, "static shapes")
    return ", ".join(parts)


@app.command()
@handles_errors
def hetero(
    model: str = typer.Argument(..., help="zoo name (see `hetforge models`) or a local HF folder"),
    soc: str = typer.Option("intel-core-ultra-155h", "--soc", help="SoC profile"),
    layout: str | None = typer.Option(None, "--layout", help="hand-made placement: all:DEV, alternate:A,B, stages:A,B"),
    strategy: str | None = typer.Option(None, "--strategy", help="placement strategy instead of --layout"),
    objective: str | None = typer.Option(None, "--objective", help="objective passed to the strategy"),
    seq: int = typer.Option(16, "--seq", help="sequence length of the input"),
    backend: list[str] = typer.Option(None, "--backend", help=BACKEND_HELP),
    policy: str = typer.Option("exact", "--policy", help=POLICY_HELP),
    no_schedule: bool = typer.Option(False, "--no-schedule", help="keep the graph's order (do not schedule)"),
    repeat: int = typer.Option(5, "--repeat", help="timed runs (median reported)"),
    warmup: int = typer.Option(1, "--warmup", help="untimed runs first"),
    trace: Path | None = typer.Option(None, "--trace", help="write a Chrome trace (Perfetto) of the median run"),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Place MODEL by layer layout or strategy, partition it, run the partitions on their backends, verify."""
    from hetforge.cli.commands.frontend import capture_model
    from hetforge.hardware import load_soc
    from hetforge.hetero.layouts import layer_assignment
    from hetforge.hetero.pipeline import partitions_from_placement

    if (layout is None) == (strategy is None):
        raise UsageError("give exactly one of --layout (e.g. alternate:cpu,gpu) or --strategy (e.g. greedy)")
    _check_counts(repeat, warmup, trace)
    prof = load_soc(soc)
    bindings = _bindings(prof, backend, policy)
    if layout is not None:
        from hetforge.hetero.layouts import parse_layout

        parse_layout(layout, prof.device_names)  # a bad layout fails before the model is built
    else:
        from hetforge.placement import get_strategy

        get_strategy(strategy)
    loaded, inputs, cg = capture_model(model, seq, "sdpa", False)
    if layout is not None:
        assignment = layer_assignment(cg.gm, layout, prof.device_names)
        how = f"layout {layout}"
    else:
        from hetforge.placement import get_strategy

        opts = {"objective": objective} if objective else {}
        assignment = get_strategy(strategy)(cg.gm, prof, **opts).assignment
        how = f"strategy {strategy}" + (f" ({objective})" if objective else "")
    pp = partitions_from_placement(cg.gm, assignment, prof, scheduled=not no_schedule, name=loaded.name)
    _run_and_report(pp.partitions, prof, bindings, inputs, cg.gm, repeat, warmup, trace, json_out,
                    {"model": loaded.name, "soc": prof.name, "placement": how, "seq": seq,
                     "scheduled": not no_schedule, "switches_naive_order": pp.naive_switches,
                     "switches_scheduled_order": pp.scheduled_switches})


def _check_counts(repeat: int, warmup: int, trace: Path | None = None) -> None:
    if trace is not None:
        from hetforge.files import check_output

        check_output(trace, "--trace", example="trace.json")  # a bad path fails before any work
    if repeat < 1:
        raise UsageError(f"--repeat must be ≥ 1, got {repeat}")
    if warmup < 0:
        raise UsageError(f"--warmup must be ≥ 0, got {warmup}")


def _bindings(prof, backend: list[str] | None, policy: str):
    from hetforge.backends.emulated import POLICIES
    from hetforge.backends.mapping import parse_overrides, resolve

    if policy not in POLICIES:
        raise UsageError(f"unknown --policy '{policy}'; allowed: {', '.join(POLICIES)}")
    return resolve(prof, parse_overrides(backend, prof.device_names), policy)


def _run_and_report(pg, prof, bindings, inputs, eager, repeat, warmup, trace, json_out, header) -> None:
    from hetforge.hetero.session import execute

    res = execute(pg, prof, bindings, inputs, eager, repeat=repeat, warmup=warmup, trace_path=trace)
    doc = {**header, **res.to_dict()}
    fid = res.fidelity
    if json_out:
        emit_json(doc)
    else:
        _print_result(res, header)
    if fid is not None and not fid.passed:
        raise HetforgeError(f"outputs do not match eager: KL max {fid.kl_max:.3g} > threshold {fid.kl_threshold:g}")


def _print_result(res, header: dict) -> None:
    med = res.median
    calls = {c.partition: c for c in med.calls}
    t = Table(title=f"{header.get('model')} on {header.get('soc')}: {header.get('placement')}, "
              f"{len(res.partitions.partitions)} partitions")
    for col in ("part", "device", "backend", "nodes", "compile s (measured)", "call ms (measured)",
                "call ms (modeled)", "mJ (modeled)"):
        t.add_column(col)
    notes: dict[str, list[int]] = {}
    for row in res.build.partitions:
        c = calls[row["partition"]]
        t.add_row(str(row["partition"]), row["device"], row["backend"], str(row["nodes"]),
                  f"{row['compile_measured_s']:.2f}", f"{1e3 * c.measured_s:.2f}", f"{1e3 * c.modeled_s:.3f}",
                  f"{1e3 * c.modeled_j:.3f}")
        for n in row["notes"]:
            if not n.startswith("executor:"):
                notes.setdefault(n, []).append(row["partition"])
    console.print(t)
    for n, parts in notes.items():
        console.print(f"  p{','.join(map(str, parts))}: {n}", style="dim", highlight=False)
    s = med.summary()
    d = res.to_dict()["latency_measured_s"]
    console.print(
        f"latency {1e3 * d['median']:.2f} ms median, {1e3 * d['min']:.2f} min of {d['repeats']} (measured) | "
        f"{s['calls']} backend calls, {s['switches']} device switches | {s['transfers']} transfers "
        f"({s['transfer_copies']} copies, {s['transfer_zero_copy']} zero-copy, "
        f"{s['transfer_bytes_copied'] / 1024:.1f} KiB"
        f" copied, {1e3 * s['transfer_measured_s']:.3f} ms measured) | modeled on {header.get('soc')}: "
        f"{1e3 * s['modeled_s']:.3f} ms, {1e3 * s['modeled_j']:.3f} mJ", highlight=False)
    if res.fidelity is not None:
        f = res.fidelity
        console.print(f"fidelity vs eager: KL max {f.kl_max:.3g} (threshold {f.kl_threshold:g}), max |err| "
                      f"{f.max_abs_err:.3g}, top-1 {100 * f.top1_agree:.1f}% -> "
                      f"{'[green]pass[/]' if f.passed else '[red]FAIL[/]'}")
    if res.trace_path is not None:
        console.print(f"trace written to {res.trace_path} (open in ui.perfetto.dev or chrome://tracing)")


@app.command("run-plan")
@handles_errors
def run_plan(
    model: str = typer.Argument(..., help="the model the plan was compiled for (zoo name or local HF folder)"),
    plan: Path = typer.Option(..., "--plan", help="plan file written by `hetforge compile MODEL --out FILE`"),
    soc: str | None = typer.Option(None, "--soc", help="check the plan was compiled for this SoC profile (the plan "
                                   "carries its own; a different one is refused)"),
    backend: list[str] = typer.Option(None, "--backend", help=BACKEND_HELP),
    policy: str = typer.Option("exact", "--policy", help=POLICY_HELP),
    repeat: int = typer.Option(5, "--repeat", help="timed runs (median reported)"),
    warmup: int = typer.Option(1, "--warmup", help="untimed runs first"),
    trace: Path | None = typer.Option(None, "--trace", help="write a Chrome trace (Perfetto) of the median run"),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Run a compiled plan: its partitions on their devices' backends (real or emulated), verified against eager."""
    from hetforge.hetero.plan import load_plan, plan_inputs, plan_soc, read_header
    from hetforge.hetero.program import partition_program
    from hetforge.models.zoo import load_model

    _check_counts(repeat, warmup, trace)
    header = read_header(plan)  # a missing, non-plan or malformed file fails before the model is built
    prof = plan_soc(plan, header, soc)
    bindings = _bindings(prof, backend, policy)
    loaded = load_model(model)
    module = loaded.logits_module().eval()
    program = load_plan(plan, loaded.name, module)
    inputs = plan_inputs(program, loaded)
    pg = partition_program(program)
    _run_and_report(pg, prof, bindings, inputs, module, repeat, warmup, trace, json_out,
                    {"model": loaded.name, "soc": prof.name, "placement": f"plan {plan}", "plan": str(plan),
                     "seq": int(inputs[0].shape[1])})
