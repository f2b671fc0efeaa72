"""The whole compiler in one call: capture → passes → placement → lower → schedule → plan → kernels → executable.

``compile_model("gpt2", seq=128, soc="host")`` builds a zoo model, captures it and compiles it;
``compile_graph(gm, soc=...)`` starts from an already captured (or optimized) GraphModule. Both return
a :class:`CompileResult` holding every stage's result, its report and its wall time (measured).

    >>> from hetforge.compile import compile_model
    >>> res = compile_model("llama-tiny", seq=8)            # doctest: +SKIP
    >>> logits = res.executable(*res.example_inputs)        # doctest: +SKIP
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hetforge.errors import UsageError
from hetforge.executor import Executable
from hetforge.frontend import gc_frozen
from hetforge.ir.kernel_choice import default_device_map, lower_kernels
from hetforge.ir.program import Program
from hetforge.ir.verify import memory_record, verify_program
from hetforge.lower import LowerResult, lower
from hetforge.memplan import MemoryPlan, plan_memory
from hetforge.schedule import ScheduleResult, schedule

STAGES = ("capture", "passes", "place", "lower", "schedule", "memory", "kernels", "build")


@dataclass
class CompileResult:
    """Every stage's product and report; ``seconds`` per stage are measured wall time."""

    name: str
    soc: Any
    gm: torch.fx.GraphModule  # the graph that was lowered (after passes)
    placement: Any
    lowered: LowerResult
    scheduled: ScheduleResult
    memory: MemoryPlan
    executable: Executable | None
    seconds: dict[str, float]
    captured: Any = None
    optimized: Any = None
    example_inputs: tuple[torch.Tensor, ...] = ()
    passes_note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def program(self) -> Program:
        """The final (scheduled) program."""
        return self.scheduled.program

    def report(self) -> dict[str, Any]:
        """The figures the CLI prints (``--json`` fields)."""
        p = self.program
        tr = p.transfers()
        mem = self.memory.to_dict()
        out: dict[str, Any] = {
            "model": self.name,
            "soc": getattr(self.soc, "name", str(self.soc)),
            "strategy": getattr(self.placement, "strategy", None),
            "instructions": len(p.instrs),
            "instructions_by_device": p.count_by_device(),
            "instructions_by_kind": self.lowered.report.by_kind,
            "transfers": len(tr),
            "transfers_detail": {
                "zero_copy": sum(1 for i in tr if i.attrs.get("zero_copy")),
                "bytes_moved": sum(int(i.attrs.get("bytes", 0)) for i in tr),
                "modeled_seconds": self.extra.get("transfer_seconds_modeled"),
            },
            "switches": {"naive": self.scheduled.naive_switches, "scheduled": self.scheduled.scheduled_switches,
                         "exact": self.scheduled.exact_switches},
            "memory": mem,
            "dropped": self.lowered.report.dropped,
            "views_rehomed": self.lowered.report.views_rehomed,
            "passes": self.passes_note or (self.optimized.to_dict() if self.optimized is not None else None),
            "seconds": dict(self.seconds),
            "labels": {"seconds": "measured", "memory": "planned (exact, from the plan)",
                       "transfers_modeled_seconds": "modeled"},
        }
        if self.executable is not None:
            s = self.executable.stats
            out["executor"] = {"mode": self.executable.mode, "out_variant": s.out_variant, "gemm_out": s.gemm_out,
                               "copy_into": s.copy_into, "functional_copy": s.functional_copy,
                               "heads_last_copies": s.heads_last_copies, "views": s.views,
                               "elided_views": s.elided_views, "unplanned": s.unplanned,
                               "fallback_ops": s.by_op_fallback}
        return out


def _run_passes(gm: torch.fx.GraphModule, example_inputs, passes) -> tuple[torch.fx.GraphModule, Any, str]:
    from hetforge.passes import optimize

    if passes is False:
        return gm, None, "disabled"
    names = None if passes in (True, None) else passes
    res = optimize(gm, example_inputs=example_inputs, passes=names)
    return res.gm, res, ""


def _passes_then_stamp(gm: torch.fx.GraphModule, example_inputs, passes, expand: Any) \
        -> tuple[torch.fx.GraphModule, Any, str]:
    """The passes on ``expand``'s two-layer graph ``gm``, then its layers stamped out (see :func:`compile_graph`);
    the passes' report then counts the whole graph's nodes before and after, as the whole graph's passes would."""
    import dataclasses

    from hetforge.passes import fused_counts

    if passes is False:
        return expand.whole(), None, "disabled"
    gm2, opt, note = _run_passes(gm, expand.two_inputs, passes)
    if not expand.after_passes(gm2):
        return _run_passes(expand.whole(), example_inputs, passes)
    opt = dataclasses.replace(opt, gm=gm2, fused=fused_counts(gm2), nodes_before=expand.whole_nodes(),
                              nodes_after=len(gm2.graph.nodes))
    return gm2, opt, note


def row_prune_enabled() -> bool:
    """Whether compiles with passes run the row-selection pass (``passes/rowprune.py``): yes unless
    ``HETFORGE_ROW_PRUNE=0`` (an A/B switch; the compile cache keys on it)."""
    return os.environ.get("HETFORGE_ROW_PRUNE", "1").strip() != "0"


def _prune_rows(gm: torch.fx.GraphModule, opt: Any) -> tuple[torch.fx.GraphModule, Any]:
    """The row-selection pass on the whole (stamped) graph, its result added to the passes' report."""
    import dataclasses

    from hetforge.passes import fused_counts
    from hetforge.passes.rowprune import prune_rows

    res = prune_rows(gm)
    if not res.rewrites:
        return gm, opt
    if opt is not None:
        opt = dataclasses.replace(opt, gm=res.gm, passes=[*opt.passes, res], fused=fused_counts(res.gm),
                                  nodes_after=res.nodes_after)
    return res.gm, opt


def _transfer_seconds(p: Program, soc) -> float:
    """Modeled time of all transfers (cost model)."""
    from hetforge.cost import transfer_cost

    return sum(transfer_cost(int(ins.attrs.get("bytes", 0)), soc.link(ins.attrs["src"], ins.attrs["dst"]))[0]
               for ins in p.transfers())


@gc_frozen()
def compile_graph(
    gm: torch.fx.GraphModule,
    soc: str | Any = "host",
    strategy: str = "support",
    example_inputs: Sequence[torch.Tensor] | None = None,
    passes: bool | str | Sequence[str] | None = True,
    name: str = "model",
    mode: str = "arena",
    build: bool = True,
    lookahead: int = 2,
    exact_limit: int = 0,
    strategy_options: dict[str, Any] | None = None,
    device_map: dict[str, torch.device] | None = None,
    placement: Any = None,
    rehome_views: bool = True,
    quantize: str = "none",
    group_size: int = 128,
    quant_skip: Sequence[str] = (),
    expand: Any = None,
) -> CompileResult:
    """Compile a captured GraphModule for ``soc`` (a name, a path or a SocProfile).

    ``passes``: True (all), False (none), or pass names. ``placement`` overrides ``strategy``.
    ``expand``: ``gm`` is a cut-down capture whose repeated layers are stamped out after the passes (a
    :class:`hetforge.runtime.stamp.Deferred`: the passes then run on two layers, not all); where the optimized
    layers cannot be stamped it gives the whole graph and the passes run on that.
    With passes, the row-selection pass (``passes/rowprune.py``) runs on the whole graph after them (and after the
    stamping): a one-row selection's last layer computed for that row only.
    ``quantize`` (``w8``/``w4``/``w8a8``/``none``) runs the weight-quantization pass after the middle-end passes,
    so placement and the cost model see the int8/int4 linears. ``build=False`` stops before allocating
    arenas (reports only).
    """
    from hetforge.hardware import load_soc
    from hetforge.placement import get_strategy

    secs: dict[str, float] = {}
    t_all = time.perf_counter()
    soc_p = load_soc(soc) if isinstance(soc, str) else soc
    t0 = time.perf_counter()
    if expand is None:
        gm2, opt, note = _run_passes(gm, example_inputs, passes)
    else:
        gm2, opt, note = _passes_then_stamp(gm, example_inputs, passes, expand)
    if passes is not False and row_prune_enabled():  # after stamping (passes/rowprune.py)
        gm2, opt = _prune_rows(gm2, opt)
    secs["passes"] = time.perf_counter() - t0 - (expand.seconds if expand is not None else 0.0)
    if expand is not None:
        secs["stamp"] = expand.seconds
    quant = None
    if quantize != "none":
        from hetforge.quant import check_options, quantize_graph

        check_options(quantize, group_size, tuple(quant_skip))
        t0 = time.perf_counter()
        quant = quantize_graph(gm2, scheme=quantize, group_size=group_size, skip=tuple(quant_skip))
        gm2 = quant.gm
        secs["quantize"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if placement is None:
        placement = get_strategy(strategy)(gm2, soc_p, **(strategy_options or {}))
    secs["place"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    low = lower(gm2, placement, soc_p, name=name, rehome_views=rehome_views)
    verify_program(low.program, "lower")
    secs["lower"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sch = schedule(low.program, lookahead=lookahead, exact_limit=exact_limit)
    verify_program(sch.program, "schedule")
    secs["schedule"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    mem = plan_memory(sch.program)
    arenas = {d: dp.arena_bytes for d, dp in mem.devices.items()}
    verify_program(sch.program, "memory", mem.offsets, arenas)
    sch.program.memory = memory_record(mem.offsets, arenas)  # saved with the program, re-checked on load
    secs["memory"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if device_map is None:
        device_map = default_device_map(sch.program, soc_p)
    lower_kernels(sch.program, mem.offsets, device_map, mode)  # attrs["kernel"] on every instruction
    secs["kernels"] = time.perf_counter() - t0
    exe = None
    if build:
        t0 = time.perf_counter()
        exe = Executable(sch.program, mem, device_map=device_map, mode=mode, soc=soc_p)
        secs["build"] = time.perf_counter() - t0
    secs["total"] = time.perf_counter() - t_all
    res = CompileResult(name, soc_p, gm2, placement, low, sch, mem, exe, secs, optimized=opt,
                        example_inputs=tuple(example_inputs or ()), passes_note=note)
    res.extra["transfer_seconds_modeled"] = _transfer_seconds(sch.program, soc_p)
    res.extra["quantize"] = quant
    return res


def compile_model(
    model: str | torch.nn.Module,
    seq: int = 16,
    soc: str | Any = "host",
    strategy: str = "support",
    example_inputs: Sequence[torch.Tensor] | None = None,
    attn: str = "sdpa",
    capture_with: Callable[[torch.nn.Module, tuple, str], Any] | None = None,
    **kwargs: Any,
) -> CompileResult:
    """Capture and compile a zoo model by name (or an nn.Module with ``example_inputs``).

    ``capture_with(module, inputs, name)``: the capture to use instead of exporting the whole module (the CLI
    passes ``hetforge.runtime.stamp.capture_layers``: two layers exported, the rest stamped out after the passes);
    a capture holding ``deferred`` layers is compiled with them (``compile_graph``'s ``expand``). Seconds: ``load``
    (building a zoo model) apart from ``capture``; ``total`` is capture and compilation."""
    from hetforge.frontend import capture

    t0 = time.perf_counter()
    loaded = None
    if isinstance(model, str):
        from hetforge.models.zoo import example_inputs as make_inputs
        from hetforge.models.zoo import load_model

        loaded = load_model(model, attn=attn)
        module = loaded.logits_module()
        inputs = tuple(example_inputs) if example_inputs is not None else make_inputs(loaded, seq=seq)
        name = loaded.name
    else:
        if example_inputs is None:
            raise UsageError("compiling an nn.Module needs example_inputs")
        module, inputs, name = model, tuple(example_inputs), kwargs.pop("name", type(model).__name__)
    t1 = time.perf_counter()
    cg = capture_with(module, inputs, name) if capture_with is not None else capture(module, inputs, name=name)
    cap = time.perf_counter() - t1
    res = compile_graph(cg.gm, soc=soc, strategy=strategy, example_inputs=inputs, name=name, expand=cg.deferred,
                        **kwargs)
    res.captured = cg
    res.seconds = {"load": t1 - t0, "capture": cap, **res.seconds, "total": res.seconds["total"] + cap}
    res.extra["module"] = module
    res.extra["loaded"] = loaded
    note = cg.final_note()  # a deferred capture's, after its stamping
    if note:
        res.extra["capture_note"] = note
    return res
