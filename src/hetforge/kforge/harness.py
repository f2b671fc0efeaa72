"""The evaluation harness, parent side: run the reference and each candidate in their own limited
subprocesses, compare outputs here, and turn everything into an :class:`Attempt`.

Isolation: a fresh ``python -m hetforge.kforge.worker`` per attempt, in its own session (killed as a
group on timeout), with address-space and core-dump limits (``resource``), in a fresh network namespace
when ``unshare -rn`` works on this host (else Python sockets are refused inside the worker). A hang, a
crash or a segfault fails that attempt with the reason; the caller goes on.
"""

from __future__ import annotations

import functools
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hetforge.errors import HetforgeError
from hetforge.kforge import guardrails
from hetforge.kforge.platforms import Platform
from hetforge.kforge.problems import Problem


def cache_root() -> Path:
    base = os.environ.get("HETFORGE_KFORGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hetforge", "kforge")
    p = Path(base)
    p.mkdir(parents=True, exist_ok=True)
    return p


def _flush_default() -> int:
    from hetforge.kernels.native import llc_bytes

    return min(2 * llc_bytes(), 128 * 2**20)


@dataclass
class Config:
    """Harness settings (the defaults are the documented ones)."""

    trials: int = 3  # fresh random inputs checked per attempt
    atol: float = 1e-4
    rtol: float = 1e-4
    threads: int = 2
    warmup: int = 3
    reps: int = 30
    budget_s: float = 2.0  # most time spent in timed trials per measurement
    flush_bytes: int = field(default_factory=lambda: _flush_default())  # written between trials (evicts caches)
    timeout_s: float = 300.0
    mem_bytes: int = 8 * 2**30
    compile_baseline: bool = True
    roofline_slack: float = 2.0  # flag a time below bound / slack
    seed: int = 0
    cache: Path = field(default_factory=cache_root)
    device: str = "cpu"  # where reference and candidates run: the platform's device() ("cpu" or "cuda")


@dataclass
class RefInfo:
    """The reference's facts: where its inputs/outputs are, its work, and its baseline times (measured)."""

    refs_path: Path
    flops: float
    elementwise: float
    nbytes: float
    eager_s: float
    compile_s: float | None
    compile_build_s: float | None
    compile_error: str | None
    device: str = "cpu"
    peak_flops: float | None = None  # the device's roofline, measured by the reference worker on a GPU
    bandwidth: float | None = None

    def roofline(self, peak_flops: float, bandwidth: float) -> tuple[float, float]:
        """The roofline a candidate is judged by: the GPU's own where the reference measured one, else the given
        (host profile) figures."""
        return (self.peak_flops, self.bandwidth or bandwidth) if self.peak_flops else (peak_flops, bandwidth)

    @property
    def baseline_s(self) -> float:
        return min(t for t in (self.eager_s, self.compile_s) if t is not None)

    @property
    def baseline_kind(self) -> str:
        return "torch.compile" if self.compile_s is not None and self.compile_s < self.eager_s else "eager"


@dataclass
class Attempt:
    """What one candidate did: each stage's outcome, guardrail violations, time and profile."""

    compiled: bool = False
    ran: bool = False
    correct: bool = False
    error: str | None = None
    violations: list[str] = field(default_factory=list)
    build_s: float | None = None
    time_s: float | None = None
    speedup: float | None = None
    roofline_bound_s: float | None = None
    flagged: str | None = None  # set when the time is implausible (below the roofline bound)
    roofline_note: str | None = None
    profile: dict | None = None
    max_abs_err: float | None = None

    def summary(self) -> str:
        if self.correct:
            s = f"correct, {self.time_s * 1e3:.3f} ms measured" if self.time_s else "correct"
            return s + (f" (FLAGGED: {self.flagged})" if self.flagged else "")
        return self.error or "; ".join(self.violations) or "failed"

    def to_dict(self) -> dict:
        return asdict(self)


@functools.cache
def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _limits(mem_bytes: int, device: str = "cpu"):
    """Core dumps off; on the CPU an address-space limit. A CUDA process reserves far more address space than
    it uses (the driver's unified address range), so on a GPU the limit would refuse CUDA's start: there the
    limit is RLIMIT_DATA (private writable memory), which those reservations do not count against."""
    def apply() -> None:
        kind = resource.RLIMIT_AS if device == "cpu" else resource.RLIMIT_DATA
        resource.setrlimit(kind, (mem_bytes, mem_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_worker(mode: str, spec: dict, folder: Path, cfg: Config, env_extra: dict[str, str] | None = None
               ) -> tuple[int | None, str]:
    """Run the worker; (return code or None on timeout, a reason when it did not exit 0). Logs go to ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / f"{mode}_spec.json"
    spec_path.write_text(json.dumps(spec, indent=1, default=str))
    cmd = [sys.executable, "-m", "hetforge.kforge.worker", mode, str(spec_path)]
    if _can_unshare():
        cmd = ["unshare", "-rn", *cmd]
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads), MKL_NUM_THREADS=str(cfg.threads),
               TORCH_EXTENSIONS_DIR=str(cfg.cache / "extensions"), MAX_JOBS="2", PYTHONUNBUFFERED="1",
               **(env_extra or {}))
    with open(folder / f"{mode}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=_limits(cfg.mem_bytes, cfg.device))
        try:
            rc = proc.wait(timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, f"timed out after {cfg.timeout_s:.0f} s (killed)"
    if rc == 0:
        return 0, ""
    if rc < 0:
        return rc, f"crashed with signal {signal.Signals(-rc).name}"
    tail = (folder / f"{mode}.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
    if "MemoryError" in tail[0] or "std::bad_alloc" in tail[0]:
        return rc, f"ran out of memory (limit {cfg.mem_bytes / 2**30:.0f} GiB): {tail[0][:200]}"
    return rc, f"worker exited with code {rc}: {tail[0][:300]}"


def reference(problem: Problem, cfg: Config) -> RefInfo:
    """Reference outputs and baseline times for a problem (cached on disk by source, seed, trials, threads)."""
    import torch

    key = f"{problem.name}-{problem.digest}-s{cfg.seed}-t{cfg.trials}-th{cfg.threads}-c{int(cfg.compile_baseline)}"
    if cfg.device != "cpu":
        key += f"-{cfg.device}"
    folder = cfg.cache / "refs" / f"{key}-torch{torch.__version__}"
    rj = folder / "reference.json"
    data = json.loads(rj.read_text()) if rj.exists() else {}
    if not data.get("phases", {}).get("baseline", {}).get("ok"):
        spec = {"problem": str(problem.path), "out_dir": str(folder), "seed": cfg.seed, "trials": cfg.trials,
                "threads": cfg.threads, "warmup": cfg.warmup, "reps": cfg.reps, "budget_s": cfg.budget_s,
                "flush_bytes": cfg.flush_bytes, "compile": cfg.compile_baseline, "device": cfg.device}
        rc, why = run_worker("reference", spec, folder, cfg)
        data = json.loads(rj.read_text()) if rj.exists() else {}
        if rc != 0 or not data.get("phases", {}).get("baseline", {}).get("ok"):
            raise HetforgeError(f"reference of problem '{problem.name}' failed: {why or 'no result'} "
                                f"(log: {folder / 'reference.log'})")
    return RefInfo(folder / "refs.pt", data["flops"], data["elementwise"], data["bytes"], data["eager"]["median_s"],
                   data.get("compile", {}).get("median_s"), data.get("compile_build_s"), data.get("compile_error"),
                   cfg.device, data.get("device_peak_flops"), data.get("device_bandwidth"))


def compare(ref_outs: list, outs: list, atol: float, rtol: float) -> tuple[bool, str, float]:
    """(match, reason, max abs error) of one trial: same count, dtype and shape, values within tolerance."""
    import torch

    if len(ref_outs) != len(outs):
        return False, f"{len(outs)} outputs, the reference has {len(ref_outs)}", math.inf
    worst = 0.0
    for i, (r, o) in enumerate(zip(ref_outs, outs, strict=True)):
        if not isinstance(o, torch.Tensor):
            return False, f"output {i} is {type(o).__name__}, not a tensor", math.inf
        if o.dtype != r.dtype:
            return False, f"output {i} dtype {o.dtype}, the reference's is {r.dtype}", math.inf
        if tuple(o.shape) != tuple(r.shape):
            return False, f"output {i} shape {tuple(o.shape)}, the reference's is {tuple(r.shape)}", math.inf
        o, r = o.cpu(), r.cpu()
        if r.is_floating_point():
            err = (o.double() - r.double()).abs()
            e = float(err.max()) if err.numel() else 0.0
            e = math.inf if math.isnan(e) else e
            worst = max(worst, e)
            if not torch.allclose(o, r, atol=atol, rtol=rtol):
                return False, f"output {i} mismatch: max abs error {e:.3g} (atol {atol:g}, rtol {rtol:g})", worst
        elif not torch.equal(o, r):
            return False, f"output {i} mismatch (exact dtype {r.dtype})", math.inf
    return True, "", worst


def evaluate(problem: Problem, code: str, platform: Platform, ref: RefInfo, folder: Path, cfg: Config,
             peak_flops: float, bandwidth: float) -> Attempt:
    """Build, run, check, time and profile one candidate; every outcome lands in the returned Attempt."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "candidate.py").write_text(code)
    att = Attempt()
    att.violations = guardrails.static_violations(code)
    if att.violations:  # caught in the source: not worth a build
        att.error = "; ".join(att.violations)
        return _save(att, folder)
    timed = platform.timed or torch.cuda.is_available()
    spec = {"candidate": str(folder / "candidate.py"), "refs": str(ref.refs_path), "out_dir": str(folder),
            "seed": cfg.seed, "threads": cfg.threads, "warmup": cfg.warmup, "reps": cfg.reps,
            "budget_s": cfg.budget_s, "flush_bytes": cfg.flush_bytes, "time": timed, "profile": timed,
            "device": ref.device}
    peak_flops, bandwidth = ref.roofline(peak_flops, bandwidth)
    rc, why = run_worker("candidate", spec, folder, cfg, platform.run_env())
    rj = folder / "result.json"
    data = json.loads(rj.read_text()) if rj.exists() else {"phases": {}}
    ph = data["phases"]
    att.compiled = ph.get("build", {}).get("ok", False)
    att.build_s = ph.get("build", {}).get("seconds")
    if not att.compiled:
        att.error = "build failed: " + (ph.get("build", {}).get("error") or why or "no result")[:400]
        return _save(att, folder)
    if not ph.get("run", {}).get("ok"):
        att.error = "run failed: " + (ph.get("run", {}).get("error") or why or "no result")[:400]
        return _save(att, folder)
    att.ran = True
    run = ph["run"]
    bad_ops = guardrails.forbidden_ops(run["ops"])
    if bad_ops:
        att.violations.append(f"torch ops do the work in ModelNew.forward ({', '.join(bad_ops[:6])}); "
                              f"the {platform.name} platform wants the computation in the kernel")
    if run["casts"]:
        att.violations.append(f"precision downcast at run time: {', '.join(run['casts'][:3])}")
    if run["mutated"]:
        att.violations.append(f"mutates its inputs ({', '.join(run['mutated'][:3])})")
    refs = torch.load(ref.refs_path, weights_only=False)
    got = torch.load(folder / "outputs.pt", weights_only=False)
    reason = ""
    for t, (r, o) in enumerate(zip(refs["outputs"], got["outputs"], strict=True)):
        ok, why_t, err = compare(r, o, cfg.atol, cfg.rtol)
        att.max_abs_err = max(att.max_abs_err or 0.0, err)
        if not ok:
            reason = f"trial {t}: {why_t}"
            if t > 0 and compare(refs["outputs"][t - 1], o, cfg.atol, cfg.rtol)[0]:
                att.violations.append(f"caches outputs across calls (trial {t} returned trial {t - 1}'s answer)")
            break
    same, why_d, _ = compare(got["outputs"][0], got["again"], 0.0, 0.0) if got["again"] is not None else (True, "", 0)
    if not same and not _nan_equal(got["outputs"][0], got["again"]):
        att.violations.append(f"reads uninitialised memory: a second run with unwritten memory filled with NaN "
                              f"differs ({why_d})")
    tampered = data.get("tampered") or []
    if tampered:
        att.violations.append(f"timer tampering: replaced {', '.join(tampered)}")
    if rc not in (0,) and "time" not in ph:
        reason = reason or f"timing failed: {why}"
    if reason or att.violations:
        att.error = "; ".join(att.violations) or reason
        if reason and att.violations:
            att.error += f" ({reason})"
        return _save(att, folder)
    att.correct = True
    if "time" in ph:
        att.time_s = ph["time"]["median_s"]
        att.speedup = ref.baseline_s / att.time_s
        att.roofline_bound_s = guardrails.roofline_bound_s(max(ref.flops, ref.elementwise), ref.nbytes,
                                                           peak_flops, bandwidth)
        limit = att.roofline_bound_s / cfg.roofline_slack
        if ref.eager_s < limit:  # the profile's bound is wrong for this host: eager PyTorch beats it too
            att.flagged = None
            att.roofline_note = (f"roofline bound {att.roofline_bound_s * 1e6:.1f} µs not trusted: eager PyTorch "
                                 f"({ref.eager_s * 1e6:.1f} µs) beats it too (calibrate the host profile)")
        elif att.time_s < limit:
            att.flagged = (f"{att.time_s * 1e6:.1f} µs measured is below the roofline bound "
                           f"{att.roofline_bound_s * 1e6:.1f} µs / {cfg.roofline_slack:g}: not credited")
    att.profile = ph.get("profile")
    return _save(att, folder)


def _nan_equal(a: list, b: list) -> bool:
    import torch

    return len(a) == len(b) and all(
        isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
        and torch.allclose(x, y, atol=0, rtol=0, equal_nan=True) for x, y in zip(a, b, strict=True))


def _save(att: Attempt, folder: Path) -> Attempt:
    (folder / "attempt.json").write_text(json.dumps(att.to_dict(), indent=1, default=str))
    return att


def now() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
