"""Executor: generated straight-line Python over preallocated per-device arenas."""

from hetforge.executor.runtime import MODES, ExecStats, Executable, InstrTime, ProfileReport, default_device_map

__all__ = ["MODES", "ExecStats", "Executable", "InstrTime", "ProfileReport", "default_device_map"]
