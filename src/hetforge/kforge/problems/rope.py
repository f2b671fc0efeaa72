"""Rotary position embedding applied to q (rotate-half form) (attention piece)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        pass

    def forward(self, x, cos, sin):
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin


def get_inputs():
    return [torch.randn(8, 128, 64), torch.randn(128, 64), torch.randn(128, 64)]


def get_init_inputs():
    return []
