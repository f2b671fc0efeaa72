import os
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# The compile cache of the whole run lives in a fresh folder (inherited by the CLI subprocesses), so no test
# reads programs a user's ~/.cache or an earlier run left behind; tests of the cache set their own folder.
_CACHE = tempfile.TemporaryDirectory(prefix="hetforge-test-compile-cache-")
os.environ["HETFORGE_COMPILE_CACHE_DIR"] = _CACHE.name

def pytest_collection_modifyitems(config, items):
    """``slow`` tests run only when asked for: ``pytest -m slow`` (any -m expression naming slow or scale) or
    HETFORGE_SLOW=1; otherwise they are skipped with that reason (``make test`` runs the slow ones not marked
    ``scale`` in a second pass)."""
    expr = config.option.markexpr or ""
    if "slow" in expr or "scale" in expr or os.environ.get("HETFORGE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with `pytest -m slow` (or HETFORGE_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


TINY = ["gpt2-tiny", "llama-tiny", "mixtral-tiny", "qwen2-tiny", "bert-tiny"]


@pytest.fixture
def no_native():
    """ATen kernels only: the native C kernels (hetforge.kernels.native) reported unavailable."""
    from hetforge.kernels import native

    with native.disabled("test: the ATen path"):
        yield


@pytest.fixture
def with_native():
    """The native C kernels, built here (skips where there is no C compiler)."""
    from hetforge.kernels import native

    if native.library() is None:
        # the native kernels are optional (they need a C compiler); without them the ATen path runs and
        # the no_native tests cover it, so a test of the kernels themselves has nothing to run
        pytest.skip(f"native C kernels not built on this host ({native.status().reason}); ATen path tested instead")


@pytest.fixture(scope="session")
def tiny_names():
    return TINY


@pytest.fixture(scope="module")
def parts():
    """qwen2-tiny cut into [cpu: embed+layer0, gpu: layer1+head] with the real inputs of every partition
    (shared by the backend tests)."""
    from fx_partition import partition_graph

    from hetforge.frontend import capture
    from hetforge.hardware import load_soc
    from hetforge.hetero.layouts import layer_assignment
    from hetforge.models.zoo import example_inputs, load_model

    lm = load_model("qwen2-tiny")
    inputs = example_inputs(lm, seq=8)
    cg = capture(lm.logits_module(), inputs)
    soc = load_soc("intel-core-ultra-155h")
    pg = partition_graph(cg.gm, layer_assignment(cg.gm, "stages:cpu,gpu", soc.device_names))
    vals = dict(zip(pg.graph_inputs, inputs, strict=True))
    args = []
    with torch.no_grad():
        for p in pg.partitions:
            a = [vals[n] for n in p.inputs]
            args.append(a)
            vals.update(zip(p.outputs, p.gm(*a), strict=True))
    return pg, args, soc, cg


@pytest.fixture
def twins(monkeypatch):
    """compile_cache's twinning of tensors bound from cache entries, from a clean slate and for tiny weights too
    (gpt2-tiny's are below TWIN_MIN_BYTES); no twins left by an earlier test's entries of equal content."""
    from hetforge.runtime import compile_cache

    monkeypatch.setattr(compile_cache, "TWIN_MIN_BYTES", 0)
    monkeypatch.setattr(compile_cache, "_BOUND", {})


def int8_storages(tensors) -> set[int]:
    """The storages of the int8 tensors among ``tensors`` (one per copy of a quantized weight)."""
    import torch

    return {t.untyped_storage().data_ptr() for t in tensors if t.dtype == torch.int8}

