"""``hetforge run MODEL --prompt TEXT``: generate text on placed programs, streaming tokens, then print measured
host timings and, for the SoC, modeled time and energy per token per device."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from hetforge.cli import options as opt
from hetforge.cli.commands.hetero import BACKEND_HELP, POLICY_HELP
from hetforge.cli.common import app, console, emit_json, err_console, handles_errors
from hetforge.runtime.select import MAX_CANDIDATES


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
        out.append(f"{label} on {pl['soc']}: {f['modeled_ms']:.3f} ms (pipelined period "
                   f"{f['modeled_bottleneck_ms']:.3f} ms), {f['modeled_mj']:.3f} mJ (modeled; "
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


def threads_line(r) -> str | None:
    """The thread counts a request ran on (measured choices of the adaptive tuner), or None where none were noted."""
    t = getattr(r, "threads_used", None) or {}
    if "prefill" not in t:
        return None
    steps = ", ".join(f"{n} thread{'s' if n > 1 else ''} × {c}" for n, c in t.get("decode_steps", {}).items())
    return (f"threads: prefill on {t['prefill']} ({t['prefill_reason']})"
            + (f"; decode steps on {steps}" if steps else ""))


def summary_line(r) -> str:
    """One line of measured figures for a finished (or interrupted) generation."""
    dec = f"{r.decode_ms_per_token:.2f} ms/token" if r.decode_ms_per_token is not None else "n/a (1 token)"
    tps = f"{r.tokens_per_s:.1f} tokens/s" if r.tokens_per_s else "n/a"
    side, cache = getattr(r, "built_alongside", {}), getattr(r, "compile_cache", {})
    comp = ", ".join(f"{k} {v:.2f} s" + (f" (built alongside the prefill program in a forked child: {side[k]:.2f} s of "
                                          "its own)" if k in side else "")
                     + (f" (compile cache {cache[k]})" if k in cache else "")
                     for k, v in r.compile_s.items()) or "none (programs cached)"
    pre = " + ".join(getattr(r, "prefill_pieces", None) or [f"tier {r.prefill_tier}"])  # e.g. prefill-64 + chunk-32
    return (f"{len(r.tokens)} tokens ({r.stop_reason}) | time to first token {1e3 * r.ttft_s:.1f} ms | decode {dec} | "
            f"{tps} (measured, executor {r.executor}) | prefill {pre}, KV cache {r.cache_length} "
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
    w8_act: opt.W8Act = None,
    w4_act: opt.W4Act = None,
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="keep going past the end-of-text token"),
    json_out: opt.Json = False,
    report: Path = typer.Option(None, "--report", help="also write an offline HTML report of this generation "
                                "(per-token measured and modeled figures, placement, timeline)"),
    candidates: int = typer.Option(1, "--candidates", help=f"decode K candidates as one batch and choose one "
                                   f"(1..{MAX_CANDIDATES}; 1 = plain decoding)"),
    select: str = typer.Option("csvet", "--select", help="how a candidate is chosen: csvet, best-of or majority"),
    match: str = typer.Option(None, "--match", help="structural filter: a regex the whole candidate must match "
                              "(group 1, if any, is the answer)"),
    schema: Path = typer.Option(None, "--schema", help="structural filter: a JSON schema file candidates must satisfy"),
    require_stop: bool = typer.Option(False, "--require-stop", help="structural filter: drop candidates cut off "
                                      "by the token limit"),
    max_entropy: float = typer.Option(1.5, "--max-entropy", help="entropy filter: drop candidates whose mean token "
                                      "entropy is above this (nats)"),
    greedy_anchor: bool = typer.Option(False, "--greedy-anchor", help="with --candidates: candidate 0 decodes "
                                       "greedily, the others sample (selection starts from the greedy answer)"),
    verifier: str = typer.Option("auto", "--verifier", help="with --candidates: the self-verification score: auto "
                                 "(the model's declared verifier when it ships one, e.g. arith-demo's "
                                 "re-derivation under equivalent prompts, else the log-probability), yesno (its "
                                 "yes/no verifier entry) or logprob"),
    inject_fault: str = typer.Option(None, "--inject-fault",
                                     help="DEVICE@TOKEN: the device fails while that new token is computed; the "
                                          "runtime re-plans onto the survivors and goes on"),
    set_load: list[str] = typer.Option(None, "--set-load", help="DEVICE=FRACTION[@TOKEN]: other work takes that "
                                       "share of the device from that token on; re-placed (repeatable)"),
    set_temp: list[str] = typer.Option(None, "--set-temp", help="DEVICE=CELSIUS[@TOKEN]: the device's temperature "
                                       "from that token on (Φ, throttling); re-placed (repeatable)"),
    failover_plans: str = typer.Option("ahead", "--failover-plans",
                                       help="ahead (compile plans for every single-device failure before the "
                                            "request) or on-demand (compile after a fault)"),
    moe_calibration: Path = typer.Option(None, "--moe-calibration", help="MoE: run expert groups on the devices "
                                         "the residency model picks (a file from `hetforge moe calibrate`)"),
    moe_share: float = typer.Option(0.9, "--moe-share", help="MoE: hot tier covers this share of assignments"),
    moe_group_size: int = typer.Option(2, "--moe-group-size", help="MoE: experts per group (divides the experts)"),
    moe_capacity_factor: float = typer.Option(1.25, "--moe-capacity-factor", help="MoE: slots per expert = factor "
                                              "x T·k x its calibrated share"),
    moe_unlimited: bool = typer.Option(False, "--moe-unlimited", help="MoE: every expert T slots (nothing dropped)"),
    moe_objective: str = typer.Option("latency", "--moe-objective", help="MoE residency objective: latency, energy"),
    moe_place: str = typer.Option("auto", "--moe-place", help="MoE groups: auto (residency model), host (all on "
                                  "CPU/GPU) or npu (all on the NPU): the baselines"),
    cluster: str = typer.Option(None, "--cluster", help="run across the nodes of this cluster (a shipped name or a "
                                                        ".yaml) on Ray; see `hetforge cluster`"),
    address: str = typer.Option(None, "--address", help="with --cluster: join this Ray cluster (HOST:PORT) instead of "
                                                        "starting a local one"),
    spread: bool = typer.Option(False, "--spread", help="with --cluster: use every node (even layer split)"),
    fail_node: str = typer.Option(None, "--fail-node", help="with --cluster: kill NODE's actor after K tokens "
                                                            "(NODE:K), to see re-planning"),
    precision: str = typer.Option("fp32", "--precision", help="fp32, or bf16 (needs AVX512-BF16/AMX-BF16)"),
    allow_emulated: bool = typer.Option(False, "--allow-emulated", help="run bf16 on a CPU without bf16 "
                                        "instructions (converted in software, slower)"),
    prefill: str = typer.Option("fine", "--prefill", help="how a prompt is prefilled: fine (one program of about its "
                                "length: padded to a multiple of 8, by at most 1/8 from 64 tokens), chunked (tiers + "
                                "power-of-two chunks over the cache, fewer programs) or tier (padded to the next "
                                "power-of-two tier)"),
) -> None:
    """Generate text from MODEL, streaming tokens as they come, then print measured timings."""
    from hetforge.errors import UsageError
    from hetforge.kernels import native
    from hetforge.runtime import SamplingParams
    from hetforge.runtime.programs import check_prefill_mode

    native.set_w8_act(w8_act)
    native.set_w4_act(w4_act)
    check_prefill_mode(prefill)
    sel = select_params(candidates, select, match, schema, require_stop, max_entropy, greedy_anchor, verifier)
    if greedy_anchor and candidates == 1:
        raise UsageError("--greedy-anchor needs --candidates K with K >= 2 (it makes candidate 0 greedy)")
    if candidates != 1 and (report is not None or trace is not None):
        raise UsageError("--report and --trace describe one generation; they cannot be combined with --candidates")

    if not prompt:
        raise UsageError("the prompt is empty; give at least one token of text")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            repetition_penalty=repetition_penalty, stop=tuple(stop or ()), seed=seed,
                            ignore_eos=ignore_eos)
    set_threads(threads)
    if cluster is None and (address or spread or fail_node):
        raise UsageError("--address, --spread and --fail-node need --cluster FILE")
    if cluster is not None:
        from hetforge.cli.commands.cluster import run_on_cluster

        single = [name for name, used in (("--plan", plan), ("--trace", trace), ("--report", report),
                                          ("--candidates", candidates != 1), ("--inject-fault", inject_fault),
                                          ("--set-load", set_load), ("--set-temp", set_temp),
                                          ("--moe-calibration", moe_calibration),
                                          ("--precision", precision != "fp32")) if used]
        if single:
            raise UsageError(f"{', '.join(single)}: single-node option(s); drop them with --cluster")
        run_on_cluster(model, cluster, address, prompt, params, objective,
                       "stages" if strategy == "rules" else strategy, executor, spread, fail_node, json_out)
        return
    if trace is not None:
        from hetforge.files import check_output

        check_output(trace, "--trace", example="trace.json")
    if report is not None:
        from hetforge.files import check_output

        check_output(report, "--report", (".html", ".htm"), example="report.html")
    adaptive_opts = (inject_fault, set_load, set_temp, failover_plans)
    if failover_plans not in ("ahead", "on-demand"):
        raise UsageError(f"--failover-plans must be ahead or on-demand, got '{failover_plans}'")
    if candidates != 1 and (inject_fault or set_load or set_temp):
        raise UsageError("--inject-fault / --set-load / --set-temp cannot be combined with --candidates")
    if plan is None and (inject_fault or set_load or set_temp):
        from hetforge.runtime.replan import parse_options

        parse_options(load_soc_names(soc), *adaptive_opts)  # bad input refused before any model work
    moe = None
    if moe_calibration is not None:
        if candidates != 1 or inject_fault or set_load or set_temp:
            raise UsageError("--moe-calibration cannot be combined with --candidates, --inject-fault, --set-load "
                             "or --set-temp")
        moe = {"calibration": moe_calibration, "share": moe_share, "group_size": moe_group_size,
               "capacity_factor": moe_capacity_factor, "unlimited": moe_unlimited, "objective": moe_objective,
               "place": moe_place}
    from hetforge.precision import resolve_precision

    dtype = resolve_precision(precision, allow_emulated, quantize)
    engine = make_engine(model, soc, executor, quantize, group_size, strategy, objective, backend, policy, plan,
                         moe=moe, dtype=dtype, prefill=prefill)
    if report is not None:  # the report shows each program's compilation (graph, placement): compile them here
        engine.programs.disk_cache = False
    if candidates != 1:
        run_candidates(engine, prompt, params, sel, json_out, strategy)
        return
    adaptive = None
    if inject_fault or set_load or set_temp:
        from hetforge.runtime.replan import make_adaptive

        adaptive = make_adaptive(engine, *adaptive_opts)
    gen = (adaptive or engine).stream(prompt, params)
    interrupted = False
    failure = None
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
    except Exception as e:  # a device failure no survivor can take over: keep and print what was generated
        from hetforge.runtime.failover import FailoverError

        if not isinstance(e, FailoverError):
            if not json_out:  # end the echoed prompt's line, so the error is a line of its own
                sys.stdout.write("\n")
                sys.stdout.flush()
            raise
        failure = e
    r = gen.result
    trace_path = gen.ledger.trace(trace, f"hetforge run {engine.loaded.name} on {engine.soc_name}") if trace else None
    report_path = None
    if report is not None:
        report_path = write_generation_report(report, engine, gen, prompt, params, model, soc, strategy, objective,
                                              quantize, group_size)
    if json_out:
        import torch

        emit_json({"model": engine.loaded.name, **r.to_dict(), "soc": engine.soc_name,
                   "strategy": strategy, "threads": torch.get_num_threads(), "precision": precision,
                   "trace": str(trace_path) if trace_path else None,
                   "report": str(report_path) if report_path else None,
                   **({"adaptive": adaptive.summary()} if adaptive else {}),
                   **({"error": str(failure)} if failure else {}),
                   "programs": [p.to_dict() for p in engine.programs.programs.values()],
                   **moe_json(engine)})
    else:
        sys.stdout.write("\n")
        console.print(summary_line(r), style="dim", highlight=False, soft_wrap=True)
        tl = threads_line(r)
        for line in placed_lines(r) + moe_lines(engine) + ([tl] if tl else []):
            console.print(line, style="dim", highlight=False, soft_wrap=True)
        if trace_path:
            console.print(f"trace: {trace_path} (open in ui.perfetto.dev)", style="dim", highlight=False)
        if report_path:
            console.print(f"report: {report_path} (open in a browser; works offline)", style="dim", highlight=False)
        if adaptive is not None:
            from hetforge.runtime.replan import adaptive_lines

            for line in adaptive_lines(adaptive):
                console.print(line, style="dim", highlight=False, soft_wrap=True)
    if failure is not None:
        raise failure
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
                policy: str = "exact", plan: Path | None = None, moe: dict | None = None, dtype=None,
                prefill: str = "fine"):
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
    if moe is not None:
        from hetforge.moe import check_plan_options

        if plan is not None or executor == "fx":
            raise UsageError("--moe-calibration needs placed programs: not with --plan or --executor fx")
        check_plan_options(moe["group_size"], moe["capacity_factor"], None, moe["share"])
        if moe["objective"] not in ("latency", "energy"):
            raise UsageError(f"--moe-objective '{moe['objective']}' must be latency or energy")
        from hetforge.runtime.moe_exec import PLACES

        if moe.get("place", "auto") not in PLACES:
            raise UsageError(f"--moe-place '{moe['place']}' must be one of {', '.join(PLACES)}")
    loaded = load_model(model) if dtype is None else load_model(model, dtype=dtype)
    if moe is not None:
        executor = moe_executor(loaded, moe, prof, quantize, group_size, strategy, objective, overrides, policy)
    engine = Engine(loaded, executor=executor, soc=prof, quantize=quantize, group_size=group_size,
                    strategy=strategy, objective=objective, backends=overrides, policy=policy, prefill=prefill)
    if plan is not None:
        from hetforge.runtime.genplan import load_genplan

        load_genplan(plan, engine)
    return engine


def write_generation_report(path: Path, engine, gen, prompt: str, params, model: str, soc: str, strategy: str,
                            objective: str, quantize: str, group_size: int) -> Path:
    """``--report``: the generation's HTML report (hetforge.report), written atomically."""
    import shlex

    from hetforge.report import generation_report_data, write_report

    data = generation_report_data(engine, gen.result, gen.ledger, prompt, strategy, objective, quantize)
    q = [] if quantize == "none" else ["--quantize", quantize, "--group-size", str(group_size)]
    cmd = ["hetforge", "run", model, "-p", prompt, "-n", str(params.max_new_tokens), "--temperature",
           str(params.temperature), "--seed", str(params.seed), "--soc", soc, "--strategy", strategy,
           "--objective", objective, *q, "--report", str(path)]
    if params.top_k:
        cmd += ["--top-k", str(params.top_k)]
    if params.top_p < 1.0:
        cmd += ["--top-p", str(params.top_p)]
    if params.ignore_eos:
        cmd.append("--ignore-eos")
    obj = [] if strategy.partition(":")[0] == "support" else ["--objective", objective]
    compile_view = ["hetforge", "report", model, "--soc", soc, "--strategy", strategy, *obj, *q, "-o", "compile.html"]
    return write_report(path, data, [shlex.join(cmd), shlex.join(compile_view)], "--report")


def select_params(k: int, mode: str, match: str | None, schema: Path | None, require_stop: bool,
                  max_entropy: float, greedy_anchor: bool = False, verifier: str = "auto"):
    """The validated :class:`~hetforge.runtime.select.SelectParams` of ``hetforge run --candidates``."""
    import json

    from hetforge.errors import UsageError
    from hetforge.runtime.select import SelectParams

    doc = None
    if schema is not None:
        if not schema.is_file():
            raise UsageError(f"--schema file '{schema}' does not exist")
        try:
            doc = json.loads(schema.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"--schema file '{schema}' is not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise UsageError(f"--schema file '{schema}' must hold a JSON object (a JSON schema)")
    return SelectParams(k=k, mode=mode, match=match, schema=doc, require_stop=require_stop, max_entropy=max_entropy,
                        greedy_anchor=greedy_anchor, verifier=verifier)


def run_candidates(engine, prompt: str, params, sel, json_out: bool, strategy: str) -> None:
    """Decode ``sel.k`` candidates as one batch, choose one, print it and the per-request record."""
    from hetforge.runtime.candidates import generate_candidates

    res = generate_candidates(engine, prompt, params, sel)
    if json_out:
        emit_json({"model": engine.loaded.name, "prompt": prompt, "soc": engine.soc_name, "strategy": strategy,
                   "executor": engine.executor.name, **res.to_dict()})
        return
    sys.stdout.write(prompt + res.text + "\n")
    for c in res.candidates:
        early = c.stopped_early
        when = (f"; stopped early after {early['after_tokens']} tokens (step {early['step']}): {early['rule']}, "
                f"{early['why']}") if early else ""
        pyes = f"{c.verify_label} {c.verify_p:.3g}, " if c.verify_p is not None else ""
        console.print(f"  #{c.index} seed {c.seed}: {c.text!r} ({c.stop_reason}; {pyes}log-probability {c.score:.3f}, "
                      f"mean entropy {c.mean_entropy:.2f} nats, {c.energy_mj:.3f} mJ modeled){when} -> {c.verdict}",
                      style="dim", highlight=False, soft_wrap=True)
    energy = (f"{res.modeled_energy_mj:.3f} mJ modeled (budget for all {len(res.candidates)} to the token limit "
              f"{res.modeled_budget_mj or 0.0:.3f} mJ)" if res.modeled_energy_mj is not None
              else "no modeled energy (executor fx)")
    chosen = f"#{res.chosen.index}" if res.chosen is not None else "none"
    console.print(f"{len(res.candidates)} candidates started, {len(res.stopped_early)} stopped early | "
                  f"{res.steps} batched decode steps (batch sizes {res.batch_sizes}) | {energy} | "
                  f"{1e3 * res.measured_s:.1f} ms (measured) | chosen {chosen}: {res.why}",
                  style="dim", highlight=False, soft_wrap=True)
    skipped = f" ({res.verifier['skipped']})" if res.verifier.get("skipped") else ""
    console.print(f"verifier: {res.verifier.get('why', '')}{skipped}", style="dim", highlight=False, soft_wrap=True)
    if res.chosen is None:
        err_console.print("no candidate passed the filters")
        raise typer.Exit(1)


def load_soc_names(soc: str) -> list[str]:
    """Device names of the SoC profile ``soc`` (a usage error names the shipped profiles when unknown)."""
    from hetforge.hardware import load_soc

    return load_soc(soc).device_names


def moe_executor(loaded, moe: dict, prof, quantize: str, group_size: int, strategy: str, objective: str,
                 overrides: dict, policy: str):
    """The placed executor that runs MoE expert groups where the residency model puts them."""
    from hetforge.moe import load_calibration
    from hetforge.moe.residency import expert_dims
    from hetforge.runtime.moe_exec import MoeOptions, MoePlacedExecutor

    opts = MoeOptions(load_calibration(moe["calibration"], loaded), share=moe["share"], group_size=moe["group_size"],
                      capacity_factor=moe["capacity_factor"], unlimited=moe["unlimited"], objective=moe["objective"],
                      place=moe.get("place", "auto"))
    return MoePlacedExecutor(soc=prof, strategy=strategy, objective=objective, quantize=quantize,
                             group_size=group_size, backends=dict(overrides), policy=policy, moe=opts,
                             dims=expert_dims(loaded.model))


def moe_json(engine) -> dict:
    """``{"moe": {program: groups, devices, reasons}}`` for a run with --moe-calibration, else nothing."""
    from hetforge.runtime.moe_exec import moe_summary

    s = moe_summary(engine.executor)
    return {"moe": s} if s is not None else {}


def moe_lines(engine) -> list[str]:
    """One line per program: where each expert group ran (modeled residency decision)."""
    from hetforge.runtime.moe_exec import moe_summary

    out = []
    for label, e in (moe_summary(engine.executor) or {}).items():
        where = ", ".join(f"l{g['layer']}g{g['group']}→{g['device']}" for g in e["groups"])
        out.append(f"MoE groups in {label} ({e['tokens_per_call']} tokens per call; residency modeled): {where}")
    return out
