"""``hetforge cluster list|show|plan`` and ``hetforge run MODEL --cluster FILE``: several edge nodes, on Ray."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from hetforge.cli import options as opt
from hetforge.cli.common import app, console, emit_json, err_console, handles_errors
from hetforge.errors import UsageError

cluster_app = typer.Typer(help="Several edge nodes: cluster profiles, placement across nodes (the network in the "
                               "cost model); `hetforge run MODEL --cluster FILE` runs on Ray.", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")

OBJECTIVES = ("latency", "energy", "balanced")


@cluster_app.command("list")
@handles_errors
def list_cmd(json_out: opt.Json = False) -> None:
    """The shipped cluster profiles."""
    from hetforge.cluster.spec import load_cluster, shipped_clusters

    rows = [load_cluster(n).to_dict() for n in shipped_clusters()]
    if json_out:
        emit_json(rows)
        return
    for r in rows:
        nodes = ", ".join(f"{n['name']}={n['soc']}" for n in r["nodes"])
        console.print(f"{r['name']}: {r['description']} | nodes {nodes}", highlight=False, soft_wrap=True)


@cluster_app.command("show")
@handles_errors
def show_cmd(cluster: str = typer.Argument(..., help="a shipped cluster name or a cluster .yaml file"),
             json_out: opt.Json = False) -> None:
    """A cluster's nodes (SoC, devices, memory) and links (with the source of every figure)."""
    from hetforge.cluster.spec import load_cluster

    c = load_cluster(cluster)
    d = c.to_dict()
    if json_out:
        emit_json(d)
        return
    console.print(f"cluster {c.name}: {c.description} (home node {c.home})", highlight=False, soft_wrap=True)
    for n in d["nodes"]:
        console.print(f"  node {n['name']}: SoC {n['soc']}, devices {', '.join(n['devices'])}, "
                      f"{n['memory_bytes'] / 2**30:.2f} GiB", highlight=False)
    for ln in d["links"]:
        src = ln["sources"]
        est = [k for k, v in src.items() if v.get("estimate")]
        console.print(f"  link {ln['a']}<->{ln['b']}: {ln['bandwidth'] / 1e6:.1f} MB/s, "
                      f"{1e6 * ln['latency_s']:.0f} us, {1e9 * ln['energy_per_byte_j']:.2f} nJ/B"
                      + (f" (estimates: {', '.join(est)})" if est else ""),
                      highlight=False, soft_wrap=True)


def _check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise UsageError(f"unknown --objective '{objective}'; allowed: {', '.join(OBJECTIVES)}")


@cluster_app.command("plan")
@handles_errors
def plan_cmd(
    model: str = typer.Argument(..., help="zoo name, local HF folder, or a shape-only model (llama-3.1-8b-shape)"),
    cluster: str = typer.Option(..., "--cluster", help="a shipped cluster name or a cluster .yaml file"),
    objective: opt.Objective = opt.OBJECTIVE,
    context: int = typer.Option(None, "--context", help="KV cache positions to hold (default: model maximum; "
                                                        "4096 for shape-only models)"),
    spread: bool = typer.Option(False, "--spread", help="use every node, layers split evenly (not by the cost model)"),
    json_out: opt.Json = False,
) -> None:
    """Place MODEL's layers over the cluster's nodes and their devices; modeled per-token time, energy, wire bytes."""
    from hetforge.cluster.models import plan_model
    from hetforge.cluster.spec import load_cluster
    from hetforge.cluster.timeline import token_timeline

    _check_objective(objective)
    c = load_cluster(cluster)
    plan = plan_model(model, c, objective, context, spread)
    tl = token_timeline(plan)
    if json_out:
        emit_json({"model": model, **plan.to_dict(), "timeline": tl.to_dict()})
        return
    for line in plan_lines(plan):
        console.print(line, highlight=False, soft_wrap=True)


def plan_lines(plan) -> list[str]:
    out = [f"plan on {plan.cluster.name} ({plan.objective}, {plan.search.get('method')}): {plan.describe()}"]
    for st in plan.stages:
        out.append(f"  stage {st.index} {st.label}: devices {st.devices or '-'}, holds "
                   f"{st.weight_bytes / 2**20:.1f} MiB weights + {st.kv_bytes / 2**20:.1f} MiB KV; "
                   f"{st.modeled_s * 1e3:.3f} ms, "
                   f"{st.modeled_j * 1e3:.3f} mJ per token (modeled)")
    for h in plan.hops:
        out.append(f"  network {h.src}->{h.dst} before {h.before}: {h.nbytes:,.0f} B, {h.modeled_s * 1e3:.3f} ms, "
                   f"{h.modeled_j * 1e3:.4f} mJ per token (modeled)")
    for n, m in plan.memory.items():
        out.append(f"  memory {n}: {m['used'] / 2**30:.3f} of {m['capacity'] / 2**30:.2f} GiB")
    out.append(f"per token: {plan.modeled_s * 1e3:.3f} ms, {plan.modeled_j * 1e3:.3f} mJ, {plan.wire_bytes:,.0f} B on "
               "the wire (modeled)")
    out += [f"why: {e}" for e in plan.explain]
    return out


def parse_fail(text: str | None) -> tuple[str, int] | None:
    if not text:
        return None
    node, _, k = text.partition(":")
    if not node or not k.isdigit() or int(k) < 1:
        raise UsageError(f"--fail-node '{text}' must be NODE:K (kill NODE's actor after K tokens, K >= 1)")
    return node, int(k)


def run_on_cluster(model: str, cluster: str, address: str | None, prompt: str, params, objective: str,
                   strategy: str, executor: str, spread: bool, fail_node: str | None, json_out: bool) -> None:
    """The body of ``hetforge run MODEL --cluster FILE``."""
    from hetforge.cluster.spec import load_cluster
    from hetforge.models.zoo import load_model

    _check_objective(objective)
    c = load_cluster(cluster)
    fail = parse_fail(fail_node)
    if fail is not None and fail[0] not in c.node_names:
        raise UsageError(f"--fail-node: cluster '{c.name}' has no node '{fail[0]}'; nodes: {', '.join(c.node_names)}")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UsageError("running on a cluster needs Ray: pip install 'hetforge[cluster]'") from None
    from hetforge.cluster.ray_runtime import ClusterEngine

    loaded = load_model(model)
    engine = ClusterEngine(loaded, c, address=address, objective=objective, strategy=strategy, executor=executor,
                           spread=spread)
    try:
        def on_token(eng, k, token):
            if fail is not None and k == fail[1] and fail[0] in eng.actors:
                eng.kill_node(fail[0])

        r = engine.generate(prompt, params, on_token=on_token)
    finally:
        engine.close()
    if json_out:
        emit_json({"model": loaded.name, "cluster": c.name, **r.to_dict()})
    else:
        sys.stdout.write(prompt + r.text + "\n")
        plan = r.plans[-1]
        dec = f"{r.decode_ms_per_token:.2f} ms/token" if r.decode_ms_per_token is not None else "n/a"
        ovh = f"{r.overhead_ms_per_token:.2f}" if r.overhead_ms_per_token is not None else "n/a"
        console.print(f"{len(r.tokens)} tokens ({r.stop_reason}) on cluster {c.name} | decode {dec}, of which "
                      f"{ovh} ms outside the stages (Ray calls, object store) | compile {r.compile_s:.1f} s (measured)",
                      style="dim", highlight=False, soft_wrap=True)
        console.print(f"plan: {plan['plan']} | per token {plan['per_token']['modeled_ms']:.3f} ms, "
                      f"{plan['per_token']['modeled_mj']:.3f} mJ, {plan['per_token']['wire_bytes']:,.0f} B on the wire "
                      "(modeled)", style="dim", highlight=False, soft_wrap=True)
        for ev in r.failovers:
            what = f"re-planned: {ev['plan']}" if ev.get("replanned") else f"not re-planned: {ev.get('reason')}"
            console.print(f"node(s) {', '.join(ev['dead'])} died after {ev['after_tokens']} tokens; {what}",
                          style="dim", highlight=False, soft_wrap=True)
    if r.stop_reason.startswith("stopped:"):
        err_console.print(f"{r.stop_reason.removeprefix('stopped: ')}; generated {len(r.tokens)} tokens before: "
                          f"{r.text!r}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


@cluster_app.command("serve")
@handles_errors
def serve_cmd(
    model: str = typer.Argument(..., help="zoo name or local Hugging Face folder"),
    cluster: str = typer.Option(..., "--cluster", help="a shipped cluster name or a cluster .yaml file"),
    requests: Path = typer.Option(None, "--requests", help="UTF-8 text file, one prompt per line"),
    replicas: int = typer.Option(1, "--replicas", help="copies of the model, each on its own group of nodes"),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", "-n", help="tokens to generate per request"),
    objective: opt.Objective = opt.OBJECTIVE,
    spread: bool = typer.Option(False, "--spread", help="each replica uses all its nodes (even layer split)"),
    address: str = typer.Option(None, "--address", help="join this Ray cluster (HOST:PORT) instead of starting one"),
    http: bool = typer.Option(False, "--http", help="serve POST /generate on a local HTTP endpoint (Ray Serve) "
                                                    "instead of a requests file; runs until Ctrl-C"),
    host: str = typer.Option("127.0.0.1", "--host", help="--http: address to listen on"),
    port: int = typer.Option(8000, "--port", help="--http: port to listen on"),
    max_requests: int = typer.Option(None, "--max-requests", help="--http: stop after answering N generations"),
    max_batch: int = typer.Option(8, "--max-batch", help="--http: requests one replica holds and runs together "
                                                         "(more wait in Serve's proxy)"),
    json_out: opt.Json = False,
) -> None:
    """Serve every request of a file (or, with --http, of a local HTTP endpoint on Ray Serve) on the cluster on Ray:
    pipelined over the stages, spread over replicas."""
    from hetforge.cluster.spec import load_cluster

    if http == (requests is not None):
        raise UsageError("give either --requests FILE or --http")
    if http:
        _check_objective(objective)
        serve_http_cmd(model, load_cluster(cluster), replicas, host, port, objective, spread, address, max_requests,
                       max_batch, json_out)
        return
    from hetforge.cluster.throughput import modeled_pipeline, read_requests, replica_groups, serve
    from hetforge.models.zoo import load_model
    from hetforge.runtime import SamplingParams

    _check_objective(objective)
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    c = load_cluster(cluster)
    groups = replica_groups(c, replicas)
    prompts = read_requests(requests)
    from hetforge.cluster.ray_runtime import ClusterEngine, RaySession

    loaded = load_model(model)
    engines: list = []
    session = None
    try:
        from hetforge.cluster.models import plan_loaded

        for g in groups:  # plans first: a replica that cannot hold the model fails before Ray starts
            plan_loaded(loaded, g, objective, spread=spread)
        session = RaySession(c, address)
        engines = [ClusterEngine(loaded, g, objective=objective, spread=spread, session=session) for g in groups]
        res = serve(engines, prompts, SamplingParams(max_new_tokens=max_new_tokens))
    finally:
        for e in engines:
            e.close()
        if session is not None:
            session.close()
    modeled = [modeled_pipeline(e.plan) for e in engines]
    if json_out:
        emit_json({"model": loaded.name, "cluster": c.name, **res.to_dict(), "modeled": modeled})
        return
    for p, out in zip(prompts, res.texts, strict=True):
        console.print(f"{p}{out}", highlight=False, soft_wrap=True)
    console.print(f"{len(prompts)} requests, {res.total_tokens} tokens in {res.wall_s:.2f} s = {res.tokens_per_s:.1f} "
                  f"tokens/s on {replicas} replica(s), pipelined (measured)", style="dim", highlight=False)
    for e, m in zip(engines, modeled, strict=True):
        console.print(f"replica {e.plan.describe()}: {m['pipelined_tokens_per_s']:.1f} tokens/s pipelined, "
                      f"{m['single_tokens_per_s']:.1f} tokens/s one request (modeled; bottleneck {m['bottleneck']})",
                      style="dim", highlight=False, soft_wrap=True)


def serve_http_cmd(model: str, c, replicas: int, host: str, port: int, objective: str, spread: bool,
                   address: str | None, max_requests: int | None, max_batch: int, json_out: bool) -> None:
    """The body of ``hetforge cluster serve MODEL --cluster FILE --http``."""
    try:
        from hetforge.cluster.http_serve import check_port, serve_http
    except ImportError:
        raise UsageError("--http needs Ray Serve: pip install 'hetforge[cluster]'") from None
    from hetforge.cluster.throughput import replica_groups
    from hetforge.models.zoo import load_model

    check_port(host, port)  # before loading anything
    replica_groups(c, replicas)
    if not 1 <= max_batch <= 64:
        raise UsageError(f"--max-batch must be 1..64 (got {max_batch})")
    loaded = load_model(model)
    out = err_console if json_out else console

    def ready(url: str, plans: list[str]) -> None:
        for k, p in enumerate(plans):
            out.print(f"replica {k}: {p}", highlight=False, soft_wrap=True)
        stop = f"stops after {max_requests} answers" if max_requests else "Ctrl-C stops"
        out.print(f"serving {loaded.name} on {url} with {replicas} replica(s) (POST JSON: prompt, max_new_tokens, "
                  f"temperature, seed); {stop}", highlight=False, soft_wrap=True)
        out.file.flush()

    s = serve_http(loaded, c, replicas, host, port, objective, spread, address, max_requests, max_batch,
                   on_ready=ready)
    if json_out:
        emit_json({"model": loaded.name, "cluster": c.name, **s.to_dict()})
        return
    per = ", ".join(f"replica {k}: {v}" for k, v in sorted(s.served.items())) or "none"
    console.print(f"answered {sum(s.served.values())} requests ({per}), {sum(s.tokens.values())} tokens in "
                  f"{s.wall_s:.1f} s (measured); stopped by {s.stopped_by}; Serve and Ray shut down",
                  style="dim", highlight=False, soft_wrap=True)
