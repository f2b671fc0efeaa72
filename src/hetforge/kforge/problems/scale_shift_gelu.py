"""x * 0.5 + 1 then GELU (elementwise fusion)."""

import torch
import torch.nn as nn

SHAPE = (512, 1024)


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.nn.functional.gelu(x * 0.5 + 1.0)


def get_inputs():
    return [torch.randn(SHAPE)]


def get_init_inputs():
    return []
