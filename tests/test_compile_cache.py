"""The compile cache on disk (hetforge.runtime.compile_cache): miss then hit with equal outputs, any weight change
is another key, corrupt and stale entries are detected, deleted and rebuilt, an unwritable folder warns once."""

import json
import os
import time
from pathlib import Path

import pytest
import torch

from hetforge.models.zoo import load_model
from hetforge.runtime import Engine, compile_cache

TIER = 32


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HETFORGE_COMPILE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HETFORGE_COMPILE_CACHE", raising=False)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def loaded():
    return load_model("gpt2-tiny")


def _prefill(loaded):
    prog, made = Engine(loaded, executor="auto").programs.prefill(TIER)
    assert made
    ids = torch.arange(TIER).reshape(1, TIER) % loaded.vocab_size
    return prog, [t.clone() for t in prog.run(ids, torch.tensor([TIER - 1]))]


def _notes(prog) -> str:
    return "\n".join(prog.notes)


def test_second_engine_hits_the_cache_and_computes_the_same(cache, loaded):
    cold, out_cold = _prefill(loaded)
    assert "compile cache: stored" in _notes(cold) and cold.capture_s > 0
    assert len(list(cache.glob("*.json"))) == 1
    warm, out_warm = _prefill(loaded)
    assert "compile cache: hit" in _notes(warm) and warm.capture_s == 0.0
    for a, b in zip(out_cold, out_warm, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_any_weight_change_is_another_key(cache):
    m = load_model("gpt2-tiny")
    doc = compile_cache.key_document(m.model, {"x": 1}, True, "prefill", TIER)
    with torch.no_grad():
        m.model.transformer.h[0].mlp.c_fc.weight[3, 5] += 1e-3
    doc2 = compile_cache.key_document(m.model, {"x": 1}, True, "prefill", TIER)
    assert doc["weights"] != doc2["weights"] and compile_cache.key_of(doc) != compile_cache.key_of(doc2)
    assert compile_cache.key_of(compile_cache.key_document(m.model, {"x": 2}, True, "prefill", TIER)) \
        != compile_cache.key_of(doc2)  # options are in the key too


def test_a_source_change_outside_the_runtime_changes_the_digest(monkeypatch):
    """Any hetforge source change (a pass, the cost model, lowering) must invalidate cached programs, not only a
    change in hetforge/runtime/ where the cache module lives."""
    from pathlib import Path

    import hetforge

    before = compile_cache.source_digest()
    target = Path(hetforge.__file__).resolve().parent / "passes" / "__init__.py"
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: real(self) + b"#" if self == target else real(self))
    monkeypatch.setattr(compile_cache, "_source_digest", [])
    assert compile_cache.source_digest() != before


def test_captured_module_and_input_shapes_are_in_the_key(cache):
    """A batched decode and a batch-1 decode of one cache length are different programs: different keys."""
    from hetforge.runtime.batched import BatchedDecodeModule
    from hetforge.runtime.static_kv import DecodeModule

    m = load_model("gpt2-tiny")
    one = compile_cache.key_document(m.model, {}, True, "decode", 32, DecodeModule(m.model), (torch.zeros(1, 1),))
    four = compile_cache.key_document(m.model, {}, True, "decode", 32, DecodeModule(m.model), (torch.zeros(4, 1),))
    batched = compile_cache.key_document(m.model, {}, True, "decode", 32, BatchedDecodeModule(m.model),
                                         (torch.zeros(1, 1),))
    assert len({compile_cache.key_of(d) for d in (one, four, batched)}) == 3


@pytest.mark.parametrize("damage", ["truncate", "edit", "stale-key", "garbage-tensors"])
def test_corrupt_or_stale_entry_is_detected_and_rebuilt(cache, loaded, damage, capsys):
    _, ref = _prefill(loaded)
    compile_cache._warned.clear()
    (entry,) = cache.glob("*.json")
    text = entry.read_text()
    if damage == "truncate":
        entry.write_text(text[: len(text) // 2])
    elif damage == "edit":
        entry.write_text(text.replace('"aten.', '"aten.X', 1))
    elif damage == "stale-key":
        head, body = text.split("\n", 1)
        h = json.loads(head)
        h["key"]["torch"] = "0.0.0"
        entry.write_text(json.dumps(h, sort_keys=True) + "\n" + body)
    else:
        entry.with_suffix(".pt").write_bytes(b"not a tensor file")
    prog, out = _prefill(loaded)
    notes = _notes(prog)
    if damage == "garbage-tensors" and "compile cache: hit" in notes:
        pytest.fail("an entry with a damaged tensor file was used")
    assert "deleted, rebuilt" in notes and "compile cache: stored" in notes, notes
    assert compile_cache.cache_state(prog.notes) == "rebuilt, stored"
    err = capsys.readouterr().err.splitlines()
    (line,) = [ln for ln in err if ln.startswith("warning: compile cache entry")]  # one line on stderr
    assert entry.stem[:12] in line and "compiled again (never used)" in line, line
    want = "stale" if damage == "stale-key" else "corrupt"
    if damage != "garbage-tensors":  # gpt2-tiny's prefill may hold no pass-made tensors: then the .pt is unread
        assert want in notes
    for a, b in zip(ref, out, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    again, _ = _prefill(loaded)
    assert "compile cache: hit" in _notes(again) and compile_cache.cache_state(again.notes) == "hit"


def test_hetforge_run_says_which_programs_came_from_the_cache_and_warns_of_a_rebuilt_entry(cache):
    from typer.testing import CliRunner

    from hetforge.cli.common import app
    from hetforge.cli.main import _load_commands

    _load_commands()
    args = ["run", "gpt2-tiny", "-p", "hello there", "-n", "4", "--json"]
    runs = []
    for _ in range(2):
        compile_cache._warned.clear()
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        runs.append(json.loads(res.stdout)["compile_cache"])
    assert set(runs[0].values()) == {"stored"} and set(runs[1].values()) == {"hit"}, runs
    assert set(runs[0]) == set(runs[1]) and len(runs[0]) == 2, runs  # the prefill and the decode program
    for entry in cache.glob("*.json"):
        entry.write_text(entry.read_text()[:100])  # cut off: corrupt
    compile_cache._warned.clear()
    res = CliRunner().invoke(app, args[:-1])
    assert res.exit_code == 0, res.output
    assert "(compile cache rebuilt, stored)" in res.stdout, res.stdout
    assert res.stderr.count("warning: compile cache entry") == 2, res.stderr


def test_unwritable_cache_folder_compiles_with_one_warning(tmp_path, monkeypatch, loaded, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("HETFORGE_COMPILE_CACHE_DIR", str(blocker / "cache"))  # a folder under a file: never creatable
    compile_cache._warned.clear()
    p1, out1 = _prefill(loaded)
    p2, out2 = _prefill(loaded)
    err = capsys.readouterr().err
    assert err.count("warning: compile cache folder") == 1, err
    assert "compile cache: hit" not in _notes(p2)
    for a, b in zip(out1, out2, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_folder_keeps_within_its_size_bound_and_keeps_the_entry_just_written(cache, loaded, monkeypatch):
    """End to end on real entries (the least-recently-used order itself: test_evict_deletes_least_recently_used_...)."""
    _prefill(loaded)
    (first,) = list(cache.glob("*.json"))
    size = first.stat().st_size + first.with_suffix(".pt").stat().st_size
    monkeypatch.setenv(compile_cache.MAX_GB_ENV, str(1.5 * size / 2**30))  # room for one entry, not two
    eng = Engine(loaded, executor="auto")
    eng.programs.prefill(TIER)  # a hit: refreshes the first entry
    eng.programs.prefill(16)  # a second entry: the first is now the least recently used, and goes
    left = list(cache.glob("*.json"))
    assert len(left) == 1 and left[0] != first and not first.with_suffix(".pt").exists()
    monkeypatch.setenv(compile_cache.MAX_GB_ENV, str(100 * size / 2**30))
    _prefill(loaded)  # stored again, nothing evicted under a roomy bound
    assert len(list(cache.glob("*.json"))) == 2


def _entry(folder, key: str, mtime: float, size: int = 500) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{key}.json").write_bytes(b"j" * size)
    (folder / f"{key}.pt").write_bytes(b"t" * size)
    os.utime(folder / f"{key}.json", (mtime, mtime))


def test_evict_deletes_least_recently_used_entries_first_and_never_the_kept_one(cache, monkeypatch):
    for i, key in enumerate("abcd"):
        _entry(cache, key, 1000.0 * (i + 1))  # a is the least recently used, d the most
    monkeypatch.setenv(compile_cache.MAX_GB_ENV, str(3.5 * 1000 / 2**30))  # room for three entries
    assert compile_cache.evict() == ["a"]
    monkeypatch.setenv(compile_cache.MAX_GB_ENV, str(1.5 * 1000 / 2**30))  # room for one
    assert compile_cache.evict(keep="b") == ["c", "d"]  # b is the oldest left, but kept
    assert sorted(p.name for p in cache.iterdir()) == ["b.json", "b.pt"]


def test_evict_removes_stale_leftovers_of_stores_that_died(cache, monkeypatch):
    _entry(cache, "live", 1000.0)
    old = time.time() - 2 * compile_cache.STALE_S
    for name in (".x.pt.123.tmp", ".x.json.123.tmp", "orphan.pt", "fresh.pt", ".y.pt.9.tmp"):
        (cache / name).write_bytes(b"z")
        if name not in ("fresh.pt", ".y.pt.9.tmp"):  # these two could be a store in progress: kept
            os.utime(cache / name, (old, old))
    assert compile_cache.evict() == []
    assert sorted(p.name for p in cache.iterdir()) == [".y.pt.9.tmp", "fresh.pt", "live.json", "live.pt"]


@pytest.mark.parametrize("fails", ["tensors", "json"])
def test_a_store_that_fails_midway_leaves_nothing_behind_and_compiles(cache, loaded, monkeypatch, capsys, fails):
    """A full disk: torch.save raises RuntimeError (not OSError) after a partial write, or the JSON write fails
    after the tensor file was renamed into place. One warning, the program compiled, no file left."""
    real_save, real_write = torch.save, Path.write_text

    def save(obj, f, *a, **k):
        if fails == "tensors":
            Path(f).write_bytes(b"partial")
            raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file")
        return real_save(obj, f, *a, **k)

    def write_text(self, *a, **k):
        if fails == "json" and self.name.endswith(".tmp"):
            real_write(self, "partial")
            raise OSError(28, "No space left on device")
        return real_write(self, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(Path, "write_text", write_text)
    compile_cache._warned.clear()
    prog, _ = _prefill(loaded)
    assert capsys.readouterr().err.count("warning: compile cache folder") == 1
    assert "compile cache: stored" not in _notes(prog)
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize("bad", ["lots", "0", "-1", "inf"])
def test_a_bad_size_bound_is_a_usage_error_naming_the_variable(cache, loaded, monkeypatch, bad):
    from hetforge.errors import UsageError

    monkeypatch.setenv(compile_cache.MAX_GB_ENV, bad)
    with pytest.raises(UsageError, match="HETFORGE_COMPILE_CACHE_MAX_GB"):
        Engine(loaded, executor="auto").programs.prefill(TIER)


def test_cache_off(cache, loaded, monkeypatch):
    monkeypatch.setenv("HETFORGE_COMPILE_CACHE", "0")
    prog, _ = _prefill(loaded)
    assert "compile cache" not in _notes(prog) and not cache.exists()


def test_garbled_tensor_values_in_a_valid_tensor_file_are_detected(cache, loaded):
    """A KEY.pt that still loads but whose numbers changed (the JSON's sha256 does not cover it) is caught by the
    CRC of each pass-made tensor, deleted and rebuilt, never used."""
    _, ref = _prefill(loaded)
    (pt,) = cache.glob("*.pt")
    tensors = torch.load(pt, weights_only=True)
    assert tensors, "gpt2-tiny's prefill keeps pass-made tensors (folded constants) in its entry"
    name = next(iter(tensors))
    flat = tensors[name].reshape(-1)
    flat[0] = flat[0] + 1.0 if flat.is_floating_point() else flat[0] + 1
    torch.save(tensors, pt)
    prog, out = _prefill(loaded)
    notes = _notes(prog)
    assert "compile cache: hit" not in notes and "does not match its checksum" in notes, notes
    assert "deleted, rebuilt" in notes and "compile cache: stored" in notes
    for a, b in zip(ref, out, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_seeded_zoo_weights_are_keyed_by_their_recipe_until_changed():
    a, b, other = load_model("gpt2-tiny"), load_model("gpt2-tiny"), load_model("gpt2-tiny", seed=1)
    fa = compile_cache.weights_fingerprint(a.model)
    assert fa == compile_cache.weights_fingerprint(b.model)  # same recipe, same bytes
    assert fa != compile_cache.weights_fingerprint(other.model)  # another seed
    for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values(), strict=True):
        assert torch.equal(x, y)  # what the recipe key relies on: the same recipe made the same bytes
    with torch.no_grad():
        b.model.transformer.h[1].attn.c_proj.bias[0] += 1e-3  # modified in place: no longer the recipe
    assert compile_cache.weights_fingerprint(b.model) not in (fa, compile_cache.weights_fingerprint(other.model))
    c = load_model("gpt2-tiny")
    c.model.transformer.ln_f.weight = torch.nn.Parameter(c.model.transformer.ln_f.weight.detach().clone())
    fc = compile_cache.weights_fingerprint(c.model)  # a replaced tensor (same bytes): read, not taken on trust
    assert fc != fa and fc == compile_cache.weights_fingerprint(c.model)


def _stored_this_run(prog) -> bool:
    """Compiled and stored by this run: here, or by the forked child that built it alongside (runtime.ahead)."""
    notes = "\n".join(prog.notes)
    return "compile cache: stored" in notes or "stored in the compile cache by a forked child" in notes


def _greedy(loaded, **engine):
    from hetforge.runtime import SamplingParams

    eng = Engine(loaded, executor="auto", **engine)
    r = eng.generate(list(range(1, TIER + 1)), SamplingParams(max_new_tokens=6, ignore_eos=True))
    return eng, r.tokens


@pytest.mark.parametrize("quantize", ["none", "w8"])
def test_warm_hit_builds_from_the_stored_partitions_and_generates_the_same_tokens(cache, loaded, monkeypatch,
                                                                                   quantize):
    """A hit builds the executor from the entry's lowered partition programs (no partitioning, no lowering), and
    greedy generation after it gives the cold run's tokens; the whole program and the partitions' graphs are
    still there when something asks for them."""
    import hetforge.hetero.program
    import hetforge.lower

    cold_eng, cold = _greedy(loaded, quantize=quantize)
    assert all(_stored_this_run(p) for p in cold_eng.programs.programs.values())

    def refuse(*a, **k):
        raise AssertionError("a compile-cache hit partitioned or lowered again")

    monkeypatch.setattr(hetforge.lower, "lower", refuse)
    monkeypatch.setattr(hetforge.hetero.program, "partition_program", refuse)
    warm_eng, warm = _greedy(loaded, quantize=quantize)
    progs = list(warm_eng.programs.programs.values())
    assert {p.kind for p in progs} >= {"prefill", "decode"}
    assert all("compile cache: hit" in "\n".join(p.notes) for p in progs)
    assert warm == cold
    assert all(p.placed.compiled._program is None for p in progs)  # the whole program was never needed
    monkeypatch.undo()
    placed = progs[0].placed
    cold_placed = cold_eng.programs.programs[(progs[0].kind, progs[0].length)].placed
    assert str(placed.compiled.program) == str(cold_placed.compiled.program)  # made on first use, checked
    part, cold_part = placed.partitions.partitions[0], cold_placed.partitions.partitions[0]
    assert str(part.gm.graph) == str(cold_part.gm.graph) and part.nodes == cold_part.nodes


def test_a_warm_w8a8_engine_packs_each_int8_weight_for_fbgemm_once(cache, loaded):
    """A w8a8 prefill and decode program bound from their own entries share the int8 weights but hold their own
    copies of the small scales and biases: after the first request, later requests use the packings already made
    (before, the two programs took turns evicting each other's and every call packed every linear again)."""
    from hetforge.ops import quant
    from hetforge.runtime import SamplingParams

    _greedy(loaded, quantize="w8a8")  # cold: stores both entries
    warm_eng, warm_first = _greedy(loaded, quantize="w8a8")
    assert all("compile cache: hit" in "\n".join(p.notes) for p in warm_eng.programs.programs.values())
    packs = {i: e.packed for i, e in quant._FBGEMM_PACKS.items()}
    assert packs
    r = warm_eng.generate(list(range(1, TIER + 1)), SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert r.tokens == warm_first
    now = quant._FBGEMM_PACKS
    assert now.keys() == packs.keys() and all(now[i].packed is p for i, p in packs.items())  # none packed again


def test_a_w8a8_hit_packs_its_fbgemm_weights_before_its_first_call(cache, loaded, monkeypatch):
    """On a hit nothing has packed the w8a8 weights for FBGEMM; each program is returned with all of them packed
    (on every thread at once, ``ir.kernel_choice.PREPACK_ALL``) and says so, so no product packs a weight while a
    request runs."""
    from hetforge.ir import kernel_choice
    from hetforge.ops import quant
    from hetforge.runtime import SamplingParams

    _greedy(loaded, quantize="w8a8")  # cold: stores the entries
    quant._FBGEMM_PACKS.clear()
    made = {"prepack": 0, "call": 0}
    in_prepack = [False]
    real_pack, op = quant._fbgemm_packed, "hetforge.linear_w8a8.default"
    real_all = kernel_choice.PREPACK_ALL[op]

    def spy_pack(q, s):
        new = id(q) not in quant._FBGEMM_PACKS
        got = real_pack(q, s)
        made["prepack" if in_prepack[0] else "call"] += new
        return got

    def spy_all(*args):
        in_prepack[0] = True
        try:
            return real_all(*args)
        finally:
            in_prepack[0] = False

    monkeypatch.setattr(quant, "_fbgemm_packed", spy_pack)
    monkeypatch.setitem(kernel_choice.PREPACK_ALL, op, spy_all)
    eng = Engine(loaded, executor="auto", quantize="w8a8")
    eng.generate(list(range(1, TIER + 1)), SamplingParams(max_new_tokens=3, ignore_eos=True))
    progs = list(eng.programs.programs.values())
    assert all("compile cache: hit" in "\n".join(p.notes) for p in progs)
    assert all(any(n.startswith("weights packed in") for n in p.notes) for p in progs)
    assert made["prepack"] > 0 and made["call"] == 0, made


def test_entry_for_another_backend_hits_through_the_whole_program(cache, loaded):
    """Partitions on a backend that compiles from the graph (here the eager ``torch-cpu:fx``) are not stored
    built: the hit rebuilds them from the whole program, as before."""
    _, cold = _greedy(loaded, backends={"cpu": "torch-cpu:fx"})
    for entry in cache.glob("*.json"):
        assert json.loads(entry.read_text().split("\n", 1)[1])["meta"]["built"] is None
    eng, warm = _greedy(loaded, backends={"cpu": "torch-cpu:fx"})
    assert all("compile cache: hit" in "\n".join(p.notes) for p in eng.programs.programs.values())
    assert warm == cold
