"""The two programs per model (prefill per prompt tier, decode per cache length), compiled once and cached.

A program is made on first use: capture the static-shape module with ``torch.export``, run the
optimization passes, then hand the graph to an :class:`Executor`.
Each step is timed (measured) and kept on the :class:`Program`.

Capture policy (``capture=`` or ``HETFORGE_CAPTURE``): ``stamped`` (the default) exports the module with two of
the model's decoder layers and stamps layer 1 out to the others (:mod:`hetforge.runtime.stamp`: the same graph as
a whole export, at a fraction of the tracing), and exports the whole module where the layers are not uniform;
``static`` exports each program's module whole at its own shape; ``dynamic`` exports each module once with a
dynamic length (the prompt tier of prefill, the cache length of decode: ``torch.export.Dim.DYNAMIC``) and makes
every program of that module by specialising that one capture to its shape (:func:`hetforge.frontend.specialize`:
shape propagation, no second trace). A dynamic export costs several static ones and a specialisation a fraction
of one, so one dynamic capture only pays after several shapes of one module, while a first prefill + decode pair
needs one shape of each (the measured ratios, and when they were measured: docs/arch/runtime.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hetforge.frontend import gc_frozen
from hetforge.runtime.executors import Executor, PlacedExecutor, StepBinding
from hetforge.runtime.kvcache import KVCache
from hetforge.runtime.model_check import check_against_model
from hetforge.runtime.static_kv import ChunkModule, DecodeModule, PrefillModule, model_dims

TIERS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CHUNK_MIN = 16  # the smallest chunk of a chunked prefill (a shorter remainder is padded to it)
CALL_TOKENS = 8  # what one more program call is taken to cost, in prompt tokens of work (an estimate: one more
# pass over the weights and the per-call overhead; bench/ttft.py measures the resulting choice against the tier)


CAPTURE_POLICIES = ("stamped", "static", "dynamic")


def capture_policy(given: str | None = None) -> str:
    """``given``, else ``HETFORGE_CAPTURE``, else ``stamped``; an unknown name is a usage error."""
    import os

    from hetforge.errors import UsageError

    p = (given or os.environ.get("HETFORGE_CAPTURE") or "stamped").strip().lower()
    if p not in CAPTURE_POLICIES:
        raise UsageError(f"capture policy '{p}' (HETFORGE_CAPTURE): allowed {', '.join(CAPTURE_POLICIES)}")
    return p


def policy_capture() -> Callable[[nn.Module, tuple, str], Any] | None:
    """The capture :func:`capture_policy` asks a static-shape compile for: ``stamped`` (the default),
    :func:`hetforge.runtime.stamp.capture_layers` deferred (two layers exported, the rest stamped out after the
    passes); None (the caller exports the whole module) for ``static`` or ``dynamic`` (one static shape is
    compiled either way)."""
    import functools

    from hetforge.runtime.stamp import capture_layers

    return functools.partial(capture_layers, defer=True) if capture_policy() == "stamped" else None


def tiers_for(max_positions: int) -> tuple[int, ...]:
    """The static lengths used for a model: the standard tiers up to its maximum context, plus that maximum."""
    ts = [t for t in TIERS if t < max_positions]
    return (*ts, max_positions)


def pick_tier(n: int, tiers: Sequence[int]) -> int:
    """The smallest tier that holds ``n`` (callers check ``n`` against the largest first)."""
    return next(t for t in tiers if t >= n)


@dataclass(frozen=True)
class Piece:
    """One program call of a prompt's prefill: ``size`` tokens (``real`` of them prompt tokens) from ``start``;
    ``kind`` is ``prefill`` (a prefill program of ``size`` tokens — a fine length or a tier — first piece only) or
    ``chunk`` (attends to the cache too)."""

    kind: str
    start: int
    size: int
    real: int


PREFILL_MODES = ("fine", "chunked", "tier")
FINE_PER_OCTAVE = 8  # prefill lengths per power of two (fine mode): a prompt pads by at most 1/8 of its length
# from 64 tokens on, and by at most FINE_MIN - 1 tokens below
FINE_MIN = 8  # the finest step (and the shortest fine prefill program)
KEEP_PREFILL = 8  # prefill programs a ProgramCache keeps in memory (least recently used dropped first)


def fine_length(n: int, tiers: Sequence[int]) -> int:
    """The fine prefill length of an ``n``-token prompt: ``n`` rounded up to a step of 1/:data:`FINE_PER_OCTAVE` of
    the power of two below it (at least :data:`FINE_MIN`), never past the tier that holds ``n``.

    Why: a prefill program's time grows with its rows, and one call reads every weight once; padding to the next
    power-of-two tier costs up to 2x the rows, chunking costs a weight pass per extra call. Eight lengths per
    octave bound the pad to 1/8 (e.g. 84 -> 88, 500 -> 512) while a program is still compiled once per length
    (and kept in the compile cache), not once per prompt."""
    octave = 1 << (max(n - 1, 1).bit_length() - 1)  # the power of two below n
    step = max(FINE_MIN, octave // FINE_PER_OCTAVE)
    return min(-(-n // step) * step, pick_tier(n, tiers))


def check_prefill_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`PREFILL_MODES`; else a usage error naming them."""
    from hetforge.errors import UsageError

    if mode not in PREFILL_MODES:
        raise UsageError(f"prefill mode '{mode}': allowed {', '.join(PREFILL_MODES)}")
    return mode


def prefill_pieces(n: int, tiers: Sequence[int], mode: str = "fine") -> list[Piece]:
    """How a prompt of ``n`` tokens is prefilled, by ``mode`` (one of :data:`PREFILL_MODES`):

    * ``fine``: one call of a prefill program :func:`fine_length` long (the default of the engine);
    * ``tier``: one call of the smallest tier that holds it;
    * ``chunked``: the largest tier ``<= n`` and the rest in power-of-two chunks over the cache (the rest rounded
      up to :data:`CHUNK_MIN`), when that is less work than the tier: padded tokens plus :data:`CALL_TOKENS` per
      extra call. Fewer programs than ``fine`` (tiers and power-of-two chunks only), more calls.

    Any other mode is a usage error (it used to be taken as ``chunked``)."""
    check_prefill_mode(mode)
    if mode == "fine":
        return [Piece("prefill", 0, fine_length(n, tiers), n)]
    whole = [Piece("prefill", 0, pick_tier(n, tiers), n)]
    if mode == "tier":
        return whole
    base = max((t for t in tiers if t <= n), default=0)
    rest = -(-(n - base) // CHUNK_MIN) * CHUNK_MIN
    pieces = [Piece("prefill", 0, base, base)] if base else []
    start = base
    while rest:
        size = 1 << (rest.bit_length() - 1)  # the largest power of two in what is left (a multiple of 16)
        pieces.append(Piece("chunk", start, size, min(size, n - start)))
        start, rest = start + size, rest - size
    work = sum(p.size for p in pieces) + CALL_TOKENS * (len(pieces) - 1)
    return pieces if work < whole[0].size else whole


@dataclass
class Program:
    """One compiled static-shape program and what making it cost (measured seconds)."""

    kind: str  # "prefill", "decode" or "chunk" (chunked prefill over the cache)
    length: int  # prompt tier (prefill) or KV cache length (decode)
    run: Callable[..., Sequence[torch.Tensor]]
    executor: str
    nodes: int
    capture_s: float
    optimize_s: float
    compile_s: float  # the rest of the wall time of making it (total_s is what its caller waited; a child's wait
    # and start are in the decode program's, see ProgramCache.decode)
    notes: list[str] = field(default_factory=list)
    placed: Any = None  # executors.Placed for placed programs (partitions, bindings, the latest RunReport)
    child_s: float | None = None  # built by a forked child alongside another program: its own seconds (ahead.py)

    @property
    def total_s(self) -> float:
        return self.capture_s + self.optimize_s + self.compile_s

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "length": self.length, "executor": self.executor, "nodes": self.nodes,
             "capture_s": round(self.capture_s, 4), "optimize_s": round(self.optimize_s, 4),
             "compile_s": round(self.compile_s, 4), "total_s": round(self.total_s, 4), "notes": self.notes}
        if self.placed is not None:
            d["placement"] = self.placed.to_dict()
        return d


def _prepack(placed: Any) -> bool:
    """Pack the weights into the GEMM kernels' layouts for every host partition of a placed program
    (:meth:`Executable.prepack`); returns whether every partition is such a generated executable (then no one-time
    work is left for the first call: its packing is done, and nothing else in it runs only once)."""
    comps = list(getattr(getattr(placed, "exe", None), "compiled", ()))
    done = [c for c in comps if getattr(c, "executable", None) is not None]
    for comp in done:
        comp.executable.prepack()
    return bool(comps) and len(done) == len(comps)


class ProgramCache:
    """Prefill and decode programs of one model, made on first use and kept in memory."""

    def __init__(self, model: nn.Module, max_positions: int, executor: Executor, optimize: bool = True,
                 capture: str | None = None):
        self.model = model.eval()
        self.max_positions = max_positions
        self.tiers = tiers_for(max_positions)
        self.executor = executor
        self.optimize = optimize
        self.layers, self.kv_heads, self.head_dim = model_dims(model)
        self.dtype = model.get_input_embeddings().weight.dtype
        self.programs: dict[tuple[str, int], Program] = {}
        self.caches: dict[int, KVCache] = {}
        self.fixed: dict[tuple[str, int], dict] | None = None  # from a generation plan (runtime.genplan)
        self.fixed_source = ""
        self.capture_policy = capture_policy(capture)
        self.dynamic: dict[str, Any] = {}  # module kind → its one dynamic capture (capture policy "dynamic")
        self.ahead: dict[tuple[str, int], Any] = {}  # programs being built in a forked child (runtime.ahead)
        self.disk_cache = True  # use the compile cache on disk (off: every program compiled here, e.g. for a report)
        self.joined: dict[tuple[str, int], tuple] = {}  # their children's reports once waited for
        self.checked = False  # the modules' logits compared with the model's own (model_check.check_against_model)

    def cache(self, length: int) -> KVCache:
        """The preallocated KV cache of ``length`` positions (made once, reused by later requests)."""
        if length not in self.caches:
            self.caches[length] = KVCache(self.layers, self.kv_heads, length, self.head_dim, self.dtype)
        return self.caches[length]

    def prefill(self, tier: int) -> tuple[Program, bool]:
        """The prefill program of ``tier`` tokens (a tier or a fine length); the flag says whether it was compiled by
        this call."""
        key = ("prefill", tier)
        if key in self.programs:
            self.programs[key] = self.programs.pop(key)  # most recently used last (keep_prefill's order)
            return self.programs[key], False
        inputs = (torch.zeros((1, tier), dtype=torch.long), torch.tensor([tier - 1]))
        self.programs[key] = self._make("prefill", tier, PrefillModule(self.model), inputs)
        self._keep_prefill()
        return self.programs[key], True

    def _keep_prefill(self) -> None:
        """Keep at most :data:`KEEP_PREFILL` prefill programs in memory, dropping the least recently used (not the
        newest): each holds its arena and executor, and fine prefill makes up to 8 lengths per power of two. A
        dropped program comes back from the compile cache on disk when asked for again."""
        held = [k for k in self.programs if k[0] == "prefill"]
        for k in held[:max(0, len(held) - KEEP_PREFILL)]:
            del self.programs[k]

    def _decode_args(self, length: int) -> tuple[nn.Module, tuple]:
        cache = self.cache(length)
        inputs = (torch.zeros((1, 1), dtype=torch.long), torch.zeros((1, 1), dtype=torch.long), *cache.buffers)
        return DecodeModule(self.model), inputs

    def _decode_step(self, inputs: tuple) -> StepBinding | None:
        """A decode program's binding: its caller (runtime.engine) copies the K/V rows out and samples before the next
        step, and passes this cache's buffers (inputs 2..) every step."""
        return StepBinding({i: t for i, t in enumerate(inputs) if i >= 2}) \
            if isinstance(self.executor, PlacedExecutor) else None

    def decode(self, length: int) -> tuple[Program, bool]:
        """The decode program over a KV cache of ``length`` positions (waiting for :meth:`decode_ahead`'s child
        when one builds it: the wait counts in its compile time)."""
        key = ("decode", length)
        if key in self.programs:
            return self.programs[key], False
        module, inputs = self._decode_args(length)
        self.join_ahead(key)
        joined = self.joined.pop(key, None)
        step = self._decode_step(inputs)
        if joined is None:
            self.programs[key] = self._make("decode", length, module, inputs, step=step)
            return self.programs[key], True
        _, own, err, waited = joined  # waited: starting the child and waiting for it
        prog = self._make("decode", length, module, inputs, step=step)
        prog.compile_s += waited  # what the user waited for the child counts as this program's compilation
        if any(n.startswith("compile cache: hit") for n in prog.notes):
            prog.child_s = own
            prog.notes.insert(0, f"built and stored in the compile cache by a forked child process while the prefill "
                                 f"program was built ({own:.3f} s of its own, measured); starting it and waiting for "
                                 f"it took {waited:.3f} s, counted in compile_s")
        else:
            prog.notes.insert(0, f"the forked child building this program {err or 'stored no entry'}"
                                 f" (starting it and waiting took {waited:.3f} s, counted in compile_s); built here "
                                 "instead")
        self.programs[key] = prog
        return prog, True

    def join_ahead(self, key: tuple[str, int] | None = None) -> None:
        """Wait for the child building ``key`` (every child when None); its report waits in ``joined``."""
        for k in [key] if key is not None else list(self.ahead):
            job = self.ahead.get(k)
            if job is not None:
                ok, own, err, waited = job.join()  # an interrupted join stops the child itself
                self.joined[k] = (ok, own, err, waited + job.start_s)
                del self.ahead[k]

    def cancel_ahead(self) -> None:
        """Stop every child still building a program (the request that wanted them failed or was interrupted)."""
        while self.ahead:
            self.ahead.popitem()[1].cancel()

    def decode_ahead(self, length: int) -> str:
        """Start building the decode program of ``length`` in a forked child (:mod:`hetforge.runtime.ahead`);
        returns why not, or "" when it started (or the program is already built, cached on disk or on its way)."""
        from hetforge.runtime import ahead, compile_cache

        key = ("decode", length)
        if key in self.programs or key in self.ahead:
            return ""
        t0 = time.perf_counter()
        why = ahead.refusal(self)
        if why:
            return why
        module, inputs = self._decode_args(length)
        if compile_cache.entry_exists(self, "decode", length, module, inputs):
            return ""

        def build() -> bool:
            prog = self._make("decode", length, module, inputs, warm=False, step=self._decode_step(inputs))
            return any(n.startswith("compile cache: stored") for n in prog.notes)

        job = ahead.start(build)
        if job is None:
            return "fork() failed"
        job.start_s = time.perf_counter() - t0  # the checks, freeing and fork: counted in the decode program's time
        self.ahead[key] = job
        return ""

    def chunk(self, size: int, length: int) -> tuple[Program, bool]:
        """The chunked-prefill program: ``size`` prompt tokens over a KV cache of ``length`` positions."""
        key = (f"chunk-{size}", length)
        if key in self.programs:
            return self.programs[key], False
        cache = self.cache(length)
        inputs = (torch.zeros((1, size), dtype=torch.long), torch.arange(size).unsqueeze(0),
                  torch.tensor([size - 1]), *cache.buffers)
        prog = self._make("chunk", length, ChunkModule(self.model), inputs, label=f"chunk-{size}x{length}")
        self.programs[key] = prog
        return prog, True

    def decode_batch(self, length: int, batch: int) -> tuple[Program, bool]:
        """The decode program over ``batch`` rows of a KV cache of ``length`` positions (runtime.batched);
        batch 1 is the ordinary decode program."""
        if batch == 1:
            return self.decode(length)
        from hetforge.runtime.batched import BatchedDecodeModule, BatchKVCache

        key = (f"decode-x{batch}", length)
        if key in self.programs:
            return self.programs[key], False
        if self.fixed is not None:
            from hetforge.runtime.genplan import GenPlanError

            raise GenPlanError(f"plan '{self.fixed_source}' holds batch-1 programs only; several candidates need "
                               f"a batch-{batch} decode program (run without --plan)")
        cache = BatchKVCache.for_model(self.model, length, batch)
        inputs = (torch.zeros((batch, 1), dtype=torch.long), torch.zeros((batch, 1), dtype=torch.long),
                  *cache.buffers)
        prog = self._make("decode", length, BatchedDecodeModule(self.model), inputs, label=f"decode-{length}x{batch}")
        self.programs[key] = prog
        return prog, True

    @gc_frozen()  # hetforge.frontend: no full garbage collection over the whole process while compiling
    def _make(self, kind: str, length: int, module: nn.Module, inputs: tuple, label: str = "",
              warm: bool = True, step: StepBinding | None = None) -> Program:
        label = label or f"{kind}-{length}"
        t_in = time.perf_counter()  # a program's seconds are the wall time of making it (less a child's wait)
        entry = None
        if self.fixed is not None:
            from hetforge.runtime.genplan import GenPlanError, missing_message

            entry = self.fixed.get((kind, length))
            if entry is None:
                raise GenPlanError(missing_message(self.fixed, self.fixed_source, kind, length))
        store, cache_notes = None, []
        if entry is None:  # the compile cache on disk (hetforge.runtime.compile_cache)
            from hetforge.runtime.compile_cache import cached_build

            hit, store, cache_notes = cached_build(self, kind, length, module, inputs, step)
            if hit is not None:
                b = hit
                if getattr(self.executor, "quantize", "none") == "w8a8":
                    # FBGEMM packs each w8a8 weight on one thread; on a hit nothing has packed them, and the first
                    # request would pack them one by one, in its time to first token: here they are packed on
                    # every thread at once, counted in compile_s (docs/arch/quant.md has the figures)
                    t_pack = time.perf_counter()
                    _prepack(b.placed)
                    b.notes.append(f"weights packed in {time.perf_counter() - t_pack:.3f} s (measured; FBGEMM's "
                                   "packings on every thread), counted in compile_s")
                return Program(kind, length, b.run, self.executor.name, b.nodes, 0.0, 0.0,
                               time.perf_counter() - t_in, b.notes, b.placed)
        checked = []
        if not self.checked and kind != "decode":  # once, before the first prompt program is compiled
            t_check = time.perf_counter()
            rel = check_against_model(self.model)
            self.checked = True
            checked.append(f"generation modules checked against {type(self.model).__name__}'s own forward on a "
                           f"short prompt: max |Δ| {rel:.1e} of the largest logit, "
                           f"{time.perf_counter() - t_check:.3f} s (measured)")
        # the passes on two layers, the rest stamped after them, where the executor compiles through compile_graph
        defer = entry is None and isinstance(self.executor, PlacedExecutor)
        cg = self._capture(module, inputs, label, kind, length, defer)
        if entry is None:
            b = (self.executor.build(cg.gm, inputs, label, self.optimize, expand=cg.deferred, step=step) if defer
                 else self.executor.build(cg.gm, inputs, label, self.optimize))
            b.notes[:0] = cache_notes
            if store is not None:
                store(b)
        else:
            b = self._build_fixed(cg.gm, inputs, label, entry, step)
        if cg.deferred is not None:
            cg.note = cg.deferred.note()
        if cg.note:
            b.notes.insert(0, cg.note)
        t0 = time.perf_counter()
        t_pack = 0.0
        call = warm
        if warm:  # packing the weights writes only new pages, so it is done while a forked child still runs
            packed = _prepack(b.placed)
            t_pack = time.perf_counter() - t0
            # a warm-up call pays what else runs once (e.g. FBGEMM's prepacking of a quantized product); a program
            # of generated executables only, not quantized, has none left: its first call runs at the speed of the
            # later ones (docs/arch/runtime.md), and a call here would be one more prefill for the user to wait for
            call = not (packed and getattr(self.executor, "quantize", "none") in (None, "none"))
            if call and self.ahead:  # a forked child shares this process's pages until it exits: every page the
                self.join_ahead()  # warm-up call writes would be copied first (copy-on-write), so wait for it
        t1 = time.perf_counter()  # the wait counts in the child's program (ProgramCache.decode), not in this one
        if call:
            b.run(*inputs)
        t2 = time.perf_counter()
        warm_s = t_pack + t2 - t1
        # the rest of the wall time (the compile cache's lookup and store, what the stages leave between them);
        # counted too, so a program's seconds are what its caller waited for it
        rest = max(0.0, (t2 - t_in) - (t1 - t0 - t_pack) - (cg.seconds + b.optimize_s + b.compile_s + warm_s))
        head = (f"warm-up call {warm_s:.3f} s (measured, with the packing), counted in compile_s" if call else
                f"weights packed in {warm_s:.3f} s (measured), counted in compile_s; no warm-up call (nothing else "
                "runs once)" if warm else "no warm-up call (built for another process)")
        notes = [*b.notes, *checked, head,
                 f"other compile-path work {rest:.3f} s (measured: compile-cache lookup and store, the check against "
                 "the model, between the stages), counted in compile_s"]
        return Program(kind, length, b.run, self.executor.name, b.nodes, cg.seconds, b.optimize_s,
                       b.compile_s + warm_s + rest, notes, b.placed)

    def _capture(self, module: nn.Module, inputs: tuple, label: str, kind: str, length: int, defer: bool = False):
        """The static graph of ``module`` at ``inputs``' shapes: two layers exported and stamped out (policy
        ``stamped``, whole where the layers are not uniform; with ``defer``, stamped after the passes:
        :class:`hetforge.runtime.stamp.Deferred`), its own export (policy ``static``), or the module's one dynamic
        export specialised to them (policy ``dynamic``); capture seconds are measured."""
        from hetforge.frontend import capture, specialize

        if self.capture_policy == "stamped":
            from hetforge.runtime.stamp import capture_layers

            return capture_layers(module, inputs, label, defer=defer)
        if self.capture_policy == "static":
            return capture(module, inputs, name=label, stack_traces=False, guards=False)
        dyn_key = f"{type(module).__qualname__}:{inputs[0].shape[0]}"  # one per module and batch size
        t0 = time.perf_counter()
        made = dyn_key not in self.dynamic
        if made:
            from torch.export import Dim

            hi = self.max_positions
            if kind == "prefill":  # (input_ids[1, T], last[1]): T dynamic
                shapes: tuple = ({1: Dim.DYNAMIC(min=2, max=hi)}, None)
            else:  # (ids, pos, *cache): every cache buffer's length (dim 2) dynamic
                s = Dim.DYNAMIC(min=2, max=hi)
                shapes = (None, None, tuple({2: s} for _ in inputs[2:]))
            self.dynamic[dyn_key] = capture(module, inputs, name=f"{kind}-dynamic", stack_traces=False,
                                            dynamic_shapes=shapes)
        cg = specialize(self.dynamic[dyn_key], inputs, name=label)
        cg.seconds = time.perf_counter() - t0  # the dynamic export (first program of this module) + specialising
        cg.note = (f"capture: one dynamic export of {type(module).__name__}"
                   f"{' (made now)' if made else ' (reused)'}, specialised to {kind} {length}")
        return cg

    def _build_fixed(self, gm, inputs: tuple, label: str, entry: dict, step: StepBinding | None = None):
        """Build with a generation plan's stored placement; the program must come out as stored."""
        from hetforge.placement import Placement
        from hetforge.runtime.genplan import check_rebuilt

        ex = self.executor
        placement = Placement(f"plan:{ex.strategy}", dict(entry["assignment"]), objective=ex.objective)
        res = ex.place(gm, inputs, label, self.optimize, placement=placement)
        check_rebuilt(entry, res.program, self.fixed_source, label)
        b = ex.build_program(res, step=step)
        b.notes.append(f"placement from plan '{self.fixed_source}' (program checked against the stored one)")
        return b
