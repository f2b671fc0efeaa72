"""Side by side: hetforge's forward latencies and its closest peers', timed in turns while all of them are loaded.

Why: the suite's rows time each system in its own process, one after the other, minutes apart. On a shared host the
machine's speed drifts over those minutes: the same pair's per-repeat ratios spread up to 0.71–1.16 on session
40's pages, as wide as the gaps the targets judge. Here each chosen system is prepared in a process of its own
(``python -m hetforge.benchmarks.worker --serve``, as in the suite, so no two share a thread pool) and then waits.
Round after round, each in turn times a short batch of prefill calls, then each in turn a short batch of one-token
calls (every batch after a pause in which the previous batch's spinning threads go to sleep, and after untimed
calls: its caches and threads were idle while the others ran) while the others wait; no two run at once. The order
rotates every round. A ratio is taken within one round, so drift slower than a round cancels out of it. The
batches are short (two prefill calls, five one-token calls) and the rounds many, because this host's memory speed
was seen to change within seconds (a one-off in session 41: the same weight stream at 35 and at 46 GB/s a few
seconds apart).

Decode: where the suite ran decode peers (systems with a KV-cache pipeline users pick for CPU decoding: OpenVINO's
stateful model, llama.cpp; :data:`DECODE_PEERS`), each round also runs one whole decode request of the suite's
``--decode-tokens`` per system that decodes (prompt, then greedy tokens; its mean ms per new token), in turns like
the batches. Each serving worker runs one untimed request before the rounds (hetforge compiles its runtime programs
there). Requests, not batches: a decode step's time depends on the cache filling up, so a request is the unit the
suite's rows time too.

Who: for hetforge (fp32), the two fastest f32 peers of the suite's rows per metric (prefill, one token; decode among
the decode peers), at most three peers; for ``hetforge-bf16``, the fastest OpenVINO row that ran in bf16 per metric;
for ``hetforge-w8`` / ``hetforge-w4``, llama.cpp's Q8_0 / Q4_0 row (decode only). A group is cut to fewer peers
(slowest first) when the peak RSS the suite measured for its systems does not fit in the memory available now, and
the group's notes say so.

The targets are judged on these ratios where a group ran (the median over rounds of hetforge's batch median, or
request, ÷ the peer's in the same round, against the peer with the lowest median over rounds); the suite's serial
medians stay on the page beside them (:func:`hetforge.benchmarks.harness.compare`).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hetforge.benchmarks.base import QUANT_DECODE_PAIRS, is_bf16, is_f32

METRICS = ("prefill_ms", "step_ms", "decode_ms_per_token")
SHAPE = {"prefill_ms": "prefill", "step_ms": "step", "decode_ms_per_token": "decode"}
DECODE_PEERS = ("llamacpp", "ov-stateful")  # system name prefixes whose decode rounds are timed side by side
PEERS_PER_METRIC = 2  # the fastest f32 peers per metric that join hetforge
MAX_PEERS = 3
PAUSE_S = 0.05  # before each batch: the thread pools of the process that ran before stop spinning and sleep
MEMORY_HEADROOM = 1.25  # the suite's peak RSS of a group's systems times this must fit in the available memory


@dataclass
class SideGroup:
    """One group timed side by side on one model: per system, its batch median in each round (ms, measured)."""

    model: str
    mine: str  # "hetforge", "hetforge-bf16", "hetforge-w8" or "hetforge-w4"
    systems: list[str]  # mine first, then its peers
    rounds: int = 0  # rounds every system completed
    metrics: list[str] = field(default_factory=lambda: list(METRICS[:2]))  # what the rounds time
    prefill_ms: dict[str, list[float]] = field(default_factory=dict)
    step_ms: dict[str, list[float]] = field(default_factory=dict)
    decode_ms_per_token: dict[str, list[float]] = field(default_factory=dict)  # one request per round
    calls: dict[str, int] = field(default_factory=dict)  # timed calls per batch, per shape (decode: new tokens)
    loadavg: list[float] = field(default_factory=list)  # at the start of the rounds
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _median(st: Any) -> float | None:
    return getattr(st, "median", None)


def is_decode_peer(system: str) -> bool:
    return system.startswith(DECODE_PEERS)


def pick_groups(rows: list, model: str) -> list[tuple[str, list[str], list[str]]]:
    """(hetforge system, its peers, the metrics timed) for ``model`` from the suite's aggregated rows: see the
    module docstring. Decode is timed where the group has a decode peer whose row has a decode figure."""
    ok = {r.system: r for r in rows if r.model == model and r.runs_ok}
    out = []
    if "hetforge" in ok:
        f32 = [r for s, r in ok.items() if not s.startswith("hetforge") and is_f32(r.precision)]
        out.append(("hetforge", _fastest(f32, PEERS_PER_METRIC)))
    if "hetforge-bf16" in ok:
        bf16 = [r for s, r in ok.items() if s.startswith("ov") and is_bf16(r.precision)]
        out.append(("hetforge-bf16", _fastest(bf16, 1)))
    groups = []
    for mine, peers in out:
        decodes = _median(ok[mine].decode_ms_per_token) is not None and any(
            is_decode_peer(p) and _median(ok[p].decode_ms_per_token) is not None for p in peers)
        if peers:
            groups.append((mine, peers, list(METRICS if decodes else METRICS[:2])))
    for quant, (peer, _) in QUANT_DECODE_PAIRS.items():
        mine, q = ok.get(quant), ok.get(peer)
        if mine is not None and q is not None and _median(mine.decode_ms_per_token) and _median(q.decode_ms_per_token):
            groups.append((quant, [peer], ["decode_ms_per_token"]))
    return groups


def _fastest(cands: list, per_metric: int) -> list[str]:
    """The ``per_metric`` fastest of ``cands`` by median, per metric (decode: decode peers only), fastest first, at
    most :data:`MAX_PEERS`."""
    chosen: list[str] = []
    for metric in METRICS:
        have = sorted((r for r in cands if _median(getattr(r, metric)) is not None
                       and (metric != "decode_ms_per_token" or is_decode_peer(r.system))),
                      key=lambda r: _median(getattr(r, metric)))
        chosen += [r.system for r in have[:per_metric]]
    return list(dict.fromkeys(chosen))[:MAX_PEERS]


def fit_memory(systems: list[str], rows: list, model: str, available_mb: float) -> tuple[list[str], str]:
    """``systems`` (the first is hetforge's) cut from the end until their peak RSS (the suite's median) times
    :data:`MEMORY_HEADROOM` fits in ``available_mb``; a note when any was cut."""
    rss = {r.system: _median(r.rss_peak_mb) or 0.0 for r in rows if r.model == model}
    keep = list(systems)
    while len(keep) > 2 and sum(rss.get(s, 0.0) for s in keep) * MEMORY_HEADROOM > available_mb:
        keep.pop()
    if sum(rss.get(s, 0.0) for s in keep) * MEMORY_HEADROOM > available_mb:
        return [], (f"{model}: side by side not run for {systems[0]} (its systems' peak RSS "
                    f"{sum(rss.get(s, 0.0) for s in keep):.0f} MB does not fit in {available_mb:.0f} MB available)")
    cut = [s for s in systems if s not in keep]
    return keep, (f"{model}: {', '.join(cut)} left out of the side-by-side group of {systems[0]} (the group's peak RSS "
                  f"would not fit in {available_mb:.0f} MB available)" if cut else "")


class _Served:
    """One system's serving worker process."""

    def __init__(self, system: str, spec_path: Path, env: dict[str, str], log: Path) -> None:
        self.system = system
        self.log = log.open("w")
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "hetforge.benchmarks.worker", "--serve",
                                          str(spec_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self.log, text=True, env=env)
        except OSError as e:  # reported like a worker that could not prepare
            self.log.close()
            raise RuntimeError(f"{system}: cannot start its worker ({e.strerror or e})") from None

    def reply(self, timeout_s: float) -> dict:
        """The worker's next reply line; a RuntimeError when it does not come within ``timeout_s`` or it died."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"{self.system}: no reply within {timeout_s:.0f} s" if not ready
                               else f"{self.system}: worker exited (code {self.proc.poll()}){self._last_words()}")
        return json.loads(line)

    def _last_words(self) -> str:
        """The last line the worker wrote to its log (stderr), as ``: line``, or ``""``."""
        self.log.flush()
        try:
            tail = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return f": {tail[-1][:200]}" if tail else ""

    def ask(self, cmd: dict, timeout_s: float) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.reply(timeout_s)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run_group(cfg: Any, model: str, mine: str, peers: list[str], root: Path, say: Callable[[str], None],
              deadline: float | None, worker_env: Callable[[Any, dict[str, str]], dict[str, str]],
              env_for: Callable[[str, Path], dict[str, str]], metrics: list[str] | None = None) -> SideGroup:
    """Prepare ``mine`` and ``peers`` on ``model`` in serving workers, one after the other, then time
    ``cfg.side_rounds`` rounds of ``metrics`` (default: prefill and one token) in turns; a worker that fails to
    prepare is left out (noted), and rounds stop at ``deadline`` (``time.perf_counter()`` seconds; noted)."""
    prefill_calls, step_calls = (1, 3) if cfg.quick else (2, 5)
    metrics = list(metrics or METRICS[:2])
    group = SideGroup(model, mine, [], metrics=metrics, calls={"prefill": prefill_calls, "step": step_calls})
    decoding = "decode_ms_per_token" in metrics
    served: list[_Served] = []
    decoders: set[str] = set()  # served systems whose decode path is ready
    folder = Path(tempfile.mkdtemp(prefix=f"side-{model}-", dir=root))
    try:
        for s in [mine, *peers]:
            spec = cfg.worker_spec(s, model, "side", folder / f"work-{s}", folder / f"cache-{s}", folder / "ref.pt")
            # only a group that times decode warms (compiles) a decode path: hetforge's and the decode peers'
            spec = replace(spec, decode=decoding and (s == mine or is_decode_peer(s)))
            if decoding and s == mine:
                group.calls["decode"] = spec.decode_tokens  # the suite's --decode-tokens (quick mode: fewer)
            path = folder / f"{s}.json"
            path.write_text(json.dumps(asdict(spec)))
            say(f"        side by side on {model}: preparing {s}")
            w = None
            try:
                w = _Served(s, path, worker_env(spec, env_for(s, folder / f"cache-{s}")), folder / f"{s}.log")
                got = w.reply(cfg.timeout_s)
            except RuntimeError as e:
                got = {"ready": False, "error": str(e)}
            if not got.get("ready"):
                group.notes.append(f"{s} left out of the side-by-side group on {model}: {got.get('error')}")
                if w is not None:
                    w.close()
                if s == mine:
                    return group
                continue
            served.append(w)
            if got.get("decode"):
                decoders.add(s)
        group.systems = [w.system for w in served]
        if len(served) < 2:
            return group
        for w in served:
            for metric in metrics:
                if metric != "decode_ms_per_token" or w.system in decoders:
                    getattr(group, metric)[w.system] = []
        group.loadavg = [round(x, 2) for x in os.getloadavg()]
        for r in range(cfg.side_rounds):
            if deadline is not None and time.perf_counter() > deadline:
                group.notes.append(f"side by side on {model}: stopped after {r} of {cfg.side_rounds} rounds (suite "
                                   "time limit)")
                break
            k = r % len(served)
            for metric in metrics:
                for w in served[k:] + served[:k]:
                    if w.system not in getattr(group, metric):
                        continue
                    time.sleep(PAUSE_S)
                    if metric == "decode_ms_per_token":
                        cmd = {"shape": "decode", "tokens": group.calls["decode"]}
                    else:
                        calls = prefill_calls if metric == "prefill_ms" else step_calls
                        cmd = {"shape": SHAPE[metric], "warmup": 1 if metric == "prefill_ms" else 2, "calls": calls,
                               "max_s": 3.0}
                    got = w.ask(cmd, cfg.timeout_s)
                    if "ms" not in got:
                        raise RuntimeError(f"{w.system}: {got.get('error', 'no timing in its reply')}")
                    getattr(group, metric)[w.system].append(statistics.median(got["ms"]))
            group.rounds = r + 1
        say(f"        side by side on {model}: {group.rounds} rounds of {', '.join(group.systems)}")
    except RuntimeError as e:  # a worker died or hung mid-round: the rounds completed so far stand
        group.notes.append(f"side by side on {model} stopped: {e}")
        for metric in METRICS:
            for xs in getattr(group, metric).values():
                del xs[group.rounds:]
    finally:
        for w in served:
            w.close()
        shutil.rmtree(folder, ignore_errors=True)  # exported models and caches are large, as in the suite's runs
    return group


def run_side(cfg: Any, rows: list, root: Path, say: Callable[[str], None], deadline: float | None,
             worker_env: Callable[[Any, dict[str, str]], dict[str, str]],
             env_for: Callable[[str, Path], dict[str, str]]) -> tuple[list[SideGroup], list[str]]:
    """Every model's groups (:func:`pick_groups`), in turn; returns the groups and notes on what did not run."""
    import psutil

    groups: list[SideGroup] = []
    notes: list[str] = []
    for model in cfg.models:
        for mine, peers, metrics in pick_groups(rows, model):
            if deadline is not None and time.perf_counter() > deadline:
                notes.append(f"{model}: side by side for {mine} not started (suite time limit)")
                continue
            systems, why = fit_memory([mine, *peers], rows, model, psutil.virtual_memory().available / 2**20)
            if why:
                notes.append(why)
            if systems:
                groups.append(run_group(cfg, model, mine, systems[1:], root, say, deadline, worker_env, env_for,
                                        metrics))
    return groups, notes


def per_round(group: dict, metric: str, mine: str, peer: str) -> list[float]:
    """``mine`` ÷ ``peer`` in each round of a saved group (``SideGroup.to_dict()``)."""
    a, b = group.get(metric, {}).get(mine) or [], group.get(metric, {}).get(peer) or []
    return [x / y for x, y in zip(a, b, strict=False) if y]


def verdict(side: list[dict] | None, model: str, mine: str, metric: str, mark: float = 1.0) -> dict | None:
    """The side-by-side figures for ``mine`` on ``model`` and ``metric``: the peer with the lowest median over
    rounds, both medians, the per-round ratios, their median and whether it is at or below ``mark``; None where no
    group with a peer and a completed round ran."""
    g = next((g for g in side or [] if g.get("model") == model and g.get("mine") == mine and g.get("rounds")), None)
    if g is None:
        return None
    times = g.get(metric) or {}
    peers = {s: xs for s, xs in times.items() if s != mine and xs}
    if mine not in times or not peers:
        return None
    best = min(peers, key=lambda s: statistics.median(peers[s]))
    ratios = per_round(g, metric, mine, best)
    ratio = statistics.median(ratios)
    return {"best_peer": best, "peer": statistics.median(peers[best]), "hetforge": statistics.median(times[mine]),
            "ratio": ratio, "per_round": ratios, "rounds": g["rounds"], "met": ratio <= mark}
