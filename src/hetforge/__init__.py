"""hetforge: a transparent compiler and runtime for LLMs on heterogeneous edge devices.

Data flows one way (see docs/architecture.md):
capture → passes → place → lower → schedule → plan memory → run, each stage one module with one
entry function returning a small result dataclass.
"""

from hetforge.errors import CaptureError, HetforgeError, UsageError
from hetforge.frontend import CapturedGraph, capture
from hetforge.verify import FidelityReport, verify

__all__ = [
    "CaptureError",
    "CapturedGraph",
    "FidelityReport",
    "HetforgeError",
    "UsageError",
    "capture",
    "verify",
]
__version__ = "0.1.0"
