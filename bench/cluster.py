"""Cluster benchmark: a model across several nodes on Ray (measured on a local cluster) and across shipped cluster
profiles (modeled) — one run, raw JSON, and the Markdown page generated from it.

1. **Stage boundaries (measured).** A real local Ray cluster on this host (head + three node processes on
   loopback, each with its ``hetforge-node-NAME`` resource). The ``demo`` model, greedy, --new-tokens tokens:
   one process (``hetforge run``'s engine, host profile) against the cluster engine with every stage on one
   node (Ray calls, no boundary), on two nodes and on three nodes (``--spread``: even layer split; the embedding
   and LM head stay on the home node, so two nodes make two network crossings and three make three). Interleaved
   rounds, medians; tokens checked equal. The per-boundary overhead is the least-squares slope of decode ms/token
   over the number of crossings.
2. **Throughput (measured).** --requests prompts × --batch-tokens tokens: one process one request after another;
   two nodes one after another; two nodes pipelined (every request in flight, each node working on another
   request); two replicas of one node each. tokens/s from the first submission to the last token (programs
   compiled before), interleaved rounds.
3. **Shipped clusters (modeled).** Every shipped cluster profile × {demo, llama-3.1-8b-shape (context 4096)}:
   the placement (latency objective), per-token ms, mJ and bytes on the wire, memory per node, why each cut is
   where it is, and the pipelined rate; a model that fits no cluster is reported with the bytes needed. Also
   ``demo`` forced over every node (``--spread``) to show what the network costs a model that fits one node.
4. **Through HTTP (measured; ``--section http``).** ``hetforge cluster serve --http``'s Ray Serve endpoint on a
   local cluster of two node processes: the same two-node cluster file served with 1 replica and with 2 replicas
   (both applications on one Serve instance, at ``/r1`` and ``/r2``); --http-requests concurrent ``POST /generate``
   requests (urllib, one thread each) × --batch-tokens tokens, tokens/s from the first send to the last answer,
   interleaved rounds after a warm-up round; greedy tokens checked against the one-process engine. ``--section
   http`` runs only this part and adds it to the JSON given by ``--out`` (the other sections are kept).

    python bench/cluster.py --out docs/bench/cluster.json --md docs/bench/cluster.md
    python bench/cluster.py --section http --out docs/bench/cluster.json --md docs/bench/cluster.md
    python bench/cluster.py --from-json docs/bench/cluster.json --md docs/bench/cluster.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from _pages import page_from_json, write_result

warnings.filterwarnings("ignore")
PROMPTS = ["Once upon a time", "The little girl", "In the morning the", "He looked at the", "She said that",
           "The dog ran", "One day, a", "They went to the"]
LINK = ("  bandwidth: {value: 1.0e9, source: loopback}\n  latency_s: {value: 1.0e-5, source: loopback}\n"
        "  energy_per_byte_j: {value: 0.0, source: loopback}\n")


def _cluster(tmp: Path, name: str, nodes: list[str]):
    from hetforge.cluster.spec import load_cluster

    p = tmp / f"{name}.yaml"
    p.write_text(f"name: {name}\nnodes:\n" + "".join(f"  - {{name: {n}, soc: host}}\n" for n in nodes)
                 + "default_link:\n" + LINK)
    return load_cluster(p)


def measured(args, tmp: Path) -> dict:
    from hetforge.cluster.ray_runtime import ClusterEngine, RaySession
    from hetforge.cluster.throughput import generate_many, replica_groups, serve
    from hetforge.models.zoo import load_model
    from hetforge.runtime import Engine, SamplingParams

    demo = load_model("demo")
    params = SamplingParams(max_new_tokens=args.new_tokens)
    three = _cluster(tmp, "three", ["a", "b", "c"])
    session = RaySession(three)
    single = Engine(demo, soc="host")
    engines = {"ray, 1 node": ClusterEngine(demo, _cluster(tmp, "one", ["a"]), session=session),
               "ray, 2 nodes": ClusterEngine(demo, _cluster(tmp, "two", ["a", "b"]), spread=True, session=session),
               "ray, 3 nodes": ClusterEngine(demo, three, spread=True, session=session)}
    try:
        runs: dict[str, list[dict]] = {"one process": [], **{k: [] for k in engines}}
        ref = single.generate(PROMPTS[0], params).tokens  # warm-up (compiles)
        for e in engines.values():
            e.generate(PROMPTS[0], params)
        same = True
        for _ in range(args.rounds):
            r = single.generate(PROMPTS[0], params)
            same &= r.tokens == ref
            runs["one process"].append({"decode_ms": r.decode_ms_per_token, "tokens_per_s": r.tokens_per_s})
            for k, e in engines.items():
                c = e.generate(PROMPTS[0], params)
                same &= c.tokens == ref
                runs[k].append({"decode_ms": c.decode_ms_per_token, "tokens_per_s": c.tokens_per_s,
                                "outside_stages_ms": c.overhead_ms_per_token,
                                "wire_bytes": float(np.mean(c.wire_bytes)) if c.wire_bytes else 0.0})
        crossings = {"ray, 1 node": 0, "ray, 2 nodes": 2, "ray, 3 nodes": 3}
        rows = []
        for k, v in runs.items():
            row = {"system": k, "decode_ms_median": statistics.median(x["decode_ms"] for x in v),
                   "tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in v), "rounds": len(v)}
            if k in engines:
                row.update({"outside_stages_ms_median": statistics.median(x["outside_stages_ms"] for x in v),
                            "wire_bytes_per_token": v[0]["wire_bytes"], "crossings": crossings[k],
                            "plan": engines[k].plan.describe()})
            rows.append(row)
        xs = np.array([crossings[r["system"]] for r in rows if r["system"] in engines], dtype=float)
        ys = np.array([r["decode_ms_median"] for r in rows if r["system"] in engines])
        slope, icpt = np.polyfit(xs, ys, 1)
        boundary = {"ms_per_crossing": float(slope), "ray_no_boundary_ms": float(icpt),
                    "one_process_ms": rows[0]["decode_ms_median"],
                    "ray_call_overhead_ms": rows[1]["decode_ms_median"] - rows[0]["decode_ms_median"]}
        # throughput
        prompts = PROMPTS[: args.requests]
        bparams = SamplingParams(max_new_tokens=args.batch_tokens)
        reps = [ClusterEngine(demo, g, session=session) for g in replica_groups(_cluster(tmp, "two", ["a", "b"]), 2)]
        two = engines["ray, 2 nodes"]

        def one_process():
            t0 = time.perf_counter()
            toks = [single.generate(p, bparams).tokens for p in prompts]
            return toks, time.perf_counter() - t0

        def two_sequential():
            t0 = time.perf_counter()
            toks = [two.generate(p, bparams).tokens for p in prompts]
            return toks, time.perf_counter() - t0

        def two_pipelined():
            b = generate_many(two, prompts, bparams)
            return b.tokens, b.wall_s

        def replicas():
            b = serve(reps, prompts, bparams)
            return b.tokens, b.wall_s

        fns = {"one process, one request after another": one_process,
               "2 nodes, one request after another": two_sequential,
               "2 nodes, pipelined": two_pipelined, "2 replicas (1 node each), pipelined": replicas}
        want, _ = one_process()
        for f in fns.values():
            f()  # warm-up: compiles every tier
        tput: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, f in fns.items():
                toks, wall = f()
                same &= toks == want
                tput[k].append(sum(len(t) for t in toks) / wall)
        throughput = [{"system": k, "tokens_per_s_median": statistics.median(v), "rounds": len(v)}
                      for k, v in tput.items()]
        for e in reps:
            e.close()
    finally:
        for e in engines.values():
            e.close()
        session.close()
    return {"model": "demo", "new_tokens": args.new_tokens, "sequential": rows, "boundary": boundary,
            "throughput": throughput, "requests": len(PROMPTS[: args.requests]), "batch_tokens": args.batch_tokens,
            "tokens_equal": bool(same)}


def http_measured(args, tmp: Path) -> dict:
    """Section 4: tokens/s through Ray Serve's HTTP endpoint, 1 vs 2 replicas, concurrent requests."""
    import socket
    import threading
    import urllib.request

    from hetforge.cluster.http_serve import MAX_BATCH, deploy, start_serve, stop_serve
    from hetforge.cluster.ray_runtime import RaySession
    from hetforge.cluster.throughput import replica_groups
    from hetforge.models.zoo import load_model
    from hetforge.runtime import Engine, SamplingParams

    demo = load_model("demo")
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.http_requests)]
    single = Engine(demo, soc="host")
    want = [single.generate(p, SamplingParams(max_new_tokens=args.batch_tokens)).tokens for p in prompts]
    two = _cluster(tmp, "two", ["a", "b"])
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    session = RaySession(two)
    try:
        start_serve("127.0.0.1", port)
        apps = {k: deploy(demo, replica_groups(two, k), "latency", False, "127.0.0.1", port, name=f"r{k}",
                          prefix=f"/r{k}") for k in (1, 2)}

        def burst(url: str) -> tuple[list[dict], float]:
            out: list[dict] = [{}] * len(prompts)

            def ask(i: int) -> None:
                body = json.dumps({"prompt": prompts[i], "max_new_tokens": args.batch_tokens}).encode()
                req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=600) as r:
                    out[i] = json.loads(r.read())

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return out, time.perf_counter() - t0

        for d in apps.values():
            burst(d.url)  # warm-up: Serve's router learns the queue lengths; every program is compiled
        runs: dict[int, list[dict]] = {k: [] for k in apps}
        served_by: dict[int, dict[int, str]] = {k: {} for k in apps}  # replica index → its plan
        same = True
        for _ in range(args.rounds):
            for k, d in apps.items():
                out, wall = burst(d.url)
                same &= [o["tokens"] for o in out] == want
                split: dict[int, int] = {}
                for o in out:
                    split[o["replica"]["index"]] = split.get(o["replica"]["index"], 0) + 1
                    served_by[k][o["replica"]["index"]] = o["replica"]["plan"]
                runs[k].append({"wall_s": wall, "tokens_per_s": sum(len(o["tokens"]) for o in out) / wall,
                                "per_replica": [split.get(i, 0) for i in range(k)],
                                "mean_batch": statistics.mean(o["timing"]["batch_size"] for o in out),
                                "server_s_median": statistics.median(o["timing"]["server_s"] for o in out)})
        plans = {k: [replica_groups(two, k)[i].node_names for i in range(k)] for k in apps}
    finally:
        stop_serve(session)
    rows = [{"replicas": k, "nodes_per_replica": plans[k], "plans": [served_by[k].get(i, "") for i in range(k)],
             "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in v),
             "wall_s_median": statistics.median(r["wall_s"] for r in v), "rounds": v} for k, v in runs.items()]
    return {"model": "demo", "requests": len(prompts), "new_tokens": args.batch_tokens, "max_batch": MAX_BATCH,
            "rows": rows, "tokens_equal": bool(same),
            "meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "loadavg": ", ".join(f"{v:.1f}" for v in os.getloadavg()),
                     "command": f"python bench/cluster.py --section http --rounds {args.rounds} --http-requests "
                                f"{args.http_requests} --batch-tokens {args.batch_tokens} "
                                "--out docs/bench/cluster.json --md docs/bench/cluster.md"}}


def modeled(args) -> dict:
    from hetforge.cluster.models import plan_model
    from hetforge.cluster.spec import load_cluster, shipped_clusters
    from hetforge.cluster.throughput import modeled_pipeline
    from hetforge.errors import HetforgeError

    rows = []
    for cname in shipped_clusters():
        c = load_cluster(cname)
        for model, ctx, spread in (("demo", None, False), ("demo", None, True), ("llama-3.1-8b-shape", 4096, False)):
            row = {"cluster": cname, "model": model, "context": ctx, "spread": spread}
            try:
                p = plan_model(model, c, "latency", ctx, spread)
            except HetforgeError as e:
                row["error"] = str(e)
                rows.append(row)
                print(f"{cname} {model}: {e}", flush=True)
                continue
            d = p.to_dict()
            row.update({"plan": d["plan"], "per_token": d["per_token"], "stages": d["stages"], "hops": d["hops"],
                        "memory": d["memory"], "explain": d["explain"], "search": d["search"]["method"],
                        "pipeline": modeled_pipeline(p)})
            rows.append(row)
            print(f"{cname} {model}{' spread' if spread else ''}: {d['plan']} {d['per_token']}", flush=True)
    return {"objective": "latency", "rows": rows}


def _cell(text: str) -> str:
    """A plan (``a: … | b: …``) inside a Markdown table cell: stages joined by arrows, not pipes."""
    return text.replace(" | ", " → ")


def _f(x, nd=2):
    return "—" if x is None else f"{x:,.{nd}f}"


def markdown(r: dict) -> str:
    m = r["meta"]
    out = ["# Cluster benchmark: a model across several nodes on Ray", "",
           f"Generated by `{m['command']}` on {m['date']} ({m['host']}, torch {m['torch']}, ray {m['ray']}; load "
           f"average at start {m['loadavg']}). **Measured** figures are timed on this host; **modeled** ones come "
           "from the cost model and the cluster profiles. The machine was shared with other build jobs: read ratios "
           "from the interleaved rounds, not absolute times.", ""]
    s = r.get("measured")
    if s:
        out += ["## Stage boundaries on a local Ray cluster (measured)", "",
                f"`{s['model']}`, greedy, {s['new_tokens']} new tokens; a head plus three node processes on loopback, "
                "each with its own resource label; node SoC profile `host`. Tokens equal the one-process run in every "
                f"round: **{'yes' if s['tokens_equal'] else 'NO'}**.", "",
                "| system | plan | network crossings / token | decode ms/token | outside the stages ms/token | "
                "bytes read from another node / token | tokens/s |", "|---|---|---|---|---|---|---|"]
        for row in s["sequential"]:
            out.append(f"| {row['system']} | {_cell(row.get('plan', 'one process, host profile'))} | "
                       f"{row.get('crossings', 0)} | {_f(row['decode_ms_median'])} | "
                       f"{_f(row.get('outside_stages_ms_median'))} | "
                       f"{_f(row.get('wire_bytes_per_token'), 0) if 'wire_bytes_per_token' in row else '—'} | "
                       f"{_f(row['tokens_per_s_median'], 1)} |")
        b = s["boundary"]
        out += ["", f"Per-token overhead of one network crossing between stages (least-squares slope over 0, 2, 3 "
                f"crossings): **{b['ms_per_crossing']:.2f} ms** (measured). Ray with no crossing costs "
                f"{b['ray_call_overhead_ms']:.2f} ms/token more than one process ({_f(b['one_process_ms'])} ms): the "
                "actor call, the object store and the logits coming back. These crossings run over loopback on one "
                "host: a real network adds its latency and bytes / bandwidth (the modeled part below).", "",
                "## Throughput (measured)", "",
                f"{s['requests']} requests × {s['batch_tokens']} tokens; tokens/s from the first submission to the "
                "last token (programs compiled before), medians of interleaved rounds; every system gives every "
                "request the tokens it gets alone.", "", "| system | tokens/s |", "|---|---|"]
        base = s["throughput"][0]["tokens_per_s_median"]
        for row in s["throughput"]:
            out.append(f"| {row['system']} | {_f(row['tokens_per_s_median'], 1)} "
                       f"({row['tokens_per_s_median'] / base:.2f}× one process) |")
        out += ["", "Two cores serve every process here: the emulated nodes share the same CPU.", ""]
    h = r.get("http")
    if h:
        out += ["## Through HTTP: Ray Serve replicas (measured)", "",
                f"Generated by `{h['meta']['command']}` on {h['meta']['date']} (load average "
                f"{h['meta']['loadavg']}: the machine was loaded). `hetforge cluster serve --http`'s endpoint on a "
                f"local Ray cluster of two node processes (SoC profile `host`): {h['requests']} concurrent "
                f"`POST /generate` requests (one urllib thread each) × {h['new_tokens']} tokens, `{h['model']}`, "
                f"greedy; a replica runs up to {h['max_batch']} "
                "requests as one pipelined batch. tokens/s from the first send to the last answer, medians of "
                "interleaved rounds after a warm-up round. Greedy tokens equal the one-process engine in every round: "
                f"**{'yes' if h['tokens_equal'] else 'NO'}**.", "",
                "| replicas | nodes per replica | plan per replica | tokens/s (median) | wall s (median) | requests "
                "per replica, each round | batch size (mean over requests) |", "|---|---|---|---|---|---|---|"]
        base = h["rows"][0]["tokens_per_s_median"]
        for row in h["rows"]:
            split = "; ".join("/".join(str(x) for x in rd["per_replica"]) for rd in row["rounds"])
            batch = statistics.mean(rd["mean_batch"] for rd in row["rounds"])
            out.append(f"| {row['replicas']} | {' + '.join(','.join(g) for g in row['nodes_per_replica'])} | "
                       f"{' ; '.join(_cell(x) for x in row.get('plans', []))} | "
                       f"{_f(row['tokens_per_s_median'], 1)} ({row['tokens_per_s_median'] / base:.2f}× 1 replica) | "
                       f"{_f(row['wall_s_median'], 2)} | {split} | {batch:.1f} |")
        out += ["", "Both emulated nodes share this host's two cores, so a second replica adds no compute here; what "
                "it changes is how the requests are split into batches (Serve's router spreads them by queue "
                "length).", ""]
    mo = r["modeled"]
    out += ["## Shipped cluster profiles (modeled)", "",
            "Latency objective. Per token: the stages one after another plus the network hops (one request); "
            "pipelined: the busiest node or link sets the rate when requests overlap.", "",
            "| cluster | model | plan | ms/token | mJ/token | bytes on the wire / token | pipelined tokens/s | "
            "memory used per node (GiB) |", "|---|---|---|---|---|---|---|---|"]
    for row in mo["rows"]:
        name = row["model"] + (" (spread)" if row["spread"] else "") + (f", ctx {row['context']}" if row["context"]
                                                                       else "")
        if "error" in row:
            out.append(f"| {row['cluster']} | {name} | does not fit: {row['error']} | — | — | — | — | — |")
            continue
        pt = row["per_token"]
        mem = ", ".join(f"{n} {v['used'] / 2**30:.2f}/{v['capacity'] / 2**30:.2f}" for n, v in row["memory"].items())
        out.append(f"| {row['cluster']} | {name} | {_cell(row['plan'])} | {pt['modeled_ms']:.3f} | "
                   f"{pt['modeled_mj']:.3f} | {pt['wire_bytes']:,.0f} | "
                   f"{row['pipeline']['pipelined_tokens_per_s']:.1f} | {mem} |")
    out += ["", "### Why each cut is where it is", ""]
    for row in mo["rows"]:
        if "error" in row or row["model"] == "demo" and not row["spread"]:
            continue
        out.append(f"- **{row['cluster']}, {row['model']}{' (spread)' if row['spread'] else ''}**: "
                   + " ".join(e.rstrip(".") + "." for e in row["explain"]))
    out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--batch-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-measured", action="store_true", help="modeled part only")
    ap.add_argument("--section", choices=["all", "http"], default="all",
                    help="http: only the HTTP (Ray Serve) part, added to the JSON of --out")
    ap.add_argument("--http-requests", type=int, default=8, help="concurrent HTTP requests per round")
    ap.add_argument("--out", default="")
    ap.add_argument("--md", default="")
    ap.add_argument("--from-json", default="", help="write the Markdown page of an earlier --out file and exit")
    args = ap.parse_args()
    if args.from_json:
        page_from_json(args.from_json, args.md, markdown)
        return
    import ray

    torch.set_num_threads(args.threads)
    if args.section == "http":
        prev = json.loads(Path(args.out).read_text()) if args.out and Path(args.out).exists() else None
        if prev is None:
            raise SystemExit("--section http adds to an earlier --out JSON; give --out with an existing file")
        prev["http"] = http_measured(args, Path(tempfile.mkdtemp(prefix="hetforge-cluster-bench-")))
        Path(args.out).write_text(json.dumps(prev, indent=1, default=float) + "\n")
        if args.md:
            Path(args.md).write_text(markdown(prev))
        return
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "host": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__, "ray": ray.__version__,
            "loadavg": ", ".join(f"{v:.1f}" for v in os.getloadavg()), "threads": args.threads,
            "command": f"python bench/cluster.py --new-tokens {args.new_tokens} --rounds {args.rounds} --requests "
                       f"{args.requests} --batch-tokens {args.batch_tokens} --out docs/bench/cluster.json "
                       "--md docs/bench/cluster.md"}
    result: dict = {"meta": meta, "modeled": modeled(args)}
    if not args.skip_measured:
        result["measured"] = measured(args, Path(tempfile.mkdtemp(prefix="hetforge-cluster-bench-")))
    write_result(result, args.out, args.md, markdown)


if __name__ == "__main__":
    main()
