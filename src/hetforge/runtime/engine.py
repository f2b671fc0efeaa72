"""The generation loop: prefill once, then decode one token at a time against the static KV cache.

Per request: tokenize, pick the prompt tier and the KV cache length, run the prefill program, write its
K/V rows into the cache, sample on the CPU, then loop decode → write the new rows in place → sample.
The per-token path reuses preallocated ``input_ids``/``pos`` tensors (``fill_``) and the cache, so it
allocates no cache-sized memory. All times are measured with ``time.perf_counter``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hetforge.errors import UsageError
from hetforge.runtime.compile_cache import cache_state
from hetforge.runtime.executors import Executor, make_executor
from hetforge.runtime.ledger import Ledger
from hetforge.runtime.programs import Piece, ProgramCache, check_prefill_mode, pick_tier, prefill_pieces
from hetforge.runtime.sampling import Sampler, SamplingParams
from hetforge.runtime.threads import ThreadTuner, others_running
from hetforge.tokenizers import StreamDecoder, Tokenizer, for_model


@dataclass
class GenerationResult:
    """What one request produced and what it cost (all times measured)."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    prefill_tier: int
    cache_length: int
    kv_cache_bytes: int
    ttft_s: float  # prefill + first sample, excluding one-time compilation (in compile_s)
    decode_s: list[float] = field(default_factory=list)  # one per decode step
    compile_s: dict[str, float] = field(default_factory=dict)  # programs compiled by this request
    stop_reason: str = "length"
    executor: str = "fx"
    placed: dict | None = None  # Ledger.summary(): modeled SoC figures and measured runner overheads
    prefill_pieces: list[str] = field(default_factory=list)  # the program calls of the prefill, e.g. prefill-64
    built_alongside: dict[str, float] = field(default_factory=dict)  # program → its own seconds in a forked child
    compile_cache: dict[str, str] = field(default_factory=dict)  # program → compile_cache.cache_state (when used)
    # the thread counts this request ran on: the prefill's and why (ThreadTuner.before_prefill), and its decode
    # steps per count (the adaptive tuner's probes and switches)
    threads_used: dict = field(default_factory=dict)

    @property
    def decode_ms_per_token(self) -> float | None:
        return 1e3 * sum(self.decode_s) / len(self.decode_s) if self.decode_s else None

    @property
    def tokens_per_s(self) -> float | None:
        total = self.ttft_s + sum(self.decode_s)
        return len(self.tokens) / total if total > 0 and self.tokens else None

    def to_dict(self) -> dict:
        return {
            "text": self.text, "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
            "ttft_s": self.ttft_s, "decode_ms_per_token": self.decode_ms_per_token,
            "tokens_per_s": self.tokens_per_s, "prefill_tier": self.prefill_tier,
            "kv_cache_length": self.cache_length, "kv_cache_bytes": self.kv_cache_bytes,
            "compile_s": self.compile_s, "stop_reason": self.stop_reason, "executor": self.executor,
            "timing": "measured", "placed": self.placed, "prefill_pieces": self.prefill_pieces,
            "built_alongside_s": self.built_alongside, "threads_used": self.threads_used,
            "compile_cache": self.compile_cache,
        }


class Engine:
    """Generates text from one loaded model with compiled static-shape programs."""

    def __init__(self, loaded, tokenizer: Tokenizer | None = None, executor: Executor | str = "auto",
                 soc: Any = "host", optimize: bool = True, quantize: str = "none", group_size: int = 128,
                 strategy: str = "rules", objective: str = "energy", backends: dict[str, str] | None = None,
                 policy: str = "exact", prefill: str = "fine"):
        if loaded.kind != "causal-lm":
            raise UsageError(f"model '{loaded.name}' is a {loaded.kind}; generation needs a causal LM")
        self.loaded = loaded
        self.tokenizer = tokenizer or for_model(loaded)
        self.executor = (make_executor(executor, soc, quantize, group_size, strategy, objective, backends, policy)
                         if isinstance(executor, str) else executor)
        prof = getattr(self.executor, "soc_profile", None)
        self.soc_name = prof.name if prof is not None else str(soc)
        self.programs = ProgramCache(loaded.model, loaded.max_positions, self.executor, optimize=optimize)
        self.vocab_size = loaded.vocab_size
        self._ids = torch.zeros((1, 1), dtype=torch.long)
        self._pos = torch.zeros((1, 1), dtype=torch.long)
        # how a prompt is prefilled (runtime.programs.prefill_pieces): one call of a fine-length program by default;
        # an executor whose programs are made per tier (runtime.moe_exec) prefills at the tier
        self.prefill_mode = "tier" if getattr(self.executor, "prefill_at_tier", False) else check_prefill_mode(prefill)

    @property
    def max_positions(self) -> int:
        return self.loaded.max_positions

    def thread_tuner(self) -> ThreadTuner:
        """The adaptive thread count of this engine's requests (made for torch's current count; kept across
        requests, so what decode steps measured also sets the next prefill's count)."""
        import torch

        t = getattr(self, "_tuner", None)
        if t is None or t.base != torch.get_num_threads():
            t = self._tuner = ThreadTuner(others=others_running)
        return t

    def encode(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise UsageError("the prompt is empty; give at least one token of text")
        if len(ids) > self.max_positions:
            raise UsageError(f"the prompt is {len(ids)} tokens but the model's maximum context is "
                             f"{self.max_positions} tokens")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the model's vocabulary (0..{self.vocab_size - 1})")
        return ids

    def plan(self, n_prompt: int, max_new: int) -> tuple[int, int, int]:
        """(prefill tier, KV cache length, new tokens that fit in the context)."""
        fixed = self.programs.fixed  # a generation plan: only its tiers exist
        pre = sorted(n for k, n in fixed if k == "prefill") if fixed is not None else self.programs.tiers
        dec = sorted(n for k, n in fixed if k == "decode") if fixed is not None else self.programs.tiers
        tier = next((t for t in pre if t >= n_prompt), pick_tier(n_prompt, self.programs.tiers))
        fit = min(max_new, self.max_positions - n_prompt + 1)  # the last token is never fed back
        need = max(tier, n_prompt + fit - 1)
        return tier, next((t for t in dec if t >= need), pick_tier(need, self.programs.tiers)), fit

    def stream(self, prompt: str | list[int], params: SamplingParams) -> Generation:
        """A :class:`Generation`: iterate it for text pieces; its ``result`` holds tokens and timings."""
        return Generation(self, self.encode(prompt), params)

    def generate(self, prompt: str | list[int], params: SamplingParams) -> GenerationResult:
        gen = self.stream(prompt, params)
        for _ in gen:
            pass
        return gen.result


class Generation:
    """One request in progress. Iterating yields decoded text pieces as tokens arrive."""

    chunkable = True  # whether this kind of request may prefill in pieces (subclasses that place each call: no)

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams):
        self.engine, self.prompt_ids, self.params = engine, prompt_ids, params
        tier, length, fit = engine.plan(len(prompt_ids), params.max_new_tokens)
        self.max_new = fit
        cache = engine.programs.cache(length)
        self.result = GenerationResult("", [], len(prompt_ids), tier, length, cache.nbytes, 0.0,
                                       executor=engine.executor.name)
        self.cache = cache
        # fine: one program of about the prompt's length; chunked: the largest tier <= n and chunks over the cache;
        # both stay within the tier (<= the cache length). A generation plan holds tier programs only.
        free = self.chunkable and engine.programs.fixed is None
        self.pieces: list[Piece] = (prefill_pieces(len(prompt_ids), engine.programs.tiers, mode=engine.prefill_mode)
                                    if free else [Piece("prefill", 0, tier, len(prompt_ids))])
        self.result.prefill_pieces = [_piece_name(p) for p in self.pieces]
        self.ledger = Ledger(engine.soc_name)
        self.decoder = StreamDecoder(engine.tokenizer)
        self.tuner: ThreadTuner | None = None
        self._steps_before: dict[int, int] = {}  # the tuner's decode steps per count when this request began
        self._prompt_rows: tuple[Any, int] | None = None  # the prompt's K/V rows not yet in the cache
        self._pending = ""  # decoded text not shown yet (may start a stop string)
        self._shown = ""

    def _compile(self, kind: str, length: int):
        get = self.engine.programs.prefill if kind == "prefill" else self.engine.programs.decode
        prog, fresh = get(length)
        if fresh:
            self.result.compile_s[f"{kind}-{length}"] = prog.total_s
            if state := cache_state(prog.notes):
                self.result.compile_cache[f"{kind}-{length}"] = state
            if prog.child_s is not None:
                self.result.built_alongside[f"{kind}-{length}"] = prog.child_s
        return prog

    def _emit(self, token: int) -> tuple[str, bool]:
        """Record ``token``; return the text that may be shown now and whether generation must stop.

        Text that could be the start of a stop string is held back until it is known not to be one,
        so a stop string is never shown.
        """
        r, p = self.result, self.params
        r.tokens.append(token)
        self._pending += self.decoder.push(token)
        eos = self.engine.tokenizer.eos_id
        stop = False
        if not p.ignore_eos and eos is not None and token == eos:
            r.stop_reason, stop = "eos", True
        elif len(r.tokens) >= self.max_new:
            r.stop_reason = "length" if self.max_new == p.max_new_tokens else "context full"
            stop = True
        if stop:
            self._pending += self.decoder.flush()
        for s in p.stop:
            cut = self._pending.find(s)
            if cut >= 0:
                r.stop_reason = f"stop string {s!r}"
                self._pending = self._pending[:cut]
                stop = True
        hold = 0 if stop else _held_back(self._pending, p.stop)
        show = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(show):]
        self._shown += show
        return show, stop

    def __iter__(self) -> Iterator[str]:
        """Text pieces as they become showable (a token may add none, e.g. half a UTF-8 character)."""
        for _, piece in self.steps():
            if piece:
                yield piece

    def steps(self) -> Iterator[tuple[int, str]]:
        """One ``(token, showable text)`` pair per generated token: prefill, then one decode step per token
        (the programs that run each step come from :meth:`_prefill` and :meth:`_decode`)."""
        e, r = self.engine, self.result
        n = len(self.prompt_ids)
        self._start()
        sampler = Sampler(self.params, e.vocab_size)
        sampler.observe(self.prompt_ids)
        t0 = start = time.perf_counter()
        out = self._prefill_all()
        token = sampler.pick(out[0])
        r.ttft_s = time.perf_counter() - t0
        try:
            piece, stop = self._emit(token)
            yield token, piece
            pos = n
            args = (e._ids, e._pos, *self.cache.buffers)
            while not stop:
                step = self._before_step()
                t0 = time.perf_counter()
                self._flush_prompt_rows()  # the first step reads them: their copy is counted in its time
                sampler.observe(token)
                e._ids.fill_(token)
                e._pos.fill_(pos)
                out, placed = self._decode(args, step)
                self.cache.write(out[1:], pos)
                token = sampler.pick(out[0])
                r.decode_s.append(time.perf_counter() - t0)
                self._after_step(step)
                self.ledger.add("decode", t0 - start, placed)
                pos += 1
                piece, stop = self._emit(token)
                yield token, piece
        finally:
            if self.tuner is not None:
                self.tuner.restore()
            self.finish()

    def _start(self) -> None:
        """Before prefill: compile (or fetch) the programs, set the thread count."""
        try:
            self._programs()
        except BaseException:
            self.engine.programs.cancel_ahead()
            raise
        self._start_threads()

    def _start_threads(self) -> None:
        """Take the engine's adaptive thread count (runtime/threads.py, kept per engine), set it for the prefill
        and note the count and why in the result."""
        self.tuner = self.engine.thread_tuner()
        n = self.tuner.before_prefill()
        self._steps_before = dict(self.tuner.counts)
        self.result.threads_used = {"prefill": n, "prefill_reason": self.tuner.prefill_reason}

    def _programs(self) -> None:
        r = self.result
        first = self.pieces[0]
        if self.max_new > 1:  # a cold decode program is built alongside the prefill where it can (runtime.ahead)
            self.engine.programs.decode_ahead(r.cache_length)
        self._prefill_prog = self._compile("prefill", first.size) if first.kind == "prefill" else None
        self._chunk_progs = {}
        for p in self.pieces:
            if p.kind == "chunk" and p.size not in self._chunk_progs:
                prog, fresh = self.engine.programs.chunk(p.size, r.cache_length)
                if fresh:
                    r.compile_s[f"chunk-{p.size}x{r.cache_length}"] = prog.total_s
                    if state := cache_state(prog.notes):
                        r.compile_cache[f"chunk-{p.size}x{r.cache_length}"] = state
                self._chunk_progs[p.size] = prog
        self._decode_prog = self._compile("decode", r.cache_length) if self.max_new > 1 else None

    def _prefill_all(self) -> Any:
        """Prefill the prompt into the cache, piece by piece (:func:`~hetforge.runtime.programs.prefill_pieces`);
        returns the last piece's outputs (its logits are the first token's). The last piece's K/V rows are copied
        into the cache by :meth:`_flush_prompt_rows` after the first token is picked (at the first decode step,
        which reads them, and inside its time): the copy is not on the way to the first token. Earlier pieces'
        rows are copied at once (the next piece reads them). The rows wait as views of the program's outputs,
        which nothing writes before that step (one request at a time per engine, as its one KV cache requires)."""
        n = len(self.prompt_ids)
        prompt = torch.tensor(self.prompt_ids)
        if len(self.pieces) == 1 and self.pieces[0].kind == "prefill":  # one tier call (pad rows written too)
            ids = torch.zeros((1, self.pieces[0].size), dtype=torch.long)
            ids[0, :n] = prompt
            out, placed = self._prefill(ids, torch.tensor([n - 1]))
            self.ledger.add("prefill", 0.0, placed)
            self._prompt_rows = (out[1:], 0)
            return out
        top = self.engine.max_positions - 1
        for p in self.pieces:
            ids = torch.zeros((1, p.size), dtype=torch.long)
            ids[0, :p.real] = prompt[p.start:p.start + p.real]
            last = torch.tensor([p.real - 1])
            if p.kind == "prefill":
                out, placed = self._prefill(ids, last)
            else:  # pad rows sit past the prompt; their positions are clamped into the model's range
                pos = torch.arange(p.start, p.start + p.size).clamp_(max=top).unsqueeze(0)
                prog = self._chunk_progs[p.size]
                out, placed = prog.run(ids, pos, last, *self.cache.buffers), prog.placed
            self.ledger.add("prefill", 0.0, placed)
            rows = out[1:] if p.real == p.size else [t[:, :, :p.real] for t in out[1:]]
            if p is self.pieces[-1]:
                self._prompt_rows = (rows, p.start)
            else:
                self.cache.write(rows, p.start)
        return out

    def _flush_prompt_rows(self) -> None:
        """Copy the prompt's last K/V rows into the cache (see :meth:`_prefill_all`); once."""
        if self._prompt_rows is not None:
            rows, at = self._prompt_rows
            self._prompt_rows = None
            self.cache.write(rows, at)

    def _prefill(self, ids: torch.Tensor, last: torch.Tensor) -> tuple[Any, Any]:
        """The prefill program's outputs (logits, K/V rows) and where it ran."""
        return self._prefill_prog.run(ids, last), self._prefill_prog.placed

    def _before_step(self) -> Any:
        return self.tuner.before()

    def _decode(self, args: tuple, step: Any) -> tuple[Any, Any]:
        """One decode step's outputs and where it ran."""
        return self._decode_prog.run(*args), self._decode_prog.placed

    def _after_step(self, step: Any) -> None:
        self.tuner.after(step, self.result.decode_s[-1])

    def finish(self) -> None:
        """Settle ``result.text`` (also after an interruption): shown text plus any held-back text, and this
        request's decode steps per thread count."""
        self.result.text = self._shown + self._pending
        self.result.placed = self.ledger.summary()
        if self.tuner is not None and self.result.threads_used:
            before = self._steps_before
            counts = sorted(self.tuner.counts.items(), reverse=True)  # the requested count first
            self.result.threads_used["decode_steps"] = {n: c - before.get(n, 0) for n, c in counts
                                                        if c > before.get(n, 0)}


def _piece_name(p: Piece) -> str:
    return f"{p.kind}-{p.size}" if p.real == p.size else f"{p.kind}-{p.size} ({p.real} real)"


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
