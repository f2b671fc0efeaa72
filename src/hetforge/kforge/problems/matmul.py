"""Plain matrix product A @ B (single op)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        pass

    def forward(self, a, b):
        return a @ b


def get_inputs():
    return [torch.randn(128, 512), torch.randn(512, 256)]


def get_init_inputs():
    return []
