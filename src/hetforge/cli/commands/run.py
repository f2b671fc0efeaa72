"""``hetforge run MODEL --prompt TEXT``: generate text, streaming tokens, then print measured timings."""

from __future__ import annotations

import sys

import typer

from hetforge.cli.common import app, console, emit_json, err_console, handles_errors


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
    soc: str = typer.Option("host", "--soc", help="SoC profile to compile for"),
    executor: str = typer.Option("auto", "--executor", help="auto, backend or fx (see docs/arch/runtime.md)"),
    threads: int = typer.Option(0, "--threads", help="CPU threads for torch (0 = torch's default)"),
    quantize: str = typer.Option("none", "--quantize", help="weights of every linear: none, w8, w4 or w8a8"),
    group_size: int = typer.Option(128, "--group-size", help="w4 quantization group size (32, 64, 128, 256)"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="keep going past the end-of-text token"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON document instead of streaming"),
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
    engine = make_engine(model, soc, executor, quantize, group_size)
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
    if json_out:
        import torch

        emit_json({"model": engine.loaded.name, **r.to_dict(), "soc": soc, "threads": torch.get_num_threads(),
                   "programs": [p.to_dict() for p in engine.programs.programs.values()]})
    else:
        sys.stdout.write("\n")
        console.print(summary_line(r), style="dim", highlight=False, soft_wrap=True)
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


def make_engine(model: str, soc: str, executor: str, quantize: str = "none", group_size: int = 128):
    """Load ``model`` and build an :class:`~hetforge.runtime.Engine` (validates the SoC name and the
    quantization options first)."""
    from hetforge.hardware import load_soc
    from hetforge.models.zoo import load_model
    from hetforge.quant import check_options
    from hetforge.runtime import Engine

    load_soc(soc)  # an unknown profile is a usage error before any model work
    check_options(quantize, group_size, ())
    return Engine(load_model(model), executor=executor, soc=soc, quantize=quantize, group_size=group_size)
