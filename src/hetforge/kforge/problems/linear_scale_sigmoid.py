"""Linear, scale by 2, sigmoid (GEMM + tail ops)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        y = self.linear(x)
        return torch.sigmoid(y * 2.0)


def get_inputs():
    return [torch.randn(128, 512)]


def get_init_inputs():
    return [512, 512]
