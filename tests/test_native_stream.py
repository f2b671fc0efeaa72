"""The fp32 one-row products' summation order and the pool's runs of chunks (kernels/native.c).

The inner product of ``hf_gemv_nk`` / ``hf_gated_mlp`` (and the tail rows) has an AVX-512, an AVX2 and a plain C
version; all three must round exactly as documented (lane ``i % 16`` partial sums, then halves), so a result does
not depend on the CPU the library was built for. Speed is measured by bench/read_bandwidth.py, not here."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys

import numpy as np
import torch
from test_native import needs_cc

from hetforge.kernels import native

pytestmark = needs_cc

# (n, k): tails of every kind — k not a multiple of 16, n not a multiple of 4, tiny, and a few chunks' worth
SHAPES = [(7, 5), (5, 17), (33, 771), (1000, 768), (2049, 33)]


def lane_dot(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Rows of ``w`` · ``x`` in the documented order, in float32: products to lane ``i % 16`` in order of ``i``
    (a zero-padded last block), then lane ``l`` += lane ``l + h`` for h = 8, 4, 2, 1."""
    n, k = w.shape
    pad = (-k) % 16
    p = np.concatenate([w * x, np.zeros((n, pad), np.float32)], axis=1).reshape(n, -1, 16)
    s = np.zeros((n, 16), np.float32)
    for b in range(p.shape[1]):
        s = s + p[:, b]
    for h in (8, 4, 2, 1):
        s[:, :h] = s[:, :h] + s[:, h:2 * h]
    return s[:, 0]


def _builds(tmp_path) -> dict[str, ctypes.CDLL]:
    """This source built for the host (AVX-512 where it has it), without AVX-512 (AVX2), and with no -march
    (plain C on x86-64); the variants this host's compiler cannot make are left out."""
    cc = shutil.which("cc") or shutil.which("gcc")
    base = ["-O3", "-fopenmp", "-ffp-contract=off"]
    variants = {"native": ["-march=native", *base], "no-avx512": ["-march=native", "-mno-avx512f", *base],
                "portable": base}
    libs = {}
    for name, flags in variants.items():
        path = tmp_path / f"hf_{name}.so"
        if native._build(cc, flags, path) is None:
            lib, why = native._open(path)
            assert lib is not None, why
            libs[name] = lib
    assert "native" in libs and "portable" in libs
    return libs


def test_one_row_products_round_as_documented_on_every_build_path(tmp_path):
    libs = _builds(tmp_path)
    rng = np.random.default_rng(3)
    for n, k in SHAPES:
        w = rng.standard_normal((n, k), dtype=np.float32)
        x = rng.standard_normal(k, dtype=np.float32)
        want = lane_dot(w, x)
        wt, xt = torch.from_numpy(w), torch.from_numpy(x)
        for name, lib in libs.items():
            for threads in (1, 2):
                y = torch.full((n,), float("nan"))
                lib.hf_gemv_nk(wt.data_ptr(), xt.data_ptr(), None, y.data_ptr(), n, k, threads)
                assert np.array_equal(y.numpy(), want), f"hf_gemv_nk [{n}, {k}] on the {name} build"
        if n % 2 == 0:  # gated: rows of w as gate (first half) and up (second half); silu(g) * u per row
            f = n // 2
            h = torch.empty(f)
            for name, lib in libs.items():
                lib.hf_gated_mlp(xt.data_ptr(), wt.data_ptr(), wt[f:].data_ptr(), None, h.data_ptr(), None, f, k,
                                 native.ACT_CODES["none"], 2)
                assert np.array_equal(h.numpy(), want[:f] * want[f:]), f"hf_gated_mlp [{f}, {k}] on {name}"


def test_split_k_product_is_the_same_on_every_build_path(tmp_path):
    libs = _builds(tmp_path)
    g = torch.Generator().manual_seed(5)
    for k, n in ((768, 2304), (771, 37), (40, 3072)):
        x, w = torch.randn(k, generator=g), torch.randn(k, n, generator=g)
        outs = {}
        for name, lib in libs.items():
            y, part = torch.empty(n), torch.empty(16, n)
            lib.hf_gemv_kn(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), n, k, 2, part.data_ptr(), 16)
            outs[name] = y
        torch.testing.assert_close(outs["native"], x @ w, rtol=1e-4, atol=1e-4)
        for name, y in outs.items():
            assert torch.equal(y, outs["native"]), f"hf_gemv_kn [{k}, {n}] differs on the {name} build"


CHILD = """
import torch
from hetforge.kernels import native
x, w = torch.randn(768), torch.randn(3072, 768)
ref = native.gemv(x, w, None, torch.empty(3072), False, threads=1)
native.gemv(x, w, None, torch.empty(3072), False, threads=2)  # start the helper
native.pool_config(hold=True)  # helpers claim nothing: the caller must take over their run
before = native.pool_info()
for _ in range(20):
    assert torch.equal(native.gemv(x, w, None, torch.empty(3072), False, threads=2), ref)
after = native.pool_info()
per_call = (after.chunks - before.chunks) // 20
print(per_call, (after.chunks_taken_over - before.chunks_taken_over) // 20)
"""


def test_each_thread_owns_a_run_of_chunks_and_a_missing_helpers_run_is_taken_over():
    """Two threads: the chunks are cut into two runs of consecutive chunks (the caller's first half, the helper's
    second); with the helper absent the caller runs its own run, then takes over all of the helper's."""
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    chunks, taken = map(int, r.stdout.split())
    assert chunks >= 16 and taken == chunks - chunks // 2
