"""LeakyReLU, slope 0.01 (single op)."""

import torch
import torch.nn as nn

SHAPE = (512, 1024)


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.nn.functional.leaky_relu(x, 0.01)


def get_inputs():
    return [torch.randn(SHAPE)]


def get_init_inputs():
    return []
