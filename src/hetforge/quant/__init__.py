"""Weight quantization: a graph pass that swaps float linears for real int8 / int4 CPU kernels.

``quantize_graph(gm, scheme, group_size, skip) -> QuantizeResult(gm, report)``; schemes ``w8`` (int8
weights, per channel), ``w4`` (int4 weights, group-wise), ``w8a8`` (int8 weights + dynamic int8
activations) and ``none``. See docs/arch/quant.md.
"""

from hetforge.quant.report import QuantReport, TensorEntry
from hetforge.quant.rewrite import QuantizeResult, already_quantized, check_options, matches, quantize_graph
from hetforge.quant.schemes import SCHEMES, QuantizedWeight, quantize_weight

__all__ = [
    "SCHEMES",
    "QuantReport",
    "QuantizeResult",
    "QuantizedWeight",
    "TensorEntry",
    "already_quantized",
    "check_options",
    "matches",
    "quantize_graph",
    "quantize_weight",
]
