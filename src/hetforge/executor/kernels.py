"""How one instruction writes into its planned arena slice: defined in :mod:`hetforge.ir.kernel_choice`
(below both the executor and the cost model); re-exported here for the executor's callers."""

from hetforge.ir.kernel_choice import COPY_LIKE, is_copy_like, out_variant

__all__ = ["COPY_LIKE", "is_copy_like", "out_variant"]
