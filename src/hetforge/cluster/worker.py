"""What one node runs: its stages of the prefill and decode programs, its slice of the KV cache.

:class:`NodeWorker` is a plain class; :mod:`.ray_runtime` makes it a Ray actor pinned to its node by the
node's custom resource. On first use of a (program kind, length) it captures the model's static-shape module
(:mod:`hetforge.runtime.static_kv`), cuts it at the plan's layer boundaries (:mod:`.split`) and compiles its
own stages only, each with hetforge's placed executor for the node's SoC (the ``stages`` strategy over the
node's devices; ``rules`` for a stage without decoder layers). A call runs one stage: inputs are the
request's token/position tensors, this node's KV cache buffers, and activations from earlier stages (Ray
object references resolved by Ray); the new K/V rows of its layers are written into its own cache and never
leave the node; what later stages read is returned (into Ray's object store).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hetforge.cluster.split import fold_constant_outputs, run_split, split_stages


class NodeWorker:
    """The stages of one node (see module docstring). Times it reports are **measured** on this host."""

    def __init__(self, node: str, soc: Any, model: str, layout: dict[str, Any], strategy: str = "stages",
                 objective: str = "latency", executor: str = "backend", threads: int = 1):
        from hetforge.models.zoo import load_model
        from hetforge.runtime.static_kv import model_dims

        if threads:
            torch.set_num_threads(threads)
        self.node, self.soc, self.layout = node, soc, layout
        self.strategy, self.objective, self.executor = strategy, objective, executor
        self.loaded = load_model(model)
        self.dims = model_dims(self.loaded.model)
        self.dtype = self.loaded.model.get_input_embeddings().weight.dtype
        self.stage_nodes: list[str] = layout["stage_nodes"]
        self.mine = [j for j, n in enumerate(self.stage_nodes) if n == node]
        self.programs: dict[tuple[str, int], dict[str, Any]] = {}
        self.caches: dict[tuple[int, int], dict[int, torch.Tensor]] = {}  # (request slot, length) → buffers

    def ping(self) -> str:
        return self.node

    def fingerprint(self) -> str:
        from hetforge.runtime.genplan import weights_fingerprint

        return weights_fingerprint(self.loaded.model)

    def _executor(self, has_layers: bool):
        from hetforge.runtime.executors import make_executor

        strategy = self.strategy if has_layers or self.strategy != "stages" else "rules"
        return make_executor(self.executor, soc=self.soc, strategy=strategy, objective=self.objective)

    def prepare(self, kind: str, length: int) -> dict[str, Any]:
        """Compile this node's stages of program ``kind`` at ``length`` (once); return the wiring and costs."""
        key = (kind, length)
        if key in self.programs:
            return self.programs[key]["info"]
        from hetforge.frontend import capture
        from hetforge.runtime.static_kv import DecodeModule, PrefillModule

        t0 = time.perf_counter()
        L, kv, hd = self.dims
        if kind == "prefill":
            module, inputs = PrefillModule(self.loaded.model), (torch.zeros((1, length), dtype=torch.long),
                                                                torch.tensor([length - 1]))
        else:
            cache = [torch.zeros((1, kv, length, hd), dtype=self.dtype) for _ in range(2 * L)]
            module, inputs = DecodeModule(self.loaded.model), (torch.zeros((1, 1), dtype=torch.long),
                                                               torch.zeros((1, 1), dtype=torch.long), *cache)
        cg = capture(module, inputs, name=f"{kind}-{length}")
        lay = self.layout
        sg = split_stages(cg.gm, {int(k): v for k, v in lay["layer_stage"].items()}, lay["embed_stage"],
                          lay["head_stage"])
        _, vals = run_split(sg, inputs)
        folded = fold_constant_outputs(sg, vals)
        kv_of = {r: i for i, r in enumerate(sg.results[1:])}  # stage output → KV buffer index (k0, v0, k1, ...)
        cache_ph = {name: i for i, name in enumerate(sg.placeholders[2:])} if kind == "decode" else {}
        read_later = {x for st in sg.stages for x in st.inputs} | {sg.results[0]}
        stages: dict[int, dict[str, Any]] = {}
        notes: list[str] = []
        for j in self.mine:
            st = sg.stages[j]
            has_layers = any(v == j for v in lay["layer_stage"].values())
            ex = self._executor(has_layers)
            built = ex.build(st.gm, tuple(vals[i] for i in st.inputs), f"{kind}-{length}-s{j}", True)
            built.run(*[vals[i] for i in st.inputs])  # warm-up
            stages[j] = {"run": built.run, "inputs": st.inputs, "out_names": st.out_names}
            notes += [f"s{j} on {self.node}: {n}" for n in built.notes[:2]]
        info = {"node": self.node, "stages": {j: sg.stages[j].inputs for j in range(len(sg.stages))},
                "logits": sg.results[0], "compile_s": time.perf_counter() - t0, "notes": notes, "folded": folded,
                "held_weight_bytes": sum(p.numel() * p.element_size() for j in self.mine
                                         for p in [*sg.stages[j].gm.parameters(), *sg.stages[j].gm.buffers()])}
        self.programs[key] = {"info": info, "stages": stages, "kv_of": kv_of, "cache_ph": cache_ph,
                              "read_later": read_later, "feed_ix": {n: i for i, n in enumerate(sg.placeholders[:2])}}
        return info

    def _cache(self, slot: int, length: int, idx: int) -> torch.Tensor:
        bufs = self.caches.setdefault((slot, length), {})
        if idx not in bufs:
            _, kv, hd = self.dims
            bufs[idx] = torch.zeros((1, kv, length, hd), dtype=self.dtype)
        return bufs[idx]

    def cache_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for c in self.caches.values() for b in c.values())

    def run(self, kind: str, length: int, cache_len: int, slot: int, j: int, feeds: list[torch.Tensor], pos: int,
            *upstream: dict[str, Any]) -> dict[str, Any]:
        """Run stage ``j`` for the request in cache ``slot``; write its layers' new K/V rows at ``pos``; return
        what later stages read."""
        prog = self.programs[(kind, length)]
        st = prog["stages"][j]
        vals: dict[str, Any] = {}
        timing: dict[int, float] = {}
        wire: dict[int, int] = {}
        received = 0
        for u in upstream:
            timing.update(u["__t"])
            wire.update(u["__wire"])
            src = u["__node"]
            for k, v in u.items():
                if not k.startswith("__"):
                    vals[k] = v
                    if src != self.node and k in st["inputs"]:
                        received += v.numel() * v.element_size()
        args = []
        for name in st["inputs"]:
            if name in prog["cache_ph"]:
                args.append(self._cache(slot, cache_len, prog["cache_ph"][name]))
            elif name in prog["feed_ix"]:  # token ids, and positions (decode) or the last row (prefill)
                args.append(feeds[prog["feed_ix"][name]])
            else:
                args.append(vals[name])
        t0 = time.perf_counter()
        out = st["run"](*args)
        out_d: dict[str, Any] = {}
        for key, v in zip(st["out_names"], out, strict=True):
            b = prog["kv_of"].get(key)
            if b is not None:
                n = v.shape[2]
                self._cache(slot, cache_len, b)[:, :, pos:pos + n].copy_(v)
            elif key in prog["read_later"]:
                out_d[key] = v
        timing[j] = time.perf_counter() - t0
        wire[j] = received
        out_d.update({"__t": timing, "__wire": wire, "__node": self.node})
        return out_d
