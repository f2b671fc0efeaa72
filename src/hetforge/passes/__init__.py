"""The middle-end: seven graph → graph passes over the captured ATen FX graph, and the pipeline that runs them.

``optimize(gm, example_inputs=None, passes=None, verify_each=False, dump_dir=None) -> OptimizeResult`` runs
cleanup, constant folding, CSE, MoE fusion, attention fusion, operator fusion and norm fusion
(:data:`PASS_NAMES`) on a copy of ``gm``. Each pass is also callable alone and returns a :class:`PassResult`.
"""

from hetforge.passes.attention import fuse_attention
from hetforge.passes.cleanup import cleanup
from hetforge.passes.common import FUSED_OPS, NearMiss, PassResult, Rewrite, copy_gm, fused_counts
from hetforge.passes.constfold import constant_fold
from hetforge.passes.cse import cse
from hetforge.passes.manager import PASS_NAMES, PASSES, OptimizeResult, optimize, resolve_passes, unknown_ops
from hetforge.passes.moe import fuse_moe
from hetforge.passes.normfusion import fuse_norms
from hetforge.passes.opfusion import fuse_operators

__all__ = [
    "FUSED_OPS",
    "PASSES",
    "PASS_NAMES",
    "NearMiss",
    "OptimizeResult",
    "PassResult",
    "Rewrite",
    "cleanup",
    "constant_fold",
    "copy_gm",
    "cse",
    "fuse_attention",
    "fuse_moe",
    "fuse_norms",
    "fuse_operators",
    "fused_counts",
    "optimize",
    "resolve_passes",
    "unknown_ops",
]
