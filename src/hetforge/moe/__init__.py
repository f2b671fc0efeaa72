"""NPUMoE on hetforge: expert calibration, static capacity tiers and their measured cost in drops, padding and
perplexity.

* :func:`calibrate` runs a model's optimized graph (its MoE blocks are ``hetforge::moe`` ops) over a text file
  and records, per layer, how many assignments each expert received and its summed router probability; the
  result is tied to the model by name and a hash of its config and weights (:func:`fingerprint`).
* :func:`choose_tiers` turns a calibration into a static plan per layer: experts stored by popularity, hottest
  first, in groups of ``G``; each group is one capacity tier sized to its hottest expert's expected load (hot
  groups large, cold small); the hot set is the smallest covering a target share of the routed tokens.
* :func:`apply_tiers` writes a plan into a graph's ``hetforge::moe`` nodes (capacity, order, group size, the
  weights stored in the plan's order); :func:`evaluate` measures unlimited vs tiered execution on the same
  data: perplexity, and per layer the drop rate and the padding waste.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from hetforge.errors import UsageError
from hetforge.files import read_json

FORMAT = "hetforge-moe-calibration/1"


def fingerprint(loaded) -> str:
    """A hash of the model's config (public fields) and every weight's name, shape, dtype and bytes."""
    h = hashlib.blake2b(digest_size=16)
    cfg = {k: v for k, v in loaded.config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, t in sorted(loaded.model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def read_tokens(loaded, data: str | Path, seq: int, max_chunks: int) -> list[torch.Tensor]:
    """The data file tokenized with the model's tokenizer, cut into ``[1, seq]`` windows (at most ``max_chunks``)."""
    from hetforge.tokenizers import for_model

    path = Path(data)
    if not path.is_file():
        raise UsageError(f"--data '{path}' is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"--data '{path}' is not UTF-8 text") from None
    if seq < 2 or seq > loaded.max_positions:
        raise UsageError(f"--seq {seq} is outside 2..{loaded.max_positions}")
    ids = for_model(loaded).encode(text)
    n = min(len(ids) // seq, max_chunks)
    if n < 1:
        raise UsageError(f"--data '{path}' has {len(ids)} tokens; at least --seq {seq} are needed")
    return [torch.tensor(ids[i * seq:(i + 1) * seq]).unsqueeze(0) for i in range(n)]


def moe_graph(loaded, seq: int) -> GraphModule:
    """The model's ``[1, seq]`` logits graph, captured and optimized (MoE blocks as ``hetforge::moe``)."""
    from hetforge.frontend import capture
    from hetforge.passes import optimize

    ids = torch.zeros((1, seq), dtype=torch.long)
    inputs = (ids, torch.ones_like(ids))
    res = optimize(capture(loaded.logits_module(), inputs, name=f"{loaded.name}-moe").gm, inputs)
    if not res.fused.get("moe"):
        misses = [m.reason for p in res.passes if p.name == "moe" for m in p.near_misses]
        why = f" (near-misses: {'; '.join(misses)})" if misses else ""
        raise UsageError(f"model '{loaded.name}' has no MoE block hetforge recognises{why}")
    return res.gm


def calibrate(loaded, data: str | Path, seq: int = 128, max_chunks: int = 16) -> dict[str, Any]:
    """Per-layer expert popularity (assignments and router-probability mass) of ``loaded`` on ``data``."""
    from hetforge.ops.moe import recording

    chunks = read_tokens(loaded, data, seq, max_chunks)
    gm = moe_graph(loaded, seq)
    t0 = time.perf_counter()
    with recording() as rec, torch.no_grad():
        for c in chunks:
            gm(c, torch.ones_like(c))
    seconds = time.perf_counter() - t0
    layers = []
    for layer, d in sorted(rec.per_layer().items()):
        total = sum(d["routed"]) or 1
        layers.append({"layer": layer, "experts": len(d["routed"]), "top_k": d["assignments"] // max(d["tokens"], 1),
                       "tokens": d["tokens"], "routed": d["routed"], "mass": d["mass"],
                       "share": [r / total for r in d["routed"]]})
    return {"format": FORMAT, "model": loaded.name, "fingerprint": fingerprint(loaded), "weights": loaded.weights,
            "data": str(data), "seq": seq, "chunks": len(chunks), "tokens": len(chunks) * seq,
            "run_seconds_measured": seconds, "layers": layers}


def load_calibration(path: str | Path, loaded) -> dict[str, Any]:
    """Read a calibration file and check that it belongs to ``loaded`` (else a UsageError naming both models)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"calibration file '{p}' does not exist")
    cal = read_json(p, lambda e: UsageError(f"calibration file '{p}' is not valid JSON: {e}"))
    if not isinstance(cal, dict) or cal.get("format") != FORMAT or not isinstance(cal.get("layers"), list):
        raise UsageError(f"'{p}' is not a hetforge MoE calibration file (format {FORMAT})")
    fp = fingerprint(loaded)
    if cal.get("fingerprint") != fp or cal.get("model") != loaded.name:
        raise UsageError(f"calibration file '{p}' was recorded for model '{cal.get('model')}' "
                         f"(hash {str(cal.get('fingerprint'))[:12]}), not for '{loaded.name}' (hash {fp[:12]})")
    return cal


def check_plan_options(group_size: int, capacity_factor: float, capacity: tuple[int, int] | None,
                       share: float) -> None:
    """Reject impossible tier settings before any work (exit 2)."""
    if group_size < 0:
        raise UsageError(f"--group-size {group_size} must be ≥ 1 (or 0: all experts of a tier in one group)")
    if not capacity_factor > 0:
        raise UsageError(f"--capacity-factor {capacity_factor} must be > 0 (a capacity of 0 drops every token)")
    if capacity is not None and min(capacity) < 1:
        raise UsageError(f"--capacity {capacity[0]},{capacity[1]}: a capacity of 0 drops every token routed to "
                         "the tier; use ≥ 1")
    if not 0 < share <= 1:
        raise UsageError(f"--share {share} must be in (0, 1]")


def choose_tiers(cal: dict[str, Any], tokens: int, share: float = 0.9, group_size: int = 0,
                 capacity_factor: float = 1.0, capacity: tuple[int, int] | None = None) -> dict[str, Any]:
    """A static capacity plan per layer for calls of ``tokens`` tokens.

    Experts are stored by calibrated popularity, hottest first, and cut into groups of ``group_size``
    (0 = one group for the hot tier, the same size for the rest). Hot tier: the most popular experts covering
    ``share`` of the calibration's assignments, rounded up to whole groups. Every group is one static tier:
    capacity ``ceil(capacity_factor · T·k · share of its hottest expert)`` (≥ 1) for each of its experts, so
    popular groups get many slots and cold groups few. ``capacity=(hot, cold)`` gives the hot and the cold
    groups fixed capacities instead."""
    check_plan_options(group_size, capacity_factor, capacity, share)
    layers = {}
    for lay in cal["layers"]:
        e, k, sh = int(lay["experts"]), int(lay["top_k"]), [float(s) for s in lay["share"]]
        if group_size and e % group_size:
            raise UsageError(f"--group-size {group_size} does not divide the {e} experts of layer {lay['layer']}")
        order = sorted(range(e), key=lambda i: (-sh[i], i))
        cum, n_hot = 0.0, 0
        while n_hot < e and cum < share - 1e-12:
            cum += sh[order[n_hot]]
            n_hot += 1
        g = group_size or None
        if g:
            n_hot = min(e, math.ceil(n_hot / g) * g)
        work = tokens * k
        # group size 0: one group per tier (tiers of different size cannot share one G, so G = the hot tier)
        gs = g or (n_hot if n_hot and e % n_hot == 0 else e)
        caps: list[int] = []
        for g0 in range(0, e, gs):  # each group of popularity neighbours is one static capacity tier
            hot = g0 < n_hot
            if capacity:
                c = capacity[0] if hot else capacity[1]
            else:
                c = max(1, math.ceil(capacity_factor * work * sh[order[g0]]))  # the group's hottest expert
            caps += [c] * len(order[g0:g0 + gs])
        hot_cap = caps[0]
        cold_cap = caps[n_hot] if n_hot < e else 0
        layers[int(lay["layer"])] = {"order": order, "capacity": caps, "group_size": gs,
                                     "group_capacity": caps[::gs], "hot": order[:n_hot], "hot_share": cum,
                                     "hot_capacity": hot_cap, "cold_capacity": cold_cap}
    return {"model": cal["model"], "tokens_per_call": tokens, "share": share, "capacity_factor": capacity_factor,
            "layers": layers}


def apply_tiers(gm: GraphModule, plan: dict[str, Any]) -> GraphModule:
    """Write ``plan`` into the ``hetforge::moe`` nodes of ``gm`` (in place): capacity, group size and the experts
    stored in the plan's order (a permuted copy of the stacked weights, registered as buffers of ``gm``)."""
    from hetforge.passes.common import const_tensor

    op = torch.ops.hetforge.moe.default
    for n in list(gm.graph.nodes):
        if n.target is not op:
            continue
        args = list(n.args) + [None] * (16 - len(n.args))
        layer = int(args[15]) if args[15] is not None else -1
        p = plan["layers"].get(layer)
        if p is None:
            continue
        order = list(p["order"])
        if order != sorted(order):
            for i, name in ((2, "wgu"), (3, "wd")):
                w = const_tensor(gm, args[i])
                attr = f"_moe_{name}_{layer}"
                gm.register_buffer(attr, w[order].contiguous(), persistent=False)
                with gm.graph.inserting_before(n):
                    args[i] = gm.graph.get_attr(attr)
                fm = _fake_mode(n)
                if fm is not None:
                    args[i].meta["val"] = fm.from_tensor(getattr(gm, attr), static_shapes=True)
        args[12], args[13], args[14] = int(p["group_size"]), list(p["capacity"]), order
        n.args = tuple(args)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _fake_mode(n):
    v = n.meta.get("val")
    return getattr(v, "fake_mode", None)


@dataclass
class Evaluation:
    """Unlimited vs tiered execution of one model on the same data (all measured on this host)."""

    tokens: int
    ppl_unlimited: float
    ppl_tiered: float
    seconds_unlimited: float
    seconds_tiered: float
    layers: list[dict[str, Any]]

    @property
    def ppl_change(self) -> float:
        return self.ppl_tiered / self.ppl_unlimited - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "ppl_unlimited": self.ppl_unlimited, "ppl_tiered": self.ppl_tiered,
                "ppl_change": self.ppl_change, "seconds_unlimited_measured": self.seconds_unlimited,
                "seconds_tiered_measured": self.seconds_tiered, "layers": self.layers}


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    lp = torch.log_softmax(logits[0, :-1].double(), -1)
    tgt = ids[0, 1:]
    return float(-lp.gather(1, tgt[:, None]).sum()), int(tgt.numel())


def evaluate(loaded, chunks: list[torch.Tensor], plan: dict[str, Any], gm: GraphModule | None = None) -> Evaluation:
    """Perplexity and per-layer drop rate / padding waste of the tiered plan against unlimited capacity."""
    from hetforge.ops.moe import recording
    from hetforge.passes import copy_gm

    seq = chunks[0].shape[1]
    base = gm if gm is not None else moe_graph(loaded, seq)
    tiered = apply_tiers(copy_gm(base), plan)
    res = {}
    for name, g in (("unlimited", base), ("tiered", tiered)):
        nll, n, secs = 0.0, 0, 0.0
        with recording() as rec, torch.no_grad():
            for c in chunks:
                t0 = time.perf_counter()
                out = g(c, torch.ones_like(c))
                secs += time.perf_counter() - t0
                a, b = _nll(out, c)
                nll, n = nll + a, n + b
        res[name] = (math.exp(nll / n), secs, rec.per_layer(), n)
    layers = []
    for layer, d in sorted(res["tiered"][2].items()):
        p = plan["layers"].get(layer, {})
        layers.append({"layer": layer, "hot": p.get("hot"), "hot_capacity": p.get("hot_capacity"),
                       "cold_capacity": p.get("cold_capacity"), "group_size": p.get("group_size"),
                       "assignments": d["assignments"], "dropped": d["dropped"], "drop_rate": d["drop_rate"],
                       "slots": d["slots"], "padded": d["slots"] - d["used"], "padding_waste": d["padding_waste"],
                       "groups_run": d["groups_run"], "groups": d["groups"]})
    return Evaluation(res["tiered"][3], res["unlimited"][0], res["tiered"][0], res["unlimited"][1],
                      res["tiered"][1], layers)


def check_max_drop(ev: Evaluation, max_drop: float) -> None:
    """Refuse a plan whose worst layer drops more than ``max_drop`` of its assignments (exit 2)."""
    worst = max(ev.layers, key=lambda d: d["drop_rate"], default=None)
    if worst is not None and worst["drop_rate"] > max_drop:
        raise UsageError(f"capacities drop {worst['drop_rate']:.1%} of the assignments of layer {worst['layer']} "
                         f"(> --max-drop {max_drop:.1%}); raise --capacity-factor or --share")
