"""``hetforge bench peers``: hetforge against HF eager, torch.export, torch.compile, ONNX Runtime, OpenVINO."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer
from rich.table import Table

from hetforge.cli import options as opt
from hetforge.cli.common import app, console, emit_json, err_console, handles_errors

bench_app = typer.Typer(help="Benchmarks: hetforge against the systems users would pick instead.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _split(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [x for v in values for x in v.replace(",", " ").split()]


def _command_line(cfg, out_dir: Path | None, json_out: bool, in_process: bool, no_warm: bool,
                  name: str = "peers") -> str:
    """The exact command that reproduces this run, rebuilt from the resolved options."""
    parts = ["hetforge", "bench", "peers", "--models", ",".join(cfg.models), "--systems", ",".join(cfg.systems),
             "--repeats", str(cfg.repeats), "--seq", str(cfg.seq), "--threads", str(cfg.threads)]
    parts += ["--quick"] if cfg.quick else ["--decode-tokens", str(cfg.decode_tokens)]
    parts += ["--no-warm"] if no_warm and not cfg.quick else []
    parts += ["--budget-s", f"{cfg.budget_s:g}"] if cfg.budget_s is not None else []
    parts += ["--limit-s", f"{cfg.limit_s:g}"] if cfg.limit_s is not None else []
    parts += ["--timeout-s", f"{cfg.timeout_s:g}"] if cfg.timeout_s != 600.0 else []
    parts += ["--side-rounds", str(cfg.side_rounds)] if cfg.side_rounds != 15 else []
    parts += ["--in-process"] if in_process else []
    parts += ["--out-dir", str(out_dir)] if out_dir is not None else []
    parts += ["--name", name] if name != "peers" else []
    parts += ["--json"] if json_out else []
    return " ".join(shlex.quote(p) for p in parts)


@bench_app.command("peers")
@handles_errors
def peers(
    models: list[str] | None = typer.Option(None, "--models", "-m",
                                            help="zoo names (repeat or comma-separate); default gpt2, llama-110m, "
                                                 "mixtral-small (gpt2-tiny, llama-tiny with --quick)"),
    systems: list[str] | None = typer.Option(None, "--systems", "-s",
                                             help="subset of: hetforge, hetforge-bf16, hetforge-w8, hetforge-w4, "
                                                  "eager, export, compile, ort, ov-default, ov-f32, ov-stateful-f32, "
                                                  "ov-stateful, llamacpp-f32, llamacpp-q8, llamacpp-q4 (default all)"),
    repeats: int = typer.Option(3, "--repeats", "-n", help="fresh-process repeats per system"),
    quick: bool = typer.Option(False, "--quick", help="1 repeat, few calls per figure, no warm-cache runs, "
                                                      "tiny models unless --models is given"),
    seq: int = typer.Option(128, "--seq", help="prefill sequence length"),
    decode_tokens: int = typer.Option(128, "--decode-tokens",
                                      help="new tokens per timed decode request (quick mode: 8)"),
    threads: int = typer.Option(2, "--threads", help="threads every system gets"),
    no_warm: bool = typer.Option(False, "--no-warm", help="skip the warm (cached) preparation runs"),
    budget_s: float | None = typer.Option(None, "--budget-s",
                                          help="start no repeat after the first once this many seconds have passed"),
    limit_s: float | None = typer.Option(None, "--limit-s",
                                         help="start no process at all after this many seconds (rows say 'not run')"),
    timeout_s: float = typer.Option(600.0, "--timeout-s", help="per-process time limit"),
    side_rounds: int = typer.Option(15, "--side-rounds",
                                    help="rounds of the side-by-side phase after the suite: hetforge and its closest "
                                         "peers loaded at once, their prefill and one-token calls timed in turns "
                                         "(0: none; not with --in-process)"),
    in_process: bool = typer.Option(False, "--in-process", help="run systems in this process (RSS not per system)"),
    out_dir: Path | None = typer.Option(None, "--out-dir", help="write peers.md, peers.png and peers.json here"),
    name: str = typer.Option("peers", "--name", help="file stem of the page, chart and JSON in --out-dir "
                                                     "(e.g. peers_decode → peers_decode.md)"),
    json_out: bool = typer.Option(False, "--json", help="print JSON (progress goes to stderr)"),
    w8_act: opt.W8Act = None,
    w4_act: opt.W4Act = None,
    from_json: Path | None = typer.Option(None, "--from-json", help="measure nothing: re-render the page, chart and "
                                          "JSON of an earlier run from its JSON (next to it), the ratios and targets "
                                          "recomputed by today's rules"),
) -> None:
    """Run the peer suite: prep time, prefill, one token, decode, peak RSS and fidelity per system (measured)."""
    from hetforge.benchmarks.harness import DEFAULT_MODELS, QUICK_MODELS, SuiteConfig, run_suite
    from hetforge.benchmarks.report import fmt, write_report
    from hetforge.benchmarks.systems import SYSTEMS
    from hetforge.kernels import native

    if from_json is not None:
        from hetforge.benchmarks.report import rerender

        for k, v in rerender(from_json).items():
            console.print(f"{k} written to {v}")
        return

    native.set_w8_act(w8_act)  # exported: the systems' processes inherit it (and the page's command records it)
    native.set_w4_act(w4_act)
    if out_dir is not None:
        from hetforge.files import check_output_dir

        check_output_dir(out_dir, "--out-dir")  # before minutes of benchmarking
    model_list = _split(models) or (list(QUICK_MODELS) if quick else list(DEFAULT_MODELS))
    cfg = SuiteConfig(models=model_list, systems=_split(systems) or list(SYSTEMS), repeats=1 if quick else repeats,
                      quick=quick, seq=seq, decode_tokens=decode_tokens, threads=threads, isolate=not in_process,
                      warm=not (no_warm or quick),
                      timeout_s=timeout_s, budget_s=budget_s, limit_s=limit_s, max_repeats={"mixtral-small": 1},
                      side_rounds=side_rounds)
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        from hetforge.errors import UsageError

        raise UsageError(f"--name '{name}' must be letters, digits, '-' or '_' (a file stem)")
    command = _command_line(cfg, out_dir, json_out, in_process, no_warm, name)
    res = run_suite(cfg, progress=lambda m: err_console.print(m, highlight=False), command=command)
    paths = write_report(res, out_dir, stem=name) if out_dir is not None else {}
    if json_out:
        d = res.to_dict()
        d["written"] = {k: str(v) for k, v in paths.items()}
        emit_json(d)
        return
    for model in cfg.models:
        t = Table(title=f"{model}: measured, median (min–max) over {cfg.repeats} repeat(s)")
        for col in ("system", "status", "cold prep s", "warm prep s", f"prefill [1,{seq}] ms", "one token ms",
                    "decode ms/tok", "peak RSS MB", "KL max"):
            t.add_column(col)
        for r in (r for r in res.rows if r.model == model):
            name = r.system + (f" [{r.precision}]" if r.precision not in ("", "f32", "float32") else "")
            status = "ok" if r.runs_ok and not r.error else f"{r.status}: {r.error[:80]}"
            t.add_row(name, status, fmt(r.prep_s, 2),
                      fmt(r.warm_prep_s, 2), fmt(r.prefill_ms), fmt(r.step_ms), fmt(r.decode_ms_per_token),
                      fmt(r.rss_peak_mb, 0), "—" if r.kl_max is None else f"{r.kl_max:.1e}")
        console.print(t)
    for k, v in paths.items():
        console.print(f"{k} written to {v}")
