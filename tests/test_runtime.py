"""The generation runtime: greedy tokens equal Hugging Face ``generate``, the KV cache is written in place,
tiers are compiled once, stop strings and bad input behave."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands
from hetforge.errors import UsageError
from hetforge.models.zoo import load_model
from hetforge.runtime import Engine, SamplingParams

_load_commands()
runner = CliRunner()

@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from a second thread, and a busy machine makes two threads stall."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


PROMPT = [(7 * i + 3) % 200 + 1 for i in range(37)]  # 37 tokens: not a tier length
_engines: dict[str, Engine] = {}


def engine(name: str) -> Engine:
    if name not in _engines:
        _engines[name] = Engine(load_model(name))  # the demo assets ship with the package: missing = failure
    return _engines[name]


def hf_greedy(loaded, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "qwen2-tiny", "mixtral-tiny", "demo", "moe-demo"])
def test_greedy_matches_hugging_face_generate(name):
    e = engine(name)
    text = "The with statement is used to wrap the execution"
    prompt = PROMPT if name not in ("demo", "moe-demo") else e.tokenizer.encode(text)
    r = e.generate(prompt, SamplingParams(max_new_tokens=32))
    assert r.prefill_tier != len(prompt)
    assert r.tokens == hf_greedy(e.loaded, prompt, 32)
    assert len(r.tokens) == 32 or r.stop_reason == "eos"


def test_second_request_in_the_same_tier_compiles_nothing():
    e = engine("llama-tiny")
    e.generate(PROMPT, SamplingParams(max_new_tokens=32))
    prompt = PROMPT[:50] + PROMPT[:3]  # 40 tokens: same tier and cache length
    r = e.generate(prompt, SamplingParams(max_new_tokens=31))
    assert r.compile_s == {}
    assert r.tokens == hf_greedy(e.loaded, prompt, 31)


class _AllocCounter(TorchDispatchMode):
    """Bytes of every new storage an ATen op returns (views and ``out=`` results share an input's storage)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_in = torch.utils._pytree.tree_leaves((args, kwargs))
        seen = {t.untyped_storage().data_ptr() for t in flat_in if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.sizes.append(t.untyped_storage().nbytes())
        return out


def test_decode_writes_the_cache_in_place_without_cache_sized_allocations():
    e = engine("llama-tiny")
    gen = e.stream(PROMPT, SamplingParams(max_new_tokens=400, ignore_eos=True))  # plans a 512-position cache
    it = gen.steps()
    next(it)
    cache = gen.cache
    assert cache.length == 512
    ptrs = cache.data_ptrs()
    layer_bytes = cache.nbytes // len(cache.buffers)
    per_step = []
    for step in range(6):
        before = [b.clone() for b in cache.buffers]
        with _AllocCounter() as c:
            next(it)
        per_step.append(c.sizes)
        pos = len(PROMPT) + step  # the position of the token fed in this step
        for b, old in zip(cache.buffers, before, strict=True):
            changed = (b != old).any(dim=-1).any(dim=1)[0]  # per position
            got = changed.nonzero().flatten().tolist()
            if step == 0:  # the first step also copies the prompt's rows in (deferred past the first token)
                assert pos in got and set(range(len(PROMPT))) <= set(got)
            else:
                assert got == [pos]  # exactly this step's row was written
    it.close()
    assert cache.data_ptrs() == ptrs
    totals = [sum(s) for s in per_step]
    assert max(max(s, default=0) for s in per_step) < layer_bytes / 4, "a cache-sized tensor was allocated in decode"
    assert max(totals) < cache.nbytes / 2
    assert len(set(totals[1:])) == 1, f"allocation per step changes: {totals}"
    # the decode program is bound as a step (runtime.executors.StepBinding): its logits and K/V rows live in its own
    # memory, so a step through the placed executor makes no new storage at all
    assert per_step == [[]] * len(per_step), per_step


def test_stop_string_cuts_the_text_before_it():
    e = engine("gpt2-tiny")
    full = e.generate("Hello", SamplingParams(max_new_tokens=24)).text
    stop = full[5:8]
    cut = full.find(stop)
    assert len(stop) == 3 and 0 <= cut <= 5
    r = e.generate("Hello", SamplingParams(max_new_tokens=24, stop=(stop,)))
    assert r.text == full[:cut] and stop not in r.text
    assert r.stop_reason.startswith("stop string")
    assert len(r.tokens) < 24


def test_seeded_sampling_reproduces():
    e = engine("gpt2-tiny")
    p = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=3)
    a = e.generate(PROMPT[:10], p).tokens
    assert a == e.generate(PROMPT[:10], p).tokens
    assert a != e.generate(PROMPT[:10], SamplingParams(max_new_tokens=16, temperature=1.0, seed=4)).tokens


def test_prompt_longer_than_the_context_names_both_numbers():
    e = engine("gpt2-tiny")
    with pytest.raises(UsageError, match="600 tokens.*maximum context is 512"):
        e.stream([1] * 600, SamplingParams())


@pytest.mark.parametrize("args", [
    ["--prompt", ""], ["--prompt", "x", "-n", "0"], ["--prompt", "x", "--top-p", "0"],
    ["--prompt", "x", "--temperature", "-1"], ["--prompt", "x", "--quantize", "w3"],
    ["--prompt", "x", "--quantize", "w4", "--group-size", "48"],
])
def test_cli_bad_input_exits_2_with_one_line(args):
    res = runner.invoke(app, ["run", "gpt2-tiny", *args])
    assert res.exit_code == 2, res.output
    assert len(res.output.strip().splitlines()) == 1


def test_cli_json_fields():
    import json

    res = runner.invoke(app, ["run", "gpt2-tiny", "--prompt", "Hi", "-n", "5", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    for k in ("text", "tokens", "ttft_s", "decode_ms_per_token", "prefill_tier", "kv_cache_bytes", "compile_s"):
        assert k in d
    assert len(d["tokens"]) == 5 and d["prefill_tier"] == 32 and d["kv_cache_bytes"] > 0


def test_cli_demo_generates_and_matches_hugging_face():
    import json

    from hetforge.models import demo

    assert demo.available(), "the demo model's assets ship in src/hetforge/assets/demo"
    res = runner.invoke(app, ["demo", "--json", "-n", "24", "--threads", "1"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["matches_hugging_face_generate"] is True
    assert len(d["generation"]["tokens"]) == 24 or d["generation"]["stop_reason"] == "eos"
    assert d["generation"]["text"].strip()


def test_fx_fallback_executor_gives_the_same_tokens():
    loaded = engine("llama-tiny").loaded
    fx = Engine(loaded, executor="fx")
    r = fx.generate(PROMPT, SamplingParams(max_new_tokens=16))
    assert r.executor == "fx"
    assert r.tokens == hf_greedy(loaded, PROMPT, 16)


def test_unknown_executor_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown executor"):
        Engine(engine("llama-tiny").loaded, executor="tpu")


def test_decode_graph_has_one_kv_attention_node_per_layer():
    from hetforge.frontend import capture
    from hetforge.runtime.kvcache import KVCache
    from hetforge.runtime.static_kv import DecodeModule, model_dims

    model = load_model("llama-tiny").model.eval()
    layers, kv, hd = model_dims(model)
    cache = KVCache(layers, kv, 16, hd, torch.float32)
    inputs = (torch.zeros((1, 1), dtype=torch.long), torch.full((1, 1), 3, dtype=torch.long), *cache.buffers)
    gm = capture(DecodeModule(model), inputs).gm
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.hetforge.kv_attention.default) == layers
    assert torch.ops.aten.softmax.int not in targets  # no unfused attention left in the decode step


@pytest.mark.parametrize(("executor", "scheme", "kernel"), [("backend", "w8a8", "quantized::linear_dynamic"),
                                                          ("fx", "w8", "aten::_weight_int8pack_mm")])
def test_quantized_generation_runs_int8_linears_in_every_program(executor, scheme, kernel, no_native):
    """The ATen int8 kernels (the native one-row int8 GEMV is tested below; the profiler cannot see it). The
    37-token prompt is prefilled as prefill-32 + a 16-token chunk (runtime.programs.prefill_pieces)."""
    loaded = engine("llama-tiny").loaded
    q = Engine(loaded, executor=executor, quantize=scheme, prefill="chunked")
    r = q.generate(PROMPT, SamplingParams(max_new_tokens=6))
    assert r.executor == f"{executor}+{scheme}" and len(r.tokens) == 6
    progs = {p.kind: p for p in q.programs.programs.values()}
    assert set(progs) == {"prefill", "chunk", "decode"}
    for p in progs.values():
        assert any(n.startswith("quantization:") for n in p.notes), p.notes
    cache = q.programs.cache(r.cache_length)
    args = (torch.tensor([[5]]), torch.tensor([[len(PROMPT)]]), *cache.buffers)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        progs["decode"].run(*args)
    ran = {e.name for e in prof.events()}
    assert kernel in ran, sorted(n for n in ran if "mm" in n or "linear" in n)
    assert "aten::linear" not in ran  # no float weight product left in the decode step


def test_w8a8_first_token_logits_do_not_depend_on_pad_rows_chunks_or_the_executor(monkeypatch):
    """w8a8 quantizes each activation row by its own range, so the prompt's last row — padded to 40 (fine) or
    64 (tier) rows, prefilled as 32 + a 16-row chunk (chunked), its last layer computed for that row alone (the
    placed programs) or for all rows (fx) — gives the first token's logits with the same int8 sums. Before,
    FBGEMM's one range over all rows made the chunked and fx logits differ from the padded ones by about 0.01."""
    from hetforge.runtime.sampling import Sampler

    loaded = engine("llama-tiny").loaded
    seen: list[torch.Tensor] = []
    real = Sampler.pick
    monkeypatch.setattr(Sampler, "pick", lambda self, x: seen.append(x.detach().reshape(-1).clone()) or real(self, x))
    first = {}
    for executor in ("auto", "fx"):
        for prefill in ("fine", "tier", "chunked"):
            seen.clear()
            Engine(loaded, executor=executor, quantize="w8a8", prefill=prefill).generate(
                PROMPT, SamplingParams(max_new_tokens=1, ignore_eos=True))
            first[executor, prefill] = seen[0]
    base = first["auto", "fine"]
    assert torch.equal(first["auto", "tier"], base)  # the same program's rows, only the pad rows differ
    for key, logits in first.items():
        assert float((logits - base).abs().max()) <= 1e-3, key


def test_quantized_programs_share_one_int8_copy_and_prepack_at_compile_time():
    loaded = engine("llama-tiny").loaded
    q = Engine(loaded, executor="fx", quantize="w8")
    q.generate(PROMPT, SamplingParams(max_new_tokens=3))
    progs = {p.kind: p for p in q.programs.programs.values()}
    assert all(any(n.startswith("warm-up call") for n in p.notes) for p in progs.values())

    from hetforge.frontend import capture
    from hetforge.quant import quantize_graph
    from hetforge.runtime.static_kv import DecodeModule, PrefillModule

    cache = q.programs.cache(16)
    dec = capture(DecodeModule(loaded.model), (torch.zeros((1, 1), dtype=torch.long),
                                               torch.zeros((1, 1), dtype=torch.long), *cache.buffers)).gm
    pre = capture(PrefillModule(loaded.model), (torch.zeros((1, 8), dtype=torch.long), torch.tensor([7]))).gm

    def int8_tensors(gm):
        return {t.data_ptr() for t in quantize_graph(gm, "w8").gm.state_dict().values() if t.dtype == torch.int8}

    a, b = int8_tensors(dec), int8_tensors(pre)
    assert a and a == b  # the same int8 storage serves both programs


def test_without_native_kernels_the_aten_path_gives_the_same_tokens(no_native):
    e = Engine(load_model("llama-tiny"))  # built while the native kernels are reported unavailable
    r = e.generate(PROMPT, SamplingParams(max_new_tokens=16))
    assert r.tokens == hf_greedy(e.loaded, PROMPT, 16)


def _decode_graph(name: str, length: int, token: int, pos: int):
    """The captured decode step of ``name`` over a ``length``-position KV cache filled with seeded values, its
    inputs (one token at ``pos``) and the layer count."""
    from hetforge.frontend import capture
    from hetforge.runtime.kvcache import KVCache
    from hetforge.runtime.programs import model_dims
    from hetforge.runtime.static_kv import DecodeModule

    m = load_model(name).model.eval()
    layers, kv_heads, hd = model_dims(m)
    cache = KVCache(layers, kv_heads, length, hd, torch.float32)
    g = torch.Generator().manual_seed(0)
    for b in cache.buffers:
        b.copy_(torch.randn(b.shape, generator=g))
    inputs = (torch.tensor([[token]]), torch.tensor([[pos]]), *cache.buffers)
    return capture(DecodeModule(m), inputs), inputs, layers


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_decode_program_runs_its_row_ops_and_gemvs_natively(name, with_native):
    """At 2 threads every one-row op of the decode step is one native call; outputs equal the ATen path's."""
    from hetforge.compile import compile_graph
    from hetforge.kernels import native

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cg, inputs, layers = _decode_graph(name, 32, token=5, pos=20)
        exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, name="decode").executable
        st = exe.stats
        assert st.native_gemv >= 2 * layers and st.native_ops >= 3 * layers
        from hetforge.ir.kernel_choice import GEMM_OPS, OP_KERNELS

        row_ops = set(OP_KERNELS) - set(GEMM_OPS)  # the hetforge ops with a native kernel registered
        assert not row_ops & set(st.by_op_fallback), st.by_op_fallback  # none ran in Python
        assert st.static_views > 0
        got = [t.clone() for t in exe.run_flat(*inputs)]
        with native.disabled():
            want = compile_graph(cg.gm, soc="host", example_inputs=inputs, name="decode").executable.run_flat(*inputs)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_a_prefill_program_runs_its_one_row_kernels_on_the_openmp_team_and_a_decode_program_on_the_pool(
        with_native):
    """A prefill program's multi-row products run on torch's OpenMP team; its LM head (one row, native GEMV) runs
    there too (``on_team``: no second thread pool competing with the team's spinning threads), so the native
    pool runs no job during it, and the switch is off again after its run, also after one that raised. A decode
    step (one-row products only) switches it off at its start and runs on the pool."""
    from hetforge.compile import compile_graph
    from hetforge.frontend import capture
    from hetforge.kernels import native
    from hetforge.runtime.programs import PrefillModule

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        m = load_model("gpt2-tiny").model.eval()
        pin = (torch.randint(0, 100, (1, 16)), torch.tensor([15]))
        pre = compile_graph(capture(PrefillModule(m), pin).gm, soc="host", example_inputs=pin,
                            name="prefill").executable
        assert "native:hf_gemv_nk" in pre.kernels.values()  # the LM head of the last row
        cg, dinputs, _ = _decode_graph("gpt2-tiny", 32, token=5, pos=20)
        dec = compile_graph(cg.gm, soc="host", example_inputs=dinputs, name="decode").executable
        jobs = native.pool_info().jobs
        pre.run_flat(*pin)  # its LM head GEMV ran at 2 threads, on the team: no pool job
        assert native.pool_info().jobs == jobs and not native.pool_info().team  # switched back off after the run
        with pytest.raises(IndexError):  # a run that raises half-way switches it off too (a token past the vocab)
            pre.run_flat(torch.full((1, 16), 10**6, dtype=torch.long), pin[1])
        assert not native.pool_info().team
        native.pool_team(True)  # left on by someone else: the decode step switches it off for its run
        dec.run_flat(*dinputs)
        assert not native.pool_info().team and native.pool_info().jobs > jobs
    finally:
        native.pool_team(False)
        torch.set_num_threads(before)


def test_decode_program_groups_the_products_of_one_input_into_one_call(with_native, monkeypatch):
    """llama's q, k and v projections read one normed row: the decode program runs them as one
    hf_gemv_nk_multi call per layer, with outputs bit-equal to one call per product (HETFORGE_GEMV_MULTI=0)."""
    from hetforge.compile import compile_graph
    from hetforge.kernels import native

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cg, inputs, layers = _decode_graph("llama-tiny", 32, token=5, pos=20)
        exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, name="decode").executable
        assert exe.stats.gemv_groups == layers
        listed = [n for v in exe._globals.values() if isinstance(v, native.CallList) for n, _, _ in v.calls]
        # one hf_gemv_nk_multi call per layer: from Python (a MultiArgs .call) or in a call list
        assert exe.source.count("hf_gemv_nk_multi") == 0
        assert exe.source.count(".call(") + listed.count("hf_gemv_nk_multi") == layers
        got = [t.clone() for t in exe.run_flat(*inputs)]
        monkeypatch.setenv("HETFORGE_GEMV_MULTI", "0")
        off = compile_graph(cg.gm, soc="host", example_inputs=inputs, name="decode").executable
        assert off.stats.gemv_groups == 0 and off.stats.native_gemv == exe.stats.native_gemv
        for a, b in zip(got, off.run_flat(*inputs), strict=True):
            assert torch.equal(a, b)
    finally:
        torch.set_num_threads(before)


def test_w8_decode_runs_its_int8_products_on_the_native_kernel(with_native, monkeypatch):
    """Under ``--w8-act weight-only`` one-row int8 products (``--quantize w8``) run on the native int8 GEMV
    with fp32 activations; outputs match the ATen ``_weight_int8pack_mm`` path to rounding."""
    from hetforge.compile import compile_graph
    from hetforge.kernels import native

    monkeypatch.setenv("HETFORGE_W8_ACT", "weight-only")

    cg, inputs, layers = _decode_graph("llama-tiny", 16, token=7, pos=3)
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, quantize="w8").executable
    assert "hetforge.linear_w8.default" not in exe.stats.by_op_fallback
    assert sum(1 for ins in exe.program.instrs if ins.op == "hetforge.linear_w8.default"
               and exe.kernels[ins.id] == "native:hf_gemv_q8") >= 7 * layers
    got = [t.clone() for t in exe.run_flat(*inputs)]
    with native.disabled():
        want = compile_graph(cg.gm, soc="host", example_inputs=inputs, quantize="w8").executable.run_flat(*inputs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_w8_decode_with_quantized_activations_is_the_default_and_close(with_native, monkeypatch):
    """The default w8 activation mode (``q8``) lowers the one-row int8 products to ``hf_gemv_q8a`` (x quantized
    per block of 32, int8·int8 sums); the logits stay close to the weight-only ATen path."""
    from hetforge.compile import compile_graph
    from hetforge.kernels import native
    from hetforge.verify import compare_logits

    cg, inputs, layers = _decode_graph("llama-tiny", 16, token=7, pos=3)
    monkeypatch.delenv("HETFORGE_W8_ACT", raising=False)
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, quantize="w8").executable
    assert sum(1 for ins in exe.program.instrs if ins.op == "hetforge.linear_w8.default"
               and exe.kernels[ins.id] == "native:hf_gemv_q8a") >= 7 * layers
    got = [t.clone() for t in exe.run_flat(*inputs)]
    with native.disabled():
        want = compile_graph(cg.gm, soc="host", example_inputs=inputs, quantize="w8").executable.run_flat(*inputs)
    assert compare_logits(want[0], got[0]).kl_mean < 1e-5  # test_quant's w8 bound (random tiny weights)
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("quantize", ["none", "w8a8"])
def test_only_a_program_with_one_time_work_left_after_packing_gets_a_warm_up_call(quantize, monkeypatch):
    """An unquantized program of generated executables is packed (every oneDNN weight) and returned without a
    call: nothing else in it runs once, and a call would be one more prefill before the user's. A quantized one
    keeps its warm-up call (FBGEMM packs a w8a8 product's weights on first use)."""
    from hetforge.kernels.onednn import LazyPacked

    monkeypatch.setenv("HETFORGE_COMPILE_CACHE", "0")
    monkeypatch.setenv("HETFORGE_GEMM", "onednn")
    loaded = engine("llama-tiny").loaded
    eng = Engine(loaded, executor="auto", quantize=quantize)
    ran = []
    real_build = type(eng.programs.executor).build_program

    def spy_build(self, *a, **k):
        b = real_build(self, *a, **k)
        run = b.run

        def counted(*args):
            ran.append(1)
            return run(*args)

        b.run = counted
        return b

    monkeypatch.setattr(type(eng.programs.executor), "build_program", spy_build)
    prog, _ = eng.programs.prefill(16)
    head = [n for n in prog.notes if "warm-up call" in n]
    if quantize == "none":
        assert ran == [] and head and head[0].startswith("weights packed in "), prog.notes
        lazy = [v for c in prog.placed.exe.compiled for v in c.executable._globals.values()
                if isinstance(v, LazyPacked)]
        assert lazy and all(v.packed is not None for v in lazy)  # packed before any call
    else:
        assert ran == [1] and head[0].startswith("warm-up call "), prog.notes
