"""Small builders the cost-model tests share: tensor metadata, a plain CPU device profile, an op call."""

import torch

from hetforge.hardware.profile import DeviceProfile
from hetforge.ops import OpCall, TensorMeta

F32 = torch.float32


def T(*shape, dtype=F32):
    return TensorMeta(tuple(shape), dtype)


def dev(**kw) -> DeviceProfile:
    """A CPU of 100 GFLOP/s fp32 and 20 GB/s; keywords replace any field."""
    base = dict(name="cpu", kind="cpu", peak_flops={"fp32": 1e11}, mem_bandwidth=2e10, mem_capacity=10**10,
                tdp_w=10.0, idle_w=1.0, dispatch_s=3e-6)
    base.update(kw)
    return DeviceProfile(**base)


def call(op, args, outs, **kwargs):
    return OpCall(op, tuple(args), kwargs, tuple(outs))
