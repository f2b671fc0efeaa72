"""OpenVINO's stateful KV-cache model as a decode peer, built without optimum-intel.

optimum-intel (the usual way to get a stateful OpenVINO LLM) requires transformers < 5.6 and this project pins
a newer one, so this module does what its exporter does, with OpenVINO's own API:

1. a wrapper module takes ``input_ids``, ``attention_mask``, ``position_ids`` and the past keys and values of
   every layer as explicit tensors (``past_0``, ``past_1``, … = layer 0 keys, layer 0 values, …), runs the HF
   model on a ``DynamicCache`` holding them, and returns the logits and the new keys and values;
2. ``torch.export`` (dynamic sequence and cache lengths) and ``openvino.convert_model`` turn it into an
   ``ov.Model`` whose outputs are named ``logits`` and ``present_<i>``;
3. ``openvino._offline_transformations.apply_make_stateful_transformation`` maps each ``past_<i>`` input to
   its ``present_<i>`` output, so the cache becomes a variable (ReadValue/Assign) that lives inside the
   compiled model between ``infer`` calls; each variable starts as an empty ``[1, heads, 0, head_dim]`` tensor.

No ``beam_idx`` input (optimum adds one to reorder the cache for beam search; greedy decoding never reorders).
Decode: ``reset_state``, one ``infer`` over the prompt (time to first token = that plus the greedy pick), then
one ``infer`` per new token with the cache inside the model; mean time per new token (measured). The forward used
for prefill timing and fidelity is the same compiled model from an empty cache.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from hetforge.benchmarks.base import DecodeTiming, Prepared, PrepContext


class KVWrapper(nn.Module):
    """An HF causal LM with its KV cache as explicit inputs and outputs (layer i: ``past[2i]``, ``past[2i+1]``)."""

    def __init__(self, model: nn.Module, layers: int) -> None:
        super().__init__()
        self.model, self.layers = model, layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i, layer in enumerate(cache.layers[: self.layers]):
            # set the layer directly: DynamicLayer.update would concatenate onto an empty 1-D tensor first,
            # which OpenVINO's converter rejects (rank mismatch)
            layer.dtype, layer.device = past[2 * i].dtype, past[2 * i].device
            layer.keys, layer.values, layer.is_initialized = past[2 * i], past[2 * i + 1], True
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        flat = []
        for layer in out.past_key_values.layers[: self.layers]:
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)


def _layers(model: nn.Module) -> int:
    return int(model.config.num_hidden_layers)


def stateful_ov_model(model: nn.Module, vocab_size: int, stages: dict[str, float] | None = None):
    """The HF causal LM ``model`` as a stateful ``ov.Model`` (cache inside); ``stages`` gets seconds per step."""
    import openvino as ov
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation
    from torch.export import Dim

    stages = {} if stages is None else stages
    n = _layers(model)
    wrapper = KVWrapper(model.eval(), n).eval()
    past_len, new_len = 3, 4  # example shapes only; every sequence and cache length is dynamic
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (1, new_len), generator=g)
    mask = torch.ones(1, past_len + new_len, dtype=torch.long)
    pos = torch.arange(past_len, past_len + new_len)[None]
    with torch.no_grad():  # check the cache layout with one eager call before exporting
        cfg = model.config
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        past = [torch.randn(1, heads, past_len, head_dim, generator=g) for _ in range(2 * n)]
        kv_shape = wrapper(ids, mask, pos, *past)[1].shape
        if tuple(kv_shape) != (1, heads, past_len + new_len, head_dim):
            raise RuntimeError(f"unexpected KV cache layout {tuple(kv_shape)} for this model")
    dyn = Dim.DYNAMIC
    shapes = {"input_ids": {1: dyn}, "attention_mask": {1: dyn}, "position_ids": {1: dyn},
              "past": tuple({2: dyn} for _ in range(2 * n))}
    t0 = time.perf_counter()
    with torch.no_grad():
        ep = torch.export.export(wrapper, (ids, mask, pos, *past), dynamic_shapes=shapes, strict=False)
    stages["torch.export"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ov_model = ov.convert_model(ep)
    stages["convert_model"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i, inp in enumerate(ov_model.inputs):  # past_<i> keep the names export gave them; check, don't assume
        want = ("input_ids", "attention_mask", "position_ids")[i] if i < 3 else f"past_{i - 3}"
        if want not in inp.get_names():
            raise RuntimeError(f"converted model input {i} is {inp.get_names()}, expected '{want}'")
    for i, out in enumerate(ov_model.outputs):
        out.get_tensor().set_names({"logits" if i == 0 else f"present_{i - 1}"})
    apply_make_stateful_transformation(ov_model, {f"past_{i}": f"present_{i}" for i in range(2 * n)})
    empty = opset13.constant(np.zeros((1, heads, 0, head_dim), np.float32))
    for op in ov_model.get_ops():
        if op.get_type_name() == "ReadValue":  # each cache variable starts empty
            op.set_arguments([empty])
    ov_model.validate_nodes_and_infer_types()
    stages["make_stateful"] = time.perf_counter() - t0
    return ov_model


class StatefulRunner:
    """A compiled stateful model and its one infer request: prompt, then one token at a time."""

    def __init__(self, compiled) -> None:
        self.req = compiled.create_infer_request()
        self.past = 0

    def reset(self) -> None:
        self.req.reset_state()
        self.past = 0

    def step(self, ids: np.ndarray) -> np.ndarray:
        """Feed ``ids`` ([1, s] int64) after the cached positions; the logits of those positions [1, s, vocab]."""
        s = ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, self.past + s), np.int64),
                 "position_ids": np.arange(self.past, self.past + s, dtype=np.int64)[None]}
        self.req.infer(feeds)
        self.past += s
        return self.req.get_tensor("logits").data

    def greedy(self, prompt: np.ndarray, n: int) -> tuple[list[int], list[float]]:
        """``n`` greedy tokens after ``prompt``; also the time stamp (perf_counter) of each pick."""
        self.reset()
        toks, stamps = [], []
        ids = prompt
        for _ in range(n):
            tok = int(np.argmax(self.step(ids)[0, -1]))
            stamps.append(time.perf_counter())
            toks.append(tok)
            ids = np.array([[tok]], np.int64)
        return toks, stamps


def compile_stateful(ov_model, threads: int, force_f32: bool, cache_dir: str | None = None):
    """Compile for the CPU plugin; returns (compiled model, the inference precision it reports)."""
    import openvino as ov

    config: dict[str, object] = {"INFERENCE_NUM_THREADS": threads}
    if cache_dir:
        config["CACHE_DIR"] = cache_dir
    if force_f32:
        config["INFERENCE_PRECISION_HINT"] = "f32"
    compiled = ov.Core().compile_model(ov_model, "CPU", config)
    try:
        precision = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
    except Exception:  # older plugins do not expose it
        precision = "f32" if force_f32 else "plugin default"
    return compiled, precision.replace("<Type: '", "").replace("'>", "")


def prepare_ov_stateful(ctx: PrepContext, force_f32: bool) -> Prepared:
    """The peer row: export + convert + make stateful + compile (timed), forward and decode callables."""
    if ctx.loaded.kind != "causal-lm":
        raise RuntimeError(f"OpenVINO stateful decoding needs a causal LM; '{ctx.loaded.name}' is "
                           f"{ctx.loaded.kind}")
    stages: dict[str, float] = {}
    ov_model = stateful_ov_model(ctx.loaded.model, ctx.loaded.vocab_size, stages)
    t0 = time.perf_counter()
    compiled, precision = compile_stateful(ov_model, ctx.threads, force_f32, str(ctx.cache_dir))
    stages["compile_model"] = time.perf_counter() - t0
    runner = StatefulRunner(compiled)

    def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        runner.reset()
        return torch.from_numpy(np.array(runner.step(ids.numpy().astype(np.int64))))

    def decode(inputs: tuple[torch.Tensor, torch.Tensor], n: int, tries: int = 2) -> DecodeTiming:
        prompt = inputs[0].numpy().astype(np.int64)
        best = None
        for _ in range(tries):  # the first warms the plugin's buffers for growing cache lengths; keep the better
            t0 = time.perf_counter()
            _, stamps = runner.greedy(prompt, n + 1)
            gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
            cur = DecodeTiming((stamps[0] - t0) * 1e3, sum(gaps) / len(gaps) * 1e3, len(gaps))
            if best is None or cur.decode_ms_per_token < best.decode_ms_per_token:
                best = cur
        return best

    notes = [f"stateful model (KV cache as OpenVINO variables, made by apply_make_stateful_transformation; "
             f"no optimum-intel), inference precision {precision}"]
    return Prepared(forward=forward, stages=stages, decode=decode, notes=notes, precision=precision)
