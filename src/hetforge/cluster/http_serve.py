"""A local HTTP endpoint (Ray Serve) for a model placed over a cluster's nodes, spread over replicas.

``hetforge cluster serve MODEL --cluster FILE --http --replicas K`` deploys :class:`GenerateReplica` on Ray Serve
with ``K`` replicas. Each replica claims one group of nodes (:func:`~.throughput.replica_groups`: the cluster's
nodes cut into ``K`` groups in file order) from a small bookkeeping actor (:class:`Book`) and drives its own
:class:`~.ray_runtime.ClusterEngine` on that group: one node actor per node with stages, exactly as
``cluster serve --requests`` does per replica. Requests that reach a replica together are gathered by
``serve.batch`` and run with :func:`~.throughput.generate_many` (every request in flight, one KV slot each, so the
stages overlap); Serve's router spreads requests over the replicas.

``POST /generate`` takes ``{"prompt": str, "max_new_tokens": int, "temperature": float, "seed": int}`` (only
``prompt`` is required) and answers the text, the token ids, the replica that served it and **measured**
timings (time in the replica's queue, the batch's wall time, the batch size, compile time spent in the batch).
A body that is not such a JSON object gets HTTP 400 with a one-line ``{"error": ...}``; the server keeps running.

The driver (:func:`serve_http`) checks the port before Ray starts (invalid or in use: a ``UsageError``), starts
(or joins) Ray like every cluster command (:class:`~.ray_runtime.RaySession`), starts Serve with one HTTP proxy on
the head node, and waits until Ctrl-C or until ``max_requests`` generations were answered; then it shuts Serve
and Ray down.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve

from hetforge.errors import HetforgeError, UsageError

ROUTE = "/generate"
MAX_BATCH = 8  # default: requests one replica holds and runs together (each its own KV slot on every node)
BATCH_WAIT_S = 0.05  # how long a replica waits for more requests to join a batch
FIELDS = {"prompt", "max_new_tokens", "temperature", "seed"}
DEFAULT_MAX_NEW = 32
MAX_BODY = 1 << 20  # bytes
HEAD = "node:__internal_head__"  # the resource Ray gives its head node


def check_port(host: str, port: int) -> None:
    """A ``UsageError`` (one line, exit 2) when ``port`` is not 1..65535 or ``host:port`` cannot be listened on."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise UsageError(f"--port must be 1..65535 (got {port})")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"--host '{host}' cannot be resolved: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free; a listener is not
        try:
            s.bind(addr)
        except OSError as e:
            why = "already in use" if e.errno == 98 else (e.strerror or str(e))
            raise UsageError(f"cannot listen on {host}:{port}: {why}") from None


def parse_request(body: bytes) -> dict[str, Any]:
    """The request fields of a ``POST /generate`` body, checked; a ``UsageError`` with one line when wrong."""
    from hetforge.runtime import SamplingParams

    if len(body) > MAX_BODY:
        raise UsageError(f"request body is {len(body)} bytes; at most {MAX_BODY}")
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"request body is not JSON: {str(e).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise UsageError('request body must be a JSON object like {"prompt": "Once upon a time"}')
    extra = sorted(set(doc) - FIELDS)
    if extra:
        raise UsageError(f"unknown field(s) {', '.join(extra)}; allowed: {', '.join(sorted(FIELDS))}")
    prompt = doc.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise UsageError('"prompt" must be a non-empty string')
    n = doc.get("max_new_tokens", DEFAULT_MAX_NEW)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UsageError(f'"max_new_tokens" must be an integer >= 1 (got {n!r})')
    t = doc.get("temperature", 0.0)
    if isinstance(t, bool) or not isinstance(t, int | float) or not t >= 0:
        raise UsageError(f'"temperature" must be a number >= 0 (got {t!r})')
    seed = doc.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise UsageError(f'"seed" must be an integer in 0..2**63-1 (got {seed!r})')
    params = SamplingParams(max_new_tokens=n, temperature=float(t), seed=seed)  # range checks: UsageError
    return {"prompt": prompt, "params": params}


class Book:
    """Bookkeeping shared by the replicas (a Ray actor): which node group each holds, how many answers each gave."""

    def __init__(self, groups: int):
        self.free = list(range(groups))
        self.served: dict[int, int] = {}
        self.tokens: dict[int, int] = {}

    def claim(self) -> int | None:
        return self.free.pop(0) if self.free else None

    def release(self, index: int) -> None:
        if index not in self.free:
            self.free.append(index)
            self.free.sort()

    def answered(self, index: int, tokens: int) -> None:
        self.served[index] = self.served.get(index, 0) + 1
        self.tokens[index] = self.tokens.get(index, 0) + tokens

    def stats(self) -> dict[str, dict[int, int]]:
        return {"served": dict(self.served), "tokens": dict(self.tokens)}


class _InRay:
    """The Ray connection of a Serve replica: already up, owned by the driver (nothing to close here)."""

    def close(self) -> None:
        return None


def _json(doc: dict[str, Any], status: int = 200):
    from starlette.responses import JSONResponse

    return JSONResponse(doc, status_code=status)


class GenerateReplica:
    """One Serve replica: a whole copy of the model on its group of nodes, driven by a ClusterEngine."""

    def __init__(self, model: str, groups: list, objective: str, spread: bool, book, max_batch: int = MAX_BATCH):
        import torch

        from hetforge.cluster.ray_runtime import ClusterEngine
        from hetforge.models.zoo import load_model

        torch.set_num_threads(1)  # the replica only samples; the node actors compute
        self.book = book
        self.engine = self.index = None
        index = ray.get(book.claim.remote())
        if index is None:
            raise HetforgeError("every node group already has a replica")
        self.index: int | None = index
        self.group = groups[index]
        try:
            self.engine = ClusterEngine(load_model(model), self.group, objective=objective, spread=spread,
                                        session=_InRay())  # type: ignore[arg-type]
            self.engine.prepare("prefill", self.engine.tiers[0])  # the common programs compile before serving
            self.engine.prepare("decode", self.engine._lengths(1, DEFAULT_MAX_NEW)[1])
        except BaseException:
            self._release()
            raise
        self.lock = asyncio.Lock()
        self._batch.set_max_batch_size(max_batch)

    def _release(self) -> None:
        """Stop this replica's node actors and give its node group back (once; safe on a half-built replica)."""
        engine, index = getattr(self, "engine", None), getattr(self, "index", None)
        self.engine = self.index = None
        if engine is not None:
            engine.close()
        if index is not None:
            try:
                ray.get(self.book.release.remote(index), timeout=5)
            except Exception:  # noqa: BLE001 - the book is gone when the driver shuts everything down
                pass

    def __del__(self) -> None:
        self._release()

    async def __call__(self, request):
        arrived = time.perf_counter()
        path = request.url.path
        root = request.scope.get("root_path", "")  # the application's route prefix
        if root and path.startswith(root):
            path = path[len(root):]
        if path.rstrip("/") != ROUTE:
            return _json({"error": f"no such path {request.url.path}; POST {ROUTE}"}, 404)
        if request.method != "POST":
            return _json({"error": f"{request.method} is not allowed; POST {ROUTE}"}, 405)
        try:
            req = parse_request(await request.body())
            ids = self.engine.tokenizer.encode(req["prompt"])
            limit = self.engine.loaded.max_positions
            if not 1 <= len(ids) <= limit:
                raise UsageError(f"the prompt is {len(ids)} tokens; the model takes 1..{limit}")
        except UsageError as e:
            return _json({"error": str(e)}, 400)
        try:
            out = await self._batch((ids, req["params"], arrived))
        except Exception as e:  # noqa: BLE001 - one line for the client; the server keeps running
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return _json({"error": f"generation failed: {msg}"}, 500)
        out["timing"]["server_s"] = time.perf_counter() - arrived
        self.book.answered.remote(self.index, len(out["tokens"]))
        return _json(out)

    @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=BATCH_WAIT_S)
    async def _batch(self, items: list[tuple[list[int], Any, float]]) -> list[dict[str, Any]]:
        from hetforge.cluster.throughput import generate_many

        async with self.lock:  # one batch at a time: the KV slots of a batch are 0..n-1 on every node
            compiled = self.engine.compile_s
            start = time.perf_counter()
            res = await asyncio.get_running_loop().run_in_executor(
                None, generate_many, self.engine, [i[0] for i in items], [i[1] for i in items])
            wall = time.perf_counter() - start
            compiled = self.engine.compile_s - compiled
        replica = {"index": self.index, "nodes": self.group.node_names,
                   "id": serve.get_replica_context().replica_id.unique_id, "plan": self.engine.plan.describe()}
        return [{"text": text, "tokens": toks, "prompt_tokens": len(item[0]), "replica": replica,
                 "timing": {"timing": "measured", "queue_s": start - item[2], "batch_s": wall,
                            "batch_size": len(items), "compile_s": compiled,
                            "batch_tokens_per_s": res.tokens_per_s}}
                for item, toks, text in zip(items, res.tokens, res.texts, strict=True)]


@dataclass
class Deployed:
    """One application on Serve: its route and its bookkeeping actor."""

    name: str
    url: str
    book: Any
    replicas: int
    plans: list[str] = field(default_factory=list)

    def stats(self) -> dict[str, dict[int, int]]:
        return ray.get(self.book.stats.remote(), timeout=30)


def start_serve(host: str, port: int) -> None:
    """Serve on the connected Ray cluster: one HTTP proxy (on the head node) at ``host:port``."""
    import logging

    for name in ("ray.serve", "ray"):
        logging.getLogger(name).setLevel(logging.ERROR)
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port},
                logging_config={"log_level": "ERROR"})


def deploy(loaded, groups: list, objective: str, spread: bool, host: str, port: int, name: str = "hetforge",
           prefix: str = "/", max_batch: int = MAX_BATCH) -> Deployed:
    """Deploy ``len(groups)`` replicas of :class:`GenerateReplica` as application ``name`` at ``prefix``; returns
    when every replica is up (programs compiled) and the proxy answers. A replica holds at most ``max_batch``
    requests (Serve's ``max_ongoing_requests``; more wait in the proxy) and runs them as one batch."""
    book = ray.remote(Book).options(num_cpus=0).remote(len(groups))
    dep = serve.deployment(GenerateReplica, name=f"{name}-generate", num_replicas=len(groups),
                           # on the head node, beside the one HTTP proxy: the proxy prefers replicas on its own
                           # node, so all there keeps Serve's choice by queue length (requests spread over replicas)
                           ray_actor_options={"num_cpus": 0, "resources": {HEAD: 0.001}},
                           max_ongoing_requests=max_batch,
                           graceful_shutdown_timeout_s=10, graceful_shutdown_wait_loop_s=0.5,
                           max_constructor_retry_count=2)
    try:
        serve.run(dep.bind(loaded.name, groups, objective, spread, book, max_batch), name=name, route_prefix=prefix)
    except Exception as e:  # noqa: BLE001 - Serve's own errors (a replica that cannot start) as one line
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        raise HetforgeError(f"Ray Serve could not start the replicas: {lines[-1] if lines else type(e).__name__}") \
            from None
    _wait_listening(host, port, 60)
    base = f"http://{host if ':' not in host else f'[{host}]'}:{port}{prefix.rstrip('/')}"
    return Deployed(name, base + ROUTE, book, len(groups))


def _wait_listening(host: str, port: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError as e:
            if time.monotonic() > end:
                raise HetforgeError(f"Serve's HTTP proxy does not answer on {host}:{port} after {timeout:.0f} s: "
                                    f"{e.strerror or e}") from None
            time.sleep(0.2)


def stop_serve(session) -> None:
    """Shut Serve down (replicas close their node actors), then Ray (``session``); errors of an already-dying
    cluster are ignored, and so are the notices Ray prints meanwhile (a killed controller's retried task)."""
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            serve.shutdown()
        except Exception:  # noqa: BLE001 - Ray itself is stopped right after
            pass
        session.close()


@dataclass
class ServeSummary:
    """What one ``--http`` session served (counts and tokens per replica; wall **measured**)."""

    url: str
    replicas: int
    served: dict[int, int]
    tokens: dict[int, int]
    wall_s: float
    stopped_by: str
    plans: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "replicas": self.replicas, "served": sum(self.served.values()),
                "served_per_replica": {str(k): v for k, v in sorted(self.served.items())},
                "tokens": sum(self.tokens.values()), "wall_s": self.wall_s, "timing": "measured",
                "stopped_by": self.stopped_by, "plans": self.plans}


def serve_http(loaded, cluster, replicas: int, host: str, port: int, objective: str = "latency", spread: bool = False,
               address: str | None = None, max_requests: int | None = None, max_batch: int = MAX_BATCH,
               on_ready=None) -> ServeSummary:
    """Serve ``POST /generate`` until Ctrl-C or ``max_requests`` answers; Serve and Ray are shut down on return.

    ``on_ready(url, plans)`` runs once every replica is up."""
    from hetforge.cluster.models import plan_loaded
    from hetforge.cluster.ray_runtime import RaySession
    from hetforge.cluster.throughput import replica_groups

    check_port(host, port)
    if max_requests is not None and max_requests < 1:
        raise UsageError(f"--max-requests must be >= 1 (got {max_requests})")
    if not 1 <= max_batch <= 64:
        raise UsageError(f"--max-batch must be 1..64 (got {max_batch})")
    groups = replica_groups(cluster, replicas)
    plans = [plan_loaded(loaded, g, objective, spread=spread).describe() for g in groups]  # fails before Ray
    session = RaySession(cluster, address)
    stopped_by = "ctrl-c"
    stats: dict[str, dict[int, int]] = {"served": {}, "tokens": {}}
    t0 = time.perf_counter()
    try:
        start_serve(host, port)
        dep = deploy(loaded, groups, objective, spread, host, port, max_batch=max_batch)
        dep.plans = plans
        if on_ready is not None:
            on_ready(dep.url, plans)
        t0 = time.perf_counter()
        try:
            while True:
                stats = dep.stats()
                if max_requests is not None and sum(stats["served"].values()) >= max_requests:
                    stopped_by = "max-requests"
                    time.sleep(0.5)  # the proxy sends the last answers out
                    stats = dep.stats()
                    break
                time.sleep(0.2)
        except KeyboardInterrupt:
            try:
                stats = dep.stats()
            except Exception:  # noqa: BLE001 - Ctrl-C may have reached Ray's processes too
                pass
    finally:
        wall = time.perf_counter() - t0
        stop_serve(session)
    return ServeSummary(dep.url, replicas, stats["served"], stats["tokens"], wall, stopped_by, plans)
