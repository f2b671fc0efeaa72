"""Programming models behind one interface: what a candidate must look like, and whether this host can run it.

Every platform answers ``available()`` with (yes/no, reason) and gives the generation agent its rules.
C++/OpenMP runs on any host with a C++ compiler; Triton needs the ``triton`` package (on a CUDA host it
compiles GPU kernels; elsewhere its interpreter, ``TRITON_INTERPRET=1``, gives functional checks, and timings
of interpreted code are not kernel timings); CUDA C++ needs a CUDA device; SYCL and Metal are slots that say
so cleanly. ``device()`` says where a platform's candidates run: CUDA and GPU Triton get their inputs,
parameters and reference on the GPU.
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass, field

from hetforge.errors import UsageError

# ATen ops ModelNew.forward may dispatch itself: allocation, views, layout — never the core computation.
ALLOWED_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros",
    "fill_", "zero_", "view", "_unsafe_view", "reshape", "contiguous", "clone", "t", "transpose", "permute",
    "expand", "unsqueeze", "squeeze", "select", "slice", "as_strided", "detach", "alias", "lift_fresh",
    "copy_", "resize_", "sym_size", "sym_stride", "flatten", "unflatten", "split", "narrow", "_to_copy", "to",
    "is_same_size", "result_type", "set_", "unbind",
})


@dataclass(frozen=True)
class Platform:
    name: str
    language: str
    rules: str
    timed: bool = True
    env: dict[str, str] = field(default_factory=dict)

    def available(self) -> tuple[bool, str]:
        raise NotImplementedError

    def device(self) -> str:
        """Where the candidate's inputs, parameters and outputs live ("cpu" or "cuda"); the reference runs there too."""
        return "cpu"

    def run_env(self) -> dict[str, str]:
        """Environment of the worker processes for this platform on this host."""
        return dict(self.env)


class CppPlatform(Platform):
    def available(self) -> tuple[bool, str]:
        cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
        return (True, f"C++ compiler {cxx}") if cxx else (False, "no C++ compiler on PATH (c++, g++ or clang++)")


class TritonPlatform(Platform):
    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("triton") is None:
            return False, "not available on this host: the triton package is not installed"
        import torch

        if torch.cuda.is_available():
            return True, "triton on the GPU (timed)"
        return True, "triton interpreter (TRITON_INTERPRET=1): functional checks only, timings are not kernel timings"

    def device(self) -> str:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def run_env(self) -> dict[str, str]:
        """The interpreter only where there is no GPU: on a GPU host Triton compiles real kernels."""
        return dict(self.env) if self.device() == "cpu" else {}


class CudaPlatform(Platform):
    def available(self) -> tuple[bool, str]:
        import torch

        if not torch.cuda.is_available():
            return False, "not available on this host: no CUDA device"
        if shutil.which("nvcc") is None:
            return False, "not available on this host: no nvcc on PATH"
        return True, torch.cuda.get_device_name(0)

    def device(self) -> str:
        return "cuda"


class SlotPlatform(Platform):
    def available(self) -> tuple[bool, str]:
        return False, f"not available on this host: no {self.language} toolchain or device is supported here yet"


_COMMON = ("Write a Python file that defines `class ModelNew(torch.nn.Module)` with the same constructor "
           "arguments and forward signature as `Model`, keeping parameters under the same attribute names. "
           "Inputs and outputs stay float32 unless the reference uses another dtype: no float16/bfloat16 or "
           "other precision downcast. ModelNew.forward may only allocate outputs and reshape/view tensors with "
           "torch; the computation itself must be in your kernel (no torch math ops, no calls into the reference). "
           "Do not cache outputs across calls, do not modify the inputs, write every element of every output, "
           "and do not touch timers, streams or the harness. Reply with one ```python block.")

PLATFORMS: dict[str, Platform] = {
    "cpp": CppPlatform("cpp", "C++/OpenMP", _COMMON + " Build the kernel with "
                       "`torch.utils.cpp_extension.load_inline` (C++ with OpenMP pragmas; `-O3 -fopenmp`)."),
    "triton": TritonPlatform("triton", "Triton", _COMMON + " Write the kernel with `@triton.jit` and launch it "
                             "from forward.", timed=False, env={"TRITON_INTERPRET": "1"}),
    "cuda": CudaPlatform("cuda", "CUDA C++", _COMMON + " Build the kernel with "
                         "`torch.utils.cpp_extension.load_inline(cuda_sources=...)`; inputs are CUDA tensors."),
    "sycl": SlotPlatform("sycl", "SYCL", _COMMON),
    "metal": SlotPlatform("metal", "Metal", _COMMON),
}


def get(name: str) -> Platform:
    if name not in PLATFORMS:
        raise UsageError(f"unknown platform '{name}'; choose from {', '.join(PLATFORMS)}")
    return PLATFORMS[name]
