"""Run a model across the nodes of a cluster on Ray: node actors, activations through Ray, node failure.

* :class:`RaySession` starts a real local Ray cluster (a head plus one node process per cluster node on
  loopback, each with the custom resource ``hetforge-node-NAME``: :func:`hetforge.cluster.spec.resource_label`)
  or joins an existing one (``address``; unreachable → one line after a bounded wait, exit 1).
* :class:`ClusterEngine` plans the model over the nodes (:func:`hetforge.cluster.placement.plan_cluster`),
  starts one :class:`~hetforge.cluster.worker.NodeWorker` actor per node that has stages (pinned by its
  resource), and generates: prefill and each decode step call the stages in order, each call getting the
  Ray object references of the earlier stages it reads (Ray moves the activations node to node; only the
  last stage's logits come back to the driver, which samples on its CPU).
* A node dies (its actor is killed or its process ends) → the engine finds the dead nodes, re-plans on the
  survivors, starts fresh actors and re-runs prefill over the prompt plus every token generated so far,
  then continues: the tokens are those of an uninterrupted run. When the model no longer fits the
  survivors it stops with the reason and what was generated (:class:`ClusterResult.stop_reason`).

Times are **measured** on this host; per-token time, energy and wire bytes of the plan are **modeled**.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hetforge.cluster.placement import ClusterPlan
from hetforge.cluster.spec import Cluster
from hetforge.errors import HetforgeError, UsageError

OBJECT_STORE = 80 * 2**20  # bytes per node process: activations of small models are KiB


def _reachable(address: str, timeout: float = 3.0) -> str | None:
    """None when ``host:port`` accepts a TCP connection within ``timeout`` s, else why not."""
    addr = address.removeprefix("ray://")
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        return f"'{address}' is not HOST:PORT"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


class RaySession:
    """A Ray connection: a local cluster this process started (and stops), or one it joined."""

    def __init__(self, cluster: Cluster, address: str | None = None, num_cpus: int = 1):
        import logging

        import ray

        logging.getLogger("ray").setLevel(logging.ERROR)  # no INFO lines on the user's terminal

        self.local = None
        self.cluster = cluster
        if address:
            why = _reachable(address)
            if why is not None:
                raise HetforgeError(f"cannot reach the Ray cluster at {address}: {why} (waited at most 3 s)")
            ray.init(address=address, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
            have = ray.cluster_resources()
            missing = [n.label for n in cluster.nodes if have.get(n.label, 0) < 1]
            if missing:
                ray.shutdown()
                raise HetforgeError(f"Ray cluster at {address} has no node with resource {', '.join(missing)}; start "
                                    f"each node with `ray start --address {address} --resources "
                                    f"'{{\"{missing[0]}\": 1}}'`")
        else:
            from ray.cluster_utils import Cluster as LocalCluster

            self.local = LocalCluster(initialize_head=True, head_node_args={
                "num_cpus": 0, "include_dashboard": False, "object_store_memory": OBJECT_STORE})
            for n in cluster.nodes:
                self.local.add_node(num_cpus=num_cpus, resources={n.label: 1}, object_store_memory=OBJECT_STORE)
            self.local.wait_for_nodes()
            ray.init(address=self.local.address, include_dashboard=False, logging_level="ERROR",
                     log_to_driver=False)

    def close(self) -> None:
        import ray

        ray.shutdown()
        if self.local is not None:
            self.local.shutdown()
            self.local = None


@dataclass
class ClusterResult:
    """One request through the cluster: tokens, measured times, the plan's modeled figures, failovers."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    stop_reason: str
    ttft_s: float
    decode_s: list[float] = field(default_factory=list)  # wall per decode step (measured)
    stage_s: list[float] = field(default_factory=list)  # per decode step: the stages' compute (measured)
    wire_bytes: list[int] = field(default_factory=list)  # per decode step: bytes read from another node
    compile_s: float = 0.0
    plans: list[dict] = field(default_factory=list)  # the plan, then one per re-plan
    failovers: list[dict] = field(default_factory=list)

    @property
    def decode_ms_per_token(self) -> float | None:
        return 1e3 * sum(self.decode_s) / len(self.decode_s) if self.decode_s else None

    @property
    def overhead_ms_per_token(self) -> float | None:
        """Measured wall per decode step minus the stages' own compute: Ray calls, object store, network."""
        if not self.decode_s:
            return None
        return 1e3 * (sum(self.decode_s) - sum(self.stage_s)) / len(self.decode_s)

    @property
    def tokens_per_s(self) -> float | None:
        total = self.ttft_s + sum(self.decode_s)
        return len(self.tokens) / total if total > 0 and self.tokens else None

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
                "stop_reason": self.stop_reason, "ttft_s": self.ttft_s,
                "decode_ms_per_token": self.decode_ms_per_token, "overhead_ms_per_token": self.overhead_ms_per_token,
                "tokens_per_s": self.tokens_per_s, "wire_bytes_per_token": (sum(self.wire_bytes) / len(self.wire_bytes)
                                                                            if self.wire_bytes else 0),
                "compile_s": self.compile_s, "timing": "measured", "plans": self.plans, "failovers": self.failovers}


def layout_of(plan: ClusterPlan) -> dict[str, Any]:
    """Stage wiring the workers need: node per stage, stage per layer, embed and head stages."""
    layer_stage: dict[int, int] = {}
    embed = head = 0
    for st in plan.stages:
        for i in range(*st.layers):
            layer_stage[i] = st.index
        if st.embed:
            embed = st.index
        if st.head:
            head = st.index
    return {"stage_nodes": [st.node for st in plan.stages], "layer_stage": layer_stage, "embed_stage": embed,
            "head_stage": head}


class ClusterEngine:
    """Generate with a model placed over a cluster's nodes (see module docstring)."""

    def __init__(self, loaded, cluster: Cluster, address: str | None = None, objective: str = "latency",
                 strategy: str = "stages", executor: str = "backend", spread: bool = False,
                 session: RaySession | None = None):
        from hetforge.runtime.programs import tiers_for
        from hetforge.tokenizers import for_model

        if loaded.kind != "causal-lm":
            raise UsageError(f"model '{loaded.name}' is a {loaded.kind}; generation needs a causal LM")
        self.loaded, self.cluster = loaded, cluster
        self.tokenizer = for_model(loaded)
        self.tiers = tiers_for(loaded.max_positions)
        self.objective, self.strategy, self.executor, self.spread = objective, strategy, executor, spread
        self.alive = cluster
        self.plan = self.make_plan(cluster)  # before Ray: a model that fits nowhere fails fast
        self.own_session = session is None
        self.session = session or RaySession(cluster, address)
        self.actors: dict[str, Any] = {}
        self.info: dict[tuple[str, int], dict[int, list[str]]] = {}
        self.logits_key: dict[tuple[str, int], str] = {}
        self.compile_s = 0.0
        try:
            self._spawn()
        except BaseException:
            self.close()
            raise

    def make_plan(self, cluster: Cluster) -> ClusterPlan:
        from hetforge.cluster.models import plan_loaded

        return plan_loaded(self.loaded, cluster, self.objective, spread=self.spread, length=self.tiers[0])

    def _spawn(self) -> None:
        import ray

        from hetforge.cluster.worker import NodeWorker
        from hetforge.runtime.genplan import weights_fingerprint

        layout = layout_of(self.plan)
        remote = ray.remote(NodeWorker)
        self.actors = {}
        for nd in self.alive.nodes:
            if nd.name in layout["stage_nodes"]:
                self.actors[nd.name] = remote.options(num_cpus=0, resources={nd.label: 0.001}, max_restarts=0).remote(
                    nd.name, nd.soc, self.loaded.name, layout, self.strategy, self.objective, self.executor)
        want = weights_fingerprint(self.loaded.model)
        got = ray.get([a.fingerprint.remote() for a in self.actors.values()], timeout=600)
        bad = [n for n, g in zip(self.actors, got, strict=True) if g != want]
        if bad:
            raise HetforgeError(f"node(s) {', '.join(bad)} loaded other weights of '{self.loaded.name}' than the "
                                "driver (fingerprints differ); every node needs the same model")
        self.info, self.logits_key = {}, {}

    def prepare(self, kind: str, length: int) -> None:
        import ray

        key = (kind, length)
        if key in self.info:
            return
        t0 = time.perf_counter()
        infos = ray.get([a.prepare.remote(kind, length) for a in self.actors.values()], timeout=900)
        self.compile_s += time.perf_counter() - t0
        self.info[key] = infos[0]["stages"]
        self.logits_key[key] = infos[0]["logits"]

    def _step(self, kind: str, length: int, cache_len: int, feeds: list[torch.Tensor], pos: int) -> dict[str, Any]:
        import ray

        return ray.get(self._submit(kind, length, cache_len, 0, feeds, pos), timeout=600)

    def _submit(self, kind: str, length: int, cache_len: int, slot: int, feeds: list[torch.Tensor], pos: int):
        """Submit one step's stage calls (non-blocking); the reference of the last stage's result."""
        stages = self.info[(kind, length)]
        nodes = layout_of(self.plan)["stage_nodes"]
        refs: list[Any] = []
        for j, node in enumerate(nodes):
            reads = sorted({int(x[1:].split(".")[0]) for x in stages[j] if x.startswith("s")} |
                           ({j - 1} if j else set()))
            refs.append(self.actors[node].run.remote(kind, length, cache_len, slot, j, feeds, pos,
                                                     *[refs[i] for i in reads]))
        return refs[-1]

    def _lengths(self, n: int, max_new: int) -> tuple[int, int, int]:
        from hetforge.runtime.programs import pick_tier

        fit = min(max_new, self.loaded.max_positions - n + 1)
        need = max(pick_tier(n, self.tiers), n + fit - 1)
        return pick_tier(n, self.tiers), pick_tier(need, self.tiers), fit

    def _prefill(self, seq: list[int], cache_len: int) -> tuple[torch.Tensor, dict]:
        from hetforge.runtime.programs import pick_tier

        tier = pick_tier(len(seq), self.tiers)
        self.prepare("prefill", tier)
        ids = torch.zeros((1, tier), dtype=torch.long)
        ids[0, :len(seq)] = torch.tensor(seq)
        out = self._step("prefill", tier, cache_len, [ids, torch.tensor([len(seq) - 1])], 0)
        return out[self.logits_key[("prefill", tier)]], out

    def dead_nodes(self) -> set[str]:
        import ray

        dead = set()
        for name, a in self.actors.items():
            try:
                ray.get(a.ping.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - any failure to answer means the node is gone for us
                dead.add(name)
        return dead

    def _failover(self, seq: list[int], cache_len: int, result: ClusterResult, error: Exception) -> torch.Tensor:
        """Re-plan on the surviving nodes, restart the actors, rebuild the KV cache from ``seq``."""
        import ray

        t0 = time.perf_counter()
        dead = self.dead_nodes()
        if not dead:  # every actor answers: not a node failure (e.g. a stage call timed out)
            raise HetforgeError(f"a stage call failed but every node answers: {type(error).__name__}: {error}")
        if not set(self.alive.node_names) - dead:
            raise HetforgeError(f"every node died ({', '.join(sorted(dead))}); nothing to re-plan onto")
        survivors = self.alive.without(dead)
        event = {"dead": sorted(dead), "after_tokens": len(result.tokens), "error": type(error).__name__}
        try:
            plan = self.make_plan(survivors)
        except HetforgeError as e:
            event["replanned"] = False
            event["reason"] = str(e)
            result.failovers.append(event)
            raise HetforgeError(f"node(s) {', '.join(sorted(dead))} died and the survivors cannot hold the model: "
                                f"{e}") from None
        for a in self.actors.values():
            ray.kill(a)
        self.alive, self.plan = survivors, plan
        self._spawn()
        self.prepare("decode", cache_len)
        logits, _ = self._prefill(seq, cache_len)
        event.update({"replanned": True, "plan": plan.describe(), "recovery_s": time.perf_counter() - t0})
        result.failovers.append(event)
        result.plans.append(plan.to_dict())
        return logits

    def generate(self, prompt: str | list[int], params, on_token=None) -> ClusterResult:
        """Generate for ``prompt``; ``on_token(engine, index, token)`` runs after each token (where a test or
        ``--fail-node`` kills a node)."""
        from ray.exceptions import GetTimeoutError, RayActorError

        from hetforge.runtime.sampling import Sampler

        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise UsageError("the prompt is empty; give at least one token of text")
        if len(ids) > self.loaded.max_positions:
            raise UsageError(f"the prompt is {len(ids)} tokens but the model's maximum context is "
                             f"{self.loaded.max_positions} tokens")
        n = len(ids)
        _, cache_len, fit = self._lengths(n, params.max_new_tokens)
        result = ClusterResult("", [], n, "length", 0.0, plans=[self.plan.to_dict()])
        sampler = Sampler(params, self.loaded.vocab_size)
        sampler.observe(ids)
        eos = self.tokenizer.eos_id
        failures = (RayActorError, GetTimeoutError)
        t0 = time.perf_counter()
        try:
            self.prepare("decode", cache_len)
            try:
                logits, _ = self._prefill(ids, cache_len)
            except failures as e:
                logits = self._failover(ids, cache_len, result, e)
            token = sampler.pick(logits)
            result.ttft_s = time.perf_counter() - t0
            while True:
                result.tokens.append(token)
                if on_token is not None:
                    on_token(self, len(result.tokens), token)
                if not params.ignore_eos and eos is not None and token == eos:
                    result.stop_reason = "eos"
                    break
                if len(result.tokens) >= fit:
                    result.stop_reason = "length" if fit == params.max_new_tokens else "context full"
                    break
                pos = n + len(result.tokens) - 1
                sampler.observe(token)
                t1 = time.perf_counter()
                try:
                    out = self._step("decode", cache_len, cache_len, [torch.tensor([[token]]), torch.tensor([[pos]])],
                                     pos)
                    logits = out[self.logits_key[("decode", cache_len)]]
                    result.stage_s.append(sum(out["__t"].values()))
                    result.wire_bytes.append(sum(out["__wire"].values()))
                    token = sampler.pick(logits)
                    result.decode_s.append(time.perf_counter() - t1)
                except failures as e:  # the step is redone after recovery; its time is in the failover event
                    logits = self._failover(ids + result.tokens, cache_len, result, e)
                    token = sampler.pick(logits)
        except HetforgeError as e:
            result.stop_reason = f"stopped: {e}"
        result.compile_s = self.compile_s
        result.text = self.tokenizer.decode(result.tokens)
        return result

    def kill_node(self, name: str) -> None:
        """Kill the actor of node ``name`` (what a node failure looks like to the driver)."""
        import ray

        ray.kill(self.actors[name], no_restart=True)

    def close(self) -> None:
        import ray

        for a in self.actors.values():
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - an actor that is already gone
                pass
        self.actors = {}
        if self.own_session:
            self.session.close()
