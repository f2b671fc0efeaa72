"""Placed programs whose MoE blocks run as expert groups on the devices the residency model chose.

:class:`MoePlacedExecutor` is the placed executor with one step between the passes and placement: every
``hetforge::moe`` node is expanded into route / per-group gather → ``moe_group`` → scatter
(:func:`hetforge.moe.expand.expand_moe`) with a tier plan for the program's own ``T`` (prefill tier or 1 for
decode) from a calibration, and each group node is pinned to the SoC device the residency model picked for it
(:func:`hetforge.moe.expand.residency_pins`). The rest of the graph is placed by the strategy as usual; the
scheduled program is cut into partitions and run on the devices' backends (an emulated NPU checks its op set
and static shapes), so the hot groups' weights really live in the NPU partition. Each group's placement reason
is the residency model's.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from hetforge.errors import UsageError
from hetforge.runtime.executors import PlacedExecutor

PLACES = ("auto", "host", "npu")


@dataclass
class MoeOptions:
    """How the MoE blocks are tiered, grouped and made resident (see ``hetforge run --moe-calibration``)."""

    calibration: dict[str, Any]
    share: float = 0.9
    group_size: int = 2
    capacity_factor: float = 1.25
    unlimited: bool = False  # every expert T slots: nothing dropped, equals the unexpanded model
    objective: str = "latency"  # residency objective: latency or energy
    npu_budget_bytes: float | None = None
    place: str = "auto"  # auto: the residency model; host: every group on CPU/GPU; npu: every group on the NPU

    def check(self) -> None:
        from hetforge.moe import check_plan_options

        check_plan_options(self.group_size, self.capacity_factor, None, self.share)
        if self.objective not in ("latency", "energy"):
            raise UsageError(f"--moe-objective '{self.objective}' must be latency or energy")
        if self.place not in PLACES:
            raise UsageError(f"--moe-place '{self.place}' must be one of {', '.join(PLACES)}")


@dataclass
class MoePlacedExecutor(PlacedExecutor):
    """:class:`PlacedExecutor` + MoE expert groups pinned by the residency model (module docstring)."""

    moe: MoeOptions | None = None
    dims: tuple[int, int, int] = (0, 0, 4)  # (D, F, dtype bytes) of the experts
    # one prefill call per tier: expert-group capacities are sized per program's tokens, so chunks would change
    # which tokens a group drops (runtime.engine reads this)
    prefill_at_tier: ClassVar[bool] = True
    expansions: dict[str, Any] = field(default_factory=dict)  # program label → Expansion

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.moe is None:
            raise UsageError("MoePlacedExecutor needs MoE options (a calibration)")
        self.moe.check()
        from hetforge.placement import get_strategy

        if "pin" not in inspect.signature(get_strategy(self.base_strategy)).parameters:
            raise UsageError(f"--moe-calibration pins expert groups to devices; strategy '{self.base_strategy}' "
                             "takes no pins (use rules, greedy, pgsam or single)")
        self.name = f"{self.name}+moe-groups"

    def place(self, gm: torch.fx.GraphModule, inputs: tuple, label: str, optimize: bool, placement: Any = None,
              expand: Any = None):
        """Passes → MoE expansion + residency pins → the strategy (with the pins) → lower → schedule → plan.
        ``expand`` (a two-layer capture, ``runtime.stamp.Deferred``) is stamped out first: the MoE expansion reads
        the whole optimized graph."""
        from hetforge.compile import compile_graph
        from hetforge.moe.expand import expand_for_soc, moe_nodes
        from hetforge.passes import optimize as run_passes

        if placement is not None:
            raise UsageError("a generation plan (--plan) cannot be combined with --moe-calibration")
        if expand is not None:
            gm = expand.whole()
        t0 = time.perf_counter()
        opt = None
        if optimize:
            opt = run_passes(gm, inputs)
            gm = opt.gm
        if not moe_nodes(gm):
            raise UsageError("--moe-calibration: the model has no MoE block hetforge recognises")
        o = self.moe
        gm, exp, pins = expand_for_soc(gm, o.calibration, self.soc_profile, self.dims, o.share, o.group_size,
                                       o.capacity_factor, o.unlimited, o.objective, o.npu_budget_bytes,
                                       None if o.place == "auto" else o.place)
        t_pre = time.perf_counter() - t0
        res = compile_graph(gm, soc=self.soc_profile, strategy=self.base_strategy,
                            strategy_options={**self.options(), "pin": pins}, example_inputs=inputs, passes=False,
                            name=label, quantize=self.quantize, group_size=self.group_size, build=False)
        res.optimized = opt
        res.seconds["passes"] = t_pre
        res.seconds["total"] = res.seconds.get("total", 0.0) + t_pre
        for g in exp.groups:
            res.placement.reasons[g.node] = g.reason
        res.extra["moe"] = exp
        self.expansions[label] = exp
        return res

    def build_program(self, res, built=None, step=None):
        b = super().build_program(res, built, step)
        exp = res.extra.get("moe")
        if exp is not None:
            on = {}
            for g in exp.groups:
                on.setdefault(g.device, []).append(f"l{g.layer}g{g.group}")
            b.notes.append(f"MoE expert groups ({exp.tokens} tokens per call): "
                           + "; ".join(f"{dev}: {', '.join(v)}" for dev, v in on.items())
                           + (f"; left whole: {', '.join(exp.skipped)}" if exp.skipped else ""))
        return b


def moe_summary(executor) -> dict[str, Any] | None:
    """Per program: its expert groups, their devices and residency reasons (None for other executors)."""
    exps = getattr(executor, "expansions", None)
    if exps is None:
        return None
    return {label: e.to_dict() for label, e in exps.items()}


@dataclass
class TieredReference:
    """The reference for tiered runs: the *unexpanded* ``hetforge::moe`` op with the same tier plan written into
    it (:func:`hetforge.moe.apply_tiers`), the optimized graph called as is (no placement)."""

    calibration: dict[str, Any]
    share: float = 0.9
    group_size: int = 2
    capacity_factor: float = 1.25
    name: str = "fx+moe-tiers"
    prefill_at_tier: ClassVar[bool] = True  # the tier plan's capacities are per program (as MoePlacedExecutor)

    def build(self, gm: torch.fx.GraphModule, inputs: tuple, label: str, optimize: bool):
        from hetforge.moe import apply_tiers, choose_tiers
        from hetforge.moe.expand import graph_tokens
        from hetforge.passes import optimize as run_passes
        from hetforge.runtime.executors import Built

        t0 = time.perf_counter()
        g = run_passes(gm, inputs).gm
        apply_tiers(g, choose_tiers(self.calibration, graph_tokens(g), share=self.share, group_size=self.group_size,
                                    capacity_factor=self.capacity_factor))

        def run(*args: torch.Tensor):
            with torch.no_grad():
                return g(*args)

        return Built(run, time.perf_counter() - t0, 0.0, len(g.graph.nodes), ["MoE tiers applied to hetforge::moe"])
