"""``hetforge run MODEL --prompt TEXT``: generate text on placed programs, streaming tokens, then print measured
host timings and, for the SoC, modeled time and energy per token per device."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from hetforge.cli import options as opt
from hetforge.cli.commands.hetero import BACKEND_HELP, POLICY_HELP
from hetforge.cli.common import app, console, emit_json, err_console, handles_errors


def placed_lines(r) -> list[str]:
    """Modeled SoC figures (prefill, decode per token, per device) and measured runner overheads."""
    pl = r.placed
    if not pl:
        return []
    out = []
    for key, label in (("prefill", "prefill"), ("decode_per_token", "decode, per token")):
        f = pl.get(key)
        if not f:
            continue
        devs = ", ".join(f"{d} {v['modeled_ms']:.3f} ms / {v['modeled_mj']:.3f} mJ" for d, v in f["by_device"].items())
        out.append(f"{label} on {pl['soc']}: {f['modeled_ms']:.3f} ms, {f['modeled_mj']:.3f} mJ (modeled; "
                   f"{devs}) | {f['switches']:.0f} switches, {f['transfers']:.0f} transfers "
                   f"({f['zero_copy']:.0f} zero-copy), {f['bytes_moved'] / 1024:.1f} KiB moved | host: "
                   f"{f['measured_transfer_ms']:.3f} ms in transfers, {f['measured_wall_ms']:.2f} ms wall (measured)")
    parts = pl.get("partitions", {}).get("decode") or pl.get("partitions", {}).get("prefill")
    if parts:
        where = ", ".join(f"{d}: {b['backend']}{' (emulated)' if b['emulated'] else ''}"
                          for d, b in pl["bindings"].items())
        out.append(f"plan: strategy {parts['strategy']}, {len(parts['partitions'])} partitions in decode, "
                   f"instructions {parts['instructions_by_device']} | backends {where}")
    return out


def summary_line(r) -> str:
    """One line of measured figures for a finished (or interrupted) generation."""
    dec = f"{r.decode_ms_per_token:.2f} ms/token" if r.decode_ms_per_token is not None else "n/a (1 token)"
    tps = f"{r.tokens_per_s:.1f} tokens/s" if r.tokens_per_s else "n/a"
    comp = ", ".join(f"{k} {v:.2f} s" for k, v in r.compile_s.items()) or "none (programs cached)"
    return (f"{len(r.tokens)} tokens ({r.stop_reason}) | time to first token {1e3 * r.ttft_s:.1f} ms | decode {dec} | "
            f"{tps} (measured, executor {r.executor}) | prefill tier {r.prefill_tier}, KV cache {r.cache_length} "
            f"positions = {r.kv_cache_bytes / 2**20:.2f} MiB | compiled: {comp} (measured)")


@app.command()
@handles_errors
def run(
    model: str = typer.Argument(..., help="zoo name (e.g. demo, gpt2-tiny) or a local Hugging Face folder"),
    prompt: str = typer.Option(..., "--prompt", "-p", help="the text to continue"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="tokens to generate"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy"),
    top_k: int = typer.Option(0, "--top-k", help="keep the k most likely tokens (0 = off)"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus sampling mass, in (0, 1]"),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help="> 1 discourages repeats"),
    stop: list[str] = typer.Option(None, "--stop", help="stop when this text appears (repeatable)"),
    seed: int = typer.Option(0, "--seed", help="seed of this request's random generator"),
    soc: opt.Soc = "host",
    strategy: opt.GenerationStrategy = opt.STRATEGY,
    objective: opt.Objective = opt.OBJECTIVE,
    backend: list[str] = typer.Option(None, "--backend", help=BACKEND_HELP),
    policy: str = typer.Option("exact", "--policy", help=POLICY_HELP),
    plan: Path = typer.Option(None, "--plan", help="a generation plan from `hetforge compile --generate --out`"),
    trace: Path = typer.Option(None, "--trace", help="write a Perfetto trace of the whole generation"),
    executor: str = typer.Option("auto", "--executor", help="auto (= backend: placed programs) or fx (reference)"),
    threads: int = typer.Option(0, "--threads", help="CPU threads for torch (0 = torch's default)"),
    quantize: opt.Quantize = opt.QUANTIZE,
    group_size: opt.GroupSize = opt.GROUP_SIZE,
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="keep going past the end-of-text token"),
    json_out: opt.Json = False,
) -> None:
    """Generate text from MODEL, streaming tokens as they come, then print measured timings."""
    from hetforge.errors import UsageError
    from hetforge.runtime import SamplingParams

    if not prompt:
        raise UsageError("the prompt is empty; give at least one token of text")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            repetition_penalty=repetition_penalty, stop=tuple(stop or ()), seed=seed,
                            ignore_eos=ignore_eos)
    set_threads(threads)
    if trace is not None:
        from hetforge.files import check_output

        check_output(trace, "--trace", example="trace.json")
    engine = make_engine(model, soc, executor, quantize, group_size, strategy, objective, backend, policy, plan)
    gen = engine.stream(prompt, params)
    interrupted = False
    try:
        if not json_out:
            sys.stdout.write(prompt)
            sys.stdout.flush()
        for piece in gen:
            if not json_out:
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:
        interrupted = True
        gen.result.stop_reason = "interrupted"
        gen.finish()
    r = gen.result
    trace_path = gen.ledger.trace(trace, f"hetforge run {engine.loaded.name} on {engine.soc_name}") if trace else None
    if json_out:
        import torch

        emit_json({"model": engine.loaded.name, **r.to_dict(), "soc": engine.soc_name,
                   "strategy": strategy, "threads": torch.get_num_threads(),
                   "trace": str(trace_path) if trace_path else None,
                   "programs": [p.to_dict() for p in engine.programs.programs.values()]})
    else:
        sys.stdout.write("\n")
        console.print(summary_line(r), style="dim", highlight=False, soft_wrap=True)
        for line in placed_lines(r):
            console.print(line, style="dim", highlight=False, soft_wrap=True)
        if trace_path:
            console.print(f"trace: {trace_path} (open in ui.perfetto.dev)", style="dim", highlight=False)
    if interrupted:
        err_console.print(f"interrupted after {len(r.tokens)} tokens")
        raise typer.Exit(130)


def set_threads(threads: int) -> None:
    """Set torch's CPU thread count (0 keeps the default); negative is a usage error."""
    import torch

    from hetforge.errors import UsageError

    if threads < 0:
        raise UsageError(f"--threads must be >= 0 (got {threads}); 0 keeps torch's default")
    if threads:
        torch.set_num_threads(threads)


def make_engine(model: str, soc: str, executor: str, quantize: str = "none", group_size: int = 128,
                strategy: str = "rules", objective: str = "energy", backend: list[str] | None = None,
                policy: str = "exact", plan: Path | None = None):
    """Load ``model`` and build an :class:`~hetforge.runtime.Engine` (validates the SoC, strategy, objective,
    backends and quantization options before any model work)."""
    from hetforge.backends.emulated import POLICIES
    from hetforge.backends.mapping import parse_overrides
    from hetforge.errors import UsageError
    from hetforge.hardware import load_soc
    from hetforge.models.zoo import load_model
    from hetforge.placement import get_strategy
    from hetforge.placement.costs import check_objective
    from hetforge.quant import check_options
    from hetforge.runtime import Engine

    if plan is not None:
        from hetforge.runtime.genplan import read_genplan_header

        head = read_genplan_header(plan)
        soc, strategy, objective, quantize, group_size = (head["soc_profile"], head["strategy"], head["objective"],
                                                          head["quantize"], head["group_size"])
    prof = soc if not isinstance(soc, str) else load_soc(soc)  # an unknown profile is a usage error first
    get_strategy(strategy.partition(":")[0])
    check_objective(objective)
    if policy not in POLICIES:
        raise UsageError(f"unknown --policy '{policy}'; allowed: {', '.join(POLICIES)}")
    overrides = parse_overrides(backend, prof.device_names)
    check_options(quantize, group_size, ())
    loaded = load_model(model)
    engine = Engine(loaded, executor=executor, soc=prof, quantize=quantize, group_size=group_size,
                    strategy=strategy, objective=objective, backends=overrides, policy=policy)
    if plan is not None:
        from hetforge.runtime.genplan import load_genplan

        load_genplan(plan, engine)
    return engine
