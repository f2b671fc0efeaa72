"""RMSNorm (LLaMA style) with a weight (norm)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def get_inputs():
    return [torch.randn(512, 1024)]


def get_init_inputs():
    return [1024]
