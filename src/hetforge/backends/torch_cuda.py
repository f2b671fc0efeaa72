"""``torch-cuda``: run a partition with PyTorch on a CUDA device.

Weights are copied to the device once, at compile time, into the partition's own module (the source model
keeps its CPU weights). Inputs arrive through the runner's transfers (``to_memory``) and outputs stay on the
device until a consumer in another memory copies them. ``torch.cuda.synchronize`` brackets each call so the
measured time is the device's, not the launch queue's. Graph constants built on the CPU (``arange(...,
device=cpu)``, ``to(device=cpu)``) are retargeted to the CUDA device.
"""

from __future__ import annotations

import time

import torch
from torch import fx

from hetforge.backends.base import Backend, BackendUnavailable, CompiledPartition, CompileReport
from hetforge.backends.partition import Partition, fetch_attr
from hetforge.backends.torch_cpu import TorchCompiled


class TorchCudaBackend(Backend):
    """PyTorch on ``cuda:index``."""

    def __init__(self, index: int = 0):
        self.index = index
        self.name = "torch-cuda" if index == 0 else f"torch-cuda:{index}"
        self.memory = f"cuda:{index}"

    def check_available(self) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                f"backend '{self.name}' needs a CUDA GPU, but this PyTorch ({torch.__version__}) sees none "
                f"(torch.cuda.is_available() is False); choose another backend for that device, e.g. "
                f"--backend gpu=emulated:torch-cpu"
            )
        if self.index >= torch.cuda.device_count():
            raise BackendUnavailable(f"backend '{self.name}': only {torch.cuda.device_count()} CUDA device(s) present")

    def to_memory(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.memory, non_blocking=False)

    def compile(self, part: Partition) -> CompiledPartition:
        self.check_available()
        dev = torch.device(self.memory)
        t0 = time.perf_counter()
        weights = {w: fetch_attr(part.gm, w).detach().to(dev) for w in part.weights}
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        def retarget(a):
            return dev if isinstance(a, torch.device) and a.type == "cpu" else a

        for n in part.gm.graph.nodes:
            new = graph.node_copy(n, lambda a: env[a])
            new.args = fx.node.map_aggregate(new.args, retarget)
            new.kwargs = fx.node.map_aggregate(new.kwargs, retarget)
            env[n] = new
        gm = fx.GraphModule(weights, graph, class_name=f"CudaPartition{part.index}")
        torch.cuda.synchronize(dev)
        name = torch.cuda.get_device_name(dev)
        report = CompileReport(self.name, f"{self.memory} ({name})", time.perf_counter() - t0,
                               [f"{len(weights)} weights copied to {self.memory} once"])
        return TorchCompiled(self.name, gm, report, memory=self.memory, sync=lambda: torch.cuda.synchronize(dev))
