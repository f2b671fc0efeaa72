"""bench/kernel_ab.py: the native kernels of a git revision against the working tree's, side by side.

Run as a user runs it (a subprocess, the real compiler and git). Slow: it builds the library twice."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hetforge.kernels import native

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "kernel_ab.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
def test_kernel_ab_builds_both_sources_and_times_every_case_with_the_bits_compared(tmp_path: Path) -> None:
    """Where the library is not vectorized (no AVX-512), its kernels are not the ones compared: one line, exit 1."""
    out = tmp_path / "ab.json"
    got = run("--base", "HEAD", "--rows", "8", "--rounds", "1", "--threads", "1", "--json", str(out))
    if not native.panel_available():
        assert got.returncode == 1 and "AVX-512" in got.stderr and "Traceback" not in got.stderr
        return
    assert got.returncode == 0, got.stderr
    doc = json.loads(out.read_text())
    cases = [r["case"] for r in doc["results"]]
    assert any(c.startswith("panel GEMM, 8 rows") for c in cases)
    assert any(c.startswith("one-row nk") for c in cases) and any(c.startswith("one-row split-K") for c in cases)
    assert "one-row w8 GEMV (hf_gemv_q8a)" in cases and "w8 GEMM (hf_gemm_q8a), 8 rows" in cases
    att = [c for c in cases if c.startswith("prefill attention")]
    assert len(att) == 18  # 2 layouts x 16/128/512 rows x (fp32 is_causal, fp32 causal bool mask, bf16 is_causal)
    assert sum(c.endswith("bool causal mask") for c in att) == 6 and sum(c.endswith("is_causal") for c in att) == 12
    assert sum(c.startswith("prefill attention bf16 (") for c in att) == 6
    dec = [c for c in cases if c.startswith("decode attention")]
    assert len(dec) == 8  # fp32 and bf16 x 2 layouts x caches of 256 and 1024 positions
    assert sum(" bf16 " in c for c in dec) == 4 and sum(c.endswith("cache 1024") for c in dec) == 4
    for r in doc["results"]:
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0
        assert all(s > 0 for s in r["median_s"].values())
    # HEAD's native.c against the working tree's: where they are the same source the bits must be too
    head = subprocess.run(["git", "show", "HEAD:src/hetforge/kernels/native.c"], cwd=ROOT, capture_output=True,
                          text=True).stdout
    if head == native.SOURCE.read_text():
        assert all(r["same_bits"] for r in doc["results"]), doc["results"]


def test_kernel_ab_refuses_a_revision_git_does_not_know_with_one_line_and_exit_2() -> None:
    got = run("--base", "no-such-revision-xyz")
    assert got.returncode == 2
    assert "--base 'no-such-revision-xyz'" in got.stderr and "Traceback" not in got.stderr


def test_kernel_ab_refuses_an_unknown_group_with_one_line_and_exit_2() -> None:
    got = run("--groups", "attention,gemm")
    assert got.returncode == 2
    assert "--groups 'attention,gemm'" in got.stderr and "panel, gemv, w8, attention, decode" in got.stderr
    assert "Traceback" not in got.stderr
