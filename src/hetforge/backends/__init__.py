"""Backends: one interface to compile a partition and run it with a measured time.

``torch-cpu``, ``torch-cuda``, ``openvino:<plugin>`` run for real; ``emulated:<stand-in>`` runs a device the
host lacks on a real stand-in while enforcing that device's constraints. :func:`resolve` binds every device
of an SoC profile to one (defaults for this host, or ``--backend DEVICE=SPEC`` overrides).
"""

from hetforge.backends.base import (
    PEERS_HINT,
    Backend,
    BackendUnavailable,
    CompiledPartition,
    CompileReport,
    ConstraintViolation,
)
from hetforge.backends.mapping import BACKEND_SPECS, Binding, default_spec, make_backend, parse_overrides, resolve

__all__ = [
    "BACKEND_SPECS", "PEERS_HINT", "Backend", "BackendUnavailable", "Binding", "CompileReport", "CompiledPartition",
    "ConstraintViolation", "default_spec", "make_backend", "parse_overrides", "resolve",
]
