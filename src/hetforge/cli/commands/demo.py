"""``hetforge demo``: compile the shipped demo model for the host and generate text, offline, in seconds."""

from __future__ import annotations

import sys
import time

import typer

from hetforge.cli import options as opt
from hetforge.cli.common import app, console, emit_json, handles_errors

DEFAULT_MODEL = "demo"
DEFAULT_PROMPT = "The for statement is used to"


@app.command()
@handles_errors
def demo(
    model: str = typer.Option(DEFAULT_MODEL, "--model", help="model to run the demo on"),
    prompt: str = typer.Option(DEFAULT_PROMPT, "--prompt", help="text to continue"),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", "-n", help="tokens to generate"),
    soc: opt.Soc = "host",
    threads: int = typer.Option(1, "--threads", help="CPU threads (a 4 M-parameter model gains nothing from more)"),
    json_out: opt.Json = False,
) -> None:
    """Compile the demo model's prefill and decode programs, generate text, check it against Hugging Face."""
    import torch

    from hetforge.cli.commands.run import make_engine, set_threads, summary_line
    from hetforge.runtime import SamplingParams

    set_threads(threads)
    t0 = time.perf_counter()
    engine = make_engine(model, soc, "auto")
    loaded = engine.loaded
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_new_tokens=max_new_tokens, repetition_penalty=1.2)
    gen = engine.stream(prompt, params)
    if not json_out:
        console.print(f"[bold]hetforge demo[/] — {loaded.name}: {loaded.num_parameters / 1e6:.2f} M parameters, "
                      f"{loaded.weights}; tokenizer {engine.tokenizer.name}; executor {engine.executor.name}, "
                      f"soc {soc}, {threads} thread(s)", highlight=False, soft_wrap=True)
        sys.stdout.write(f"\n{prompt}")
        sys.stdout.flush()
    for piece in gen:
        if not json_out:
            sys.stdout.write(piece)
            sys.stdout.flush()
    r = gen.result
    # the same request through Hugging Face generate (same repetition penalty, greedy) as a check
    ids = torch.tensor([engine.encode(prompt)])
    with torch.no_grad():
        ref = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(r.tokens),
                                    do_sample=False, repetition_penalty=params.repetition_penalty)
    matches = ref[0, ids.shape[1]:].tolist() == r.tokens
    programs = [p.to_dict() for p in engine.programs.programs.values()]
    training = loaded.extra.get("training", {})
    total_s = time.perf_counter() - t0
    if json_out:
        emit_json({"model": loaded.name, "parameters": loaded.num_parameters, "weights": loaded.weights, "soc": soc,
                   "threads": torch.get_num_threads(), "load_s": load_s, "programs": programs,
                   "generation": r.to_dict(),
                   "matches_hugging_face_generate": matches, "total_s": total_s,
                   "training": {k: training.get(k) for k in ("final_train_loss", "final_val_loss", "steps")}})
    else:
        sys.stdout.write("\n\n")
        for p in programs:
            console.print(f"  {p['kind']:7s} program, static length {p['length']:4d}: capture {p['capture_s']:.2f} s + "
                          f"passes {p['optimize_s']:.2f} s + compile {p['compile_s']:.2f} s (measured); "
                          f"{p['nodes']} nodes", highlight=False, soft_wrap=True)
        console.print(f"  generate : {summary_line(r)}", highlight=False, soft_wrap=True)
        console.print(f"  check    : tokens {'equal' if matches else 'DIFFER from'} Hugging Face generate "
                      f"(greedy, repetition penalty {params.repetition_penalty})", highlight=False, soft_wrap=True)
        if training:
            console.print(f"  training : {training.get('steps')} steps, train loss {training.get('final_train_loss')}, "
                          f"validation loss {training.get('final_val_loss')} (recorded by scripts/train_demo.py)",
                          highlight=False, soft_wrap=True)
        console.print(f"  total    : {total_s:.1f} s wall (measured)", highlight=False)
    if not matches:
        raise typer.Exit(1)
