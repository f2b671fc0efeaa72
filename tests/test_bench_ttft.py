"""bench/ttft.py end to end on a tiny model: a row per system (llama.cpp's included), the ratio columns naming
the best peer, the GGUF files removed; and bad input refused with one line and exit 2."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "ttft.py"


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}, cwd=ROOT)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None,
                    reason="llama_cpp (llama-cpp-python) or gguf is not installed (no PyPI wheel: "
                           "pip install -e '.[llamacpp]' builds it): the llama.cpp rows cannot run")
def test_ttft_page_has_a_row_per_system_and_ratios_against_named_peers(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out, md = tmp_path / "t.json", tmp_path / "t.md"
    r = _run(["--models", "llama-tiny", "--lengths", "8", "20", "--rounds", "1", "--quantize", "none", "w8", "w4",
              "bf16", "--peers", "hf", "llamacpp-f32", "llamacpp-q8", "llamacpp-q4", "--json", str(out),
              "--md", str(md)],
             env={"TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    (m,) = res["models"]
    sy = m["systems"]
    schemes = ["fp32", "w8", "w4"]
    if "hetforge bf16 fine" in sy:
        schemes.append("bf16")
    else:  # a CPU without bf16 instructions: refused, and the page says so
        assert any(n.startswith("hetforge bf16: refused") for n in m["notes"]), m["notes"]
    want = ["hf", "llamacpp-f32", "llamacpp-q8", "llamacpp-q4"] + [f"hetforge {s} {mode}" for s in schemes
                                                                   for mode in ("tier", "chunked", "fine")]
    assert list(sy) == want
    for key in want:
        assert all(v > 0 for v in sy[key]["median_ms"].values()), key
    # llama.cpp ran the same seeded weights: its f32 first token is HF's
    assert sy["llamacpp-f32"]["first_token"] == sy["hf"]["first_token"]
    assert sy["llamacpp-q8"]["precision"] == "q8_0" and sy["llamacpp-q4"]["precision"] == "q4_0"
    page = md.read_text()
    # the page names the llama.cpp build's CPU features (which kernels the peer could use)
    assert sy["llamacpp-q8"]["build"].startswith("llama-cpp-python ") and "(built with " in sy["llamacpp-q8"]["build"]
    assert sy["llamacpp-q8"]["build"] in page
    for key in want:
        assert f"| {key} | {sy[key]['precision']} |" in page, key
    header = next(ln for ln in page.splitlines() if ln.startswith("| hetforge scheme |"))
    for n in ("8", "20"):
        for col in ("fine ÷ tier", "fine ÷ chunked", "fine ÷ best same-precision peer",
                    "fine ÷ best peer of any precision"):
            assert f"{col}, n = {n}" in header
    lines = page.splitlines()
    body = lines[lines.index(header) + 2:]
    body = body[:body.index("")]
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in ln.strip("|").split("|")] for ln in body)}
    assert set(rows) == {f"hetforge {s}" for s in schemes}
    # fp32 is matched with the f32 peer, w8 with Q8_0, w4 with Q4_0; the any-precision cell names the fastest peer
    assert rows["hetforge fp32"][4].endswith("(llamacpp-f32)")
    assert rows["hetforge w8"][4].endswith("(llamacpp-q8)")
    assert rows["hetforge w4"][4].endswith("(llamacpp-q4)")
    fastest = min(("llamacpp-f32", "llamacpp-q8", "llamacpp-q4"), key=lambda k: sy[k]["median_ms"]["8"])
    assert rows["hetforge fp32"][6].endswith(f"({fastest})")
    ratio = sy["hetforge fp32 fine"]["median_ms"]["8"] / sy[fastest]["median_ms"]["8"]
    assert rows["hetforge fp32"][6].startswith(f"{ratio:.2f} ")
    # fine runs one program of about the prompt's length (8 -> prefill-8, 20 -> prefill-24)
    assert sy["hetforge fp32 fine"]["pieces"] == {"8": ["prefill-8"], "20": ["prefill-24 (20 real)"]}
    if "bf16" in schemes:  # its peer (ov-default) was not asked for
        assert rows["hetforge bf16"][4] == "—"
    assert "load average" in page and res["host"]["isa"]
    assert not list(tmp.glob("hetforge-ttft-*")), "the GGUF folder was left behind"


@pytest.mark.parametrize("args, says", [
    (["--peers", "hf", "llama.cpp"], "unknown --peers name(s) llama.cpp"),
    (["--lengths", "0", "8"], "--lengths must be >= 1"),
    (["--lengths", "8", "600"], "exceeds llama-tiny's 512 positions"),
    (["--quantize", "q8"], "unknown --quantize name(s) q8"),
])
def test_ttft_bad_input_is_one_line_and_exit_2(args: list[str], says: str) -> None:
    r = _run(["--models", "llama-tiny", *args])
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and says in lines[0], r.stderr


def _ttft_module():
    spec = importlib.util.spec_from_file_location("ttft_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_peer_that_dies_in_its_probe_process_is_reported_not_fatal(tmp_path: Path, monkeypatch) -> None:
    """The probe runs in a real child process; one killed by SIGSEGV (as llama.cpp's AMX matmul was on an AMX
    host) and one that exits with an error are both reported as PeerCrashed with how they ended."""
    ttft = _ttft_module()
    monkeypatch.setattr(ttft, "_PROBE", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    with pytest.raises(ttft.PeerCrashed, match="died with SIGSEGV"):
        ttft._probe(tmp_path / "x.gguf", 1, 64, [8])
    monkeypatch.setattr(ttft, "_PROBE", "raise SystemExit('no such model file')\n")
    with pytest.raises(ttft.PeerCrashed, match="failed in a probe process: no such model file"):
        ttft._probe(tmp_path / "x.gguf", 1, 64, [8])


def test_build_info_lists_the_features_llama_cpp_reports_as_built(monkeypatch) -> None:
    """The parser of ``llama_print_system_info``: the features set to 1, in its order, none set to 0."""
    import types

    from hetforge.benchmarks.llamacpp_system import build_info

    fake = types.SimpleNamespace(__version__="9.9.9", llama_print_system_info=lambda: (
        b"CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 0 | AVX512_VNNI = 1 | REPACK = 1 | "))
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    assert build_info() == "llama-cpp-python 9.9.9 (built with SSE3, AVX2, AVX512, AVX512_VNNI, REPACK)"
