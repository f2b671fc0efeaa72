"""The subprocess side of the harness: ``python -m hetforge.kforge.worker reference|candidate SPEC.json``.

``reference`` builds the problem's ``Model``, makes fresh inputs per trial, computes the reference outputs
and times eager PyTorch (and ``torch.compile``). ``candidate`` imports a candidate file, builds
``ModelNew`` with the reference's parameters, runs it on the saved inputs (recording which ATen ops its
forward dispatches, whether it mutates inputs, and a second run with uninitialised memory filled with
NaN), saves its outputs for the parent to compare, times it and profiles it. The two never share a
process: a candidate cannot see or patch the reference or the comparison.

Everything it learns goes into ``result.json`` in the attempt folder, phase by phase, so a crash or a
timeout still leaves what happened before it.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

# Saved before any candidate code runs; timing uses these, and tampering with the module attributes is detected.
_PERF_NS = time.perf_counter_ns
_CLOCK_NS = time.clock_gettime_ns
_TIMERS = {"time.perf_counter": time.perf_counter, "time.perf_counter_ns": time.perf_counter_ns,
           "time.time": time.time, "time.monotonic": time.monotonic, "time.process_time": time.process_time}


def _block_network() -> None:
    """Refuse sockets other than local unix ones (the parent also runs us in a fresh network namespace when it can)."""
    real = socket.socket

    class _NoNet(real):  # type: ignore[misc, valid-type]
        def __init__(self, family=-1, *a, **k):
            if family not in (-1, socket.AF_UNIX):
                raise PermissionError("kforge harness: network access is not allowed")
            super().__init__(family, *a, **k)

        def connect(self, *a, **k):
            if self.family != socket.AF_UNIX:
                raise PermissionError("kforge harness: network access is not allowed")
            return super().connect(*a, **k)

    socket.socket = _NoNet  # type: ignore[misc]
    socket.create_connection = lambda *a, **k: (_ for _ in ()).throw(  # type: ignore[assignment]
        PermissionError("kforge harness: network access is not allowed"))


class Result:
    """result.json, rewritten after every phase."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict = {"phases": {}}

    def set(self, **kw) -> None:
        self.data.update(kw)
        self.flush()

    def phase(self, name: str, ok: bool, **kw) -> None:
        self.data["phases"][name] = {"ok": ok, **kw}
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def _as_list(out) -> list:
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return list(out)
    return [out]


def _flusher(nbytes: int, device: str = "cpu"):
    import torch

    buf = torch.empty(max(nbytes // 4, 1), dtype=torch.float32, device=device) if nbytes > 0 else None

    def flush() -> None:
        if buf is not None:
            buf.add_(1.0)  # writes every line: evicts the inputs and outputs from the caches

    return flush


def time_fn(fn, args, warmup: int, reps: int, flush_bytes: int, budget_s: float, device: str = "cpu"
            ) -> list[float]:
    """Times of ``fn(*args)`` in seconds: warm-ups, then up to ``reps`` trials (cache flushed between) within budget.

    On a GPU the flush buffer lives on the GPU (it evicts the GPU's L2) and the device is synchronized around
    each trial, so a trial's time is the device's work, not the launch queue's."""
    import torch

    flush = _flusher(flush_bytes, device)
    for _ in range(warmup):
        fn(*args)
    times: list[float] = []
    t_end = _PERF_NS() + int(budget_s * 1e9)
    cuda = torch.cuda.is_available()
    for _ in range(reps):
        flush()
        if cuda:
            torch.cuda.synchronize()
        t0 = _PERF_NS()
        fn(*args)
        if cuda:
            torch.cuda.synchronize()  # device-wide: work a candidate hides on a side stream is still waited for
        times.append((_PERF_NS() - t0) / 1e9)
        if _PERF_NS() > t_end and len(times) >= 3:
            break
    return times


def _summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "n": len(times)}


def reference(spec: dict) -> None:
    import torch

    from hetforge.kforge.problems import load_module

    out = Path(spec["out_dir"])
    res = Result(out / "reference.json")
    torch.set_num_threads(spec["threads"])
    device = spec.get("device", "cpu")
    mod = load_module(Path(spec["problem"]), "kforge_reference")
    init = list(mod.get_init_inputs())
    torch.manual_seed(spec["seed"])
    model = mod.Model(*init).eval().to(device)
    inputs, outputs = [], []
    with torch.no_grad():
        for t in range(spec["trials"]):
            torch.manual_seed(spec["seed"] + 1000 + t)  # fresh inputs per trial, drawn on the CPU (saved there)
            xs = list(mod.get_inputs())
            inputs.append(xs)
            outputs.append([o.detach().cpu().clone() if isinstance(o, torch.Tensor) else o
                            for o in _as_list(model(*_to(xs, device)))])
    from torch.utils.flop_counter import FlopCounterMode

    dev_inputs = _to(inputs[0], device)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(*dev_inputs)
    nbytes = sum(x.nbytes for x in inputs[0] if isinstance(x, torch.Tensor))
    nbytes += sum(o.nbytes for o in outputs[0] if isinstance(o, torch.Tensor))
    nbytes += sum(p.nbytes for p in model.state_dict().values())
    elem = max((o.numel() for o in outputs[0] if isinstance(o, torch.Tensor)), default=0)
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    torch.save({"init": init, "state": state, "inputs": inputs, "outputs": outputs}, out / "refs.pt")
    res.set(flops=float(fc.get_total_flops()), elementwise=float(elem), bytes=float(nbytes),
            out_meta=[[list(o.shape), str(o.dtype)] for o in outputs[0] if isinstance(o, torch.Tensor)])
    res.phase("reference", True)
    if device != "cpu":
        res.set(**device_roofline(device))
    tk = dict(warmup=spec["warmup"], reps=spec["reps"], flush_bytes=spec["flush_bytes"], budget_s=spec["budget_s"],
              device=device)
    with torch.no_grad():
        res.set(eager=_summary(time_fn(model, dev_inputs, **tk)))
        if spec.get("compile"):
            try:
                cm = torch.compile(model)
                t0 = _PERF_NS()
                cm(*dev_inputs)
                build = (_PERF_NS() - t0) / 1e9
                res.set(compile=_summary(time_fn(cm, dev_inputs, **tk)), compile_build_s=build)
            except Exception as e:  # torch.compile failing is a fact about the baseline, not an error of ours
                res.set(compile_error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    res.phase("baseline", True)


def _to(xs: list, device: str) -> list:
    """The tensors of ``xs`` on ``device`` (other values as they are)."""
    import torch

    return [x.to(device) if isinstance(x, torch.Tensor) else x for x in xs]


def device_roofline(device: str) -> dict:
    """The GPU's own roofline, measured here: fp32 GEMM rate (4096³, TF32 off: candidates must stay fp32) and
    device-to-device copy bandwidth (bytes read + written), each the median of 10 event-timed runs."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    n = 4096
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    src = torch.randn(2**28, device=device)  # 1 GiB
    dst = torch.empty_like(src)

    def median_ms(fn) -> float:
        for _ in range(3):
            fn()
        ts = []
        for _ in range(10):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        return statistics.median(ts)

    gemm_ms = median_ms(lambda: torch.mm(a, b))
    copy_ms = median_ms(lambda: dst.copy_(src))
    return {"device_name": torch.cuda.get_device_name(), "device_peak_flops": 2 * n**3 / (gemm_ms / 1e3),
            "device_bandwidth": 2 * src.nbytes / (copy_ms / 1e3), "device_roofline": "measured"}


def _op_recorder():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: dict[str, int] = {}
            self.casts: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch

            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
            dt = kwargs.get("dtype")
            if dt in (torch.float16, torch.bfloat16) or (name == "to" and any(
                    a in (torch.float16, torch.bfloat16) for a in args)):
                self.casts.append(f"{name} to {dt}")
            return func(*args, **kwargs)

    return Recorder()


def _tampered() -> list[str]:
    import torch

    bad = [k for k, f in _TIMERS.items() if getattr(time, k.split(".")[1]) is not f]
    if torch.cuda.synchronize is not _CUDA_SYNC:
        bad.append("torch.cuda.synchronize")
    if torch.cuda.Event is not _CUDA_EVENT:
        bad.append("torch.cuda.Event")
    return bad


def candidate(spec: dict) -> None:
    import torch

    global _CUDA_SYNC, _CUDA_EVENT
    _CUDA_SYNC, _CUDA_EVENT = torch.cuda.synchronize, torch.cuda.Event
    save, load, allclose = torch.save, torch.load, torch.equal
    from hetforge.kforge.problems import load_module

    out = Path(spec["out_dir"])
    res = Result(out / "result.json")
    torch.set_num_threads(spec["threads"])
    device = spec.get("device", "cpu")
    refs = load(spec["refs"], weights_only=False)
    _block_network()
    t0 = _PERF_NS()
    try:
        mod = load_module(Path(spec["candidate"]), "kforge_candidate")
        if not hasattr(mod, "ModelNew"):
            res.phase("build", False, error="the candidate defines no ModelNew")
            return
        torch.manual_seed(spec["seed"])
        model = mod.ModelNew(*refs["init"])
        if isinstance(model, torch.nn.Module):
            mine = model.state_dict()
            theirs = {k: v for k, v in refs["state"].items() if k in mine and mine[k].shape == v.shape}
            model.load_state_dict(theirs, strict=False)  # same parameters as the reference, by name
            model.eval().to(device)
    except Exception as e:
        res.phase("build", False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        return
    res.phase("build", True, seconds=(_PERF_NS() - t0) / 1e9)

    outs, ops, casts, mutated = [], {}, [], []
    try:
        with torch.no_grad():
            for t, xs in enumerate(refs["inputs"]):
                xs = _to(xs, device)
                before = [x.clone() if isinstance(x, torch.Tensor) else x for x in xs]
                rec = _op_recorder()
                with rec:
                    o = _as_list(model(*xs))
                for k, v in rec.ops.items():
                    ops[k] = ops.get(k, 0) + v
                casts += rec.casts
                for i, (a, b) in enumerate(zip(before, xs, strict=True)):
                    if isinstance(a, torch.Tensor) and not allclose(a, b):
                        mutated.append(f"trial {t} input {i}")
                outs.append([x.detach().cpu().clone() if isinstance(x, torch.Tensor) else x for x in o])
            # Double run with uninitialised memory filled with NaN: an output that reads memory it never wrote changes.
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.utils.deterministic.fill_uninitialized_memory = True
            again = [x.detach().cpu().clone() if isinstance(x, torch.Tensor) else x
                     for x in _as_list(model(*_to(refs["inputs"][0], device)))]
            torch.use_deterministic_algorithms(False)
    except Exception as e:
        res.phase("run", False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        return
    save({"outputs": outs, "again": again}, out / "outputs.pt")
    res.phase("run", True, ops=ops, casts=casts, mutated=mutated)

    if spec.get("time", True):
        xs = _to(refs["inputs"][0], device)
        t_wall = _CLOCK_NS(time.CLOCK_MONOTONIC)
        with torch.no_grad():
            times = time_fn(model, xs, spec["warmup"], spec["reps"], spec["flush_bytes"], spec["budget_s"], device)
        wall = (_CLOCK_NS(time.CLOCK_MONOTONIC) - t_wall) / 1e9
        res.phase("time", True, **_summary(times), times=times, wall_s=wall)
        if spec.get("profile", True):
            res.phase("profile", True, **profile(model, xs, device))
    res.set(tampered=_tampered())


def profile(model, xs, device: str = "cpu") -> dict:
    """torch.profiler summary of three calls: top ops by self CPU time, allocations, time outside ATen ops;
    on a GPU also the kernels' device time."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.no_grad(), tprofile(activities=acts, profile_memory=True) as prof:
        t0 = _PERF_NS()
        for _ in range(3):
            model(*xs)
        if device == "cuda":
            _CUDA_SYNC()
        total_us = (_PERF_NS() - t0) / 1e3 / 3
    ka = prof.key_averages()
    rows = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)
    top = [{"op": e.key, "calls": e.count // 3, "self_us": e.self_cpu_time_total / 3,
            "alloc_bytes": max(e.self_cpu_memory_usage, 0) / 3} for e in rows[:8]]
    aten_us = sum(e.self_cpu_time_total for e in ka if e.key.startswith("aten::")) / 3
    allocs = sum(1 for e in prof.events() if e.name == "[memory]" and getattr(e, "cpu_memory_usage", 0) > 0) / 3
    alloc_bytes = sum(max(e.self_cpu_memory_usage, 0) for e in ka) / 3
    out = {"total_us": total_us, "aten_us": aten_us, "top": top, "allocations": allocs, "alloc_bytes": alloc_bytes}
    if device == "cuda":
        out["device_us"] = sum(getattr(e, "self_device_time_total", 0.0) for e in ka) / 3
    return out


_CUDA_SYNC = None
_CUDA_EVENT = None


def main() -> None:
    mode, spec_path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_path).read_text())
    {"reference": reference, "candidate": candidate}[mode](spec)


if __name__ == "__main__":
    main()
