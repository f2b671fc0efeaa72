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
