"""What the quantization pass did, tensor by tensor: scheme, bytes before/after, error, or why not."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class TensorEntry:
    """One weight tensor a linear reads."""

    path: str  # module path of the layer (``model.layers.0.mlp.up_proj``)
    target: str  # the get_attr target in the graph
    ops: list[str]  # the ops that read it (``aten.linear.default``, ...)
    shape: tuple[int, ...]  # [out, in]
    scheme: str  # w8 / w4 / w8a8, or "fp32" when left in float
    bytes_before: int
    bytes_after: int  # what this weight occupies in the new graph (a float copy kept for other users counts)
    rel_error: float | None = None  # ‖W − deq(Q)‖_F / ‖W‖_F
    group_size: int | None = None
    reason: str = ""  # why skipped, or a note (e.g. float copy kept for an embedding)

    @property
    def quantized(self) -> bool:
        return self.scheme != "fp32"


@dataclass
class QuantReport:
    """The per-tensor report plus totals over every constant the graph holds."""

    scheme: str
    group_size: int | None
    skip: tuple[str, ...]
    entries: list[TensorEntry] = field(default_factory=list)
    unmatched_skip: list[str] = field(default_factory=list)  # patterns that matched no layer
    already_quantized: str = ""  # non-empty: the graph was left alone, and why
    graph_bytes_before: int = 0  # all get_attr tensors (weights, biases, buffers)
    graph_bytes_after: int = 0
    rewritten_nodes: int = 0

    @property
    def quantized(self) -> list[TensorEntry]:
        return [e for e in self.entries if e.quantized]

    @property
    def skipped(self) -> list[TensorEntry]:
        return [e for e in self.entries if not e.quantized]

    @property
    def weight_bytes_before(self) -> int:
        return sum(e.bytes_before for e in self.entries)

    @property
    def weight_bytes_after(self) -> int:
        return sum(e.bytes_after for e in self.entries)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["summary"] = {
            "quantized": len(self.quantized), "skipped": len(self.skipped),
            "linear_weight_bytes_before": self.weight_bytes_before,
            "linear_weight_bytes_after": self.weight_bytes_after,
            "graph_bytes_before": self.graph_bytes_before, "graph_bytes_after": self.graph_bytes_after,
            "compression": (self.graph_bytes_before / self.graph_bytes_after) if self.graph_bytes_after else None,
        }
        return d

    def summary_line(self) -> str:
        if self.already_quantized:
            return f"left alone: {self.already_quantized}"
        mb = 1e6
        return (f"{self.scheme}: {len(self.quantized)} weights quantized, {len(self.skipped)} kept in float; "
                f"graph constants {self.graph_bytes_before / mb:.2f} MB → {self.graph_bytes_after / mb:.2f} MB")
