"""LayerNorm over the last dim with affine weights (norm)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)

    def forward(self, x):
        return self.ln(x)


def get_inputs():
    return [torch.randn(512, 1024)]


def get_init_inputs():
    return [1024]
