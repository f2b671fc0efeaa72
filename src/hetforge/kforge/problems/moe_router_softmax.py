"""Router: linear to expert logits then softmax (MoE combine)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, hidden, experts):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)

    def forward(self, x):
        return torch.softmax(self.gate(x), dim=-1)


def get_inputs():
    return [torch.randn(256, 512)]


def get_init_inputs():
    return [512, 64]
