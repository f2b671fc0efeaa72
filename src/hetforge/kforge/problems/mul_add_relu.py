"""x * y + 1 then ReLU (elementwise fusion)."""

import torch
import torch.nn as nn

SHAPE = (512, 1024)


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x, y):
        return torch.relu(x * y + 1.0)


def get_inputs():
    return [torch.randn(SHAPE), torch.randn(SHAPE)]


def get_init_inputs():
    return []
