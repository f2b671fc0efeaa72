"""The peer benchmark harness: interleave systems, one process per measurement, aggregate, compare.

Order of work, per model: repeat 1 runs eager first (it writes the reference logits every other
system is compared with), then every other system; each later repeat rotates the order so slow drift
of the machine's speed lands on all systems alike. A system with a cache (torch.compile's inductor
cache, OpenVINO's CACHE_DIR) gets a second, fresh process right after its cold run, pointed at the
cache folder the cold run filled: that is its warm preparation time.

Each measurement runs in its own Python process (``isolate=True``) so peak RSS is that system's own
(import + model + preparation + runs); ``isolate=False`` runs in this process (tests), and the RSS
figures then say so. A run that raises, times out or whose peer is not installed becomes a row with
the error's first line. A time budget stops starting new repeats once spent and the report says so.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hetforge.benchmarks.base import QUANT_DECODE_PAIRS, is_bf16, is_f32
from hetforge.benchmarks.side import run_side, verdict
from hetforge.benchmarks.systems import (
    PEER_KEYS_FOR_PREP_TARGET,
    SYSTEMS,
    missing_requirement,
)
from hetforge.benchmarks.worker import FIRST_CALLS, RunResult, WorkerSpec, first_line, run_worker
from hetforge.errors import UsageError
from hetforge.files import json_safe, write_text
from hetforge.hardware.isa import isa_flags

DEFAULT_MODELS = ["gpt2", "llama-110m", "mixtral-small"]
QUICK_MODELS = ["gpt2-tiny", "llama-tiny"]
# Systems known (peer-baselines.md) to take minutes on an MoE model for no usable result are still run,
# but with a short timeout so their row is recorded quickly.
HEAVY_MODEL_PEER_TIMEOUT_S = {"mixtral-small": 300.0}
# issue 24: fp32 prefill at or below 0.95x the best f32 peer; the one-token forward and decode at or below it
TARGET_MARKS = {"prefill_ms": 0.95}


@dataclass
class SuiteConfig:
    """What to run and how hard."""

    models: list[str] = field(default_factory=lambda: list(DEFAULT_MODELS))
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    repeats: int = 3
    quick: bool = False
    seq: int = 128
    decode_tokens: int = 128  # new tokens per timed decode request (quick mode: 8)
    threads: int = 2
    isolate: bool = True
    warm: bool = True  # measure warm (cached) preparation for systems with a cache
    timeout_s: float = 600.0  # per process
    budget_s: float | None = None  # soft: start no repeat after the first once this much time has passed
    limit_s: float | None = None  # hard: start no process at all after this; what is left is a "not run" row
    warm_repeats: int = 1  # warm (cached) preparation is measured in this many repeats
    max_repeats: dict[str, int] = field(default_factory=dict)  # per-model cap (e.g. mixtral-small: 1)
    workdir: str | None = None
    # how first calls are counted (recorded so a page says which rule its figures follow): "above-hot" = every
    # system's first call of each shape, minus the best of its next two, where positive (benchmarks.worker)
    first_calls: str = "above-hot"
    # rounds of the side-by-side phase (benchmarks.side: hetforge and its closest peers loaded at once, timed in
    # turns); 0: none. It needs isolated workers (isolate=True)
    side_rounds: int = 15

    def validate(self) -> None:
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown:
            raise UsageError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
        from hetforge.models.zoo import resolve

        for m in self.models:
            resolve(m)
        if self.repeats < 1:
            raise UsageError(f"--repeats must be ≥ 1, got {self.repeats}")
        if not 1 <= self.seq <= 4096:
            raise UsageError(f"--seq must be in 1..4096, got {self.seq}")
        if not 1 <= self.decode_tokens <= 4096:
            raise UsageError(f"--decode-tokens must be in 1..4096, got {self.decode_tokens}")
        if not 0 <= self.side_rounds <= 50:
            raise UsageError(f"--side-rounds must be in 0..50, got {self.side_rounds}")

    def worker_spec(self, system: str, model: str, mode: str, workdir: Path, cache_dir: Path, ref: Path
                    ) -> WorkerSpec:
        if self.quick:
            iters = dict(warmup=1, prefill_iters=3, step_iters=5, max_measure_s=2.0, decode_tokens=8)
        else:
            iters = dict(warmup=2, prefill_iters=10, step_iters=30, max_measure_s=3.0,
                         decode_tokens=self.decode_tokens)
        return WorkerSpec(system=system, model=model, mode=mode, seq=self.seq, threads=self.threads,
                          workdir=str(workdir), cache_dir=str(cache_dir), ref_path=str(ref), **iters)


@dataclass
class Stat:
    """Median and spread (min, max) over repeats of one figure; ``n`` runs contributed."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, xs: list[float]) -> Stat | None:
        xs = [x for x in xs if x is not None]
        if not xs:
            return None
        return cls(statistics.median(xs), min(xs), max(xs), len(xs))


@dataclass
class Row:
    """One system on one model, aggregated over repeats."""

    model: str
    system: str
    label: str
    status: str
    error: str = ""
    runs_ok: int = 0
    runs: int = 0
    precision: str = ""
    prep_s: Stat | None = None
    stages: dict[str, Stat] = field(default_factory=dict)
    warm_prep_s: Stat | None = None
    warm_stages: dict[str, Stat] = field(default_factory=dict)
    prefill_ms: Stat | None = None
    step_ms: Stat | None = None
    ttft_ms: Stat | None = None
    decode_ms_per_token: Stat | None = None
    decode_prep_s: Stat | None = None  # one-time preparation of the decode path, not in prep_s
    rss_peak_mb: Stat | None = None
    rss_model_mb: Stat | None = None
    max_abs_err: float | None = None  # worst over runs
    kl_mean: float | None = None
    kl_max: float | None = None
    top1_agree: float | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class SuiteResult:
    """Everything a suite run produced: raw runs, aggregated rows, comparisons and where it ran."""

    config: dict
    machine: dict
    command: str
    started: str
    seconds: float
    rows: list[Row]
    runs: list[dict]
    comparisons: list[dict]
    skipped: list[str] = field(default_factory=list)
    isolated: bool = True
    side: list[dict] = field(default_factory=list)  # benchmarks.side.SideGroup.to_dict() per group timed side by side

    def to_dict(self) -> dict:
        return asdict(self)


def machine_info(threads: int) -> dict:
    """Where the suite ran: CPU model and ISA flags, cores, memory, library versions, load average."""
    import psutil
    import torch
    import transformers

    from hetforge.hardware.host import cpu_name

    cpu = cpu_name()
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__}
    for mod in ("onnxruntime", "openvino", "onnx", "onnxscript"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # not installed, or no __version__
            versions[mod] = "not installed"
    return {
        "cpu": cpu, "isa": isa_flags(), "logical_cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}", "threads": threads, "versions": versions,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def worker_env(spec: WorkerSpec, env_extra: dict[str, str]) -> dict[str, str]:
    """The environment of a worker process: this one's, the thread counts, offline Hugging Face, ``env_extra``."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(spec.threads), "MKL_NUM_THREADS": str(spec.threads),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONWARNINGS": "ignore"})
    env.update(env_extra)
    return env


def _run_isolated(spec: WorkerSpec, timeout_s: float, env_extra: dict[str, str]) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="hf-bench-") as td:
        spec_path, out_path = Path(td) / "spec.json", Path(td) / "result.json"
        spec_path.write_text(json.dumps(asdict(spec)))
        env = worker_env(spec, env_extra)
        cmd = [sys.executable, "-m", "hetforge.benchmarks.worker", str(spec_path), str(out_path)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return RunResult(system=spec.system, model=spec.model, mode=spec.mode, status="timeout",
                             error=f"timed out after {timeout_s:.0f} s (process killed)",
                             wall_s=time.perf_counter() - t0)
        if out_path.is_file():
            return RunResult(**json.loads(out_path.read_text()))
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()
        msg = tail[-1] if tail else f"exit code {proc.returncode}"
        return RunResult(system=spec.system, model=spec.model, mode=spec.mode, status="failed",
                         error=f"worker died (exit {proc.returncode}): {first_line(msg)}",
                         wall_s=time.perf_counter() - t0)


def _run_inprocess(spec: WorkerSpec, env_extra: dict[str, str]) -> RunResult:
    saved = {k: os.environ.get(k) for k in env_extra}
    os.environ.update(env_extra)
    try:
        res = run_worker(spec)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    res.notes.append("in-process run: RSS figures are the whole test process's, not this system's own")
    return res


def _env_for(system: str, cache_dir: Path) -> dict[str, str]:
    if system == "compile":
        return {"TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor")}
    if system.startswith("hetforge"):  # own compile cache folder: a cold run is cold (runtime.compile_cache)
        return {"HETFORGE_COMPILE_CACHE_DIR": str(cache_dir / "hetforge-programs")}
    return {}


def run_suite(cfg: SuiteConfig, progress: Callable[[str], None] | None = None, command: str = "") -> SuiteResult:
    """Run every (model, system) pair ``cfg.repeats`` times, interleaved, and aggregate."""
    cfg.validate()
    say = progress or (lambda _m: None)
    t_suite = time.perf_counter()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    machine = machine_info(cfg.threads)
    own_root = cfg.workdir is None
    root = Path(cfg.workdir) if cfg.workdir else Path(tempfile.mkdtemp(prefix="hetforge-peers-"))
    root.mkdir(parents=True, exist_ok=True)
    runs: list[RunResult] = []
    skipped: list[str] = []
    systems = list(dict.fromkeys(cfg.systems))
    # the eager run writes the reference logits; it goes first in repeat 1 when selected
    active: dict[str, list[str]] = {}
    for model in cfg.models:
        missing = {s: missing_requirement(SYSTEMS[s]) for s in systems}
        for s, msg in missing.items():
            if msg:
                runs.append(RunResult(system=s, model=model, mode="cold", status="not installed", error=msg,
                                      label=SYSTEMS[s].label))
        active[model] = [s for s in systems if not missing[s]]
    # repeat-major: every model gets its first repeat before any model gets a second, so a time budget
    # that runs out costs spread, never a whole model
    for r in range(cfg.repeats):
        for model in cfg.models:
            reps = min(cfg.repeats, cfg.max_repeats.get(model, cfg.repeats))
            if r >= reps:
                continue
            if cfg.budget_s is not None and r > 0 and time.perf_counter() - t_suite > cfg.budget_s:
                skipped.append(f"{model}: repeat {r + 1} of {reps} not started (time budget {cfg.budget_s:.0f} s "
                               "spent)")
                continue
            _run_block(cfg, model, r, reps, active[model], root, runs, say, t_suite)
    rows = aggregate(runs, cfg.models, systems)
    side: list[dict] = []
    if cfg.side_rounds and cfg.isolate:
        deadline = t_suite + cfg.limit_s if cfg.limit_s is not None else None
        groups, side_notes = run_side(cfg, rows, root, say, deadline, worker_env, _env_for)
        side = [g.to_dict() for g in groups]
        skipped += side_notes
    if cfg.limit_s is not None and time.perf_counter() - t_suite > cfg.limit_s:
        skipped.append(f"suite time limit {cfg.limit_s:.0f} s reached: processes after it were not started")
    if own_root:
        shutil.rmtree(root, ignore_errors=True)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return SuiteResult(
        config=asdict(cfg), machine=machine, command=with_env(command or _default_command()), started=started,
        seconds=time.perf_counter() - t_suite, rows=rows, runs=[r.to_dict() for r in runs],
        comparisons=compare(rows, runs, side), skipped=skipped, isolated=cfg.isolate, side=side,
    )


def _run_block(cfg: SuiteConfig, model: str, r: int, reps: int, active: list[str], root: Path,
               runs: list[RunResult], say: Callable[[str], None], t_suite: float) -> None:
    """Repeat ``r`` of every active system on ``model``: eager first in repeat 1, then rotated order."""
    ref = root / f"ref-{model}-seq{cfg.seq}.pt"
    order = active[r % len(active):] + active[:r % len(active)] if active else []
    if r == 0 and "eager" in order:
        order.remove("eager")
        order.insert(0, "eager")
    for s in order:
        # a system that failed or timed out on this model is not retried in later repeats
        prior = [x for x in runs if x.model == model and x.system == s and x.mode == "cold"]
        if prior and all(x.status in ("failed", "timeout", "not run") for x in prior):
            continue
        cache = root / "cache" / f"{model}-{s}-r{r}"
        work = root / "work" / f"{model}-{s}-r{r}"
        timeout = cfg.timeout_s
        if s not in ("eager", "hetforge") and model in HEAVY_MODEL_PEER_TIMEOUT_S:
            timeout = min(timeout, HEAVY_MODEL_PEER_TIMEOUT_S[model])
        for mode in ("cold", "warm"):
            if mode == "warm" and not (cfg.warm and SYSTEMS[s].has_cache and runs[-1].status == "ok"
                                       and r < cfg.warm_repeats):
                continue
            if cfg.limit_s is not None and time.perf_counter() - t_suite > cfg.limit_s:
                if mode == "cold" and not prior:
                    runs.append(RunResult(system=s, model=model, mode="cold", status="not run",
                                          error=f"suite time limit ({cfg.limit_s:.0f} s) reached before this "
                                                "system's turn", label=SYSTEMS[s].label))
                break
            spec = cfg.worker_spec(s, model, mode, work, cache, ref)
            say(f"[{time.perf_counter() - t_suite:6.0f}s] {model} repeat {r + 1}/{reps}: {s} ({mode})")
            env = _env_for(s, cache)
            res = _run_isolated(spec, timeout, env) if cfg.isolate else _run_inprocess(spec, env)
            runs.append(res)
            extra = f" — {res.error}" if res.error else ""
            say(f"        {res.status}{extra}")
        # exported files and caches are large (an ONNX GPT-2 is ~0.5 GB): drop them once measured
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)


# settings that change what hetforge runs (or, HETFORGE_PARALLEL_COMPILE, how its cold preparation is timed)
BEHAVIOUR_ENV = ("HETFORGE_W8_ACT", "HETFORGE_W4_ACT", "HETFORGE_GEMM", "HETFORGE_CAPTURE", "HETFORGE_GEMV_MULTI",
                 "HETFORGE_PARALLEL_COMPILE")


def _default_command() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]])


def with_env(command: str) -> str:
    """``command`` with the environment settings that change what hetforge runs in front of it (as a shell line)."""
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in BEHAVIOUR_ENV if os.environ.get(k)]
    return " ".join([*env, command])


def aggregate(runs: list[RunResult], models: list[str], systems: list[str]) -> list[Row]:
    """One row per (model, system): medians and spread over the successful cold/warm runs."""
    rows: list[Row] = []
    for model in models:
        for s in systems:
            cold = [r for r in runs if r.model == model and r.system == s and r.mode == "cold"]
            warm = [r for r in runs if r.model == model and r.system == s and r.mode == "warm" and r.status == "ok"]
            ok = [r for r in cold if r.status == "ok"]
            bad = [r for r in cold if r.status != "ok" and (r.status != "not run" or not ok)]
            label = next((r.label for r in ok if r.label), None) or SYSTEMS[s].label
            row = Row(model=model, system=s, label=label, status="ok" if ok else (bad[0].status if bad else "not run"),
                      runs_ok=len(ok), runs=len(cold))
            if bad:
                row.error = bad[0].error
                if ok:
                    row.status = f"ok ({len(bad)}/{len(cold)} runs {bad[0].status})"
            if ok:
                row.precision = ok[0].precision
                row.prep_s = Stat.of([r.prep_s for r in ok])
                row.stages = {k: Stat.of([r.stages.get(k) for r in ok]) for k in ok[0].stages}
                row.prefill_ms = Stat.of([statistics.median(r.prefill_ms) for r in ok if r.prefill_ms])
                row.step_ms = Stat.of([statistics.median(r.step_ms) for r in ok if r.step_ms])
                row.ttft_ms = Stat.of([r.ttft_ms for r in ok])
                row.decode_ms_per_token = Stat.of([r.decode_ms_per_token for r in ok])
                row.decode_prep_s = Stat.of([r.decode_prep_s for r in ok])
                row.rss_peak_mb = Stat.of([r.rss_peak_mb for r in ok])
                row.rss_model_mb = Stat.of([r.rss_model_mb for r in ok])
                fids = [r.fidelity for r in ok if r.fidelity]
                if fids:
                    row.max_abs_err = max(f["max_abs_err"] for f in fids)
                    row.kl_mean = max(f["kl_mean"] for f in fids)
                    row.kl_max = max(f["kl_max"] for f in fids)
                    row.top1_agree = min(f["top1_agree"] for f in fids)
                row.notes = list(dict.fromkeys(n for r in ok for n in r.notes if len(n) < 200))
            if warm:
                row.warm_prep_s = Stat.of([r.prep_s for r in warm])
                row.warm_stages = {k: Stat.of([r.stages.get(k) for r in warm]) for k in warm[0].stages}
            rows.append(row)
    return rows


def _med(st: Stat | None) -> float | None:
    return st.median if st is not None else None


def _prepares(row: Row) -> bool:
    """Whether a system has a preparation stage besides its first calls."""
    return any(k != FIRST_CALLS and v is not None and v.median > 0 for k, v in row.stages.items())


def by_repeat(runs: list, model: str, system: str, metric: str) -> list[float | None]:
    """``system``'s figure for ``metric`` on ``model`` in each of its cold runs, in run order (None where a run
    failed): the k-th is its repeat k, since the suite runs repeat-major and a system it stops running (after
    failing) is not run again. A list figure (per-call latencies) gives its median, as :func:`aggregate` does.
    ``runs``: :class:`~hetforge.benchmarks.worker.RunResult` objects or their dicts (a saved JSON)."""
    out: list[float | None] = []
    for r in runs:
        get = r.get if isinstance(r, dict) else (lambda k, r=r: getattr(r, k, None))
        if get("model") != model or get("system") != system or get("mode") != "cold":
            continue
        v = get(metric) if get("status") == "ok" else None
        out.append((statistics.median(v) if v else None) if isinstance(v, list) else v)
    return out


def paired(runs: list | None, model: str, mine: str, peer: str, metric: str) -> list[float]:
    """``mine`` ÷ ``peer`` repeat by repeat (the two ran in the same round of the interleaved suite: a shared host's
    drift between rounds does not enter the ratio), over the repeats both completed; empty without runs."""
    if not runs:
        return []
    a, b = by_repeat(runs, model, mine, metric), by_repeat(runs, model, peer, metric)
    return [x / y for x, y in zip(a, b, strict=False) if x is not None and y]


def _judged(serial: dict, side: dict | None) -> dict:
    """A target's entry: judged on its side-by-side figures where they exist (:func:`hetforge.benchmarks.side.verdict`:
    timed in turns, so the machine's drift between the suite's processes stays out of the ratio), with the serial
    medians kept under ``serial``; else the serial medians."""
    if side is None:
        return {**serial, "judged": "serial"}
    return {**serial, **side, "judged": "side by side",
            "serial": {k: serial[k] for k in ("best_peer", "peer", "hetforge", "ratio", "met", "paired")}}


def compare(rows: list[Row], runs: list | None = None, side: list[dict] | None = None) -> list[dict]:
    """Per model: hetforge ÷ each peer (median ÷ median) and the issue's targets, met or not (judged on the medians);
    with ``runs``, each target also lists the ratio repeat by repeat (:func:`paired`), which shows whether the
    verdict held in every round. With ``side`` (groups timed side by side, :mod:`hetforge.benchmarks.side`), the
    prefill, one-token and decode targets are judged on those rounds where a group timed them (:func:`_judged`)."""
    out: list[dict] = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = next((r for r in rows if r.model == model and r.system == "hetforge" and r.runs_ok), None)
        peers = [r for r in rows if r.model == model and not r.system.startswith("hetforge") and r.runs_ok]
        entry: dict = {"model": model, "hetforge": mine is not None, "ratios": {}, "targets": {}}
        if mine is None:
            out.append(entry)
            continue
        for p in peers:
            ratio = {}
            for metric in ("prep_s", "prefill_ms", "step_ms", "decode_ms_per_token", "rss_peak_mb"):
                a, b = _med(getattr(mine, metric)), _med(getattr(p, metric))
                if metric == "prep_s" and not _prepares(p):
                    b = None  # e.g. eager: its first calls alone are no preparation to compare with
                ratio[metric] = a / b if a is not None and b not in (None, 0) else None
            entry["ratios"][p.system] = ratio
        prep_peers = [p for p in peers if p.system in PEER_KEYS_FOR_PREP_TARGET and p.prep_s]
        if prep_peers and mine.prep_s:
            # judged on the slower of hetforge's two pairs: the forward programs ([1, seq] and [1, 1], no cache:
            # what the peers prepare) and the runtime's prefill + KV-cache decode programs (what `hetforge run`
            # waits for before its first token; decode_prep_s)
            fwd, rt = mine.prep_s.median, _med(mine.decode_prep_s)
            hs = max(fwd, rt) if rt is not None else fwd
            fastest = min(prep_peers, key=lambda p: p.prep_s.median)
            speedup = fastest.prep_s.median / hs if hs > 0 else None
            entry["targets"]["cold_prep_5x"] = {
                "fastest_peer": fastest.system, "peer_s": fastest.prep_s.median, "hetforge_s": hs,
                "hetforge_forward_pair_s": fwd, "hetforge_runtime_pair_s": rt,
                "speedup": speedup, "met": speedup is not None and speedup >= 5.0}
        f32 = [p for p in peers if is_f32(p.precision)]
        for metric in ("prefill_ms", "step_ms", "decode_ms_per_token"):
            cands = [p for p in f32 if getattr(p, metric) is not None]
            mv = _med(getattr(mine, metric))
            if cands and mv is not None:
                best = min(cands, key=lambda p: getattr(p, metric).median)
                bv = getattr(best, metric).median
                mark = TARGET_MARKS.get(metric, 1.0)
                entry["targets"][f"{metric}_at_or_below_best_f32_peer"] = _judged(
                    {"best_peer": best.system, "peer": bv, "hetforge": mv, "ratio": mv / bv, "mark": mark,
                     "met": mv <= mark * bv, "paired": paired(runs, model, "hetforge", best.system, metric)},
                    verdict(side, model, "hetforge", metric, mark))
        for quant, (peer, key) in QUANT_DECODE_PAIRS.items():
            qr = next((r for r in rows if r.model == model and r.system == quant and r.runs_ok), None)
            pr = next((r for r in rows if r.model == model and r.system == peer and r.runs_ok), None)
            if qr is not None and pr is not None and qr.decode_ms_per_token and pr.decode_ms_per_token:
                mv, bv = qr.decode_ms_per_token.median, pr.decode_ms_per_token.median
                entry["targets"][key] = _judged(
                    {"best_peer": peer, "peer": bv, "hetforge": mv, "ratio": mv / bv, "met": mv <= bv,
                     "paired": paired(runs, model, quant, peer, "decode_ms_per_token")},
                    verdict(side, model, quant, "decode_ms_per_token"))
        if mine.kl_max is not None:
            entry["targets"]["kl_le_1e-8"] = {"kl_max": mine.kl_max, "met": mine.kl_max <= 1e-8}
        entry["targets"].update(_bf16_targets(rows, model, runs, side))
        out.append(entry)
    return out


def _bf16_targets(rows: list[Row], model: str, runs: list | None = None, side: list[dict] | None = None) -> dict:
    """hetforge at ``--precision bf16`` against the OpenVINO rows that ran in bf16 (median ÷ median), per metric,
    with hetforge-bf16's KL against fp32 eager reported beside (issue: at or below OpenVINO's bf16)."""
    mine = next((r for r in rows if r.model == model and r.system == "hetforge-bf16" and r.runs_ok), None)
    ov = [r for r in rows if r.model == model and r.system.startswith("ov") and r.runs_ok
          and is_bf16(r.precision)]
    out: dict = {}
    if mine is None or not ov:
        return out
    for metric in ("prefill_ms", "step_ms", "decode_ms_per_token"):
        cands = [p for p in ov if getattr(p, metric) is not None]
        mv = _med(getattr(mine, metric))
        if cands and mv is not None:
            best = min(cands, key=lambda p: getattr(p, metric).median)
            bv = getattr(best, metric).median
            out[f"{metric}_bf16_at_or_below_openvino_bf16"] = _judged(
                {"best_peer": best.system, "peer": bv, "hetforge": mv, "ratio": mv / bv, "met": mv <= bv,
                 "kl_max": mine.kl_max, "paired": paired(runs, model, "hetforge-bf16", best.system, metric)},
                verdict(side, model, "hetforge-bf16", metric))
    return out


def save_json(result: SuiteResult, path: Path) -> None:
    """Write the raw and aggregated results (atomically)."""
    write_text(path, json.dumps(json_safe(result.to_dict()), indent=1, default=str), "--out-dir file")
