"""``openvino:<plugin>``: OpenVINO compiles one partition and runs it (measured).

The partition's own GraphModule (not the whole model) is exported with ``torch.export`` and converted with
``ov.convert_model``; ``hetforge::`` fused ops, which OpenVINO does not know, are first decomposed back into
ATen through their registry reference implementations (``ExportedProgram.run_decompositions``), and the
report counts them. Precision is explicit: ``INFERENCE_PRECISION_HINT`` is ``f32`` unless asked otherwise
(OpenVINO's CPU plugin would otherwise pick bf16 on AMX hosts). Threads follow ``torch.get_num_threads()`` so
torch and OpenVINO partitions compete for the same cores on equal terms.

Inputs are handed over zero-copy (``share_inputs``); outputs alias the infer request's buffers
(``share_outputs``) until that partition runs again, so ``outputs_alias`` tells the runner to copy any value
that must outlive the call (the graph's final outputs).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from hetforge.backends.base import (
    PEERS_HINT,
    Backend,
    BackendUnavailable,
    CompiledPartition,
    CompileReport,
    example_args,
)
from hetforge.backends.partition import Partition
from hetforge.errors import HetforgeError

PRECISIONS = {"f32": "f32", "fp32": "f32", "f16": "f16", "fp16": "f16", "bf16": "bf16"}
PLUGIN_PREFERENCE = ("NPU", "GPU", "CPU")


@lru_cache(maxsize=1)
def _core():
    import openvino as ov

    return ov.Core()


def core_started() -> bool:
    """Whether this process has made its OpenVINO ``Core`` (and with it, once used, its task executor's threads)."""
    return _core.cache_info().currsize > 0


def openvino_version() -> str | None:
    try:
        import openvino as ov
    except ImportError:
        return None
    return ov.__version__


def available_plugins() -> list[str]:
    """``ov.Core().available_devices`` (e.g. ['CPU'] or ['CPU', 'GPU', 'NPU']); [] without OpenVINO."""
    if openvino_version() is None:
        return []
    return list(_core().available_devices)


def best_plugin(kind: str | None = None) -> str:
    """The plugin for a device kind: NPU/GPU when the host has it, else CPU."""
    plugins = available_plugins()
    wanted = {"npu": "NPU", "gpu": "GPU"}.get(kind or "", None)
    if wanted and any(p.startswith(wanted) for p in plugins):
        return next(p for p in plugins if p.startswith(wanted))
    for p in PLUGIN_PREFERENCE:
        if kind is None and any(x.startswith(p) for x in plugins):
            return next(x for x in plugins if x.startswith(p))
    return "CPU"


class OpenVinoCompiled(CompiledPartition):
    """One compiled OpenVINO model and its infer request."""

    outputs_alias = True

    def __init__(self, compiled, report: CompileReport, n_outputs: int, input_dtypes: list[torch.dtype]):
        self.backend = report.backend
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self.report = report
        self.n_outputs = n_outputs
        self.input_dtypes = input_dtypes

    def run(self, args: Sequence[Any]) -> tuple[list[Any], float]:
        t0 = time.perf_counter()
        arrays = [a.contiguous().numpy() for a in args]  # OpenVINO reads dense buffers
        res = self.request.infer(arrays, share_inputs=True, share_outputs=True)
        outs = [torch.from_numpy(np.asarray(res[i])) for i in range(self.n_outputs)]
        return outs, time.perf_counter() - t0


class OpenVinoBackend(Backend):
    """OpenVINO on one plugin (``CPU``, ``GPU``, ``NPU``) at an explicit inference precision."""

    memory = "host"

    def __init__(self, plugin: str = "CPU", precision: str = "f32", threads: int | None = None):
        if precision not in PRECISIONS:
            raise HetforgeError(f"unknown OpenVINO precision '{precision}'; allowed: {', '.join(PRECISIONS)}")
        self.plugin = plugin
        self.precision = PRECISIONS[precision]
        self.threads = threads
        self.name = f"openvino:{plugin}"

    def fork_refusal(self) -> str | None:
        """A child compiling on the ``Core`` this process made waits forever for its task executor's threads,
        which ``fork()`` does not copy (seen: a placed program's child blocked in ``compile_model``)."""
        if core_started():
            return "OpenVINO's runtime was started in this process and its worker threads do not survive fork()"
        return None

    def check_available(self) -> None:
        if openvino_version() is None:
            raise BackendUnavailable(f"backend '{self.name}' needs OpenVINO, which is not installed; install it with "
                                     f"`{PEERS_HINT}`")
        plugins = available_plugins()
        if not any(p == self.plugin or p.startswith(self.plugin + ".") for p in plugins):
            raise BackendUnavailable(f"backend '{self.name}': this host's OpenVINO has no '{self.plugin}' plugin "
                                     f"(available: {', '.join(plugins) or 'none'})")

    def compile(self, part: Partition) -> CompiledPartition:
        self.check_available()
        import openvino as ov

        t0 = time.perf_counter()
        args = example_args(part)
        bad = [n for n, a in zip(part.inputs, args, strict=True) if not isinstance(a, torch.Tensor)]
        if bad:
            raise HetforgeError(f"partition {part.name} reads non-tensor value(s) {bad}: OpenVINO takes tensors only; "
                                f"place their producers on the same device")
        try:
            ep = torch.export.export(part.gm, tuple(args), strict=False)
        except Exception as e:  # torch raises many types; all mean "this partition cannot be exported"
            raise HetforgeError(f"partition {part.name}: torch.export of the partition failed: "
                                f"{str(e).splitlines()[0][:300]}") from None
        ep, decomposed = decompose_custom_ops(ep)
        try:
            model = ov.convert_model(ep)
        except Exception as e:  # OpenVINO raises its own error types for unconvertible ops
            raise HetforgeError(f"partition {part.name}: OpenVINO could not convert it: "
                                f"{str(e).splitlines()[0][:300]}") from None
        config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": self.precision, "PERFORMANCE_HINT": "LATENCY"}
        threads = self.threads or torch.get_num_threads()
        if self.plugin == "CPU":
            config["INFERENCE_NUM_THREADS"] = threads
            # int8 weights stay weight-only: without this the CPU plugin quantizes activations of compressed-weight
            # MatMuls on the fly (dynamic quantization), which is not the computation the plan asked for
            config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
        compiled = _core().compile_model(model, self.plugin, config)
        notes = [f"INFERENCE_PRECISION_HINT={self.precision}"]
        if self.plugin == "CPU":
            notes.append(f"{threads} threads")
        if decomposed:
            notes.append("decomposed for OpenVINO: " + ", ".join(f"{k} x{v}" for k, v in sorted(decomposed.items())))
            notes += [OPENVINO_NUMERICS[k] for k in sorted(decomposed) if k in OPENVINO_NUMERICS]
        report = CompileReport(self.name, f"OpenVINO {openvino_version()} {self.plugin} plugin",
                               time.perf_counter() - t0, notes)
        return OpenVinoCompiled(compiled, report, len(part.outputs), [a.dtype for a in args])


def _attention_for_openvino(q, k, v, mask=None, scale=1.0, is_causal=False):
    """``hetforge::attention`` with grouped-query k/v expanded to q's heads first.

    The registry reference passes ``enable_gqa=True`` to SDPA; OpenVINO 2026.4's CPU plugin converts that call
    but fails at inference ("Incompatible MatMul batch dimension", measured), so k/v heads are repeated the way
    Hugging Face's ``repeat_kv`` does (query head h reads k/v head h // (Hq/Hkv)): the same result.
    """
    if q.dim() >= 3 and k.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0,
                                                            is_causal=is_causal, scale=scale)


# Decompositions that differ from the registry reference for OpenVINO's sake (op name → function); the
# quantization ops bring their own (``Convert(i8)·scale → linear``, which OpenVINO runs with int8 weights).
OPENVINO_DECOMPOSITIONS = {"hetforge.attention.default": _attention_for_openvino}
# Ops whose reference is a CPU kernel with no ATen equivalent OpenVINO could convert.
OPENVINO_UNSUPPORTED = {"hetforge.linear_w4.default": "its packed int4 tile layout has no ATen unpacking op"}
# Ops that run with different numerics once decomposed for OpenVINO (said in the compile notes).
OPENVINO_NUMERICS = {"hetforge.linear_w8a8.default": "w8a8 runs weight-only int8 (activations stay float)"}


def _decompositions() -> dict:
    from hetforge.ops.quant import OPENVINO_DECOMPOSITIONS as quant_decomps

    return {**quant_decomps, **dict(OPENVINO_DECOMPOSITIONS)}


def decompose_custom_ops(ep: torch.export.ExportedProgram) -> tuple[torch.export.ExportedProgram, dict[str, int]]:
    """Decompose every ``hetforge::`` op in ``ep`` into ATen via its registry reference implementation
    (or the OpenVINO-specific one in :data:`OPENVINO_DECOMPOSITIONS`)."""
    from hetforge.ops.registry import lookup

    table: dict[Any, Any] = {}
    counts: dict[str, int] = {}
    decomps = _decompositions()
    for n in ep.graph.nodes:
        t = n.target
        if n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.namespace != "aten":
            info = lookup(t)
            if info is None or info.reference is None or (info is not None and info.name in OPENVINO_UNSUPPORTED):
                why = OPENVINO_UNSUPPORTED.get(getattr(info, "name", ""), "it has no reference implementation")
                raise HetforgeError(f"node '{n.name}' ({t}) cannot run on OpenVINO: {why}; bind its device to a "
                                    f"torch backend (e.g. --backend DEVICE=emulated:torch-cpu)")
            table[t] = decomps.get(info.name, info.reference)
            counts[info.name] = counts.get(info.name, 0) + 1
    if not table:
        return ep, {}
    return ep.run_decompositions(table), counts
