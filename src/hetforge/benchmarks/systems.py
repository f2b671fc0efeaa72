"""The systems the peer benchmark compares: how each one turns an ``nn.Module`` into something runnable.

Every system is a :class:`System` with a ``prepare`` function. ``prepare`` gets a :class:`PrepContext`
(the model, example inputs for prefill and for one token, a scratch folder and a cache folder) and
returns a :class:`Prepared`: a forward callable ``(input_ids, attention_mask) -> logits`` (a torch
tensor), the seconds each preparation stage took (measured, cold unless the cache folder was already
filled by an earlier run) and, where the system has a KV-cache generation path, a ``decode`` callable.

The peers are run the way their documentation tells a user to: no hand tuning beyond the thread count
(2) and, for OpenVINO f32, the precision hint. Optional peers (ONNX Runtime, OpenVINO) are imported
lazily; a missing one is reported by :func:`missing_requirement`, never raised at import time.
"""

from __future__ import annotations

import importlib.util
import time

import torch
from torch import nn

from hetforge.benchmarks.base import DecodeTiming, Forward, Prepared, PrepContext, System  # noqa: F401


class _Timer:
    """Collects named stage durations: ``with t("export"): ...``."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}

    def __call__(self, name: str) -> _Timer:
        self._name = name
        return self

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.stages[self._name] = self.stages.get(self._name, 0.0) + time.perf_counter() - self._t0


def _seq_dims(ctx: PrepContext):
    from torch.export import Dim

    seq = Dim("seq", min=1, max=ctx.loaded.max_positions)
    return ({1: seq}, {1: seq})


# ---------------------------------------------------------------- HF eager


def hf_decode(model: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor], new_tokens: int, reps: int = 1,
              ) -> DecodeTiming:
    """HF ``generate`` (greedy, KV cache), timed per step by a logits processor that stamps each token.

    ttft = start → first stamp (prefill forward); decode = mean gap between later stamps (one cached
    forward + greedy pick each). The best of ``reps`` requests (by decode time) is kept.
    """
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.t: list[float] = []

        def __call__(self, input_ids, scores):
            self.t.append(time.perf_counter())
            return scores

    ids, mask = inputs
    n = new_tokens + 1
    kw = dict(do_sample=False, attention_mask=mask, pad_token_id=0, eos_token_id=None, use_cache=True,
              max_new_tokens=n, min_new_tokens=n)
    best: DecodeTiming | None = None
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        for _ in range(reps):
            stamp = Stamp()
            t0 = time.perf_counter()
            model.generate(ids, logits_processor=LogitsProcessorList([stamp]), **kw)
            gaps = [b - a for a, b in zip(stamp.t, stamp.t[1:], strict=False)]
            if not gaps:
                continue
            cur = DecodeTiming((stamp.t[0] - t0) * 1e3, sum(gaps) / len(gaps) * 1e3, len(gaps))
            if best is None or cur.decode_ms_per_token < best.decode_ms_per_token:
                best = cur
    if best is None:
        raise RuntimeError("generate produced fewer than two tokens; no decode time to report")
    return best


def _prepare_eager(ctx: PrepContext) -> Prepared:
    """HF as a user gets it. MoE models go back to transformers' default experts path (the zoo picks
    ``batched_mm`` so that export can see the expert matmuls; a user of eager would not)."""
    module = ctx.module.eval()
    hf = ctx.loaded.model
    notes: list[str] = []
    current = getattr(hf.config, "_experts_implementation", None)
    if current not in (None, "eager") and hasattr(hf, "set_experts_implementation"):
        try:
            hf.set_experts_implementation(None)  # None = transformers' own choice for this device/dtype
            notes.append(f"experts: transformers default ('{hf.config._experts_implementation}'), "
                         f"not the zoo's '{current}'")
        except Exception as e:  # keep the zoo's path, and say so
            notes.append(f"experts: kept '{current}' (default could not be set: {str(e).splitlines()[0][:120]})")

    def decode(inputs, n, tries: int = 1):
        return hf_decode(hf, inputs, n, reps=tries)

    return Prepared(forward=module, stages={}, notes=notes,
                    decode=decode if ctx.loaded.kind == "causal-lm" else None)


# ---------------------------------------------------------------- torch.export


def _prepare_export(ctx: PrepContext) -> Prepared:
    t = _Timer()
    with t("export"), torch.no_grad():
        ep = torch.export.export(ctx.module.eval(), ctx.prefill_inputs, dynamic_shapes=_seq_dims(ctx))
    with t("unlift"):
        gm = ep.module()
    return Prepared(forward=gm, stages=t.stages, notes=["non-strict export, dynamic sequence length"])


# ---------------------------------------------------------------- torch.compile


def _prepare_compile(ctx: PrepContext) -> Prepared:
    """``torch.compile`` (inductor, default mode): compilation happens on the first call of each shape."""
    t = _Timer()
    with t("dynamo+inductor@prefill"), torch.no_grad():
        compiled = torch.compile(ctx.module.eval())
        compiled(*ctx.prefill_inputs)
    with t("recompile@one-token"), torch.no_grad():
        compiled(*ctx.step_inputs)
    return Prepared(forward=compiled, stages=t.stages,
                    notes=["stages include the first (compiling) call of each shape"])


# ---------------------------------------------------------------- ONNX Runtime


def _prepare_ort(ctx: PrepContext) -> Prepared:
    import onnxruntime as ort

    path = ctx.workdir / "model.onnx"
    t = _Timer()
    with t("torch.onnx.export"), torch.no_grad():
        torch.onnx.export(
            ctx.module.eval(), ctx.prefill_inputs, str(path), dynamo=True,
            input_names=["input_ids", "attention_mask"], output_names=["logits"],
            dynamic_shapes=_seq_dims(ctx), verbose=False,
        )
    with t("InferenceSession"):
        so = ort.SessionOptions()
        so.intra_op_num_threads = ctx.threads
        so.inter_op_num_threads = 1
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]

    def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        feeds = dict(zip(names, (ids.numpy(), mask.numpy()), strict=True))
        return torch.from_numpy(sess.run(None, feeds)[0])

    return Prepared(forward=forward, stages=t.stages, notes=["dynamo exporter, CPU EP"])


# ---------------------------------------------------------------- OpenVINO


def _prepare_openvino(ctx: PrepContext, force_f32: bool) -> Prepared:
    import numpy as np
    import openvino as ov

    t = _Timer()
    with t("convert_model"), torch.no_grad():
        ov_model = ov.convert_model(ctx.module.eval(), example_input=ctx.prefill_inputs)
    config: dict[str, object] = {"INFERENCE_NUM_THREADS": ctx.threads, "CACHE_DIR": str(ctx.cache_dir)}
    if force_f32:
        config["INFERENCE_PRECISION_HINT"] = "f32"
    with t("compile_model"):
        core = ov.Core()
        compiled = core.compile_model(ov_model, "CPU", config)
    try:
        precision = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
    except Exception:  # older plugins do not expose it
        precision = "f32" if force_f32 else "plugin default"
    precision = precision.replace("<Type: '", "").replace("'>", "")
    req = compiled.create_infer_request()

    def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        req.infer([ids.numpy(), mask.numpy()], share_inputs=True)
        return torch.from_numpy(np.array(req.get_output_tensor(0).data))

    notes = [f"inference precision {precision}"]
    return Prepared(forward=forward, stages=t.stages, notes=notes, precision=precision)


# ---------------------------------------------------------------- registry


def _prepare_hetforge(ctx: PrepContext, quantize: str = "none") -> Prepared:
    from hetforge.benchmarks.hetforge_system import prepare_hetforge

    return prepare_hetforge(ctx, quantize)


def _prepare_hetforge_bf16(ctx: PrepContext) -> Prepared:
    from hetforge.benchmarks.hetforge_system import prepare_hetforge_bf16

    return prepare_hetforge_bf16(ctx)


LLAMACPP_INSTALL = ("pip install -e .[llamacpp]; llama-cpp-python has no wheel on PyPI and builds llama.cpp from "
                    "source: CMake and a C++ compiler, many minutes on 2 cores")


def _prepare_llamacpp(ctx: PrepContext, qtype: str) -> Prepared:
    from hetforge.benchmarks.llamacpp_system import prepare_llamacpp

    return prepare_llamacpp(ctx, qtype)


def _prepare_ov_stateful(ctx: PrepContext, force_f32: bool) -> Prepared:
    from hetforge.benchmarks.ov_stateful_system import prepare_ov_stateful

    return prepare_ov_stateful(ctx, force_f32)


SYSTEMS: dict[str, System] = {
    s.key: s
    for s in [
        System("hetforge", "hetforge", _prepare_hetforge, is_hetforge=True),
        System("hetforge-bf16", "hetforge --precision bf16", _prepare_hetforge_bf16, is_hetforge=True),
        System("eager", "HF eager", _prepare_eager),
        System("export", "torch.export (module run)", _prepare_export),
        System("compile", "torch.compile (inductor)", _prepare_compile, has_cache=True),
        System("ort", "ONNX Runtime (CPU EP)", _prepare_ort, requires=("onnxruntime", "onnx", "onnxscript"),
               max_model_note="exporter: torch.onnx dynamo"),
        # OpenVINO's cache (CACHE_DIR) works the same for both precisions: measured once, on the f32 row
        System("ov-default", "OpenVINO (default precision)", lambda c: _prepare_openvino(c, False),
               requires=("openvino",)),
        System("ov-f32", "OpenVINO (f32 hint)", lambda c: _prepare_openvino(c, True),
               requires=("openvino",), has_cache=True),
        # decode peers with their own KV cache, on the same seeded weights written as GGUF
        System("llamacpp-f32", "llama.cpp (GGUF f32)", lambda c: _prepare_llamacpp(c, "f32"),
               requires=("llama_cpp", "gguf"), install=LLAMACPP_INSTALL),
        System("llamacpp-q8", "llama.cpp (GGUF Q8_0)", lambda c: _prepare_llamacpp(c, "q8_0"),
               requires=("llama_cpp", "gguf"), install=LLAMACPP_INSTALL),
        System("llamacpp-q4", "llama.cpp (GGUF Q4_0)", lambda c: _prepare_llamacpp(c, "q4_0"),
               requires=("llama_cpp", "gguf"), install=LLAMACPP_INSTALL),
        # OpenVINO's stateful KV-cache model (what optimum-intel exports), made with OpenVINO's own API
        System("ov-stateful-f32", "OpenVINO stateful KV cache (f32 hint)", lambda c: _prepare_ov_stateful(c, True),
               requires=("openvino",)),
        System("ov-stateful", "OpenVINO stateful KV cache (default precision)",
               lambda c: _prepare_ov_stateful(c, False), requires=("openvino",)),
        # hetforge with 8-bit weights (``hetforge run --quantize w8``), the counterpart of llama.cpp's Q8_0
        System("hetforge-w8", "hetforge --quantize w8", lambda c: _prepare_hetforge(c, "w8"), is_hetforge=True),
        # and with 4-bit weights (``--quantize w4``), the counterpart of llama.cpp's Q4_0
        System("hetforge-w4", "hetforge --quantize w4", lambda c: _prepare_hetforge(c, "w4"), is_hetforge=True),
    ]
}

DEFAULT_SYSTEMS = list(SYSTEMS)
PEER_KEYS_FOR_PREP_TARGET = ("compile", "ort", "ov-default", "ov-f32")


def missing_requirement(system: System) -> str | None:
    """The first module a system needs that is not installed, as a one-line message, or None."""
    for mod in system.requires:
        if importlib.util.find_spec(mod) is None:
            return f"not installed: no module named '{mod}' ({system.install})"
    return None
