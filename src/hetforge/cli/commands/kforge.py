"""``hetforge kforge``: agentic kernel synthesis (problems, platforms, providers, run)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hetforge.cli.common import app, console, emit_json, err_console, handles_errors
from hetforge.errors import UsageError

kforge_app = typer.Typer(help="KForge: generate and tune kernels with a generation agent and a performance-analysis "
                         "agent, checked by a guarded harness.", no_args_is_help=True)
app.add_typer(kforge_app, name="kforge")


@kforge_app.command("problems")
@handles_errors
def problems_cmd(spec: str = typer.Argument("all", help="'all', shipped names (comma-separated), a folder or a file"),
                 json_out: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """List problems (the shipped set by default) in the KernelBench format."""
    from hetforge.kforge.problems import resolve

    ps = resolve(spec)
    if json_out:
        emit_json({"problems": [{"name": p.name, "category": p.category, "description": p.description,
                                 "path": str(p.path)} for p in ps]})
        return
    t = Table(title=f"{len(ps)} problems")
    for c in ("name", "category", "description"):
        t.add_column(c)
    for p in ps:
        t.add_row(p.name, p.category, p.description)
    console.print(t)


@kforge_app.command("platforms")
@handles_errors
def platforms_cmd(json_out: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Programming models and whether this host can run them."""
    from hetforge.kforge.platforms import PLATFORMS

    rows = [{"platform": k, "language": p.language, "available": p.available()[0], "detail": p.available()[1]}
            for k, p in PLATFORMS.items()]
    if json_out:
        emit_json({"platforms": rows})
        return
    t = Table(title="KForge platforms on this host")
    for c in ("platform", "language", "available", "detail"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["platform"], r["language"], "yes" if r["available"] else "no", r["detail"])
    console.print(t)


@kforge_app.command("providers")
@handles_errors
def providers_cmd(providers: Path | None = typer.Option(None, "--providers", help="provider file (JSON or TOML)"),
                  json_out: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Configured model providers (file and environment); `offline` needs no network."""
    from dataclasses import asdict

    from hetforge.kforge.providers import load_configs

    cfgs = load_configs(providers)
    if json_out:
        emit_json({"providers": [asdict(c) for c in cfgs.values()]})
        return
    t = Table(title="KForge providers")
    for c in ("name", "kind", "model", "endpoint", "timeout s", "retries"):
        t.add_column(c)
    for c in cfgs.values():
        t.add_row(c.name, c.kind, c.model or "-", c.base_url or "-", f"{c.timeout_s:g}", str(c.max_retries))
    console.print(t)


@kforge_app.command("run")
@handles_errors
def run_cmd(
    spec: str = typer.Argument(..., help="problems: 'all', shipped names (comma-separated), a folder or a file"),
    platform: str = typer.Option("cpp", "--platform", help="cpp, triton, cuda, sycl, metal"),
    provider: str = typer.Option("offline", "--provider", help="a configured provider name (see `kforge providers`)"),
    providers: Path | None = typer.Option(None, "--providers", help="provider file (JSON or TOML)"),
    rounds: int = typer.Option(4, "--rounds", help="synthesis rounds per problem"),
    threads: int = typer.Option(1, "--threads", help="threads for every timing (fixed)"),
    trials: int = typer.Option(3, "--trials", help="fresh random inputs checked per candidate"),
    atol: float = typer.Option(1e-4, "--atol"),
    rtol: float = typer.Option(1e-4, "--rtol"),
    compile_baseline: bool = typer.Option(True, "--compile-baseline/--no-compile-baseline",
                                          help="also time torch.compile (slow to build on CPU; cached)"),
    timeout_s: float = typer.Option(300.0, "--timeout-s", help="limit per worker process"),
    mem_gb: float = typer.Option(8.0, "--mem-gb", help="address-space limit per worker process"),
    translate_from: Path | None = typer.Option(None, "--translate-from",
                                               help="a working kernel on another platform to translate (one problem)"),
    out: Path | None = typer.Option(None, "--out", help="folder for all attempts (default: a new one in the cache)"),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Synthesize kernels for problems; per problem compiled / correct / speedup, then fast_p and geomean (measured)."""
    from hetforge.kforge import harness, loop
    from hetforge.kforge import platforms as plat
    from hetforge.kforge import providers as prov
    from hetforge.kforge.problems import resolve

    if rounds < 1 or threads < 1 or trials < 1:
        raise UsageError("--rounds, --threads and --trials must be ≥ 1")
    ps = resolve(spec)
    pf = plat.get(platform)
    ok, why = pf.available()
    if not ok:
        raise UsageError(f"platform '{platform}' is {why}")
    pv = prov.get(provider, providers)
    tr = None
    if translate_from is not None:
        if not translate_from.is_file():
            raise UsageError(f"--translate-from '{translate_from}' does not exist")
        tr = (translate_from.stem, translate_from.read_text())
    cfg = harness.Config(trials=trials, atol=atol, rtol=rtol, threads=threads, compile_baseline=compile_baseline,
                         timeout_s=timeout_s, mem_bytes=int(mem_gb * 2**30), device=pf.device())
    out = out or cfg.cache / "runs" / harness.now()
    out.mkdir(parents=True, exist_ok=True)
    peak, bw, calibrated = loop.host_roofline()
    usage = prov.Usage()
    results = []
    with Progress(TextColumn("[bold]kforge[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=True, disable=json_out) as bar:
        task = bar.add_task("starting", total=len(ps))
        for p in ps:
            results.append(loop.solve(p, pf, pv, rounds, cfg, out, usage, peak, bw, tr,
                                      tick=lambda m: bar.update(task, description=m)))
            bar.advance(task)
    rep = loop.summary(results, usage, cfg, platform, provider, rounds, calibrated)
    rep["out"] = str(out)
    (out / "summary.json").write_text(json.dumps(rep, indent=1, default=str))
    if json_out:
        emit_json(rep)
        return
    t = Table(title=f"KForge {platform} / {provider}, {rounds} rounds (times measured on this host, {threads} thread)")
    for c in ("problem", "compiled", "correct", "speedup", "kernel µs", "baseline µs", "baseline", "note"):
        t.add_column(c)
    for r in results:
        base = min(x for x in (r.eager_s, r.compile_s) if x is not None) if r.eager_s else None
        t.add_row(r.name, "yes" if r.compiled else "no", "yes" if r.correct else "no",
                  f"{r.speedup:.2f}x" if r.speedup else "-", f"{r.time_s * 1e6:.1f}" if r.time_s else "-",
                  f"{base * 1e6:.1f}" if base else "-", r.baseline_kind or "-",
                  (f"FLAGGED: {r.flagged}" if r.flagged else (r.error or ""))[:80])
    console.print(t)
    m = rep["metrics"]
    gm = m["geomean_speedup_correct"]
    console.print(f"fast_0 {m['fast_0']:.2f}  fast_1 {m['fast_1']:.2f}  fast_1.5 {m['fast_1.5']:.2f}  geomean speedup "
                  f"(correct) {gm:.2f}x  (all, failures as 1x) {m['geomean_speedup_all']:.2f}x  [measured]"
                  if gm else f"fast_0 {m['fast_0']:.2f}: no correct kernel")
    if usage.calls and usage.tokens_in:
        console.print(f"tokens: {usage.tokens_in} in, {usage.tokens_out} out, ${usage.cost_usd:.4f}")
    console.print(f"attempts, code and logs: {out}")


@kforge_app.command("register")
@handles_errors
def register_cmd(
    problem: str = typer.Argument(..., help="the problem (shipped name or file) the kernel solves"),
    kernel: Path | None = typer.Option(None, "--kernel", help="a passing offline-format candidate file"),
    run: Path | None = typer.Option(None, "--run", help="a `kforge run` folder: take this problem's best kernel"),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Turn a passing kernel into a hetforge op, substitute it into captured graphs, and check fidelity end to end."""
    import torch

    from hetforge.kforge import register
    from hetforge.kforge.harness import cache_root
    from hetforge.kforge.problems import resolve

    ps = resolve(problem)
    if len(ps) != 1:
        raise UsageError("register takes exactly one problem")
    p = ps[0]
    measured = None
    if (kernel is None) == (run is None):
        raise UsageError("give exactly one of --kernel FILE or --run DIR")
    if run is not None:
        sj = run / "summary.json"
        if not sj.is_file():
            raise UsageError(f"'{run}' holds no summary.json (is it a `kforge run` folder?)")
        row = next((r for r in json.loads(sj.read_text())["problems"] if r["name"] == p.name), None)
        if row is None or not row["correct"] or not row["best_code"]:
            raise UsageError(f"run '{run}' has no passing kernel for '{p.name}'")
        kernel, measured = Path(row["best_code"]), row["time_s"]
    if not kernel.is_file():
        raise UsageError(f"kernel file '{kernel}' does not exist")
    reg = register.register_kernel(p, kernel, measured)
    mod = p.load()
    torch.manual_seed(0)
    inner = mod.Model(*mod.get_init_inputs()).eval()
    xs = tuple(mod.get_inputs())

    class Wrapped(torch.nn.Module):
        """The problem inside a larger model: a tanh before it and a +1 after it."""

        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, *a):
            return self.inner(torch.tanh(a[0]), *a[1:]) + 1.0

    checks = {"problem model": register.fidelity(inner, xs, reg), "wrapped model": register.fidelity(Wrapped(), xs,
                                                                                                      reg)}
    manifest = register.save_manifest(reg, cache_root() / "ops")
    rep = {"op": reg.op_name, "kernel": str(kernel), "measured_s": measured, "devices": ["cpu"],
           "manifest": str(manifest), "fidelity": checks}
    if json_out:
        emit_json(rep)
    else:
        console.print(f"registered {reg.op_name} (cpu; kernel {kernel})")
        for k, c in checks.items():
            console.print(f"  {k}: substituted {c['substituted']}x, max abs error {c['max_abs_err']:.3g} "
                          f"({'ok' if c['ok'] else 'FAILED'})")
    if not all(c["ok"] for c in checks.values()):
        from hetforge.errors import HetforgeError

        raise HetforgeError(f"fidelity check failed for {reg.op_name}")
