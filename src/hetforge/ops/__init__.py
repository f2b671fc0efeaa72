"""Operator registry: every op hetforge knows how to cost, place or introduce lives here.

Importing this package registers hetforge's own fused ops (``hetforge::*`` custom ops) and the ATen
cost formulas, so ``lookup(...)`` sees all of them.
"""

from hetforge.ops import (
    aten_costs,  # noqa: F401  (registers ATen cost formulas)
    fused,  # noqa: F401  (registers the hetforge:: fused ops)
    moe,  # noqa: F401  (registers hetforge::moe)
    moe_groups,  # noqa: F401  (registers hetforge::moe_route / moe_gather / moe_group / moe_scatter)
    quant,  # noqa: F401  (registers the hetforge:: quantized linears)
)
from hetforge.ops.registry import (
    REGISTRY,
    OpCall,
    OpInfo,
    TensorMeta,
    lookup,
    op_call_from_node,
    register_aten,
    register_op,
)

__all__ = [
    "REGISTRY",
    "OpCall",
    "OpInfo",
    "TensorMeta",
    "lookup",
    "op_call_from_node",
    "register_aten",
    "register_op",
]
