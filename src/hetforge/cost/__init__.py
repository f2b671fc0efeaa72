"""The cost model: roofline time, DASI, thermal factor, memory pressure, energy and transfers.

Every number it returns is a *model prediction* (label it "modeled" wherever it is printed).
"""

from hetforge.cost.analyze import GraphCost, NodeCost, analyze, param_bytes
from hetforge.cost.context import CacheContext
from hetforge.cost.energy import dasi, stage_energy, stage_power
from hetforge.cost.instr import cost_mode, estimate_instr, estimate_program
from hetforge.cost.memory_pressure import cpq, cpq_penalty
from hetforge.cost.model import UNKNOWN_OPS, OpCost, cost_group, dtype_key, estimate, estimate_parts
from hetforge.cost.roofline import Roofline, arithmetic_intensity, roofline
from hetforge.cost.thermal import phi
from hetforge.cost.transfer import switch_cost_s, transfer_cost

__all__ = [
    "UNKNOWN_OPS",
    "CacheContext",
    "GraphCost",
    "NodeCost",
    "OpCost",
    "Roofline",
    "analyze",
    "arithmetic_intensity",
    "cost_group",
    "cpq",
    "cpq_penalty",
    "dasi",
    "dtype_key",
    "estimate",
    "estimate_instr",
    "estimate_parts",
    "estimate_program",
    "param_bytes",
    "phi",
    "roofline",
    "stage_energy",
    "stage_power",
    "transfer_cost",
    "switch_cost_s",
    "cost_mode",
]
