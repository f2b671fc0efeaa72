"""LogSumExp over the last dim (reduction)."""

import torch
import torch.nn as nn

SHAPE = (512, 1024)


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.logsumexp(x, dim=-1)


def get_inputs():
    return [torch.randn(SHAPE)]


def get_init_inputs():
    return []
