"""--precision: bf16 where the CPU has it, refused naming the missing feature elsewhere (exit 2)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from hetforge.errors import UsageError
from hetforge.hardware.isa import cpu_flags, host_record, isa_flags, missing_feature
from hetforge.precision import resolve_precision

CPUINFO_X86 = "processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_bf16\n"


def test_flags_are_read_from_cpuinfo():
    flags = cpu_flags(CPUINFO_X86)
    assert {"avx2", "avx512_bf16"} <= flags
    assert isa_flags(flags) == ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16"]
    assert missing_feature("bf16", flags) is None
    assert missing_feature("bf16", {"avx2", "fma"}) == "AVX512_BF16 or AMX_BF16"
    assert missing_feature("fp32", set()) is None
    rec = host_record()
    assert rec["cpu"] and rec["cores"] >= 1 and isinstance(rec["isa"], list)


def test_resolve_precision():
    assert resolve_precision("fp32", flags=set()) is torch.float32
    assert resolve_precision("bf16", flags={"amx_bf16"}) is torch.bfloat16
    with pytest.raises(UsageError, match="AVX512_BF16 or AMX_BF16"):
        resolve_precision("bf16", flags={"avx2"})
    assert resolve_precision("bf16", allow_emulated=True, flags={"avx2"}) is torch.bfloat16
    with pytest.raises(UsageError, match="allowed: fp32, bf16"):
        resolve_precision("fp16")
    with pytest.raises(UsageError, match="--quantize w8"):
        resolve_precision("bf16", quantize="w8", flags={"avx512_bf16"})


def _run(*args, flags=None):
    env = dict(os.environ, HETFORGE_COMPILE_CACHE="0")
    if flags is not None:
        env["HETFORGE_CPU_FLAGS"] = flags
    return subprocess.run([sys.executable, "-m", "hetforge.cli.main", "run", "gpt2-tiny", "-p", "hello", "-n", "2",
                           "--json", *args], capture_output=True, text=True, env=env, timeout=600)


def test_cli_refuses_bf16_on_a_cpu_without_it():
    r = _run("--precision", "bf16", flags="sse4_2 avx avx2 fma")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "AVX512_BF16" in lines[0] and "Traceback" not in r.stderr
    assert r.stdout == ""


# bf16 runs only on CPUs with AVX512_BF16 or AMX_BF16; elsewhere `--precision bf16` is refused, which the test
# above checks instead.
@pytest.mark.skipif(missing_feature("bf16") is not None,
                    reason="this CPU has no AVX512_BF16/AMX_BF16: bf16 is refused here (tested above)")
def test_cli_runs_bf16_where_the_cpu_has_it():
    r = _run("--precision", "bf16", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["precision"] == "bf16" and len(doc["tokens"]) == 2


def test_cpu_name_carries_the_x86_family_model_and_stepping_of_the_first_processor():
    """A VM's generic model name ("AMD EPYC") is the same for two CPU generations; the record must tell them apart."""
    from hetforge.hardware.host import cpu_name

    def block(i: int, model: int) -> str:
        return (f"processor\t: {i}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {model}\n"
                f"model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: fpu avx512f\n\n")

    assert cpu_name(block(0, 17) + block(1, 99)) == "AMD EPYC (family 25, model 17, stepping 1)"
    assert cpu_name(CPUINFO_X86) == "Test CPU"  # no family/model/stepping lines (e.g. ARM): the name alone


def test_the_cpu_name_flags_and_kernel_build_choices_read_the_same_first_processor_block():
    """hardware (name, flags) and kernels (the prefetch distances by CPU family) read one block through
    hetforge.cpuinfo; the host's cached fields come back as a fresh dict each call."""
    from hetforge import cpuinfo
    from hetforge.hardware.host import cpu_name
    from hetforge.kernels import native

    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
            "stepping\t: 1\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\ncpu family\t: 26\n")
    f = cpuinfo.parse(text)
    assert f["cpu family"] == "25" and "processor" in f and f.get("flags", "").split()[-1] == "avx512_bf16"
    assert cpu_name(text) == "AMD EPYC (family 25, model 17, stepping 1)"
    assert cpu_flags(text) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert native.host_defines(f) == ["-DHF_PF_BYTES=0"]
    assert native.host_defines(cpuinfo.parse(text.replace(": 25", ": 26"))) == ["-DHF_PF_BYTES_F32=0"]  # Zen 5
    assert cpuinfo.parse("") == {}
    mine = cpuinfo.fields()
    mine["cpu family"] = "edited"
    assert cpuinfo.fields().get("cpu family") != "edited"
