"""Passing kernels into the compiler: a KForge kernel becomes a ``hetforge::kf_<problem>`` op, and a pass
substitutes it wherever the problem's reference pattern appears in a captured model.

The op is a real ``torch.library`` custom op (via :func:`hetforge.ops.registry.register_op`): its CPU
kernel calls the generated C ABI (``kforge_kernel``), its fake kernel gives the fixed output shape, its
cost formula is the reference's FLOPs with the measured kernel time kept in ``attrs``, and it runs on the
CPU only. The pattern is the reference ``Model`` exported with its parameters lifted to inputs, so it
matches the same computation inside any captured graph; a match is taken only when every input has the
shape the kernel was built for. Limits: offline-format kernels (those exposing ``kforge_kernel``,
``IN_SHAPES`` and ``OUT_SHAPES``) with one output.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.fx import GraphModule

from hetforge.errors import UsageError
from hetforge.kforge.problems import Problem, load_module


@dataclass
class Registered:
    op_name: str  # hetforge.kf_<problem>.default
    overload: object
    problem: Problem
    kernel_path: Path
    in_shapes: list[list[int]]
    out_shape: list[int]
    pattern: GraphModule
    measured_s: float | None


def _pattern(problem: Problem) -> GraphModule:
    """The reference Model's ATen graph with parameters as placeholders (in the kernel's input order)."""
    mod = problem.load()
    torch.manual_seed(0)
    model = mod.Model(*mod.get_init_inputs()).eval()
    ep = torch.export.export(model, tuple(mod.get_inputs()))
    return ep.graph_module


def register_kernel(problem: Problem, kernel_path: Path, measured_s: float | None = None,
                    flops: float = 0.0) -> Registered:
    """Register the kernel file as ``hetforge::kf_<problem>``; returns what the substitution pass needs."""
    from hetforge.ops.registry import REGISTRY, register_op

    cand = load_module(kernel_path, f"kforge_op_{problem.name}")
    if not all(hasattr(cand, a) for a in ("_LIB", "IN_SHAPES", "OUT_SHAPES")):
        raise UsageError(f"'{kernel_path}' is not an offline-format kernel (needs _LIB.kforge_kernel, IN_SHAPES, "
                         "OUT_SHAPES); only those can be registered as ops")
    if len(cand.OUT_SHAPES) != 1:
        raise UsageError(f"'{kernel_path}' has {len(cand.OUT_SHAPES)} outputs; ops with one output only")
    ins, out = [list(s) for s in cand.IN_SHAPES], list(cand.OUT_SHAPES[0])
    name = f"kf_{problem.name}"
    op_name = f"hetforge.{name}.default"
    if op_name not in REGISTRY:
        import ctypes

        lib = cand._LIB
        args = ", ".join(f"Tensor a{i}" for i in range(len(ins)))

        def fake(*xs):
            return xs[0].new_empty(out)

        def kernel(*xs):
            xs = [x.contiguous() for x in xs]
            if [list(x.shape) for x in xs] != ins:
                raise ValueError(f"{name} was built for input shapes {ins}")
            y = torch.empty(out)
            lib.kforge_kernel(*[ctypes.c_void_p(t.data_ptr()) for t in [*xs, y]])
            return y

        info = register_op(f"hetforge::{name}({args}) -> Tensor", flops=lambda call, f=flops: f, devices=("cpu",),
                           fake=fake, description=f"KForge kernel for {problem.name}")(kernel)
        info.attrs.update(measured_s=measured_s, kernel=str(kernel_path), source="kforge")
    info = REGISTRY[op_name]
    return Registered(op_name, info.overload, problem, kernel_path, ins, out, _pattern(problem), measured_s)


def _shape_of(node, gm: GraphModule) -> list[int] | None:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return list(v.shape)
    if node.op == "get_attr":
        t = gm
        for part in str(node.target).split("."):
            t = getattr(t, part, None)
        return list(t.shape) if isinstance(t, torch.Tensor) else None
    return None


def substitute(gm: GraphModule, reg: Registered) -> int:
    """Replace every shape-matching occurrence of the registered pattern in ``gm`` with the op; returns the count."""
    from torch.fx.subgraph_rewriter import replace_pattern_with_filters

    pat = reg.pattern
    phs = [n for n in pat.graph.nodes if n.op == "placeholder"]
    repl = torch.fx.Graph()
    args = [repl.placeholder(p.name) for p in phs]
    repl.output(repl.call_function(reg.overload, tuple(args)))

    def shapes_match(match, original, pattern) -> bool:
        got = [_shape_of(n, gm) for n in match.placeholder_nodes]
        return got == reg.in_shapes

    pattern_graph = torch.fx.Graph()
    env = {}
    for n in pat.graph.nodes:  # drop the export wrapper's output pytree: return the single tensor
        if n.op == "output":
            o = n.args[0]
            pattern_graph.output(env[(o[0] if isinstance(o, (list, tuple)) else o).name])
        else:
            env[n.name] = pattern_graph.node_copy(n, lambda a: env[a.name])
    done = replace_pattern_with_filters(gm, pattern_graph, repl, match_filters=[shapes_match])
    gm.recompile()
    return len(done)


def fidelity(model: torch.nn.Module, xs: tuple, reg: Registered) -> dict:
    """Capture ``model``, substitute the kernel, and compare the substituted graph with eager (max abs error)."""
    from hetforge.frontend import capture

    cg = capture(model, xs, name="kforge-register")
    gm = cg.gm
    n = substitute(gm, reg)
    with torch.no_grad():
        ref = model(*xs)
        got = gm(*xs)
    ref = ref[0] if isinstance(ref, (list, tuple)) else ref
    got = got[0] if isinstance(got, (list, tuple)) else got
    err = float((ref.double() - got.double()).abs().max())
    used = sum(1 for node in gm.graph.nodes if node.op == "call_function" and node.target is reg.overload)
    return {"substituted": n, "op_calls": used, "max_abs_err": err, "ok": n > 0 and err <= 1e-4 and not math.isnan(err)}


def save_manifest(reg: Registered, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / f"{reg.op_name}.json"
    p.write_text(json.dumps({"op": reg.op_name, "problem": str(reg.problem.path), "kernel": str(reg.kernel_path),
                             "in_shapes": reg.in_shapes, "out_shape": reg.out_shape, "measured_s": reg.measured_s,
                             "devices": ["cpu"]}, indent=1))
    return p
