"""The pass pipeline: runs the seven passes in order through ``torch.fx.passes.infra.PassManager``.

Each pass is wrapped as a ``PassBase`` step; the manager lints the graph after every step. Optionally each
step's graph is checked numerically against the previous step's on the given inputs (``verify_each``) and
written to ``dump_dir`` as readable text (``00_input.txt``, ``01_cleanup.txt``, ...).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase
from torch.fx.passes.infra.pass_base import PassResult as InfraResult
from torch.fx.passes.infra.pass_manager import PassManager
from torch.utils import _pytree as pytree

from hetforge.errors import UsageError
from hetforge.files import write_text
from hetforge.passes.attention import fuse_attention
from hetforge.passes.cleanup import cleanup
from hetforge.passes.common import PassResult, copy_gm, fused_counts, num_nodes
from hetforge.passes.constfold import DEFAULT_MAX_BYTES, constant_fold
from hetforge.passes.cse import cse
from hetforge.passes.moe import fuse_moe
from hetforge.passes.normfusion import fuse_norms
from hetforge.passes.opfusion import fuse_operators

PASSES: dict[str, Callable[..., PassResult]] = {
    "cleanup": cleanup,
    "constant_fold": constant_fold,
    "cse": cse,
    "moe": fuse_moe,
    "attention": fuse_attention,
    "op_fusion": fuse_operators,
    "norm_fusion": fuse_norms,
}
PASS_NAMES: tuple[str, ...] = tuple(PASSES)


@dataclass
class OptimizeResult:
    """The optimized graph, what each pass did, and how many fused ops the graph now holds."""

    gm: GraphModule
    passes: list[PassResult]
    fused: dict[str, int]
    nodes_before: int
    nodes_after: int
    seconds: float
    dumped: list[str] = field(default_factory=list)
    unknown_ops: dict[str, int] = field(default_factory=dict)  # ops with no registry entry, passed through

    def to_dict(self, full: bool = False) -> dict[str, Any]:
        return {
            "passes": [p.to_dict(full) for p in self.passes], "fused": dict(self.fused),
            "nodes_before": self.nodes_before, "nodes_after": self.nodes_after, "seconds": self.seconds,
            "unknown_ops": dict(self.unknown_ops),
        }


def unknown_ops(gm: GraphModule) -> dict[str, int]:
    """Ops in ``gm`` that hetforge's op registry has no entry for (they pass through the passes untouched)."""
    from hetforge.frontend import op_name
    from hetforge.ops import lookup

    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and lookup(n.target) is None:
            out[op_name(n)] = out.get(op_name(n), 0) + 1
    return out


def resolve_passes(passes: Sequence[str] | str | None) -> list[str]:
    """Validate pass names (a list or a comma-separated string); None means all seven, in order."""
    if passes is None:
        return list(PASS_NAMES)
    names = [p.strip() for p in passes.split(",")] if isinstance(passes, str) else [str(p).strip() for p in passes]
    names = [n for n in names if n]
    bad = [n for n in names if n not in PASSES]
    if bad:
        raise UsageError(f"unknown pass{'es' if len(bad) > 1 else ''} {', '.join(repr(b) for b in bad)}; "
                         f"valid passes: {', '.join(PASS_NAMES)}")
    if not names:
        raise UsageError(f"no passes given; valid passes: {', '.join(PASS_NAMES)}")
    return names


def _first_tensor(out: Any) -> torch.Tensor | None:
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf
    return None


def _run(gm: GraphModule, inputs: Sequence[torch.Tensor]) -> torch.Tensor | None:
    with torch.no_grad():
        return _first_tensor(gm(*inputs))


def _fidelity(ref: torch.Tensor | None, got: torch.Tensor | None, kl_threshold: float) -> dict[str, Any]:
    from hetforge.verify import compare_logits

    if ref is None or got is None:
        return {"passed": ref is None and got is None}
    rep = compare_logits(ref.reshape(-1, ref.shape[-1]) if ref.dim() else ref.reshape(1, 1),
                         got.reshape(-1, got.shape[-1]) if got.dim() else got.reshape(1, 1), kl_threshold)
    return {"max_abs_err": rep.max_abs_err, "kl_mean": rep.kl_mean, "kl_max": rep.kl_max, "passed": rep.passed}


def _ensure_meta(gm: GraphModule, inputs: Sequence[torch.Tensor] | None) -> GraphModule:
    """Give every node ``meta['val']`` (fake tensors) when some lack it and inputs are known."""
    if inputs is None or all("val" in n.meta for n in gm.graph.nodes if n.op in ("placeholder", "call_function")):
        return gm
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = copy_gm(gm)
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    return gm


def _lint(module: torch.nn.Module) -> None:
    if isinstance(module, GraphModule):
        module.graph.lint()


class _Step(PassBase):
    """One hetforge pass as a ``torch.fx`` infra pass, recording its result (and check/dump) on the way."""

    def __init__(self, name: str, fn: Callable[..., PassResult], pipeline: _Pipeline):
        super().__init__()
        self.name, self.fn, self.pipeline = name, fn, pipeline

    def call(self, graph_module: GraphModule) -> InfraResult:
        res = self.fn(graph_module, inplace=True)  # on the pipeline's private copy; the manager lints + recompiles
        self.pipeline.record(res)
        return InfraResult(res.gm, res.changed)


@dataclass
class _Pipeline:
    inputs: Sequence[torch.Tensor] | None
    verify_each: bool
    dump_dir: Path | None
    kl_threshold: float
    results: list[PassResult] = field(default_factory=list)
    dumped: list[str] = field(default_factory=list)
    last_out: torch.Tensor | None = None

    def start(self, gm: GraphModule) -> None:
        if self.verify_each and self.inputs is not None:
            self.last_out = _run(gm, self.inputs)
        self.dump(gm, 0, "input", "the graph given to the pipeline")

    def record(self, res: PassResult) -> None:
        self.results.append(res)
        if self.verify_each and self.inputs is not None:
            out = _run(res.gm, self.inputs)
            res.fidelity = _fidelity(self.last_out, out, self.kl_threshold)
            self.last_out = out
        summary = (f"{res.name}: {res.nodes_before} -> {res.nodes_after} nodes, {len(res.rewrites)} rewrites, "
                   f"{len(res.near_misses)} near-misses, {res.seconds * 1e3:.1f} ms (measured)")
        lines = [summary] + [f"near-miss {m.kind} at {m.node}: {m.reason}" for m in res.near_misses]
        self.dump(res.gm, len(self.results), res.name, "\n".join(lines))

    def dump(self, gm: GraphModule, index: int, name: str, header: str) -> None:
        if self.dump_dir is None:
            return
        path = self.dump_dir / f"{index:02d}_{name}.txt"
        text = "\n".join(f"# {ln}" for ln in header.splitlines()) + "\n\n" + gm.print_readable(print_output=False)
        write_text(path, text, "--dump-dir file")
        self.dumped.append(str(path))


def optimize(
    gm: GraphModule,
    example_inputs: Sequence[torch.Tensor] | None = None,
    passes: Sequence[str] | str | None = None,
    verify_each: bool = False,
    dump_dir: str | Path | None = None,
    kl_threshold: float = 1e-8,
    fold_max_bytes: int = DEFAULT_MAX_BYTES,
) -> OptimizeResult:
    """Run the middle-end passes (all seven by default, in :data:`PASS_NAMES` order) on a copy of ``gm``.

    ``verify_each`` (needs ``example_inputs``) compares each pass's graph with the previous one's outputs;
    ``dump_dir`` receives the graph after each pass as text. The input GraphModule is never modified.
    """
    names = resolve_passes(passes)
    if verify_each and example_inputs is None:
        raise UsageError("verify_each needs example_inputs to run the graphs on")
    ddir = Path(dump_dir) if dump_dir is not None else None
    if ddir is not None:
        if ddir.exists() and not ddir.is_dir():
            raise UsageError(f"--dump-dir '{ddir}' exists and is not a folder")
        try:
            ddir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot create --dump-dir '{ddir}': {e.strerror or e}") from None
    t0 = time.perf_counter()
    before = num_nodes(gm)
    work = _ensure_meta(gm, example_inputs)
    if work is gm:
        work = copy_gm(gm)  # the one copy: every pass then rewrites it in place
    pipe = _Pipeline(example_inputs, verify_each, ddir, kl_threshold)
    pipe.start(work)
    fns = {**PASSES, "constant_fold": lambda g, inplace: constant_fold(g, fold_max_bytes, inplace=inplace)}
    # each step's class is named after its pass: PassManager names a failing step by its class
    steps = [type(n, (_Step,), {})(n, fns[n], pipe) for n in names]
    # lint after every pass when verifying or dumping (a malformed graph then names its pass), else once at the
    # end: the lint after every pass (inside torch's dead-code elimination; PassManager's own check does nothing)
    # was an eighth to a sixth of the pipeline's time
    debug = verify_each or ddir is not None
    pm = PassManager(passes=steps, steps=1, run_checks_after_each_pass=debug)
    if debug:
        pm.add_checks(_lint)
    out = pm(work).graph_module
    if not debug:
        _lint(out)
    seconds = time.perf_counter() - t0
    return OptimizeResult(out, pipe.results, fused_counts(out), before, num_nodes(out), seconds, pipe.dumped,
                          unknown_ops(out))
