"""Plan a named model over a cluster: a zoo model's decode program, or a shape-only model (Llama-3.1-8B shape).

The graph costed per token is the decode program (one new token against a KV cache; its cache inputs stay
on their node). A shape-only model (:mod:`hetforge.models.shapes`) is captured on the meta device as a
one-token forward without a cache; its KV cache bytes per layer are added from its config for ``context``
positions. Both count the KV cache of the whole context toward each node's memory.
"""

from __future__ import annotations

import torch

from hetforge.cluster.placement import ClusterPlan, plan_cluster
from hetforge.cluster.spec import Cluster


def decode_graph(loaded, length: int):
    """The captured decode program of ``loaded`` over a cache of ``length`` positions, and its cache inputs."""
    from hetforge.frontend import capture
    from hetforge.runtime.static_kv import DecodeModule, model_dims

    L, kv, hd = model_dims(loaded.model)
    dtype = loaded.model.get_input_embeddings().weight.dtype
    cache = [torch.zeros((1, kv, length, hd), dtype=dtype) for _ in range(2 * L)]
    inputs = (torch.zeros((1, 1), dtype=torch.long), torch.zeros((1, 1), dtype=torch.long), *cache)
    cg = capture(DecodeModule(loaded.model), inputs, name=f"decode-{length}")
    resident = {n.name for n in cg.gm.graph.nodes if n.op == "placeholder"} - {"input_ids", "pos"}
    return cg.gm, resident


def kv_bytes_per_layer(kv_heads: int, head_dim: int, context: int, dtype: torch.dtype) -> int:
    return 2 * kv_heads * head_dim * context * (torch.finfo(dtype).bits // 8)


def plan_model(name: str, cluster: Cluster, objective: str = "latency", context: int | None = None,
               spread: bool = False, latency_mode: str = "total") -> ClusterPlan:
    """Plan ``name`` (a zoo/local model or a shape-only model) over ``cluster`` for ``context`` positions
    (default: the model's maximum for runnable models, 4096 for shape-only ones)."""
    from hetforge.errors import UsageError
    from hetforge.frontend import capture_shaped
    from hetforge.models.shapes import SHAPED, is_shaped

    if context is not None and context < 1:
        raise UsageError(f"--context must be >= 1 (got {context})")
    if is_shaped(name):
        cfg = SHAPED[name]
        ctx = context or 4096
        cg = capture_shaped(name, seq=1)
        heads = cfg["num_attention_heads"]
        kv = cfg.get("num_key_value_heads", heads)
        hd = cfg.get("head_dim", cfg["hidden_size"] // heads)
        return plan_cluster(cg.gm, cluster, objective, kv_bytes_per_layer(kv, hd, ctx, torch.float16), set(),
                            latency_mode, force_spread=spread)
    from hetforge.models.zoo import load_model
    from hetforge.runtime.programs import tiers_for

    loaded = load_model(name)
    return plan_loaded(loaded, cluster, objective, context, spread, latency_mode, tiers_for(loaded.max_positions)[0])


def plan_loaded(loaded, cluster: Cluster, objective: str = "latency", context: int | None = None,
                spread: bool = False, latency_mode: str = "total", length: int = 32) -> ClusterPlan:
    from hetforge.runtime.static_kv import model_dims

    _, kv, hd = model_dims(loaded.model)
    dtype = loaded.model.get_input_embeddings().weight.dtype
    gm, resident = decode_graph(loaded, length)
    ctx = min(context or loaded.max_positions, loaded.max_positions)
    return plan_cluster(gm, cluster, objective, kv_bytes_per_layer(kv, hd, ctx, dtype), resident, latency_mode,
                        force_spread=spread)
