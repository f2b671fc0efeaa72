"""Candidate files for the KForge tests: one honest relu kernel and cheating variants of it."""

KERNEL = '''
import ctypes
import time

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

SRC = r"""
#include <cstdint>
extern "C" void relu(const float* a, float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) b[i] = BODY;
}
"""
_LIB = ctypes.CDLL(load_inline(NAME, cpp_sources=SRC, extra_cflags=["-O2"], is_python_module=False,
                               no_implicit_headers=True))


def _call(x, y):
    _LIB.relu(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(x.numel()))


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = None

    def forward(self, x):
        FORWARD
'''


def kernel(name: str, body: str = "a[i] > 0.f ? a[i] : 0.f",
           forward: str = "y = torch.empty_like(x)\n        _call(x, y)\n        return y") -> str:
    """A relu candidate built with load_inline; ``body`` is the C expression, ``forward`` ModelNew.forward's body."""
    return KERNEL.replace("NAME", repr(name)).replace("BODY", body).replace("FORWARD", forward)


HONEST = kernel("kft_honest")
TORCH_DOES_WORK = kernel("kft_torchwork", forward="return torch.relu(x)")
CACHES = kernel("kft_cache", forward=(
    "if self.cache is None:\n            self.cache = torch.empty_like(x)\n            _call(x, self.cache)\n"
    "        return self.cache"))
MUTATES = kernel("kft_mutate", forward="_call(x, x)\n        return x.clone()")
# Reads the output buffer before writing it: right when fresh memory is zero, wrong when it is not.
UNINIT = kernel("kft_uninit", body="b[i] * 0.f + (a[i] > 0.f ? a[i] : 0.f)")
TIMER = kernel("kft_timer", forward=(
    "setattr(time, 'perf_counter_ns', lambda: 0)\n        y = torch.empty_like(x)\n        _call(x, y)\n"
    "        return y"))
DOWNCAST = kernel("kft_half", forward="return torch.relu(x.to(torch.float16)).to(torch.float32)")
CALLS_REFERENCE = HONEST.replace("class ModelNew", "from relu import Model\n\n\nclass ModelNew").replace(
    "y = torch.empty_like(x)\n        _call(x, y)\n        return y", "return Model()(x)")
SEGFAULT = kernel("kft_segv", forward="ctypes.string_at(0)\n        return x")
HANGS = kernel("kft_hang", forward="while True:\n            pass")


CUDA_RELU = '''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CPP = "torch::Tensor relu(torch::Tensor x);"
CU = r"""
#include <torch/extension.h>
__global__ void relu_k(const float* a, float* b, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) b[i] = a[i] > 0.f ? a[i] : 0.f;
}
torch::Tensor relu(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda(), "relu: input must be a CUDA tensor");
  auto y = torch::empty_like(x);
  int64_t n = x.numel();
  relu_k<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
  return y;
}
"""
_M = load_inline("kf_cuda_relu", cpp_sources=CPP, cuda_sources=CU, functions=["relu"])


class ModelNew(nn.Module):
    def forward(self, x):
        return _M.relu(x.contiguous())
'''

TRITON_RELU = '''
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def _relu(a, b, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(a + i, mask=m)
    tl.store(b + i, tl.maximum(x, 0.0), mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        n = x.numel()
        _relu[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)
        return y
'''
