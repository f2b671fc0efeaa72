"""Property checks at scale: random decoder-like models through the whole compiler, compared with eager.

:func:`draw` / :func:`build` make a small decoder from a seed (embedding, 1–3 blocks of norm → attention →
residual → norm → MLP → residual, final norm, LM head), varying what the passes and the backend must handle:
RMSNorm or LayerNorm, SDPA or hand-written attention (scale by multiply or divide, causal mask or none), one
to four heads with grouped K/V, rotary or learned positions, gated-SiLU or GELU/ReLU MLPs with or without
bias, a tied or separate head, sequence 1–6, batch 1–2. :func:`check_model` captures it with
``torch.export`` and runs the middle-end passes once, then for several random placements (every node on a random
device of a three-device SoC, so lowering inserts transfers; copies on the 155H, zero-copy on the Orin)
lowers, schedules and plans memory (the program verifier runs after each), saves and reloads the program
(the verifier re-checks its saved arena offsets), executes it and compares the logits with the eager model.

Everything is determined by the seeds, so a failure is reproduced with ``check_model(seed, placements)``.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

SOC = "intel-core-ultra-155h"  # cpu + gpu + npu: random placements need transfers (copies, not zero-copy)
UNIFIED_SOC = "jetson-agx-orin"  # unified memory: transfers become zero-copy aliases


@dataclass
class DecoderSpec:
    """What one seed draws."""

    seed: int
    vocab: int
    dim: int
    heads: int
    kv_heads: int
    layers: int
    norm: str  # rms | layer
    attn: str  # sdpa | manual-mul | manual-div
    causal: bool
    positions: str  # rotary | learned
    mlp: str  # gated-silu | gelu | relu | gelu-tanh
    bias: bool
    tied: bool
    batch: int
    seq: int
    soc: str


def draw(seed: int) -> DecoderSpec:
    """The decoder a seed stands for."""
    r = random.Random(seed)
    heads = r.choice([1, 2, 4])
    dim = heads * r.choice([4, 8])
    return DecoderSpec(
        seed=seed, vocab=r.choice([16, 32, 61]), dim=dim, heads=heads,
        kv_heads=r.choice([h for h in (1, 2, 4) if heads % h == 0]), layers=r.choice([1, 1, 2, 3]),
        norm=r.choice(["rms", "layer"]), attn=r.choice(["sdpa", "manual-mul", "manual-div"]),
        causal=r.random() < 0.8, positions=r.choice(["rotary", "learned"]),
        mlp=r.choice(["gated-silu", "gelu", "relu", "gelu-tanh"]), bias=r.random() < 0.5, tied=r.random() < 0.3,
        batch=r.choice([1, 1, 2]), seq=r.choice([1, 2, 3, 5, 6]), soc=UNIFIED_SOC if r.random() < 0.25 else SOC)


class _Norm(nn.Module):
    def __init__(self, kind: str, dim: int):
        super().__init__()
        self.kind = kind
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)
        self.bias = nn.Parameter(torch.randn(dim) * 0.1) if kind == "layer" else None

    def forward(self, x):
        if self.kind == "layer":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, 1e-5)
        v = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(v + 1e-6))


def _rotate(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class _Block(nn.Module):
    def __init__(self, s: DecoderSpec):
        super().__init__()
        self.s = s
        hd = s.dim // s.heads
        self.n1, self.n2 = _Norm(s.norm, s.dim), _Norm(s.norm, s.dim)
        self.q = nn.Linear(s.dim, s.dim, bias=s.bias)
        self.k = nn.Linear(s.dim, s.kv_heads * hd, bias=s.bias)
        self.v = nn.Linear(s.dim, s.kv_heads * hd, bias=s.bias)
        self.o = nn.Linear(s.dim, s.dim, bias=s.bias)
        hidden = 2 * s.dim
        self.up = nn.Linear(s.dim, hidden, bias=s.bias)
        self.gate = nn.Linear(s.dim, hidden, bias=False) if s.mlp == "gated-silu" else None
        self.down = nn.Linear(hidden, s.dim, bias=s.bias)

    def attention(self, x, cos, sin):
        s = self.s
        b, t, _ = x.shape
        hd = s.dim // s.heads
        q = self.q(x).view(b, t, s.heads, hd).transpose(1, 2)
        k = self.k(x).view(b, t, s.kv_heads, hd).transpose(1, 2)
        v = self.v(x).view(b, t, s.kv_heads, hd).transpose(1, 2)
        if cos is not None:
            q, k = q * cos + _rotate(q) * sin, k * cos + _rotate(k) * sin
        if s.kv_heads != s.heads:
            k = k.repeat_interleave(s.heads // s.kv_heads, dim=1)
            v = v.repeat_interleave(s.heads // s.kv_heads, dim=1)
        if s.attn == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=s.causal and t > 1)
        else:
            w = q @ k.transpose(-1, -2)
            w = w * (1.0 / math.sqrt(hd)) if s.attn == "manual-mul" else w / math.sqrt(hd)
            if s.causal:
                w = w + torch.triu(torch.full((t, t), float("-inf")), 1)
            y = torch.softmax(w, dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, t, s.dim))

    def mlp(self, x):
        s = self.s
        if s.mlp == "gated-silu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        h = self.up(x)
        h = F.relu(h) if s.mlp == "relu" else F.gelu(h, approximate="tanh" if s.mlp == "gelu-tanh" else "none")
        return self.down(h)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.n1(x), cos, sin)
        return x + self.mlp(self.n2(x))


class RandomDecoder(nn.Module):
    """``input_ids [batch, seq] -> logits [batch, seq, vocab]`` for one :class:`DecoderSpec`."""

    def __init__(self, s: DecoderSpec):
        super().__init__()
        self.s = s
        self.embed = nn.Embedding(s.vocab, s.dim)
        self.pos = nn.Embedding(8, s.dim) if s.positions == "learned" else None
        self.blocks = nn.ModuleList(_Block(s) for _ in range(s.layers))
        self.norm = _Norm(s.norm, s.dim)
        self.head = nn.Linear(s.dim, s.vocab, bias=False)
        if s.tied:
            self.head.weight = self.embed.weight
        hd = s.dim // s.heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(8).float(), inv)
        self.register_buffer("cos", torch.cat((ang.cos(), ang.cos()), -1), persistent=False)
        self.register_buffer("sin", torch.cat((ang.sin(), ang.sin()), -1), persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.embed(ids)
        cos = sin = None
        if self.pos is not None:
            x = x + self.pos(torch.arange(t))
        else:
            cos, sin = self.cos[:t], self.sin[:t]
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.head(self.norm(x))


def build(seed: int) -> tuple[RandomDecoder, tuple[torch.Tensor]]:
    """The seeded model (weights from ``torch.manual_seed(seed)``) and its input ids."""
    s = draw(seed)
    torch.manual_seed(seed)
    model = RandomDecoder(s).eval()
    ids = torch.randint(0, s.vocab, (s.batch, s.seq), generator=torch.Generator().manual_seed(seed))
    return model, (ids,)


def random_placement(gm: torch.fx.GraphModule, devices: list[str], seed: int):
    """Every compute node on a device drawn at random (so transfers appear between any two devices)."""
    from hetforge.placement import Placement

    r = random.Random(seed ^ 0x5EED)
    return Placement("random", {n.name: r.choice(devices) for n in gm.graph.nodes if n.op == "call_function"})


@dataclass
class GraphResult:
    """One compiled program's outcome: ``ok`` when its logits match eager within fp32 tolerance."""

    seed: int  # the model
    placement: int  # the random placement of that model
    ok: bool
    max_abs_err: float
    instructions: int
    transfers: int
    devices_used: int
    mode: str
    seconds: float
    error: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


TOLERANCE = (2e-5, 2e-4)  # atol, rtol: fp32 reassociation inside fused ops


def _fail(seed: int, k: int, mode: str, t0: float, e: Exception) -> GraphResult:
    return GraphResult(seed, k, False, float("nan"), 0, 0, 0, mode, time.perf_counter() - t0,
                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def check_model(seed: int, placements: int = 1) -> list[GraphResult]:
    """Capture seed's decoder and run the middle-end passes once, then for each of ``placements`` random placements
    compile it (lowering, scheduling, memory plan, each verified; arena or fast executor mode alternately),
    save and reload the program (the verifier re-checks the saved arena offsets), run it and compare its logits
    with eager. An exception anywhere is a failed graph, recorded with its text; nothing is raised."""
    from hetforge.compile import compile_graph
    from hetforge.frontend import capture
    from hetforge.hardware import load_soc
    from hetforge.ir.serialize import program_from_dict, program_to_dict
    from hetforge.passes import optimize

    t0 = time.perf_counter()
    s = draw(seed)
    try:
        model, inputs = build(seed)
        cg = capture(model, inputs, name=f"rand{seed}")
        opt = optimize(cg.gm, inputs)
        soc = load_soc(s.soc)
        with torch.no_grad():
            want = model(*inputs)
    except Exception as e:  # noqa: BLE001  (any failure of any stage is the finding)
        return [_fail(seed, k, "-", t0, e) for k in range(placements)]
    out = []
    for k in range(placements):
        t1 = time.perf_counter()
        mode = "arena" if k % 2 == 0 else "fast"
        try:
            res = compile_graph(opt.gm, soc=soc, example_inputs=inputs, passes=False, name=f"rand{seed}",
                                mode=mode, placement=random_placement(opt.gm, soc.device_names, seed * 1000 + k))
            program_from_dict(program_to_dict(res.program), opt.gm, label=f"rand{seed}/{k}")  # verify at load
            with torch.no_grad():
                got = res.executable(*inputs)
            got = got[0] if isinstance(got, (tuple, list)) else got
            same_shape = tuple(got.shape) == tuple(want.shape)
            err = float((got - want).abs().max()) if same_shape else float("inf")
            ok = same_shape and bool(torch.allclose(got, want, atol=TOLERANCE[0], rtol=TOLERANCE[1]))
            p = res.program
            out.append(GraphResult(seed, k, ok, err, len(p.instrs), len(p.transfers()),
                                   len({i.device for i in p.instrs if i.kind != "transfer"}), mode,
                                   time.perf_counter() - t1, "" if ok else f"logits differ: max |err| {err:.3g}"))
        except Exception as e:  # noqa: BLE001
            out.append(_fail(seed, k, mode, t1, e))
    return out
