"""MoE combine with a token-to-slot gather: out[t] = sum_k w[t,k] y[idx[t,k]] (MoE combine)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        pass

    def forward(self, y, idx, w):
        return (y[idx] * w.unsqueeze(-1)).sum(dim=1)


def get_inputs():
    return [torch.randn(1024, 512), torch.randint(0, 1024, (256, 2)), torch.softmax(torch.randn(256, 2), dim=-1)]


def get_init_inputs():
    return []
