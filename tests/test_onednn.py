"""oneDNN prepacked linears: numerics against ATen, the executor's use of them (fidelity vs eager, KL ≤ 1e-8),
the policy switch, the measured choice, and calibration taking the fastest GEMM kernel."""

import contextlib
import json
import statistics

import pytest
import torch
import torch.nn.functional as F
from test_ir_common import captured

from hetforge.compile import compile_graph
from hetforge.kernels import native, onednn
from hetforge.ops.fused import apply_act
from hetforge.verify import verify

# oneDNN ships inside the x86 torch wheels; a build without it keeps ATen's GEMMs and never reaches this code.
pytestmark = pytest.mark.skipif(not onednn.available(),
                                reason="this torch build has no oneDNN: the executor keeps ATen's GEMMs there")


@pytest.mark.parametrize("act", list(onednn.ACT_ATTR))
def test_packed_linear_with_fused_activation_matches_aten(act):
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(24, 64, generator=g), torch.randn(96, 64, generator=g) * 0.1, torch.randn(96, generator=g)
    ref = F.linear(x, w, b)
    ref = ref if act == "none" else apply_act(ref, act)
    got = onednn.linear_fn(onednn.packed_weight(w, False, 24), b, act)(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("alike", [True, False])
def test_packed_weight_is_made_once_per_weight_and_packing(monkeypatch, alike):
    """Row counts >= 2 share one packed copy exactly where this oneDNN packs them byte for byte alike (checked, here
    forced either way); one row is always its own packing."""
    monkeypatch.setattr(onednn, "_hint_free", {})
    if not alike:
        monkeypatch.setattr(onednn, "_same_bytes", lambda a, b: False)
    w = torch.randn(32, 16)
    a, b, c = onednn.packed_weight(w, False, 8), onednn.packed_weight(w, False, 8), onednn.packed_weight(w, False, 16)
    assert a is b and a.is_mkldnn
    assert (a is c) == (alike and onednn._hint_free[(w.dtype, (32, 16), False, "onednn")])
    assert onednn.packed_weight(w, False, 1) is not a
    x = torch.randn(16, 16)
    torch.testing.assert_close(onednn.linear_fn(c, None)(x), x @ w.t(), rtol=1e-5, atol=1e-5)
    wt = torch.randn(16, 32)  # [K, N] (an addmm weight): packed as its transpose
    torch.testing.assert_close(onednn.linear_fn(onednn.packed_weight(wt, True, 8), None)(x[:8]), x[:8] @ wt)


def test_the_first_row_count_is_packed_once_and_the_alike_check_waits_for_a_second(monkeypatch):
    """A program with one prefill length reorders each weight once (no check); the check (two more reorders here:
    2 and PACK_ROWS rows) runs when a second row count asks, and its answer is what the real bytes say."""
    monkeypatch.setattr(onednn, "_hint_free", {})
    calls = []
    real = onednn._reorder
    monkeypatch.setattr(onednn, "_reorder", lambda w, t, r, k="onednn": calls.append(r) or real(w, t, r, k))
    w = torch.randn(48, 32)
    first = onednn.packed_weight(w, False, 128)
    assert calls == [128] and onednn._hint_free == {}
    second = onednn.packed_weight(w, False, 64)
    alike = onednn._same_bytes(real(w, False, 2), real(w, False, onednn.PACK_ROWS))
    assert onednn._hint_free == {(w.dtype, (48, 32), False, "onednn"): alike}
    assert calls[:3] == [128, 2, onednn.PACK_ROWS] and (second is first) == alike
    assert len(calls) == (3 if alike else 4)
    x = torch.randn(64, 32)
    torch.testing.assert_close(onednn.linear_fn(second, None)(x), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_a_packing_burst_copies_transposed_weights_through_one_buffer_and_packs_the_same_bytes():
    g = torch.Generator().manual_seed(3)
    big, small = torch.randn(64, 96, generator=g), torch.randn(32, 48, generator=g)  # [K, N]: packed as transposes
    alone = [onednn._reorder(w, True, 16) for w in (big, small)]
    with onednn.packing():
        burst = [onednn._reorder(w, True, 16) for w in (big, small)]
        assert onednn._scratch[0].numel() == 64 * 96  # grown once for the larger, reused for the smaller
    assert onednn._scratch == []  # freed after the burst
    assert all(onednn._same_bytes(a, b) for a, b in zip(alone, burst, strict=True))
    x = torch.randn(16, 64, generator=g)
    torch.testing.assert_close(onednn.linear_fn(burst[0], None)(x), x @ big, rtol=1e-5, atol=1e-5)


def test_dtype_ok_says_exactly_whether_onednn_packs_that_dtype_here_and_pick_keeps_the_rest_on_aten(monkeypatch):
    """fp32 packs everywhere; bf16 packs only where oneDNN has bf16 kernels (elsewhere packing raises), and
    :func:`onednn.dtype_ok` says which. Where it says no, :func:`onednn.pick` sends the product to ATen under every
    policy, so an emulated bf16 model never reaches the packing (the bug: a raw RuntimeError from the reorder)."""
    monkeypatch.delenv("HETFORGE_GEMM", raising=False)
    for dtype in onednn.DTYPES:
        try:
            onednn._reorder(torch.randn(48, 32).to(dtype), False, 16)
            packs = True
        except RuntimeError:
            packs = False
        assert onednn.dtype_ok(dtype) == packs, dtype
    assert onednn.dtype_ok(torch.float32) and not onednn.dtype_ok(torch.float16)
    monkeypatch.setattr(onednn, "_bf16_kernels", lambda: False)  # as on a CPU without them
    assert not onednn.dtype_ok(torch.bfloat16)
    for pol in ("auto", "onednn"):
        monkeypatch.setenv("HETFORGE_GEMM", pol)
        assert onednn.pick(200, 96, 112, torch.bfloat16) == "aten"
    assert onednn.pick(200, 96, 112, torch.float32) == "onednn"  # fp32 still packs (the policy left at onednn)


def test_transposed_weights_pack_to_the_same_bytes_through_the_native_transpose_and_aten():
    """For every dtype oneDNN packs here (:func:`onednn.dtype_ok`: fp32 always, bf16 where it has the kernels)."""
    for dtype in filter(onednn.dtype_ok, onednn.DTYPES):
        _same_bytes_both_ways(dtype)


def _same_bytes_both_ways(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(72, 40, generator=g).to(dtype)  # [K, N], not a multiple of the native kernel's 32-tiles
    ways = []
    for use_native in (True, False):
        with contextlib.nullcontext() if use_native else native.disabled():
            ways.append(onednn._reorder(w, True, 16))  # no burst: a fresh buffer (native) or oneDNN's strided read
            with onednn.packing():
                ways.append(onednn._reorder(w, True, 16))  # through the burst's buffer
    assert all(onednn._same_bytes(ways[0], p) for p in ways[1:])


def test_same_bytes_reads_the_packed_bytes_in_place():
    w = torch.randn(40, 24)
    p, q = onednn._reorder(w, False, 8), onednn._reorder(w, False, 8)
    assert onednn._same_bytes(p, q)
    assert not onednn._same_bytes(p, onednn._reorder(w + 1, False, 8))
    view = onednn._bytes(p)
    assert view.numel() == torch.ops.mkldnn._nbytes(p) and view.data_ptr() == torch.ops.mkldnn.data_ptr(p)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "qwen2-tiny"])
def test_executor_runs_multi_row_linears_on_onednn_within_kl_1e8(name, monkeypatch):
    monkeypatch.setenv("HETFORGE_GEMM", "onednn")
    module, inputs, cg = captured(name)
    res = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name)
    exe = res.executable
    assert exe.stats.onednn_gemm > 0
    assert "_linear_pointwise" in str([v for k, v in exe._globals.items() if k.startswith("_dnn")])
    rep = verify(module, exe, inputs, kl_threshold=1e-8)
    assert rep.passed and rep.top1_agree == 1.0, rep
    # results survive the next call (oneDNN's results are fresh tensors, not arena slices)
    first = exe(*inputs).clone()
    exe(*inputs)
    torch.testing.assert_close(exe(*inputs), first)


@pytest.mark.parametrize("name, fused", [("gpt2-tiny", 4), ("llama-tiny", 4)])
def test_residual_adds_ride_on_the_product_before_them_with_the_same_bits(name, fused, monkeypatch):
    """Each layer's two residual adds (after the attention output product and after the MLP's last product: GPT-2's
    Conv1D addmm, Llama's gated MLP down product) become the oneDNN product's ``add`` post-op: the add's own
    instruction runs nothing, and the fp32 logits are bit for bit those of the program that adds separately
    (HETFORGE_RESIDUAL_FUSION=0), which fuses none."""
    monkeypatch.setenv("HETFORGE_GEMM", "onednn")
    module, inputs, cg = captured(name)
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name).executable
    assert exe.stats.onednn_residual == fused and exe.source.count("'add')") == fused
    monkeypatch.setenv("HETFORGE_RESIDUAL_FUSION", "0")
    apart = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name + "-apart").executable
    assert apart.stats.onednn_residual == 0 and "'add')" not in apart.source
    torch.testing.assert_close(exe(*inputs), apart(*inputs), rtol=0, atol=0)
    assert verify(module, exe, inputs, kl_threshold=1e-8).passed


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_a_residual_add_residual_pick_gives_to_aten_stays_its_own_instruction_with_the_same_bits(name, monkeypatch):
    """Where residual_pick answers ``aten`` (forced here; it measures under the auto policy), the residual add after a
    product on oneDNN runs as its own instruction (no ``add`` post-op in the program), with the logits of the
    program whose products take it as the post-op, bit for bit."""
    import hetforge.executor.onednn as exec_onednn

    monkeypatch.setenv("HETFORGE_GEMM", "onednn")
    module, inputs, cg = captured(name)
    got = {}
    for who in ("aten", "onednn"):
        monkeypatch.setattr(exec_onednn, "residual_pick", lambda *a, who=who, **kw: who)
        exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=f"{name}-res-{who}").executable
        got[who] = (exe.stats.onednn_residual, exe.source.count("'add')"), exe(*inputs))
    assert got["aten"][:2] == (0, 0) and got["onednn"][0] == got["onednn"][1] == 4  # two adds a layer, two layers
    torch.testing.assert_close(got["aten"][2], got["onednn"][2], rtol=0, atol=0)


def test_the_residual_add_choice_is_measured_once_kept_seeded_and_refused_when_pinned(monkeypatch):
    """residual_pick times the product then ATen's add against oneDNN's ``add`` post-op once per shape and bias,
    keeps the answer with pick's choices (activation ``residual:bias`` / ``residual:none``, other side ``aten-add``),
    takes one seeded from an earlier process, answers the post-op without measuring under a forced policy, and
    refuses to measure in a pinned process."""
    monkeypatch.delenv("HETFORGE_GEMM", raising=False)
    rows, k, n = 37, 56, 72  # a shape no other test uses
    got = onednn.residual_pick(rows, k, n, torch.float32, True)
    assert got in ("onednn", "aten")
    rec = [c for c in onednn.measured_choices()
           if (c["rows"], c["k"], c["n"], c["act"]) == (rows, k, n, "residual:bias")]
    assert len(rec) == 1 and rec[0]["kernel"] == got and rec[0]["aten_side"] == "aten-add"
    assert (rec[0]["ratio"] > 1.0) == (got == "onednn") and rec[0]["aten_s"] > 0 and rec[0]["onednn_s"] > 0

    def no_measuring(*a, **kw):
        raise AssertionError("measured again")

    monkeypatch.setattr(onednn, "_bench_pair", no_measuring)
    assert onednn.residual_pick(rows, k, n, torch.float32, True) == got  # kept
    monkeypatch.setenv("HETFORGE_GEMM", "onednn")
    assert onednn.residual_pick(rows + 1, k, n, torch.float32, True) == "onednn"
    monkeypatch.delenv("HETFORGE_GEMM")
    other = "onednn" if got == "aten" else "aten"
    onednn.seed_choices([{**rec[0], "rows": rows + 2, "kernel": other, "onednn": other == "onednn"}])
    assert onednn.residual_pick(rows + 2, k, n, torch.float32, True) == other  # from an earlier process
    monkeypatch.setattr(onednn, "_pinned", [torch.get_num_threads()])
    with pytest.raises(onednn.ChoiceRefused, match="residual-add choice"):
        onednn.residual_pick(rows, k, n, torch.float32, False)  # no bias: another choice, not measured yet


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "qwen2-tiny"])
def test_views_of_a_onednn_result_are_made_in_one_step_with_the_same_bits(name, monkeypatch):
    """The chains of views over oneDNN's results (a fused projection's split into heads, GPT-2's 3-D/2-D round
    trips) are composed: no view call survives on them, only one ``as_strided`` per register a non-view
    instruction reads; the logits are bit for bit those of the program that makes every view
    (HETFORGE_COMPOSE_VIEWS=0), and survive the next call."""
    monkeypatch.setenv("HETFORGE_GEMM", "onednn")
    module, inputs, cg = captured(name)
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name).executable
    assert exe.stats.composed_views > 0 and "as_strided" in exe.source
    monkeypatch.setenv("HETFORGE_COMPOSE_VIEWS", "0")
    each = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name + "-each").executable
    assert each.stats.composed_views == 0 and "as_strided" not in each.source
    assert exe.source.count("\n") < each.source.count("\n")
    first = exe(*inputs).clone()
    torch.testing.assert_close(first, each(*inputs), rtol=0, atol=0)
    exe(*inputs)
    torch.testing.assert_close(exe(*inputs), first, rtol=0, atol=0)
    assert verify(module, exe, inputs, kl_threshold=1e-8).passed


def test_a_product_read_through_a_transpose_keeps_its_add_apart(monkeypatch):
    """``x·Wᵀ`` transposed, then added: the add is not taken by the product (its rows would meet the wrong
    elements of ``r``), and the program computes what the module does."""
    from hetforge.frontend import capture

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x, r):
            return self.fc(x).t() + r

    monkeypatch.setenv("HETFORGE_GEMM", "onednn")
    g = torch.Generator().manual_seed(0)
    module, inputs = M().eval(), (torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g))
    exe = compile_graph(capture(module, inputs).gm, soc="host", example_inputs=inputs, name="t").executable
    assert exe.stats.onednn_gemm == 1 and exe.stats.onednn_residual == 0
    with torch.no_grad():
        torch.testing.assert_close(exe(*inputs), module(*inputs), rtol=1e-5, atol=1e-5)


def test_prepack_packs_every_onednn_weight_once_and_the_run_after_it_gives_the_same_bits(monkeypatch):
    """``Executable.prepack`` (what a cold request does while the decode program's child still runs) packs each
    oneDNN weight of the program, a second call packs nothing, and the program then computes what a program packing
    in its first call computes."""
    from hetforge.kernels.onednn import LazyPacked

    monkeypatch.setenv("HETFORGE_GEMM", "onednn")
    module, inputs, cg = captured("gpt2-tiny")
    lazy_first = compile_graph(cg.gm, soc="host", example_inputs=inputs, name="a").executable
    packed_first = compile_graph(cg.gm, soc="host", example_inputs=inputs, name="b").executable
    weights = [v for v in packed_first._globals.values() if isinstance(v, LazyPacked)]
    assert weights and all(v.packed is None for v in weights)
    assert packed_first.prepack() == len(weights) and all(v.packed is not None for v in weights)
    assert packed_first.prepack() == 0
    torch.testing.assert_close(packed_first(*inputs), lazy_first(*inputs), rtol=0, atol=0)


def test_a_shape_goes_to_onednn_over_mkl_only_by_more_than_this_hosts_margin(monkeypatch):
    """Against MKL's packed sgemm oneDNN needs a ratio above 1 + the host's margin (MKL_MARGIN where MKL won the
    calibration sequence, else 0); against ATen above 1; a choice seeded from an earlier process is decided again
    by this rule."""
    m = onednn.MKL_MARGIN
    monkeypatch.setattr(onednn, "_margins", {onednn.threads(): m})
    assert onednn._decide(1.0 + m / 2, "mkl") == "mkl" and onednn._decide(1.0 + 2 * m, "mkl") == "onednn"
    assert onednn._decide(1.0 + m / 2, "aten") == "onednn" and onednn._decide(0.99, "aten") == "aten"
    monkeypatch.setattr(onednn, "_margins", {onednn.threads(): 0.0})
    assert onednn._decide(1.01, "mkl") == "onednn" and onednn._decide(0.99, "mkl") == "mkl"
    monkeypatch.setattr(onednn, "_margins", {onednn.threads(): m})
    if not onednn.mkl_available():
        return
    rows = native.PANEL_MAX + 7  # above the rows the panel GEMM takes by rule (nothing measured there)
    key = dict(rows=rows, k=40, n=24, dtype="float32", threads=torch.get_num_threads(), act="none")
    onednn.seed_choices([{**key, "kernel": "onednn", "onednn": True, "aten_s": 1.05e-5, "onednn_s": 1e-5,
                          "ratio": 1.0 + m / 2, "aten_side": "mkl-packed"}])
    assert onednn.pick(rows, 40, 24, torch.float32) == "mkl"


def test_the_hosts_margin_comes_from_its_calibration_file_and_a_damaged_file_is_measured_again(monkeypatch, tmp_path):
    monkeypatch.setenv("HETFORGE_CACHE", str(tmp_path))
    monkeypatch.setattr(onednn, "_margins", {})
    n = onednn.threads()
    path = onednn._margin_file(n)
    assert tmp_path in path.parents
    path.parent.mkdir(parents=True)

    def no_measuring(*a, **k):
        raise AssertionError("measured although the file has the ratio")

    monkeypatch.setattr(onednn, "_bench_pair", no_measuring)
    path.write_text(json.dumps({"mkl_over_onednn": 0.93}))  # MKL ran the sequence faster: the margin applies
    assert onednn.mkl_margin() == onednn.MKL_MARGIN
    monkeypatch.setattr(onednn, "_margins", {})
    path.write_text(json.dumps({"mkl_over_onednn": 1.2}))  # oneDNN faster: pick's ratio decides alone
    assert onednn.mkl_margin() == 0.0
    calls = []
    monkeypatch.setattr(onednn, "_bench_pair", lambda fa, fb, rounds: calls.append(rounds) or (2.0, 1.0, 2.0))
    monkeypatch.setattr(onednn, "MARGIN_SHAPES", ((16, 24),))  # small, the measurement itself is faked
    monkeypatch.setattr(native, "llc_bytes", lambda: 4096)
    for damaged in ("{not json", json.dumps({"mkl_over_onednn": "nan"}), json.dumps({"other": 1})):
        monkeypatch.setattr(onednn, "_margins", {})
        path.write_text(damaged)
        assert onednn.mkl_margin() == 0.0 and calls
        assert json.loads(path.read_text())["mkl_over_onednn"] == 2.0  # measured again and written back
        calls.clear()
    monkeypatch.setattr(onednn, "_margins", {})
    monkeypatch.setattr(onednn, "_pinned", [n])
    path.unlink()
    assert onednn.mkl_margin() == onednn.MKL_MARGIN and not calls  # must not measure: the older rule
    assert not path.exists()


def test_the_hosts_margin_is_measured_on_real_kernels_and_kept(monkeypatch, tmp_path):
    assert onednn.mkl_available(), "the pinned torch CPU wheel ships MKL's packed sgemm on x86_64"
    monkeypatch.setenv("HETFORGE_CACHE", str(tmp_path))
    monkeypatch.setattr(onednn, "_margins", {})
    got = onednn.mkl_margin()
    rec = json.loads(onednn._margin_file(onednn.threads()).read_text())
    assert rec["mkl_s"] > 0 and rec["onednn_s"] > 0 and rec["copies"] >= 2
    assert got == (onednn.MKL_MARGIN if rec["mkl_over_onednn"] <= 1.0 else 0.0)


def test_policy_aten_keeps_every_product_on_aten(monkeypatch):
    monkeypatch.setenv("HETFORGE_GEMM", "aten")
    module, inputs, cg = captured("llama-tiny")
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, name="llama-tiny").executable
    assert exe.stats.onednn_gemm == 0
    assert verify(module, exe, inputs, kl_threshold=1e-8).passed


def test_auto_policy_measures_both_kernels_once_per_shape(monkeypatch):
    monkeypatch.delenv("HETFORGE_GEMM", raising=False)
    rows, k, n = native.PANEL_MAX + 5, 48, 80  # a shape no other test uses, above the panel GEMM's rows
    first = onednn.choose(rows, k, n, torch.float32)
    got = [c for c in onednn.measured_choices() if (c["rows"], c["k"], c["n"]) == (rows, k, n)]
    assert len(got) == 1 and got[0]["aten_s"] > 0 and got[0]["onednn_s"] > 0
    margin = onednn.mkl_margin() if got[0]["aten_side"] == "mkl-packed" else 0.0
    assert got[0]["onednn"] == (got[0]["ratio"] > 1.0 + margin)  # the median per-round ratio decided
    assert first == (got[0]["kernel"] != "aten")  # a packed kernel (oneDNN, or MKL's on its side) runs it
    assert got[0]["aten_side"] == ("mkl-packed" if onednn.mkl_available() else "aten")
    assert got[0]["kernel"] in (("onednn", "mkl") if onednn.mkl_available() else ("onednn", "aten"))
    assert onednn.choose(rows, k, n, torch.float32) == first
    assert len([c for c in onednn.measured_choices() if (c["rows"], c["k"], c["n"]) == (rows, k, n)]) == 1
    assert not onednn.choose(1, k, n, torch.float32)  # one row: the native GEMV's job
    assert not onednn.choose(rows, k, n, torch.int8)


def test_the_choice_is_measured_per_activation_and_old_rows_without_one_are_not_seeded(monkeypatch):
    """The ATen side of a fused-activation candidate is its ``linear`` plus the activation pass: a separate choice
    (key) per activation; cache rows from before (no ``act``) are not taken."""
    monkeypatch.delenv("HETFORGE_GEMM", raising=False)
    rows, k, n = native.PANEL_MAX + 6, 40, 72  # a shape no other test uses, above the panel GEMM's rows
    onednn.choose(rows, k, n, torch.float32)
    onednn.choose(rows, k, n, torch.float32, act="gelu")
    got = {c["act"]: c for c in onednn.measured_choices() if (c["rows"], c["k"], c["n"]) == (rows, k, n)}
    assert set(got) == {"none", "gelu"} and all(c["aten_s"] > 0 and c["onednn_s"] > 0 for c in got.values())
    assert onednn.decided(rows, k, n, torch.float32, "gelu") == (got["gelu"]["kernel"] != "aten")
    r7, r9 = native.PANEL_MAX + 7, native.PANEL_MAX + 9
    old = {"rows": r7, "k": 40, "n": 72, "dtype": "float32", "threads": torch.get_num_threads(), "aten_s": 1.0,
           "onednn_s": 2.0, "ratio": 0.5, "onednn": False}
    onednn.seed_choices([old, {**old, "rows": r9, "act": "silu"}])
    assert onednn.decided(r7, 40, 72, torch.float32) is None  # no activation recorded: measured afresh
    assert onednn.decided(r9, 40, 72, torch.float32, "silu") is False


def test_calibration_times_every_packed_gemm_too():
    """The fp32 compute bound is the fastest of ATen's ``mm``, oneDNN's packed product and (where this torch has
    it) MKL's packed sgemm: each is timed, and each computes the product."""
    from hetforge.hardware import calibrate

    fns = calibrate._gemm_fns("fp32", 64)
    assert len(fns) == 2 + onednn.mkl_available()
    for fn in fns[1:]:
        torch.testing.assert_close(fn(), fns[0](), rtol=1e-4, atol=1e-4)
    a = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    b = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(onednn.gemm_fn(a, b)(), a @ b, rtol=1e-4, atol=1e-4)
    if onednn.mkl_available():
        torch.testing.assert_close(onednn.mkl_gemm_fn(a, b)(), a @ b, rtol=1e-4, atol=1e-4)


needs_mkl = pytest.mark.skipif(not onednn.mkl_available(),
                               reason="this torch has no MKL packed sgemm op (non-x86 wheel): oneDNN or ATen runs")


@needs_mkl
@pytest.mark.parametrize("weight_t", [False, True])
def test_mkl_packed_products_match_aten_and_one_packing_serves_every_row_count_where_alike(weight_t):
    """One MKL packing serves every row count exactly where :func:`onednn._alike` finds the products on a 2-row and
    a PACK_ROWS-row packing bit for bit equal; each product matches ATen's ``linear`` on the ``[N, K]`` weight,
    and a ``[K, N]`` weight (Conv1D) is packed as its transpose."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 80, generator=g) if not weight_t else torch.randn(80, 96, generator=g)
    nk = w.t() if weight_t else w  # [N=96, K=80]
    b = torch.randn(96, generator=g)
    packs = [onednn.packed_weight(w, weight_t, rows, "mkl") for rows in (16, 128, 5)]
    alike = onednn._hint_free[(w.dtype, tuple(w.shape), weight_t, "mkl")]
    assert alike == (packs[0] is packs[1] is packs[2])
    for rows in (2, 5, 16, 128):
        x = torch.randn(rows, 80, generator=g)
        got = onednn.mkl_linear(x, onednn.packed_weight(w, weight_t, rows, "mkl"), nk, b, rows)
        torch.testing.assert_close(got, F.linear(x, nk.contiguous(), b), rtol=1e-5, atol=1e-5)
        own = torch.ops.mkl._mkl_reorder_linear_weight(nk.contiguous(), rows)  # packed for exactly these rows
        assert torch.equal(got, onednn.mkl_linear(x, own, nk, b, rows)) or not alike, rows


@needs_mkl
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "qwen2-tiny"])
def test_executor_runs_multi_row_linears_on_mkl_packed_sgemm_within_kl_1e8(name, monkeypatch):
    """``HETFORGE_GEMM=mkl``: every multi-row product on MKL's packed weight (activation, gated MLP product and
    residual add in place after it), the residual adds the same bits as the program that adds apart, KL ≤ 1e-8
    against the eager module, and results that survive the next call."""
    monkeypatch.setenv("HETFORGE_GEMM", "mkl")
    module, inputs, cg = captured(name)
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name).executable
    assert exe.stats.mkl_gemm > 0 and exe.stats.onednn_gemm == 0 and "_mkl_linear" in exe.source + str(
        [v for k, v in exe._globals.items() if k.startswith("_mkl")])
    rep = verify(module, exe, inputs, kl_threshold=1e-8)
    assert rep.passed and rep.top1_agree == 1.0, rep
    first = exe(*inputs).clone()
    exe(*inputs)
    torch.testing.assert_close(exe(*inputs), first, rtol=0, atol=0)
    monkeypatch.setenv("HETFORGE_RESIDUAL_FUSION", "0")
    apart = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=name + "-apart").executable
    assert apart.stats.onednn_residual == 0 < exe.stats.onednn_residual
    torch.testing.assert_close(apart(*inputs), first, rtol=0, atol=0)


def test_choice_statistic_is_the_median_round_ratio_so_one_spoiled_round_does_not_decide(monkeypatch):
    now = [0.0]  # a fake clock the two "kernels" advance: deterministic on a loaded host
    calls = {"b": 0}
    monkeypatch.setattr(onednn.time, "perf_counter", lambda: now[0])

    def fa():
        now[0] += 2.0

    def fb():  # twice as fast, except one measured round in which "another process took the core"
        calls["b"] += 1
        now[0] += 30.0 if calls["b"] == 4 else 1.0

    ta, tb, ratio = onednn._bench_pair(fa, fb, rounds=5)
    assert calls["b"] == 2 + 5  # two warm-up calls, then one per round
    assert ratio == 2.0 and (ta, tb) == (2.0, 1.0)  # the spoiled round (ratio 1/15) is left out by the median


@pytest.mark.parametrize("ratios", [[2, 2, 2, 0.1, 0.1], [0.5, 0.5, 0.5, 9, 9], [2, 0.5, 2, 0.5, 2],
                                    [0.5, 2, 0.5, 2, 2], [2, 2, 0.5, 0.5, 0.5]])
def test_choice_stops_once_a_majority_of_rounds_agrees_with_the_full_median(monkeypatch, ratios):
    now = [0.0]
    calls = {"b": 0}
    monkeypatch.setattr(onednn.time, "perf_counter", lambda: now[0])

    def fa():
        now[0] += 1.0

    def fb():  # fa ÷ fb in measured round i is ratios[i] (the two warm-up calls come first)
        calls["b"] += 1
        now[0] += 1.0 / ratios[calls["b"] - 3] if calls["b"] > 2 else 1.0

    _, _, early = onednn._bench_pair(fa, fb, rounds=5, decide=1.0)
    rounds = calls["b"] - 2
    first = ratios[:rounds]
    assert max(sum(r > 1 for r in first), sum(r <= 1 for r in first)) >= 3  # stopped only on a decided majority
    assert rounds == 5 or rounds < 5 and (sum(r > 1 for r in first) == 3 or sum(r <= 1 for r in first) == 3)
    assert (early > 1.0) == (statistics.median(ratios) > 1.0)  # the answer the five rounds give


@needs_mkl
def test_mkl_packs_for_at_least_pack_rows_whatever_row_count_asks_first(monkeypatch):
    """MKL's packing takes a row hint: the products are the same bits for any hint, but a packing made for a few
    rows ran many rows up to ~2x slower (docs/arch/runtime.md), and the first program to ask may be a short
    prompt's. So every MKL packing is made for max(rows, PACK_ROWS), and serves every row count."""
    hints = []
    real = torch.ops.mkl._mkl_reorder_linear_weight

    class Recording:
        def __call__(self, w, rows):
            hints.append(rows)
            return real(w, rows)

    monkeypatch.setattr(torch.ops.mkl, "_mkl_reorder_linear_weight", Recording())
    w = torch.randn(96, 64)
    small = onednn.pack(w, False, 16, "mkl")
    big = onednn.pack(w, False, 2 * onednn.PACK_ROWS, "mkl")
    assert hints == [onednn.PACK_ROWS, 2 * onednn.PACK_ROWS]
    x = torch.randn(16, 64)
    torch.testing.assert_close(onednn.mkl_linear(x, small, w, None, 16), F.linear(x, w), rtol=1e-5, atol=1e-5)
    x = torch.randn(2 * onednn.PACK_ROWS, 64)
    torch.testing.assert_close(onednn.mkl_linear(x, big, w, None, x.shape[0]), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_a_gated_mlps_gate_and_up_choice_is_measured_once_kept_seeded_and_refused_when_pinned(monkeypatch):
    """gated_pick times the native gated panel call against oneDNN's two calls (the activation post-op, then the
    ``mul`` post-op) once per shape and keeps the answer with pick's choices (activation ``gated:`` + act), so a
    compile-cache entry seeds it; bf16 and a forced policy take oneDNN's without measuring; a pinned process
    refuses to measure."""
    monkeypatch.delenv("HETFORGE_GEMM", raising=False)
    rows, k, n = native.PANEL_MAX + 11, 48, 80  # a shape no other test uses
    got = onednn.gated_pick(rows, k, n, torch.float32, "silu")
    if not (native.panel_available() and native.epilogue_act("silu")):  # no vectorized panel GEMM with a SiLU
        # epilogue in this build (none, or AVX2's, whose epilogue has no SiLU): oneDNN's two calls, nothing measured
        assert got == "onednn"
        assert not [c for c in onednn.measured_choices() if c["act"] == "gated:silu" and c["rows"] == rows]
        return
    assert got in ("panel", "onednn")
    rec = [c for c in onednn.measured_choices() if (c["rows"], c["k"], c["n"], c["act"]) == (rows, k, n, "gated:silu")]
    assert len(rec) == 1 and rec[0]["kernel"] == got and rec[0]["aten_side"] == "panel-gated"
    assert (rec[0]["ratio"] > 1.0) == (got == "onednn") and rec[0]["aten_s"] > 0 and rec[0]["onednn_s"] > 0

    def no_measuring(*a, **kw):
        raise AssertionError("measured again")

    monkeypatch.setattr(onednn, "_bench_pair", no_measuring)
    assert onednn.gated_pick(rows, k, n, torch.float32, "silu") == got  # kept
    assert onednn.gated_pick(rows, k, n, torch.bfloat16, "silu") == "onednn"
    monkeypatch.setenv("HETFORGE_GEMM", "onednn")
    assert onednn.gated_pick(rows + 1, k, n, torch.float32, "silu") == "onednn"
    monkeypatch.delenv("HETFORGE_GEMM")
    other = "onednn" if got == "panel" else "panel"
    onednn.seed_choices([{**rec[0], "rows": rows + 2, "kernel": other, "onednn": other == "onednn"}])
    assert onednn.gated_pick(rows + 2, k, n, torch.float32, "silu") == other  # from an earlier process
    monkeypatch.setattr(onednn, "_pinned", [torch.get_num_threads()])
    with pytest.raises(onednn.ChoiceRefused, match="gated-MLP choice"):
        onednn.gated_pick(rows + 3, k, n, torch.float32, "silu")


@pytest.mark.parametrize("kernel", ["panel", "onednn"] if native.panel_available() and native.epilogue_act("silu")
                         else ["onednn"])
def test_a_gated_mlp_on_onednns_rows_runs_gate_and_up_as_the_chosen_kernel_within_kl_1e8(kernel, monkeypatch):
    """Above the panel GEMM's rows a gated MLP's products run on oneDNN; its gate and up run as one native gated call
    where gated_pick says ``panel`` (forced here either way), the down product on oneDNN with the residual add,
    and the logits match eager (KL ≤ 1e-8) and each other (1e-5). (The policy is forced to oneDNN for the products,
    and gated_pick's answer by hand: under a forced policy it answers oneDNN itself. ``panel`` only where the
    library has the vectorized panel GEMM with a SiLU epilogue, the only place gated_pick can answer it.)"""
    import hetforge.executor.onednn as exec_onednn

    monkeypatch.setenv("HETFORGE_GEMM", "onednn")  # every product on oneDNN (a measured pick may take MKL here)
    monkeypatch.setattr(exec_onednn, "gated_pick", lambda *a, **kw: kernel)
    module, inputs, cg = captured("llama-tiny", seq=native.PANEL_MAX + 8)
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=f"llama-tiny-gated-{kernel}").executable
    from hetforge.models.zoo import load_model

    layers = load_model("llama-tiny").config.num_hidden_layers
    assert exe.stats.onednn_gemm > 0
    assert exe.stats.panel_gated == (layers if kernel == "panel" else 0)  # one gated MLP a layer
    assert verify(module, exe, inputs, kl_threshold=1e-8).passed
    monkeypatch.setenv("HETFORGE_PANEL_GATED", "0")  # oneDNN's two calls, whatever gated_pick says
    apart = compile_graph(cg.gm, soc="host", example_inputs=inputs, name="llama-tiny-gated-off").executable
    assert apart.stats.panel_gated == 0
    torch.testing.assert_close(exe(*inputs), apart(*inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act,pass_faster", [("silu", True), ("gelu_tanh", False), ("none", True)])
def test_onednns_side_of_an_activation_is_its_post_op_or_its_plain_product_then_the_native_pass_as_timed(
        monkeypatch, act, pass_faster):
    """For an fp32 product with an activation the native epilogue has, pick first times oneDNN's post-op against
    its plain product followed by the native activation pass (the two give the same values) and takes the faster
    as oneDNN's side (``dnnact`` where the pass was faster), then times that side against the other kernel; with
    no activation, or one the library does not apply, there is one timing and no ``dnnact``. The answer is kept in
    measured_choices and taken from there by seed_choices."""
    monkeypatch.delenv("HETFORGE_GEMM", raising=False)
    rows, k, n = native.PANEL_MAX + 11, 40, 56  # a shape no other test uses, above the panel GEMM's rows
    calls = []

    def fake(fa, fb, rounds=onednn.ROUNDS, decide=None):
        calls.append((fa, fb))
        if len(calls) == 1 and two_way:  # the plain product then the pass (fa) against the post-op (fb)
            torch.testing.assert_close(fa(), fb(), rtol=1e-5, atol=1e-5)
            return 1.0, 1.0, 0.5 if pass_faster else 2.0
        return 10.0, 1.0, 10.0  # then oneDNN's side is far faster than the other kernel

    two_way = act != "none" and native.epilogue_act(act)
    monkeypatch.setattr(onednn, "_bench_pair", fake)
    got = onednn.pick(rows, k, n, torch.float32, act=act)
    assert len(calls) == (2 if two_way else 1)
    assert got == ("dnnact" if two_way and pass_faster else "onednn")
    row = [c for c in onednn.measured_choices() if (c["rows"], c["k"], c["n"], c["act"]) == (rows, k, n, act)]
    assert len(row) == 1 and row[0]["kernel"] == got and row[0]["onednn"]
    onednn.seed_choices([{**row[0], "rows": rows + 2}])
    assert onednn.pick(rows + 2, k, n, torch.float32, act=act) == got and len(calls) == (2 if two_way else 1)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_products_chosen_as_dnnact_run_onednns_plain_product_then_the_native_pass_within_kl_1e8(name, monkeypatch):
    """Where pick answers ``dnnact`` for the products with an activation (forced here), the program runs oneDNN's
    plain product and then the native activation pass (a gated MLP: the pass applies the activation and the product
    with up), matches eager (KL ≤ 1e-8) and the program with oneDNN's post-ops (1e-5)."""
    import hetforge.executor.onednn as exec_onednn

    monkeypatch.delenv("HETFORGE_GEMM", raising=False)
    monkeypatch.setattr(exec_onednn, "pick", lambda rows, k, n, dtype, w=None, weight_t=False, act="none":
                        "dnnact" if act != "none" else "onednn")
    module, inputs, cg = captured(name, seq=native.PANEL_MAX + 8)
    exe = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=f"{name}-dnnact").executable
    passes = [v for v in exe._globals.values() if v is native.act_inplace or v in onednn.MKL_ACT.values()]
    assert passes and exe.stats.onednn_gemm > 0 and exe.stats.mkl_gemm == exe.stats.panel_gemm == 0
    assert verify(module, exe, inputs, kl_threshold=1e-8).passed
    monkeypatch.setenv("HETFORGE_GEMM", "onednn")  # every product on oneDNN, activations as its post-ops
    monkeypatch.setattr(exec_onednn, "pick", onednn.pick)
    post = compile_graph(cg.gm, soc="host", example_inputs=inputs, name=f"{name}-post").executable
    assert not [v for v in post._globals.values() if v is native.act_inplace or v in onednn.MKL_ACT.values()]
    torch.testing.assert_close(exe(*inputs), post(*inputs), rtol=1e-5, atol=1e-5)
