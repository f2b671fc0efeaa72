"""SwiGLU gate: silu(x W1) * (x W3) (GEMM + tail ops)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def forward(self, x):
        return torch.nn.functional.silu(self.w1(x)) * self.w3(x)


def get_inputs():
    return [torch.randn(64, 512)]


def get_init_inputs():
    return [512, 512]
