"""``--precision``: the dtype a model's weights and activations run in, checked against the host CPU.

``fp32`` runs everywhere. ``bf16`` needs a CPU that computes in bfloat16 (x86: AVX512-BF16 or AMX-BF16; ARM:
the BF16 extension), read from /proc/cpuinfo (:mod:`hetforge.hardware.isa`); without one, oneDNN and ATen
convert every product in software, which is slower than fp32, so it is refused naming the missing feature
(exit 2) unless ``--allow-emulated`` asks for it anyway.
"""

from __future__ import annotations

import torch

from hetforge.errors import UsageError

PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_precision(precision: str, allow_emulated: bool = False, quantize: str = "none",
                      flags: set[str] | None = None) -> torch.dtype:
    """The torch dtype for ``precision``; a UsageError for an unknown name, a CPU without the instructions
    (unless ``allow_emulated``) or a combination with weight quantization."""
    from hetforge.hardware.host import cpu_name
    from hetforge.hardware.isa import missing_feature

    if precision not in PRECISIONS:
        raise UsageError(f"unknown --precision '{precision}'; allowed: {', '.join(PRECISIONS)}")
    if precision != "fp32" and quantize != "none":
        raise UsageError(f"--precision {precision} with --quantize {quantize}: quantized linears run from fp32 "
                         "activations; use one of the two")
    missing = missing_feature(precision, flags)
    if missing is not None and not allow_emulated:
        raise UsageError(f"--precision {precision} needs a CPU with {missing}, which this CPU ({cpu_name()}) lacks; "
                         f"use --precision fp32, or --allow-emulated to run {precision} converted in software (slower)")
    return PRECISIONS[precision]
