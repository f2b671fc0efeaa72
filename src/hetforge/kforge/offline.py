"""The offline kernel generator: fused C++/OpenMP kernels from the reference's captured graph, no network.

``torch.export`` captures ``Model`` on the problem's inputs and decomposes it to core ATen. The graph
is accepted when it is elementwise ops, reductions over the last dimension (sum, mean, max, min,
softmax, log-softmax, layer norm) and at most one GEMM (``mm``/``addmm``, linear layers) feeding them.
It is then one row program: for each row (a block of rows after a GEMM, computed into a thread-local
buffer) run the reductions' loops and write every output in one pass — so a whole GEMM + tail-op chain
is one kernel with one trip through memory. Anything else raises :class:`Unsupported` with the op.

:class:`Tunables` are the knobs the search turns (row block, register blocking, SIMD pragmas, serial
cut-off, fast math); the performance-analysis agent's advice picks which to turn next.
"""

from __future__ import annotations

import hashlib
import math
import operator
from dataclasses import asdict, dataclass, replace

import torch

from hetforge.kforge.problems import Problem


class Unsupported(Exception):
    """The reference graph has something the generator cannot express (named in the message)."""


@dataclass(frozen=True)
class Tunables:
    mb: int = 8  # GEMM rows computed per block (and per thread-local buffer)
    nb: int = 4  # GEMM output columns accumulated together (register blocking)
    simd: bool = True  # `#pragma omp simd` on inner loops
    parallel_min: int = 1 << 15  # below this many output elements the kernel runs serially
    fast_math: bool = False  # -ffast-math: vectorised exp/log from libmvec, reassociation
    schedule: str = "static"

    def key(self) -> str:
        return ",".join(f"{k}={v}" for k, v in asdict(self).items())


@dataclass
class _V:
    kind: str  # in, wT, gemm, elem, row, const, tuple
    node: object = None
    shape: tuple = ()
    op: str = ""
    args: tuple = ()
    value: float = 0.0


def _f(x: float) -> str:
    if math.isinf(x):
        return "INFINITY" if x > 0 else "(-INFINITY)"
    if math.isnan(x):
        return "NAN"
    return f"{float(x)!r}f"


_UNARY = {
    "neg": "(-{0})", "relu": "({0} > 0.f ? {0} : 0.f)", "sigmoid": "(1.f / (1.f + expf(-{0})))",
    "tanh": "tanhf({0})", "exp": "expf({0})", "log": "logf({0})", "sqrt": "sqrtf({0})",
    "rsqrt": "(1.f / sqrtf({0}))", "abs": "fabsf({0})", "erf": "erff({0})", "reciprocal": "(1.f / {0})",
    "silu": "({0} / (1.f + expf(-{0})))", "sin": "sinf({0})", "cos": "cosf({0})",
}
_BINARY = {"add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
           "maximum": "fmaxf({0}, {1})", "minimum": "fminf({0}, {1})", "eq": "(float)({0} == {1})",
           "ne": "(float)({0} != {1})", "gt": "(float)({0} > {1})", "lt": "(float)({0} < {1})",
           "ge": "(float)({0} >= {1})", "le": "(float)({0} <= {1})", "pow": "powf({0}, {1})"}


class _Plan:
    """The row program of one captured graph."""

    def __init__(self, ep):
        self.ep = ep
        self.vals: dict = {}
        self.inputs: list[tuple[str, str, tuple]] = []  # (placeholder, user index or param fqn, shape)
        self.in_vals: list[_V] = []
        self.gemm: _V | None = None
        self.outputs: list[_V] = []
        self.S: tuple = ()
        self._build()

    def _shape(self, n) -> tuple:
        v = n.meta.get("val")
        return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else ()

    def _build(self) -> None:
        ep = self.ep
        sig = {s.arg.name: s for s in ep.graph_signature.input_specs}
        user_i = 0
        for n in ep.graph.nodes:
            if n.op != "placeholder":
                continue
            s = sig[n.name]
            kind = s.kind.name
            v = n.meta.get("val")
            if not isinstance(v, torch.Tensor):
                raise Unsupported(f"non-tensor input {n.name}")
            if v.dtype != torch.float32:
                raise Unsupported(f"input {n.name} has dtype {v.dtype} (the generator handles float32)")
            if kind == "USER_INPUT":
                self.inputs.append((n.name, str(user_i), self._shape(n)))
                user_i += 1
            elif kind in ("PARAMETER", "BUFFER"):
                self.inputs.append((n.name, s.target, self._shape(n)))
            else:
                raise Unsupported(f"input kind {kind}")
            self.vals[n] = _V("in", n, self._shape(n))
            self.in_vals.append(self.vals[n])
        computes = [n for n in ep.graph.nodes if n.op == "call_function"]
        gemms = [n for n in computes if str(n.target) in ("aten.mm.default", "aten.addmm.default")]
        users = [n for n in ep.graph.nodes if n.op == "placeholder" and sig[n.name].kind.name == "USER_INPUT"]
        cand = [self._shape(n) for n in (gemms or computes + users) if isinstance(n.meta.get("val"), torch.Tensor)
                and "permute" not in str(n.target)]
        if not cand:
            raise Unsupported("no computation in the graph")
        self.S = max(cand, key=lambda s: (math.prod(s), len(s)))
        if not self.S or math.prod(self.S) == 0:
            raise Unsupported("scalar or empty output")
        self.C = self.S[-1]
        self.R = math.prod(self.S) // self.C
        for n in computes:
            self.vals[n] = self._node(n)
        out = next(n for n in ep.graph.nodes if n.op == "output")
        for o in out.args[0]:
            v = self.vals[o]
            if v.kind not in ("elem", "row", "gemm", "in"):
                raise Unsupported(f"output of kind {v.kind}")
            shp = self._shape(o)
            if v.kind == "row" and math.prod(shp) != self.R:
                raise Unsupported(f"row output of shape {shp}")
            if v.kind in ("elem", "gemm", "in") and shp != self.S:
                raise Unsupported(f"output shape {shp} differs from the iteration shape {self.S}")
            if v.kind == "in":
                v = _V("elem", o, shp, "copy", (v,))
            self.outputs.append(_V(v.kind, o, shp, "out", (v,)))

    def _arg(self, a):
        if isinstance(a, torch.fx.Node):
            return self.vals[a]
        if isinstance(a, (int, float, bool)):
            return _V("const", value=float(a))
        raise Unsupported(f"argument {a!r}")

    def _kind(self, vs) -> str:
        kinds = {self._in_kind(v) for v in vs}
        if "elem" in kinds:
            return "elem"
        return "row" if "row" in kinds else "const"

    def _in_kind(self, v: _V) -> str:
        if v.kind in ("gemm", "elem"):
            return "elem"
        if v.kind == "in":
            t = v.shape
            if len(t) > len(self.S):
                raise Unsupported(f"input of shape {t} wider than {self.S}")
            return "elem" if t and t[-1] == self.C and self.C > 1 else ("row" if math.prod(t) > 1 else "const")
        return v.kind

    def _last_dim(self, n, dims) -> bool:
        nd = len(self._shape(n.args[0]))
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        return len(dims) == 1 and dims[0] % nd == nd - 1 and self._shape(n.args[0]) == self.S

    def _node(self, n) -> _V:
        t = n.target
        name = getattr(t, "__name__", str(t)).split(".")[0]
        args = n.args
        if t is operator.getitem:
            tup = self.vals[args[0]]
            if tup.kind != "tuple":
                raise Unsupported("getitem of a non-tuple")
            return tup.args[args[1]]
        if name in ("permute", "t"):
            src = self.vals[args[0]]
            if src.kind != "in" or len(src.shape) != 2:
                raise Unsupported("permute of a computed value")
            return _V("wT", n, self._shape(n), args=(src,))
        if name in ("mm", "addmm"):
            if self.gemm is not None:
                raise Unsupported("more than one GEMM")
            if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
                raise Unsupported("addmm with alpha/beta")
            bias = self.vals[args[0]] if name == "addmm" else None
            a, b = (self.vals[args[1]], self.vals[args[2]]) if name == "addmm" else (self.vals[args[0]],
                                                                                     self.vals[args[1]])
            if a.kind != "in" or len(a.shape) != 2 or self._shape(n) != self.S:
                raise Unsupported("GEMM whose left operand is computed, or whose output is not the iteration shape")
            if bias is not None and (bias.kind != "in" or bias.shape not in ((self.C,), (1, self.C))):
                raise Unsupported("GEMM bias that is not a vector")
            if b.kind == "wT":
                w, w_is_nk = b.args[0], True
            elif b.kind == "in":
                w, w_is_nk = b, False
            else:
                raise Unsupported("GEMM right operand is computed")
            self.gemm = _V("gemm", n, self.S, "gemm", (a, w, bias), value=float(w_is_nk))
            self.gemm_k = a.shape[1]
            return self.gemm
        if name in ("squeeze", "unsqueeze", "view", "reshape", "_unsafe_view", "alias", "clone", "expand",
                    "contiguous"):
            v = self.vals[args[0]]
            if v.kind == "row" or (v.kind in ("elem", "gemm") and self._shape(n) == self.S):
                return v
            raise Unsupported(f"{name} that changes the layout")
        if name == "scalar_tensor":
            return _V("const", value=float(args[0]))
        if name in ("sum", "mean", "amax", "amin", "max", "min"):
            dims = args[1] if len(args) > 1 else n.kwargs.get("dim")
            if not self._last_dim(n, dims) or n.kwargs.get("dtype") is not None:
                raise Unsupported(f"{name} over dims {dims} (only the last dimension is handled)")
            x = self.vals[args[0]]
            red = {"sum": "sum", "mean": "mean", "amax": "max", "max": "max", "amin": "min", "min": "min"}[name]
            return _V("row", n, self._shape(n), "reduce_" + red, (x,))
        if name in ("_softmax", "_log_softmax"):
            if not self._last_dim(n, args[1]):
                raise Unsupported(f"{name} over a dimension other than the last")
            x = self.vals[args[0]]
            m = _V("row", op="reduce_max", args=(x,))
            e = _V("elem", op="exp", args=(_V("elem", op="sub", args=(x, m)),))
            s = _V("row", op="reduce_sum", args=(e,))
            if name == "_softmax":
                return _V("elem", n, op="div", args=(e, s))
            return _V("elem", n, op="sub", args=(_V("elem", op="sub", args=(x, m)), _V("row", op="log", args=(s,))))
        if name == "native_layer_norm":
            x = self.vals[args[0]]
            if list(args[1]) != [self.C] or self._shape(args[0]) != self.S:
                raise Unsupported("layer norm over more than the last dimension")
            w = self.vals[args[2]] if args[2] is not None else None
            b = self.vals[args[3]] if args[3] is not None else None
            mean = _V("row", op="reduce_mean", args=(x,))
            d = _V("elem", op="sub", args=(x, mean))
            var = _V("row", op="reduce_mean", args=(_V("elem", op="mul", args=(d, d)),))
            rstd = _V("row", op="rsqrt", args=(_V("row", op="add", args=(var, _V("const", value=float(args[4])))),))
            y = _V("elem", op="mul", args=(d, rstd))
            if w is not None:
                y = _V("elem", op="mul", args=(y, w))
            if b is not None:
                y = _V("elem", op="add", args=(y, b))
            return _V("tuple", args=(y, mean, rstd))
        if name == "where":
            vs = tuple(self._arg(a) for a in args)
            return _V(self._kind(vs), n, self._shape(n), "where", vs)
        if name == "clamp" or name == "hardtanh":
            x = self._arg(args[0])
            lo = args[1] if len(args) > 1 else n.kwargs.get("min")
            hi = args[2] if len(args) > 2 else n.kwargs.get("max")
            if name == "hardtanh":
                lo, hi = (lo if lo is not None else -1.0), (hi if hi is not None else 1.0)
            v = x
            if lo is not None:
                v = _V(self._kind([x]), op="maximum", args=(v, self._arg(lo)))
            if hi is not None:
                v = _V(self._kind([x]), op="minimum", args=(v, self._arg(hi)))
            return v
        if name == "gelu":
            approx = n.kwargs.get("approximate", args[1] if len(args) > 1 else "none")
            x = self._arg(args[0])
            return _V(self._kind([x]), n, op="gelu_tanh" if approx == "tanh" else "gelu", args=(x,))
        if name == "leaky_relu":
            x = self._arg(args[0])
            slope = args[1] if len(args) > 1 else n.kwargs.get("negative_slope", 0.01)
            return _V(self._kind([x]), n, op="leaky_relu", args=(x, _V("const", value=float(slope))))
        if name in _UNARY:
            x = self._arg(args[0])
            return _V(self._kind([x]), n, op=name, args=(x,))
        if name in _BINARY:
            vs = tuple(self._arg(a) for a in args[:2])
            alpha = n.kwargs.get("alpha", 1)
            if alpha != 1:
                vs = (vs[0], _V(self._kind([vs[1]]), op="mul", args=(vs[1], _V("const", value=float(alpha)))))
            return _V(self._kind(vs), n, op=name, args=vs)
        raise Unsupported(f"op {t} is not handled by the offline generator")


class _Emitter:
    """C++ for one row program."""

    def __init__(self, plan: _Plan, tun: Tunables):
        self.p = plan
        self.t = tun
        self.names = {id(v): f"in{i}" for i, v in enumerate(plan.in_vals)}
        self.row_memo: dict[int, str] = {}
        self.row_lines: list[str] = []
        self.n = 0

    def _new(self, p: str) -> str:
        self.n += 1
        return f"{p}{self.n}"

    def index(self, v: _V) -> str:
        """Offset into an input for element (r, j) of the iteration space."""
        S, T = self.p.S, v.shape
        T = (1,) * (len(S) - len(T)) + tuple(T)
        if T == S:
            return "(r * C + j)"
        if all(t == 1 for t in T[:-1]) and T[-1] == S[-1]:
            return "j"
        terms = []
        stride = 1
        for d in range(len(S) - 1, -1, -1):
            if T[d] != 1:
                if d == len(S) - 1:
                    idx = "j"
                else:
                    inner = math.prod(S[d + 1:-1])
                    idx = f"((r / {inner}) % {S[d]})" if inner > 1 else f"(r % {S[d]})"
                terms.append(f"{idx} * {stride}")
            stride *= T[d]
        return "(" + " + ".join(terms or ["0"]) + ")"

    def scalar(self, op: str, a: list[str]) -> str:
        if op in _UNARY:
            return _UNARY[op].format(*a)
        if op in _BINARY:
            return _BINARY[op].format(*a)
        if op == "where":
            return f"({a[0]} != 0.f ? {a[1]} : {a[2]})"
        if op == "gelu":
            return f"(0.5f * {a[0]} * (1.f + erff({a[0]} * 0.70710678118654752f)))"
        if op == "gelu_tanh":
            return (f"(0.5f * {a[0]} * (1.f + tanhf(0.7978845608028654f * ({a[0]} + 0.044715f * {a[0]} * {a[0]} * "
                    f"{a[0]}))))")
        if op == "leaky_relu":
            return f"({a[0]} > 0.f ? {a[0]} : {a[0]} * {a[1]})"
        if op == "copy":
            return a[0]
        raise Unsupported(f"scalar op {op}")

    def row(self, v: _V) -> str:
        """A per-row value (emitting its loops/statements on first use)."""
        if v.kind == "const":
            return _f(v.value)
        if v.kind == "in":
            return f"{self.names[id(v)]}[{self.index(v)}]"
        if id(v) in self.row_memo:
            return self.row_memo[id(v)]
        if v.op.startswith("reduce_"):
            red = v.op[7:]
            acc = self._new("acc")
            init = {"sum": "0.f", "mean": "0.f", "max": "(-INFINITY)", "min": "INFINITY"}[red]
            body: list[str] = []
            memo: dict[int, str] = {}
            x = self.elem(v.args[0], body, memo)
            comb = {"sum": f"{acc} += {x};", "mean": f"{acc} += {x};", "max": f"{acc} = fmaxf({acc}, {x});",
                    "min": f"{acc} = fminf({acc}, {x});"}[red]
            self.row_lines.append(f"float {acc} = {init};")
            if self.t.simd:
                op = {"sum": "+", "mean": "+", "max": "max", "min": "min"}[red]
                self.row_lines.append(f"#pragma omp simd reduction({op}:{acc})")
            self.row_lines.append("for (int64_t j = 0; j < C; ++j) {")
            self.row_lines += ["  " + s for s in body] + [f"  {comb}", "}"]
            res = f"({acc} / (float)C)" if red == "mean" else acc
        else:
            res = self.scalar(v.op, [self.row(a) for a in v.args])
        name = self._new("r")
        self.row_lines.append(f"const float {name} = {res};")
        self.row_memo[id(v)] = name
        return name

    def elem(self, v: _V, body: list[str], memo: dict[int, str]) -> str:
        """A per-element value inside a j loop (statements appended to ``body``)."""
        if v.kind in ("const", "row") or (v.kind == "in" and self.p._in_kind(v) != "elem"):
            return self.row(v)
        if id(v) in memo:
            return memo[id(v)]
        if v.kind == "in":
            res = f"{self.names[id(v)]}[{self.index(v)}]"
        elif v.kind == "gemm":
            res = "gbuf[(r - rb) * C + j]"
        else:
            # Row operands first, so their loops come before this one.
            args = [self.row(a) if self._is_row(a) else None for a in v.args]
            args = [a if a is not None else self.elem(x, body, memo) for a, x in zip(args, v.args, strict=True)]
            res = self.scalar(v.op, args)
        name = self._new("e")
        body.append(f"const float {name} = {res};")
        memo[id(v)] = name
        return name

    def _is_row(self, v: _V) -> bool:
        return v.kind in ("row", "const") or (v.kind == "in" and self.p._in_kind(v) != "elem")

    def _prefetch_rows(self, v: _V, seen: set) -> None:
        """Emit every row value an elementwise expression needs before its loop starts."""
        if id(v) in seen:
            return
        seen.add(id(v))
        if self._is_row(v):
            self.row(v)
            return
        for a in v.args:
            if isinstance(a, _V):
                self._prefetch_rows(a, seen)

    def program(self) -> str:
        p, t = self.p, self.t
        outs = []
        seen: set = set()
        for o in p.outputs:
            src = o.args[0]
            if o.kind != "row":
                self._prefetch_rows(src, seen)
        body: list[str] = []
        memo: dict[int, str] = {}
        writes = []
        for k, o in enumerate(p.outputs):
            src = o.args[0]
            if o.kind == "row":
                outs.append(f"out{k}[r] = {self.row(src)};")
            else:
                writes.append(f"out{k}[r * C + j] = {self.elem(src, body, memo)};")
        lines = list(self.row_lines)
        if writes:
            if t.simd:
                lines.append("#pragma omp simd")
            lines.append("for (int64_t j = 0; j < C; ++j) {")
            lines += ["  " + s for s in body + writes] + ["}"]
        lines += outs
        return "\n".join("      " + s for s in lines)

    def gemm_block(self) -> str:
        """Rows rb..re of the GEMM into gbuf (x row · w row over K, nb columns at a time)."""
        a, w, bias = self.p.gemm.args
        xa, wa = self.names[id(a)], self.names[id(w)] if self.p.gemm.value else "bt"
        nb = self.t.nb
        b = f"{self.names[id(bias)]}[n + q]" if bias is not None else "0.f"
        simd = f"#pragma omp simd reduction(+:{', '.join(f'a{q}' for q in range(nb))})" if self.t.simd else ""
        accs = "\n".join(f"          float a{q} = 0.f;" for q in range(nb))
        dots = "\n".join(f"            a{q} += xv * {wa}[(n + {q}) * K + k];" for q in range(nb))
        stores = "\n".join(f"          gbuf[(r - rb) * C + n + {q}] = a{q} + {b.replace('q', str(q))};"
                           for q in range(nb))
        tail_b = b.replace("n + q", "n")
        return f"""      for (int64_t r = rb; r < re; ++r) {{
        const float* xr = {xa} + r * K;
        int64_t n = 0;
        for (; n + {nb} <= C; n += {nb}) {{
{accs}
          {simd}
          for (int64_t k = 0; k < K; ++k) {{
            const float xv = xr[k];
{dots}
          }}
{stores}
        }}
        for (; n < C; ++n) {{
          float acc = 0.f;
          for (int64_t k = 0; k < K; ++k) acc += xr[k] * {wa}[n * K + k];
          gbuf[(r - rb) * C + n] = acc + {tail_b};
        }}
      }}"""

    def source(self) -> str:
        p, t = self.p, self.t
        params = ", ".join([f"const float* __restrict__ in{i}" for i in range(len(p.inputs))]
                           + [f"float* __restrict__ out{k}" for k in range(len(p.outputs))])
        prog = self.program()
        par = f"#pragma omp parallel if ((int64_t)R * C >= {t.parallel_min})"
        head = f"""#include <cmath>
#include <cstdint>
#include <vector>
// generated by hetforge kforge offline provider; tunables: {t.key()}
static constexpr int64_t R = {p.R}, C = {p.C};
extern "C" void kforge_kernel({params}) {{
"""
        if p.gemm is None:
            return head + f"""  {par}
  {{
    #pragma omp for schedule({t.schedule})
    for (int64_t r = 0; r < R; ++r) {{
      const int64_t rb = r; (void)rb;
{prog}
    }}
  }}
}}
"""
        a, w, _ = p.gemm.args
        K = p.gemm_k
        head = head.replace("C = ", f"K = {K}, C = ")
        pack = ""
        if not p.gemm.value:  # B is [K, N]: pack it as [N, K] once per call so dot products are contiguous
            pack = f"""  std::vector<float> btv((size_t)C * {K});
  float* bt = btv.data();
  const float* bsrc = {self.names[id(w)]};
  #pragma omp parallel for if ((int64_t)C * {K} >= {t.parallel_min})
  for (int64_t n = 0; n < C; ++n)
    for (int64_t k = 0; k < {K}; ++k) bt[n * {K} + k] = bsrc[k * C + n];
"""
        return head + pack + f"""  {par}
  {{
    std::vector<float> gv((size_t){t.mb} * C);
    float* gbuf = gv.data();
    #pragma omp for schedule({t.schedule})
    for (int64_t rb = 0; rb < R; rb += {t.mb}) {{
      const int64_t re = rb + {t.mb} < R ? rb + {t.mb} : R;
{self.gemm_block()}
      for (int64_t r = rb; r < re; ++r) {{
{prog}
      }}
    }}
  }}
}}
"""


def capture(problem: Problem):
    """The problem's Model exported and decomposed to core ATen, with its init arguments."""
    mod = problem.load()
    init = list(mod.get_init_inputs())
    torch.manual_seed(0)
    model = mod.Model(*init).eval()
    xs = tuple(mod.get_inputs())
    try:
        ep = torch.export.export(model, xs).run_decompositions()
    except Exception as e:
        raise Unsupported(f"torch.export failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    return ep


def generate(problem: Problem, tun: Tunables, ep=None) -> str:
    """A complete candidate file (``ModelNew`` + a load_inline'd C++/OpenMP kernel) for the problem."""
    ep = ep if ep is not None else capture(problem)
    plan = _Plan(ep)
    cpp = _Emitter(plan, tun).source()
    flags = ["-O3", "-fopenmp", "-march=native", "-fno-math-errno"] + (["-ffast-math"] if tun.fast_math else [])
    name = "kf_" + hashlib.sha256((cpp + " ".join(flags)).encode()).hexdigest()[:16]
    params = [(fqn, shape) for (_, fqn, shape) in plan.inputs if not fqn.isdigit()]
    order = [f"xs[{fqn}]" if fqn.isdigit() else f"self.get_parameter({fqn!r})" for (_, fqn, _) in plan.inputs]
    shapes = [list(shape) for (_, _, shape) in plan.inputs]
    out_shapes = [list(o.shape) for o in plan.outputs]
    return f'''"""KForge offline candidate for {problem.name}: one fused C++/OpenMP kernel (tunables: {tun.key()}).

Parameters are created with the reference's names and shapes; the harness loads the reference's values.
"""

import ctypes

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CPP = r"""
{cpp}"""

_LIB = ctypes.CDLL(load_inline({name!r}, cpp_sources=CPP, extra_cflags={flags!r}, extra_ldflags=["-fopenmp"],
                               is_python_module=False, no_implicit_headers=True))
_LIB.kforge_kernel.restype = None
IN_SHAPES = {shapes!r}
OUT_SHAPES = {out_shapes!r}


class ModelNew(nn.Module):
    def __init__(self, *init_inputs):
        super().__init__()
        for fqn, shape in {params!r}:
            *path, leaf = fqn.split(".")
            m = self
            for p in path:
                if not hasattr(m, p):
                    m.add_module(p, nn.Module())
                m = getattr(m, p)
            m.register_parameter(leaf, nn.Parameter(torch.zeros(shape)))

    def forward(self, *xs):
        ins = [t.contiguous() for t in ({", ".join(order)}{"," if len(order) == 1 else ""})]
        for t, s in zip(ins, IN_SHAPES):
            if list(t.shape) != s or t.dtype != torch.float32:
                raise ValueError(f"kernel built for shape {{s}} float32, got {{list(t.shape)}} {{t.dtype}}")
        outs = [torch.empty(s) for s in OUT_SHAPES]
        _LIB.kforge_kernel(*[ctypes.c_void_p(t.data_ptr()) for t in ins + outs])
        return outs[0] if len(outs) == 1 else tuple(outs)
'''


SEARCH_ORDER = {
    # knob → candidate values tried in order (the analysis agent's advice names knobs)
    "fast_math": [True],
    "nb": [8, 2],
    "mb": [16, 4, 32],
    "simd": [False],
    "parallel_min": [1 << 62, 1 << 12],
    "schedule": ["dynamic"],
}


GEMM_KNOBS = ("mb", "nb")


def has_gemm(ep) -> bool:
    return any(str(n.target) in ("aten.mm.default", "aten.addmm.default") for n in ep.graph.nodes)


def next_tunables(tried: list[Tunables], best: Tunables, knobs: list[str], gemm: bool = True) -> Tunables | None:
    """The next untried setting: turn the advised knobs first (from the best so far), then any other that applies."""
    order = list(dict.fromkeys(list(knobs) + list(SEARCH_ORDER)))
    for knob in [k for k in order if k in SEARCH_ORDER and (gemm or k not in GEMM_KNOBS)]:
        for v in SEARCH_ORDER.get(knob, []):
            t = replace(best, **{knob: v})
            if t not in tried:
                return t
    return None
