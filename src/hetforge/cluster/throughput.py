"""Throughput mode: many requests through the cluster at once, pipelined over the stages, spread over replicas.

* **Pipelining (micro-batches of one request).** Each request has its own KV cache slot on every node. A decode
  round submits every active request's chain of stage calls without waiting; each node's actor runs the calls
  in the order they arrive, so while the second node works on request 1 the first node already works on
  request 2: the stages overlap. Tokens per request are what :meth:`ClusterEngine.generate` gives it alone
  (greedy: identical; the tests check it).
* **Replicas.** ``replicas=k`` cuts the cluster's nodes into ``k`` groups (in file order) and places a whole copy
  of the model on each group; requests go round-robin to the replicas, which run at the same time.

Measured figures (wall, tokens/s) are timed on this host from the first request's submission to the last token
(programs are compiled before); :func:`modeled_pipeline` gives the modeled rate of a
plan when stages overlap (the busiest node or link sets it).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hetforge.cluster.placement import ClusterPlan
from hetforge.errors import UsageError


def read_requests(path: Path) -> list[str]:
    """One prompt per line of a UTF-8 text file (blank lines skipped)."""
    from hetforge.files import check_input_file

    check_input_file(path, "requests file")
    try:
        lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    except UnicodeDecodeError:
        raise UsageError(f"requests file '{path}' is not UTF-8 text (one prompt per line)") from None
    prompts = [ln for ln in lines if ln]
    if not prompts:
        raise UsageError(f"requests file '{path}' has no prompt (one prompt per line)")
    return prompts


@dataclass
class BatchResult:
    """Requests served together: tokens per request and measured wall time."""

    tokens: list[list[int]]
    texts: list[str]
    wall_s: float
    replicas: int = 1
    plans: list[str] = field(default_factory=list)
    span: tuple[float, float] = (0.0, 0.0)  # perf_counter at the first submission and the last token

    @property
    def total_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"requests": len(self.tokens), "tokens": self.total_tokens, "wall_s": self.wall_s,
                "tokens_per_s": self.tokens_per_s, "replicas": self.replicas, "plans": self.plans,
                "timing": "measured", "outputs": [{"tokens": t, "text": x} for t, x in
                                                  zip(self.tokens, self.texts, strict=True)]}


def generate_many(engine, prompts: list[str | list[int]], params) -> BatchResult:
    """Serve ``prompts`` on one :class:`~hetforge.cluster.ray_runtime.ClusterEngine`, pipelined (see module doc).
    ``params``: one :class:`~hetforge.runtime.SamplingParams` for all, or a list with one per prompt."""
    import ray

    from hetforge.runtime.programs import pick_tier
    from hetforge.runtime.sampling import Sampler

    plist = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise UsageError(f"{len(plist)} sampling settings for {len(prompts)} requests")
    reqs = []
    for p, pp in zip(prompts, plist, strict=True):
        ids = engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
        if not ids or len(ids) > engine.loaded.max_positions:
            raise UsageError(f"a request has {len(ids)} tokens; each needs 1..{engine.loaded.max_positions}")
        tier, cache_len, fit = engine._lengths(len(ids), pp.max_new_tokens)
        s = Sampler(pp, engine.loaded.vocab_size)
        s.observe(ids)
        reqs.append({"ids": ids, "tier": pick_tier(len(ids), engine.tiers), "cache": cache_len, "fit": fit,
                     "sampler": s, "params": pp, "tokens": [], "done": False})
    cache_len = max(r["cache"] for r in reqs)
    engine.prepare("decode", cache_len)
    for t in sorted({r["tier"] for r in reqs}):
        engine.prepare("prefill", t)
    eos = engine.tokenizer.eos_id
    t0 = time.perf_counter()
    refs = []
    for slot, r in enumerate(reqs):
        ids = torch.zeros((1, r["tier"]), dtype=torch.long)
        ids[0, :len(r["ids"])] = torch.tensor(r["ids"])
        refs.append(engine._submit("prefill", r["tier"], cache_len, slot, [ids, torch.tensor([len(r["ids"]) - 1])], 0))
    outs = ray.get(refs, timeout=900)
    for r, out in zip(reqs, outs, strict=True):
        _take(r, out[engine.logits_key[("prefill", r["tier"])]], r["params"], eos)
    key = engine.logits_key[("decode", cache_len)]
    while True:
        active = [(slot, r) for slot, r in enumerate(reqs) if not r["done"]]
        if not active:
            break
        refs = []
        for slot, r in active:
            pos = len(r["ids"]) + len(r["tokens"]) - 1
            r["sampler"].observe(r["tokens"][-1])
            refs.append(engine._submit("decode", cache_len, cache_len, slot,
                                       [torch.tensor([[r["tokens"][-1]]]), torch.tensor([[pos]])], pos))
        for (_, r), out in zip(active, ray.get(refs, timeout=900), strict=True):
            _take(r, out[key], r["params"], eos)
    wall = time.perf_counter() - t0
    return BatchResult([r["tokens"] for r in reqs], [engine.tokenizer.decode(r["tokens"]) for r in reqs], wall,
                       plans=[engine.plan.describe()], span=(t0, t0 + wall))


def _take(r: dict, logits: torch.Tensor, params, eos: int | None) -> None:
    tok = r["sampler"].pick(logits)
    r["tokens"].append(tok)
    if (not params.ignore_eos and eos is not None and tok == eos) or len(r["tokens"]) >= r["fit"]:
        r["done"] = True


def replica_groups(cluster, replicas: int) -> list:
    """The cluster's nodes cut into ``replicas`` groups in file order (each a sub-cluster, its first node home)."""
    n = len(cluster.nodes)
    if not 1 <= replicas <= n:
        raise UsageError(f"--replicas must be 1..{n} (the cluster has {n} nodes), got {replicas}")
    names = cluster.node_names
    groups = [names[i * n // replicas:(i + 1) * n // replicas] for i in range(replicas)]
    return [cluster.without(set(names) - set(g)) for g in groups]


def serve(engines: list, prompts: list[str], params) -> BatchResult:
    """Requests round-robin over replica engines, each replica pipelining its share; all replicas at once."""
    shares = [prompts[i::len(engines)] for i in range(len(engines))]
    results: list[BatchResult | None] = [None] * len(engines)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = generate_many(engines[i], shares[i], params) if shares[i] else BatchResult([], [], 0.0)
        except BaseException as e:  # noqa: BLE001 - re-raised below in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    spans = [r.span for r in results if r is not None and r.tokens]
    wall = max(b for _, b in spans) - min(a for a, _ in spans)  # serving time; each replica compiles first
    tokens: list[list[int]] = [[] for _ in prompts]
    texts = [""] * len(prompts)
    for i, res in enumerate(results):
        assert res is not None
        for k, (tok, txt) in enumerate(zip(res.tokens, res.texts, strict=True)):
            tokens[i + k * len(engines)], texts[i + k * len(engines)] = tok, txt
    return BatchResult(tokens, texts, wall, len(engines), [e.plan.describe() for e in engines])


def modeled_pipeline(plan: ClusterPlan) -> dict[str, float]:
    """Modeled per-token figures when requests overlap in the pipeline: the busiest node (its stages' time added
    up) or link sets the rate; one request alone takes the sum of every stage and hop."""
    busy: dict[str, float] = {}
    for st in plan.stages:
        busy[st.node] = busy.get(st.node, 0.0) + st.modeled_s
    for h in plan.hops:
        key = f"{min(h.src, h.dst)}<->{max(h.src, h.dst)}"
        busy[key] = busy.get(key, 0.0) + h.modeled_s
    bottleneck = max(busy.values())
    return {"single_request_ms": 1e3 * plan.modeled_s, "bottleneck_ms": 1e3 * bottleneck,
            "pipelined_tokens_per_s": 1.0 / bottleneck if bottleneck > 0 else 0.0,
            "single_tokens_per_s": 1.0 / plan.modeled_s if plan.modeled_s > 0 else 0.0,
            "bottleneck": max(busy, key=lambda k: busy[k])}
