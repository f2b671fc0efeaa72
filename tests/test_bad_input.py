"""The bad-input catalogue: every command driven through wrong names, numbers, files and folders.

For each case: the documented exit code (2 = the user's mistake, 1 = a failure such as a damaged model
folder), exactly one readable line on stderr, nothing on stdout under ``--json``, no Python exception
escaping (no traceback), and no file left behind (neither in the working folder nor next to the inputs).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hetforge.cli.common import app
from hetforge.cli.main import _load_commands

_load_commands()


def _sys_unwritable() -> bool:
    try:
        os.close(os.open("/sys/hetforge-probe", os.O_CREAT | os.O_WRONLY))
        return False
    except OSError:
        return Path("/sys").is_dir()


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    """Input files every case may point at: good and damaged plans, model folders, profiles, plain files."""
    from safetensors.torch import load_file, save_file

    from hetforge.compile import compile_model
    from hetforge.ir import save_program
    from hetforge.models.zoo import load_model

    d = tmp_path_factory.mktemp("fx")
    (d / "dir").mkdir()
    (d / "empty_model").mkdir()
    (d / "file.txt").write_text("plain text\n")
    (d / "bin.json").write_bytes(bytes(range(256)) * 4)
    (d / "bad.json").write_text("{not json")
    (d / "badsoc.json").write_text(json.dumps({"name": "x", "devices": [{"name": "cpu", "kind": "tpu"}]}))
    res = compile_model("gpt2-tiny", seq=8, soc="intel-core-ultra-155h", strategy="greedy", build=False)
    save_program(res.program, d / "plan.json")
    plan = json.loads((d / "plan.json").read_text())
    (d / "header_only.json").write_text(json.dumps({"format": plan["format"]}))
    (d / "cut.json").write_text(json.dumps({**plan, "instrs": plan["instrs"][: len(plan["instrs"]) // 2]}))
    (d / "wrong_type.json").write_text(json.dumps({**plan, "inputs": "x"}))
    (d / "bad_dtype.json").write_text(json.dumps({**plan, "values": [{**plan["values"][0], "dtype": "f99"},
                                                                      *plan["values"][1:]]}))
    good = d / "llama"
    load_model("llama-tiny").model.save_pretrained(good)
    load_model("bert-tiny").model.save_pretrained(d / "bert")
    for name in ("missing_tensor", "nan_weights", "nullcfg", "badcfg"):
        shutil.copytree(good, d / name)
    sd = load_file(good / "model.safetensors")
    save_file({k: v for k, v in sd.items() if "layers.1.mlp.up_proj" not in k}, d / "missing_tensor" /
              "model.safetensors", metadata={"format": "pt"})
    sd["model.norm.weight"] = torch.full_like(sd["model.norm.weight"], float("nan"))
    save_file(sd, d / "nan_weights" / "model.safetensors", metadata={"format": "pt"})
    (d / "nullcfg" / "config.json").write_text("null")
    (d / "badcfg" / "config.json").write_text("{\"model_type\": ")
    _cluster_files(d)
    return d


def _cluster_files(d: Path) -> None:
    """Cluster files: an unknown SoC, a link to an unknown node, nodes far too small for any model."""
    from hetforge.hardware import load_soc

    link = ("  - a: a\n    b: {b}\n    bandwidth: {{value: 1.0e8, source: t}}\n"
            "    latency_s: {{value: 0.0, source: t}}\n    energy_per_byte_j: {{value: 0.0, source: t}}\n")
    (d / "cl_soc.yaml").write_text("name: x\nnodes:\n  - {name: a, soc: host}\n  - {name: b, soc: orin-9000}\n"
                                   "links:\n" + link.format(b="b"))
    (d / "cl_link.yaml").write_text("name: x\nnodes:\n  - {name: a, soc: host}\n  - {name: b, soc: host}\n"
                                    "links:\n" + link.format(b="z"))
    spec = json.loads(json.dumps(load_soc("host").spec))
    for dev in spec["devices"]:
        dev["mem_capacity"] = {"value": 2**20, "source": "test: 1 MiB"}
    (d / "tiny_soc.json").write_text(json.dumps({**spec, "name": "tiny"}))
    (d / "cl_tiny.yaml").write_text("name: x\nnodes:\n  - {name: a, soc: tiny_soc.json}\n"
                                    "  - {name: b, soc: tiny_soc.json}\nlinks:\n" + link.format(b="b"))


M, SOC = "llama-tiny", "intel-core-ultra-155h"

# (id, argv with {fx} for the fixture folder, expected exit code, text the one stderr line must contain)
CASES: list[tuple[str, list[str], int, str]] = [
    # the CLI itself
    ("unknown-command", ["transmogrify"], 2, "No such command"),
    ("missing-argument", ["capture"], 2, "Missing argument"),
    ("unknown-option", ["models", "--bogus"], 2, "No such option"),
    ("not-an-integer", ["capture", M, "--seq", "abc", "--json"], 2, "Invalid value for '--seq'"),
    # capture
    ("capture-unknown-model", ["capture", "gpt5", "--json"], 2, "unknown model 'gpt5'"),
    ("capture-seq-0", ["capture", M, "--seq", "0", "--json"], 2, "outside 1.."),
    ("capture-seq-huge", ["capture", M, "--seq", "100000", "--json"], 2, "outside 1.."),
    ("capture-attn", ["capture", M, "--attn", "flash", "--json"], 2, "unknown attention implementation"),
    ("capture-dump-folder", ["capture", M, "--dump", "{fx}/dir", "--json"], 2, "is a folder"),
    ("capture-dump-under-file", ["capture", M, "--dump", "{fx}/file.txt/g.txt", "--json"], 2,
     "is a file, not a folder"),
    ("capture-dump-no-folder", ["capture", M, "--dump", "{fx}/nowhere/g.txt", "--json"], 2, "does not exist"),
    ("capture-empty-model-folder", ["capture", "{fx}/empty_model", "--json"], 1, "config.json' is missing"),
    ("capture-null-config", ["capture", "{fx}/nullcfg", "--json"], 1, "holds null"),
    ("capture-bad-config", ["capture", "{fx}/badcfg", "--json"], 1, "is not valid JSON"),
    ("capture-missing-tensor", ["capture", "{fx}/missing_tensor", "--json"], 1,
     "model.layers.1.mlp.up_proj.weight"),
    ("capture-file-as-model", ["capture", "{fx}/file.txt", "--json"], 2, "is a file; give a model folder"),
    ("capture-no-such-folder", ["capture", "{fx}/nowhere/", "--json"], 1, "does not exist"),
    # verify / optimize / quantize
    ("verify-kl-nan", ["verify", M, "--kl-threshold", "nan", "--json"], 2, "--kl-threshold must be"),
    ("verify-kl-negative", ["verify", M, "--kl-threshold", "-1", "--json"], 2, "--kl-threshold must be"),
    ("verify-unknown-model", ["verify", "nope", "--json"], 2, "unknown model"),
    ("optimize-unknown-pass", ["optimize", M, "--passes", "bogus", "--json"], 2, "bogus"),
    ("optimize-dump-dir-is-file", ["optimize", M, "--dump-dir", "{fx}/file.txt", "--json"], 2,
     "not a folder"),
    ("optimize-quantize-scheme", ["optimize", M, "--quantize", "w3", "--json"], 2, "w8, w4, w8a8, none"),
    ("optimize-kl-inf", ["optimize", M, "--kl-threshold", "inf", "--json"], 2, "--kl-threshold must be"),
    ("quantize-scheme", ["quantize", M, "--scheme", "w3", "--json"], 2, "w8, w4, w8a8"),
    ("quantize-group-size", ["quantize", M, "--scheme", "w4", "--group-size", "7", "--json"], 2, "group"),
    # compile / run-graph
    ("compile-strategy", ["compile", M, "--strategy", "bogus", "--json"], 2, "bogus"),
    ("compile-objective", ["compile", M, "--strategy", "greedy", "--objective", "speed", "--json"], 2,
     "energy, latency, balanced"),
    ("compile-unknown-soc", ["compile", M, "--soc", "tpu-9000", "--json"], 2, "unknown SoC"),
    ("compile-binary-soc", ["compile", M, "--soc", "{fx}/bin.json", "--json"], 2, "not a text"),
    ("compile-soc-folder", ["compile", M, "--soc", "{fx}/dir", "--json"], 2, "is a folder, not a file"),
    ("compile-soc-not-json", ["compile", M, "--soc", "{fx}/bad.json", "--json"], 2, "not valid JSON"),
    ("compile-soc-invalid", ["compile", M, "--soc", "{fx}/badsoc.json", "--json"], 2, "invalid SoC profile"),
    ("compile-soc-missing", ["compile", M, "--soc", "{fx}/none.json", "--json"], 2, "does not exist"),
    ("compile-out-folder", ["compile", M, "--out", "{fx}/dir", "--json"], 2, "is a folder"),
    ("compile-out-under-file", ["compile", M, "--out", "{fx}/file.txt/p.json", "--json"], 2,
     "is a file, not a folder"),
    ("compile-text-no-folder", ["compile", M, "--text", "{fx}/nowhere/p.txt", "--json"], 2, "does not exist"),
    ("compile-group-size", ["compile", M, "--quantize", "w4", "--group-size", "3", "--json"], 2, "group"),
    ("compile-seq-negative", ["compile", M, "--seq", "-5", "--json"], 2, "outside 1.."),
    ("run-graph-mode", ["run-graph", M, "--mode", "turbo", "--json"], 2, "unknown --mode"),
    ("run-graph-profile", ["run-graph", M, "--profile", "-1", "--json"], 2, "--profile must be"),
    ("run-graph-kl", ["run-graph", M, "--kl-threshold", "-1", "--json"], 2, "--kl-threshold must be"),
    # hardware
    ("calibrate-out-folder", ["calibrate", "--quick", "--out", "{fx}/dir", "--json"], 2, "is a folder"),
    ("calibrate-out-under-file", ["calibrate", "--quick", "--out", "{fx}/file.txt/h.json", "--json"], 2,
     "is a file, not a folder"),
    ("calibrate-threads", ["calibrate", "--quick", "--threads", "0", "--json"], 2, "--threads must be"),
    ("calibrate-clock", ["calibrate", "--quick", "--clock", "sundial", "--json"], 2, "--clock must be"),
    ("calibrate-thread-clock", ["calibrate", "--quick", "--clock", "thread", "--threads", "2", "--json"], 2,
     "needs --threads 1"),
    ("profile-temp-nan", ["profile", M, "--temp", "nan", "--json"], 2, "--temp must be"),
    ("profile-temp-cold", ["profile", M, "--temp", "-300", "--json"], 2, "--temp must be"),
    ("profile-plot-gif", ["profile", M, "--plot", "{fx}/x.gif", "--json"], 2, "must end in .png or .svg"),
    ("profile-plot-no-folder", ["profile", M, "--plot", "{fx}/nowhere/x.png", "--json"], 2, "does not exist"),
    ("profile-seq-0", ["profile", M, "--seq", "0", "--json"], 2, "--seq must be"),
    ("backends-soc", ["backends", "--soc", "nope", "--json"], 2, "unknown SoC"),
    # placement
    ("explain-node", ["explain", M, "--soc", SOC, "--node", "no_such_node", "--json"], 2, "no_such_node"),
    ("explain-strategy", ["explain", M, "--soc", SOC, "--node", "x", "--strategy", "bogus", "--json"], 2, "bogus"),
    ("explain-objective", ["explain", M, "--soc", SOC, "--node", "x", "--objective", "fast", "--json"], 2,
     "fast"),
    ("pareto-plot-txt", ["pareto", M, "--soc", SOC, "--plot", "{fx}/front.txt", "--json"], 2,
     "must end in .png or .svg"),
    ("pareto-plot-no-extension", ["pareto", M, "--soc", SOC, "--plot", "X", "--json"], 2, "must end in"),
    ("pareto-plot-folder", ["pareto", M, "--soc", SOC, "--plot", "{fx}/dir", "--json"], 2, "must end in"),
    ("pareto-latency", ["pareto", M, "--soc", SOC, "--latency", "fast", "--json"], 2, "bottleneck, total"),
    ("pareto-aux", ["pareto", M, "--soc", SOC, "--aux", "nope", "--json"], 2, "power, cost"),
    # hetero / run-plan
    ("hetero-no-layout", ["hetero", M, "--json"], 2, "exactly one of --layout"),
    ("hetero-layout-device", ["hetero", M, "--layout", "all:tpu", "--json"], 2, "tpu"),
    ("hetero-repeat", ["hetero", M, "--layout", "all:cpu", "--repeat", "0", "--json"], 2, "--repeat must be"),
    ("hetero-trace-folder", ["hetero", M, "--layout", "all:cpu", "--trace", "{fx}/dir", "--json"], 2,
     "is a folder"),
    ("hetero-policy", ["hetero", M, "--layout", "all:cpu", "--policy", "loose", "--json"], 2, "--policy"),
    ("hetero-backend", ["hetero", M, "--layout", "all:cpu", "--backend", "gpu=bogus", "--json"], 2, "bogus"),
    ("run-plan-folder", ["run-plan", "gpt2-tiny", "--plan", "{fx}/dir", "--json"], 2, "is a folder, not a file"),
    ("run-plan-missing", ["run-plan", "gpt2-tiny", "--plan", "{fx}/none.json", "--json"], 2, "does not exist"),
    ("run-plan-binary", ["run-plan", "gpt2-tiny", "--plan", "{fx}/bin.json", "--json"], 2, "not a hetforge plan"),
    ("run-plan-header-only", ["run-plan", "gpt2-tiny", "--plan", "{fx}/header_only.json", "--json"], 2,
     "malformed"),
    ("run-plan-cut", ["run-plan", "gpt2-tiny", "--plan", "{fx}/cut.json", "--json"], 2, "malformed"),
    ("run-plan-wrong-type", ["run-plan", "gpt2-tiny", "--plan", "{fx}/wrong_type.json", "--json"], 2,
     "field 'inputs'"),
    ("run-plan-dtype", ["run-plan", "gpt2-tiny", "--plan", "{fx}/bad_dtype.json", "--json"], 2, "'f99'"),
    ("run-plan-other-model", ["run-plan", M, "--plan", "{fx}/plan.json", "--json"], 1,
     "compiled for model 'gpt2-tiny'"),
    ("run-plan-other-soc", ["run-plan", "gpt2-tiny", "--plan", "{fx}/plan.json", "--soc", "jetson-agx-orin",
                            "--json"], 2, "different profile"),
    ("run-plan-trace-under-file", ["run-plan", "gpt2-tiny", "--plan", "{fx}/plan.json", "--trace",
                                   "{fx}/file.txt/t.json", "--json"], 2, "is a file, not a folder"),
    # generation
    ("run-empty-prompt", ["run", M, "-p", "", "--json"], 2, "prompt is empty"),
    ("run-temperature-nan", ["run", M, "-p", "hi", "--temperature", "nan", "--json"], 2, "--temperature"),
    ("run-top-p", ["run", M, "-p", "hi", "--top-p", "0", "--json"], 2, "--top-p"),
    ("run-seed-huge", ["run", M, "-p", "hi", "--seed", str(10**30), "--json"], 2, "--seed must be"),
    ("run-zero-tokens", ["run", M, "-p", "hi", "-n", "0", "--json"], 2, "--max-new-tokens"),
    ("run-threads", ["run", M, "-p", "hi", "--threads", "-1", "--json"], 2, "--threads"),
    ("run-masked-lm", ["run", "bert-tiny", "-p", "hi", "--json"], 2, "masked-lm"),
    ("run-masked-lm-folder", ["run", "{fx}/bert", "-p", "hi", "--json"], 2, "masked-lm"),
    ("run-nan-weights", ["run", "{fx}/nan_weights", "-p", "hi", "-n", "2", "--temperature", "0.8", "--json"], 1,
     "NaN logits"),
    ("demo-model", ["demo", "--model", "nope", "--json"], 2, "unknown model"),
    ("bench-models", ["bench", "peers", "--models", "nope", "--json"], 2, "nope"),
    ("bench-systems", ["bench", "peers", "--systems", "bogus", "--json"], 2, "bogus"),
    ("bench-out-dir-is-file", ["bench", "peers", "--quick", "--out-dir", "{fx}/file.txt", "--json"], 2,
     "is a file, not a folder"),
    ("bench-out-dir-under-file", ["bench", "peers", "--quick", "--out-dir", "{fx}/file.txt/out", "--json"], 2,
     "is a file, not a folder"),
    ("kforge-problem", ["kforge", "run", "nosuchproblem", "--platform", "cpp", "--provider", "offline",
                        "--rounds", "1"], 2, "unknown problem 'nosuchproblem'"),
    ("kforge-platform", ["kforge", "run", "softmax", "--platform", "nope"], 2, "unknown platform 'nope'"),
    # report
    ("report-out-no-folder", ["report", M, "--soc", SOC, "-o", "{fx}/nowhere/r.html", "--json"], 2, "does not exist"),
    ("report-out-under-file", ["report", M, "--soc", SOC, "-o", "{fx}/file.txt/r.html", "--json"], 2,
     "is a file, not a folder"),
    ("report-out-extension", ["report", M, "--soc", SOC, "-o", "{fx}/r.pdf", "--json"], 2, "must end in .html"),
    ("report-unknown-soc", ["report", M, "--soc", "tpu-9000", "-o", "{fx}/r.html", "--json"], 2, "unknown SoC"),
    ("report-strategy", ["report", M, "--soc", SOC, "--strategy", "bogus", "-o", "{fx}/r.html", "--json"], 2,
     "bogus"),
    ("report-unknown-model", ["report", "gpt5", "--soc", SOC, "-o", "{fx}/r.html", "--json"], 2,
     "unknown model 'gpt5'"),
    ("run-report-no-folder", ["run", M, "-p", "hi", "--report", "{fx}/nowhere/r.html", "--json"], 2,
     "does not exist"),
    ("moe-data", ["moe", "calibrate", "moe-demo", "--data", "{fx}/dir"], 2, "is not a file"),
    ("moe-calib", ["moe", "tiers", "gpt2-tiny", "--calib", "{fx}/nothing.json", "--data", "{fx}/file.txt"], 2,
     "does not exist"),
    ("run-moe-calib", ["run", "moe-demo", "-p", "hi", "--soc", SOC, "--moe-calibration", "{fx}/nothing.json",
                       "--json"], 2, "does not exist"),
    ("run-moe-factor", ["run", "moe-demo", "-p", "hi", "--moe-calibration", "{fx}/file.txt", "--moe-capacity-factor",
                        "0", "--json"], 2, "must be > 0"),
    ("run-moe-place", ["run", "moe-demo", "-p", "hi", "--moe-calibration", "{fx}/file.txt", "--moe-place", "gpu",
                       "--json"], 2, "--moe-place 'gpu'"),
    # clusters (several nodes on Ray)
    ("cluster-unknown", ["cluster", "show", "nope", "--json"], 2, "unknown cluster 'nope'"),
    ("cluster-missing-file", ["cluster", "show", "{fx}/none.yaml", "--json"], 2, "does not exist"),
    ("cluster-not-yaml", ["cluster", "show", "{fx}/bad.json", "--json"], 2, "not valid YAML"),
    ("cluster-unknown-soc", ["cluster", "show", "{fx}/cl_soc.yaml", "--json"], 2, "names SoC 'orin-9000'"),
    ("cluster-link-node", ["cluster", "plan", "demo", "--cluster", "{fx}/cl_link.yaml", "--json"], 2,
     "names unknown node 'z'"),
    ("cluster-objective", ["cluster", "plan", "demo", "--cluster", "orin-nano-x2-gbe", "--objective", "fast",
                           "--json"], 2, "unknown --objective 'fast'"),
    ("cluster-too-big", ["cluster", "plan", "demo", "--cluster", "{fx}/cl_tiny.yaml", "--json"], 1,
     "activations; the 2 node(s) have 2,097,152 bytes"),
    ("cluster-serve-replicas", ["cluster", "serve", "demo", "--cluster", "orin-nano-x2-gbe", "--requests",
                                "{fx}/file.txt", "--replicas", "3", "--json"], 2, "--replicas must be 1..2"),
    ("cluster-serve-requests", ["cluster", "serve", "demo", "--cluster", "orin-nano-x2-gbe", "--requests",
                                "{fx}/none.txt", "--json"], 2, "does not exist"),
    ("cluster-serve-binary", ["cluster", "serve", "demo", "--cluster", "orin-nano-x2-gbe", "--requests",
                              "{fx}/bin.json", "--json"], 2, "not UTF-8 text"),
    ("cluster-serve-http-port", ["cluster", "serve", "demo", "--cluster", "orin-nano-x2-gbe", "--http", "--port",
                                 "0", "--json"], 2, "--port must be 1..65535"),
    ("cluster-serve-http-replicas", ["cluster", "serve", "demo", "--cluster", "orin-nano-x2-gbe", "--http", "--port",
                                     "18999", "--replicas", "3", "--json"], 2, "--replicas must be 1..2"),
    ("cluster-serve-http-and-file", ["cluster", "serve", "demo", "--cluster", "orin-nano-x2-gbe", "--http",
                                     "--requests", "{fx}/file.txt", "--json"], 2, "either --requests FILE or --http"),
    ("run-address-no-cluster", ["run", "demo", "-p", "hi", "--address", "127.0.0.1:9", "--json"], 2,
     "need --cluster"),
    ("run-cluster-fail-node", ["run", "demo", "-p", "hi", "--cluster", "orin-nano-x2-gbe", "--fail-node", "z:2",
                               "--json"], 2, "has no node 'z'"),
    ("run-cluster-too-big", ["run", "demo", "-p", "hi", "--cluster", "{fx}/cl_tiny.yaml", "--json"], 1,
     "does not fit cluster"),
    ("run-cluster-unreachable", ["run", "demo", "-p", "hi", "--cluster", "orin-nano-x2-gbe", "--address",
                                 "127.0.0.1:9", "--json"], 1, "cannot reach the Ray cluster at 127.0.0.1:9"),
]
ENV_CASES: list[tuple[str, list[str], dict[str, str], int, str]] = [
    ("host-profile-binary", ["socs", "--json"], {"HETFORGE_HOST_PROFILE": "{fx}/bin.json"}, 2, "not a text"),
    ("host-profile-folder", ["socs", "--json"], {"HETFORGE_HOST_PROFILE": "{fx}/dir"}, 2, "is a folder"),
    ("host-profile-invalid", ["compile", M, "--json"], {"HETFORGE_HOST_PROFILE": "{fx}/badsoc.json"}, 2,
     "invalid SoC profile"),
]
CASES += [  # issue 19: thermal simulation, failover and run-time re-placement options
    ("simulate-minutes", ["simulate", "thermal", "--soc", "jetson-orin-nano", "--minutes", "0", "--json"], 2,
     "--minutes must be in (0, 1440]"),
    ("simulate-ambient", ["simulate", "thermal", "--soc", "jetson-orin-nano", "--ambient", "90"], 2,
     "--ambient must be in [-40, 60]"),
    ("run-inject-fault-form", ["run", M, "--soc", "jetson-orin-nano", "-p", "hi", "--inject-fault", "gpu"], 2,
     "expected DEVICE@TOKEN"),
    ("run-set-load-range", ["run", M, "--soc", "jetson-orin-nano", "-p", "hi", "--set-load", "gpu=2"], 2,
     "allowed: [0, 1)"),
]
if _sys_unwritable():
    CASES += [
        ("capture-dump-unwritable", ["capture", M, "--dump", "/sys/g.txt", "--json"], 2, "not writable"),
        ("compile-out-unwritable", ["compile", M, "--out", "/sys/p.json", "--json"], 2, "not writable"),
        ("pareto-plot-unwritable", ["pareto", M, "--soc", SOC, "--plot", "/sys/f.png", "--json"], 2,
         "not writable"),
        ("report-out-unwritable", ["report", M, "--soc", SOC, "-o", "/sys/r.html", "--json"], 2, "not writable"),
    ]


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _check(fx: Path, tmp_path: Path, monkeypatch, argv: list[str], env: dict[str, str], code: int, text: str):
    argv = [a.replace("{fx}", str(fx)) for a in argv]
    for k, v in env.items():
        monkeypatch.setenv(k, v.replace("{fx}", str(fx)))
    monkeypatch.chdir(tmp_path)
    before_fx, before_cwd = _tree(fx), _tree(tmp_path)
    r = CliRunner().invoke(app, argv)
    assert r.exception is None or isinstance(r.exception, SystemExit), f"escaped: {r.exception!r}\n{r.output}"
    assert r.exit_code == code, f"exit {r.exit_code}, expected {code}: {r.stderr}"
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{r.stderr}"
    assert text in lines[0], lines[0]
    assert "Traceback" not in r.stderr and lines[0].startswith("error:"), lines[0]
    if "--json" in argv:
        assert r.stdout == "", r.stdout
    assert _tree(fx) == before_fx and _tree(tmp_path) == before_cwd, "a file was left behind"


@pytest.mark.parametrize("argv,code,text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(fx, tmp_path, monkeypatch, argv, code, text):
    _check(fx, tmp_path, monkeypatch, argv, {}, code, text)


@pytest.mark.parametrize("argv,env,code,text", [c[1:] for c in ENV_CASES], ids=[c[0] for c in ENV_CASES])
def test_bad_environment(fx, tmp_path, monkeypatch, argv, env, code, text):
    _check(fx, tmp_path, monkeypatch, argv, env, code, text)


def test_catalogue_is_large_and_covers_every_command():
    import typer

    assert len(CASES) + len(ENV_CASES) >= 60
    commands = set(typer.main.get_command(app).commands)
    covered = {argv[0] for _, argv, *_ in CASES + ENV_CASES}
    assert not commands - covered, f"commands with no bad-input case: {sorted(commands - covered)}"
