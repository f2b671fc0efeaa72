"""Causal scaled dot-product attention (attention piece)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        pass

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def get_inputs():
    return [torch.randn(1, 8, 128, 64), torch.randn(1, 8, 128, 64), torch.randn(1, 8, 128, 64)]


def get_init_inputs():
    return []
